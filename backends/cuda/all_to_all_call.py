"""all_to_all for expert parallelism on the ``cuda`` backend: every call's rows and splits are its
own, on every rank (flashoverlap_core.all_to_all), so nothing of a call's layout is prepared.

One native function per call (``fo_a2a_run``, csrc/cuda/all_to_all_call.cu) lays the call out
from its splits and issues it: a table kernel writes the GEMM's work items (and, in the "tiles"
layout, the post-reorder's tiles) on the device, the signaling GEMM runs over the unequal
destination blocks, the communication stream waits for each group's tiles and sends and
receives the group's part for every peer in one NCCL group. The plan's "destinations" grouping
(group g takes chunk g of every destination block) lets each rank count what a peer sends it in
each group from the rows alone, so with ``recv_splits`` given nothing is exchanged and the host
never waits.

The plan's layout decides where the tiles go:

* "rows" (the default): a group's chunk of a block is whole strips of row bands, so the GEMM
  writes each tile at its final row of the row-major product (at world size 1 straight into
  ``out``), each send is contiguous rows of the product and each receive lands at its final rows
  of ``out``: no staging buffer, no post-reorder;
* "tiles": the packed buffer holds each group's tiles back to back, the receives land in a
  staging buffer and a post-reorder restores the rows.

Per compute stream the call keeps its own communication stream, counters and buffers; the
buffers grow when a call needs more (the native call says how much), and stay.

fp8 (e4m3 a and b, sm90; issue 32): the GEMM is an e4m3 build for unequal destination blocks
(``fo_gemm_run_blocks_scaled``) that scales each product by its row's ``scale_a`` and its
column's ``scale_b`` (tensor-wise, row-wise, or block-wise in its main loop), and writes the
result in ``out_dtype``, which is what the buffers hold and NCCL moves. Each call passes its own
scales (``run_scaled``): a row-wise or block-wise ``scale_a`` has that call's rows.
"""
from __future__ import annotations


import torch

from flashoverlap_core.backend import OverlapCall
from flashoverlap_core.tiles import RASTERS

from . import kernels, nccl
from .call_base import CallState, NativeCall, WarmUps, new_description
from .device_state import (NCCL_DTYPES, _current_device, kernel_scale, outside_graph_pools,
                           overlap_nccl_ctas, scale_modes, wait_mode)
from .gemm import Operands, arch, takes_col_major
from .runtime import WAIT_MODES

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
    if plan is not None and plan.layout == "rows" and plan.strategy == "overlap":
        if plan.grouping != "destinations":
            reasons.append("an all_to_all plan in layout 'rows' has grouping 'destinations' on "
                           "cuda (fo.plan's default; explicit group_sizes take layout 'tiles')")
        if plan.schedule.raster != "n":
            reasons.append("an all_to_all plan in layout 'rows' has a raster 'n' tile order on "
                           "cuda (its groups are whole strips of bands only in that order)")
    return reasons


