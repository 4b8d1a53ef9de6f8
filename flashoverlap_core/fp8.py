"""fp8 inputs: ``a`` and ``b`` in float8_e4m3fn with float32 scales, bf16 or fp16 out.

``fo.overlap(a8, b8, op, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)`` returns
``op((a8 * sa) @ (b8 * sb))``, accumulated in float32 (the meaning of ``torch._scaled_mm``):

* ``b`` is laid out as ``torch._scaled_mm`` takes it, column-major ``[K, N]`` (``weight.t()``
  of an fp8 ``[N, K]`` weight);
* ``scale_a`` is 0-dim (tensor-wise) or ``[M, 1]`` (row-wise; for allgather this rank's
  ``[m, 1]``), ``scale_b`` 0-dim or ``[1, N]``, both float32;
* ``out_dtype`` is bfloat16 (the default) or float16;
* every op; inference only: an fp8 input or scale that requires grad is a TypeError.

No backend has an fp8 signaling GEMM yet, so the call is dequantized (the inputs times their
scales, in float32) and runs as a float32 overlapped call on the backend chosen for that
(reference or decomposition), then rounded to ``out_dtype``.
"""
from __future__ import annotations

import torch

FP8_DTYPES = tuple(d for d in (getattr(torch, "float8_e4m3fn", None),) if d is not None)
OUT_DTYPES = (torch.bfloat16, torch.float16)


def is_fp8(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in FP8_DTYPES


def check(a, b, scale_a, scale_b, out_dtype, plan) -> torch.dtype:
    """The fp8 call's own checks (TypeError/ValueError, no device work); the output dtype."""
    if not (is_fp8(a) and is_fp8(b)):
        got = [getattr(t, "dtype", type(t).__name__) for t in (a, b)]
        raise TypeError(f"scale_a, scale_b and out_dtype are for float8_e4m3fn a and b; got "
                        f"a {got[0]} and b {got[1]} (both must be float8_e4m3fn)")
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"a and b must be 2-D, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    (m, _), (_, n) = a.shape, b.shape
    if not (b.stride(0) == 1 and b.stride(1) >= max(1, b.shape[0])):
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
        raise TypeError("fp8 calls are for inference: no autograd through them (call under "
                        "torch.no_grad(), or with inputs that do not require grad)")
    if plan is not None:
        raise ValueError("an fp8 call takes no plan= yet: it runs dequantized, as a float32 "
                         "call with the plan its backend makes")
    return out_dtype


def dequantized(a, b, scale_a, scale_b) -> tuple[torch.Tensor, torch.Tensor]:
    """(a * scale_a, b * scale_b) in float32; b keeps its column-major layout."""
    return a.float() * scale_a, (b.t().float() * scale_b.t()).t()
