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
    (dict(scale_a=torch.rand(1, 7)), ValueError,
     r"scale_a has shape \[1, 7\]; the scales must be one of: tensor-wise: both 0-dim; row-wise: "
     r"scale_a 0-dim or \[7, 1\] and scale_b 0-dim or \[1, 9\]"),
    (dict(scale_b=torch.rand(9, 1)), ValueError, r"scale_b \[9, 1\].*row-wise: scale_a 0-dim or \[7, 1\] and scale_b 0-dim or \[1, 9\]"),
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


def _block_call(m=8, n=200, k=300):
    """A block-wise call: K and N ragged against the 128 blocks."""
    a = torch.randn(m, k).to(F8)
    b = torch.randn(n, k).to(F8).t()
    return a, b, torch.rand(m, 3) + 0.5, torch.rand(3, 2) + 0.5


def test_blockwise_scales_take_torch_layouts_and_the_padded_scale_b():
    """Any strides (torch's outer-dim-major scale_a, scale_b as weight_scale.t()) and the
    padded [round_up(ceil(K/128), 4), ceil(N/128)] scale_b that F.scaled_mm takes give the same
    result; the rows of the padding are not read."""
    api.forget_prepared()
    a, b, sa, sb = _block_call()
    want = fo.overlap(a, b, "allreduce", scale_a=sa, scale_b=sb).double()
    outer = sa.t().contiguous().t()  # strides (1, M)
    weight_scale = sb.t().contiguous()  # [ceil(N/128), ceil(K/128)], a checkpoint's layout
    padded = torch.full((4, 2), float(1e30))
    padded[:3] = sb
    for scale_a, scale_b in ((outer, weight_scale.t()), (sa, padded),
                             (outer, padded.t().contiguous().t())):
        got = fo.overlap(a, b, "allreduce", scale_a=scale_a, scale_b=scale_b)
        assert torch.equal(got.double(), want)
    kinds = {(e["a"][0], tuple(e["b"]), e["scaling"]) for e in fo.prepared_calls()}
    assert kinds == {(8, (300, 200), "blockwise")}


@pytest.mark.parametrize("m, n, k, scales, kind", [
    (8, 9, 16, ((), ()), "tensorwise"),
    (8, 9, 16, ((8, 1), ()), "rowwise"),
    (8, 9, 16, ((8, 1), (1, 9)), "rowwise"),
    (8, 1, 16, ((8, 1), (1, 1)), "rowwise"),  # fits both kinds: the same product
    (8, 9, 16, ((8, 1), (1, 1)), "blockwise"),  # K <= 128: [M, 1] is both kinds of scale_a
    (8, 200, 300, ((8, 3), (3, 2)), "blockwise"),
    (8, 200, 300, ((8, 3), (4, 2)), "blockwise"),  # F.scaled_mm's padded scale_b
    (8, 200, 300, ((8, 3), (1, 200)), None),
    (8, 200, 1024, ((8, 8), (8, 2)), "blockwise"),
])
def test_the_scaling_kind_follows_from_the_shapes(m, n, k, scales, kind):
    sa, sb = (torch.empty(s) for s in scales)
    assert fo.fp8.scaling_kind(m, n, k, sa, sb) == kind


def test_blockwise_plans_carry_their_scaling_and_fit_only_blockwise_calls():
    plan = fo.plan(8, 200, 300, dtype=F8, scaling="blockwise", backend="reference")
    assert (plan.scaling, plan.out_dtype) == ("blockwise", "bfloat16")
    assert fo.Plan.from_json(plan.to_json()) == plan
    assert "blockwise scales" in plan.describe()
    assert fo.plan(8, 200, 300, dtype=F8, scaling="rowwise", backend="reference").scaling is None
    assert "scaling" not in fo.plan(8, 200, 300, dtype=F8, backend="reference").to_dict()
    with pytest.raises(ValueError, match="scaling is for fp8"):
        fo.plan(8, 200, 300, dtype=torch.bfloat16, scaling="blockwise")
    with pytest.raises(ValueError, match="scaling must be one of"):
        fo.plan(8, 200, 300, dtype=F8, scaling="per-block")
    a, b, sa, sb = _block_call()
    with pytest.raises(ValueError, match="the plan does not fit this call: scaling: plan has None, "
                                         "call has 'blockwise'"):
        fo.overlap(a, b, "allreduce", scale_a=sa, scale_b=sb,
                   plan=fo.plan(8, 200, 300, dtype=F8, backend="reference"))
    with pytest.raises(ValueError, match="scaling: plan has 'blockwise', call has None"):
        fo.overlap(a, b, "allreduce", scale_a=torch.rand(8, 1), scale_b=torch.rand(1, 200),
                   plan=plan)
    got = fo.overlap(a, b, "allreduce", scale_a=sa, scale_b=sb, plan=plan)
    assert got.shape == (8, 200)


