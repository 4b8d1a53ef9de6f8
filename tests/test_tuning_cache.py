"""The tuning cache: keys, the JSON file, and plans for calls (exact, nearest M, never wrong)."""
from __future__ import annotations

import json
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flashoverlap_core as fo
from flashoverlap_core import registry
from flashoverlap_core.backend import OverlapSpec
from flashoverlap_core.tuning import cache as tc

REFERENCE = registry.get("reference")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "tuning.json"
    monkeypatch.setenv(tc.ENV_CACHE, str(path))
    return tc.TuningCache()


def spec(m=1024, n=256, k=64, op="allreduce", world=1, dtype="float32", send=None):
    return OverlapSpec(m, n, k, op, world, dtype, "cpu", "col", send)


def store(cache, plan, transfer="", **fields):
    ctx = tc.context_for(REFERENCE, "cpu")
    key = tc.plan_key(ctx, dtype=plan.dtype, m=plan.m, n=plan.n, k=plan.k, op=plan.op,
                      world_size=plan.world_size, transfer=transfer)
    cache.put("plans", {**key, **fields}, {"plan": plan.to_dict()})
    return key


def test_cache_path_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(tc.ENV_CACHE, str(tmp_path / "x.json"))
    assert tc.cache_path() == tmp_path / "x.json"
    monkeypatch.delenv(tc.ENV_CACHE)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tc.cache_path() == tmp_path / "xdg" / "flashoverlap" / "tuning.json"


def test_plan_key_names_everything_a_tuned_plan_depends_on():
    ctx = tc.context_for(REFERENCE, "cpu")
    key = tc.plan_key(ctx, dtype="bfloat16", m=1, n=2, k=3, op="allreduce", world_size=8)
    for field in ("device", "backend", "collective", "versions", "dtype", "M", "N", "K", "op",
                  "world_size", "transfer"):
        assert field in key
    assert key["backend"] == "reference" and key["collective"] == "none"
    assert "torch=" in key["versions"] and key["device"]
    plan = fo.plan(256, 128, 64, backend="reference", dtype="float32")
    kernel = tc.kernel_key(ctx, plan)
    assert (kernel["tile"], kernel["wave_size"], kernel["block_rows"]) == ([128, 128], 4, [256])


def test_entries_round_trip_through_json_and_replace_their_key(cache):
    plan = fo.plan(1024, 256, 64, backend="reference", dtype="float32", group_sizes=[4, 12])
    key = store(cache, plan)
    assert fo.Plan.from_dict(cache.get("plans", key)["plan"]) == plan
    again = fo.plan(1024, 256, 64, backend="reference", dtype="float32", group_sizes=[8, 8])
    store(cache, again)
    assert len(cache.entries("plans")) == 1
    assert fo.Plan.from_dict(cache.get("plans", key)["plan"]).group_sizes == (8, 8)
    doc = json.loads(cache.path.read_text())
    assert doc["format"] == tc.FORMAT and set(tc.SECTIONS) <= set(doc)
    with pytest.raises(ValueError, match="section"):
        cache.put("nope", {}, {})


def test_lookup_finds_the_exact_shape(cache):
    plan = fo.plan(1024, 256, 64, backend="reference", dtype="float32", group_sizes=[4, 12])
    store(cache, plan)
    assert tc.lookup_plan(spec(), REFERENCE) == plan
    assert tc.lookup_plan(spec(n=128), REFERENCE) is None  # other N
    assert tc.lookup_plan(spec(dtype="float16"), REFERENCE) is None
    assert tc.lookup_plan(spec(op="custom"), REFERENCE) is None
    assert tc.lookup_plan(spec(world=2), REFERENCE) is None


def test_lookup_ignores_other_devices_and_library_versions(cache):
    plan = fo.plan(1024, 256, 64, backend="reference", dtype="float32", group_sizes=[4, 12])
    store(cache, plan, device="another device")
    store(cache, plan, versions="nccl=0.0")
    assert tc.lookup_plan(spec(), REFERENCE) is None


def test_custom_ops_are_looked_up_by_transfer(cache):
    plan = fo.plan(1024, 256, 64, op="custom", backend="reference", dtype="float32",
                   group_sizes=[8, 8])
    store(cache, plan, transfer="HostOffload")
    assert tc.lookup_plan(spec(op="custom"), REFERENCE, transfer="HostOffload") == plan
    assert tc.lookup_plan(spec(op="custom"), REFERENCE) is None