class _StreamState(CallState):
    """The state of one compute stream (:class:`CallState`; a communication stream only with a
    communicator): the counters and the buffers, which grow when a call needs more."""

    def __init__(self, call: "CudaAllToAllCall"):
        device = call.device
        super().__init__(device, call.runtime, comm=call.comm is not None)
        self.counters = torch.zeros(call.groups, dtype=torch.int32, device=device)
        self.tensors = {"block_starts": torch.empty(call.world + 1, dtype=torch.int32, device=device),
                        "counters": self.counters}
        self.buffers = self.runtime.A2aBuffers()
        self.buffers.block_starts = self.tensors["block_starts"].data_ptr()
        self.buffers.counters = self.counters.data_ptr()
        call.desc.comm_stream = self.comm.cuda_stream if self.comm is not None else None
        self.handle = self.runtime.a2a_create(call.desc)
        self.keep_for_comm(self.tensors.values())
        self.runtime.a2a_set_buffers(self.handle, self.buffers)

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
        self.keep_for_comm(self.tensors.values())
        self.runtime.a2a_set_buffers(self.handle, b)

    def workspace_bytes(self) -> int:
        """Device memory of this stream's buffers: tables, counters, the packed buffer (the
        row-major product of a "rows" call with a communicator) and the staging buffer."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def destroy(self) -> None:
        self.runtime.a2a_destroy(self.handle)


class CudaAllToAllCall(NativeCall):
    """The all_to_all calls of one key: ``run(a, b, out, send_splits, recv_splits)`` with each
    call's own rows and splits (checked by the caller, :class:`flashoverlap_core.all_to_all.
    AllToAllCall`); an fp8 key's: ``run_scaled(a, b, scale_a, scale_b, out, send_splits,
    recv_splits)``."""

    def __init__(self, template: OverlapCall, warm_ups: WarmUps):
        plan, b, device = template.plan, template.b, template.a.device
        super().__init__(device, warm_ups)
        self.world, self.groups, self.n = template.world_size, plan.num_groups, plan.n
        self.dtype = plan.result_dtype  # what the buffers hold and NCCL moves (fp8: out_dtype)
        self.layout = plan.layout
        self.arch = arch()
        self.col = takes_col_major(self.arch, b)
        # fp8: the scales' modes are the key's (their kind); their pointers and (block-wise)
        # strides each call's own
        self.scaled = template.scale_a is not None
        self.blockwise = plan.scaling == "blockwise"
        # the build for unequal destination blocks, with 1x1 clusters: a round's items are
        # tiles of different destination blocks, which need not share operand tiles
        self.gemm = kernels.gemm_library(kernels.gemm_config(
            self.arch, plan.tile, plan.dtype, self.col, blocks=True, out_dtype=plan.out_dtype,
            scaling=plan.scaling))
        if self.scaled and not self.gemm.run_blocks_scaled_address:
            raise RuntimeError(f"{self.gemm.path} has no fo_gemm_run_blocks_scaled (fp8 "
                               "all_to_all's GEMM): rebuild it (flashoverlap build)")
        # a's rows are each call's own: its strides are checked per call (Operands.of_rows)
        self.operands = Operands(self.arch, template.a, b, self.col)
        self.k = self.operands.k
        self.comm = (nccl.communicator(template.group, device, max_ctas=overlap_nccl_ctas(self.world))
                     if template.group is not None and self.world > 1 else None)
        self.runtime = kernels.runtime_library()
        self.run_native = self.runtime.a2a_run
        self.run_native_scaled = self.runtime.a2a_run_scaled
        self.warm_key = (self.gemm.path, template.group, "all_to_all rows", plan.dtype)
        self.warmed = False
        self.desc = self.description(template)
        self.state()

    def description(self, template: OverlapCall):
        """fo_a2a_desc of this key (each stream's state adds its communication stream)."""
        plan, b = template.plan, template.b
        desc = new_description(self.runtime.A2aDescription)
        desc.gemm_run_blocks = self.gemm.run_blocks_address
        if self.scaled:  # the modes of the key's kind of scales (fo_gemm_scales)
            desc.gemm_run_blocks_scaled = self.gemm.run_blocks_scaled_address
            desc.scaled = 1
            desc.scale_a_per_row, desc.scale_b_per_col = scale_modes(
                kernel_scale(template.scale_a, self.blockwise),
                kernel_scale(template.scale_b, self.blockwise), self.blockwise)[:2]
        desc.tile_m, desc.tile_n = plan.tile
        desc.N = plan.n
        desc.raster_m = RASTERS.index(plan.schedule.raster)
        desc.swizzle = plan.schedule.swizzle
        desc.groups = plan.num_groups
        desc.world, desc.rank = self.world, template.rank
        desc.K, desc.num_ctas = self.k, plan.wave_size
        desc.wait_mode = WAIT_MODES[wait_mode()]
        desc.nccl_comm = self.comm
        desc.nccl_dtype = NCCL_DTYPES[plan.out_dtype or plan.dtype]  # the result's
        desc.elem_size = plan.result_dtype.itemsize
        desc.rows = int(plan.layout == "rows")
        return desc

    def new_state(self) -> _StreamState:
        return _StreamState(self)

    def workspace_bytes(self) -> int:
        """Device memory the calls keep beyond their outputs, over every stream's state
        (``fo.prepared_calls()``)."""
        return sum(state.workspace_bytes() for state in list(self._states.values()))

    def buffers(self, stream: int | None = None) -> dict[str, int]:
        """Bytes of each buffer of ``stream``'s state (the current stream's by default): what
        a call of this stream keeps ("packed" is the row-major product of a "rows" call)."""
        state = self._states.get(self.current_stream(self.index) if stream is None else stream)
        return {} if state is None else {name: t.numel() * t.element_size()
                                         for name, t in state.tensors.items()}

    def run(self, a, b, out, send, recv) -> torch.Tensor:
        return self._run(a, b, out, send, recv, None)

    def run_scaled(self, a, b, scale_a, scale_b, out, send, recv) -> torch.Tensor:
        """An fp8 call (checked by the caller): ``run`` with this call's scales, read in place
        where the kernel can read them (:func:`.device_state.kernel_scale`; else copies)."""
        return self._run(a, b, out, send, recv, (scale_a, scale_b))

    def _run(self, a, b, out, send, recv, scales) -> torch.Tensor:
        if _current_device() != self.index:
            with torch.cuda.device(self.device):
                return self._run(a, b, out, send, recv, scales)
        stream = self.current_stream(self.index)
        state = self._states.get(stream) or self.state(stream)
        a_ptr, lda, b_ptr, ldb, copies = self.operands.of_rows(a, b)
        warm = 0 if self.warmed else int(self.needs_warm_up())
        if scales is None:
            args = (state.handle, a_ptr, lda, b_ptr, ldb, out.data_ptr(), a.shape[0], send, recv,
                    stream, warm)
            run, what = self.run_native, "fo_a2a_run"
        else:
            # a copy (a scale the kernel cannot read in place) is queued before the call, and
            # the caching allocator orders its reuse after it
            scale_a, scale_b = (kernel_scale(t, self.blockwise) for t in scales)
            strides = (tuple(scale_a.stride()) + tuple(scale_b.stride())
                       if self.blockwise else None)
            args = (state.handle, a_ptr, lda, b_ptr, ldb, scale_a.data_ptr(), scale_b.data_ptr(),
                    strides, out.data_ptr(), a.shape[0], send, recv, stream, warm)
            run, what = self.run_native_scaled, "fo_a2a_run_scaled"
        err = run(*args)
        if err == _TOO_SMALL and any(n > 0 for n in state.handle.needs):
            state.grow(self)
            err = run(*args)
        del copies  # queued: the caching allocator orders their reuse after these kernels
        if err:
            self.raise_error(err, what)
        self.warmed = True
        return out
