"""fo.overlap as torch custom ops (flashoverlap_core/torch_ops.py): torch.compile(fullgraph=True)
with inductor and aot_eager for every string op at world sizes 1, 2 and 4 (spawned gloo ranks)
against eager and a float64 reference of all ranks, gradients through the registered autograd,
meta and fake tensors, the eager fast path, and clear errors.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

import flashoverlap_core as fo
from flashoverlap_core import torch_ops
from test_torch_ops_ranks import INDUCTOR, WORLD_SIZES
from test_torch_ops_ranks import ranks as shared_ranks

SEED = 20261201
OPS = torch_ops.STRING_OPS
K, N = 6, 7


# ---- one call's inputs on every rank, and a float64 reference of the whole group -----------
def rows_of(op: str, world: int) -> int:
    """Rows of a: a multiple of the world size for reduce_scatter, ragged otherwise."""
    return 4 * world if op == "reduce_scatter" else 5


def send_splits(rank: int, world: int, m: int) -> list[int]:
    """all_to_all rows rank sends to each rank: uneven, with a zero where world > 2."""
    g = torch.Generator().manual_seed(SEED + 7 * rank)
    cuts = sorted(torch.randint(0, m + 1, (world - 1,), generator=g).tolist())
    splits = [hi - lo for lo, hi in zip([0] + cuts, cuts + [m])]
    if world > 2:
        splits[(rank + 1) % world] += splits[rank % world]
        splits[rank % world] = 0
    return splits


def inputs(op: str, rank: int, world: int, dtype=torch.float32):
    """(a, b, upstream gradient) of ``rank``; b is an nn.Linear weight's transpose. The gradient
    of an allreduce'd (replicated) result is the same on every rank."""
    g = torch.Generator().manual_seed(SEED + 1000 * OPS.index(op) + rank)
    m = rows_of(op, world)
    a = torch.randn(m, K, generator=g, dtype=torch.float64)
    b = torch.randn(N, K, generator=g, dtype=torch.float64).t()
    rows = reference(op, [a] * world, [b] * world)[rank].shape[0] if op != "all_to_all" else \
        sum(send_splits(s, world, m)[rank] for s in range(world))
    gg = torch.Generator().manual_seed(SEED + 99 + (0 if op == "allreduce" else rank))
    grad = torch.randn(rows, N, generator=gg, dtype=torch.float64)
    return a.to(dtype), b.to(dtype), grad.to(dtype)


def reference(op: str, As, Bs):
    """Every rank's result, in float64, by the semantics in docs/design.md (differentiable)."""
    world = len(As)
    cs = [a @ b for a, b in zip(As, Bs)]
    if op == "allreduce":
        return [sum(cs)] * world
    if op == "reduce_scatter":
        return list(sum(cs).chunk(world))
    if op == "allgather":
        gathered = torch.cat(As)
        return [gathered @ b for b in Bs]
    pieces = [c.split(send_splits(s, world, c.shape[0])) for s, c in enumerate(cs)]
    return [torch.cat([pieces[s][r] for s in range(world)]) for r in range(world)]


def reference_grads(op: str, rank: int, world: int):
    """(result, dL/da, dL/db) of ``rank`` in float64 for L = <result, grad> summed over the
    ranks (one copy of the replicated allreduce result)."""
    leaves = [[t.double().requires_grad_() for t in inputs(op, r, world)[:2]] for r in range(world)]
    outs = reference(op, [a for a, _ in leaves], [b for _, b in leaves])
    grads = [inputs(op, r, world)[2].double() for r in range(world)]
    terms = [(outs[0] * grads[0]).sum()] if op == "allreduce" else \
        [(o * g).sum() for o, g in zip(outs, grads)]
    sum(terms).backward()
    a, b = leaves[rank]
    return outs[rank].detach(), a.grad, b.grad


def call_kwargs(op: str, rank: int, world: int) -> dict:
    if op != "all_to_all":
        return {}
    m = rows_of(op, world)
    return {"send_splits": send_splits(rank, world, m),
            "recv_splits": [send_splits(s, world, m)[rank] for s in range(world)]}


def all_ops(*tensors, kwargs):
    """Every string op once, on its own (a, b) pair: one graph to compile per world size."""
    return tuple(fo.overlap(tensors[2 * i], tensors[2 * i + 1], op, **kwargs[op])
                 for i, op in enumerate(OPS))


