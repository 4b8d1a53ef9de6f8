"""``overlap`` as torch custom ops: traceable by torch.compile, differentiable, fake-tensor aware.

The string ops are registered as ``flashoverlap::allreduce``, ``::reduce_scatter``,
``::all_to_all`` and ``::allgather`` (see docs/design.md, "In a model"). The process group
travels by name, as in torch's functional collectives, and a plan as its JSON text. Each op's
real kernel is :func:`flashoverlap_core.api.overlap`; its fake kernel gives the result's shape
and dtype; its registered backward is made of the same overlapped ops where one fits (a
reduce-scattered output's gradient is all-gathered into the next GEMM, an all-gathered input's
gradient is the reduce-scatter of a GEMM's output).

:func:`overlap` is the public ``fo.overlap``. A plain eager call (real tensors, nothing to
differentiate, not compiling) goes straight to ``api.overlap``: the custom-op machinery costs
microseconds per call, and the eager path's whole budget is ~30 us. A callable ``op`` runs only
on that path.
"""
from __future__ import annotations

from functools import lru_cache

import torch
import torch.distributed as dist

from . import add_rmsnorm as norm
from . import api, fp8, registry
from .backend import OverlapSpec
from .checks import check_operands, check_rows
from .ops import OPS, of
from .plan import Plan, dtype_name

NAMESPACE = "flashoverlap"
STRING_OPS = OPS

_Tensor, _Parameter = torch.Tensor, torch.nn.Parameter
_is_compiling, _grad_enabled = torch.compiler.is_compiling, torch.is_grad_enabled


def overlap(a, b, op="allreduce", group=None, *, plan: Plan | None = None, out=None,
            send_splits=None, recv_splits=None, backend: str | None = None, scale_a=None,
            scale_b=None, out_dtype=None):
    """``op`` applied to ``a @ b`` across ``group`` with the communication overlapped with the
    GEMM (semantics in :func:`flashoverlap_core.api.overlap` and docs/design.md).

    Under torch.compile, with meta or fake tensors, or when ``a`` or ``b`` requires grad, the
    string ops run as torch custom ops; ``all_to_all`` then needs explicit ``recv_splits`` (the
    result's size must be known without communicating) when the world size is above 1. A
    callable ``op`` is eager-only: it raises ``TypeError`` there.

    fp8: float8_e4m3fn ``a`` and ``b`` (b column-major) with float32 ``scale_a`` (0-dim or
    [M, 1]) and ``scale_b`` (0-dim or [1, N]) give ``op((a * scale_a) @ (b * scale_b))`` in
    ``out_dtype`` (bfloat16 default, or float16); inference only (flashoverlap_core/fp8.py).
    """
    if scale_a is not None or scale_b is not None or out_dtype is not None:
        return _overlap_fp8(a, b, op, group, plan, out, send_splits, recv_splits, backend,
                            scale_a, scale_b, out_dtype)
    if not _is_compiling() and _direct(a) and _direct(b):
        return api.overlap(a, b, op, group, plan=plan, out=out, send_splits=send_splits,
                           recv_splits=recv_splits, backend=backend)
    return _through_custom_op(a, b, op, group, plan, out, send_splits, recv_splits, backend)