def test_fp8_without_scales_says_what_it_needs():
    a, b, _, _ = _call()
    with pytest.raises(TypeError, match=r"need scale_a and scale_b \(float32: tensor-wise 0-dim, "
                                        r"row-wise \[M, 1\] and \[1, N\], or block-wise "
                                        r"\[M, ceil\(K/128\)\] and \[ceil\(K/128\), "
                                        r"ceil\(N/128\)\]\)"):
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


def test_blockwise_fp8_compiles():
    a, b, sa, sb = _block_call()
    fn = torch.compile(lambda *t: fo.overlap(*t[:2], "allreduce", scale_a=t[2], scale_b=t[3]),
                       fullgraph=True)
    got = fn(a, b, sa, sb)
    want = fo.overlap(a, b, "allreduce", scale_a=sa, scale_b=sb)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


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


class TripwireFp8(NativeFp8):
    """A native fp8 backend under its own name that fails the test if it runs a call while
    armed: checks of a call's arguments must come before any device work."""

    def __init__(self, name: str, armed: bool = False):
        super().__init__()
        self.name, self.armed = name, armed

    def run(self, call):
        if self.armed:
            raise AssertionError("the backend ran a call whose arguments are invalid")
        return super().run(call)


def _want(a, b, sa, sb):
    return (a.double() * sa.double()) @ (b.double() * sb.double())


@pytest.mark.parametrize("kind", ["tensorwise", "rowwise", "blockwise"])
def test_a_prepared_keys_later_call_refuses_non_finite_host_scales(kind, registered):
    """A key's later calls (its hot path) read scales in host memory each call, as its first
    call does (no device sync to pay): inf or NaN is a ValueError before the backend runs."""
    tripwire = registered(TripwireFp8(f"fake-tripwire-finite-{kind}"))
    api.forget_prepared()
    m, n, k = 8, 200, 300
    a = torch.randn(m, k).to(F8)
    b = torch.randn(n, k).to(F8).t()
    sa, sb = _a2a_scales(m, n, k, kind)
    fo.overlap(a, b, "allreduce", scale_a=sa, scale_b=sb, backend=tripwire.name)
    tripwire.armed = True
    for bad in (float("nan"), float("inf")):
        for name, scale in (("scale_a", sa), ("scale_b", sb)):
            poisoned = scale.clone()
            poisoned.view(-1)[-1] = bad
            kw = {"scale_a": sa, "scale_b": sb, name: poisoned}
            with pytest.raises(ValueError, match=f"{name} has non-finite values"):
                fo.overlap(a, b, "allreduce", backend=tripwire.name, **kw)
    tripwire.armed = False
    assert len(fo.prepared_calls()) == 1  # the same key throughout
    got = fo.overlap(a, b, "allreduce", scale_a=sa, scale_b=sb, backend=tripwire.name)
    assert torch.allclose(got.double(), _a2a_want(a, b, sa, sb), rtol=1e-2, atol=1e-2)


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
    # the fp8 call's key (issue 32), run dequantized: no backend here has native fp8
    [entry] = fo.prepared_calls()
    assert (entry["dtype"], entry["out_dtype"], entry["runner"]) == (
        "float8_e4m3fn", "bfloat16", "AllToAllCall")
    assert not registry.get(entry["backend"]).native_fp8
    assert list(api._prepared.values())[-1].prepared.dequantize
    import dataclasses

    sequential = dataclasses.replace(fo.plan(8, 9, 16, dtype=F8, backend="reference"),
                                     strategy="sequential", group_sizes=(1,))
    got = fo.overlap(a, b, "allreduce", scale_a=sa, scale_b=sb, plan=sequential)
    assert torch.allclose(got.double(), _want(a, b, sa, sb), rtol=1e-2, atol=1e-2)
    # the plain path runs the device's fp8 GEMM (torch._scaled_mm), never dequantized rows
    assert fo.prepared_calls()[-1]["runner"] == "ScaledSequentialCall"


