"""GPU tests of all_to_all with each call's own rows and splits on the cuda backend at world
size 1: the per-call tables, the signaling GEMM over its block, the buffers that grow and the
ranks' counts are the same closed forms at every world size (world sizes 2-4 run in the
shared-GPU topology: test_multirank.py and the conformance suite's MoE sequences). Both
layouts: "rows" (the default: tiles written at their final rows, at world size 1 straight into
out, no post-reorder) and "tiles"."""
from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

import flashoverlap_core as fo
from flashoverlap_core import api
from test_cuda import _check, _inputs, needs_cuda

pytestmark = [pytest.mark.timeout(600), needs_cuda]


def _runner():
    return list(api._prepared.values())[-1].prepared


@pytest.mark.parametrize("arch", ["90", "80"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_world1_rows_change_every_call(arch, dtype, monkeypatch):
    """40 calls of one key whose rows change every call (none at times, tile edges, thousands),
    send/recv splits given or not, out given (poisoned) or not: every result against float64,
    one prepared key laid out per call on the signaling GEMM."""
    if arch == "90" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("sm_90a kernels need Hopper")
    monkeypatch.setenv("FLASHOVERLAP_CUDA_ARCH", arch)
    api.forget_prepared()
    rng = random.Random()
    n, k = rng.choice([(1000, 264), (4096, 512), (136, 72)])
    col = rng.random() < 0.5
    for call in range(40):
        m = rng.choice([0, 1, 127, 128, 129, 255, rng.randint(1, 5000)])
        a, b = _inputs(m, n, k, dtype, col)
        splits = {} if call % 3 == 0 else {"send_splits": [m]}
        if call % 2:
            splits["recv_splits"] = [m]
        if call % 4 == 1:
            out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
            assert fo.overlap(a, b, "all_to_all", out=out, **splits) is out
        else:
            out = fo.overlap(a, b, "all_to_all", **splits)
        torch.cuda.synchronize()
        assert out.shape == (m, n)
        if m:
            _check(out, a, b)
    [key] = fo.prepared_calls()
    assert key["backend"] == "cuda" and key["runner"] == "AllToAllCall", key
    assert _runner().native is not None  # laid out per call, no plan per split
    api.forget_prepared()


def test_world1_operands_that_need_copies_and_growing_buffers():
    """a with a row stride that is not 16-byte aligned (copied), b row-major, then ever larger
    calls (the buffers grow) and smaller ones again (they stay)."""
    api.forget_prepared()
    n, k = 520, 100
    for m in (10, 3000, 9000, 40, 20000, 5):
        base = torch.randn(m, k + 3, device="cuda", dtype=torch.bfloat16)
        a = base[:, :k]  # row stride k + 3: not a multiple of 8 elements
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        out = fo.overlap(a, b, "all_to_all", send_splits=[m], recv_splits=[m])
        torch.cuda.synchronize()
        _check(out, a, b)
    api.forget_prepared()


def test_world1_two_streams_share_nothing():
    """Calls of one key in flight on two streams, each with its own rows every round."""
    api.forget_prepared()
    n, k = 768, 256
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    rng = random.Random()
    pending = []
    for _ in range(50):
        for s in streams:
            m = rng.randint(0, 2000)
            with torch.cuda.stream(s):
                a, b = _inputs(m, n, k, torch.bfloat16)
                pending.append((a, b, fo.overlap(a, b, "all_to_all", send_splits=[m])))
    torch.cuda.synchronize()
    for a, b, out in pending:
        if a.shape[0]:
            _check(out, a, b)
    api.forget_prepared()


def test_world1_tile_follows_the_first_calls_rows():
    """A default all_to_all key weighs the waves of its first call's rows (the tile rule's
    hint): 1024 rows at N=5120 take pingpong's 128x128 (3 waves against 2 ragged ones of
    128x256) through the unequal-blocks build of that tile, 4096 rows at N=4096 the default
    128x256; later calls of each key, with other rows, keep its tile; all against float64."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the per-shape tile is the sm90 rule")
    api.forget_prepared()
    for first, n, want in ((1024, 5120, (128, 128)), (4096, 4096, (128, 256))):
        for m in (first, 77, 0, 3000):
            a, b = _inputs(m, n, 256, torch.bfloat16)
            out = fo.overlap(a, b, "all_to_all", send_splits=[m], recv_splits=[m])
            torch.cuda.synchronize()
            if m:
                _check(out, a, b)
            runner = _runner()
            assert tuple(runner.plan.tile) == want, (first, m, runner.plan)
            built = Path(runner.native.gemm.path).name  # that tile's unequal-blocks build
            assert f"_{want[0]}x{want[1]}x64_" in built and "_blocks" in built, built
        api.forget_prepared()


# ---- the "rows" layout (issue 30): tiles written at their final rows, no post-reorder ----------
def _plan(m, n, k, dtype, layout):
    return fo.plan(m, n, k, op="all_to_all", dtype=dtype, backend="cuda", layout=layout)


@pytest.mark.parametrize("arch", ["90", "80"])
def test_world1_rows_is_the_default_and_keeps_no_staging(arch, monkeypatch):
    """A default all_to_all plan on cuda is "rows": at world size 1 the GEMM writes out itself,
    so the call keeps no packed, staging or post-reorder buffer (fo.prepared_calls shows the
    layout and the workspace: tables and counters only)."""
    if arch == "90" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("sm_90a kernels need Hopper")
    monkeypatch.setenv("FLASHOVERLAP_CUDA_ARCH", arch)
    api.forget_prepared()
    n, k = 1024, 256
    assert _plan(4096, n, k, torch.bfloat16, None).layout == "rows"
    for m in (4096, 1, 0, 777, 20000):
        a, b = _inputs(m, n, k, torch.bfloat16)
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        assert fo.overlap(a, b, "all_to_all", out=out, send_splits=[m], recv_splits=[m]) is out
        torch.cuda.synchronize()
        if m:
            _check(out, a, b)
    [key] = fo.prepared_calls()
    assert key["layout"] == "rows" and key["runner"] == "AllToAllCall", key
    buffers = _runner().native.buffers()
    assert not {"packed", "staging", "unpack_tiles", "unpack_offsets"} & set(buffers), buffers
    assert key["workspace_bytes"] == sum(buffers.values()), (key, buffers)
    assert key["workspace_bytes"] < 20000 * n * 2 // 100, key  # < 1% of the largest output
    api.forget_prepared()


@pytest.mark.parametrize("arch", ["90", "80"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_world1_rows_ragged_shapes_match_float64_and_the_tiles_layout(arch, dtype, monkeypatch):
    """Ragged shapes (partial last band and column tile, N not a multiple of 8 where the kernel
    allows it, one row, no rows), poisoned outputs, both layouts of b: the "rows" call against
    float64 and bit for bit against the "tiles" call of the same operands."""
    if arch == "90" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("sm_90a kernels need Hopper")
    monkeypatch.setenv("FLASHOVERLAP_CUDA_ARCH", arch)
    api.forget_prepared()
    shapes = [(129, 1000, 264), (1, 136, 72), (4097, 384, 72), (300, 4104, 512), (0, 256, 64)]
    if arch == "90":  # sm80 needs N % 8 == 0 for a row-major b
        shapes += [(255, 1001, 64), (1000, 7, 16)]
    for m, n, k in shapes:
        plans = {layout: _plan(max(m, 1), n, k, dtype, layout) for layout in ("rows", "tiles")}
        for col in (True, False):
            if not col and n % 8:
                continue
            a, b = _inputs(m, n, k, dtype, col)
            outs = {}
            for layout, plan in plans.items():
                out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
                assert fo.overlap(a, b, "all_to_all", plan=plan, out=out) is out
                outs[layout] = out
            torch.cuda.synchronize()
            if m:
                _check(outs["rows"], a, b)
            assert torch.equal(outs["rows"], outs["tiles"]), (m, n, k, col)
    layouts = sorted(c["layout"] for c in fo.prepared_calls())
    assert set(layouts) == {"rows", "tiles"}, layouts
    api.forget_prepared()


def test_world1_rows_follows_moving_outputs_and_rows():
    """Calls of one "rows" key whose out, a and rows move every call (out given or not, one
    output reused twice in a row): each written in place, nothing outside it touched."""
    api.forget_prepared()
    n, k = 640, 128
    base = torch.full((6000, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    rng = random.Random()
    for call in range(30):
        m = rng.choice([0, 1, 128, 129, rng.randint(1, 2000)])
        a, b = _inputs(m, n, k, torch.bfloat16)
        start = rng.randint(0, 1000) if call % 3 else 7  # a row slice: not 16-byte aligned at times
        out = base[start:start + m]
        got = fo.overlap(a, b, "all_to_all", out=out, send_splits=[m], recv_splits=[m])
        torch.cuda.synchronize()
        assert got is out
        if m:
            _check(out, a, b)
        assert torch.isnan(base[:start]).all() and torch.isnan(base[start + m:]).all(), call
        base.fill_(float("nan"))
    assert fo.prepared_calls()[0]["layout"] == "rows"
    api.forget_prepared()


@pytest.mark.parametrize("layout", ["rows", "tiles"])
def test_world1_graph_capture_and_replay(layout):
    """A call captured by the caller (after a warm-up call outside the capture) replays with
    new values in the same a, into a poisoned out, as often as asked."""
    api.forget_prepared()
    m, n, k = 1000, 768, 256
    plan = _plan(m, n, k, torch.bfloat16, layout)
    a, b = _inputs(m, n, k, torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    fo.overlap(a, b, "all_to_all", plan=plan, out=out, send_splits=[m], recv_splits=[m])
    torch.cuda.synchronize()
    _check(out, a, b)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        fo.overlap(a, b, "all_to_all", plan=plan, out=out, send_splits=[m], recv_splits=[m])
    torch.cuda.synchronize()
    for i in range(int(os.environ.get("FO_GRAPH_REPLAYS", "200"))):
        fresh, _ = _inputs(m, n, k, torch.bfloat16)
        a.copy_(fresh)
        out.fill_(float("nan"))
        graph.replay()
        if i % 50 == 0:
            torch.cuda.synchronize()
            _check(out, a, b)
    torch.cuda.synchronize()
    _check(out, a, b)
    assert fo.prepared_calls()[0]["layout"] == layout
    api.forget_prepared()
