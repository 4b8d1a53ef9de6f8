"""torch.compile and CUDA graphs with the cuda backend (issue 13): every string op compiled with
fullgraph=True (inductor and aot_eager) equals eager and a float64 reference, forward and
backward; mode="reduce-overhead" records and replays CUDA graphs (no cudagraph skips) with a
NCCL group of one rank; the fo.nn MLP block compiles, trains and replays. An op the cuda backend
declines (test_cuda_runs_the_op says which, and why) runs on the backend chosen for it. Skips
without the cuda backend (fails under FLASHOVERLAP_REQUIRE_HW=1, as test_cuda does)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import flashoverlap_core as fo
from flashoverlap_core import registry
from flashoverlap_core.backend import OverlapSpec
from test_cuda import REASON, _check, _inputs, nccl_group, needs_cuda  # noqa: F401 (fixture)

pytestmark = [pytest.mark.timeout(600), needs_cuda]
OPS = ("allreduce", "reduce_scatter", "allgather", "all_to_all")
M, N, K = 640, 896, 128
SPLITS = {"all_to_all": {"send_splits": [M], "recv_splits": [M]}}


def cuda_declines(op: str) -> list[str]:
    """Why the cuda backend does not run ``op`` on this test's shapes (empty: it does)."""
    send = tuple(SPLITS[op]["send_splits"]) if op in SPLITS else None
    spec = OverlapSpec(M, N, K, op, 1, "bfloat16", "cuda", "col", send)
    return registry.get("cuda").unsupported_reasons(spec)


BACKENDS = {op: None if REASON is not None or cuda_declines(op) else "cuda" for op in OPS}


@pytest.mark.parametrize("op", OPS)
def test_cuda_runs_the_op(op):
    reasons = cuda_declines(op)
    if reasons:
        pytest.skip(f"the cuda backend declines {op}: {'; '.join(reasons)}; the tests below "
                    f"run it on the backend chosen for it")


def every_op(*tensors):
    """Each string op once, on its own (a, b) pair, at world size 1."""
    return tuple(fo.overlap(tensors[2 * i], tensors[2 * i + 1], op, backend=BACKENDS[op],
                            **SPLITS.get(op, {}))
                 for i, op in enumerate(OPS))


def fresh_pairs(seed: int) -> list[torch.Tensor]:
    return [t for i in range(len(OPS)) for t in _inputs(M, N, K, torch.bfloat16, seed=seed + i)]


def _close_to_float64(got, want, what):
    """Within bf16 rounding of the float64 value, relative to the tensor's scale."""
    err = (got.double() - want).abs().max().item()
    scale = want.abs().max().item()
    assert err <= 2e-2 * scale, f"{what}: max error {err} against scale {scale}"


@pytest.mark.parametrize("compile_backend", ["inductor", "aot_eager"])
def test_every_op_compiled_forward_and_backward(compile_backend, nccl_group):
    tensors = fresh_pairs(11)
    eager = every_op(*tensors)
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    outs = torch.compile(every_op, fullgraph=True, backend=compile_backend)(*leaves)
    grads = [torch.randn_like(o) for o in outs]
    torch.autograd.backward(outs, grads)
    torch.cuda.synchronize()
    for i, op in enumerate(OPS):
        a, b = tensors[2 * i], tensors[2 * i + 1]
        _check(eager[i], a, b)
        _check(outs[i], a, b)
        g = grads[i].double()
        _close_to_float64(leaves[2 * i].grad, g @ b.double().t(), f"{op} grad a")
        _close_to_float64(leaves[2 * i + 1].grad, a.double().t() @ g, f"{op} grad b")


def test_reduce_overhead_records_and_replays_cuda_graphs(nccl_group):
    from torch._dynamo.utils import counters

    counters.clear()
    compiled = torch.compile(every_op, fullgraph=True, mode="reduce-overhead")
    with torch.no_grad():
        for seed in range(5):  # warm-up, record, then replays, each with new input values
            tensors = fresh_pairs(100 + 10 * seed)
            outs = [o.clone() for o in compiled(*tensors)]
            torch.cuda.synchronize()
            for i in range(len(OPS)):
                _check(outs[i], tensors[2 * i], tensors[2 * i + 1])
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


def mlp(block, x):
    gate, up = block[0](x).chunk(2, dim=-1)
    return block[1](F.silu(gate) * up)


def mlp_block(hidden=512, inner=1536):
    kw = {"bias": False, "device": "cuda", "dtype": torch.bfloat16}  # each call's backend
    return torch.nn.ModuleList([
        fo.nn.ColumnParallelLinear(hidden, 2 * inner, gather_input=True, **kw),
        fo.nn.RowParallelLinear(inner, hidden, reduce="reduce_scatter", **kw)])


def test_mlp_block_compiled_trains_like_eager(nccl_group):
    torch.manual_seed(0)
    block = mlp_block()
    x = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    results = []
    for fn in (mlp, torch.compile(mlp, fullgraph=True)):
        leaf = x.clone().requires_grad_()
        for p in block.parameters():
            p.grad = None
        out = fn(block, leaf)
        out.backward(grad)
        results.append([out, leaf.grad] + [p.grad for p in block.parameters()])
    torch.cuda.synchronize()
    for name, eager, compiled in zip(("output", "input grad", "gate_up grad", "down grad"),
                                     *results):
        assert not torch.isnan(compiled).any(), name
        _close_to_float64(compiled, eager.double(), f"compiled vs eager {name}")


def test_mlp_block_inference_replays_cuda_graphs(nccl_group):
    from torch._dynamo.utils import counters

    counters.clear()
    torch.manual_seed(1)
    block = mlp_block()
    compiled = torch.compile(mlp, fullgraph=True, mode="reduce-overhead")
    with torch.no_grad():
        for step in range(4):
            x = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)
            got = compiled(block, x).clone()
            gate, up = (x.double() @ block[0].weight.double().t()).chunk(2, dim=-1)
            want = (F.silu(gate) * up) @ block[1].weight.double().t()
            torch.cuda.synchronize()
            _close_to_float64(got, want, f"step {step}")
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
