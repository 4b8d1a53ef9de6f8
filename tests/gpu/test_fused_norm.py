"""GPU tests of the post-reorder fused into residual add + RMSNorm (issue 22): the kernel alone
(fo_add_rmsnorm_tiles) on tiles in shuffled order, ragged and unaligned layouts included, and
``fo.overlap_add_rmsnorm`` on the cuda backend at world size 1 (with and without an NCCL group of
one rank): first calls, graph replays that follow moving operands, two streams, the caller's own
graph capture, and a fresh process under lazy module loading. Inputs are fresh random values on
every run, outputs are poisoned, and results are held to float64 and, tightly, to the unfused
torch path on the same GEMM result. Skips without the cuda backend (fails under
FLASHOVERLAP_REQUIRE_HW=1)."""
from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch

import flashoverlap_core as fo
import test_cuda
from flashoverlap_core import api
from flashoverlap_core.reorder import add_rmsnorm, band_offsets, block_tiles, unpack_tiles
from flashoverlap_core.testing.checks import normwise_mismatch
from flashoverlap_core.tiles import Schedule
from test_cuda import _inputs, needs_cuda

pytestmark = [pytest.mark.timeout(600), needs_cuda]
nccl_group = test_cuda.nccl_group  # the fixture: an NCCL process group of one rank
RTOL = {torch.bfloat16: 3e-2, torch.float16: 6e-3}  # normwise, as the conformance suite
DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1}


def _runtime():
    from flashoverlap_backends.cuda import kernels
    return kernels.runtime_library()


def _reference(reduced, residual, weight, eps):
    """(normed, residual_out) in float64."""
    x = residual.double() + reduced.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double(), x


def _within_rounding(got, want, what):
    """Each element within one rounding of ``got``'s dtype of ``want`` (plus float32 noise):
    a misplaced tile or row, or an element left unwritten, fails."""
    want = want.double()
    bound = torch.finfo(got.dtype).eps * want.abs() + 1e-5 * float(want.abs().max()) + 1e-30
    bad = ~((got.double() - want).abs() <= bound)
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} elements off, first at "
                           f"{bad.nonzero()[0].tolist()}")


def _poison_allocator(rows, n, dtype):
    """Leave NaN in the blocks the next allocations of [rows, n] will reuse (the caching
    allocator hands back the last freed block of a size), so that an output the op leaves
    unwritten shows."""
    blocks = [torch.full((rows, n), float("nan"), device="cuda", dtype=dtype) for _ in range(4)]
    del blocks


# ---- the kernel alone -------------------------------------------------------------------------

def _shuffled_layout(rows, n, tile, rng):
    """A block's tiles stored back to back in a random order (as groups and ranks leave them)."""
    tiles = block_tiles(rows, n, tile, Schedule(rng.choice("nm"), rng.choice([1, 2, 8])))
    order = list(range(len(tiles)))
    rng.shuffle(order)
    offsets, at = [0] * len(tiles), 0
    for i in order:
        offsets[i], at = at, at + tiles[i].numel
    return tiles, offsets, at


def _run_kernel(src, table, rows, n, tile, residual, ld_residual, weight, normed, resid_out,
                ld_out, eps):
    _runtime().add_rmsnorm_tiles(
        src.data_ptr(), table.data_ptr(), rows, n, tile, DTYPE_CODES[residual.dtype],
        residual.data_ptr(), ld_residual, weight.data_ptr(), int(weight.dtype == torch.float32),
        eps, normed.data_ptr(), resid_out.data_ptr(), ld_out,
        torch.cuda.current_stream().cuda_stream)


@pytest.mark.parametrize("rows, n, tile", [
    (1, 4096, (128, 256)), (7, 127, (128, 256)), (300, 1000, (128, 256)), (129, 5120, (128, 128)),
    (1025, 8192, (128, 256)), (3, 20000, (128, 256)), (2, 4100, (128, 256)), (257, 8, (128, 128)),
    (5, 1, (128, 128))])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weight_f32", [False, True])