# ---- fp8 all_to_all (issue 32): each call's rows, splits and scales ----------------------------
def _a2a_scales(m, n, k, kind, seed=0):
    """Scales of ``kind`` for a [m, k] @ [k, n] call: "tensorwise", "rowwise" (both), "rowwise-a"
    ([m, 1] and a 0-dim scale_b), "rowwise-b" (0-dim scale_a and [1, n]), "blockwise"."""
    g = torch.Generator().manual_seed(seed)
    kb, nb = fo.fp8.blocks(k), fo.fp8.blocks(n)
    shapes = {"tensorwise": ((), ()), "rowwise": ((m, 1), (1, n)), "rowwise-a": ((m, 1), ()),
              "rowwise-b": ((), (1, n)), "blockwise": ((m, kb), (kb, nb))}[kind]
    return [torch.rand(s, generator=g) + 0.5 for s in shapes]


def _a2a_want(a, b, sa, sb):
    a32, b32 = fo.fp8.dequantized(a, b, sa, sb)
    return a32.double() @ b32.double()


@pytest.mark.parametrize("backend", ["reference", "decomposition", "fake-native-fp8"])
def test_fp8_all_to_all_keys_hold_the_scaling_kind_not_the_rows(backend, registered):
    """An fp8 all_to_all key holds what every rank shares (the scales' kind, which side is per
    row or column, out_dtype), never a call's rows: calls of other rows (none too) reuse it,
    each with scales of its own rows; each kind and out_dtype is a key of its own. Native fp8
    backends get each call's scales, the others its dequantized float32 call."""
    native = registered(NativeFp8()) if backend == "fake-native-fp8" else None
    api.forget_prepared()
    n, k = 200, 300
    kinds = ("tensorwise", "rowwise", "rowwise-a", "rowwise-b", "blockwise")
    for kind in kinds:
        for call, m in enumerate((8, 0, 13, 1)):
            a = torch.randn(m, k).to(F8)
            b = torch.randn(n, k).to(F8).t()
            sa, sb = _a2a_scales(m, n, k, kind, seed=call)
            if kind == "blockwise" and call % 2:  # torch's outer-dim-major scale_a, any rows
                sa = sa.t().contiguous().t()
            splits = {} if call == 2 else {"send_splits": [m], "recv_splits": [m]}
            got = fo.overlap(a, b, "all_to_all", scale_a=sa, scale_b=sb, backend=backend,
                             **splits)
            assert got.dtype == torch.bfloat16 and got.shape == (m, n)
            assert torch.allclose(got.double(), _a2a_want(a, b, sa, sb), rtol=1e-2, atol=1e-2)
    out = torch.full((5, n), float("nan"), dtype=torch.float16)
    a = torch.randn(5, k).to(F8)
    sa, sb = _a2a_scales(5, n, k, "rowwise")
    b = torch.randn(n, k).to(F8).t()
    assert fo.overlap(a, b, "all_to_all", scale_a=sa, scale_b=sb, out_dtype=torch.float16,
                      out=out, backend=backend) is out
    assert torch.allclose(out.double(), _a2a_want(a, b, sa, sb), rtol=4e-3, atol=4e-3)
    calls = fo.prepared_calls()
    assert len(calls) == len(kinds) + 1  # one key per kind, one for the float16 result
    assert {(c["a"][0], c["M"], c["runner"], c["dtype"]) for c in calls} == {
        (api.ROWS_PER_CALL, api.ROWS_PER_CALL, "AllToAllCall", "float8_e4m3fn")}
    assert [c["scaling"] for c in calls] == [None] * 4 + ["blockwise", None]
    assert [c["out_dtype"] for c in calls] == ["bfloat16"] * len(kinds) + ["float16"]
    if native is not None:  # each call's scales, with its own rows
        assert [tuple(c[4].shape) for c in native.calls[:4]] == [(), (), (), ()]
        assert [tuple(c[4].shape) for c in native.calls[4:8]] == [(8, 1), (0, 1), (13, 1), (1, 1)]
        assert all(c[:4] == (F8, "float8_e4m3fn", "bfloat16", torch.bfloat16)
                   for c in native.calls[:-1])


