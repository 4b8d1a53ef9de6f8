"""The strategy choice of default calls (overlap or the plain path): the fixed rules, the
prediction on synthetic rates and links, the measurement's cache and its fallback. No device
work beyond a small host GEMM calibration."""
from __future__ import annotations

import warnings

import pytest
import torch

import flashoverlap_core as fo
from flashoverlap_core.tuning import strategy as st
from flashoverlap_core.tuning.cache import TuningCache
from flashoverlap_core.tuning.model import Contention, CostCurve

H200_LIKE = st.GemmRates(flops_per_s=800e12, bytes_per_s=4.0e12, fixed_s=5e-6)
NVLINK = CostCurve.affine(15e-6, 150e9, 1 << 30)  # assumed: latency, bus rate of a collective
PCIE = CostCurve.affine(30e-6, 20e9, 1 << 30)


def plan_of(m, n, k, op="allreduce", world=8, **kw):
    """A plan with an H200-sized kernel: 128x256 tiles, 132 per wave."""
    kw.setdefault("tile", (128, 256))
    kw.setdefault("wave_size", 132)
    return fo.plan(m, n, k, op=op, world_size=world, backend="reference", dtype=torch.bfloat16,
                   **kw)


@pytest.fixture(autouse=True)
def _auto(monkeypatch):
    monkeypatch.delenv(st.ENV_STRATEGY, raising=False)
    st.forget()


def test_fixed_rules(monkeypatch):
    assert st.fixed_choice(plan_of(4096, 8192, 1024, world=1)).strategy == st.PLAIN
    assert st.fixed_choice(plan_of(4096, 8192, 1024, world=4)) is None
    monkeypatch.setenv(st.ENV_STRATEGY, "overlap")
    assert st.fixed_choice(plan_of(1, 8192, 1024, world=1)).strategy == st.OVERLAP
    monkeypatch.setenv(st.ENV_STRATEGY, "PLAIN")
    assert st.fixed_choice(plan_of(16384, 8192, 1024)).strategy == st.PLAIN
    monkeypatch.setenv(st.ENV_STRATEGY, "fastest")
    with pytest.raises(ValueError, match="FLASHOVERLAP_STRATEGY must be one of auto"):
        st.fixed_choice(plan_of(16384, 8192, 1024))


def test_all_to_all_is_predicted_at_world_size_above_one_and_is_plain_alone():
    two = fo.plan(2, 1024, 512, op="all_to_all", world_size=2, send_splits=[1, 1],
                  backend="reference")
    one = fo.plan(64, 1024, 512, op="all_to_all", world_size=1, backend="reference")
    assert st.fixed_choice(two) is None  # predicted on the plan of the ranks' mean rows
    assert st.fixed_choice(two, predicted_rows=False).strategy == st.OVERLAP  # none given
    assert st.fixed_choice(one).strategy == st.PLAIN


def test_all_to_all_key_takes_the_choice_predicted_on_its_expected_rows(monkeypatch):
    """The key's plan (no rows of its own) gets the strategy predicted on the plan of the
    expected rows, whichever way it goes; without that plan it overlaps."""
    key = fo.plan(2, 8192, 8192, op="all_to_all", world_size=2, send_splits=[1, 1],
                  backend="reference")
    big = fo.plan(16384, 8192, 8192, op="all_to_all", world_size=2, send_splits=[8192, 8192],
                  backend="reference")
    few = fo.plan(16, 8192, 8192, op="all_to_all", world_size=2, send_splits=[8, 8],
                  backend="reference")
    link = NVLINK
    assert (st.predict(big, H200_LIKE, link).strategy, st.predict(few, H200_LIKE, link).strategy) \
        == (st.OVERLAP, st.PLAIN)
    seen = []
    monkeypatch.setattr(st, "group_facts", lambda plan, *a, **k: seen.append(plan) or (H200_LIKE, link))
    for on in (big, few):
        plan, prediction = st.choose(key, _Backend(), None, torch.device("cpu"), predict_on=on)
        assert plan.strategy == st.predict(on, H200_LIKE, link).strategy, prediction
        assert plan.m == key.m and plan.group_sizes == key.group_sizes, plan
        assert "predicted" in prediction.reason and seen[-1] is on, prediction
    plan, prediction = st.choose(key, _Backend(), None, torch.device("cpu"))
    assert plan.strategy == st.OVERLAP and "without the ranks' expected rows" in prediction.reason


