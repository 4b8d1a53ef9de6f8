"""The post-communication reorder fused into the next op: residual add + RMSNorm.

``overlap_add_rmsnorm(a, b, residual, weight, eps=1e-6, op="allreduce")`` returns
``(normed, residual_out)`` with ``residual_out = residual + op(a @ b)`` and ``normed =
residual_out * rsqrt(mean(residual_out ** 2, -1) + eps) * weight``, in float32 math, both in
``a``'s dtype (the seed's ReorderRMSNorm; vLLM and flashinfer fuse allreduce + add + RMSNorm
likewise). ``op`` is ``allreduce`` (``residual`` is ``[M, N]``) or ``reduce_scatter``
(``residual`` is this rank's ``[M / W, N]`` rows).

The call runs on the prepared call ``overlap`` would run (:func:`api.prepared_call`), through
its ``run_add_rmsnorm``: a backend with a fused kernel reads the received tiles and the
residual once and writes both results; the others post-reorder, then add and normalise in
torch (:meth:`Backend.run_add_rmsnorm <flashoverlap_core.backend.Backend.run_add_rmsnorm>`).
Like ``overlap``, a key's first call checks everything and prepares; later calls of the key
(same shapes, strides, dtypes and devices of a and b, residual and weight, op, group, plan,
backend) check only eps and launch.
"""
from __future__ import annotations

import numbers

import torch

from . import api, faults
from .ops import REDUCE_OPS
from .reorder import add_rmsnorm

NORM_OPS = REDUCE_OPS  # the ops whose ranks' results are summed
__all__ = ["NORM_OPS", "add_rmsnorm", "add_rmsnorm_backward", "check", "overlap_add_rmsnorm"]


def check(a, b, residual, weight, eps, op, group) -> int:
    """Every check that needs no device work (TypeError/ValueError); the result's rows."""
    if not isinstance(op, str) or op not in NORM_OPS:
        raise ValueError(f"overlap_add_rmsnorm takes op one of {NORM_OPS}, got {op!r}")
    c = api.check_arguments(a, b, op, group)
    rows, n = c["rows"], c["n"]
    for name, t in (("residual", residual), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != a.device:
            raise ValueError(f"{name} must be on {a.device} like a, got {t.device}")
    if residual.dtype != a.dtype:
        raise TypeError(f"residual must have a's dtype {a.dtype}, got {residual.dtype}")
    if tuple(residual.shape) != (rows, n):
        what = "this rank's rows of the result" if op == "reduce_scatter" else "the result"
        raise ValueError(f"residual must be [{rows}, {n}] ({what}), got {tuple(residual.shape)}")
    if not weight.is_floating_point() or tuple(weight.shape) != (n,):
        raise ValueError(f"weight must be a floating-point [{n}] tensor, got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps >= 0:
        raise ValueError(f"eps must be a real number >= 0, got {eps!r}")
    return rows


def add_rmsnorm_backward(resid_out, weight, eps: float, grad_normed, grad_resid):
    """(d residual_out, d weight) of ``normed = rmsnorm(residual_out) * weight`` given the two
    outputs' gradients (either may be None), in float32."""
    x = resid_out.float()
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    grad_x = grad_resid.float() if grad_resid is not None else torch.zeros_like(x)
    grad_w = None
    if grad_normed is not None:
        g = grad_normed.float() * weight.float()
        grad_x = grad_x + rstd * g - x * rstd.pow(3) * (g * x).mean(-1, keepdim=True)
        grad_w = (grad_normed.float() * x * rstd).sum(0)
    return grad_x, grad_w


_prepared = api.keyed_table()  # key (see below) -> the prepared call that runs it


def overlap_add_rmsnorm(a, b, residual, weight, eps: float = 1e-6, op: str = "allreduce",
                        group=None, *, plan=None, backend=None):
    """See the module docstring (the eager path: real tensors, nothing to differentiate)."""
    try:  # overlap's key, then the residual's and the weight's layout
        key = api.call_key(a, b, op, group, plan, backend, more=api.tensor_facts(residual, weight))
        prepared = _prepared.get(key)
    except (AttributeError, TypeError):  # not tensors, an unhashable op: the checks say what
        key = prepared = None
    if prepared is None or eps.__class__ is not float or not eps >= 0:
        check(a, b, residual, weight, eps, op, group)
        prepared = api.prepared_call(a, b, op, group, plan, backend)
        if key is not None:
            api.remember(_prepared, key, prepared)
    if faults.failures:
        faults.check(group, op)
    try:
        return prepared.run_add_rmsnorm(a, b, op, residual, weight, float(eps))
    except RuntimeError as e:  # communication that failed: the group's CommunicationError
        failure = faults.raised(e, group, op)
        if failure is None:
            raise
        raise failure from e
