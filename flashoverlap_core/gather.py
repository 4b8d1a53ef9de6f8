"""The communication side of an allgather call, where the collective feeds the GEMM.

Group g of an allgather plan is a chunk of the gather: rows ``plan.chunk_rows(g)`` of every
rank's shard. :class:`GatherExchange` gathers each chunk with one ``all_gather`` on the
caller's process group (whichever collective library it uses) into its contiguous region of
the packed buffer, asynchronously, and lets the backend wait for chunk g before it computes
the tiles that read it. A rank's own rows are read straight from its ``a``: they need no
transfer, so the GEMM starts with them while the first chunks are in flight.

:func:`execute_tiles` is the reference backend's execution of the op: the plan literally,
tile by tile.
"""
from __future__ import annotations

import torch

from .backend import OverlapCall
from .collectives import all_gather_single
from .faults import collective as _collective
from .tiles import TileRect


class GatherExchange:
    """The chunked all-gather of one call: ``start(g)``, ``wait(g)``, then ``rows(...)``."""

    def __init__(self, call: OverlapCall):
        self.call, self.plan = call, call.plan
        # Ranks of a group of one have nothing to receive: every row is their own.
        self.remote = call.group is not None and call.world_size > 1
        self.local = call.a if call.a.is_contiguous() else call.a.contiguous()
        self.gathered = call.a.new_empty(self.plan.packed_numel if self.remote else 0)
        self.works: dict[int, object] = {}

    def chunk(self, g: int) -> torch.Tensor:
        """Group g's region of the packed buffer as [source rank, row of the chunk, K]."""
        r, (start, end) = self.plan.regions[g], self.plan.chunk_rows(g)
        return self.gathered[r.offset:r.offset + r.numel].view(self.call.world_size, end - start, -1)

    def start(self, g: int) -> None:
        """Launch chunk g's all-gather (asynchronous) on the current stream."""
        if not self.remote:
            return
        start, end = self.plan.chunk_rows(g)
        region = self.chunk(g).flatten(0, 1)  # [W * rows, K]: what every collective library takes
        with _collective(self.call.group, f"chunk {g}'s all-gather"):
            self.works[g] = all_gather_single(region, self.local[start:end],
                                              group=self.call.group, async_op=True)

    def wait(self, g: int) -> None:
        """Make the current stream (the host, on the CPU) wait until chunk g has arrived."""
        work = self.works.pop(g, None)
        if work is not None:
            with _collective(self.call.group, f"waiting for chunk {g}'s all-gather"):
                work.wait()

    def rows(self, source: int, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) of rank ``source``'s shard ([end - start, K]), from the local a or
        from the chunk that holds them (which must have arrived; they must lie in one chunk)."""
        if source == self.call.rank:
            return self.local[start:end]
        g = self.plan.group_of_band[start // self.plan.tile[0]]
        first, last = self.plan.chunk_rows(g)
        if end > last:
            raise ValueError(f"rows [{start}, {end}) span chunks: chunk {g} is rows [{first}, {last})")
        return self.chunk(g)[source, start - first:end - first]


def tile_rows(plan, t: TileRect) -> tuple[int, int]:
    """Rows [start, end) of its source shard that tile ``t`` reads."""
    start = t.row0 - plan.grid.block_starts[t.block]
    return start, start + t.rows


def execute_tiles(call: OverlapCall, recorder, acc: torch.dtype,
                  exchange: GatherExchange | None = None) -> torch.Tensor:
    """The reference execution: start every chunk's gather; compute this rank's own tiles;
    then, chunk by chunk, wait for the chunk and compute the tiles that read it. Each tile is
    accumulated in ``acc`` and written to its place in ``call.out``. ``recorder`` stamps the
    tiles in this order; a transfer's end is stamped when the GEMM sees the chunk arrive.
    ``exchange`` replaces the transport (default: :class:`GatherExchange` of the call)."""
    plan, out, b = call.plan, call.out, call.b.to(acc)
    exchange = exchange if exchange is not None else GatherExchange(call)

    def compute(tiles):
        for t in tiles:
            a_rows = exchange.rows(t.block, *tile_rows(plan, t)).to(acc)
            out[t.row0:t.row0 + t.rows, t.col0:t.col0 + t.cols] = a_rows @ b[:, t.col0:t.col0 + t.cols]
            recorder.tile_done()

    for g in range(plan.num_groups):
        recorder.transfer_started(g)
        exchange.start(g)
    compute(plan.local_tiles(call.rank))
    for g in range(plan.num_groups):
        exchange.wait(g)
        recorder.transfer_launched(g, [])
        compute(plan.arriving_tiles(call.rank, g))
    recorder.join()
    return out