# ---- run on every rank -------------------------------------------------------------------------
def check_every_op(compile_backend: str | None) -> str:
    """Eager without grad (api's direct path) and, compiled with ``compile_backend`` (or eager
    when None), forward and backward through the custom ops; all against the reference."""
    rank, world = dist.get_rank(), dist.get_world_size()
    per_op = {op: inputs(op, rank, world) for op in OPS}
    kwargs = {op: call_kwargs(op, rank, world) for op in OPS}
    flat = [t for op in OPS for t in per_op[op][:2]]
    eager = all_ops(*flat, kwargs=kwargs)
    leaves = [t.clone().requires_grad_() for t in flat]
    fn = all_ops if compile_backend is None else torch.compile(all_ops, fullgraph=True,
                                                               backend=compile_backend)
    outs = fn(*leaves, kwargs=kwargs)
    sum((o * per_op[op][2]).sum() for op, o in zip(OPS, outs)).backward()
    for i, op in enumerate(OPS):
        want, grad_a, grad_b = reference_grads(op, rank, world)
        torch.testing.assert_close(eager[i].double(), want, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{op} eager: {m}")
        torch.testing.assert_close(outs[i], eager[i], rtol=1e-6, atol=1e-6,
                                   msg=lambda m: f"{op} {compile_backend} vs eager: {m}")
        torch.testing.assert_close(leaves[2 * i].grad.double(), grad_a, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{op} {compile_backend} grad a: {m}")
        torch.testing.assert_close(leaves[2 * i + 1].grad.double(), grad_b, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{op} {compile_backend} grad b: {m}")
    return compile_backend or "eager"


def check_meta() -> list:
    """Meta tensors get the result's shape and dtype from the fake kernels, on the group."""
    rank, world = dist.get_rank(), dist.get_world_size()
    shapes = []
    for op in OPS:
        a, b, _ = inputs(op, rank, world, torch.bfloat16)
        out = fo.overlap(a.to("meta"), b.to("meta"), op, **call_kwargs(op, rank, world))
        want = reference(op, [a.double()] * world, [b.double()] * world)[rank].shape \
            if op != "all_to_all" else (sum(call_kwargs(op, rank, world)["recv_splits"]), N)
        assert out.is_meta and out.dtype == torch.bfloat16 and tuple(out.shape) == tuple(want), \
            (op, out.shape, want)
        shapes.append(tuple(out.shape))
    return shapes


def check_errors() -> list[str]:
    """Wrong calls on the custom-op path raise a clear error; all_to_all needs recv_splits."""
    rank, world = dist.get_rank(), dist.get_world_size()
    a = torch.randn(4 * world + 1, K, requires_grad=True)
    b = torch.randn(K, N)
    messages = []
    if world > 1:
        with pytest.raises(ValueError, match="divisible by the world size"):
            fo.overlap(a.detach().to("meta"), b.to("meta"), "reduce_scatter")
        with pytest.raises(ValueError, match="explicit send_splits and recv_splits"):
            fo.overlap(a, b, "all_to_all", send_splits=send_splits(rank, world, a.shape[0]))
        messages += ["reduce_scatter rows", "all_to_all without recv_splits"]
    with pytest.raises(ValueError, match="recv_splits must have"):
        fo.overlap(a, b, "all_to_all", send_splits=[a.shape[0]] + [0] * (world - 1),
                   recv_splits=[1] * (world + 1))
    messages.append("recv_splits length")
    not_member = dist.new_group([0])  # every rank takes part in new_group
    if rank != 0:
        with pytest.raises(TypeError, match="ProcessGroup"):
            fo.overlap(a, b, "allreduce", group=not_member)
        messages.append("not a member")
    return messages


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"W{w}")
def ranks(request):
    return shared_ranks(request.param)


@pytest.mark.parametrize("compile_backend", [None, "aot_eager", INDUCTOR])
def test_every_op_compiled_equals_eager_and_reference(ranks, compile_backend):
    done = ranks.run(check_every_op, compile_backend)
    assert done == [compile_backend or "eager"] * ranks.world_size


def test_meta_tensors_on_the_group(ranks):
    shapes = ranks.run(check_meta)
    assert len(shapes) == ranks.world_size


def test_errors_on_the_group(ranks):
    ranks.run(check_errors)


# ---- in this process: no torch.distributed, world size 1 ----------------------------------------
def test_public_overlap_is_the_torch_op_layer():
    assert fo.overlap is torch_ops.overlap
    for op in OPS:
        assert hasattr(torch.ops.flashoverlap, op)


def test_eager_fast_path_skips_the_custom_ops(monkeypatch):
    """No grad, real tensors, not compiling: straight to api.overlap, so a callable op works."""
    def no_custom_op(*args, **kwargs):
        raise AssertionError("the custom op was used on the eager fast path")
    monkeypatch.setattr(torch_ops, "_through_custom_op", no_custom_op)
    a, b = torch.randn(9, 4), torch.randn(5, 4).t()
    seen = []
    torch.testing.assert_close(fo.overlap(a, b, lambda region, g: seen.append(g)), a @ b)
    assert seen
    weight = torch.nn.Parameter(torch.randn(5, 4))
    with torch.no_grad():
        torch.testing.assert_close(fo.overlap(a, weight.t()), a @ weight.t())


@pytest.mark.parametrize("op", OPS)
def test_grad_and_meta_and_fake_at_world_size_1(op):
    a, b, grad = inputs(op, 0, 1)
    a.requires_grad_()
    out = fo.overlap(a, b, op)
    torch.testing.assert_close(out, a @ b)
    out.backward(grad)
    torch.testing.assert_close(a.grad, grad @ b.t())
    meta = fo.overlap(a.detach().to("meta"), b.to("meta"), op)
    assert meta.is_meta and meta.shape == out.shape
    mode = FakeTensorMode()
    fake_a, fake_b = mode.from_tensor(a.detach()), mode.from_tensor(b)
    with mode:
        fake = fo.overlap(fake_a, fake_b, op)
    assert fake.shape == out.shape and fake.dtype == out.dtype


def test_out_on_the_custom_op_path():
    a, b = torch.randn(6, 3, requires_grad=True), torch.randn(3, 4)
    out = torch.full((6, 4), float("nan"))
    result = fo.overlap(a, b, out=out)
    assert result is out
    torch.testing.assert_close(out, a.detach() @ b)
    with pytest.raises(ValueError, match=r"shape \(6, 4\)"):
        fo.overlap(a, b, out=torch.empty(4, 6))


def test_plan_travels_through_compile():
    a, b = torch.randn(16, 8), torch.randn(8, 12)
    plans = [fo.plan(16, 12, 8, dtype=torch.float32, tile=tile, backend="reference")
             for tile in ((8, 4), (16, 12))]
    fn = torch.compile(lambda a, b, plan: fo.overlap(a, b, plan=plan), fullgraph=True,
                       backend="aot_eager")
    for plan in plans + plans[:1]:
        torch.testing.assert_close(fn(a, b, plan), a @ b)
    mismatched = fo.plan(8, 12, 8, dtype=torch.float32, backend="reference")
    with pytest.raises(ValueError, match="does not fit"):  # the plan reached api.overlap
        fn(a, b, mismatched)
    with pytest.raises(ValueError, match="does not fit"):
        fo.overlap(a.requires_grad_(), b, plan=mismatched)


def test_callable_op_is_eager_only():
    a, b = torch.randn(4, 3), torch.randn(3, 2)
    transfer = lambda region, index: None  # noqa: E731
    with pytest.raises(TypeError, match="eager-only"):
        fo.overlap(a.requires_grad_(), b, transfer)
    with pytest.raises(TypeError, match="eager-only"):
        fo.overlap(a.detach().to("meta"), b.to("meta"), transfer)
    compiled = torch.compile(lambda a, b: fo.overlap(a, b, transfer), fullgraph=True,
                             backend="aot_eager")
    with pytest.raises(Exception, match="eager-only"):
        compiled(a.detach(), b)


@pytest.mark.parametrize("call, error, match", [
    (lambda a, b: fo.overlap(a, b[:2]), ValueError, "must equal b.shape"),
    (lambda a, b: fo.overlap(a, b.double()), TypeError, "same dtype"),
    (lambda a, b: fo.overlap(a, b, "allgatherr"), ValueError, "op must be one of"),
    (lambda a, b: fo.overlap(a, b, "allreduce", send_splits=[4]), ValueError, "only apply"),
    (lambda a, b: fo.overlap(a, b, group="tp"), TypeError, "ProcessGroup"),
    (lambda a, b: fo.overlap(a[0], b), ValueError, "2-D"),
])
def test_clear_errors_eager_meta_and_compiled(call, error, match):
    a, b = torch.randn(4, 3), torch.randn(3, 2)
    for x, y in ((a.requires_grad_(), b), (a.detach().to("meta"), b.to("meta"))):
        with pytest.raises(error, match=match):
            call(x, y)
    with pytest.raises(Exception, match=match):
        torch.compile(call, fullgraph=True, backend="aot_eager")(a.detach(), b)
