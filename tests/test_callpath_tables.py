"""The tables a native call path issues (collective steps, post-reorder layouts), executed
step by step with torch.distributed on CPU ranks exactly as the cuda backend's fo_call_run
issues them with NCCL: the packed GEMM output, per step its collective on the given offsets
and counts (all_to_all as grouped point-to-point), then the unpack ("tiles" plans; a "rows"
plan's allreduce reduces the output in place and its reduce_scatter receives into it). Checks the tables' meaning
against a float64 reference without a GPU, at world sizes where no GPU run was possible."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.timeout(300)


def _rank_inputs(seed, rank, m, n, k):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return torch.randn(m, k, generator=g), torch.randn(k, n, generator=torch.Generator().manual_seed(seed))


def _execute(seed, op, sizes_of, layout="tiles"):
    import torch.distributed as dist

    import flashoverlap_core as fo
    from flashoverlap_core.backend import OverlapCall
    from flashoverlap_core.collectives import (RegionExchange, collective_steps,
                                               reduce_scatter_single, unpack_layouts)
    from flashoverlap_core.plan import group_unit

    rank, world = dist.get_rank(), dist.get_world_size()
    m, n, k = 6 * world * 5, 37, 9
    a, b = _rank_inputs(seed, rank, m, n, k)
    every = [_rank_inputs(seed, r, m, n, k)[0].double() @ b.double() for r in range(world)]
    send = sizes_of(rank, world, m) if op == "all_to_all" else None
    recv = [sizes_of(src, world, m)[rank] for src in range(world)] if op == "all_to_all" else None
    plan = fo.plan(m, n, k, op=op, world_size=world, dtype=torch.float32, backend="reference",
                   tile=(8, 16), send_splits=send)
    cuts = plan.num_tiles
    unit = group_unit(op, world, n, plan.tile, layout, plan.schedule)
    sizes = [unit * (cuts // unit // 3)] * 2
    sizes.append(cuts - sum(sizes))
    plan = fo.plan(m, n, k, op=op, world_size=world, dtype=torch.float32, backend="reference",
                   tile=(8, 16), send_splits=send, group_sizes=sizes, layout=layout)
    c = a @ b
    rows = {"allreduce": m, "reduce_scatter": m // world, "all_to_all": sum(recv or [m])}[op]
    out = torch.full((rows, n), float("nan"))
    packed = c.flatten()[plan.packed_index()].contiguous()  # what the signaling GEMM writes
    if layout == "rows" and op == "allreduce":  # the GEMM writes the output itself
        packed = out.view(-1).copy_(packed)
    call = OverlapCall(a, b, plan, op, dist.group.WORLD, rank, world, out, tuple(recv) if recv else None)
    exchange = RegionExchange(call, packed)
    table, steps, per_step = collective_steps(exchange)
    staging = exchange.staging
    for s in range(steps):
        entries = [table[(s * per_step + p) * 4:(s * per_step + p + 1) * 4] for p in range(per_step)]
        if op == "allreduce":
            off, cnt, _, _ = entries[0]
            dist.all_reduce(packed[off:off + cnt])
        elif op == "reduce_scatter":
            off, cnt, roff, rcnt = entries[0]
            reduce_scatter_single(staging[roff:roff + rcnt], packed[off:off + cnt])
        else:
            ops = []
            for peer, (so, sc, ro, rc) in enumerate(entries):
                if peer == rank:
                    assert sc == rc
                    staging[ro:ro + rc].copy_(packed[so:so + sc])
                    continue
                if sc:
                    ops.append(dist.P2POp(dist.isend, packed[so:so + sc], peer))
                if rc:
                    ops.append(dist.P2POp(dist.irecv, staging[ro:ro + rc], peer))
            for work in dist.batch_isend_irecv(ops) if ops else []:
                work.wait()
    flat = out.view(-1)
    for start, rects, offsets in unpack_layouts(exchange):
        block = flat[start:].view(-1, n)
        for (r0, rs, c0, cs), off in zip(rects, offsets):
            block[r0:r0 + rs, c0:c0 + cs] = staging[off:off + rs * cs].view(rs, cs)
    if op == "allreduce":
        want = sum(every)
    elif op == "reduce_scatter":
        want = sum(every)[rank * rows:(rank + 1) * rows]
    else:
        parts = []
        for src in range(world):
            start = sum(sizes_of(src, world, m)[:rank])
            parts.append(every[src][start:start + sizes_of(src, world, m)[rank]])
        want = torch.cat(parts)
    return float((out.double() - want).abs().max()) if out.numel() else 0.0


def _equal(src, world, m):
    return [m // world] * world


def _ragged(src, world, m):
    """Unequal splits that differ per source rank, a zero among them."""
    sizes = [(src + d) % world * 3 for d in range(world)]
    sizes[-1] += m - sum(sizes)
    return sizes


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.full)])
def test_native_tables_give_the_reference_result(world):
    from flashoverlap_core.tools.ranks import RankPool

    cases = [("allreduce", _equal, "tiles"), ("reduce_scatter", _equal, "tiles"),
             ("all_to_all", _equal, "tiles"), ("all_to_all", _ragged, "tiles"),
             ("allreduce", _equal, "rows"), ("reduce_scatter", _equal, "rows")]
    with RankPool(world, timeout=240) as pool:
        for op, sizes, layout in cases:
            errors = pool.run(_execute, 7, op, sizes, layout)
            assert max(errors) < 1e-4, (op, sizes.__name__, layout, errors)