def _overlap_fp8(a, b, op, group, plan, out, send_splits, recv_splits, backend, scale_a,
                 scale_b, out_dtype):
    """The fp8 call (api.overlap_scaled); under torch.compile, on fake tensors or with a
    scale that requires grad, the fp8 custom ops (all_to_all: dequantized, the float32 op;
    eagerly it runs on the backend's fp8 path)."""
    if not _is_compiling() and all(_direct(t) for t in (a, b, scale_a, scale_b)):
        return api.overlap_scaled(a, b, op, group, scale_a=scale_a, scale_b=scale_b,
                                  out_dtype=out_dtype, plan=plan, out=out,
                                  send_splits=send_splits, recv_splits=recv_splits,
                                  backend=backend)
    out_dtype = fp8.check(a, b, scale_a, scale_b, out_dtype)  # inference only: TypeError
    if callable(op) and not isinstance(op, str):
        raise TypeError("a callable op is eager-only: it cannot run under torch.compile, on "
                        "meta or fake tensors, or on tensors that require grad")
    if not _is_compiling():
        api.check_arguments(a, b, op, group, plan, out, send_splits, recv_splits, out_dtype)
    if op == "all_to_all":  # no fp8 custom op: the float32 op of the dequantized inputs
        a32, b32 = fp8.dequantized(a, b, scale_a, scale_b)
        result = _through_custom_op(a32, b32, op, group, plan.dequantized() if plan else None,
                                    None, send_splits, recv_splits, backend).to(out_dtype)
    elif not isinstance(op, str) or op not in FP8_OPS:
        raise ValueError(f"op must be one of {STRING_OPS} or a callable op(region, index), "
                         f"got {op!r}")
    else:
        name = group_name(group)
        size = dist.get_world_size(group) if name else 1
        result = FP8_OPS[op](a, b, scale_a, scale_b, name, size, out_dtype,
                             plan=_plan_text(plan) if plan is not None else None, backend=backend)
    if out is None:
        return result
    if not isinstance(out, _Tensor) or out.shape != result.shape or out.dtype != result.dtype:
        raise ValueError(f"out must be a {result.dtype} tensor of shape {tuple(result.shape)}, "
                         f"got {_describe(out)}")
    return out.copy_(result)


def _direct(t) -> bool:
    """Whether ``api.overlap`` can take ``t`` as it is: a real tensor with nothing to
    differentiate, or a DLPack array. Tensor subclasses (fake, functional) need the custom op."""
    if type(t) is _Tensor or type(t) is _Parameter:
        return not t.is_meta and not (t.requires_grad and _grad_enabled())
    return not isinstance(t, _Tensor)


def _through_custom_op(a, b, op, group, plan, out, send_splits, recv_splits, backend):
    if callable(op) and not isinstance(op, str):
        raise TypeError(
            "a callable op is eager-only: it cannot run under torch.compile, on meta or fake "
            "tensors, or on tensors that require grad (call it under torch.no_grad(), on "
            "real tensors, outside the compiled region)")
    if not _is_compiling():
        # Every check api.overlap makes before device work, with its messages. (Under
        # torch.compile the fake kernel checks what shapes can tell: dynamo does not trace these.)
        checked = api.check_arguments(a, b, op, group, plan, out, send_splits, recv_splits)
        if checked["op"] == "all_to_all":
            _check_rows_known(checked["world_size"], send_splits, recv_splits)
    if not isinstance(op, str) or op not in STRING_OPS:
        raise ValueError(f"op must be one of {STRING_OPS} or a callable op(region, index), "
                         f"got {op!r}")
    kwargs = {"plan": _plan_text(plan) if plan is not None else None, "backend": backend}
    name = group_name(group)
    size = dist.get_world_size(group) if name else 1  # dynamo folds this to a constant
    if op == "all_to_all":
        args = (a, b, name, size, _split_list(send_splits), _split_list(recv_splits))
    elif send_splits is not None or recv_splits is not None:
        raise ValueError(f"send_splits/recv_splits only apply to op='all_to_all', not {op!r}")
    else:
        args = (a, b, name, size)
    result = CUSTOM_OPS[op](*args, **kwargs)
    if out is None:
        return result
    if not isinstance(out, _Tensor) or out.shape != result.shape or out.dtype != result.dtype:
        raise ValueError(f"out must be a {result.dtype} tensor of shape {tuple(result.shape)}, "
                         f"got {_describe(out)}")
    return out.copy_(result)


def _describe(x) -> str:
    if isinstance(x, _Tensor):
        return f"{x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__


def _split_list(splits):
    if splits is None or isinstance(splits, list):
        return splits
    if isinstance(splits, (str, bytes)) or not hasattr(splits, "__iter__"):
        raise TypeError(f"splits must be a sequence of ints, got {type(splits).__name__}")
    return list(splits)


