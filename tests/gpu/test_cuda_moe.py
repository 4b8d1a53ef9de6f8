"""GPU tests of all_to_all with each call's own rows and splits on the cuda backend at world
size 1: the per-call tables, the signaling GEMM over its block, the buffers that grow and the
ranks' counts are the same closed forms at every world size (world sizes 2-4 run in the
shared-GPU topology: test_multirank.py and the conformance suite's MoE sequences)."""
from __future__ import annotations

import random

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
