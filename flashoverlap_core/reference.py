"""The reference backend: the plan executed literally, in plain torch, on any device.

Tiles are computed one by one in execution order (fp32 accumulation) and stored in their packed
slots; when a group's last tile is stored, its collective starts asynchronously and runs while
the next groups' tiles are computed; then the post-communication reorder. It is the executable
specification every other backend is tested against, not a fast path.
"""
from __future__ import annotations

import torch

from .backend import Backend, OverlapCall
from .collectives import RegionExchange
from .gather import execute_tiles
from .plan import GATHER_OP
from .reorder import pack_tile
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

    def _execute(self, call: OverlapCall, recorder) -> torch.Tensor:
        plan = call.plan
        acc = accumulation_dtype(call.a.dtype)
        if plan.op == GATHER_OP:  # the collective feeds the GEMM (see flashoverlap_core.gather)
            return execute_tiles(call, recorder, acc)
        a, b = call.a.to(acc), call.b.to(acc)
        packed = torch.empty(plan.packed_numel, dtype=call.a.dtype, device=call.a.device)
        offsets = {tile: offset for tile, _, offset in plan.packed_tiles}
        exchange = RegionExchange(call, packed)
        for g, tiles in enumerate(plan.groups):
            for t in tiles:
                value = a[t.row0:t.row0 + t.rows] @ b[:, t.col0:t.col0 + t.cols]
                pack_tile(packed, offsets[t], t, value)
                recorder.tile_done()
            recorder.transfer_started(g)
            launched = len(exchange.works)
            exchange.start(g)
            recorder.transfer_launched(g, exchange.works[launched:])
        recorder.join()
        exchange.wait()
        return exchange.finish()