# ---- process groups by name, as torch's functional collectives pass them --------------------
def group_name(group) -> str:
    """The name a custom op carries for ``group``; "" when torch.distributed is not initialised
    (world size 1, the collective is the identity)."""
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return ""
        group = dist.group.WORLD
    elif not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None, "
                        f"got {type(group).__name__}")
    return group.group_name


def resolve_group(name: str):
    """The process group a custom op's ``group_name`` names (None for "")."""
    if not name:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group
    return _resolve_process_group(name)


def world_size(name: str) -> int:
    return resolve_group(name).size() if name else 1


# ---- plans travel as JSON text ---------------------------------------------------------------
def _plan_text(plan) -> str:
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a flashoverlap_core.Plan or None, got {type(plan).__name__}")
    return plan.to_json()


# Dynamo runs this at trace time instead of tracing it (it cannot trace json, nor repr a plan
# whose ints it made symbolic), and guards on the plan, so another plan retraces. This is what
# torch.compiler.assume_constant_result does, without importing torch._dynamo (seconds) into
# every `import flashoverlap_core`.
_plan_text._dynamo_marked_constant = True


@lru_cache(maxsize=64)
def _plan_from_text(text: str) -> Plan:
    return Plan.from_json(text)


# ---- the custom ops --------------------------------------------------------------------------
# The group travels by name and by size, as in torch's functional collectives: the result's
# shape depends on the size, so it must be an argument of the op. Otherwise a graph traced (and
# cached on disk by torch.compile) at one world size is reused at another: the names of the
# default groups are the same at every world size.
_HEAD = "(Tensor a, Tensor b, str group_name, int group_size, "
_TAIL = "*, str? plan=None, str? backend=None) -> Tensor"
SCHEMAS = {
    "allreduce": _HEAD + _TAIL,
    "reduce_scatter": _HEAD + _TAIL,
    "allgather": _HEAD + _TAIL,
    "all_to_all": _HEAD + "SymInt[]? send_splits, SymInt[]? recv_splits, " + _TAIL,
}
# The backend reads b's layout (weight.t() is the fast case): keep the strides the caller gave.
_TAGS = tuple(t for t in (getattr(torch.Tag, "needs_exact_strides", None),) if t is not None)


def _real_kernel(op: str):
    def run(a, b, group_name, group_size, send_splits=None, recv_splits=None, *, plan=None,
            backend=None):
        _check_group_size(group_name, group_size)
        return api.overlap(a, b, op, resolve_group(group_name),
                           plan=_plan_from_text(plan) if plan is not None else None,
                           send_splits=send_splits, recv_splits=recv_splits, backend=backend)
    run.__name__ = op
    return run


def _check_group_size(group_name: str, group_size: int) -> None:
    actual = world_size(group_name)
    if group_size != actual:
        raise ValueError(f"the op was traced for a group of {group_size} rank(s), but group "
                         f"{group_name!r} has {actual}: the graph belongs to another world size")


def _fake_kernel(op: str):
    def fake(a, b, group_name, group_size, send_splits=None, recv_splits=None, *, plan=None,
             backend=None):
        rows = result_rows(op, a, b, group_size, send_splits, recv_splits)
        return a.new_empty((rows, b.shape[1]))
    return fake


def result_rows(op: str, a, b, world: int, send_splits=None, recv_splits=None,
                out_dtype=None) -> int:
    """Rows of ``op``'s result, with the checks a shape-only (fake) run can make (those of
    ``api.check_arguments`` that need no process group, plan or out): the fake kernel's, so
    also the checks under torch.compile."""
    m = check_operands(a, b, op, out_dtype)[0]
    if of(op).splits:
        _check_rows_known(world, send_splits, recv_splits)
    return check_rows(op, m, world, send_splits, recv_splits)[2]


def _check_rows_known(world, send_splits, recv_splits) -> None:
    """all_to_all as a custom op: the result's rows must be known without communicating, and
    the backward pass needs both splits."""
    if (recv_splits is None and world > 1) or (recv_splits is not None and send_splits is None):
        raise ValueError(
            f"all_to_all at world size {world} under torch.compile, autograd or fake tensors "
            "needs explicit send_splits and recv_splits (the result's rows must be known "
            "without communicating)")