def test_a_callable_op_always_overlaps(monkeypatch):
    p = fo.plan(4096, 1024, 512, op="custom", world_size=1, backend="reference",
                dtype=torch.bfloat16)
    monkeypatch.setenv(st.ENV_STRATEGY, "plain")
    assert st.fixed_choice(p).strategy == st.OVERLAP


@pytest.mark.parametrize("m,n,k", [(1, 8192, 3584), (16, 8192, 1024), (64, 4096, 7168),
                                   (256, 8192, 3584)])
@pytest.mark.parametrize("link", [NVLINK, PCIE])
def test_decode_sizes_run_plain(m, n, k, link):
    p = st.predict(plan_of(m, n, k), H200_LIKE, link)
    assert p.strategy == st.PLAIN, p
    assert p.plain_s < p.overlap_s


def test_prefill_with_a_transfer_to_hide_overlaps():
    p = st.predict(plan_of(4096, 8192, 3584), H200_LIKE, NVLINK)
    assert p.strategy == st.OVERLAP and p.overlap_s < 0.97 * p.plain_s


def test_the_tile_layout_pays_its_reorder():
    rows = plan_of(16384, 8192, 1024)
    tiles = plan_of(16384, 8192, 1024, layout="tiles")
    assert rows.layout == "rows" and tiles.layout == "tiles"
    a, b = st.predict(rows, H200_LIKE, NVLINK), st.predict(tiles, H200_LIKE, NVLINK)
    assert a.plain_s == pytest.approx(b.plain_s)
    assert b.overlap_s > a.overlap_s + 2 * 16384 * 8192 * 2 / H200_LIKE.bytes_per_s * 0.99


def test_more_contention_never_predicts_faster():
    p = plan_of(8192, 8192, 3584)
    easy = st.predict(p, H200_LIKE, NVLINK, Contention())
    hard = st.predict(p, H200_LIKE, NVLINK, Contention(gemm=1.5, comm=1.5, gap_s=2e-5,
                                                      lag_s=2e-5))
    assert hard.overlap_s >= easy.overlap_s and hard.plain_s == easy.plain_s


def test_allgather_and_reduce_scatter_are_predicted():
    for op in ("allgather", "reduce_scatter"):
        small = st.predict(plan_of(8, 8192, 3584, op=op), H200_LIKE, NVLINK)
        assert small.strategy == st.PLAIN and small.overlap_s > 0 and small.plain_s > 0


def test_rates_roofline_and_whole_tiles():
    r = H200_LIKE
    assert r.plain_s(1, 8192, 8192, 2, 2) == pytest.approx(5e-6 + 8192 * 8192 * 2 / 4e12,
                                                           rel=1e-3)
    assert r.plain_s(8192, 8192, 8192, 2, 2) == pytest.approx(5e-6 + 2 * 8192 ** 3 / 800e12)
    # one token in 128-row tiles: the signaling GEMM computes whole tiles
    p = plan_of(1, 8192, 8192)
    t = r.signaling_timing(p, 2, 2)
    assert t.end > 2 * r.plain_s(1, 8192, 8192, 2, 2)
    with pytest.raises(ValueError, match="positive"):
        st.GemmRates(0.0, 1.0, 0.0)