def test_fp8_all_to_all_checks_each_calls_scales_before_any_device_work(registered):
    """A later call of an fp8 all_to_all key (its hot path) checks its scales against its own
    rows and their dtype and device, and its out against the result dtype, before the backend
    runs anything."""
    tripwire = registered(TripwireFp8("fake-tripwire-a2a"))
    api.forget_prepared()
    n, k = 9, 300
    b = torch.randn(n, k).to(F8).t()

    def call(m, kind, **kw):
        a = torch.randn(m, k).to(F8)
        sa, sb = _a2a_scales(m, n, k, kind)
        args = {"scale_a": sa, "scale_b": sb, "send_splits": [m], **kw}
        return fo.overlap(a, b, "all_to_all", backend=tripwire.name, **args)

    for kind in ("rowwise", "blockwise"):
        call(8, kind)  # the key's first call
        tripwire.armed = True
        sa, sb = _a2a_scales(7, n, k, kind)
        with pytest.raises(ValueError, match=r"scale_a has 7 rows, but this call's a has 6: a "
                                             f"{kind} scale_a has one row per row of a"):
            call(6, kind, scale_a=sa)
        with pytest.raises(TypeError, match="scale_a must be a float32 tensor, got torch.float64"):
            call(6, kind, scale_a=_a2a_scales(6, n, k, kind)[0].double())
        with pytest.raises(TypeError, match="scale_b must be a float32 tensor, got torch.float16"):
            call(6, kind, scale_b=sb.half())
        with pytest.raises(ValueError, match="scale_b must be on cpu like a, got meta"):
            call(6, kind, scale_b=sb.to("meta"))
        sa, sb = _a2a_scales(6, n, k, kind)  # host scales are read every call: no sync
        sa[-1, -1] = float("nan")
        with pytest.raises(ValueError, match=r"scale_a has non-finite values \(inf or NaN\)"):
            call(6, kind, scale_a=sa)
        sb[0, -1] = float("-inf")
        with pytest.raises(ValueError, match="scale_b has non-finite values"):
            call(6, kind, scale_b=sb)
        with pytest.raises(ValueError, match="out must be torch.bfloat16"):
            call(6, kind, out=torch.empty(6, n, dtype=torch.float16))
        with pytest.raises(ValueError, match="send_splits"):
            call(6, kind, send_splits=[5])
        tripwire.armed = False
    assert len(fo.prepared_calls()) == 2
    # a first call's scales: fp8's own checks, naming the kinds' shapes
    api.forget_prepared()
    a = torch.randn(6, k).to(F8)
    with pytest.raises(ValueError, match=r"scale_a has shape \[5, 1\]; the scales must be one of"):
        fo.overlap(a, b, "all_to_all", scale_a=torch.rand(5, 1), scale_b=torch.rand(()),
                   backend=tripwire.name)
    with pytest.raises(ValueError, match="non-finite"):
        fo.overlap(a, b, "all_to_all", scale_a=torch.full((6, 1), float("inf")),
                   scale_b=torch.rand(()), backend=tripwire.name)
    assert fo.prepared_calls() == []


def test_fp8_all_to_all_plain_path_runs_torchs_scaled_gemm():
    """A "sequential" all_to_all plan: torch's scaled GEMM of each call's rows (where it runs
    the key's calls), then the all_to_all (none at world size 1)."""
    import dataclasses

    api.forget_prepared()
    n, k = 9, 16
    plan = dataclasses.replace(fo.plan(8, n, k, op="all_to_all", dtype=F8, backend="reference"),
                               strategy="sequential")
    b = torch.randn(n, k).to(F8).t()
    for m in (8, 0, 3):
        a = torch.randn(m, k).to(F8)
        sa, sb = _a2a_scales(m, n, k, "rowwise-a")
        got = fo.overlap(a, b, "all_to_all", scale_a=sa, scale_b=sb, plan=plan)
        assert got.shape == (m, n) and got.dtype == torch.bfloat16
        assert torch.allclose(got.double(), _a2a_want(a, b, sa, sb), rtol=1e-2, atol=1e-2)
    [entry] = fo.prepared_calls()
    assert (entry["strategy"], entry["runner"]) == ("sequential", "AllToAllCall")
    assert isinstance(list(api._prepared.values())[-1].prepared.scaled_mm,
                      fo.fp8.ScaledSequentialCall)


