"""GPU tests of the cuda backend: signal ordering, back-to-back calls, graph replays, offload,
and lazy module loading in a fresh process. Run by ci/gpu.sh on a machine with a GPU; every
test skips with its reason elsewhere (and fails under FLASHOVERLAP_REQUIRE_HW=1)."""
from __future__ import annotations

import os
import random
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch

import flashoverlap_core as fo
from flashoverlap_core.transfers import HostOffload

pytestmark = pytest.mark.timeout(600)


def _cuda_reason() -> str | None:
    status = {s.name: s for s in fo.backends()}.get("cuda")
    if status is None:
        return "the cuda backend is not installed"
    return None if status.available else f"cuda backend unavailable: {status.reason}"


REASON = _cuda_reason()
if REASON and os.environ.get("FLASHOVERLAP_REQUIRE_HW") == "1":
    raise RuntimeError(f"FLASHOVERLAP_REQUIRE_HW=1 but {REASON}")
needs_cuda = pytest.mark.skipif(REASON is not None, reason=REASON or "")


@pytest.fixture
def nccl_group():
    """A NCCL process group of one rank, so that the calls' collectives really run (and are
    captured and replayed in graphs)."""
    import torch.distributed as dist

    store = tempfile.mktemp(prefix="fo-gpu-test-")
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    yield dist.group.WORLD
    dist.destroy_process_group()


def _inputs(m, n, k, dtype, col_major=True, seed=None):
    g = torch.Generator(device="cuda").manual_seed(seed if seed is not None else random.randrange(2**31))
    a = torch.randn(m, k, device="cuda", dtype=dtype, generator=g)
    if col_major:
        b = torch.randn(n, k, device="cuda", dtype=dtype, generator=g).t()
    else:
        b = torch.randn(k, n, device="cuda", dtype=dtype, generator=g)
    return a, b


def _check(out, a, b):
    ref = a.double() @ b.double()
    bound = a.double().abs() @ b.double().abs()
    eps = torch.finfo(a.dtype).eps
    err = (out.double() - ref).abs()
    assert not torch.isnan(out).any()
    assert (err <= 4 * eps * bound + 1e-6).all(), f"max err {err.max().item()}"


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("col_major", [True, False])
@pytest.mark.parametrize("shape", [(1, 1, 1), (7, 127, 33), (1000, 1000, 1000), (4097, 384, 72),
                                   (256, 8192, 64)])
def test_allreduce_world1_matches_float64(dtype, col_major, shape):
    a, b = _inputs(*shape, dtype, col_major)
    out = torch.full((shape[0], shape[1]), float("nan"), device="cuda", dtype=dtype)
    res = fo.overlap(a, b, "allreduce", out=out, backend="cuda")
    torch.cuda.synchronize()
    assert res is out
    _check(out, a, b)


class RegionSnapshots:
    """A consumer: copies each region the moment its group's counter has fired."""

    def __init__(self):
        self.copies = []

    def __call__(self, region, index):
        self.copies.append(region.clone())


@needs_cuda
def test_signal_ordering_stress():
    """Each region copied right after its device-side wait must equal the final result."""
    runs = int(os.environ.get("FO_STRESS_RUNS", "1000"))
    rng = random.Random()
    for run in range(runs):
        m, n, k = rng.randint(1, 1500), rng.randint(1, 1500), rng.choice([8, 64, 200, 512])
        dtype = rng.choice([torch.bfloat16, torch.float16])
        a, b = _inputs(m, n, k, dtype, rng.random() < 0.5)
        base = fo.plan(m, n, k, op="custom", dtype=dtype, backend="cuda")
        cuts = sorted(rng.sample(range(1, base.num_tiles), min(3, base.num_tiles - 1)))
        sizes = [y - x for x, y in zip([0] + cuts, cuts + [base.num_tiles])]
        plan = fo.plan(m, n, k, op="custom", dtype=dtype, backend="cuda", group_sizes=sizes)
        snap = RegionSnapshots()
        out = fo.overlap(a, b, snap, plan=plan)
        torch.cuda.synchronize()
        packed = out.flatten()[plan.packed_index().cuda()]
        got = torch.cat(snap.copies)
        assert torch.equal(got.view(torch.int16), packed.view(torch.int16)), \
            f"run {run}: a region was read before its tiles were written ({m}x{n}x{k}, {sizes})"


@needs_cuda
@pytest.mark.parametrize("op", ["allreduce", "reduce_scatter", "all_to_all"])
@pytest.mark.parametrize("shape", [(1, 4096, 512), (7, 127, 33), (1000, 1000, 1000), (4097, 384, 72)])
def test_native_call_with_nccl_matches_float64(op, shape, nccl_group):
    """The native call path (one fo_call_run: GEMM, waits, NCCL, post-reorder) at world size 1
    with a real NCCL communicator, back to back with poisoned outputs."""
    for dtype in (torch.bfloat16, torch.float16):
        for col_major in (True, False):
            for _ in range(3):
                a, b = _inputs(*shape, dtype, col_major)
                out = torch.full((shape[0], shape[1]), float("nan"), device="cuda", dtype=dtype)
                assert fo.overlap(a, b, op, out=out) is out
                torch.cuda.synchronize()
                _check(out, a, b)


