"""The call path: a key is prepared once and later calls only launch; ranks agree on the plan;
concurrent calls share nothing; the sequential strategy; no deprecation warnings."""
from __future__ import annotations

import threading
import warnings

import pytest
import torch

import flashoverlap_core as fo
from flashoverlap_core import api, planning, registry
from flashoverlap_core.reference import ReferenceBackend
from flashoverlap_core.tools.ranks import RankPool
from test_torch_ops_ranks import ranks as shared_ranks

pytestmark = pytest.mark.timeout(300)


def _ref(a, b):
    return (a.double() @ b.double())


@pytest.fixture
def fresh(monkeypatch):
    """A process as if new: no prepared calls, entry points and probes forgotten."""
    api.forget_prepared()
    registry.refresh()
    yield
    api.forget_prepared()
    registry.refresh()


def test_entry_points_and_probes_are_read_once(fresh, monkeypatch):
    reads, probes = [], []
    real_entry_points = registry.entry_points
    monkeypatch.setattr(registry, "entry_points", lambda **kw: reads.append(kw) or real_entry_points(**kw))
    real_probe = ReferenceBackend.probe
    monkeypatch.setattr(ReferenceBackend, "probe", lambda self: probes.append(1) or real_probe(self))
    for m in (5, 6, 5, 7, 5):  # three keys, repeated
        a, b = torch.randn(m, 9), torch.randn(9, 11)
        out = fo.overlap(a, b)
        assert torch.allclose(out.double(), _ref(a, b), atol=1e-4)
    assert len(reads) == 1, "entry points must be read once per process"
    assert len(probes) <= 1, "a backend must be probed once per process"
    before = len(probes)
    fo.backends()  # the listing probes afresh
    assert len(probes) == before + 1


def test_a_prepared_key_skips_selection_and_planning(fresh, monkeypatch):
    a, b = torch.randn(33, 17), torch.randn(17, 29)
    first = fo.overlap(a, b)

    def refuse(*args, **kwargs):
        raise AssertionError("a prepared key must not select a backend or make a plan again")

    monkeypatch.setattr(registry, "select", refuse)
    monkeypatch.setattr(planning, "make_plan", refuse)
    a2 = torch.randn(33, 17)  # fresh inputs, same key
    out = torch.full((33, 29), float("nan"))
    assert fo.overlap(a2, b, out=out) is out
    assert torch.allclose(out.double(), _ref(a2, b), atol=1e-4)
    assert torch.allclose(first.double(), _ref(a, b), atol=1e-4)
    with pytest.raises(AssertionError):  # a new key goes through selection again
        fo.overlap(torch.randn(34, 17), b)


def test_a_prepared_key_still_checks_out(fresh):
    a, b = torch.randn(8, 4), torch.randn(4, 6)
    fo.overlap(a, b)
    with pytest.raises(ValueError, match="shape"):
        fo.overlap(a, b, out=torch.empty(9, 6))
    with pytest.raises(ValueError):
        fo.overlap(a, b, out=torch.empty(6, 8).t())  # not contiguous
    with pytest.raises(ValueError):
        fo.overlap(a, b, out=torch.empty(8, 6, dtype=torch.float64))


def test_changed_backend_env_applies_to_new_keys(fresh, monkeypatch):
    monkeypatch.setenv("FLASHOVERLAP_BACKEND", "no-such-backend")
    with pytest.raises(fo.BackendError, match="no-such-backend"):
        fo.overlap(torch.randn(3, 3), torch.randn(3, 3))


def test_concurrent_threads_share_nothing(fresh):
    b = torch.randn(40, 24)
    errors = []

    def worker(seed):
        g = torch.Generator().manual_seed(seed)
        try:
            for _ in range(50):
                a = torch.randn(64, 40, generator=g)
                out = fo.overlap(a, b, op=lambda region, index: None)
                assert torch.allclose(out.double(), _ref(a, b), atol=1e-4)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[0]


@pytest.mark.parametrize("op", ["allreduce", "reduce_scatter", "all_to_all", "allgather"])
def test_sequential_strategy_world1(fresh, op):
    plan = fo.plan(12, 10, 6, op=op, dtype=torch.float32, backend="reference")
    plan = fo.Plan.from_dict({**plan.to_dict(), "strategy": "sequential"})
    a, b = torch.randn(12, 6), torch.randn(6, 10)
    out = fo.overlap(a, b, op, plan=plan)
    assert torch.allclose(out.double(), _ref(a, b), atol=1e-4)


# ---- two ranks ---------------------------------------------------------------------------------

