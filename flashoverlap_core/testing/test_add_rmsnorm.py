"""``fo.overlap_add_rmsnorm`` on spawned ranks: allreduce and reduce_scatter, eager, compiled
(``torch.compile(fullgraph=True)``, aot_eager: the custom op, its fake kernel and autograd
traced) and with gradients, against float64 recomputed by each rank from every rank's seeds."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from flashoverlap_core.tools.ranks import RankError, RankTimeout

from .cases import SHAPES, seed_of
from .checks import normwise_mismatch
from .plugin import settings

NORM_OPS = ("allreduce", "reduce_scatter")
MODES = ("eager", "compiled", "grad")
DTYPES = ("float32", "bfloat16", "float16")
RTOL = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 6e-3}  # of the largest |reference|


@dataclass(frozen=True)
class NormCase:
    op: str
    world_size: int
    dtype: str
    m: int
    n: int
    k: int
    mode: str
    eps: float

    @property
    def id(self) -> str:
        return (f"W{self.world_size}-{self.op}-add-rmsnorm-{self.dtype}-{self.m}x{self.n}x{self.k}-"
                f"{self.mode}")


def norm_matrix(world_sizes) -> list[NormCase]:
    cases = []
    for w in world_sizes:
        for o, op in enumerate(NORM_OPS):
            for j, mode in enumerate(MODES):
                shape = SHAPES[(2 * w + 3 * o + j) % len(SHAPES)]
                m = -(-shape.m // w) * w if op == "reduce_scatter" else shape.m
                cases.append(NormCase(op, w, DTYPES[(w + o + j) % 3], m, shape.n, shape.k, mode,
                                      (1e-6, 1e-5)[j % 2]))
    return cases


def pytest_generate_tests(metafunc):
    if "norm_case" in metafunc.fixturenames:
        cases = norm_matrix(settings(metafunc.config).world_sizes)
        metafunc.parametrize("norm_case", cases, ids=[c.id for c in cases])


def inputs(case: NormCase, seed: int, rank: int):
    """Rank ``rank``'s a, b (``w.t()``), residual, norm weight and output gradients (host,
    float64; the weight is the same on every rank)."""
    g = torch.Generator().manual_seed(seed_of(seed, case.id, rank))
    rows = case.m // case.world_size if case.op == "reduce_scatter" else case.m
    a = torch.randn(case.m, case.k, generator=g, dtype=torch.float64)
    b = torch.randn(case.n, case.k, generator=g, dtype=torch.float64).t()
    residual = torch.randn(rows, case.n, generator=g, dtype=torch.float64)
    grads = (torch.randn(rows, case.n, generator=g, dtype=torch.float64),
             torch.randn(rows, case.n, generator=g, dtype=torch.float64))
    weight = torch.randn(case.n, generator=torch.Generator().manual_seed(seed_of(seed, case.id)),
                         dtype=torch.float64)
    return a, b, residual, weight, grads


def reference(case: NormCase, seed: int, rank: int, rounded):
    """float64 (normed, residual_out) of ``rank`` and its gradients of a, b, residual, weight
    under fo's conventions: an allreduced output's gradient is this rank's own, a
    reduce-scattered one's is every rank's (all-gathered); weight's is this rank's rows'."""
    w = case.world_size
    per = [[t.clone() for t in inputs(case, seed, r)[:4]] for r in range(w)]
    per = [[rounded(t).requires_grad_(True) for t in ts] for ts in per]
    total = sum(a @ b for a, b, _, _ in per)
    rows = case.m // w
    outs, losses, lost = [], [], []
    for q, (_, _, residual, weight) in enumerate(per):
        y = total[q * rows:(q + 1) * rows] if case.op == "reduce_scatter" else total
        x = residual + y
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + case.eps) * weight
        gn, gr = inputs(case, seed, q)[4]
        outs.append((normed, x))
        losses.append((normed * gn).sum() + (x * gr).sum())
        # what rank q's gradient of x loses to cancellation: own rows, or every rank's where
        # the gradient of a and b gathers them
        lost.append(_cancelled(x.detach(), weight.detach(), gn, gr, case.eps))
    a, b, residual, weight = per[rank]
    own = torch.autograd.grad(losses[rank], (residual, weight, a, b), retain_graph=True)
    if case.op == "reduce_scatter":  # the gradient of a and b gathers every rank's
        grads_ab = torch.autograd.grad(sum(losses), (a, b), retain_graph=True)
        lost_ab = torch.cat(lost)
    else:
        grads_ab = own[2:]
        lost_ab = lost[rank]
    slack = (lost_ab @ b.detach().abs().t(), a.detach().abs().t() @ lost_ab, lost[rank], None)
    normed, x = outs[rank]
    y = total[rank * rows:(rank + 1) * rows] if case.op == "reduce_scatter" else total
    terms = max(float(per[rank][2].detach().abs().max()), float(y.detach().abs().max())) \
        if x.numel() else 0.0
    return (normed.detach(), x.detach(), terms), \
        (grads_ab[0], grads_ab[1], own[0], own[1]), slack


