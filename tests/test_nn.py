"""fo.nn.RowParallelLinear / ColumnParallelLinear (flashoverlap_core/nn.py) against the unsharded
nn.Linear in float64, forward and backward, at world sizes 1, 2 and 4 (spawned gloo ranks),
eager and under torch.compile(fullgraph=True); a tensor-parallel MLP block; clear errors.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import flashoverlap_core as fo
from flashoverlap_core import api, registry
from flashoverlap_core.backend import OverlapSpec
from flashoverlap_core.nn import ColumnParallelLinear, RowParallelLinear
from flashoverlap_core.reference import ReferenceBackend
from test_readme import python_block
from test_torch_ops_ranks import INDUCTOR, WORLD_SIZES
from test_torch_ops_ranks import ranks as shared_ranks

SEED = 20261202
IN, OUT = 8, 12  # divisible by every world size tested
KINDS = ("row_allreduce", "row_reduce_scatter", "column", "column_gather")


def full_linear(seed: int, in_features: int = IN, out_features: int = OUT) -> nn.Linear:
    """The same float32 nn.Linear on every rank."""
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features)


def seeded(seed: int, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def make_layer(kind: str, linear: nn.Linear, group=None):
    if kind.startswith("row"):
        return RowParallelLinear.from_linear(linear, group, reduce=kind.split("_", 1)[1])
    return ColumnParallelLinear.from_linear(linear, group, gather_input=kind == "column_gather")


def full_input(kind: str, world: int) -> torch.Tensor:
    """The unsharded layer's input: leading shape [2, 3] for the replicated kinds, token rows
    that split evenly over the ranks for the sequence-parallel ones."""
    shape = {"row_reduce_scatter": (2 * world, 2), "column_gather": (3 * world,)}.get(kind, (2, 3))
    return seeded(SEED + KINDS.index(kind), *shape, IN)


def case(kind: str, rank: int, world: int):
    """(this rank's input, its upstream gradient, expected output, expected grads of input,
    weight and bias) from the unsharded layer in float64 with L = <y, G>."""
    linear = full_linear(SEED + 17 * KINDS.index(kind))
    ref = nn.Linear(IN, OUT).double()
    ref.load_state_dict(linear.state_dict())
    x = full_input(kind, world).requires_grad_()
    y = ref(x)
    grad = seeded(SEED + 50 + KINDS.index(kind), *y.shape)
    (y * grad).sum().backward()
    x_grad, w_grad, b_grad = x.grad, ref.weight.grad, ref.bias.grad
    cols = slice(rank * IN // world, (rank + 1) * IN // world)
    outs = slice(rank * OUT // world, (rank + 1) * OUT // world)
    y, x = y.detach(), x.detach()
    if kind == "row_allreduce":  # input split by features, replicated output
        return (x[..., cols], grad, y, x_grad[..., cols], w_grad[:, cols], b_grad), linear
    if kind == "row_reduce_scatter":  # ... and this rank's rows of the flattened output
        rows = slice(rank * y.numel() // OUT // world, (rank + 1) * y.numel() // OUT // world)
        return (x[..., cols], grad.reshape(-1, OUT)[rows], y.reshape(-1, OUT)[rows],
                x_grad[..., cols], w_grad[:, cols], b_grad), linear
    if kind == "column":  # full input, this rank's output features; input grad is a partial
        return (x, grad[..., outs], y[..., outs], x_grad, w_grad[outs], b_grad[outs]), linear
    rows = slice(rank * x.shape[0] // world, (rank + 1) * x.shape[0] // world)
    return (x[rows], grad[:, outs], y[:, outs], x_grad[rows], w_grad[outs], b_grad[outs]), linear


def apply_layers(layers, xs):
    return [layer(x) for layer, x in zip(layers, xs)]


def check_against_unsharded(kinds, layers, xs, outs, cases, what: str) -> None:
    for kind, layer, x, out, ((_, _, want, want_x, want_w, want_b), _) in zip(
            kinds, layers, xs, outs, cases):
        x_grad = x.grad
        if kind == "column" and dist.is_initialized():  # the caller's region sums the partials
            dist.all_reduce(x_grad)
        got = (out, x_grad, layer.weight.grad, layer.bias.grad)
        for name, g, w in zip(("output", "input grad", "weight grad", "bias grad"), got,
                              (want, want_x, want_w, want_b)):
            if g is None and name == "weight grad" and not layer.weight.requires_grad:
                continue  # a frozen weight
            torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{kind} {name} ({what}): {m}")


def run_layers(kinds, rank: int, world: int, compile_backend: str | None) -> list[str]:
    """Every kind of layer in one function (one graph when compiled), forward and backward with
    L = sum of <output, upstream gradient>, against the unsharded layers."""
    cases = [case(kind, rank, world) for kind in kinds]
    layers = [make_layer(kind, linear) for kind, (_, linear) in zip(kinds, cases)]
    xs = [c[0].float().requires_grad_() for c, _ in cases]
    fn = apply_layers if compile_backend is None else torch.compile(apply_layers, fullgraph=True,
                                                                    backend=compile_backend)
    outs = fn(layers, xs)
    sum((out * c[1].float()).sum() for out, (c, _) in zip(outs, cases)).backward()
    check_against_unsharded(kinds, layers, xs, outs, cases, compile_backend or "eager")
    copied = copy.deepcopy(layers[0])  # the group is shared, the parameters copied
    assert copied.group is layers[0].group and copied.weight is not layers[0].weight
    torch.testing.assert_close(copied(xs[0].detach()), outs[0].detach())
    return list(kinds)


# ---- run on every rank -------------------------------------------------------------------------
def check_layers(compile_backend: str | None) -> list[str]:
    return run_layers(KINDS, dist.get_rank(), dist.get_world_size(), compile_backend)


def tp_mlp(hidden: int, inner: int, group=None):
    """A Llama-style MLP's full weights (float32, the same on every rank) and this rank's
    tensor-parallel block: column-parallel gate/up with the token rows gathered,
    SiLU(gate) * up, row-parallel down reduce-scattered."""
    torch.manual_seed(SEED + 3)
    gate_up, down = nn.Linear(hidden, 2 * inner, bias=False), nn.Linear(inner, hidden, bias=False)
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    # Interleave the rows so that each rank's slice of gate_up holds its gate and its up rows.
    order = torch.arange(2 * inner).view(2, world, inner // world).transpose(0, 1).reshape(-1)
    gate_up_tp = nn.Linear(hidden, 2 * inner, bias=False)
    gate_up_tp.weight.data.copy_(gate_up.weight.data[order])
    block = nn.ModuleList([ColumnParallelLinear.from_linear(gate_up_tp, group, gather_input=True),
                           RowParallelLinear.from_linear(down, group, reduce="reduce_scatter")])
    return gate_up.weight, down.weight, order, block


def mlp_forward(block, x):
    gate, up = block[0](x).chunk(2, dim=-1)
    return block[1](F.silu(gate) * up)


def check_mlp(compile_backend: str | None) -> str:
    """The block (compiled with ``compile_backend``, or eager) against the full MLP in float64,
    forward and backward: this rank's output rows, input rows and weight shards' gradients."""
    rank, world = dist.get_rank(), dist.get_world_size()
    hidden, inner, tokens = 8, 12, 4 * world
    w_gate_up, w_down, order, block = tp_mlp(hidden, inner)
    ref = [t.detach().double().requires_grad_() for t in (w_gate_up, w_down)]
    x_full = seeded(SEED + 5, tokens, hidden).requires_grad_()
    g_full = seeded(SEED + 6, tokens, hidden)
    ref_gate, ref_up = F.linear(x_full, ref[0]).chunk(2, dim=-1)
    (F.linear(F.silu(ref_gate) * ref_up, ref[1]) * g_full).sum().backward()
    y_full = F.linear(F.silu(ref_gate) * ref_up, ref[1]).detach()

    fn = mlp_forward if compile_backend is None else torch.compile(mlp_forward, fullgraph=True,
                                                                   backend=compile_backend)
    rows = slice(rank * tokens // world, (rank + 1) * tokens // world)
    x = x_full.detach()[rows].float().requires_grad_()
    y = fn(block, x)
    y.backward(g_full[rows].float())
    gate_up_rows = slice(rank * 2 * inner // world, (rank + 1) * 2 * inner // world)
    down_cols = slice(rank * inner // world, (rank + 1) * inner // world)
    pairs = [(y, y_full[rows]), (x.grad, x_full.grad[rows]),
             (block[0].weight.grad, ref[0].grad[order][gate_up_rows]),
             (block[1].weight.grad, ref[1].grad[:, down_cols])]
    for name, (got, want) in zip(("output", "input grad", "gate_up grad", "down grad"), pairs):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"MLP {name} {compile_backend}: {m}")
    return compile_backend or "eager"


def check_errors() -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    seen = []
    layer = RowParallelLinear.from_linear(full_linear(SEED))
    with pytest.raises(ValueError, match=rf"expects input \[\.\.\., {IN // world}\]"):
        layer(torch.randn(3, IN + 1))
    seen.append("input features")
    with pytest.raises(ValueError, match="reduce must be one of"):
        RowParallelLinear(IN, OUT, reduce="all_reduce")
    if world > 1:
        with pytest.raises(ValueError, match="not divisible by the group's world size"):
            ColumnParallelLinear.from_linear(full_linear(SEED, IN, world + 1))
        rs = RowParallelLinear.from_linear(full_linear(SEED), reduce="reduce_scatter")
        with pytest.raises(ValueError, match="divisible by the world size"):
            rs(torch.randn(world + 1, IN // world, requires_grad=True))
        gather = ColumnParallelLinear.from_linear(full_linear(SEED), gather_input=True)
        with pytest.raises(ValueError, match="same rows"):  # detected on the group's first call
            gather(torch.randn(11 + rank, IN))  # shapes no other check here uses
        seen += ["features % W", "tokens % W", "unequal rows"]
    not_member = dist.new_group([0])  # every rank takes part in new_group
    if rank != 0:
        with pytest.raises(TypeError, match="ProcessGroup"):
            RowParallelLinear.from_linear(full_linear(SEED), not_member)
        seen.append("not a member")
    return seen


# ---- the tests ---------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"W{w}")
def ranks(request):
    return shared_ranks(request.param)


@pytest.mark.parametrize("compile_backend", [None, "aot_eager"])
def test_layers_equal_the_unsharded_linear(ranks, compile_backend):
    assert ranks.run(check_layers, compile_backend) == [list(KINDS)] * ranks.world_size


@pytest.mark.parametrize("compile_backend", [None, INDUCTOR])
def test_tensor_parallel_mlp_block(ranks, compile_backend):
    assert ranks.run(check_mlp, compile_backend) == [compile_backend or "eager"] * ranks.world_size


def test_clear_errors(ranks):
    ranks.run(check_errors)


# ---- in this process: world size 1 without torch.distributed -----------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_world_size_1_layer_is_the_linear(kind):
    assert run_layers([kind], 0, 1, None) == [kind]
    layer = make_layer(kind, full_linear(SEED))
    assert [name for name, _ in layer.named_parameters()] == ["weight", "bias"]
    assert layer.weight.shape == (OUT, IN) and layer.world_size == 1


def test_fo_nn_and_constructors():
    assert fo.nn.RowParallelLinear is RowParallelLinear
    row = RowParallelLinear(IN, OUT, bias=False, reduce="reduce_scatter")
    column = ColumnParallelLinear(IN, OUT, gather_input=True, dtype=torch.float64)
    assert row.bias is None and row.weight.shape == (OUT, IN) and "reduce_scatter" in repr(row)
    assert column.weight.dtype == torch.float64 and column.bias.shape == (OUT,)
    assert column.weight.abs().max() <= 1 / IN ** 0.5  # nn.Linear's initialisation bound
    with torch.no_grad():  # inference: the eager fast path, no custom op
        torch.testing.assert_close(row(torch.ones(2, IN)), torch.ones(2, IN) @ row.weight.t())
    with pytest.raises(ValueError, match="positive int"):
        RowParallelLinear(0, OUT)
    with pytest.raises(TypeError, match="ProcessGroup"):
        ColumnParallelLinear(IN, OUT, group="tp")


def test_the_readme_model_snippet_runs(monkeypatch):
    """README's "In a model" example, as written there, at world size 1 (compiled with
    aot_eager: inductor's code generation is tested above, and costs a CPU minute here)."""
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, backend="aot_eager", **kw))
    exec(compile(python_block("fo.nn.ColumnParallelLinear.from_linear"), "README.md", "exec"), {})