@needs_cuda
@pytest.mark.parametrize("op", ["allreduce", "reduce_scatter", "all_to_all", "allgather"])
def test_narrow_tiles_through_the_call(op, nccl_group):
    """The 128x224 and 128x160 kernels (cooperative, the tma epilogue in 32-column blocks) on
    the native call path: "rows" plans (tiles written as final rows) and, for allreduce, a
    "tiles" plan (packed tiles, group sizes that cut bands); ragged shapes (partial last band
    and column tile, K tails), both layouts of b, bf16 and fp16, poisoned outputs, against
    float64. The default plan of a shape whose 128x256 waves are ragged takes them."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("sm_90a kernels need Hopper")
    for (m, n, k), want in (((5120, 5120, 4096), (128, 160)), ((6144, 3584, 2048), (128, 224))):
        assert fo.plan(m, n, k, op="allreduce", dtype=torch.bfloat16, backend="cuda").tile == want
    cases = [(700, 3584, 264, (128, 224)), (1000, 1234, 520, (128, 160)),
             (257, 5120, 72, (128, 160)), (900, 7200, 200, (128, 224))]
    for m, n, k, tile in cases:
        for dtype in (torch.bfloat16, torch.float16):
            for col_major in (True, False):
                plan = fo.plan(m, n, k, op=op, dtype=dtype, backend="cuda", tile=tile)
                plans = [plan]
                if op == "allreduce":
                    plans.append(fo.plan(m, n, k, op=op, dtype=dtype, backend="cuda", tile=tile,
                                         group_sizes=[3, plan.num_tiles - 3]))
                    assert (plans[0].layout, plans[1].layout) == ("rows", "tiles")
                for p, call in ((p, call) for p in plans for call in range(2)):
                    # fresh inputs and output each call: the second replays the first's graph
                    # (all_to_all excepted: it is laid out per call)
                    a, b = _inputs(m, n, k, dtype, col_major)
                    out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
                    assert fo.overlap(a, b, op, plan=p, out=out) is out
                    torch.cuda.synchronize()
                    try:
                        _check(out, a, b)
                    except AssertionError as e:
                        raise AssertionError(f"{op} {m}x{n}x{k} {tile} {dtype} col_major="
                                             f"{col_major} layout {p.layout} call {call}: "
                                             f"{e}") from e


@needs_cuda
@pytest.mark.parametrize("op", ["allreduce", "reduce_scatter", "allgather"])
@pytest.mark.parametrize("shape", [(1, 4096, 512), (16, 8192, 1024), (7, 127, 33), (300, 96, 64)])
def test_plain_path_at_world_size_one(op, shape, nccl_group, monkeypatch):
    """The plain path (FLASHOVERLAP_STRATEGY=plain) on an NCCL group of one rank: the device's
    GEMM and no collective (a collective over one rank is the identity), back to back, with
    poisoned outputs; fp8 too. (At world size > 1 it runs on FlashOverlap's own communicator,
    nccl.PlainCollectives: tests/gpu/test_multirank.py.)"""
    from flashoverlap_core import api
    monkeypatch.setenv("FLASHOVERLAP_STRATEGY", "plain")
    api.forget_prepared()
    try:
        for dtype in (torch.bfloat16, torch.float16):
            for _ in range(3):
                a, b = _inputs(*shape, dtype, True)
                out = torch.full((shape[0], shape[1]), float("nan"), device="cuda", dtype=dtype)
                assert fo.overlap(a, b, op, out=out) is out
                torch.cuda.synchronize()
                _check(out, a, b)
        prepared = _last_prepared()
        assert fo.prepared_calls()[-1]["runner"] == "SequentialCall"
        assert prepared.native is None and prepared.group is None, prepared
        if op != "reduce_scatter":  # fp8 row-wise: _scaled_mm, then the same collective
            m, n, k = shape[0], shape[1], max(16, shape[2] // 16 * 16)
            a8 = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
            w8 = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
            sa = torch.rand(m, 1, device="cuda") + 0.5
            sb = torch.rand(1, n, device="cuda") + 0.5
            got = fo.overlap(a8, w8.t(), op, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
            ref = (a8.double() * sa.double()) @ (w8.double() * sb.double().t()).t()
            torch.testing.assert_close(got.double(), ref, rtol=2e-2, atol=2e-2 * k ** 0.5)
            # where torch's fp8 GEMM refuses N (CUDA's want multiples of 16: N = 127 here), the
            # forced plain path runs dequantized (the default call would overlap)
            from flashoverlap_core.fp8 import scaled_mm_takes
            native = scaled_mm_takes(a8.device, a8.dtype, k, n, True, torch.bfloat16)
            assert native == (n % 16 == 0)
            assert fo.prepared_calls()[-1]["runner"] == (
                "ScaledSequentialCall" if native else "DequantizedCall")
    finally:
        api.forget_prepared()


def _last_prepared():
    from flashoverlap_core import api
    return list(api._prepared.values())[-1].prepared


@needs_cuda
@pytest.mark.parametrize("replay", ["1", "0"])
@pytest.mark.parametrize("arch", ["90", "80"])
@pytest.mark.parametrize("op", ["allreduce", "reduce_scatter", "all_to_all"])
def test_replayed_call_follows_moving_operands(op, arch, replay, monkeypatch, nccl_group):
    """From its second call a key replays its captured graph; the GEMM and post-reorder nodes
    are re-pointed whenever a, b or out move. Fresh operands and fresh (poisoned) outputs every
    call, default arguments and out=, both layouts of b: every result matches float64."""
    if arch == "90" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("sm_90a kernels need Hopper")
    from flashoverlap_core import api
    monkeypatch.setenv("FLASHOVERLAP_CUDA_ARCH", arch)
    monkeypatch.setenv("FLASHOVERLAP_CUDA_GRAPH", replay)
    api.forget_prepared()
    m, n, k = 777, 1000, 264
    plan = fo.plan(m, n, k, op=op, dtype=torch.bfloat16, backend="cuda",
                   group_sizes=None)
    for col_major in (True, False):
        for i in range(12):
            a, b = _inputs(m, n, k, torch.bfloat16, col_major)
            if i % 3 == 2:
                out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                assert fo.overlap(a, b, op, plan=plan, out=out) is out
            else:
                out = fo.overlap(a, b, op, plan=plan)
            torch.cuda.synchronize()
            _check(out, a, b)
        if op == "all_to_all":  # laid out per call from its splits: nothing to replay
            assert _last_prepared().native is not None
            continue
        state = _last_prepared().graph_state()
        assert state == (1 if replay == "1" else 0), f"graph state {state}"
    api.forget_prepared()


@needs_cuda
def test_two_streams_share_nothing(nccl_group):
    """Two calls of the same key in flight on two streams: their own counters, buffers and
    communication streams, so 1,000 rounds stay exact and nothing hangs."""
    rounds = int(os.environ.get("FO_CONCURRENT_ROUNDS", "1000"))
    m, n, k = 1024, 2048, 512
    plan = fo.plan(m, n, k, dtype=torch.bfloat16, backend="cuda", group_sizes=None)
    inputs = [_inputs(m, n, k, torch.bfloat16, seed=s) for s in (1, 2)]
    expected = [fo.overlap(a, b, plan=plan) for a, b in inputs]
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in streams]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    for i in range(rounds):
        for (a, b), out, s in zip(inputs, outs, streams):
            with torch.cuda.stream(s):
                fo.overlap(a, b, plan=plan, out=out)
        if i % 250 == 249 or i == rounds - 1:
            torch.cuda.synchronize()
            for out, want in zip(outs, expected):
                assert torch.equal(out, want), f"round {i}: a call was disturbed by the other stream"
            for out in outs:
                out.fill_(float("nan"))


@needs_cuda
def test_first_call_inside_graph_capture_is_a_clear_error(nccl_group):
    a, b = _inputs(640, 896, 128, torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with pytest.raises(ValueError, match="outside the capture"):
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            fo.overlap(a, b)
    out = fo.overlap(a, b)  # the same call eagerly, then captured: works
    torch.cuda.synchronize()
    _check(out, a, b)


@needs_cuda
def test_back_to_back_bitwise_stable_memory_flat(nccl_group):
    calls = int(os.environ.get("FO_REPEAT_CALLS", "10000"))
    a, b = _inputs(2048, 2048, 512, torch.bfloat16)
    first = fo.overlap(a, b, backend="cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()  # a, b and one result alive
    for i in range(calls):
        out = fo.overlap(a, b, backend="cuda")
        if i % 1000 == 999:
            assert torch.equal(out, first), f"call {i} differs"
        del out  # the next call's result replaces it: one result alive, as before the loop
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= before + (1 << 20)


@needs_cuda
@pytest.mark.parametrize("wait", ["stream_wait_value", "spin_kernel"])
@pytest.mark.parametrize("op", ["allreduce", "reduce_scatter"])
def test_graph_replays_bitwise_stable(wait, op, monkeypatch, nccl_group):
    monkeypatch.setenv("FLASHOVERLAP_CUDA_WAIT", wait)
    replays = int(os.environ.get("FO_GRAPH_REPLAYS", "10000"))
    a, b = _inputs(1024, 3072, 256, torch.bfloat16)
    plan = fo.plan(1024, 3072, 256, op=op, dtype=torch.bfloat16, backend="cuda")
    out = torch.empty(1024, 3072, device="cuda", dtype=torch.bfloat16)
    fo.overlap(a, b, op, plan=plan, out=out)  # warm-up (loads every kernel)
    torch.cuda.synchronize()
    expected = out.clone()
    _check(out, a, b)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            fo.overlap(a, b, op, plan=plan, out=out)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for i in range(replays):
        out.fill_(float("nan")) if i % 2500 == 0 else None
        graph.replay()
        if i % 2500 == 0:
            torch.cuda.synchronize()
            assert torch.equal(out, expected), f"replay {i} differs"
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
    assert torch.cuda.memory_allocated() <= before + (1 << 20)


@needs_cuda
def test_graph_replays_and_eager_collectives_take_separate_communicators(nccl_group):
    """A communicator of FlashOverlap's runs either graph replays or eager calls, never both
    (NCCL 2.28 may post a rank's network work out of order on one used both ways:
    csrc/cuda/nccl.cu). Behind a GPU busy for a while, a replay of the call's graph is pending
    on the capture twin's watch alone, and a plain-path collective on the eager one alone."""
    import time

    from flashoverlap_backends.cuda import nccl

    if not nccl.watchdog_enabled() or not nccl.capture_twin():
        pytest.skip("needs the watchdog and the capture twin (both on by default)")
    a, b = _inputs(1024, 3072, 256, torch.bfloat16)
    plan = fo.plan(1024, 3072, 256, op="allreduce", dtype=torch.bfloat16, backend="cuda")
    out = torch.empty(1024, 3072, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):  # launches, then a capture and replays
        fo.overlap(a, b, "allreduce", plan=plan, out=out)
    torch.cuda.synchronize()
    _check(out, a, b)
    mine = [(key, comm) for comm, (group, key, _) in nccl._watches.items() if group is nccl_group]
    eager = [comm for key, comm in mine if key[-1] != "capture"]
    twins = [comm for key, comm in mine if key[-1] == "capture"]
    assert len(eager) == len(twins) == 1, mine
    time.sleep(0.5)  # a few looks of the watchdog: everything completed is dropped
    assert nccl.pending(eager[0]) == nccl.pending(twins[0]) == 0
    torch.cuda._sleep(400_000_000)  # about 0.2 s of the GPU's clock
    fo.overlap(a, b, "allreduce", plan=plan, out=out)  # a replay
    assert nccl.pending(twins[0]) >= 1 and nccl.pending(eager[0]) == 0
    torch.cuda.synchronize()
    time.sleep(0.5)
    t = torch.ones(4096, device="cuda")
    torch.cuda._sleep(400_000_000)
    nccl.PlainCollectives(nccl_group, t.device).all_reduce(t)
    assert nccl.pending(eager[0]) >= 1 and nccl.pending(twins[0]) == 0
    torch.cuda.synchronize()
    assert torch.equal(t, torch.ones_like(t))