class Fp8ThroughReference(ReferenceBackend):
    """A native fp8 backend for spawned ranks: the fp8 call it is handed (each call's own
    scales) as the reference runs its float32 call, collectives included."""

    name = "fake-fp8-through-reference"
    native_fp8 = True

    def run(self, call):
        if call.scale_a is None:
            return super().run(call)
        import dataclasses

        a32, b32 = fo.fp8.dequantized(call.a, call.b, call.scale_a, call.scale_b)
        into = None if call.out is None else torch.empty(call.out.shape)
        result = super().run(dataclasses.replace(call, a=a32, b=b32, out=into, scale_a=None,
                                                 scale_b=None, plan=call.plan.dequantized()))
        return result.to(call.plan.result_dtype) if call.out is None else call.out.copy_(result)


def _all_to_all_with_each_ranks_rows_and_scales(backend: str) -> list[str]:
    """On a spawned rank (gloo): fp8 all_to_all calls whose rows and splits are new every call
    (zeros among them: a rank with no rows, destinations that get none), each rank with scales
    of its own rows, recv_splits given or not; against float64 of every source's dequantized
    rows, recomputed here. One key per kind of scales."""
    import torch.distributed as dist

    rank, w = dist.get_rank(), dist.get_world_size()
    if backend == Fp8ThroughReference.name:
        registry.register(Fp8ThroughReference())
    api.forget_prepared()
    n, k = 136, 200
    rows_of = [[(5, 0), (0, 0), (3, 9)], [(0, 4), (2, 2), (1, 0)]]  # [call][rank] -> splits

    def inputs(r, call, kind):
        sends = rows_of[call % 2][r] if w == 2 else (call + r,) * w
        m = sum(sends)
        g = torch.Generator().manual_seed(1000 * r + call)
        a = (torch.randn(m, k, generator=g) * 2).to(F8)
        b = (torch.randn(n, k, generator=g) * 2).to(F8).t()
        sa, sb = _a2a_scales(m, n, k, kind, seed=17 * r + call)
        return a, b, sa, sb, list(sends)

    problems = []
    for kind in ("tensorwise", "rowwise", "rowwise-a", "blockwise"):
        for call in range(3):
            a, b, sa, sb, send = inputs(rank, call, kind)
            theirs = [inputs(r, call, kind) for r in range(w)]
            recv = [t[4][rank] for t in theirs]
            want = torch.cat([_a2a_want(*t[:4])[sum(t[4][:rank]):sum(t[4][:rank + 1])]
                              for t in theirs])
            got = fo.overlap(a, b, "all_to_all", scale_a=sa, scale_b=sb, send_splits=send,
                             recv_splits=recv if call != 1 else None, backend=backend)
            if got.shape != want.shape or got.dtype != torch.bfloat16 or (
                    want.numel() and not torch.allclose(got.double(), want, rtol=1e-2, atol=1e-2)):
                problems.append(f"{kind} call {call}: rank {rank} got {tuple(got.shape)} "
                                f"{got.dtype}, want {tuple(want.shape)}")
    calls = fo.prepared_calls()
    if len(calls) != 4 or {c["runner"] for c in calls} != {"AllToAllCall"}:
        problems.append(f"rank {rank}: keys {[(c['scaling'], c['runner']) for c in calls]}")
    return problems


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", ["reference", Fp8ThroughReference.name])
def test_fp8_all_to_all_on_ranks_with_their_own_rows_and_scales(backend):
    """fp8 all_to_all at world size 2: each rank's rows, splits (zeros too) and scales its own,
    every call; dequantized on the reference, each call's scales on a native fp8 backend."""
    from flashoverlap_core.tools.ranks import RankPool

    with RankPool(2, "cpu", timeout=150) as pool:
        problems = pool.run(_all_to_all_with_each_ranks_rows_and_scales, backend)
    assert problems == [[], []]