def test_kernel_reads_rows_through_the_band_table(rows, n, tile, dtype, weight_f32):
    """N not a multiple of 8 (element path), rows past the registers (20000, 4100: the second
    pass), partial bands and column tiles, 1 to 1025 rows."""
    rng = random.Random()
    tiles, offsets, numel = _shuffled_layout(rows, n, tile, rng)
    src = torch.randn(numel, device="cuda", dtype=dtype)
    table = torch.tensor(band_offsets(tiles, offsets, rows, n, tile), dtype=torch.int64,
                         device="cuda")
    residual = torch.randn(rows, n, device="cuda", dtype=dtype)
    weight = torch.randn(n, device="cuda", dtype=torch.float32 if weight_f32 else dtype)
    normed, resid_out = (torch.full_like(residual, float("nan")) for _ in range(2))
    eps = rng.choice([1e-6, 1e-5, 0.1])
    _run_kernel(src, table, rows, n, tile, residual, n, weight, normed, resid_out, n, eps)
    torch.cuda.synchronize()
    reduced = unpack_tiles(src, offsets, tiles, torch.empty_like(residual))
    want_n, want_r = _reference(reduced, residual, weight, eps)
    _within_rounding(normed, want_n, "normed")
    _within_rounding(resid_out, want_r, "residual_out")