def test_measured_rates_on_the_host_are_sane_and_quick():
    import time
    began = time.perf_counter()
    r = st.measure_rates(torch.float32, torch.device("cpu"), None)
    assert r.flops_per_s > 1e8 and r.bytes_per_s > 1e7 and r.fixed_s >= 0
    assert time.perf_counter() - began < 5.0
    assert st.GemmRates.from_dict(r.to_dict()) == r


class _Backend:
    name = "reference"

    def versions(self):
        return {"fake": "1"}


def test_cached_facts_are_used_without_measuring(tmp_path, monkeypatch):
    cache = TuningCache(tmp_path / "t.json")
    p = plan_of(4096, 1024, 512, world=2)
    calls = []
    monkeypatch.setattr(st, "measure_rates", lambda *a: calls.append("gemm") or H200_LIKE)
    monkeypatch.setattr(st, "measure_collective", lambda *a: calls.append("coll") or NVLINK)
    first = st.group_facts(p, _Backend(), None, torch.device("cpu"), cache)
    assert calls == ["gemm", "coll"] and first == (H200_LIKE, NVLINK)
    st.forget()
    assert st.group_facts(p, _Backend(), None, torch.device("cpu"), cache) == first
    assert calls == ["gemm", "coll"]  # from the file this time
    # another dtype of the same group: its own GEMM rates, its own curve
    p16 = fo.plan(4096, 1024, 512, op="allreduce", world_size=2, backend="reference",
                  dtype=torch.float16)
    st.group_facts(p16, _Backend(), None, torch.device("cpu"), cache)
    assert calls == ["gemm", "coll"] * 2


def test_a_failed_measurement_falls_back_once_with_a_warning(monkeypatch):
    def broken(*a):
        raise RuntimeError("no collective today")

    monkeypatch.setattr(st, "group_facts", broken)
    st._warned.clear()
    big, small = plan_of(4096, 1024, 512, world=2), plan_of(16, 1024, 512, world=2)
    with pytest.warns(RuntimeWarning, match="overlapping where M >= 1024"):
        chosen, why = st.choose(big, _Backend(), None, torch.device("cpu"))
    assert chosen.strategy == st.OVERLAP and "fallback" in why.reason
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        chosen, _ = st.choose(small, _Backend(), None, torch.device("cpu"))
    assert chosen.strategy == st.PLAIN


def test_choose_marks_the_plan(monkeypatch):
    monkeypatch.setattr(st, "group_facts", lambda *a, **k: (H200_LIKE, NVLINK))
    p = plan_of(1, 8192, 3584, world=2)
    chosen, why = st.choose(p, _Backend(), None, torch.device("cpu"))
    assert chosen.strategy == st.PLAIN and why.plain_s < why.overlap_s
    assert chosen.group_sizes == p.group_sizes and chosen.tile == p.tile


# ---- through the call path ---------------------------------------------------------------------
def test_world_size_one_runs_the_plain_path_by_default():
    from flashoverlap_core import api
    api.forget_prepared()
    a, b = torch.randn(64, 32, dtype=torch.float32), torch.randn(32, 48, dtype=torch.float32)
    out = fo.overlap(a, b)
    assert torch.allclose(out.double(), a.double() @ b.double(), atol=1e-4)
    (call,) = fo.prepared_calls()
    assert call["strategy"] == st.PLAIN and call["runner"] == "SequentialCall"
    assert call["strategy_reason"] == "world size 1: nothing to overlap"
    # a callable op still overlaps, and an explicit plan keeps its strategy
    seen = []
    fo.overlap(a, b, lambda region, g: seen.append(region.numel()))
    assert sum(seen) == 64 * 48
    p = fo.plan(64, 48, 32, dtype=torch.float32, backend="reference")
    fo.overlap(a, b, plan=p)
    runners = [(c["strategy"], c["runner"]) for c in fo.prepared_calls()]
    assert runners[1][0] == st.OVERLAP and runners[2] == (st.OVERLAP, "PreparedCall"), runners
    api.forget_prepared()