def test_fp8_backward_says_fp8_is_for_inference():
    a, b, sa, sb = _call()
    sa.requires_grad_(True)
    fn = torch.compile(lambda *t: fo.overlap(*t[:2], "allreduce", scale_a=t[2], scale_b=t[3]))
    with pytest.raises(Exception, match="inference"):
        fn(a, b, sa, sb).sum().backward()


@pytest.mark.parametrize("change, error, match", [
    (dict(scale_a=torch.rand(8, 2)), ValueError,
     r"scale_a \[8, 2\] has 2 groups of 128 along K, which cover K in \(128, 256\]; K=300 needs "
     r"ceil\(300/128\) = 3 groups \(the last one may be partial\): \[8, 3\]"),
    (dict(scale_a=torch.rand(8, 4)), ValueError, r"K=300 needs ceil\(300/128\) = 3 groups"),
    (dict(scale_b=torch.rand(2, 2)), ValueError,
     r"scale_b \[2, 2\] has 2 block rows of 128 along K; K=300 needs ceil\(300/128\) = 3"),
    (dict(scale_b=torch.rand(3, 1)), ValueError,
     r"scale_b \[3, 1\] has 1 block columns of 128; N=200 needs ceil\(200/128\) = 2"),
    (dict(scale_b=torch.rand(1, 200)), ValueError,
     "block-wise scale_a goes with block-wise scale_b"),
    (dict(scale_b=torch.rand(())), ValueError, "block-wise scale_a goes with block-wise scale_b"),
    (dict(scale_a=torch.rand(8, 1)), ValueError,
     r"block-wise scale_b goes with block-wise scale_a \[8, 3\]"),
    (dict(scale_a=torch.rand(8, 3, dtype=torch.float64)), TypeError, "scale_a must be a float32"),
    (dict(scale_b=torch.rand(3, 2).half()), TypeError, "scale_b must be a float32"),
    (dict(scale_a=torch.full((8, 3), float("nan"))), ValueError,
     r"scale_a has non-finite values \(inf or NaN\)"),
    (dict(scale_b=torch.tensor([[1.0, float("inf")]] * 3)), ValueError,
     r"scale_b has non-finite values"),
    (dict(scale_a=torch.rand(8, 3, device="meta")), ValueError, "scale_a must be on cpu like a"),
])
def test_bad_blockwise_scales_are_refused_before_any_device_work(change, error, match, registered):
    registered(TripwireFp8("fake-tripwire-fp8", armed=True))
    api.forget_prepared()
    a, b, sa, sb = _block_call()
    kw = {"scale_a": sa, "scale_b": sb, **change}
    with pytest.raises(error, match=match):
        fo.overlap(a, b, "allreduce", backend="fake-tripwire-fp8", **kw)


# ---- fp8 allgather (issue 32): each rank's rows take its own scale_a ---------------------------
def _gather_scales(m, n, k, kind, seed=0):
    """Scales of ``kind`` for an allgather shard [m, k] @ [k, n] (block-wise scale_a in torch's
    outer-dim-major layout)."""
    sa, sb = _a2a_scales(m, n, k, kind, seed)
    return (sa.t().contiguous().t() if kind == "blockwise" else sa), sb


def test_a_native_backend_gets_fp8_allgather_with_each_calls_scales(registered):
    """fp8 allgather on a backend with native fp8 (cuda's is issue 32's): the fp8 call itself
    (e4m3 a and b, never dequantized), with this rank's scale_a of its own shard and each call's
    scale values, every kind of scales a key of its own, out in out_dtype."""
    native = registered(NativeFp8())
    api.forget_prepared()
    m, n, k = 8, 9, 300
    a, b = torch.randn(m, k).to(F8), torch.randn(n, k).to(F8).t()
    kinds = ("tensorwise", "rowwise", "rowwise-a", "rowwise-b", "blockwise")
    for kind in kinds:
        plan = fo.plan(m, n, k, op="allgather", dtype=F8, out_dtype=torch.float16,
                       backend=native.name, scaling="blockwise" if kind == "blockwise" else None)
        for seed in range(3):  # the second call on takes the prepared key's hot path
            sa, sb = _gather_scales(m, n, k, kind, seed)
            got = fo.overlap(a, b, "allgather", scale_a=sa, scale_b=sb, out_dtype=torch.float16,
                             plan=plan, backend=native.name)
            assert got.dtype == torch.float16 and got.shape == (m, n)
            assert torch.allclose(got.double(), _a2a_want(a, b, sa, sb), rtol=4e-3, atol=1e-2)
            assert native.calls[-1][4] is sa and native.calls[-1][5] is sb
    assert [c[:4] for c in native.calls] == [(F8, "float8_e4m3fn", "float16", torch.float16)] * 15
    entries = fo.prepared_calls()
    assert len(entries) == len(kinds)
    assert {(e["op"], e["backend"], e["runner"], e["dtype"]) for e in entries} == {
        ("allgather", native.name, "PreparedCall", "float8_e4m3fn")}
    assert [e["scaling"] for e in entries] == [None] * 4 + ["blockwise"]


