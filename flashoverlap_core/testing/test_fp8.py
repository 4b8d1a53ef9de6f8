"""fp8 calls on spawned ranks: float8_e4m3fn a and b (b column-major) with tensor-wise,
row-wise and block-wise (1x128 groups of a, 128x128 blocks of b) float32 scales, bf16 and fp16
out, every op, ragged shapes (block-wise: K and N not multiples of 128 too), into poisoned
outputs, against float64 of the dequantized inputs recomputed by each rank from every rank's
seeds."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from flashoverlap_core.fp8 import FP8_DTYPES
from flashoverlap_core.plan import FP8_DTYPES as FP8_DTYPE_NAMES
from flashoverlap_core.tools.ranks import RankError, RankTimeout

from .cases import COLLECTIVES, SHAPES, seed_of
from .checks import normwise_mismatch
from .plugin import settings

OUT = ("bfloat16", "float16")
RTOL = {"bfloat16": 2e-2, "float16": 4e-3}  # of the largest |reference| (or term of a sum)
# fp8 products on accelerators accumulate fast (torch._scaled_mm's use_fast_accum, a
# backend's tensor-/row-wise kernels; block-wise ones promote every 128 along K, and the
# reference and decomposition dequantize): an fp8 MMA that adds each 32 products into the
# running sum keeps about 14 bits of it, so the error grows with K, relative to the partial
# sums' size. Allowed per MMA of 32 along K, tensor- and row-wise: 2^-13 of the largest term.
# (Seen: W = 4 reduce_scatter, fp16 out, 8x127x4097: 3.1 off a sum of 322 whose terms reach
# 444, 1.0% of it, beyond RTOL's 4e-3 alone; docs/results.md, "fp8 e4m3 with scales".)
FAST_ACCUM_ULP = 2.0 ** -13
FP8_DTYPE_NAME = FP8_DTYPE_NAMES[0] if FP8_DTYPE_NAMES else None


@dataclass(frozen=True)
class Fp8Case:
    op: str
    world_size: int
    m: int
    n: int
    k: int
    scaling: str  # "tensorwise" (0-dim scales), "rowwise" ([M, 1], [1, N]) or "blockwise"
    out_dtype: str

    @property
    def id(self) -> str:
        return (f"W{self.world_size}-{self.op}-fp8-{self.scaling}-{self.out_dtype}-"
                f"{self.m}x{self.n}x{self.k}")


# Block-wise shapes (M, N, K): K and N ragged against the 128 blocks (a partial last group and
# block), exact multiples, a K of one group, and 1x1x1.
BLOCK_SHAPES = ((33, 257, 300), (130, 128, 1000), (7, 300, 128), (1, 1, 1), (64, 129, 129),
                (200, 384, 512), (2, 96, 257))


def fp8_matrix(world_sizes) -> list[Fp8Case]:
    cases = []
    for w in world_sizes:
        for o, op in enumerate(COLLECTIVES):
            for j in range(2):
                shape = SHAPES[(w + 2 * o + 5 * j) % len(SHAPES)]
                m = -(-shape.m // w) * w if op == "reduce_scatter" else shape.m
                scaling = "rowwise" if (o + j) % 2 else "tensorwise"
                cases.append(Fp8Case(op, w, m, shape.n, shape.k, scaling, OUT[(w + j) % 2]))
            # block-wise: every op at every world size, one shape each (CI time); across the
            # ops of one world size the shapes cover ragged K, ragged N and exact blocks
            bm, bn, bk = BLOCK_SHAPES[(w + 2 * o) % len(BLOCK_SHAPES)]
            bm = -(-bm // w) * w if op == "reduce_scatter" else bm
            cases.append(Fp8Case(op, w, bm, bn, bk, "blockwise", OUT[(w + o) % 2]))
    return cases


def pytest_generate_tests(metafunc):
    if "fp8_case" in metafunc.fixturenames:
        cases = fp8_matrix(settings(metafunc.config).world_sizes) if FP8_DTYPES else []
        metafunc.parametrize("fp8_case", cases, ids=[c.id for c in cases])


def inputs(case: Fp8Case, seed: int, rank: int):
    """Rank ``rank``'s fp8 a, fp8 b (``w.t()``), scales and send_splits (all_to_all), host."""
    g = torch.Generator().manual_seed(seed_of(seed, case.id, rank))
    f8 = FP8_DTYPES[0]
    a = (torch.randn(case.m, case.k, generator=g) * 2).to(f8)
    b = (torch.randn(case.n, case.k, generator=g) * 2).to(f8).t()
    if case.scaling == "blockwise":  # scale_a outer-dim-major, as torch keeps it
        kb, nb = -(-case.k // 128), -(-case.n // 128)
        sa = (torch.rand(kb, case.m, generator=g) + 0.25).t()
        sb = torch.rand(kb, nb, generator=g) + 0.25
    elif case.scaling == "rowwise":
        sa = torch.rand(case.m, 1, generator=g) + 0.25
        sb = torch.rand(1, case.n, generator=g) + 0.25
    else:
        sa, sb = torch.rand((), generator=g) + 0.25, torch.rand((), generator=g) + 0.25
    w = case.world_size
    cuts = sorted(torch.randint(0, case.m + 1, (w - 1,), generator=g).tolist())
    splits = [y - x for x, y in zip([0] + cuts, cuts + [case.m])]
    return a, b, sa, sb, splits


def expand(scale: torch.Tensor, rows: int, cols: int, row_block: int, blockwise: bool):
    """A scale as float64 to multiply its operand by: 0-dim and row/column scales broadcast
    as they are; a block-wise one repeated over its row_block x 128 blocks, cut to the
    operand's [rows, cols] (written here apart from flashoverlap_core.fp8)."""
    scale = scale.double()
    if not blockwise:
        return scale
    full = torch.empty(rows, cols, dtype=torch.float64)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            full[i * row_block:(i + 1) * row_block, j * 128:(j + 1) * 128] = scale[i, j]
    return full


def reference(case: Fp8Case, seed: int, rank: int) -> tuple[torch.Tensor, float]:
    """What ``rank`` gets, float64, and the largest |term| it sums: one rank's product for the
    reductions (each rank accumulates and rounds its own before the collective adds them),
    the result itself otherwise."""
    w = case.world_size
    per = [inputs(case, seed, r) for r in range(w)]
    block = case.scaling == "blockwise"
    deq = [(a.double() * expand(sa, case.m, case.k, 1, block),
            b.double() * expand(sb, case.k, case.n, 128, block), s) for a, b, sa, sb, s in per]
    if case.op == "allgather":
        out = torch.cat([x for x, _, _ in deq]) @ deq[rank][1]
    elif case.op == "all_to_all":
        parts = []
        for x, y, s in deq:
            start = sum(s[:rank])
            parts.append(x[start:start + s[rank]] @ y)
        out = torch.cat(parts)
    else:
        rows = slice(None)
        if case.op == "reduce_scatter":
            per_rank = case.m // w
            rows = slice(rank * per_rank, (rank + 1) * per_rank)
        terms = [(x @ y)[rows] for x, y, _ in deq]
        out = sum(terms)
        return out, max((float(t.abs().max()) for t in terms if t.numel()), default=0.0)
    return out, float(out.abs().max()) if out.numel() else 0.0


def run_fp8_case(target, case: Fp8Case, seed: int) -> list[str]:
    import torch.distributed as dist

    import flashoverlap_core as fo
    from flashoverlap_core import api

    api.forget_prepared()
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = target.device(rank)
    a, b, sa, sb, splits = inputs(case, seed, rank)
    kwargs = {}
    if case.op == "all_to_all" and case.world_size > 1:
        kwargs = {"send_splits": splits,
                  "recv_splits": [inputs(case, seed, src)[4][rank] for src in range(case.world_size)]}
    out_dtype = getattr(torch, case.out_dtype)
    rows = {"allreduce": case.m, "reduce_scatter": case.m // case.world_size,
            "allgather": case.m * case.world_size}.get(case.op)
    if rows is not None:  # poisoned: an element never written shows as NaN
        kwargs["out"] = torch.full((rows, case.n), float("nan"), dtype=out_dtype, device=device)
    got = fo.overlap(a.to(device), b.t().to(device).t(), case.op, scale_a=sa.to(device),
                     scale_b=sb.to(device), out_dtype=out_dtype, backend=target.backend_name,
                     **kwargs)
    want, terms = reference(case, seed, rank)
    if got.dtype != out_dtype:
        return [f"result is {got.dtype}, expected {out_dtype}"]
    fast = case.scaling != "blockwise"
    accumulation = FAST_ACCUM_ULP * -(-case.k // 32) * terms if fast else 0.0
    wrong = normwise_mismatch(got, want, RTOL[case.out_dtype], "result", scale=terms,
                              slack=torch.full_like(want, accumulation))
    return [wrong] if wrong else []


def fp8_reasons(backend, case: Fp8Case, seed: int, device_type: str) -> list[str]:
    """Why ``backend`` declines the case: asked of the fp8 call (a backend without native fp8
    is asked of the float32 call it runs as: call_reasons)."""
    import dataclasses

    from flashoverlap_core.backend import call_reasons

    from .cases import Case
    from .runner import spec_of

    as_float32 = Case(case.op, case.world_size, "float32", case.m, case.n, case.k, (1, 1), "col",
                      "auto", splits="send")
    spec = spec_of(as_float32, seed, 0, device_type)
    return call_reasons(backend, dataclasses.replace(spec, dtype=FP8_DTYPE_NAME,
                                                     out_dtype=case.out_dtype,
                                                     scaling=case.scaling))


def test_fp8_on_ranks(fp8_case, fo_pools, fo_backend, fo_target, fo_settings):
    reasons = fp8_reasons(fo_backend, fp8_case, fo_settings.seed, fo_target.device_type)
    if reasons:
        pytest.skip(f"backend {fo_backend.name!r} declines {fp8_case.id}: " + "; ".join(reasons))
    try:
        results = fo_pools.run(fp8_case.world_size, run_fp8_case, fp8_case, fo_settings.seed)
    except (RankError, RankTimeout) as e:
        pytest.fail(f"{type(e).__name__}: {e}", pytrace=False)
    bad = {r: p for r, p in enumerate(results) if p}
    assert not bad, f"{fp8_case.id}, seed {fo_settings.seed}: " + "; ".join(
        f"rank {r}: {p}" for r, p in bad.items())
