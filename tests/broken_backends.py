"""Deliberately broken backends: the conformance suite must fail against each of them.

Each is the reference backend with one realistic fault of a signaling-GEMM backend. They are
loaded by the suite as ``broken_backends:NAME`` with this directory on PYTHONPATH.
"""
from __future__ import annotations

import time

import torch

from flashoverlap_core.collectives import RegionExchange
from flashoverlap_core.reference import ReferenceBackend, accumulation_dtype
from flashoverlap_core.reorder import unpack_tiles


class FaultyReference(ReferenceBackend):
    """The reference backend's run, with hooks where a fault can be put."""

    def run(self, call):
        plan = call.plan
        acc = accumulation_dtype(call.a.dtype)
        a, b = call.a.to(acc), call.b.to(acc)
        packed = torch.empty(plan.packed_numel, dtype=call.a.dtype, device=call.a.device)
        offsets = {tile: offset for tile, _, offset in plan.packed_tiles}
        exchange = RegionExchange(call, packed)
        for g, tiles in enumerate(plan.groups):
            self.before_group(exchange, g)
            for t in tiles:
                plan.packed_view(packed, t, offsets[t]).copy_(
                    a[t.row0:t.row0 + t.rows] @ b[:, t.col0:t.col0 + t.cols])
            self.group_done(exchange, g)
        exchange.wait()
        return self.post_reorder(exchange)

    def before_group(self, exchange: RegionExchange, g: int) -> None:
        pass

    def group_done(self, exchange: RegionExchange, g: int) -> None:
        exchange.start(g)

    def post_reorder(self, exchange: RegionExchange) -> torch.Tensor:
        return exchange.finish()


class SwappedGroups(FaultyReference):
    """Groups 0 and 1 trade places in the packed buffer (as many elements as both have)."""

    name = "broken-swapped-groups"

    def group_done(self, exchange, g):
        if g == 0 and exchange.plan.num_groups > 1:
            return  # group 0 is sent together with group 1, after the swap
        if g == 1:
            r0, r1 = exchange.region(0), exchange.region(1)
            count = min(r0.numel(), r1.numel())
            held = r0[:count].clone()
            r0[:count].copy_(r1[:count])
            r1[:count].copy_(held)
            exchange.start(0)
        exchange.start(g)


class EarlySignal(FaultyReference):
    """Signals the wrong group: group g + 1 as soon as group g is written, so every collective
    (or custom op) runs on a region whose tiles are not there yet."""

    name = "broken-early-signal"

    def before_group(self, exchange, g):
        if g == 0:
            exchange.start(0)

    def group_done(self, exchange, g):
        if g + 1 < exchange.plan.num_groups:
            exchange.start(g + 1)


class NoPostReorder(FaultyReference):
    """Forgets the post-communication reorder: the packed tiles are copied out as if they were
    row-major rows."""

    name = "broken-no-post-reorder"

    def layouts(self, spec):
        return ("tiles",)  # a "rows" plan has no post-reorder to forget

    def post_reorder(self, exchange):
        out = exchange.call.out
        out.view(-1).copy_(exchange.staging[:out.numel()])
        return out


class UnwrittenTile(FaultyReference):
    """The post-reorder never writes the last tile of each destination block."""

    name = "broken-unwritten-tile"

    def post_reorder(self, exchange):
        for rows, tiles, offsets in exchange.block_layouts():
            unpack_tiles(exchange.staging, offsets[:-1], tiles[:-1], rows)
        return exchange.call.out


class WritesPastOut(FaultyReference):
    """The post-reorder also writes the element just after ``out`` (when its storage has one)."""

    name = "broken-writes-past-out"

    def post_reorder(self, exchange):
        out = exchange.finish()
        end = out.storage_offset() + out.numel()
        if out.untyped_storage().nbytes() > end * out.element_size():
            torch.as_strided(out, (1,), (1,), end).zero_()
        return out


class StaleRepeat(ReferenceBackend):
    """Caches its result per plan and returns it again on the next call with that plan, like a
    backend whose per-plan state (counters, buffers) is not reset between calls."""

    name = "broken-stale-repeat"

    def __init__(self):
        self.results = {}

    def run(self, call):
        key = (call.plan, call.rank)
        if key not in self.results:
            self.results[key] = super().run(call).clone()
        elif call.out is None:
            call.out = self.results[key].clone()
        else:
            call.out.copy_(self.results[key])
        return call.out


BROKEN = ("SwappedGroups", "EarlySignal", "NoPostReorder", "UnwrittenTile", "WritesPastOut", "StaleRepeat")


class HangsOnRank1(ReferenceBackend):
    """Rank 1 never returns (a device-side wait whose signal never comes)."""

    name = "broken-hangs-on-rank-1"

    def run(self, call):
        if call.rank == 1:
            time.sleep(3600)
        return super().run(call)
