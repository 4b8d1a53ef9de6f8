"""fp8 calls' argument checks, the inference-only rule and torch.compile (the conformance suite
checks the results at W = 1-4: flashoverlap_core/testing/test_fp8.py)."""
from __future__ import annotations

import pytest
import torch

import flashoverlap_core as fo

F8 = torch.float8_e4m3fn


def _call(m=7, n=9, k=16):
    a = torch.randn(m, k).to(F8)
    b = torch.randn(n, k).to(F8).t()
    return a, b, torch.rand(m, 1) + 0.5, torch.rand(1, n) + 0.5


@pytest.mark.parametrize("change, error, match", [
    (dict(scale_a=None), TypeError, "needs scale_a"),
    (dict(scale_b=None), TypeError, "needs scale_b"),
    (dict(scale_a=torch.rand(7, 1, dtype=torch.float64)), TypeError, "scale_a must be a float32"),
    (dict(scale_a=torch.rand(1, 7)), ValueError, r"scale_a must have shape \[\] or \[7, 1\]"),
    (dict(scale_b=torch.rand(9, 1)), ValueError, r"scale_b must have shape \[\] or \[1, 9\]"),
    (dict(out_dtype=torch.float32), ValueError, "out_dtype must be torch.bfloat16 or torch.float16"),
    (dict(b=torch.randn(16, 9)), TypeError, "both must be float8_e4m3fn"),
    (dict(b=torch.randn(16, 9).to(F8)), ValueError, "column-major"),
    (dict(plan="a plan"), ValueError, "takes no plan"),
])
def test_bad_fp8_arguments_are_refused(change, error, match):
    a, b, sa, sb = _call()
    kw = {"b": b, "scale_a": sa, "scale_b": sb, **change}
    b = kw.pop("b")
    with pytest.raises(error, match=match):
        fo.overlap(a, b, "allreduce", **kw)


def test_fp8_without_scales_says_what_it_needs():
    a, b, _, _ = _call()
    with pytest.raises(TypeError, match="need scale_a and scale_b"):
        fo.overlap(a, b, "allreduce")


def test_fp8_is_inference_only():
    a, b, sa, sb = _call()
    with pytest.raises(TypeError, match="inference"):
        fo.overlap(a, b, "allreduce", scale_a=sa.requires_grad_(True), scale_b=sb)
    with torch.no_grad():
        fo.overlap(a, b, "allreduce", scale_a=sa, scale_b=sb)


def test_fp8_compiles_and_names_its_dtype():
    a, b, sa, sb = _call()
    fn = torch.compile(lambda *t: fo.overlap(*t[:2], "allreduce", scale_a=t[2], scale_b=t[3],
                                             out_dtype=torch.float16), fullgraph=True)
    got = fn(a, b, sa, sb)
    want = (a.double() * sa.double()) @ (b.double() * sb.double())
    assert got.dtype == torch.float16
    assert float((got.double() - want).abs().max()) <= 4e-3 * float(want.abs().max())


def test_a_backend_without_float32_says_why():
    from flashoverlap_core import registry
    from flashoverlap_core.reference import ReferenceBackend

    class NoFloat32(ReferenceBackend):
        name = "fake-no-float32"

        def unsupported_reasons(self, spec):
            return ["no float32 GEMM"] if spec.dtype == "float32" else []

    registry.register(NoFloat32())
    a, b, sa, sb = _call()
    with pytest.raises(fo.BackendError, match="runs dequantized, as a float32 call"):
        fo.overlap(a, b, "allreduce", scale_a=sa, scale_b=sb, backend="fake-no-float32")