@pytest.mark.parametrize("op", ["allreduce", "reduce_scatter", "allgather"])
def test_plain_path_without_out_returns_the_gemms_own_fresh_result(op, monkeypatch):
    """A plain-path call without ``out`` returns the GEMM's own result (no torch.empty + out=
    GEMM on the host): right, contiguous, a new tensor every call; with ``out`` it writes
    there."""
    from flashoverlap_core import api
    api.forget_prepared()
    monkeypatch.setenv(st.ENV_STRATEGY, "plain")
    kind = op
    a = torch.randn(24, 40, dtype=torch.float32)
    b = torch.randn(56, 40, dtype=torch.float32).t()  # weight.t(), as nn.Linear keeps it
    want = a.double() @ b.double()
    first, second = fo.overlap(a, b, kind), fo.overlap(a, b, kind)
    for got in (first, second):
        assert got.shape == (24, 56) and got.dtype == a.dtype and got.is_contiguous()
        assert torch.allclose(got.double(), want, atol=1e-4)
    assert first.data_ptr() != second.data_ptr()  # a result is never reused by the next call
    assert fo.prepared_calls()[-1]["runner"] == "SequentialCall"
    entry = next(iter(api._prepared.values()))
    assert entry.run_new is not None
    out = torch.full((24, 56), float("nan"))
    assert fo.overlap(a, b, kind, out=out) is out and torch.allclose(out.double(), want, atol=1e-4)
    api.forget_prepared()


def _default_strategy_on_ranks(seed, cache_dir, modes):
    import os

    import torch.distributed as dist
    from flashoverlap_core import api

    rank, world = dist.get_rank(), dist.get_world_size()
    saved = {k: os.environ.get(k) for k in (st.ENV_STRATEGY, "FLASHOVERLAP_TUNING_CACHE")}
    os.environ[st.ENV_STRATEGY] = modes[rank]
    os.environ["FLASHOVERLAP_TUNING_CACHE"] = f"{cache_dir}/rank{rank}.json"  # each its own
    api.forget_prepared()
    st.forget()
    try:
        g = torch.Generator().manual_seed(seed)
        b = torch.randn(64, 96, generator=g, dtype=torch.float32)
        every_a = [torch.randn(256, 64, generator=g, dtype=torch.float32) for _ in range(world)]
        out = fo.overlap(every_a[rank], b, "allreduce")
        ok = torch.allclose(out.double(), sum(x.double() @ b.double() for x in every_a),
                            atol=1e-3)
        # all_to_all: each rank its own rows and splits
        rows = 8 + 5 * rank
        send = [rows // world] * (world - 1) + [rows - rows // world * (world - 1)]
        got = fo.overlap(torch.randn(rows, 64, dtype=torch.float32), b, "all_to_all",
                         send_splits=send)
        ok = ok and got.shape[1] == 96
        return {"strategies": [c["strategy"] for c in fo.prepared_calls()], "ok": ok,
                "reasons": [c["strategy_reason"] for c in fo.prepared_calls()]}
    except ValueError as e:
        return {"error": str(e)}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        api.forget_prepared()
        st.forget()


def test_ranks_choose_alike_from_agreed_numbers(tmp_path):
    from test_torch_ops_ranks import ranks
    pool = ranks(2)
    first = pool.run(_default_strategy_on_ranks, 7, str(tmp_path), ["auto", "auto"], timeout=240)
    assert all("error" not in r and r["ok"] for r in first), first
    assert first[0]["strategies"] == first[1]["strategies"], first
    assert "predicted" in first[0]["reasons"][0], first
    # all_to_all (rows 8 and 13): predicted too, on the plan of the ranks' mean rows
    assert "predicted" in first[0]["reasons"][1], first
    # rank 1 loses its cached numbers: every rank measures again, and still chooses alike
    (tmp_path / "rank1.json").unlink()
    again = pool.run(_default_strategy_on_ranks, 8, str(tmp_path), ["auto", "auto"], timeout=240)
    assert again[0]["strategies"] == again[1]["strategies"] == first[0]["strategies"] or \
        again[0]["strategies"] == again[1]["strategies"], again


def test_ranks_that_would_choose_differently_are_told(tmp_path):
    from test_torch_ops_ranks import ranks
    out = ranks(2).run(_default_strategy_on_ranks, 9, str(tmp_path), ["auto", "overlap"],
                       timeout=240)
    for r in out:
        assert "would not choose this call's strategy" in r.get("error", ""), out


def test_fp8_plain_path_runs_scaled_mm_not_dequantized():
    from flashoverlap_core import api
    api.forget_prepared()
    g = torch.Generator().manual_seed(3)
    a = torch.randn(40, 64, generator=g).to(torch.float8_e4m3fn)
    w = torch.randn(24, 64, generator=g).to(torch.float8_e4m3fn)
    sa, sb = torch.rand(40, 1, generator=g) + 0.5, torch.rand(1, 24, generator=g) + 0.5
    out = fo.overlap(a, w.t(), scale_a=sa, scale_b=sb)
    ref = (a.double() * sa.double()) @ (w.double() * sb.double().t()).t()
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.double(), ref, rtol=2e-2, atol=2e-2)
    (call,) = fo.prepared_calls()
    assert (call["strategy"], call["runner"]) == (st.PLAIN, "ScaledSequentialCall"), call
    api.forget_prepared()