def _tuned_on_rank0(cache_dir):
    """Rank 0 has a tuning cache with a tuned plan for the shape; rank 1 has none. The first
    call must refuse with a ValueError naming the ranks, on both ranks, and not hang."""
    import os

    import torch.distributed as dist

    from flashoverlap_core.tuning import cache as tc

    rank = dist.get_rank()
    os.environ["FLASHOVERLAP_TUNING_CACHE"] = f"{cache_dir}/tuning.json" if rank == 0 else "off"
    m, n, k = 64, 48, 16
    if rank == 0:
        backend = registry.get("reference")
        heuristic = fo.plan(m, n, k, dtype=torch.float32, backend="reference", world_size=2)
        tuned = fo.plan(m, n, k, dtype=torch.float32, backend="reference", world_size=2,
                        tile=(16, 16), group_sizes=[4, 8])
        assert tuned.to_json() != heuristic.to_json()
        ctx = tc.context_for(backend, "cpu", dist.group.WORLD)
        key = tc.plan_key(ctx, dtype="float32", m=m, n=n, k=k, op="allreduce", world_size=2)
        tc.TuningCache().put("plans", key, {"plan": tuned.to_dict()})
    api.forget_prepared()
    a, b = torch.randn(m, k), torch.randn(k, n)
    try:
        fo.overlap(a, b, "allreduce", backend="reference")
    except ValueError as e:
        return str(e)
    return "no error"


def test_ranks_with_different_plans_are_refused(tmp_path):
    with RankPool(2, timeout=240) as pool:
        messages = pool.run(_tuned_on_rank0, str(tmp_path))
    for msg in messages:
        assert "do not run the same plan" in msg and "ranks [1]" in msg, messages


def _ops_without_warnings(seed):
    import torch.distributed as dist

    api.forget_prepared()
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(seed + rank)
    a, b = torch.randn(12, 8, generator=g), torch.randn(8, 10, generator=torch.Generator().manual_seed(seed))
    every_a = [torch.randn(12, 8, generator=torch.Generator().manual_seed(seed + r)) for r in range(world)]
    total = sum(x.double() @ b.double() for x in every_a)
    results = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a deprecation warning fails the call
        for strategy in ("overlap", "sequential"):
            plan = fo.plan(12, 10, 8, op="reduce_scatter", world_size=world, dtype=torch.float32,
                           backend="reference")
            plan = fo.Plan.from_dict({**plan.to_dict(), "strategy": strategy})
            for _ in range(3):  # back to back: prepared after the first
                out = fo.overlap(a, b, "reduce_scatter", plan=plan)
            rows = 12 // world
            results[strategy] = bool(torch.allclose(out.double(), total[rank * rows:(rank + 1) * rows], atol=1e-4))
            out = fo.overlap(a, b, "allreduce")
            results[f"allreduce-{strategy}"] = bool(torch.allclose(out.double(), total, atol=1e-4))
    return results


def test_two_ranks_back_to_back_without_warnings():
    results = shared_ranks(2).run(_ops_without_warnings, 1234, timeout=240)
    for r in results:
        assert all(r.values()), results


def test_prepared_calls_lists_what_each_key_runs(fresh, monkeypatch):
    """fo.prepared_calls(): one entry per prepared key, in order, with the backend, strategy,
    groups and runner that each key's calls run (a sequential plan: the SequentialCall, whatever
    backend made the plan) and b's layout read from the key's strides (no tensor made for it)."""
    assert fo.prepared_calls() == []
    f32 = torch.float32
    plans = [fo.plan(6, 11, 9, "allreduce", dtype=f32, backend="reference", tile=(4, 4),
                     group_sizes=[3, 3]),
             fo.plan(8, 5, 9, "reduce_scatter", dtype=f32, backend="decomposition", tile=(4, 4),
                     group_sizes=[1, 1, 2]),
             fo.plan(4, 5, 9, "allgather", dtype=f32, backend="reference", tile=(4, 4),
                     group_sizes=[2])]
    plans[2] = fo.Plan.from_dict({**plans[2].to_dict(), "strategy": "sequential"})
    weight = torch.randn(11, 9)
    fo.overlap(torch.randn(6, 9), weight.t(), "allreduce", plan=plans[0])
    fo.overlap(torch.randn(8, 9), torch.randn(9, 5), "reduce_scatter", plan=plans[1])
    fo.overlap(torch.randn(4, 9), torch.randn(9, 10)[:, ::2], "allgather", plan=plans[2])
    fo.overlap(torch.randn(6, 9), weight.t(), "allreduce", plan=plans[0])  # a known key
    made = []
    real_empty_strided = torch.empty_strided
    monkeypatch.setattr(torch, "empty_strided",
                        lambda *a, **k: made.append(a) or real_empty_strided(*a, **k))
    calls = fo.prepared_calls()
    assert made == []
    same = {"dtype": "float32", "out_dtype": None, "scaling": None, "device": "cpu",
            "world_size": 1, "K": 9,
            "workspace_bytes": 0, "strategy_reason": "the plan's own (given or tuned)",
            "predicted_overlap_s": None, "predicted_plain_s": None}
    assert calls == [
        {"op": "allreduce", "a": [6, 9], "b": [9, 11], "b_layout": "col", "M": 6, "N": 11,
         "backend": "reference", "strategy": "overlap", "groups": 2, "layout": "rows",
         "runner": "PreparedCall", **same},
        {"op": "reduce_scatter", "a": [8, 9], "b": [9, 5], "b_layout": "row", "M": 8, "N": 5,
         "backend": "decomposition", "strategy": "overlap", "groups": 3, "layout": "tiles",
         "runner": "PreparedCall", **same},
        {"op": "allgather", "a": [4, 9], "b": [9, 5], "b_layout": "strided", "M": 4, "N": 5,
         "backend": "reference", "strategy": "sequential", "groups": 1, "layout": "rows",
         "runner": "SequentialCall", **same},
    ]
    api.forget_prepared()
    assert fo.prepared_calls() == []


