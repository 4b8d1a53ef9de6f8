"""The reference backend: the plan executed literally, in plain torch, on any device.

Tiles are computed one by one in execution order (fp32 accumulation) and stored in their packed
slots; when a group's last tile is stored, its collective starts asynchronously and runs while
the next groups' tiles are computed; then the post-communication reorder (fused into the
residual add and the RMSNorm for ``fo.overlap_add_rmsnorm``: rows read from the received tiles
through the band table of :func:`~flashoverlap_core.reorder.band_offsets`, as a fused kernel
reads them). A "rows" plan's packed buffer of an allreduce or callable op is the output itself,
and its collectives leave the rows in place: nothing is reordered. It is the executable specification every other backend is tested against, not a
fast path.
"""
from __future__ import annotations

import torch

from .backend import Backend, OverlapCall
from .collectives import RegionExchange, packed_buffer
from .gather import execute_tiles
from .plan import GATHER_OP
from .reorder import add_rmsnorm, band_offsets, row_index
from .tile_trace import HostRecorder, NoRecorder, TileTrace


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class ReferenceBackend(Backend):
    name = "reference"
    device_type = None
    priority = 0

    def run(self, call: OverlapCall) -> torch.Tensor:
        return self._execute(call, NoRecorder())

    def trace(self, call: OverlapCall) -> TileTrace:
        """Run the call, stamping each tile and each group's collective on the host clock
        (the device is synchronised before every stamp when the tensors are not on the CPU)."""
        device = call.a.device.type
        sync = torch.get_device_module(device).synchronize if device != "cpu" else None
        recorder = HostRecorder(call.plan, sync)
        self._execute(call, recorder)
        return recorder.trace()

    def run_add_rmsnorm(self, call: OverlapCall, residual, weight, eps: float):
        """The received tiles read row by row through the band table, then add + RMSNorm."""
        exchange = self._communicate(call, NoRecorder())
        if call.plan.layout == "rows":  # the reduced rows are in place
            return add_rmsnorm(exchange.finish(), residual, weight, eps)
        (rows_view, tiles, offsets), = exchange.block_layouts()  # allreduce, reduce_scatter
        rows, n = rows_view.shape
        index = row_index(band_offsets(tiles, offsets, rows, n, call.plan.tile), rows, n,
                          call.plan.tile)
        return add_rmsnorm(exchange.staging[index.to(exchange.staging.device)], residual, weight,
                           eps)

    def _execute(self, call: OverlapCall, recorder) -> torch.Tensor:
        if call.plan.op == GATHER_OP:  # the collective feeds the GEMM (see flashoverlap_core.gather)
            return execute_tiles(call, recorder, accumulation_dtype(call.a.dtype))
        return self._communicate(call, recorder).finish()

    def _communicate(self, call: OverlapCall, recorder) -> RegionExchange:
        """The tiles and every group's collective, joined: what the post-reorder reads."""
        plan = call.plan
        acc = accumulation_dtype(call.a.dtype)
        a, b = call.a.to(acc), call.b.to(acc)
        packed = packed_buffer(call)
        offsets = {tile: offset for tile, _, offset in plan.packed_tiles}
        exchange = RegionExchange(call, packed)
        for g, tiles in enumerate(plan.groups):
            for t in tiles:
                value = a[t.row0:t.row0 + t.rows] @ b[:, t.col0:t.col0 + t.cols]
                plan.packed_view(packed, t, offsets[t]).copy_(value)
                recorder.tile_done()
            recorder.transfer_started(g)
            launched = len(exchange.works)
            exchange.start(g)
            recorder.transfer_launched(g, exchange.works[launched:])
        recorder.join()
        exchange.wait()
        return exchange