def test_fp8_shape_torch_refuses_overlaps_unless_plain_is_forced(monkeypatch):
    """Where torch's fp8 GEMM refuses K or N (CUDA's want multiples of 16), the default call
    overlaps rather than run a dequantized plain path; FLASHOVERLAP_STRATEGY=plain still runs
    (dequantized, correct)."""
    from flashoverlap_core import api, fp8
    refused = []

    def cuda_rule(device, dtype, k, n, rowwise, out_dtype):
        refused.append((k, n))
        return not (k % 16 or n % 16)

    monkeypatch.setattr(fp8, "scaled_mm_takes", cuda_rule)
    g = torch.Generator().manual_seed(5)
    a = torch.randn(40, 64, generator=g).to(torch.float8_e4m3fn)
    w = torch.randn(24, 64, generator=g).to(torch.float8_e4m3fn)  # N = 24
    sa, sb = torch.rand(40, 1, generator=g) + 0.5, torch.rand(1, 24, generator=g) + 0.5
    ref = (a.double() * sa.double()) @ (w.double() * sb.double().t()).t()
    for forced, strategy, runner in ((None, st.OVERLAP, None),
                                     ("plain", st.PLAIN, "DequantizedCall")):
        api.forget_prepared()
        if forced:
            monkeypatch.setenv(st.ENV_STRATEGY, forced)
        out = fo.overlap(a, w.t(), scale_a=sa, scale_b=sb)
        assert torch.allclose(out.double(), ref, rtol=2e-2, atol=2e-2)
        (call,) = fo.prepared_calls()
        assert call["strategy"] == strategy, call
        assert runner is None or call["runner"] == runner, call
    assert (64, 24) in refused
    api.forget_prepared()