def _cancelled(x, weight, gn, gr, eps: float) -> torch.Tensor:
    """Per element, how much larger the terms of the norm's gradient of x are than the
    gradient itself (float64, >= 0). That gradient is gr + r w gn - x r^3 mean(x w gn)
    (r = rsqrt(mean(x^2) + eps)); where |x| r is near 1 (few columns, or one value that
    dominates its row) the last two terms cancel, and a rounded evaluation keeps their
    rounding, not the small difference's: its error is relative to the terms."""
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    wg = weight * gn
    first, second = r * wg, x * r.pow(3) * (x * wg).mean(-1, keepdim=True)
    terms = gr.abs() + first.abs() + x.abs() * r.pow(3) * (x * wg).abs().mean(-1, keepdim=True)
    return (terms - (gr + first - second).abs()).clamp(min=0.0)


def run_norm_case(target, case: NormCase, seed: int) -> list[str]:
    """The case on this rank; what is wrong (empty: nothing)."""
    import torch.distributed as dist

    import flashoverlap_core as fo
    from flashoverlap_core import api

    api.forget_prepared()
    rank = dist.get_rank() if dist.is_initialized() else 0
    dtype = getattr(torch, case.dtype)
    device = target.device(rank)
    a, b, residual, weight, (gn, gr) = inputs(case, seed, rank)
    # b keeps the layout of w.t() on the device
    b_dev = b.t().to(device, dtype).t()
    mine = [a.to(device, dtype), b_dev, residual.to(device, dtype), weight.to(device, dtype)]
    backend = target.backend_name

    def call(a_, b_, r_, w_):
        return fo.overlap_add_rmsnorm(a_, b_, r_, w_, eps=case.eps, op=case.op, backend=backend)

    fn = torch.compile(call, fullgraph=True, backend="aot_eager") if case.mode == "compiled" else call
    if case.mode == "grad":
        for t in mine:
            t.requires_grad_(True)
    normed, resid = fn(*mine)
    # the reference starts from the same rounded inputs
    (want_n, want_r, terms), want_grads, lost = reference(case, seed, rank,
                                                          lambda t: t.to(dtype).double())
    problems = _compare_results(normed, resid, want_n, want_r, terms, weight, case)
    if case.mode == "grad":
        ((normed * gn.to(device, dtype)).sum() + (resid * gr.to(device, dtype)).sum()).backward()
        for what, t, want, cancelled in zip(("a", "b", "residual", "weight"), mine, want_grads,
                                            lost):
            problems += _compare(f"gradient of {what}", t.grad, want, case.dtype, cancelled)
    return problems


def _compare(what, got, want, dtype, cancelled=None) -> list[str]:
    """``cancelled``: the terms the gradient of x lost to cancellation (_cancelled), carried
    to this gradient; RTOL of them is added to the bound, element by element."""
    rtol = RTOL[dtype]
    wrong = normwise_mismatch(got, want, rtol, what,
                              slack=None if cancelled is None else rtol * cancelled)
    return [wrong] if wrong else []


def _compare_results(normed, resid, want_n, want_r, terms: float, weight, case) -> list[str]:
    """residual_out = residual + the reduced product, whose rounding (in a's dtype, in the
    collective's order) is relative to the terms, which may cancel: its error is bounded by
    RTOL of the larger term. The norm passes that error dx on: per element, |w| dx r (1 +
    |x| r) to first order (r = rsqrt(mean(x^2) + eps)), twice that for the rest, and never
    more than the whole range of the normalised value, 2 |w| max(1, |x| r)."""
    rtol = RTOL[case.dtype]
    dx = rtol * max(float(want_r.abs().max()) if want_r.numel() else 0.0, terms)
    r = torch.rsqrt(want_r.pow(2).mean(-1, keepdim=True) + case.eps)
    w, xr = weight.double().abs(), want_r.abs() * r
    slack = w * torch.minimum(2 * dx * r * (1 + xr), 2 * torch.clamp(xr, min=1.0))
    problems = [normwise_mismatch(normed, want_n, rtol, "normed", slack=slack),
                normwise_mismatch(resid, want_r, rtol, "residual_out", scale=terms)]
    return [p for p in problems if p]


def test_overlap_add_rmsnorm_on_ranks(norm_case, fo_pools, fo_backend, fo_target, fo_settings):
    from .runner import spec_of
    from .cases import Case

    as_case = Case(norm_case.op, norm_case.world_size, norm_case.dtype, norm_case.m, norm_case.n,
                   norm_case.k, (1, 1), "col", "auto")
    reasons = fo_backend.unsupported_reasons(spec_of(as_case, fo_settings.seed, 0,
                                                     fo_target.device_type))
    if norm_case.mode == "grad" and norm_case.op == "reduce_scatter":
        # its backward all-gathers the gradient into the next GEMM (an overlapped allgather)
        gather = Case("allgather", norm_case.world_size, norm_case.dtype,
                      norm_case.m // norm_case.world_size, norm_case.k, norm_case.n, (1, 1),
                      "col", "auto")
        reasons += [f"the backward's allgather: {r}" for r in fo_backend.unsupported_reasons(
            spec_of(gather, fo_settings.seed, 0, fo_target.device_type))]
    if reasons:
        pytest.skip(f"backend {fo_backend.name!r} does not support {norm_case.id}: "
                    + "; ".join(reasons))
    try:
        results = fo_pools.run(norm_case.world_size, run_norm_case, norm_case, fo_settings.seed)
    except (RankError, RankTimeout) as e:
        pytest.fail(f"{type(e).__name__}: {e}", pytrace=False)
    bad = {r: p for r, p in enumerate(results) if p}
    assert not bad, f"{norm_case.id}, seed {fo_settings.seed}: " + "; ".join(
        f"rank {r}: {p}" for r, p in bad.items())