def test_kernel_with_strided_and_unaligned_operands():
    """A residual that is a column slice of a wider matrix, one that starts an element past a
    16-byte boundary (element path), outputs with row padding that must stay untouched."""
    rows, n, tile = 300, 1000, (128, 256)
    tiles, offsets, numel = _shuffled_layout(rows, n, tile, random.Random())
    src = torch.randn(numel, device="cuda", dtype=torch.bfloat16)
    table = torch.tensor(band_offsets(tiles, offsets, rows, n, tile), dtype=torch.int64,
                         device="cuda")
    wide = torch.randn(rows, n + 24, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(n + 1, device="cuda", dtype=torch.bfloat16)
    reduced = unpack_tiles(src, offsets, tiles, torch.empty(rows, n, device="cuda",
                                                            dtype=torch.bfloat16))
    for residual, w in ((wide[:, :n], weight[:n]), (wide[:, 1:n + 1], weight[1:])):
        out = torch.full((2, rows, n + 8), float("nan"), device="cuda", dtype=torch.bfloat16)
        _run_kernel(src, table, rows, n, tile, residual, n + 24, w, out[0], out[1], n + 8, 1e-6)
        torch.cuda.synchronize()
        want_n, want_r = _reference(reduced, residual, w, 1e-6)
        _within_rounding(out[0, :, :n], want_n, "normed")
        _within_rounding(out[1, :, :n], want_r, "residual_out")
        assert torch.isnan(out[:, :, n:]).all(), "a write past N, into the rows' padding"


# ---- fo.overlap_add_rmsnorm on the cuda backend ---------------------------------------------------

def _operands(m, n, k, dtype, col_major=True):
    """a, b, residual, weight of one call (world size 1: reduce_scatter keeps every row)."""
    a, b = _inputs(m, n, k, dtype, col_major)
    return (a, b, torch.randn(m, n, device="cuda", dtype=dtype),
            torch.randn(n, device="cuda", dtype=dtype))


def _check_call(a, b, residual, weight, eps, op, got):
    """The fused results against float64 (normwise) and, within one rounding, against the
    unfused torch path on the same GEMM's result (fo.overlap: the same kernel and plan)."""
    normed, resid = got
    reduced = fo.overlap(a, b, op, backend="cuda")
    torch.cuda.synchronize()
    unfused = add_rmsnorm(reduced, residual, weight, eps)
    _within_rounding(normed, unfused[0], "normed against the unfused path")
    _within_rounding(resid, unfused[1], "residual_out against the unfused path")
    want = _reference(a.double() @ b.double(), residual, weight, eps)
    for what, g, w in (("normed", normed, want[0]), ("residual_out", resid, want[1])):
        wrong = normwise_mismatch(g, w.cpu(), RTOL[a.dtype], what)  # want on the host
        assert wrong is None, wrong


def _prepared(a, b, op):
    return api.prepared_call(a, b, op, backend="cuda")


@pytest.mark.parametrize("op", ["allreduce", "reduce_scatter"])
@pytest.mark.parametrize("shape", [(1, 4096, 4096), (7, 127, 33), (777, 1000, 264),
                                   (2048, 5120, 512), (300, 20000, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_overlap_add_rmsnorm_world1(op, shape, dtype):
    """Four calls of one key, fresh operands each: the first (kernels loaded with syncs), then
    its graph captured and replayed, re-pointed at every call's operands and outputs."""
    m, n, k = shape
    for call in range(4):
        a, b, residual, weight = _operands(m, n, k, dtype)
        eps = (1e-6, 1e-5)[call % 2]
        _poison_allocator(m, n, dtype)
        got = fo.overlap_add_rmsnorm(a, b, residual, weight, eps=eps, op=op, backend="cuda")
        torch.cuda.synchronize()
        _check_call(a, b, residual, weight, eps, op, got)
    assert _prepared(a, b, op).graph_state(fused=True) == 1


@pytest.mark.parametrize("op", ["allreduce", "reduce_scatter"])
def test_with_an_nccl_group_of_one(op, nccl_group):
    """The native call with its collective (a device-side wait per group, NCCL on each group's
    region; reduce_scatter receives into its staging buffer)."""
    for shape in ((1, 4096, 512), (1000, 1000, 1000), (4097, 384, 72)):
        for col_major in (True, False):
            for _ in range(3):
                a, b, residual, weight = _operands(*shape, torch.bfloat16, col_major)
                _poison_allocator(shape[0], shape[1], torch.bfloat16)
                got = fo.overlap_add_rmsnorm(a, b, residual, weight, op=op)
                torch.cuda.synchronize()
                _check_call(a, b, residual, weight, 1e-6, op, got)


@pytest.mark.parametrize("replay", ["1", "0"])
def test_replays_follow_moving_residual_weight_and_eps(replay, monkeypatch, nccl_group):
    """Residual, weight and eps move between calls; a residual one element past a 16-byte
    boundary (another kernel: the graph is captured afresh), float32 and float16 weights with
    bf16 activations."""
    monkeypatch.setenv("FLASHOVERLAP_CUDA_GRAPH", replay)
    api.forget_prepared()
    m, n, k = 640, 2048, 256
    a, b = _inputs(m, n, k, torch.bfloat16)
    spare = torch.randn(m * n + 8, device="cuda", dtype=torch.bfloat16)
    cases = [("plain", torch.bfloat16), ("plain", torch.bfloat16), ("unaligned", torch.bfloat16),
             ("plain", torch.float32), ("unaligned", torch.float16), ("plain", torch.bfloat16)]
    for i, (kind, weight_dtype) in enumerate(cases):
        residual = (spare[1:m * n + 1].view(m, n) if kind == "unaligned"
                    else torch.randn(m, n, device="cuda", dtype=torch.bfloat16))
        weight = torch.randn(n, device="cuda", dtype=weight_dtype)
        eps = 10.0 ** -(i + 3)
        _poison_allocator(m, n, torch.bfloat16)
        got = fo.overlap_add_rmsnorm(a, b, residual, weight, eps=eps, backend="cuda")
        torch.cuda.synchronize()
        _check_call(a, b, residual, weight, eps, "allreduce", got)
        spare.normal_()
    assert _prepared(a, b, "allreduce").graph_state(fused=True) == (1 if replay == "1" else 0)
    api.forget_prepared()


def test_two_streams_share_nothing(nccl_group):
    """Calls of one key in flight on two streams, each with its own inputs: every round equal
    to the same call made alone."""
    rounds = int(os.environ.get("FO_CONCURRENT_ROUNDS", "200"))
    m, n, k = 1024, 2048, 512
    inputs = [_operands(m, n, k, torch.bfloat16) for _ in range(2)]
    expected = [fo.overlap_add_rmsnorm(*ops) for ops in inputs]
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    for i in range(rounds):
        results = []
        for ops, s in zip(inputs, streams):
            with torch.cuda.stream(s):
                results.append(fo.overlap_add_rmsnorm(*ops))
        if i % 50 == 49 or i == rounds - 1:
            torch.cuda.synchronize()
            for got, want in zip(results, expected):
                assert all(torch.equal(g, w) for g, w in zip(got, want)), \
                    f"round {i}: a call was disturbed by the other stream"


def test_captured_in_the_callers_graph(nccl_group):
    """A warmed-up key captured in a torch CUDA graph, replayed on fresh values of its static
    inputs."""
    m, n, k = 768, 1536, 320
    a, b, residual, weight = _operands(m, n, k, torch.bfloat16)
    fo.overlap_add_rmsnorm(a, b, residual, weight)  # the key's first call: outside the capture
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fo.overlap_add_rmsnorm(a, b, residual, weight)  # this stream's own state, first
        with torch.cuda.graph(graph, stream=stream):
            normed, resid = fo.overlap_add_rmsnorm(a, b, residual, weight)
    torch.cuda.synchronize()
    for _ in range(3):
        for t in (a, b, residual, weight):
            t.copy_(torch.randn_like(t))
        normed.fill_(float("nan"))
        resid.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check_call(a, b, residual, weight, 1e-6, "allreduce", (normed, resid))


LAZY_SCRIPT = textwrap.dedent("""
    import os, tempfile, torch, torch.distributed as dist
    import flashoverlap_core as fo
    assert os.environ.get("CUDA_MODULE_LOADING", "LAZY") == "LAZY"
    dist.init_process_group("nccl", init_method="file://" + tempfile.mktemp(), rank=0,
                            world_size=1, device_id=torch.device("cuda", 0))
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16).t()
    residual = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    x = residual.double() + a.double() @ b.double()
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
    for op in ("allreduce", "reduce_scatter"):
        for _ in range(3):
            normed, resid = fo.overlap_add_rmsnorm(a, b, residual, weight, op=op)
        torch.cuda.synchronize()
        err = ((normed.double() - want).abs().max() / want.abs().max()).item()
        assert err < 3e-2, (op, err)
    dist.destroy_process_group()
    print("LAZY_OK")
""")


def test_fresh_process_with_lazy_loading_does_not_hang():
    env = {k: v for k, v in os.environ.items() if k != "CUDA_MODULE_LOADING"}
    proc = subprocess.run([sys.executable, "-c", LAZY_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "LAZY_OK" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("op", ["allreduce", "reduce_scatter"])
def test_the_default_plain_path_runs_the_fused_kernel_over_rows(op, monkeypatch, nccl_group):
    """At world size 1 the default call runs the plain path (issue 31): the device's GEMM, the
    collective, then the backend's fused add + RMSNorm over the result's rows (one kernel,
    ``CudaBackend.add_rmsnorm_rows``), decode sizes and ragged N included."""
    monkeypatch.delenv("FLASHOVERLAP_STRATEGY", raising=False)
    api.forget_prepared()
    from flashoverlap_backends.cuda import add_rmsnorm as norm_module
    used = []
    real = norm_module.add_rmsnorm_rows
    monkeypatch.setattr(norm_module, "add_rmsnorm_rows", lambda *a: used.append(1) or real(*a))
    import flashoverlap_backends.cuda.backend as backend_module
    monkeypatch.setattr(backend_module, "add_rmsnorm_rows", norm_module.add_rmsnorm_rows)
    for shape in ((1, 4096, 512), (16, 1000, 256), (257, 8192, 1024)):
        a, b, residual, weight = _operands(*shape, torch.bfloat16, True)
        _poison_allocator(shape[0], shape[1], torch.bfloat16)
        got = fo.overlap_add_rmsnorm(a, b, residual, weight, op=op)
        torch.cuda.synchronize()
        _check_call(a, b, residual, weight, 1e-6, op, got)
    assert used and all(c["strategy"] == "sequential" for c in fo.prepared_calls())
    api.forget_prepared()