def test_plain_fused_norm_uses_the_backends_row_kernel(monkeypatch):
    from flashoverlap_core import api
    from flashoverlap_core.reference import ReferenceBackend
    from flashoverlap_core.reorder import add_rmsnorm
    api.forget_prepared()
    used = []

    def rows_kernel(self, x, residual, weight, eps):
        used.append(tuple(x.shape))
        return add_rmsnorm(x, residual, weight, eps)

    monkeypatch.setattr(ReferenceBackend, "add_rmsnorm_rows", rows_kernel)
    a, b = torch.randn(16, 32), torch.randn(32, 24)
    residual, weight = torch.randn(16, 24), torch.rand(24) + 0.5
    normed, resid = fo.overlap_add_rmsnorm(a, b, residual, weight, eps=1e-6, backend="reference")
    want_resid = (a.double() @ b.double()) + residual.double()
    want = want_resid * torch.rsqrt(want_resid.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
    assert used == [(16, 24)]
    assert torch.allclose(resid.double(), want_resid, atol=1e-4)
    assert torch.allclose(normed.double(), want, atol=1e-4)
    assert fo.prepared_calls()[0]["runner"] == "SequentialCall"
    api.forget_prepared()



class _RecordedCollectives:
    """A backend's own plain-path collectives (Backend.plain_collectives): torch.distributed's,
    counted."""

    def __init__(self, group):
        self.group, self.seen = group, []

    def all_reduce(self, t):
        import torch.distributed as dist
        self.seen.append("all_reduce")
        dist.all_reduce(t, group=self.group)

    def reduce_scatter(self, out, t):
        from flashoverlap_core.collectives import reduce_scatter_single
        self.seen.append("reduce_scatter")
        reduce_scatter_single(out, t, group=self.group)

    def all_gather(self, out, t):
        from flashoverlap_core.collectives import all_gather_single
        self.seen.append("all_gather")
        all_gather_single(out, t, group=self.group)

    def all_to_all(self, out, t, send_splits, recv_splits):
        import torch.distributed as dist
        self.seen.append("all_to_all")
        dist.all_to_all_single(out, t, output_split_sizes=list(recv_splits),
                               input_split_sizes=list(send_splits), group=self.group)


def _plain_path_through_the_backends_collectives(seed):
    import os

    import torch.distributed as dist
    from flashoverlap_core import api
    from flashoverlap_core.reference import ReferenceBackend

    rank, world = dist.get_rank(), dist.get_world_size()
    made = []

    def plain_collectives(self, call):
        made.append(_RecordedCollectives(call.group))
        return made[-1]

    saved_env, saved_hook = os.environ.get(st.ENV_STRATEGY), ReferenceBackend.plain_collectives
    os.environ[st.ENV_STRATEGY] = "plain"
    ReferenceBackend.plain_collectives = plain_collectives
    api.forget_prepared()
    problems = []
    try:
        g = torch.Generator().manual_seed(seed)
        b = torch.randn(32, 40, generator=g, dtype=torch.float64)
        every_a = [torch.randn(8 * world, 32, generator=g, dtype=torch.float64)
                   for _ in range(world)]
        total = sum(x @ b for x in every_a)
        rows = total.shape[0] // world
        want = {"allreduce": total, "reduce_scatter": total[rank * rows:(rank + 1) * rows],
                "allgather": torch.cat(every_a) @ b}
        for op, ref in want.items():
            got = fo.overlap(every_a[rank].float(), b.float(), op, backend="reference")
            if not torch.allclose(got.double(), ref, atol=1e-3):
                problems.append(f"{op}: wrong result")
        # fp8 with row-wise scales: _scaled_mm (or dequantized) then the same collectives
        a8 = every_a[rank].float().to(torch.float8_e4m3fn)
        w8 = b.float().t().contiguous().to(torch.float8_e4m3fn)
        sa, sb = torch.ones(a8.shape[0], 1), torch.ones(1, w8.shape[0])
        got = fo.overlap(a8, w8.t(), "allgather", scale_a=sa, scale_b=sb, backend="reference")
        every8 = torch.cat([x.float().to(torch.float8_e4m3fn).double() for x in every_a])
        if not torch.allclose(got.double(), every8 @ w8.double().t(), rtol=2e-2, atol=2e-2):
            problems.append("fp8 allgather: wrong result")
        # all_to_all with uneven splits (rank r sends r + 1 + d rows to rank d, none to itself
        # at r = 0): the GEMM of its own rows, then the backend's all_to_all
        sends = [[0 if (r, d) == (0, 0) else r + 1 + d for d in range(world)]
                 for r in range(world)]
        rows_of = [torch.randn(sum(sends[r]), 32, generator=g, dtype=torch.float64)
                   for r in range(world)]
        recv = [sends[r][rank] for r in range(world)]
        got = fo.overlap(rows_of[rank].float(), b.float(), "all_to_all", backend="reference",
                         send_splits=sends[rank], recv_splits=recv)
        pieces = []
        for r in range(world):
            start = sum(sends[r][:rank])
            pieces.append(rows_of[r][start:start + sends[r][rank]] @ b)
        if not torch.allclose(got.double(), torch.cat(pieces), atol=1e-3):
            problems.append("all_to_all: wrong result")
        seen = [s for m in made for s in m.seen]
        return {"problems": problems, "seen": seen,
                "runners": [c["runner"] for c in fo.prepared_calls()]}
    finally:
        ReferenceBackend.plain_collectives = saved_hook
        if saved_env is None:
            os.environ.pop(st.ENV_STRATEGY, None)
        else:
            os.environ[st.ENV_STRATEGY] = saved_env
        api.forget_prepared()


def test_the_plain_path_runs_the_backends_own_collectives():
    from test_torch_ops_ranks import ranks
    out = ranks(2).run(_plain_path_through_the_backends_collectives, 11, timeout=240)
    for r in out:
        assert not r["problems"], out
        # fp8's allgather gathers the e4m3 rows and their row-wise scales
        assert r["seen"] == ["all_reduce", "reduce_scatter", "all_gather", "all_gather",
                             "all_gather", "all_to_all"], r
        assert r["runners"][:3] == ["SequentialCall"] * 3, r
        assert r["runners"][-1] == "AllToAllCall", r


def _plain_all_to_all(seed):
    """The plain path of all_to_all on this rank (FLASHOVERLAP_STRATEGY=plain): recv_splits
    given or not, out given (poisoned) or not, a destination with no rows."""
    import os

    import torch.distributed as dist

    from flashoverlap_core import api

    os.environ[st.ENV_STRATEGY] = "plain"
    try:
        api.forget_prepared()
        rank, world = dist.get_rank(), dist.get_world_size()
        splits = [[3, 0], [1, 2]]
        b = torch.randn(6, 5, generator=torch.Generator().manual_seed(seed))
        a_all = [torch.randn(sum(splits[r]), 6, generator=torch.Generator().manual_seed(seed + r))
                 for r in range(world)]
        recv = [splits[src][rank] for src in range(world)]
        want = torch.cat([(a_all[src].double() @ b.double())[sum(splits[src][:rank]):
                                                             sum(splits[src][:rank + 1])]
                          for src in range(world)])
        errors = []
        for kw in ({"recv_splits": recv}, {},
                   {"recv_splits": recv, "out": torch.full((sum(recv), 5), float("nan"))}):
            got = fo.overlap(a_all[rank], b, "all_to_all", send_splits=splits[rank],
                             backend="reference", **kw)
            assert "out" not in kw or got is kw["out"]
            errors.append(float((got.double() - want).abs().max()))
        return errors, fo.prepared_calls()[-1]["strategy"]
    finally:
        os.environ.pop(st.ENV_STRATEGY, None)


def test_plain_all_to_all_on_ranks_and_alone():
    from test_torch_ops_ranks import ranks

    for errors, strategy in ranks(2).run(_plain_all_to_all, 3, timeout=120):
        assert strategy == st.PLAIN and max(errors) < 1e-5, (errors, strategy)
    # alone the GEMM writes the result itself (no copy of it): into out when given
    a, b = torch.randn(7, 6), torch.randn(6, 5)
    out = torch.full((7, 5), float("nan"))
    assert fo.overlap(a, b, "all_to_all", out=out, backend="reference") is out
    assert torch.allclose(out, a @ b)
    assert torch.allclose(fo.overlap(a, b, "all_to_all", backend="reference"), a @ b)
