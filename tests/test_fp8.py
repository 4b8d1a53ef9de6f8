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
    (dict(plan="a plan"), TypeError, "plan must be a flashoverlap_core.Plan"),
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


@pytest.fixture
def registered():
    """Registers backends for one test only (a registered one would be probed by later tests)."""
    from flashoverlap_core import registry

    names = []
    yield lambda backend: names.append(backend.name) or registry.register(backend)
    for name in names:
        registry._loaded.pop(name, None)
        registry._probed.pop(name, None)


def test_a_backend_without_float32_says_why(registered):
    from flashoverlap_core.reference import ReferenceBackend

    class NoFloat32(ReferenceBackend):
        name = "fake-no-float32"

        def unsupported_reasons(self, spec):
            return ["no float32 GEMM"] if spec.dtype == "float32" else []

    registered(NoFloat32())
    a, b, sa, sb = _call()
    with pytest.raises(fo.BackendError, match="runs dequantized, as a float32 call"):
        fo.overlap(a, b, "allreduce", scale_a=sa, scale_b=sb, backend="fake-no-float32")


# ---- fp8 as a call kind: routing, plans, prepared calls (issue 23) -----------------------------
from flashoverlap_core import api, registry  # noqa: E402
from flashoverlap_core.backend import call_reasons  # noqa: E402
from flashoverlap_core.reference import ReferenceBackend  # noqa: E402


class NativeFp8(ReferenceBackend):
    """Runs fp8 calls itself (as the reference does, from the scales it is handed) and records
    what each call brought."""

    name = "fake-native-fp8"
    native_fp8 = True

    def __init__(self):
        self.calls = []

    def run(self, call):
        self.calls.append((call.a.dtype, call.plan.dtype, call.plan.out_dtype, call.out.dtype,
                           call.scale_a, call.scale_b))
        a32, b32 = fo.fp8.dequantized(call.a, call.b, call.scale_a, call.scale_b)
        return call.out.copy_(a32 @ b32)


def _want(a, b, sa, sb):
    return (a.double() * sa.double()) @ (b.double() * sb.double())


def test_a_native_backend_gets_the_fp8_call_with_each_calls_scales(registered):
    native = registered(NativeFp8())
    api.forget_prepared()
    a, b, sa, sb = _call()
    for scale in (1.0, 2.0, 0.5):  # the second call on takes the prepared key's hot path
        got = fo.overlap(a, b, "allreduce", scale_a=sa * scale, scale_b=sb, out_dtype=torch.float16,
                         backend=native.name)
        assert got.dtype == torch.float16
        assert torch.allclose(got.double(), _want(a, b, sa * scale, sb), rtol=4e-3, atol=1e-3)
    assert [c[:4] for c in native.calls] == [(F8, "float8_e4m3fn", "float16", torch.float16)] * 3
    assert native.calls[-1][4].shape == (7, 1)
    [entry] = fo.prepared_calls()
    assert (entry["dtype"], entry["out_dtype"], entry["backend"]) == (
        "float8_e4m3fn", "float16", native.name)


def test_a_backend_without_native_fp8_runs_the_dequantized_float32_call():
    api.forget_prepared()
    a, b, sa, sb = _call()
    got = fo.overlap(a, b, "reduce_scatter", scale_a=sa, scale_b=sb, backend="decomposition")
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.double(), _want(a, b, sa, sb), rtol=1e-2, atol=1e-2)
    [entry] = fo.prepared_calls()
    assert (entry["runner"], entry["backend"], entry["dtype"]) == (
        "DequantizedCall", "decomposition", "float8_e4m3fn")
    spec = fo.OverlapSpec(7, 9, 16, "allreduce", 1, "float8_e4m3fn", "cpu", "col", None, "bfloat16")
    assert call_reasons(registry.get("reference"), spec) == []


def test_fp8_plans_carry_the_result_dtype_and_fit_only_their_calls():
    a, b, sa, sb = _call(m=8)
    plan = fo.plan(8, 9, 16, dtype=F8, backend="reference")
    assert (plan.dtype, plan.out_dtype, plan.result_dtype) == ("float8_e4m3fn", "bfloat16", torch.bfloat16)
    assert fo.Plan.from_json(plan.to_json()) == plan
    assert "out_dtype" not in fo.plan(8, 9, 16, dtype=torch.float32).to_dict()  # 16-bit JSON as before
    got = fo.overlap(a, b, "allreduce", scale_a=sa, scale_b=sb, plan=plan)
    assert torch.allclose(got.double(), _want(a, b, sa, sb), rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="out_dtype: plan has 'bfloat16', call has 'float16'"):
        fo.overlap(a, b, "allreduce", scale_a=sa, scale_b=sb, out_dtype=torch.float16, plan=plan)
    with pytest.raises(ValueError, match="dtype: plan has 'float8_e4m3fn'"):
        fo.overlap(a.float(), b.float(), "allreduce", plan=plan)
    with pytest.raises(ValueError, match="out_dtype is for fp8"):
        fo.plan(8, 9, 16, dtype=torch.bfloat16, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="out_dtype must be one of"):
        fo.plan(8, 9, 16, dtype=F8, out_dtype=torch.float32)


def test_fp8_out_is_checked_against_the_result_dtype():
    a, b, sa, sb = _call()
    with pytest.raises(ValueError, match="out must be torch.float16"):
        fo.overlap(a, b, "allreduce", scale_a=sa, scale_b=sb, out_dtype=torch.float16,
                   out=torch.empty(7, 9, dtype=torch.bfloat16))
    out = torch.full((7, 9), float("nan"), dtype=torch.float16)
    assert fo.overlap(a, b, "allreduce", scale_a=sa, scale_b=sb, out_dtype=torch.float16, out=out) is out
    assert not out.isnan().any()


def test_fp8_all_to_all_runs_dequantized_and_sequential_plans_scaled_mm():
    api.forget_prepared()
    a, b, sa, sb = _call(m=8)
    got = fo.overlap(a, b, "all_to_all", scale_a=sa, scale_b=sb)
    assert torch.allclose(got.double(), _want(a, b, sa, sb), rtol=1e-2, atol=1e-2)
    assert [c["dtype"] for c in fo.prepared_calls()] == ["float32"]  # the float32 call's key
    import dataclasses

    sequential = dataclasses.replace(fo.plan(8, 9, 16, dtype=F8, backend="reference"),
                                     strategy="sequential", group_sizes=(1,))
    got = fo.overlap(a, b, "allreduce", scale_a=sa, scale_b=sb, plan=sequential)
    assert torch.allclose(got.double(), _want(a, b, sa, sb), rtol=1e-2, atol=1e-2)
    # the plain path runs the device's fp8 GEMM (torch._scaled_mm), never dequantized rows
    assert fo.prepared_calls()[-1]["runner"] == "ScaledSequentialCall"


def test_fp8_backward_says_fp8_is_for_inference():
    a, b, sa, sb = _call()
    sa.requires_grad_(True)
    fn = torch.compile(lambda *t: fo.overlap(*t[:2], "allreduce", scale_a=t[2], scale_b=t[3]))
    with pytest.raises(Exception, match="inference"):
        fn(a, b, sa, sb).sum().backward()