@needs_cuda
def test_host_offload_gets_packed_result():
    m, n, k = 3000, 2048, 1024
    a, b = _inputs(m, n, k, torch.bfloat16)
    plan = fo.plan(m, n, k, op="custom", dtype=torch.bfloat16, backend="cuda")
    offload = HostOffload.for_plan(plan)
    out = fo.overlap(a, b, offload, plan=plan)
    torch.cuda.synchronize()
    assert torch.equal(offload.host, out.flatten()[plan.packed_index().cuda()].cpu())
    _check(out, a, b)


LAZY_SCRIPT = textwrap.dedent("""
    import os, tempfile, torch, torch.distributed as dist
    import flashoverlap_core as fo
    assert os.environ.get("CUDA_MODULE_LOADING", "LAZY") == "LAZY"
    store = tempfile.mktemp()
    dist.init_process_group("nccl", init_method="file://" + store, rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16).t()
    for op in ("allreduce", "reduce_scatter", "all_to_all"):
        for _ in range(3):
            out = fo.overlap(a, b, op, backend="cuda")
        torch.cuda.synchronize()
        err = ((out.float() - (a.float() @ b.float())).abs().max() / (a.float() @ b.float()).abs().max()).item()
        assert err < 2e-2, (op, err)
    dist.destroy_process_group()
    print("LAZY_OK")
""")


@needs_cuda
def test_fresh_process_with_lazy_loading_does_not_hang():
    env = {k: v for k, v in os.environ.items() if k != "CUDA_MODULE_LOADING"}
    proc = subprocess.run([sys.executable, "-c", LAZY_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "LAZY_OK" in proc.stdout, proc.stdout + proc.stderr