def test_nearest_m_bucket_gives_a_plan_that_fits_the_call(cache):
    store(cache, fo.plan(1024, 256, 64, backend="reference", dtype="float32",
                         group_sizes=[4, 4, 8]))  # 4 waves: ends after waves 1, 2 (of 4)
    store(cache, fo.plan(4096, 256, 64, backend="reference", dtype="float32",
                         group_sizes=[64]))
    got = tc.lookup_plan(spec(m=2000), REFERENCE)  # nearest is 1024 (ratio 1.95 < 2.05)
    assert got is not None and got.m == 2000 and got.num_tiles == 32
    assert got.group_sizes == (8, 8, 16)  # the same fractions of 8 waves
    assert not got.mismatches(m=2000, n=256, k=64, op="allreduce", world_size=1,
                              dtype="float32")
    assert tc.lookup_plan(spec(m=3000), REFERENCE).group_sizes == (48,)  # nearest: 4096
    assert tc.lookup_plan(spec(m=256), REFERENCE) is None  # 4x away: use the heuristic
    out = fo.overlap(*_inputs(2000, 256, 64), "allreduce", plan=got)
    assert out.shape == (2000, 256)


def test_a_sequential_tuned_plan_stays_sequential_at_the_nearest_m(cache):
    """The tuner stores the plain path where overlapping does not pay; a call of a nearby M
    must not get an overlapped plan carried from it."""
    import dataclasses

    tuned = fo.plan(1024, 256, 64, backend="reference", dtype="float32")
    store(cache, dataclasses.replace(tuned, strategy="sequential"))
    assert tc.lookup_plan(spec(m=1024), REFERENCE).strategy == "sequential"
    carried = tc.lookup_plan(spec(m=1500), REFERENCE)
    assert carried is not None and carried.m == 1500 and carried.strategy == "sequential"


def _inputs(m, n, k):
    import torch
    gen = torch.Generator().manual_seed(0)
    return torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen).t()


@settings(max_examples=60, deadline=None)
@given(world=st.sampled_from([2, 3, 4]), tuned_m=st.integers(1, 40), call_m=st.integers(1, 40),
       n=st.integers(1, 300), cuts=st.lists(st.integers(1, 30), max_size=5),
       op=st.sampled_from(["allreduce", "reduce_scatter", "all_to_all"]))
def test_carried_plans_always_fit_or_are_refused(world, tuned_m, call_m, n, cuts, op):
    """Whatever the tuned grouping and the call's M, a plan from the cache fits the call
    (validated, balanced reduce_scatter groups) or there is none."""
    tuned_m, call_m = tuned_m * world * 8, call_m * world * 8

    def splits(m):
        return [m // world] * world if op == "all_to_all" else None

    base = fo.plan(tuned_m, n, 16, op=op, world_size=world, backend="reference",
                   dtype="float32", send_splits=splits(tuned_m), tile=(16, 32))
    unit = world if op == "reduce_scatter" else 1
    ends = sorted({min(base.num_tiles, c * base.wave_size) // unit * unit for c in cuts}
                  - {0, base.num_tiles}) + [base.num_tiles]
    sizes = tuple(b - a for a, b in zip([0] + ends, ends))
    tuned = fo.plan(tuned_m, n, 16, op=op, world_size=world, backend="reference",
                    dtype="float32", send_splits=splits(tuned_m), tile=(16, 32),
                    group_sizes=sizes)
    call = spec(m=call_m, n=n, k=16, op=op, world=world,
                send=tuple(splits(call_m)) if splits(call_m) else None)
    got = tc.rebuild_plan(tuned, call, REFERENCE)
    if got is not None:
        assert not got.mismatches(m=call_m, n=n, k=16, op=op, world_size=world,
                                  dtype="float32", send_splits=call.send_splits)
        assert sum(got.group_sizes) == got.num_tiles
        assert got.num_groups <= tuned.num_groups
        assert all(s % unit == 0 for s in got.group_sizes)


def test_a_broken_cache_is_ignored_with_a_warning(cache, caplog):
    cache.path.parent.mkdir(parents=True, exist_ok=True)
    cache.path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="flashoverlap"):
        assert tc.lookup_plan(spec(), REFERENCE) is None
    assert "ignoring the tuning cache" in caplog.text
    cache.path.write_text(json.dumps({"format": tc.FORMAT, "plans": [
        {"key": {**tc.plan_key(tc.context_for(REFERENCE, "cpu"), dtype="float32", m=1024,
                               n=256, k=64, op="allreduce", world_size=1)},
         "value": {"plan": {"format": "garbage"}}}]}))
    assert tc.lookup_plan(spec(), REFERENCE) is None


def test_a_missing_cache_means_no_tuned_plan(cache):
    assert not cache.path.exists()
    assert tc.lookup_plan(spec(), REFERENCE) is None


def test_tuned_plans_can_be_turned_off(cache, monkeypatch):
    plan = fo.plan(1024, 256, 64, backend="reference", dtype="float32", group_sizes=[4, 12])
    store(cache, plan)
    monkeypatch.setenv(tc.ENV_CACHE, "off")
    assert tc.cache_path() is None
    assert tc.lookup_plan(spec(), REFERENCE) is None
    tc.TuningCache().put("plans", {"a": 1}, {})  # nothing is written anywhere
