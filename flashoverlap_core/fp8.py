"""fp8 inputs: ``a`` and ``b`` in float8_e4m3fn with float32 scales, bf16 or fp16 out.

``fo.overlap(a8, b8, op, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)`` returns
``op((a8 * sa) @ (b8 * sb))``, accumulated in float32 (the meaning of ``torch._scaled_mm``):

* ``b`` is laid out as ``torch._scaled_mm`` takes it, column-major ``[K, N]`` (``weight.t()``
  of an fp8 ``[N, K]`` weight);
* ``scale_a`` is 0-dim (tensor-wise) or ``[M, 1]`` (row-wise; for allgather this rank's
  ``[m, 1]``), ``scale_b`` 0-dim or ``[1, N]``, both float32;
* ``out_dtype`` is bfloat16 (the default) or float16;
* every op; inference only: an fp8 input or scale that requires grad is a TypeError.

An fp8 call is a call kind of its own (``api.overlap_scaled``): its spec has dtype
``float8_e4m3fn`` and the ``out_dtype``, its plan the ``out_dtype`` too, and it carries its
scales. A backend with ``native_fp8`` (an fp8 signaling GEMM) runs it. A "sequential" plan
runs ``torch._scaled_mm`` and one collective (:class:`ScaledSequentialCall`) where the device
has it. Otherwise it runs dequantized (:class:`DequantizedCall`: the inputs times their scales
in float32, the float32 call, the result rounded to ``out_dtype``). all_to_all always runs
dequantized: its per-call rows and splits path carries no scales.
"""
from __future__ import annotations

import dataclasses

import torch

from .backend import OverlapCall, b_layout

FP8_DTYPES = tuple(d for d in (getattr(torch, "float8_e4m3fn", None),) if d is not None)
OUT_DTYPES = (torch.bfloat16, torch.float16)
INFERENCE_ONLY = ("fp8 calls are for inference: no autograd through them (call under "
                  "torch.no_grad(), or with inputs that do not require grad)")


def is_fp8(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in FP8_DTYPES


def check(a, b, scale_a, scale_b, out_dtype) -> torch.dtype:
    """The fp8 call's own checks (TypeError/ValueError, no device work); the output dtype."""
    if not (is_fp8(a) and is_fp8(b)):
        got = [getattr(t, "dtype", type(t).__name__) for t in (a, b)]
        raise TypeError(f"scale_a, scale_b and out_dtype are for float8_e4m3fn a and b; got "
                        f"a {got[0]} and b {got[1]} (both must be float8_e4m3fn)")
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"a and b must be 2-D, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    (m, _), (_, n) = a.shape, b.shape
    if b_layout(b) != "col":
        raise ValueError("fp8 b must be column-major [K, N], as torch._scaled_mm takes it: "
                         f"weight.t() of a contiguous fp8 [N, K] weight; got strides {b.stride()}")
    for name, scale, shapes in (("scale_a", scale_a, ((), (m, 1))), ("scale_b", scale_b, ((), (1, n)))):
        if scale is None:
            raise TypeError(f"an fp8 call needs {name}: a float32 tensor of shape "
                            f"{' or '.join(str(list(s)) for s in shapes)}")
        if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32:
            raise TypeError(f"{name} must be a float32 tensor, got "
                            f"{getattr(scale, 'dtype', type(scale).__name__)}")
        if tuple(scale.shape) not in shapes:
            raise ValueError(f"{name} must have shape {' or '.join(str(list(s)) for s in shapes)}"
                             f", got {list(scale.shape)}")
        if scale.device != a.device:
            raise ValueError(f"{name} must be on {a.device} like a, got {scale.device}")
    out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be torch.bfloat16 or torch.float16, got {out_dtype}")
    if any(t.requires_grad for t in (a, b, scale_a, scale_b)) and torch.is_grad_enabled():
        raise TypeError(INFERENCE_ONLY)
    return out_dtype


def dequantized(a, b, scale_a, scale_b) -> tuple[torch.Tensor, torch.Tensor]:
    """(a * scale_a, b * scale_b) in float32; b keeps its column-major layout."""
    return a.float() * scale_a, (b.t().float() * scale_b.t()).t()


def dequantized_call(call: OverlapCall) -> OverlapCall:
    """The float32 call an fp8 call runs as (its example tensors, the plan's float32 twin)."""
    a, b = dequantized(call.a, call.b, call.scale_a, call.scale_b)
    out = (None if call.out is None
           else torch.empty(call.out.shape, dtype=torch.float32, device=call.out.device))
    return dataclasses.replace(call, a=a, b=b, plan=call.plan.dequantized(), out=out,
                               scale_a=None, scale_b=None)


class ScaledSequentialCall:
    """The plain path of an fp8 key (a "sequential" plan): ``torch._scaled_mm`` on the
    device's fp8 GEMM (fast accumulation on accelerators, as the native fp8 kernels), then one
    collective on its result, as :class:`~flashoverlap_core.collectives.SequentialCall`; for
    allgather, the e4m3 bytes (and row-wise scales) are gathered, never dequantized rows."""

    def __init__(self, call: OverlapCall, native=None):
        from .collectives import SequentialCall  # the collective half of the plain path

        self.plain = SequentialCall(call, native=native)
        self.fast = call.a.device.type != "cpu"

    @staticmethod
    def available(call: OverlapCall) -> bool:
        """Whether ``torch._scaled_mm`` runs this call's fp8 GEMM on its device (a tiny probe
        at prepare time, with the call's kinds of scale)."""
        if not hasattr(torch, "_scaled_mm"):
            return False
        dev = call.a.device
        a = torch.zeros(16, 32, device=dev, dtype=call.a.dtype)
        b = torch.zeros(16, 32, device=dev, dtype=call.b.dtype).t()
        sa = torch.ones(() if call.scale_a.dim() == 0 else (16, 1), device=dev)
        sb = torch.ones(() if call.scale_b.dim() == 0 else (1, 16), device=dev)
        try:
            torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=call.plan.result_dtype,
                             use_fast_accum=dev.type != "cpu")
        except (RuntimeError, NotImplementedError, TypeError):
            return False
        return True

    def _product(self, a, b, scale_a, scale_b, out_dtype):
        return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype,
                                use_fast_accum=self.fast)

    def run_scaled(self, a, b, scale_a, scale_b, out, op) -> torch.Tensor:
        plain = self.plain
        if plain.collective == "all_gather":
            a = plain.gathered(a)
            scale_a = plain.gathered(scale_a) if scale_a.dim() else scale_a
            return out.copy_(self._product(a, b, scale_a, scale_b, out.dtype))
        product = self._product(a, b, scale_a, scale_b, out.dtype)
        return plain.collect(product, out, op)


class DequantizedCall:
    """The prepared calls of an fp8 key that run dequantized: each call's inputs times their
    scales in float32, then ``inner`` (the prepared float32 call: a backend's, or the
    sequential path), its result rounded into ``out``."""

    def __init__(self, inner):
        self.inner = inner
        self.backend = getattr(inner, "backend", None)

    def run_scaled(self, a, b, scale_a, scale_b, out, op) -> torch.Tensor:
        a32, b32 = dequantized(a, b, scale_a, scale_b)
        result = self.inner.run(a32, b32, torch.empty(out.shape, dtype=torch.float32,
                                                      device=out.device), op)
        return out.copy_(result)
