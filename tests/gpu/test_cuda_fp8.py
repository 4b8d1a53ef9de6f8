"""GPU tests of fp8 calls on the cuda backend (issue 23): float8_e4m3fn a and b with float32
scales through fo.overlap, at world size 1, against float64 of the dequantized inputs.

Fresh random inputs every run (the seed is in each failure's message), NaN-poisoned outputs,
ragged shapes (partial tiles, K not a multiple of the 128-element K tile, K not a multiple of
16: the rows are then copied to 16-byte strides), tensor-wise, row-wise and mixed scales, bf16
and fp16 out, allreduce and reduce_scatter on a NCCL group of one rank, callable ops, graph
replays with moving operands and scales, torch.compile, all_to_all with each call's own rows
and scales (issue 32: ragged rows, none at times, every kind of scales, alone and on the NCCL
group of one rank; world sizes 2-4 in test_multirank.py), allgather (issue 32: the e4m3 rows and
every rank's scales gathered, its waiting GEMM with scales; every kind of scales, alone and on
the NCCL group of one rank; the gathered path itself, whose tiles wait, at world size 1 in
test_cuda_allgather.py, world sizes 2-4 in test_multirank.py), and what cuda declines (sm_80
kernels) running dequantized on 'decomposition'. Block-wise scales (1x128
groups of a, 128x128 blocks of b; issue 32): every element's error at most that of torch's
block-wise scaled_mm on the same inputs plus 2 ulps of the output dtype (where torch lacks it,
the float32 dequantized product, and the failure message says which), their scale layouts,
replays, the NCCL group of one rank, the plain path, and what cuda declines. The kernel-level paths
(every epilogue, item tables with gaps, counters, release order) are in test_gemm_epilogue.py.
Skips without a GPU (fails under FLASHOVERLAP_REQUIRE_HW=1).
"""
from __future__ import annotations

import os
import random

import pytest
import torch

import flashoverlap_core as fo
from flashoverlap_core import api

import test_cuda  # tests/gpu: its NCCL group of one rank

pytestmark = pytest.mark.timeout(600)

F8 = getattr(torch, "float8_e4m3fn", None)


def _reason() -> str | None:
    status = {s.name: s for s in fo.backends()}.get("cuda")
    if status is None:
        return "the cuda backend is not installed"
    if not status.available:
        return f"cuda backend unavailable: {status.reason}"
    if torch.cuda.get_device_capability()[0] != 9:
        return "the fp8 signaling GEMM needs sm_90 (Hopper)"
    return None


REASON = _reason()
if REASON and os.environ.get("FLASHOVERLAP_REQUIRE_HW") == "1":
    raise RuntimeError(f"FLASHOVERLAP_REQUIRE_HW=1 but {REASON}")
pytestmark = [pytestmark, pytest.mark.skipif(REASON is not None, reason=REASON or "")]

nccl_group = test_cuda.nccl_group  # the fixture: a NCCL process group of one rank

OUT = {"bfloat16": torch.bfloat16, "float16": torch.float16}
SCALINGS = ("tensorwise", "rowwise", "mixed")  # mixed: row-wise a, tensor-wise b
SHAPES = [(1, 1, 1), (7, 127, 33), (1000, 1000, 1000), (4097, 384, 72), (256, 8192, 64),
          (777, 1234, 999), (3000, 2500, 320), (2048, 4096, 4096)]


@pytest.fixture(autouse=True)
def _block_scaled_kernel(monkeypatch):
    """These tests are the block-scaled kernel's verification: run it (cuda declines block-wise
    scales by default until it is verified)."""
    monkeypatch.setenv("FLASHOVERLAP_CUDA_FP8_BLOCK", "1")


@pytest.fixture(autouse=True)
def _fresh_keys():
    api.forget_prepared()
    yield
    api.forget_prepared()