@pytest.mark.parametrize("change, error, match", [
    (dict(scale_a=torch.rand(9, 1)), ValueError, r"scale_a has shape \[9, 1\]"),
    (dict(scale_a=torch.rand(8, 1, dtype=torch.float64)), TypeError, "scale_a must be a float32"),
    (dict(scale_a=torch.rand(8, 1, device="meta")), ValueError, "scale_a must be on cpu like a"),
    (dict(scale_b=torch.rand(1, 9).half()), TypeError, "scale_b must be a float32"),
    (dict(scale_a=torch.rand(9, 3)), ValueError, "scale_a has shape"),
])
def test_fp8_allgather_checks_this_ranks_scales_before_any_device_work(change, error, match,
                                                                       registered):
    """A call of a prepared fp8 allgather key whose scales are not this shard's (scale_a's rows
    are this rank's m), not float32 or on another device: refused before the backend runs."""
    tripwire = registered(TripwireFp8("fake-tripwire-gather"))
    api.forget_prepared()
    m, n, k = 8, 9, 300
    a, b = torch.randn(m, k).to(F8), torch.randn(n, k).to(F8).t()
    plan = fo.plan(m, n, k, op="allgather", dtype=F8, backend=tripwire.name)
    args = dict(scale_a=torch.rand(m, 1), scale_b=torch.rand(1, n), plan=plan,
                backend=tripwire.name)
    fo.overlap(a, b, "allgather", **args)  # the key's first call
    tripwire.armed = True
    with pytest.raises(error, match=match):
        fo.overlap(a, b, "allgather", **{**args, **change})
    assert len(tripwire.calls) == 1