def _define(op: str):
    custom = torch.library.custom_op(f"{NAMESPACE}::{op}", _real_kernel(op), mutates_args=(),
                                     schema=SCHEMAS[op], tags=_TAGS)
    custom.register_fake(_fake_kernel(op))
    return custom


CUSTOM_OPS = {op: _define(op) for op in STRING_OPS}


# ---- autograd --------------------------------------------------------------------------------
# Every rank r computes c_r = a_r @ b_r. Its result's gradient g is mapped back to dL/dc_r, then
# dL/da_r = dL/dc_r @ b_r^T and dL/db_r = a_r^T @ dL/dc_r, using an overlapped op where the
# mapping's collective feeds (or is fed by) one of these GEMMs.
def _setup_context(ctx, inputs, output, keyword_only_inputs=None):
    # torch passes the schema's keyword-only arguments (plan, backend) as keyword_only_inputs=;
    # one left at its default may be missing from it.
    a, b, name = inputs[:3]
    ctx.save_for_backward(a, b)
    ctx.group_name = name
    ctx.splits = inputs[4:6]
    ctx.backend = (keyword_only_inputs or {}).get("backend")


def _backward_backend(ctx, op: str, a, b) -> str | None:
    """The forward's ``backend=`` for the backward's overlapped ``op`` of ``a @ b`` when that
    backend can run it, else None (the automatic choice): a layer built with ``backend="X"``
    keeps X for its backward, and X declining the backward's op is no error."""
    if ctx.backend is None:
        return None
    try:
        chosen = registry.get(ctx.backend)
    except registry.BackendError:  # unavailable here: the forward's call says so
        return None
    world = world_size(ctx.group_name)
    spec = OverlapSpec(of(op).result_rows(a.shape[0], world), b.shape[1], a.shape[1], op,
                       world, dtype_name(a.dtype), a.device.type, api.b_layout(b))
    if chosen.device_type not in (None, spec.device_type) or chosen.unsupported_reasons(spec):
        return None
    return ctx.backend


def _grads(ctx, grad_c):
    """(dL/da, dL/db) from dL/dc, a plain tensor on this rank."""
    a, b = ctx.saved_tensors[:2]
    grad_a = grad_c @ b.t() if ctx.needs_input_grad[0] else None
    grad_b = a.t() @ grad_c if ctx.needs_input_grad[1] else None
    return grad_a, grad_b


def _backward_allreduce(ctx, grad):
    # Every rank's partial product contributed to the sum with weight 1, and the result's
    # gradient is the same on every rank: no communication.
    return *_grads(ctx, grad), None, None


def _backward_reduce_scatter(ctx, grad):
    # dL/dc is the all-gather of the ranks' row blocks of the gradient. When dL/db is wanted it
    # needs the gathered rows themselves: they are gathered once and both GEMMs read them (an
    # overlapped allgather-GEMM for dL/da would gather the same rows a second time, beside the
    # first: twice the bytes on the links). Without dL/db (frozen weights), dL/da is one
    # overlapped allgather-GEMM.
    a, b = ctx.saved_tensors[:2]
    grad = grad.contiguous()
    if ctx.needs_input_grad[1]:
        gathered = _all_gather(grad, ctx.group_name)
        grad_a = gathered @ b.t() if ctx.needs_input_grad[0] else None
        return grad_a, a.t() @ gathered, None, None
    grad_a = (overlap(grad, b.t(), "allgather", resolve_group(ctx.group_name),
                      backend=_backward_backend(ctx, "allgather", grad, b.t()))
              if ctx.needs_input_grad[0] else None)
    return grad_a, None, None, None


