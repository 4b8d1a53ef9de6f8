"""all_to_all for expert parallelism on the ``cuda`` backend: every call's rows and splits are its
own, on every rank (flashoverlap_core.all_to_all), so nothing of a call's layout is prepared.

One native function per call (``fo_a2a_run``, csrc/cuda/all_to_all_call.cuh) lays the call out
from its splits and issues it: a table kernel writes the GEMM's work items and the
post-reorder's tiles on the device, the signaling GEMM runs over the unequal destination blocks,
the communication stream waits for each group's tiles and sends and receives the group's part
for every peer in one NCCL group, and the post-reorder restores the rows. The plan's
"destinations" grouping (group g takes chunk g of every destination block) lets each rank count
what a peer sends it in each group from the rows alone, so with ``recv_splits`` given nothing is
exchanged and the host never waits.

Per compute stream the call keeps its own communication stream, counters and buffers; the
buffers grow when a call needs more (the native call says how much), and stay.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from flashoverlap_core.backend import OverlapCall
from flashoverlap_core.tiles import RASTERS

from . import kernels, nccl
from .device_state import (ALIGN_BYTES, NCCL_DTYPES, _current_device, _current_stream_getter,
                           b_col_major, outside_graph_pools, wait_mode)
from .runtime import ABI_VERSION, WAIT_MODES

if TYPE_CHECKING:
    from .backend import CudaBackend

MAX_RANKS = 64  # a2a_layout.cuh's kMaxRanks
MAX_GROUPS = 16  # and kMaxGroups
_TOO_SMALL = 2  # cudaErrorMemoryAllocation: the buffers hold less than the call needs


def unsupported(plan, world_size: int) -> list[str]:
    """Why the native all_to_all cannot run calls of this plan (empty: it can)."""
    reasons = []
    if world_size > MAX_RANKS:
        reasons.append(f"all_to_all runs at world sizes up to {MAX_RANKS} on cuda, not {world_size}")
    if plan is not None and plan.num_groups > MAX_GROUPS:
        reasons.append(f"an all_to_all plan has at most {MAX_GROUPS} groups on cuda, not "
                       f"{plan.num_groups}")
    return reasons


class _StreamState:
    """What the calls on one compute stream use, and no other call: the native call (its
    events), the communication stream, the counters and the buffers."""

    def __init__(self, call: "CudaAllToAllCall"):
        device, world = call.device, call.world
        self.runtime = call.runtime
        self.comm = None
        if call.comm is not None:
            _, high = torch.cuda.Stream.priority_range()
            self.comm = torch.cuda.Stream(device=device, priority=high)
        self.counters = torch.zeros(call.groups, dtype=torch.int32, device=device)
        self.tensors = {"block_starts": torch.empty(world + 1, dtype=torch.int32, device=device),
                        "counters": self.counters}
        self.buffers = self.runtime.A2aBuffers()
        self.buffers.block_starts = self.tensors["block_starts"].data_ptr()
        self.buffers.counters = self.counters.data_ptr()
        call.desc.comm_stream = self.comm.cuda_stream if self.comm is not None else None
        self.handle = self.runtime.a2a_create(call.desc)
        self._keep_for_comm()
        self.runtime.a2a_set_buffers(self.handle, self.buffers)

    def _keep_for_comm(self) -> None:
        if self.comm is not None:
            for t in self.tensors.values():
                t.record_stream(self.comm)  # freed only once the communication stream is done

    def grow(self, call: "CudaAllToAllCall") -> None:
        """Make every buffer hold what the last call asked for (``needs``), with room to spare."""
        tiles, received, packed, staging = self.handle.needs
        b, device, dtype = self.buffers, call.device, call.dtype

        def more(have: int, need: int) -> int:
            return max(need, have + have // 2)

        def make():
            if tiles > b.tile_capacity:
                b.tile_capacity = more(b.tile_capacity, tiles)
                self.tensors["items"] = torch.empty(b.tile_capacity, 4, dtype=torch.int64, device=device)
                self.tensors["item_group"] = torch.empty(b.tile_capacity, dtype=torch.int32, device=device)
            if received > b.unpack_capacity:
                b.unpack_capacity = more(b.unpack_capacity, received)
                self.tensors["unpack_tiles"] = torch.empty(b.unpack_capacity, 4, dtype=torch.int32,
                                                           device=device)
                self.tensors["unpack_offsets"] = torch.empty(b.unpack_capacity, dtype=torch.int64,
                                                             device=device)
            if packed > b.packed_numel:
                b.packed_numel = more(b.packed_numel, packed)
                self.tensors["packed"] = torch.empty(b.packed_numel, dtype=dtype, device=device)
            if staging > b.staging_numel:
                b.staging_numel = more(b.staging_numel, staging)
                self.tensors["staging"] = torch.empty(b.staging_numel, dtype=dtype, device=device)

        outside_graph_pools(make, torch.cuda.current_stream(device))
        for name in ("items", "item_group", "unpack_tiles", "unpack_offsets", "packed", "staging"):
            if name in self.tensors:
                setattr(b, name, self.tensors[name].data_ptr())
        self._keep_for_comm()
        self.runtime.a2a_set_buffers(self.handle, b)

    def __del__(self):
        if getattr(self, "handle", None):
            self.runtime.a2a_destroy(self.handle)


class CudaAllToAllCall:
    """The all_to_all calls of one key: ``run(a, b, out, send_splits, recv_splits)`` with each
    call's own rows and splits (checked by the caller, :class:`flashoverlap_core.all_to_all.
    AllToAllCall`)."""

    def __init__(self, backend: "CudaBackend", template: OverlapCall):
        plan, b, device = template.plan, template.b, template.a.device
        self.backend, self.device, self.index = backend, device, device.index
        self.world, self.groups, self.n = template.world_size, plan.num_groups, plan.n
        self.dtype = plan.torch_dtype
        self.arch = backend._arch()
        # sm80 loads 8-element vectors along N of a row-major b: such a b with N % 8 != 0 runs
        # as the column-major kernel on a transposed copy (as CudaCall does)
        self.col = b_col_major(b) or (self.arch == 80 and b.shape[1] % 8 != 0)
        # the build for unequal destination blocks, with 1x1 clusters: a round's items are
        # tiles of different destination blocks, which need not share operand tiles
        self.gemm = kernels.gemm_library(kernels.gemm_config(self.arch, plan.tile, plan.dtype,
                                                             self.col, blocks=True))
        k = template.a.shape[1]
        self.k = k if self.arch != 80 else -(-k // 8) * 8
        b_rows = b.t() if self.col else b
        step = ALIGN_BYTES // b.element_size()
        self.b_direct = (b_rows.stride(1) == 1 and b_rows.stride(0) % step == 0 and self.k == k)
        self.ldb = b_rows.stride(0)
        self.a_step = step
        self.comm = (nccl.communicator(template.group, device)
                     if template.group is not None and self.world > 1 else None)
        self.runtime = kernels.runtime_library()
        self.run_native = self.runtime.a2a_run
        self.warm_key = (self.gemm.path, template.group, "all_to_all rows", plan.dtype)
        self.warmed = False
        self.current_stream = _current_stream_getter()
        desc = self.runtime.A2aDescription()
        desc.abi_version = ABI_VERSION
        desc.gemm_run_blocks = self.gemm.run_blocks_address
        desc.tile_m, desc.tile_n = plan.tile
        desc.N = plan.n
        desc.raster_m = RASTERS.index(plan.schedule.raster)
        desc.swizzle = plan.schedule.swizzle
        desc.groups = plan.num_groups
        desc.world, desc.rank = self.world, template.rank
        desc.K, desc.num_ctas = self.k, plan.wave_size
        desc.wait_mode = WAIT_MODES[wait_mode()]
        desc.nccl_comm = self.comm
        desc.nccl_dtype = NCCL_DTYPES[plan.dtype]
        desc.elem_size = b.element_size()
        self.desc = desc
        self._states: dict[int, _StreamState] = {}
        self.state()

    def state(self, stream: int | None = None) -> _StreamState:
        """This compute stream's state, made on its first call (outside graph pools)."""
        if stream is None:
            stream = self.current_stream(self.index)
        state = self._states.get(stream)
        if state is None:
            state = outside_graph_pools(lambda: _StreamState(self),
                                        torch.cuda.current_stream(self.device))
            self._states[stream] = state
        return state

    def _operands(self, a, b):
        """(a, lda, b, ldb, copies): a and b read in place when their strides and addresses
        allow (16-byte aligned rows), else copies that do (kept alive until queued)."""
        if (self.b_direct and a.stride(1) == 1 and a.stride(0) % self.a_step == 0
                and (a.data_ptr() | b.data_ptr()) & (ALIGN_BYTES - 1) == 0
                and a.shape[1] == self.k):
            return a.data_ptr(), a.stride(0), b.data_ptr(), self.ldb, None
        if a.shape[0] == 0:  # nothing to compute: the GEMM is not launched
            return a.data_ptr(), self.k, b.data_ptr(), self.ldb, None
        a_op, b_op, _ = self.backend._operands(self.arch, a, b, self.col)
        return a_op.data_ptr(), a_op.stride(0), b_op.data_ptr(), b_op.stride(0), (a_op, b_op)

    def run(self, a, b, out, send, recv) -> torch.Tensor:
        if _current_device() != self.index:
            with torch.cuda.device(self.device):
                return self.run(a, b, out, send, recv)
        stream = self.current_stream(self.index)
        state = self._states.get(stream) or self.state(stream)
        a_ptr, lda, b_ptr, ldb, copies = self._operands(a, b)
        warm = 0 if self.warmed else int(self.backend.warm_up(self.warm_key))
        args = (state.handle, a_ptr, lda, b_ptr, ldb, out.data_ptr(), a.shape[0], send, recv,
                stream, warm)
        err = self.run_native(*args)
        if err == _TOO_SMALL and any(n > 0 for n in state.handle.needs):
            state.grow(self)
            err = self.run_native(*args)
        del copies  # queued: the caching allocator orders their reuse after these kernels
        if err:
            self.runtime.check(err, "fo_a2a_run", self.gemm)
        self.warmed = True
        return out