def _allgather_with_each_ranks_scales(device_type: str = "cpu", backend: str | None = None
                                      ) -> list[str]:
    """On a spawned rank: allgather on a "sequential" plan (torch's scaled GEMM after one
    gather), or (``backend``, a native fp8 one) on an overlapped plan of that backend, which
    gets the fp8 call with this rank's own scales; each rank with scales of its own, against
    float64 of every rank's a times that rank's scale_a (recomputed here from every rank's
    seed)."""
    import dataclasses
    import warnings

    import torch.distributed as dist

    if backend == Fp8ThroughReference.name:
        registry.register(Fp8ThroughReference())
    rank, w = dist.get_rank(), dist.get_world_size()
    dev = torch.device(device_type,
                       torch.cuda.current_device() if device_type == "cuda" else None)
    m, n, k = 16, 144, 320  # K and N multiples of 16, ragged against the 128 blocks
    kb, nb = fo.fp8.blocks(k), fo.fp8.blocks(n)
    g0 = torch.Generator().manual_seed(7)
    b = (torch.randn(n, k, generator=g0) * 2).to(F8).t()  # the same weight on every rank
    sb_blocks = torch.rand(kb, nb, generator=g0) + 0.25

    def inputs(r, scaling, again):  # rank r's a and scales
        g = torch.Generator().manual_seed(100 * r + again)
        a = (torch.randn(m, k, generator=g) * 2).to(F8)
        if scaling == "tensorwise":  # very different per-tensor scales on each rank
            return a, torch.tensor(0.25 + 2.0 * r + again), torch.tensor(0.75)
        if scaling == "rowwise-0dim-a":  # row-wise: a 0-dim scale_a with a [1, N] scale_b
            sb = torch.rand(1, n, generator=torch.Generator().manual_seed(50 + again)) + 0.5
            return a, torch.tensor(0.5 + 3.0 * r + again), sb
        if scaling == "rowwise":
            return (a, torch.rand(m, 1, generator=g) + 0.25 + 2.0 * r,
                    torch.linspace(0.5, 1, n)[None])
        # block-wise, scale_a outer-dim-major as torch keeps it (strides (1, M))
        return a, (torch.rand(kb, m, generator=g) + 0.25 + 2.0 * r).t(), sb_blocks

    def dequantized_a(a, sa):
        if sa.dim() == 2 and sa.shape[1] == kb and kb > 1:
            sa = sa.repeat_interleave(fo.fp8.BLOCK, 1)[:, :k]
        return a.double() * sa.double()

    def dequantized_b(sb):
        if sb.shape == (kb, nb):
            sb = sb.repeat_interleave(fo.fp8.BLOCK, 0)[:k].repeat_interleave(fo.fp8.BLOCK, 1)
            return b.double() * sb[:, :n].double()
        return b.double() * sb.double()

    problems = []
    real_available = fo.fp8.ScaledSequentialCall.available
    try:
        # where the device has no block-wise GEMM (the host), run ScaledSequentialCall anyway:
        # its GEMM falls back to the dequantized product of the gathered block-wise scales
        fo.fp8.ScaledSequentialCall.available = staticmethod(
            lambda call: call.plan.scaling == "blockwise" or real_available(call))
        for scaling in ("tensorwise", "rowwise-0dim-a", "rowwise", "blockwise"):
            for out_dtype in (torch.bfloat16, torch.float16):
                plan = fo.plan(m * w, n, k, op="allgather", world_size=w, dtype=F8,
                               backend=backend or "decomposition", out_dtype=out_dtype,
                               scaling="blockwise" if scaling == "blockwise" else None)
                if backend is None:
                    plan = dataclasses.replace(plan, strategy="sequential")
                for again in (0, 1):  # the second call runs the prepared key's hot path
                    a, sa, sb = inputs(rank, scaling, again)
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", RuntimeWarning)
                        got = fo.overlap(a.to(dev), b.to(dev), op="allgather",
                                         scale_a=sa.to(dev), scale_b=sb.to(dev),
                                         out_dtype=out_dtype, plan=plan)
                    want = torch.cat([dequantized_a(*inputs(r, scaling, again)[:2])
                                      for r in range(w)]) @ dequantized_b(sb)
                    err = float((got.cpu().double() - want).abs().max() / want.abs().max())
                    runner = fo.prepared_calls()[-1]["runner"]
                    rtol = 2e-2 if out_dtype == torch.bfloat16 else 4e-3  # the suite's
                    expected = "PreparedCall" if backend else "ScaledSequentialCall"
                    if got.shape != want.shape or err > rtol or runner != expected:
                        problems.append(f"{scaling} {out_dtype} call {again}: rank {rank} "
                                        f"relative error {err:.3g} ({runner})")
    finally:
        fo.fp8.ScaledSequentialCall.available = real_available
    return problems


@pytest.mark.timeout(120)
def test_fp8_allgather_sequential_scales_each_ranks_rows_by_its_own_scale():
    """allgather is allgather(a_r * scale_a_r) @ (b * scale_b): on the plain path (torch's
    scaled GEMM on the gathered e4m3 rows) every rank's rows take that rank's scale_a,
    tensor-wise (0-dim, gathered too), row-wise (a 0-dim or an [m, 1] scale_a) and block-wise
    (torch's outer-dim-major scale_a)."""
    from flashoverlap_core.tools.ranks import RankPool

    with RankPool(2, "cpu", timeout=90) as pool:
        problems = pool.run(_allgather_with_each_ranks_scales)
    assert problems == [[], []]


@pytest.mark.timeout(120)
def test_fp8_allgather_on_a_native_backend_scales_each_ranks_rows_by_its_own_scale():
    """The same on an overlapped plan of a native fp8 backend (as cuda's is, issue 32): every
    rank's call brings its own scale_a (tensor-wise ones that differ by rank too), and every
    rank's rows come out scaled by theirs."""
    from flashoverlap_core.tools.ranks import RankPool

    with RankPool(2, "cpu", timeout=90) as pool:
        problems = pool.run(_allgather_with_each_ranks_scales, "cpu", Fp8ThroughReference.name)
    assert problems == [[], []]
