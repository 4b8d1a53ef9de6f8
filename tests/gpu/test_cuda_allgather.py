"""GPU tests of the cuda backend's allgather (backends/cuda/gather_call.py): at world size 1, the
plain in-place GEMM, the loopback path, which gathers through the buffer and its flags so that
the GEMM's tiles really wait (FLASHOVERLAP_CUDA_GATHER_LOOPBACK=1), and the own rows' path of the
other world sizes (=2: one copy on the compute stream, the GEMM on the gathered buffer).

Every case that runs the waiting GEMM runs in a fresh process under a timeout (a GEMM that
waits for a flag nobody sets would hang the test process): the ``case_*`` functions below are
run by ``python -c`` with the knobs in the environment. Ragged shapes, both dtypes and layouts
of b, out= poisoned and not, back-to-back calls with fresh inputs, CUDA-graph replays, two
streams, and the stress test with a slow transfer, plus its negative control: a GEMM that does
not wait (FLASHOVERLAP_CUDA_GATHER_NO_WAIT=1) must be caught reading rows before they arrive.

fp8 (issue 32, sm90): e4m3 a and b with float32 scales of every kind (tensor-wise, row-wise,
row-wise a with a 0-dim scale_b, block-wise in torch's layouts) on the same three paths: the
e4m3 rows and this rank's scale_a go through the gathered buffers (gather_call.cu), the GEMM
with scales waits for its rows; ragged shapes, fresh inputs and scales every call, graph replays
with new scale values, two streams, and the slow-transfer stress.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_cuda import _inputs, needs_cuda  # the cuda tests' inputs and availability skip

import flashoverlap_core as fo
from flashoverlap_core import fp8

pytestmark = pytest.mark.timeout(900)

HERE = Path(__file__).resolve().parent
SHAPES = [(1, 1, 1), (7, 127, 33), (130, 257, 8), (1000, 1000, 1000), (4097, 384, 72),
          (300, 4099, 136)]
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


# ---- helpers (also used inside the child processes) ---------------------------------------------

def error(out, a, b) -> float:
    """Largest error of out against the float64 product, in units of the dtype's rounding of
    |a| @ |b| (<= 4 passes); inf for NaN (an unwritten poisoned element)."""
    ref = a.double() @ b.double()
    bound = (a.double().abs() @ b.double().abs()) * torch.finfo(a.dtype).eps + 1e-6
    if torch.isnan(out).any():
        return float("inf")
    return ((out.double() - ref).abs() / bound).max().item()


def check(out, a, b, what=""):
    e = error(out, a, b)
    assert e <= 4, f"{what}: error {e:.3g} x eps-bound against float64"


def chunked_plan(m, n, k, dtype, bands_per_chunk=1):
    """A plan whose chunks are ``bands_per_chunk`` bands each (many flags, so tiles wait)."""
    base = fo.plan(m, n, k, op="allgather", dtype=dtype, backend="cuda")
    unit = -(-n // base.tile[1])
    bands = base.num_tiles // unit
    sizes = [unit * min(bands_per_chunk, bands - s) for s in range(0, bands, bands_per_chunk)]
    return fo.plan(m, n, k, op="allgather", dtype=dtype, backend="cuda", tile=base.tile,
                   group_sizes=sizes)


# ---- fp8 (issue 32) -------------------------------------------------------------------------
F8 = getattr(torch, "float8_e4m3fn", None)
FP8_SCALINGS = ("tensorwise", "rowwise", "mixed", "blockwise")  # mixed: [m, 1] a, 0-dim b
FP8_SHAPES = [(1, 1, 1), (7, 127, 33), (130, 257, 8), (1000, 1000, 1000), (4097, 384, 72),
              (300, 4099, 136), (640, 512, 300)]


def fp8_inputs(m, n, k, scaling, seed=None):
    """e4m3 a [m, k], b = w.t() of an e4m3 [n, k] w, and scales of ``scaling`` (block-wise:
    scale_a [m, ceil(k/128)] outer-dim-major, as torch keeps it, scale_b [ceil(k/128),
    ceil(n/128)])."""
    g = torch.Generator(device="cuda")
    if seed is not None:
        g.manual_seed(seed)
    else:  # fresh values every call (a new generator's default seed is always the same)
        g.seed()
    a = (torch.randn(m, k, device="cuda", generator=g) * 2).to(F8)
    b = (torch.randn(n, k, device="cuda", generator=g) * 2).to(F8).t()
    if scaling == "blockwise":
        kb, nb = -(-k // 128), -(-n // 128)
        sa = (torch.rand(kb, m, device="cuda", generator=g) + 0.25).t()
        sb = torch.rand(kb, nb, device="cuda", generator=g) + 0.25
        return a, b, sa, sb
    sa = torch.rand((m, 1) if scaling != "tensorwise" else (), device="cuda", generator=g) + 0.25
    sb = torch.rand((1, n) if scaling == "rowwise" else (), device="cuda", generator=g) + 0.25
    return a, b, sa, sb


def fp8_dequantized(a, b, sa, sb, blockwise):
    """a * scale_a and b * scale_b in float64 (block-wise scales repeated over their blocks)."""
    (m, k), n = a.shape, b.shape[1]
    if blockwise:
        sa = sa.double().repeat_interleave(128, 1)[:, :k]
        sb = sb.double().repeat_interleave(128, 0)[:k].repeat_interleave(128, 1)[:, :n]
    return a.double() * sa.double(), b.double() * sb.double()


def fp8_check(out, a, b, sa, sb, scaling, what=""):
    """Against float64 of the dequantized inputs: every element within the output's rounding
    plus 2^-9 of its sum of |products| (e4m3 tensor-core accumulation), the whole normwise
    (test_cuda_fp8.py's bounds); nothing unwritten."""
    x, y = fp8_dequantized(a, b, sa, sb, scaling == "blockwise")
    ref, mass = x @ y, x.abs() @ y.abs()
    assert not torch.isnan(out).any(), f"{what}: elements never written (NaN)"
    err = (out.double() - ref).abs()
    over = err > torch.finfo(out.dtype).eps * ref.abs() + 2.0 ** -9 * mass + 1e-6
    assert not over.any(), f"{what}: {int(over.sum())} elements outside the bound, max err " \
                           f"{err.max().item():.4g}"
    rel = (err.norm() / ref.norm().clamp(min=1e-30)).item()
    assert rel < (1.5e-2 if out.dtype == torch.bfloat16 else 5e-3), f"{what}: normwise {rel:.3g}"


def fp8_plan(m, n, k, scaling, out_dtype, bands_per_chunk=None):
    """An fp8 allgather plan, its chunks ``bands_per_chunk`` bands each (many flags) if given."""
    kw = dict(op="allgather", dtype=F8, out_dtype=out_dtype, backend="cuda",
              scaling="blockwise" if scaling == "blockwise" else None)
    base = fo.plan(m, n, k, **kw)
    if bands_per_chunk is None:
        return base
    unit = -(-n // base.tile[1])
    bands = base.num_tiles // unit
    sizes = [unit * min(bands_per_chunk, bands - s) for s in range(0, bands, bands_per_chunk)]
    return fo.plan(m, n, k, tile=base.tile, group_sizes=sizes, **kw)


# ---- cases, run in child processes -------------------------------------------------------------

def case_shapes(dtype: str):
    """Every shape, both layouts of b, out= poisoned and not, default arguments and a chunked
    plan; three calls each with fresh inputs."""
    dt = DTYPES[dtype]
    for m, n, k in SHAPES:
        for col_major in (True, False):
            for plan in (None, chunked_plan(m, n, k, dt)):
                for i in range(3):
                    a, b = _inputs(m, n, k, dt, col_major)
                    if i % 2:
                        out = torch.full((m, n), float("nan"), device="cuda", dtype=dt)
                        assert fo.overlap(a, b, "allgather", plan=plan, out=out) is out
                    else:
                        out = fo.overlap(a, b, "allgather", plan=plan)
                    torch.cuda.synchronize()
                    check(out, a, b, f"{m}x{n}x{k} col={col_major} plan={plan is not None} call {i}")
    return {"ok": True}


def case_strided_a():
    """a with a row stride larger than K (a slice of a wider tensor) and a transposed a."""
    wide = torch.randn(333, 200, device="cuda", dtype=torch.bfloat16)
    a, b = wide[:, 10:74], torch.randn(64, 520, device="cuda", dtype=torch.bfloat16)
    out = fo.overlap(a, b, "allgather")
    torch.cuda.synchronize()
    check(out, a, b, "strided a")
    at = torch.randn(64, 333, device="cuda", dtype=torch.bfloat16).t()
    out = fo.overlap(at, b, "allgather")
    torch.cuda.synchronize()
    check(out, at, b, "transposed a")
    return {"ok": True}


def case_back_to_back(calls: int):
    """``calls`` calls in a row with fresh inputs (queued without syncs), each result checked."""
    m, n, k = 1500, 1000, 264
    plan = chunked_plan(m, n, k, torch.bfloat16, 2)
    done = []
    for i in range(calls):
        a, b = _inputs(m, n, k, torch.bfloat16, i % 2 == 0)
        done.append((fo.overlap(a, b, "allgather", plan=plan), a, b))
        if len(done) == 10:
            torch.cuda.synchronize()
            for j, (out, a, b) in enumerate(done):
                check(out, a, b, f"call {i - 9 + j}")
            done.clear()
    return {"ok": True}


def case_graph(replays: int):
    """A call captured in a CUDA graph after one eager call; each replay after new inputs are
    copied into the captured tensors gives their product."""
    m, n, k = 1100, 777, 200
    plan = chunked_plan(m, n, k, torch.bfloat16, 2)
    a, b = _inputs(m, n, k, torch.bfloat16, True)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    fo.overlap(a, b, "allgather", plan=plan, out=out)
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fo.overlap(a, b, "allgather", plan=plan, out=out)  # this stream's state, made eagerly
    stream.synchronize()
    with torch.cuda.graph(graph, stream=stream):
        fo.overlap(a, b, "allgather", plan=plan, out=out)
    for i in range(replays):
        new_a, new_b = _inputs(m, n, k, torch.bfloat16, True)
        a.copy_(new_a)
        b.copy_(new_b)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(out, a, b, f"replay {i}")
    return {"ok": True}


def case_first_call_in_capture():
    a, b = _inputs(640, 896, 128, torch.bfloat16, True)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    try:
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            fo.overlap(a, b, "allgather")
    except ValueError as e:
        message = str(e)
    else:
        return {"ok": False, "why": "no error"}
    out = fo.overlap(a, b, "allgather")  # eagerly it works
    torch.cuda.synchronize()
    check(out, a, b, "after the refused capture")
    return {"ok": "outside the capture" in message, "message": message}


def on_two_streams(call, expected, rounds: int) -> dict:
    """``call(i, out)`` on stream i of two, ``rounds`` times, both in flight at once, into an
    out per stream like ``expected[i]``: every 50 rounds and at the end each out must equal
    ``expected[i]`` (then poisoned again)."""
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs = [torch.empty_like(want) for want in expected]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    for r in range(rounds):
        for i, (out, s) in enumerate(zip(outs, streams)):
            with torch.cuda.stream(s):
                call(i, out)
        if r % 50 == 49 or r == rounds - 1:
            torch.cuda.synchronize()
            for out, want in zip(outs, expected):
                assert torch.equal(out, want), f"round {r}: a call was disturbed by the other stream"
            for out in outs:
                out.fill_(float("nan"))
    return {"ok": True}


def case_two_streams(rounds: int):
    """Two calls of one key in flight on two streams, each with its own buffer and flags."""
    m, n, k = 1024, 2048, 512
    plan = chunked_plan(m, n, k, torch.bfloat16, 2)
    pairs = [_inputs(m, n, k, torch.bfloat16, True, seed=s) for s in (1, 2)]
    expected = [fo.overlap(a, b, "allgather", plan=plan) for a, b in pairs]
    torch.cuda.synchronize()
    for want, (a, b) in zip(expected, pairs):
        check(want, a, b, "eager")
    def call(i, out):
        a, b = pairs[i]
        fo.overlap(a, b, "allgather", plan=plan, out=out)

    return on_two_streams(call, expected, rounds)


def case_stress(calls: int):
    """Fresh inputs every call into one chunked plan (a flag per band), the transfer slowed by
    FLASHOVERLAP_CUDA_GATHER_DELAY_US per chunk: the count of wrong results. A GEMM that reads
    a chunk before its flag is set reads the previous call's rows and is wrong."""
    m, n, k = 2048, 1024, 512
    plan = chunked_plan(m, n, k, torch.bfloat16, 1)
    wrong, errors = 0, []
    for i in range(calls):
        a, b = _inputs(m, n, k, torch.bfloat16, i % 2 == 0)
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        fo.overlap(a, b, "allgather", plan=plan, out=out)
        torch.cuda.synchronize()
        e = error(out, a, b)
        errors.append(e)
        wrong += e > 4
    return {"ok": True, "wrong": wrong, "calls": calls, "chunks": plan.num_groups,
            "max_error": max(errors)}


def case_fp8_shapes(scaling: str, out_name: str):
    """fp8: every shape, the default plan and a chunked one, out= poisoned and not, three calls
    each with fresh inputs and scales; the key's runner is cuda's allgather call."""
    out_dtype = DTYPES[out_name]
    for m, n, k in FP8_SHAPES:
        # a shape whose block-wise scales have row-wise shapes (one group of 128 k and one
        # block of 128 columns, say) is a row-wise call: a block-wise plan does not fit it
        a, b, sa, sb = fp8_inputs(m, n, k, scaling)
        kind = fp8.scaling_kind(m, n, k, sa, sb)
        chunked = fp8_plan(m, n, k, kind if scaling == "blockwise" else scaling, out_dtype, 1)
        for plan in (None, chunked):
            for i in range(3):
                a, b, sa, sb = fp8_inputs(m, n, k, scaling)
                kw = dict(scale_a=sa, scale_b=sb, out_dtype=out_dtype, plan=plan, backend="cuda")
                if i % 2:
                    out = torch.full((m, n), float("nan"), device="cuda", dtype=out_dtype)
                    assert fo.overlap(a, b, "allgather", out=out, **kw) is out
                else:
                    out = fo.overlap(a, b, "allgather", **kw)
                torch.cuda.synchronize()
                assert out.dtype == out_dtype
                fp8_check(out, a, b, sa, sb, scaling, f"fp8 {scaling} {m}x{n}x{k} "
                          f"plan={plan is not None} call {i}")
            runners = {(c["backend"], c["runner"]) for c in fo.prepared_calls()}
            assert runners == {("cuda", "CudaGatherCall")}, runners
    return {"ok": True}


def case_fp8_graph(scaling: str, replays: int):
    """fp8: a call captured after one eager call; each replay after new a, b and scale values
    are copied into the captured tensors gives their product."""
    m, n, k = 1100, 777, 300
    plan = fp8_plan(m, n, k, scaling, torch.bfloat16, 2)
    a, b, sa, sb = fp8_inputs(m, n, k, scaling)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    kw = dict(scale_a=sa, scale_b=sb, plan=plan, out=out)
    fo.overlap(a, b, "allgather", **kw)
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fo.overlap(a, b, "allgather", **kw)  # this stream's state, made eagerly
    stream.synchronize()
    with torch.cuda.graph(graph, stream=stream):
        fo.overlap(a, b, "allgather", **kw)
    for i in range(replays):
        for t, new in zip((a, b, sa, sb), fp8_inputs(m, n, k, scaling)):
            t.copy_(new)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        fp8_check(out, a, b, sa, sb, scaling, f"fp8 {scaling} replay {i}")
    return {"ok": True}


def case_fp8_two_streams(rounds: int):
    """fp8: two calls of one key in flight on two streams (each its own gathered rows, scales
    and flags), with scales of their own: every round's results are the eager ones."""
    m, n, k = 1024, 2048, 512
    plan = fp8_plan(m, n, k, "rowwise", torch.bfloat16, 2)
    sets = [fp8_inputs(m, n, k, "rowwise", seed=s) for s in (1, 2)]
    expected = [fo.overlap(a, b, "allgather", scale_a=sa, scale_b=sb, plan=plan)
                for a, b, sa, sb in sets]
    torch.cuda.synchronize()
    for want, (a, b, sa, sb) in zip(expected, sets):
        fp8_check(want, a, b, sa, sb, "rowwise", "eager")
    def call(i, out):
        a, b, sa, sb = sets[i]
        fo.overlap(a, b, "allgather", scale_a=sa, scale_b=sb, plan=plan, out=out)

    return on_two_streams(call, expected, rounds)


def case_fp8_stress(calls: int):
    """case_stress for fp8: fresh e4m3 inputs and scales every call into one chunked plan, the
    transfer slowed per chunk; the count of wrong results."""
    m, n, k = 2048, 1024, 512
    plan = fp8_plan(m, n, k, "rowwise", torch.bfloat16, 1)
    block_plan = fp8_plan(m, n, k, "blockwise", torch.bfloat16, 1)  # a plan of their own
    wrong, wrong_by = 0, dict.fromkeys(("rowwise", "tensorwise", "blockwise"), 0)
    for i in range(calls):
        scaling = ("rowwise", "tensorwise", "blockwise")[i % 3]
        a, b, sa, sb = fp8_inputs(m, n, k, scaling)
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        fo.overlap(a, b, "allgather", scale_a=sa, scale_b=sb, out=out,
                   plan=block_plan if scaling == "blockwise" else plan)
        torch.cuda.synchronize()
        try:
            fp8_check(out, a, b, sa, sb, scaling)
        except AssertionError:
            wrong += 1
            wrong_by[scaling] += 1
    return {"ok": True, "wrong": wrong, "calls": calls, "chunks": plan.num_groups,
            "wrong_by": wrong_by, "libraries": gather_libraries()}


def gather_libraries() -> dict:
    """{scaling kind: the file name of the GEMM library its prepared allgather key runs}."""
    from flashoverlap_core import api

    return {entry.plan.scaling or "rowwise": Path(entry.prepared.gemm.path).name
            for entry in api._prepared.values() if hasattr(entry.prepared, "gemm")}


# ---- the tests: each case in a fresh process -----------------------------------------------------

def run_case(case: str, *args, env: dict | None = None, timeout: int = 300) -> dict:
    code = (f"import sys, json; sys.path.insert(0, {str(HERE)!r}); import test_cuda_allgather as t; "
            f"print('RESULT', json.dumps(t.{case}(*{args!r})))")
    full = dict(os.environ, **(env or {}))
    try:
        proc = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{case}{args} with {env} did not finish in {timeout} s (a GEMM waiting "
                    "for rows that never arrive?)")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (
        f"{case}{args} with {env} failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(lines[-1][len("RESULT "):])


LOOPBACK = {"FLASHOVERLAP_CUDA_GATHER_LOOPBACK": "1"}
PATHS = {"plain": {}, "loopback": LOOPBACK, "own-copy": {"FLASHOVERLAP_CUDA_GATHER_LOOPBACK": "2"},
         "sm80-loopback": dict(LOOPBACK, FLASHOVERLAP_CUDA_ARCH="80")}
EAGER_PATHS = ["plain", "loopback", "own-copy"]


@needs_cuda
@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_ragged_shapes_match_float64(path, dtype):
    assert run_case("case_shapes", dtype, env=PATHS[path], timeout=600)["ok"]


@needs_cuda
@pytest.mark.parametrize("path", EAGER_PATHS)
def test_strided_a(path):
    assert run_case("case_strided_a", env=PATHS[path])["ok"]


@needs_cuda
@pytest.mark.parametrize("path", EAGER_PATHS)
def test_back_to_back_with_fresh_inputs(path):
    assert run_case("case_back_to_back", 100, env=PATHS[path])["ok"]


@needs_cuda
@pytest.mark.parametrize("path", EAGER_PATHS)
def test_graph_replays_follow_new_inputs(path):
    assert run_case("case_graph", 20, env=PATHS[path])["ok"]


@needs_cuda
@pytest.mark.parametrize("path", EAGER_PATHS)
def test_first_call_inside_graph_capture_is_a_clear_error(path):
    result = run_case("case_first_call_in_capture", env=PATHS[path])
    assert result["ok"], result


@needs_cuda
@pytest.mark.parametrize("path", EAGER_PATHS)
def test_two_streams_share_nothing(path):
    assert run_case("case_two_streams", 200, env=PATHS[path])["ok"]


STRESS_DELAY_US = "150"


@needs_cuda
@pytest.mark.parametrize("arch", ["native", "80"])
def test_stress_slow_transfer_results_exact(arch):
    """The transfer of every chunk is slowed down, so the GEMM is far ahead of it: with the
    waits every result is right."""
    env = dict(LOOPBACK, FLASHOVERLAP_CUDA_GATHER_DELAY_US=STRESS_DELAY_US)
    if arch == "80":
        env["FLASHOVERLAP_CUDA_ARCH"] = "80"
    result = run_case("case_stress", int(os.environ.get("FO_STRESS_RUNS", "30")), env=env)
    assert result["wrong"] == 0, result


@needs_cuda
@pytest.mark.parametrize("arch", ["native", "80"])
def test_stress_catches_a_gemm_that_does_not_wait(arch):
    """Negative control: the same stress with flags that read as already set. The GEMM then
    reads chunks before they arrive, and the stress test must see wrong results (else it
    could not catch a broken wait)."""
    env = dict(LOOPBACK, FLASHOVERLAP_CUDA_GATHER_DELAY_US=STRESS_DELAY_US,
               FLASHOVERLAP_CUDA_GATHER_NO_WAIT="1")
    if arch == "80":
        env["FLASHOVERLAP_CUDA_ARCH"] = "80"
    result = run_case("case_stress", 10, env=env)
    # the first call runs phase by phase (the warm-up), so it is right; the others must not be
    assert result["wrong"] >= 5, result


# ---- fp8 (issue 32) ---------------------------------------------------------------------------
needs_sm90 = pytest.mark.skipif(
    F8 is None or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="fp8 allgather's GEMM (e4m3) needs sm_90 (Hopper)")


@needs_cuda
@needs_sm90
@pytest.mark.parametrize("path", EAGER_PATHS)
@pytest.mark.parametrize("out_name", sorted(DTYPES))
@pytest.mark.parametrize("scaling", FP8_SCALINGS)
def test_fp8_ragged_shapes_match_float64(scaling, out_name, path):
    assert run_case("case_fp8_shapes", scaling, out_name, env=PATHS[path], timeout=600)["ok"]


@needs_cuda
@needs_sm90
@pytest.mark.parametrize("path", EAGER_PATHS)
@pytest.mark.parametrize("scaling", FP8_SCALINGS)
def test_fp8_graph_replays_follow_new_inputs_and_scales(scaling, path):
    assert run_case("case_fp8_graph", scaling, 10, env=PATHS[path])["ok"]


@needs_cuda
@needs_sm90
@pytest.mark.parametrize("path", EAGER_PATHS)
def test_fp8_two_streams_share_nothing(path):
    assert run_case("case_fp8_two_streams", 100, env=PATHS[path])["ok"]


@needs_cuda
@needs_sm90
def test_fp8_stress_slow_transfer_results_exact():
    """Every result right with the transfer slowed per chunk; tensor- and row-wise scales run
    CUTLASS's kernel (its producer warp waits for the rows: gemm_sm90_stock_ex_scaled.cu),
    block-wise gemm_sm90.cu's (kernels.stock_op)."""
    env = dict(LOOPBACK, FLASHOVERLAP_CUDA_GATHER_DELAY_US=STRESS_DELAY_US)
    result = run_case("case_fp8_stress", int(os.environ.get("FO_STRESS_RUNS", "30")), env=env)
    assert result["wrong"] == 0, result
    libraries = result["libraries"]
    assert "_gather_stock-" in libraries["rowwise"], libraries
    assert "_stock" not in libraries["blockwise"] and "_gather-" in libraries["blockwise"]


@needs_cuda
@needs_sm90
def test_fp8_stress_catches_a_gemm_that_does_not_wait():
    """Negative control of the fp8 stress, CUTLASS's kernel included: with flags that read as
    already set the GEMMs read chunks before they arrive, and the stress sees wrong results
    (each key's first call runs phase by phase: of the 8 tensor- and row-wise calls, 6 may
    be wrong)."""
    env = dict(LOOPBACK, FLASHOVERLAP_CUDA_GATHER_DELAY_US=STRESS_DELAY_US,
               FLASHOVERLAP_CUDA_GATHER_NO_WAIT="1")
    result = run_case("case_fp8_stress", 12, env=env)
    assert "_gather_stock-" in result["libraries"]["rowwise"], result
    assert result["wrong_by"]["rowwise"] + result["wrong_by"]["tensorwise"] >= 4, result