def _inputs(m, n, k, scaling, seed):
    """e4m3 a [m, k], b = w.t() of an e4m3 [n, k] w, and the scales."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = (torch.randn(m, k, device="cuda", generator=g) * 2).to(F8)
    b = (torch.randn(n, k, device="cuda", generator=g) * 2).to(F8).t()
    rows = (m, 1) if scaling in ("rowwise", "mixed") else ()
    cols = (1, n) if scaling == "rowwise" else ()
    sa = torch.rand(rows, device="cuda", generator=g) + 0.25
    sb = torch.rand(cols, device="cuda", generator=g) + 0.25
    return a, b, sa, sb


def _reference(a, b, sa, sb):
    return (a.double() * sa.double()) @ (b.double() * sb.double())


def _check(got, a, b, sa, sb, out_dtype, what):
    """Every element within the output's rounding plus an accumulation allowance of the
    absolute products, and the whole within a normwise bound; nothing left unwritten."""
    ref = _reference(a, b, sa, sb)
    bound = (a.double().abs() * sa.double()) @ (b.double().abs() * sb.double())
    assert got.dtype == out_dtype, f"{what}: result is {got.dtype}, expected {out_dtype}"
    assert not torch.isnan(got).any(), f"{what}: elements never written (NaN)"
    err = (got.double() - ref).abs()
    eps = torch.finfo(out_dtype).eps
    over = err > eps * ref.abs() + 2.0 ** -9 * bound + 1e-6
    assert not over.any(), (f"{what}: {int(over.sum())} elements outside the bound, max err "
                            f"{err.max().item():.4g}")
    rel = (err.norm() / ref.norm().clamp(min=1e-30)).item()
    assert rel < (1.5e-2 if out_dtype == torch.bfloat16 else 5e-3), f"{what}: normwise error {rel:.3g}"


def _call(m, n, k, scaling, out_name, op="allreduce", group=None, layout="torch", **kw):
    """One call at world size 1 into a poisoned out, checked (block-wise: with _block_check,
    whose baseline's name it returns; ``layout``: its scales', see _block_inputs)."""
    seed = random.randrange(2**31)
    blockwise = scaling == "blockwise"
    a, b, sa, sb = (_block_inputs(m, n, k, seed, layout) if blockwise
                    else _inputs(m, n, k, scaling, seed))
    out_dtype = OUT[out_name]
    out = torch.full((m, n), float("nan"), device="cuda", dtype=out_dtype)  # world size 1
    got = fo.overlap(a, b, op, group, scale_a=sa, scale_b=sb, out_dtype=out_dtype, out=out,
                     backend="cuda", **kw)
    torch.cuda.synchronize()
    assert got is out
    what = f"{op} {m}x{n}x{k} {scaling} {out_name}{' ' + layout if blockwise else ''}, seed {seed}"
    return (_block_check if blockwise else _check)(got, a, b, sa, sb, out_dtype, what)


@pytest.mark.parametrize("out_name", sorted(OUT))
@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fp8_one_rank_matches_float64(shape, scaling, out_name):
    _call(*shape, scaling, out_name)
    assert fo.prepared_calls()[-1]["backend"] == "cuda"


@pytest.mark.parametrize("op", ["allreduce", "reduce_scatter"])
@pytest.mark.parametrize("shape", [(1000, 1000, 1000), (4096, 4096, 1024), (300, 520, 72)],
                         ids=lambda s: "x".join(map(str, s)))
def test_fp8_collectives_on_a_nccl_group(op, shape, nccl_group):
    for scaling, out_name in (("rowwise", "bfloat16"), ("tensorwise", "float16")):
        for _ in range(3):  # the first call, then the captured graph's replays
            _call(*shape, scaling, out_name, op=op, group=nccl_group)
    call = fo.prepared_calls()[-1]
    assert (call["backend"], call["runner"]) == ("cuda", "CudaCall"), call


def test_fp8_explicit_plan_and_pingpong_tile():
    plan = fo.plan(1000, 1000, 512, dtype=F8, out_dtype=torch.float16, tile=(128, 128),
                   backend="cuda")
    assert (plan.dtype, plan.out_dtype) == ("float8_e4m3fn", "float16")
    fo.Plan.from_json(plan.to_json())  # round-trips
    _call(1000, 1000, 512, "rowwise", "float16", plan=plan)
    with pytest.raises(ValueError, match="out_dtype"):
        _call(1000, 1000, 512, "rowwise", "bfloat16", plan=plan)


@pytest.mark.parametrize("scaling", ["rowwise", "blockwise"])
def test_fp8_replays_follow_moving_operands_and_scales(scaling):
    """A key's calls replay one captured graph: new a, b and scales (new addresses, and new
    values at the same addresses) must each be what the next call computes (block-wise: the
    scales are read per K tile in the main loop)."""
    _calls_with_moving_scales("allreduce", scaling)


def _calls_with_moving_scales(op: str, scaling: str, m=1536, n=1280, k=768):
    """Six calls of one key: new a, b and scales (new addresses) every other call, new values
    in the same tensors between them (the kernel reads the scales at run time); each result
    against float64, into a poisoned out."""
    blockwise = scaling == "blockwise"
    inputs = ((lambda seed: _block_inputs(m, n, k, seed)) if blockwise
              else (lambda seed: _inputs(m, n, k, scaling, seed)))
    a, b, sa, sb = inputs(random.randrange(2**31))
    for i in range(6):
        if i % 2:  # new tensors: a replayed graph's GEMM node is re-pointed
            a, b, sa, sb = inputs(random.randrange(2**31))
        else:  # same tensors, new values
            sa.uniform_(0.25, 1.25)
            sb.uniform_(0.25, 1.25)
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        fo.overlap(a, b, op, scale_a=sa, scale_b=sb, out=out, backend="cuda")
        torch.cuda.synchronize()
        (_block_check if blockwise else _check)(out, a, b, sa, sb, torch.bfloat16,
                                                f"{op} {scaling} call {i}")


def test_fp8_strided_scales_and_unaligned_rows():
    """A scale_a that is a column of a wider tensor (copied per call) and rows of a whose
    stride is not 16 bytes (K = 72 + padding view): still exact."""
    m, n, k = 640, 768, 72
    seed = random.randrange(2**31)
    a, b, _, sb = _inputs(m, n, k, "rowwise", seed)
    wide = torch.rand(m, 3, device="cuda") + 0.25
    sa = wide[:, 1:2]  # [m, 1], stride (3, 1)
    store = torch.empty(m, k + 8, device="cuda", dtype=F8)
    store[:, :k] = a
    a_view = store[:, :k]  # row stride k + 8 = 80 bytes: 16-byte aligned rows
    odd = torch.empty(m, k + 3, device="cuda", dtype=F8)
    odd[:, :k] = a
    for operand in (a_view, odd[:, :k]):  # the second is copied to 16-byte rows per call
        for _ in range(2):
            got = fo.overlap(operand, b, "allreduce", scale_a=sa, scale_b=sb, backend="cuda")
            torch.cuda.synchronize()
            _check(got, a, b, sa, sb, torch.bfloat16, f"strides {operand.stride()}, seed {seed}")


def test_fp8_callable_op_sees_the_scaled_result():
    m, n, k = 1024, 2048, 512
    a, b, sa, sb = _inputs(m, n, k, "rowwise", random.randrange(2**31))
    seen = []
    got = fo.overlap(a, b, lambda region, i: seen.append(i), scale_a=sa, scale_b=sb,
                     backend="cuda")
    torch.cuda.synchronize()
    assert seen == list(range(len(seen))) and seen
    _check(got, a, b, sa, sb, torch.bfloat16, "callable op")


def test_fp8_compiles_on_cuda():
    m, n, k = 512, 768, 256
    a, b, sa, sb = _inputs(m, n, k, "rowwise", random.randrange(2**31))
    fn = torch.compile(lambda a, b, sa, sb: fo.overlap(a, b, "allreduce", scale_a=sa, scale_b=sb,
                                                       out_dtype=torch.float16), fullgraph=True)
    with torch.no_grad():
        got = fn(a, b, sa, sb)
        torch.cuda.synchronize()
    _check(got, a, b, sa, sb, torch.float16, "compiled")


# ---- allgather (issue 32): the e4m3 rows and every rank's scales, never dequantized rows -------
ALLGATHER_SCALINGS = ("tensorwise", "rowwise", "mixed", "blockwise")
ALLGATHER_SHAPES = [(1, 1, 1), (7, 127, 33), (130, 300, 300), (1000, 1000, 1000),
                    (4097, 384, 72)]


@pytest.mark.parametrize("group", ["none", "nccl"])
@pytest.mark.parametrize("out_name", sorted(OUT))
@pytest.mark.parametrize("scaling", ALLGATHER_SCALINGS)
def test_fp8_allgather_runs_natively(scaling, out_name, group, request, monkeypatch):
    """fp8 allgather on cuda's own path (CudaGatherCall: at world size 1 the GEMM with scales
    on a, in place), alone and on the NCCL group of one rank, every kind of scales (this rank's
    scale_a, tensor-wise too), ragged shapes, three calls of a key with fresh inputs each,
    against float64 of the dequantized inputs (block-wise: _block_check)."""
    monkeypatch.setenv("FLASHOVERLAP_STRATEGY", "overlap")  # (world size 1 would run plain)
    nccl_group = request.getfixturevalue("nccl_group") if group == "nccl" else None
    for shape in ALLGATHER_SHAPES:
        for _ in range(3):  # the first call, then the prepared key's
            _call(*shape, scaling, out_name, op="allgather", group=nccl_group)
        call = fo.prepared_calls()[-1]
        assert call["backend"] == "cuda"
        assert (call["runner"], call["op"], call["out_dtype"]) == (
            "CudaGatherCall", "allgather", out_name), call


def test_fp8_allgather_follows_moving_and_changing_scales(monkeypatch):
    """One key's calls with new scale tensors (new addresses) and new values in the same
    tensors: each call's result is its own scales' (the native call reads them per call)."""
    monkeypatch.setenv("FLASHOVERLAP_STRATEGY", "overlap")
    for scaling in ("rowwise", "tensorwise", "blockwise"):
        _calls_with_moving_scales("allgather", scaling)
        assert fo.prepared_calls()[-1]["runner"] == "CudaGatherCall"


# ---- all_to_all (issue 32): each call's rows, splits and scales ------------------------------
A2A_SCALINGS = ("tensorwise", "rowwise", "mixed", "blockwise")


def _a2a_inputs(m, n, k, scaling, seed):
    """A call's e4m3 a and b and scales of ``scaling`` (block-wise: torch's layouts)."""
    if scaling == "blockwise":
        return _block_inputs(m, n, k, seed)
    return _inputs(m, n, k, scaling, seed)


@pytest.mark.parametrize("group", ["none", "nccl"])
@pytest.mark.parametrize("out_name", sorted(OUT))
@pytest.mark.parametrize("scaling", A2A_SCALINGS)
def test_fp8_all_to_all_rows_change_every_call(scaling, out_name, group, request):
    """One fp8 all_to_all key, 14 calls whose rows change every call (none at times, tile
    edges, thousands), scale_a of each call's rows, splits given or not, out given (poisoned)
    or not, b and its scales new at times: every result against float64 of the dequantized
    inputs (block-wise: within torch's block-wise error + 2 ulps), run by cuda's scaled GEMM
    over unequal destination blocks, laid out per call."""
    nccl_group = request.getfixturevalue("nccl_group") if group == "nccl" else None
    rng = random.Random()
    n, k = rng.choice([(1000, 264), (136, 72), (384, 300), (4096, 512)])
    out_dtype = OUT[out_name]
    check = _block_check if scaling == "blockwise" else _check
    for call in range(14):
        m = rng.choice([0, 1, 127, 128, 129, 255, rng.randint(1, 3000)])
        seed = random.randrange(2**31)
        a, b, sa, sb = _a2a_inputs(m, n, k, scaling, seed)
        kw = {} if call % 3 == 0 else {"send_splits": [m]}
        if call % 2:
            kw["recv_splits"] = [m]
        if call % 4 == 1:
            kw["out"] = torch.full((m, n), float("nan"), device="cuda", dtype=out_dtype)
        got = fo.overlap(a, b, "all_to_all", nccl_group, scale_a=sa, scale_b=sb,
                         out_dtype=out_dtype, backend="cuda", **kw)
        torch.cuda.synchronize()
        if "out" in kw:
            assert got is kw["out"]
        assert got.shape == (m, n) and got.dtype == out_dtype, (got.shape, got.dtype)
        if m:
            check(got, a, b, sa, sb, out_dtype,
                  f"all_to_all {m}x{n}x{k} {scaling} {out_name} call {call}, seed {seed}")
    [key] = fo.prepared_calls()  # the rows are each call's own: one key
    assert (key["backend"], key["runner"], key["dtype"], key["out_dtype"]) == (
        "cuda", "AllToAllCall", "float8_e4m3fn", out_name), key
    assert fo.prepared_calls()[-1]["backend"] == "cuda"
    assert list(api._prepared.values())[-1].prepared.native is not None  # laid out per call


@pytest.mark.parametrize("layout", ["rows", "tiles"])
def test_fp8_all_to_all_layouts_and_strided_scales(layout):
    """Both all_to_all layouts on the scaled GEMM, a row-wise scale_a that is a column of a
    wider tensor (copied per call), and rows of a whose stride is not 16 bytes (copied)."""
    n, k = 768, 200
    plan = fo.plan(1000, n, k, op="all_to_all", dtype=F8, backend="cuda", layout=layout)
    for m in (1000, 0, 333, 2000):
        a, b, _, sb = _inputs(m, n, k, "rowwise", random.randrange(2**31))
        sa = (torch.rand(m, 3, device="cuda") + 0.25)[:, 1:2]  # [m, 1], stride (3, 1)
        odd = torch.empty(m, k + 3, device="cuda", dtype=F8)
        odd[:, :k] = a
        got = fo.overlap(odd[:, :k], b, "all_to_all", scale_a=sa, scale_b=sb, plan=plan,
                         send_splits=[m], recv_splits=[m])
        torch.cuda.synchronize()
        assert got.shape == (m, n)
        if m:
            _check(got, a, b, sa, sb, torch.bfloat16, f"all_to_all {layout} {m} rows")
    [key] = fo.prepared_calls()
    assert (key["backend"], key["layout"]) == ("cuda", layout), key


@pytest.mark.parametrize("scaling", ["tensorwise", "blockwise"])
def test_fp8_on_sm80_kernels_is_declined_with_the_reason(monkeypatch, scaling):
    monkeypatch.setenv("FLASHOVERLAP_CUDA_ARCH", "80")
    blockwise = scaling == "blockwise"
    seed = random.randrange(2**31)
    a, b, sa, sb = (_block_inputs(256, 256, 300, seed) if blockwise
                    else _inputs(256, 256, 128, scaling, seed))
    with pytest.raises(fo.BackendError, match="block-wise scales .*needs sm_90a" if blockwise
                       else "sm_90a"):
        fo.overlap(a, b, "allreduce", scale_a=sa, scale_b=sb, backend="cuda")
    got = fo.overlap(a, b, "allreduce", scale_a=sa, scale_b=sb)
    torch.cuda.synchronize()
    (_block_check if blockwise else _check)(got, a, b, sa, sb, torch.bfloat16,
                                            f"sm80 {scaling}: dequantized")
    assert fo.prepared_calls()[-1]["backend"] == "decomposition"


# ---- block-wise scales (issue 32): 1x128 groups of a along K, 128x128 blocks of b ------------
BLOCK_SHAPES = [(1, 1, 1), (7, 127, 33), (130, 300, 300), (1000, 1000, 1000), (777, 1234, 999),
                (4097, 384, 72), (256, 8192, 128), (3000, 2500, 320), (2048, 4096, 4096),
                (512, 7168, 2048)]


def _block_inputs(m, n, k, seed, layout="torch"):
    """e4m3 a and b = w.t(), block-wise scales: scale_a [m, ceil(k/128)] (``layout`` "torch":
    outer-dim-major, strides (1, m), as torch keeps it; "rows": row-major) and scale_b
    [ceil(k/128), ceil(n/128)] as weight_scale.t() of a checkpoint's [ceil(n/128), ceil(k/128)]
    ("padded": F.scaled_mm's [round_up(ceil(k/128), 4), ceil(n/128)], its pad rows huge).
    scale_a as the kernel loads it: "torch" with m a multiple of 4 by TMA, else by cp.async;
    "spaced": outer-dim-major, its groups round_up(m, 4) + 4 floats apart (TMA), the gap huge;
    "shifted": outer-dim-major at a base 4 bytes past a 16-byte boundary (cp.async)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    kb, nb = -(-k // 128), -(-n // 128)
    a = (torch.randn(m, k, device="cuda", generator=g) * 2).to(F8)
    b = (torch.randn(n, k, device="cuda", generator=g) * 2).to(F8).t()
    sa = torch.rand(m, kb, device="cuda", generator=g) + 0.25
    sb = (torch.rand(nb, kb, device="cuda", generator=g) + 0.25).t()
    if layout == "torch":
        sa = sa.t().contiguous().t()
    if layout in ("spaced", "shifted"):
        space = -(-m // 4) * 4 + 4
        store = torch.full((kb * space + 1,), 1e30, device="cuda")
        sa = store.as_strided((m, kb), (1, space), 1 if layout == "shifted" else 0).copy_(sa)
    if layout == "padded":
        rows = -(-kb // 4) * 4
        padded = torch.full((nb, rows), 1e30, device="cuda")
        padded[:, :kb] = sb.t()
        sb = padded.t()
    return a, b, sa, sb


def _block_expand(scale, rows, cols, row_block):
    used = scale[:-(-rows // row_block), :-(-cols // 128)].double()
    return used.repeat_interleave(row_block, 0)[:rows].repeat_interleave(128, 1)[:, :cols]


def _block_reference(a, b, sa, sb):
    (m, k), n = a.shape, b.shape[1]
    return (a.double() * _block_expand(sa, m, k, 1)) @ (b.double() * _block_expand(sb, k, n, 128))


def _block_baseline(a, b, sa, sb, out_dtype):
    """(torch's result for the same inputs, what it is): torch.nn.functional.scaled_mm with
    BlockWise1x128 / BlockWise128x128 where this torch and device take the shape, else what a
    block-scaled GEMM computes, from torch's own fp8 GEMM: per group of 128 k, the unscaled
    e4m3 product on the tensor cores (``torch._scaled_mm``, fast accumulation, float32 out;
    K and N zero-padded to the multiples of 16 it wants), times the group's scales, summed in
    float32 (DeepSeek-V3's promotion of every 128-long accumulation). A plain float32 matmul of
    the dequantized inputs is no baseline here: the e4m3 tensor cores accumulate with fewer
    bits than float32 within a group, as every fp8 GEMM on them does."""
    from flashoverlap_core import fp8

    if fp8.blockwise_available(a.device) and a.shape[1] % 16 == 0 and b.shape[1] % 16 == 0:
        try:
            return fp8.blockwise_mm(a, b, sa, sb, out_dtype), "torch block-wise scaled_mm"
        except (RuntimeError, NotImplementedError, ValueError):
            pass
    (m, k), n = a.shape, b.shape[1]
    n16 = -(-n // 16) * 16
    one = torch.ones((), device=a.device)
    sb_cols = sb.float().repeat_interleave(128, 1)[:, :n]  # [groups, n]
    total = torch.zeros(m, n, device=a.device)
    for g in range(-(-k // 128)):
        k0, k1 = g * 128, min(k, g * 128 + 128)
        kp = -(-(k1 - k0) // 16) * 16
        ag = torch.zeros(m, kp, device=a.device, dtype=a.dtype)
        ag[:, :k1 - k0] = a[:, k0:k1]
        bg = torch.zeros(n16, kp, device=a.device, dtype=b.dtype)
        bg[:n, :k1 - k0] = b[k0:k1].t()
        part = torch._scaled_mm(ag, bg.t(), scale_a=one, scale_b=one, out_dtype=torch.float32,
                                use_fast_accum=True)[:, :n]
        total += part * sa[:, g:g + 1].float() * sb_cols[g]
    return total.to(out_dtype), ("torch._scaled_mm per 128-group, promoted in float32 (no torch "
                                 "block-wise GEMM for this shape)")


def _block_check(got, a, b, sa, sb, out_dtype, what):
    """The error against float64 of the dequantized inputs at most the baseline's own error
    (torch's block-wise GEMM on the same inputs, or its per-group stand-in: _block_baseline)
    plus 2 ulps of the output dtype: the largest error over the result (the issue's measure),
    and at every element up to what e4m3 tensor-core accumulation may differ by between two
    kernels (2^-12 of that element's sum of |products|: the baseline and this kernel round
    their sums in different orders); nothing unwritten."""
    ref = _block_reference(a, b, sa, sb)
    base, base_name = _block_baseline(a, b, sa, sb, out_dtype)
    assert got.dtype == out_dtype, f"{what}: result is {got.dtype}, expected {out_dtype}"
    assert not torch.isnan(got).any(), f"{what}: elements never written (NaN)"
    info = torch.finfo(out_dtype)
    ulp = info.eps * torch.exp2(torch.floor(torch.log2(ref.abs().clamp(min=info.tiny))))
    err, base_err = (got.double() - ref).abs(), (base.double() - ref).abs()
    top = ref.abs().argmax()
    assert err.max() <= base_err.max() + 2 * ulp.flatten()[top], (
        f"{what}: max error {err.max().item():.4g} beyond {base_name}'s "
        f"{base_err.max().item():.4g} + 2 ulps")
    (m, k), n = a.shape, b.shape[1]
    mass = ((a.double() * _block_expand(sa, m, k, 1)).abs()
            @ (b.double() * _block_expand(sb, k, n, 128)).abs())
    over = err > base_err + 2 * ulp + 2.0 ** -12 * mass
    assert not over.any(), (
        f"{what}: {int(over.sum())} elements beyond {base_name}'s error + 2 ulps + the "
        f"accumulation allowance; max err {err.max().item():.4g} (baseline "
        f"{base_err.max().item():.4g})")
    return base_name


@pytest.mark.parametrize("out_name", sorted(OUT))
@pytest.mark.parametrize("shape", BLOCK_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fp8_blockwise_one_rank_matches_float64(shape, out_name):
    _call(*shape, "blockwise", out_name)
    call = fo.prepared_calls()[-1]
    assert (call["backend"], call["runner"]) == ("cuda", "CudaCall"), call


@pytest.mark.parametrize("layout", ["torch", "rows", "padded", "spaced", "shifted"])
def test_fp8_blockwise_scale_layouts(layout):
    """Every scale layout; scale_a by TMA (torch's at m = 1000, spaced) and by cp.async (rows,
    shifted, torch's at m = 777, and m = 64: fewer rows than a tile, which a TMA map's box may
    not exceed), 128x128 and 128x256 tiles, and a replay with fresh values."""
    for m in (1000, 777, 64):
        for tile in ((128, 128), (128, 256)):
            plan = fo.plan(m, 1000, 1000, dtype=F8, scaling="blockwise", tile=tile,
                           backend="cuda", out_dtype=torch.bfloat16)
            for _ in range(2):
                _call(m, 1000, 1000, "blockwise", "bfloat16", layout=layout, plan=plan)


@pytest.mark.parametrize("op", ["allreduce", "reduce_scatter"])
@pytest.mark.parametrize("shape", [(1000, 1000, 1000), (4096, 4096, 1024), (300, 520, 72)],
                         ids=lambda s: "x".join(map(str, s)))
def test_fp8_blockwise_collectives_on_a_nccl_group(op, shape, nccl_group):
    for out_name in ("bfloat16", "float16"):
        for _ in range(3):  # the first call, then the captured graph's replays
            _call(*shape, "blockwise", out_name, op=op, group=nccl_group)
    call = fo.prepared_calls()[-1]
    assert (call["backend"], call["runner"]) == ("cuda", "CudaCall"), call


def test_fp8_blockwise_plans_take_its_tiles_only():
    plan = fo.plan(1000, 1000, 512, dtype=F8, scaling="blockwise", backend="cuda")
    assert (plan.tile, plan.scaling) == ((128, 128), "blockwise")
    _call(1000, 1000, 512, "blockwise", "bfloat16", plan=plan)
    with pytest.raises(ValueError, match="no CUDA kernel with block-wise fp8 scales"):
        fo.plan(1000, 1000, 512, dtype=F8, scaling="blockwise", tile=(128, 224), backend="cuda")


# N: whole 256-column tiles; a last tile whose second 128-column block is partial (1000), has
# 2 columns (386), or lies past N (100, 1100: its scale_b is zero-filled, never read); K: whole
# groups, a partial last group (1000) and one group (72)
WIDE_SHAPES = [(1024, 1024, 1024), (1000, 1000, 1000), (300, 386, 72), (777, 100, 520),
               (4097, 1100, 384)]


@pytest.mark.parametrize("shape", WIDE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fp8_blockwise_wide_tile_matches_float64(shape):
    """The block-scaled 128x256 kernel (two 128-column blocks of b per tile, each multiplied
    into the same partial accumulators and promoted by its own scale_b), through explicit plans:
    both result dtypes, both layouts, and a graph replay with fresh inputs."""
    m, n, k = shape
    for out_name in ("bfloat16", "float16"):
        for layout in ("torch", "rows"):
            plan = fo.plan(m, n, k, dtype=F8, scaling="blockwise", tile=(128, 256),
                           backend="cuda", out_dtype=OUT[out_name])
            for _ in range(2):
                _call(m, n, k, "blockwise", out_name, layout=layout, plan=plan)
            call = fo.prepared_calls()[-1]
            assert (call["backend"], call["runner"]) == ("cuda", "CudaCall"), call


@pytest.mark.parametrize("op", ["allreduce", "reduce_scatter", "allgather"])
def test_fp8_blockwise_wide_tile_on_a_nccl_group(op, nccl_group):
    m, n, k = 1000, 1000, 1000
    plan = fo.plan(m, n, k, op=op, dtype=F8, scaling="blockwise", tile=(128, 256),
                   backend="cuda", out_dtype=torch.bfloat16)
    for _ in range(3):
        _call(m, n, k, "blockwise", "bfloat16", op=op, group=nccl_group, plan=plan)


def test_fp8_blockwise_plain_path_runs_torchs_blockwise_gemm(monkeypatch):
    """The plain path (a "sequential" plan) runs torch.nn.functional.scaled_mm block-wise where
    this torch has it on the device, else the dequantized product; the runner says which."""
    from flashoverlap_core import fp8

    monkeypatch.setenv("FLASHOVERLAP_STRATEGY", "plain")
    base = _call(1024, 1024, 1024, "blockwise", "bfloat16")
    runner = fo.prepared_calls()[-1]["runner"]
    torch_has_it = base.startswith("torch")
    assert runner == ("ScaledSequentialCall" if torch_has_it else "DequantizedCall"), (runner, base)
    assert fp8.blockwise_available(torch.device("cuda")) or not torch_has_it