def _backward_allgather(ctx, grad):
    # The result is allgather(a) @ b: a's rows reach every rank's GEMM, so dL/da is this rank's
    # rows of the sum over ranks of grad @ b^T, one overlapped GEMM-reduce_scatter. dL/db needs
    # the gathered a again (gathered once more rather than kept from the forward, as Megatron does).
    a, b = ctx.saved_tensors
    gathered = _all_gather(a, ctx.group_name) if ctx.needs_input_grad[1] else None
    grad = grad.contiguous()
    grad_a = (overlap(grad, b.t(), "reduce_scatter", resolve_group(ctx.group_name),
                      backend=_backward_backend(ctx, "reduce_scatter", grad, b.t()))
              if ctx.needs_input_grad[0] else None)
    grad_b = gathered.t() @ grad if gathered is not None else None
    return grad_a, grad_b, None, None


def _backward_all_to_all(ctx, grad):
    # The rows go back where they came from: the inverse all_to_all (splits swapped), then the
    # local GEMMs. No overlapped op fits: the collective comes before the GEMMs that use it.
    send, recv = ctx.splits
    grad_c = _all_to_all(grad.contiguous(), ctx.group_name, out_splits=send, in_splits=recv)
    return *_grads(ctx, grad_c), None, None, None, None


# torch's functional collectives: traceable, and in eager they return a tensor that waits on
# first use, so a collective started early runs while the next call does.
def _all_gather(t, name):
    if not name:
        return t
    from torch.distributed import _functional_collectives as funcol
    # all_gather_tensor is the older name of all_gather_single
    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    return gather(t, 0, name)


def _all_to_all(t, name, out_splits, in_splits):
    if not name:
        return t
    from torch.distributed import _functional_collectives as funcol
    return funcol.all_to_all_single(t, out_splits, in_splits, name)


_BACKWARDS = {"allreduce": _backward_allreduce, "reduce_scatter": _backward_reduce_scatter,
              "allgather": _backward_allgather, "all_to_all": _backward_all_to_all}
for _op, _custom in CUSTOM_OPS.items():
    _custom.register_autograd(_BACKWARDS[_op], setup_context=_setup_context)


# ---- fp8 (flashoverlap_core/fp8.py): allreduce, reduce_scatter and allgather --------------------
# Inference only: no gradient flows through them (a backward raises, saying so).
_FP8_SCHEMA = ("(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, str group_name, "
               "int group_size, ScalarType out_dtype, *, str? plan=None, str? backend=None) -> Tensor")


def _fp8_real_kernel(op: str):
    def run(a, b, scale_a, scale_b, group_name, group_size, out_dtype, *, plan=None, backend=None):
        _check_group_size(group_name, group_size)
        return api.overlap_scaled(a, b, op, resolve_group(group_name), scale_a=scale_a,
                                  scale_b=scale_b, out_dtype=out_dtype,
                                  plan=_plan_from_text(plan) if plan is not None else None,
                                  backend=backend)
    run.__name__ = f"{op}_fp8"
    return run


def _fp8_fake_kernel(op: str):
    def fake(a, b, scale_a, scale_b, group_name, group_size, out_dtype, *, plan=None, backend=None):
        return a.new_empty((result_rows(op, a, b, group_size, out_dtype=out_dtype), b.shape[1]),
                           dtype=out_dtype)
    return fake


def _fp8_backward(ctx, grad):
    raise TypeError(fp8.INFERENCE_ONLY)


def _define_fp8(op: str):
    custom = torch.library.custom_op(f"{NAMESPACE}::{op}_fp8", _fp8_real_kernel(op),
                                     mutates_args=(), schema=_FP8_SCHEMA, tags=_TAGS)
    custom.register_fake(_fp8_fake_kernel(op))
    custom.register_autograd(_fp8_backward, setup_context=lambda ctx, inputs, output: None)
    return custom


FP8_OPS = {op: _define_fp8(op) for op in ("allreduce", "reduce_scatter", "allgather")}


# ---- overlap + residual add + RMSNorm (flashoverlap_core/add_rmsnorm.py) ------------------------
_NORM_SCHEMA = ("(Tensor a, Tensor b, Tensor residual, Tensor weight, str group_name, "
                "int group_size, float eps, *, str? plan=None, str? backend=None) -> (Tensor, Tensor)")