# ---- the backward keeps the forward's backend --------------------------------------------------
# (kind, its forward's overlapped op, the op of its backward's overlapped call). A reduce-
# scattering layer's backward overlaps its allgather only with a frozen weight: a weight's
# gradient needs the gathered rows too, which are then gathered once for both GEMMs.
OVERLAPPED_BACKWARD = (("row_reduce_scatter", "reduce_scatter", "allgather"),
                       ("column_gather", "allgather", "reduce_scatter"))
FROZEN = {"row_reduce_scatter": True, "column_gather": False}


class NoAllgather(ReferenceBackend):
    """The reference backend under another name, declining allgather: a reduce-scattering
    layer built with it has its backward's allgather on the automatic choice."""

    name = "test-nn-no-allgather"
    priority = -100  # never chosen automatically

    def unsupported_reasons(self, spec):
        return ["no allgather (test backend)"] if spec.op == "allgather" else []


def run_on_backend(kind: str, backend: str, compile_backend: str | None,
                   frozen: bool = False) -> list[dict]:
    """One layer built with ``backend=``, forward and backward against the unsharded float64
    layer (``frozen``: its weight takes no gradient); what each overlapped call ran on
    (fo.prepared_calls)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    c = case(kind, rank, world)
    cls, option = ((RowParallelLinear, {"reduce": "reduce_scatter"}) if kind.startswith("row")
                   else (ColumnParallelLinear, {"gather_input": True}))
    layer = cls.from_linear(c[1], backend=backend, **option)
    layer.weight.requires_grad_(not frozen)
    x = c[0][0].float().requires_grad_()
    fn = layer if compile_backend is None else torch.compile(layer, fullgraph=True,
                                                             backend=compile_backend)
    api.forget_prepared()
    out = fn(x)
    (out * c[0][1].float()).sum().backward()
    assert (layer.weight.grad is None) == frozen
    check_against_unsharded([kind], [layer], [x], [out], [c], f"backend={backend}")
    return fo.prepared_calls()


def check_backward_backends(compile_backend: str | None) -> list:
    """With backend="reference" every overlapped call, forward and backward, runs on it; with a
    backend that declines the backward's op, that call runs on the automatic choice."""
    ran = []
    for kind, forward_op, backward_op in OVERLAPPED_BACKWARD:
        calls = run_on_backend(kind, "reference", compile_backend, frozen=FROZEN[kind])
        ran.append(sorted((c["op"], c["backend"]) for c in calls))
        assert ran[-1] == sorted([(forward_op, "reference"), (backward_op, "reference")]), calls
    # with the weight's gradient wanted, the reduce-scattering layer's backward gathers once and
    # makes no overlapped call of its own
    calls = run_on_backend("row_reduce_scatter", "reference", compile_backend)
    assert [c["op"] for c in calls] == ["reduce_scatter"], calls
    if compile_backend is None:
        registry.register(NoAllgather())
        try:
            calls = run_on_backend("row_reduce_scatter", NoAllgather.name, None, frozen=True)
        finally:
            registry._loaded.pop(NoAllgather.name, None)
        by_op = {c["op"]: c for c in calls}
        assert by_op["reduce_scatter"]["backend"] == NoAllgather.name, calls
        gather = by_op["allgather"]
        spec = OverlapSpec(gather["M"], gather["N"], gather["K"], "allgather",
                           gather["world_size"], "float32", "cpu", gather["b_layout"])
        assert gather["backend"] == registry.select(spec).name != NoAllgather.name, calls
        ran.append(sorted(by_op))
    return ran


@pytest.mark.timeout(600)
@pytest.mark.parametrize("compile_backend", [None, "aot_eager"])
@pytest.mark.parametrize("world", [1, 2], ids=lambda w: f"W{w}")
def test_backward_keeps_the_forward_backend(world, compile_backend):
    results = shared_ranks(world).run(check_backward_backends, compile_backend)
    assert results == [results[0]] * world and len(results[0]) == 2 + (compile_backend is None)


def test_backward_keeps_the_forward_backend_without_torch_distributed():
    assert len(check_backward_backends(None)) == 3