# ---- what a user sees: a plan runs where the call would, all_to_all's rows, a rank alone ----
def _backends_with_and_without_a_plan(world: int) -> list[tuple]:
    """(op, dtype, backend without plan=, backend with plan=fo.plan(...)) for each op and dtype,
    nothing naming a backend."""
    import torch.distributed as dist

    api.forget_prepared()
    rank = dist.get_rank() if dist.is_initialized() else 0
    ran = []
    for op in ("allreduce", "reduce_scatter", "allgather", "all_to_all"):
        for dtype in (torch.float32, torch.bfloat16):
            m = 8 * world  # the plan's rows (allgather: of the result, each rank has 8)
            a = torch.randn(8 if op == "allgather" else m, 16, dtype=dtype)
            b = torch.randn(16, 12, dtype=dtype)
            splits = ({"send_splits": [8] * world, "recv_splits": [8] * world}
                      if op == "all_to_all" else {})
            plan = fo.plan(m, 12, 16, op, world, dtype, b_layout="row",
                           send_splits=splits.get("send_splits"))
            backends = []
            for given in (None, plan):
                api.forget_prepared()
                fo.overlap(a, b, op, plan=given, **splits)
                (call,) = fo.prepared_calls()
                backends.append(call["backend"])
            ran.append((op, str(dtype), rank, *backends, plan.backend))
    return ran


@pytest.mark.parametrize("world", [1, 2])
def test_a_plan_made_without_a_backend_runs_where_the_call_would(fresh, monkeypatch, world):
    """fo.plan(...) without backend= plans for the backend fo.overlap chooses for the call on
    the default device: passing the plan does not change where the call runs."""
    monkeypatch.delenv("FLASHOVERLAP_BACKEND", raising=False)
    ran = (_backends_with_and_without_a_plan(1) if world == 1 else
           [r for rank in shared_ranks(2).run(_backends_with_and_without_a_plan, 2) for r in rank])
    assert ran and all(without == given == planned for *_, without, given, planned in ran), ran


def test_prepared_calls_say_all_to_all_rows_are_per_call(fresh):
    a, w = torch.randn(6, 4), torch.randn(5, 4)
    fo.overlap(a, w.t(), "all_to_all", send_splits=[6], recv_splits=[6])
    fo.overlap(a[:2], w.t(), "all_to_all", send_splits=[2], recv_splits=[2])  # the same key
    (call,) = fo.prepared_calls()
    assert call["a"] == ["per call", 4] and call["M"] == "per call", call
    # the predictions are None: the suite's calls overlap (FLASHOVERLAP_STRATEGY), none predicted
    assert [key for key, value in call.items() if value is None] == [
        "out_dtype", "scaling", "predicted_overlap_s", "predicted_plain_s"], call


def test_a_launched_rank_without_a_process_group_is_warned_once(fresh, monkeypatch):
    """WORLD_SIZE > 1 (torchrun) without init_process_group: the first call says so, once per
    process; later calls and new keys do not, and nor does a process not started so."""
    a, b = torch.randn(4, 3), torch.randn(3, 5)
    monkeypatch.setattr(api, "_launch_checked", False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.warns(RuntimeWarning, match=r"WORLD_SIZE=2 .*init_process_group"):
        fo.overlap(a, b)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fo.overlap(a, b)
        fo.overlap(torch.randn(6, 3), b)  # a new key
        for world in ("1", ""):
            monkeypatch.setattr(api, "_launch_checked", False)
            monkeypatch.setenv("WORLD_SIZE", world)
            api.forget_prepared()
            fo.overlap(a, b)


def _launched_with_a_process_group() -> str:
    """A rank whose environment says WORLD_SIZE=2, as under torchrun, with its group joined."""
    import os

    api.forget_prepared()
    api._launch_checked = False
    os.environ["WORLD_SIZE"] = "2"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            fo.overlap(torch.randn(4, 3), torch.randn(3, 5))
    finally:
        del os.environ["WORLD_SIZE"]
    return "no warning"


def test_a_launched_rank_in_its_process_group_is_not_warned():
    assert shared_ranks(2).run(_launched_with_a_process_group) == ["no warning"] * 2