def overlap_add_rmsnorm(a, b, residual, weight, *, eps: float = 1e-6, op: str = "allreduce",
                        group=None, plan: Plan | None = None, backend: str | None = None):
    """``(normed, residual_out)``: ``residual_out = residual + op(a @ b)`` (op ``allreduce``
    or ``reduce_scatter``; with reduce_scatter ``residual`` is this rank's rows) and ``normed =
    residual_out * rsqrt(mean(residual_out ** 2, -1) + eps) * weight``, float32 math, in a's
    dtype (see flashoverlap_core/add_rmsnorm.py). A torch custom op under torch.compile, on
    fake tensors or with gradients: an allreduced output's gradient needs no communication, a
    reduce-scattered one's is all-gathered, and ``weight``'s gradient is this rank's rows' share.
    """
    tensors = (a, b, residual, weight)
    if not _is_compiling() and all(_direct(t) for t in tensors):
        return norm.overlap_add_rmsnorm(a, b, residual, weight, eps, op, group, plan=plan,
                                        backend=backend)
    if not _is_compiling():
        norm.check(a, b, residual, weight, eps, op, group)
    if not isinstance(op, str) or op not in norm.NORM_OPS:
        raise ValueError(f"overlap_add_rmsnorm takes op one of {norm.NORM_OPS}, got {op!r}")
    name = group_name(group)
    size = dist.get_world_size(group) if name else 1
    return NORM_OPS[op](a, b, residual, weight, name, size, float(eps),
                        plan=_plan_text(plan) if plan is not None else None, backend=backend)


def _norm_real_kernel(op: str):
    def run(a, b, residual, weight, group_name, group_size, eps, *, plan=None, backend=None):
        _check_group_size(group_name, group_size)
        return norm.overlap_add_rmsnorm(a, b, residual, weight, eps, op, resolve_group(group_name),
                                        plan=_plan_from_text(plan) if plan is not None else None,
                                        backend=backend)
    run.__name__ = f"{op}_add_rmsnorm"
    return run


def _norm_fake_kernel(op: str):
    def fake(a, b, residual, weight, group_name, group_size, eps, *, plan=None, backend=None):
        rows = result_rows(op, a, b, group_size)
        if tuple(residual.shape) != (rows, b.shape[1]):
            raise ValueError(f"residual must be [{rows}, {b.shape[1]}], got {tuple(residual.shape)}")
        return a.new_empty((rows, b.shape[1])), a.new_empty((rows, b.shape[1]))
    return fake


def _norm_setup_context(ctx, inputs, output, keyword_only_inputs=None):
    a, b, residual, weight, name, _, eps = inputs
    ctx.save_for_backward(a, b, weight, output[1])
    ctx.group_name, ctx.eps = name, eps
    ctx.backend = (keyword_only_inputs or {}).get("backend")


def _norm_backward(op: str):
    reduce_backward = {"allreduce": _backward_allreduce, "reduce_scatter": _backward_reduce_scatter}[op]

    def backward(ctx, grad_normed, grad_resid):
        a, b, weight, resid_out = ctx.saved_tensors
        grad_x, grad_w = norm.add_rmsnorm_backward(resid_out, weight, ctx.eps, grad_normed,
                                                   grad_resid)
        grad_a, grad_b = reduce_backward(ctx, grad_x.to(a.dtype))[:2]
        grad_residual = grad_x.to(resid_out.dtype) if ctx.needs_input_grad[2] else None
        grad_weight = grad_w.to(weight.dtype) if ctx.needs_input_grad[3] and grad_w is not None else None
        return grad_a, grad_b, grad_residual, grad_weight, None, None, None
    return backward


def _define_norm(op: str):
    custom = torch.library.custom_op(f"{NAMESPACE}::{op}_add_rmsnorm", _norm_real_kernel(op),
                                     mutates_args=(), schema=_NORM_SCHEMA, tags=_TAGS)
    custom.register_fake(_norm_fake_kernel(op))
    custom.register_autograd(_norm_backward(op), setup_context=_norm_setup_context)
    return custom


NORM_OPS = {op: _define_norm(op) for op in norm.NORM_OPS}
