"""The float64 reference of a case and the element-wise error bound results are held to.

For every output element, with c_r = a_r @ b_r computed in float64 and S the number of rank
results summed into it (W for allreduce / reduce_scatter, 1 otherwise):

    |out - ref| <= (S + 1) * eps(dtype) * sum_r |c_r|  +  K * eps(float32) * sum_r (|a_r| @ |b_r|)  +  tiny

The second term bounds an accumulation in float32 or better over K products in any order; the
first bounds rounding each c_r to the output dtype and the S - 1 additions of the collective, in
any order, each off by at most eps/2 of a partial sum. It is the classic
c * eps * sum_r |a_r| @ |b_r| bound, split so that the low-precision part scales with the
outputs rather than with |a| @ |b|: that keeps it tight enough for a single misplaced tile to
fail even in bfloat16 with K in the thousands. NaN never passes (NaN <= x is false).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .cases import Case, RankInput, rank_input


@dataclass
class Expected:
    """Reference values and per-element tolerance, float64, on the host."""

    ref: torch.Tensor
    tol: torch.Tensor


def products(inp: RankInput) -> tuple[torch.Tensor, torch.Tensor]:
    """(a @ b, |a| @ |b|) in float64."""
    a, b = inp.a.double(), inp.b.double()
    return a @ b, a.abs() @ b.abs()


def tolerance(dtype: torch.dtype, k: int, summands: int, sum_abs_c, sum_abs_ab) -> torch.Tensor:
    info = torch.finfo(dtype)
    acc_eps = torch.finfo(torch.float32).eps
    return (summands + 1) * info.eps * sum_abs_c + k * acc_eps * sum_abs_ab + info.tiny


def expected(case: Case, seed: int, rank: int, call: int = 0) -> Expected:
    """What ``rank`` must get back from call ``call``, recomputed from every rank's seeds (for
    a custom op: the product itself, which the op may then negate)."""
    w = case.world_size
    if case.reduces:
        ref = abs_c = abs_ab = 0
        for r in range(w):
            c, ab = products(rank_input(case, seed, r, call=call))
            ref, abs_c, abs_ab = ref + c, abs_c + c.abs(), abs_ab + ab
        if case.op == "reduce_scatter":
            rows = slice(rank * case.m // w, (rank + 1) * case.m // w)
            ref, abs_c, abs_ab = ref[rows], abs_c[rows], abs_ab[rows]
        return Expected(ref, tolerance(case.torch_dtype, case.k, w, abs_c, abs_ab))
    if case.op == "allgather":  # every rank's rows, in rank order, times this rank's b
        rows = torch.cat([rank_input(case, seed, src, call=call).a for src in range(w)])
        ref, abs_ab = products(RankInput(rows, rank_input(case, seed, rank, call=call).b, None))
    elif case.op == "all_to_all":
        refs, abs_abs = [], []
        for src in range(w):
            inp = rank_input(case, seed, src, call=call)
            start = sum(inp.send_splits[:rank])
            c, ab = products(RankInput(inp.a[start:start + inp.send_splits[rank]], inp.b, None))
            refs.append(c)
            abs_abs.append(ab)
        ref, abs_ab = torch.cat(refs), torch.cat(abs_abs)
    else:  # a custom op: this rank's own product
        ref, abs_ab = products(rank_input(case, seed, rank, call=call))
    return Expected(ref, tolerance(case.torch_dtype, case.k, 1, ref.abs(), abs_ab))


def mismatch(got: torch.Tensor, want: Expected, what: str) -> str | None:
    """None when ``got`` is within the bound everywhere, else a description of what is wrong."""
    if tuple(got.shape) != tuple(want.ref.shape):
        return f"{what}: shape {tuple(got.shape)}, expected {tuple(want.ref.shape)}"
    got64 = got.detach().to("cpu", torch.float64)
    bad = ~((got64 - want.ref).abs() <= want.tol)
    return _outside(what, got64, want.ref, bad, "",
                    lambda first: f" +- {want.tol[first].item():.3g}")


def _outside(what, got64, ref, bad, bound: str, detail) -> str | None:
    """What is wrong where ``bad`` (None when nothing is)."""
    if not bad.any():
        return None
    unwritten = int(torch.isnan(got64).sum())
    first = tuple(int(i) for i in bad.nonzero()[0])
    return (f"{what}: {int(bad.sum())} of {bad.numel()} elements outside the error bound{bound}"
            f"{f' ({unwritten} never written: still NaN)' if unwritten else ''}; first at "
            f"{list(first)}: got {got64[first].item():.6g}, expected {ref[first].item():.6g}"
            f"{detail(first)}")


def normwise_mismatch(got, want: torch.Tensor, rtol: float, what: str, scale: float = 0.0,
                      slack: torch.Tensor | None = None) -> str | None:
    """None when ``got`` is within ``rtol`` of the largest |value| of ``want`` (float64)
    everywhere, else what is wrong: for results that pass through a normalisation or a
    quantisation, where the element-wise bound above does not apply. ``scale``: a larger
    magnitude the error is relative to (the terms of a sum that cancel); ``slack``: float64
    amounts added to the bound element by element (an error a sum passes on)."""
    if got is None:
        return f"{what}: missing"
    if tuple(got.shape) != tuple(want.shape):
        return f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if not want.numel():
        return None
    got64 = got.detach().to("cpu", torch.float64)
    largest = float(want.abs().max())
    bound = rtol * max(largest, scale)
    limit = bound if slack is None else bound + slack
    bad = ~((got64 - want).abs() <= limit)
    of = "the largest |value|" if scale <= largest else f"the largest term, {scale:.3g}"
    return _outside(what, got64, want, bad, f" {bound:.3g} ({rtol} of {of})",
                    lambda first: "" if slack is None else f" + {float(slack[first]):.3g}")
