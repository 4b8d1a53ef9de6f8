"""The overlapped call of the ``cuda`` backend (allreduce, reduce_scatter, callable ops, and
all_to_all with a plan per split; csrc/cuda/overlap_call.cu): the signaling GEMM writes the
packed layout and bumps each group's counter; the communication stream waits on each counter
and runs the group's collective; the post-reorder restores the layout (see :mod:`.backend` for
the whole picture). For ``fo.overlap_add_rmsnorm`` the post-reorder is the fused residual add +
RMSNorm kernel, a phase of this call (its helpers: :mod:`.add_rmsnorm`).
"""
from __future__ import annotations


import torch

from flashoverlap_core.backend import OverlapCall, PreparedCall
from flashoverlap_core.collectives import (RegionExchange, collective_steps, packed_buffer,
                                           unpack_layouts)
from flashoverlap_core.ops import CUSTOM_OP, of
from flashoverlap_core.reorder import add_rmsnorm

from . import kernels, nccl
from .add_rmsnorm import DTYPE_CODES, band_table, residual_operand, weight_operand
from .call_base import CallState, NativeCall, WarmUps, new_description
from .device_state import (ALIGN_BYTES, NCCL_DTYPES, _current_device, kernel_scale,
                           overlap_nccl_ctas, replay_graphs, scale_modes, wait_mode)
from .gemm import Gemms, Operands, bases_aligned, into_aligned, stock_aligned, workspace
from .runtime import WAIT_MODES

# What an op's collective (flashoverlap_core.ops) is to the native call: fo_call_desc.collective
# (0: none, no process group); ops without a code (callables) take the Python path.
COLLECTIVES = {"all_reduce": 1, "reduce_scatter": 2, "all_to_all": 3}


class StreamState(CallState):
    """The state of one compute stream (:class:`CallState`): the group counters, the packed
    and staging buffers."""

    def __init__(self, plan, device: torch.device, dtype: torch.dtype, staging_numel: int | None,
                 packed: bool = True):
        super().__init__(device)
        self.counters = torch.zeros(plan.num_groups, dtype=torch.int32, device=device)
        # a "rows" allreduce writes the call's output itself: packed=False, no buffers
        self.packed = torch.empty(plan.packed_numel, dtype=dtype, device=device) if packed else None
        self.staging = (self.packed if staging_numel is None
                        else torch.empty(staging_numel, dtype=dtype, device=device))
        if plan.layout == "rows" and staging_numel is None:
            self.staging = None  # what the fused norm reads: made on its first call
        self.keep_for_comm((self.counters, self.packed, self.staging))

    def destroy(self) -> None:
        self.runtime.call_destroy(self.handle)


class CudaCall(NativeCall, PreparedCall):
    """The prepared calls of one key on the cuda backend (see the module docstring).

    ``run`` costs a few microseconds of Python: find this stream's state, check the operands'
    alignment, one native call that issues the GEMM, every wait and collective, and the
    post-reorder (``run_add_rmsnorm``: the fused residual add + RMSNorm in its place)."""

    def __init__(self, backend, call: OverlapCall, gemms: Gemms, warm_ups: WarmUps,
                 python_path: bool = False, stream: int | None = None):
        PreparedCall.__init__(self, backend, call)
        NativeCall.__init__(self, call.a.device, warm_ups)
        plan, a, device = call.plan, call.a, call.a.device
        self.gemms = gemms
        self.op = of(call.op)
        self.kind = self.op.name
        self.tables = gemms.plan_tables(plan, device)
        # fp8: per call, scale_a and scale_b go to fo_call_run_scaled as they are when the key's
        # strides let the kernel read them in place (kernel_scale), else as copies
        # (block-wise scales: as they are, read through the key's strides)
        self.scaled = call.scale_a is not None
        self.blockwise = plan.scaling == "blockwise"
        scales = (tuple(kernel_scale(t, self.blockwise) for t in (call.scale_a, call.scale_b))
                  if self.scaled else None)
        self.gemm, self.col, self.arch = gemms.gemm_for(plan, self.tables, call.b, scales=scales)
        self.stock = kernels.is_stock(self.gemm)  # its result and block-wise scale_a: TMA
        # The key fixes the strides: what the kernel takes as lda and ldb, and whether it
        # reads a and b in place (per call only their base addresses are checked).
        self.operands = Operands(self.arch, a, call.b, self.col)
        self.k, self.direct = self.operands.k, self.operands.direct
        self.lda, self.ldb = self.operands.lda, self.operands.ldb
        self.workspace = workspace(self.gemm, plan, self.k, device)
        self.wait = wait_mode()
        self.use_graph = replay_graphs()
        self.runtime = kernels.runtime_library()
        self.call_run = self.runtime.call_run
        self.norm_run = self.runtime.call_run_add_rmsnorm
        self.warmed = False  # this key's first call ran (with host syncs where needed)
        group = call.group
        self.python_path = python_path or self.kind == CUSTOM_OP or (
            group is not None and not nccl.uses_nccl(group)) or (
            self.op.splits and call.world_size > 1 and call.recv_splits is None)
        self.comm = (nccl.communicator(group, device, max_ctas=overlap_nccl_ctas(call.world_size))
                     if group is not None and not self.python_path else None)
        self.warm_key = (self.gemm.path, group, self.kind if not self.python_path else "python",
                         plan.dtype)
        self.template_scales = scale_modes(*scales, self.blockwise) if self.scaled else None
        self.scales_direct = self.scaled and all(
            k is t for k, t in zip(scales, (call.scale_a, call.scale_b)))
        self.call_run_scaled = self.runtime.call_run_scaled
        # A "rows" plan writes and receives the output's own rows: an allreduce needs no buffer
        # of its own (until its fused norm, which reduces a buffer of the call's rows), nor does
        # a native reduce_scatter of one rank, whose one block is the output: each group's
        # collective then sends and receives the same rows (NCCL's in-place form moves nothing;
        # the python path keeps its own buffer, whatever its group's library does with aliases).
        self.rows = plan.layout == "rows"
        self.rs_in_place = (self.rows and self.op.output == "block" and not self.python_path
                            and self.template.world_size == 1)
        self.packed_needed = not self.rows or not (self.op.in_place or self.rs_in_place)
        first = StreamState(plan, device, plan.result_dtype, None, self.packed_needed)
        self._states[self.current_stream(self.index) if stream is None else stream] = first
        with torch.cuda.device(device):
            # The layouts of the regions and of the post-reorder, from the first call: with a
            # communicator, all_to_all's counts are exchanged here, once.
            exchange = RegionExchange(call, first.packed)
            self.staging_numel = None
            if not self.rows and exchange.staging is not first.packed:
                self.staging_numel = exchange.staging.numel()
                first.staging = exchange.staging
                first.keep_for_comm((first.staging,))
            self.blocks = self._unpack_tables(exchange)  # none for a "rows" plan
            self.norm = band_table(exchange, device)  # (table, rows, tile) of the fused norm
            self.steps, self.num_steps, self.per_step = collective_steps(exchange)
        if not self.python_path:
            self._make_native(first)

    # ---- tables built once -----------------------------------------------------------------
    def _unpack_tables(self, exchange) -> list:
        """Per received block: (byte offset in out, tiles table, source offsets) on the device."""
        size = exchange.call.out.element_size()
        return [(start * size, torch.tensor(rects, dtype=torch.int32).to(self.device),
                 torch.tensor(offsets, dtype=torch.int64).to(self.device))
                for start, rects, offsets in unpack_layouts(exchange)]

    def _make_native(self, state: StreamState) -> None:
        plan = self.template.plan
        desc = new_description(self.runtime.CallDescription)
        desc.gemm_launch = self.gemm.launch_address
        desc.L, desc.block_rows = len(plan.block_rows), plan.block_rows[0]
        desc.N, desc.K = plan.n, self.k
        desc.items, desc.item_group = self.tables.items.data_ptr(), self.tables.item_group.data_ptr()
        desc.num_items, desc.num_ctas = plan.num_tiles, plan.wave_size
        desc.workspace = self.workspace.data_ptr() if self.workspace is not None else None
        desc.packed, desc.staging = (t.data_ptr() if t is not None else None
                                     for t in (state.packed, state.staging))
        desc.counters, desc.num_groups = state.counters.data_ptr(), plan.num_groups
        desc.group_sizes = plan.group_sizes
        desc.wait_mode = WAIT_MODES[self.wait]
        desc.collective = COLLECTIVES[self.op.collective] if self.comm is not None else 0
        desc.nccl_comm = self.comm
        desc.nccl_dtype = NCCL_DTYPES[plan.out_dtype or plan.dtype]
        desc.num_steps, desc.per_step = self.num_steps, self.per_step
        desc.steps = self.steps
        desc.num_blocks = len(self.blocks)
        desc.block_out_offset = [b[0] for b in self.blocks]
        desc.block_tiles = [b[1].data_ptr() for b in self.blocks]
        desc.block_offsets = [b[2].data_ptr() for b in self.blocks]
        desc.block_num_tiles = [b[1].shape[0] for b in self.blocks]
        desc.ldo, desc.elem_size = plan.n, plan.result_dtype.itemsize
        desc.comm_stream = state.comm.cuda_stream
        desc.gemm_set_node = self.gemm.set_node_address
        desc.use_graph = int(self.use_graph)
        desc.rows = int(self.rows)
        if self.scaled:
            desc.scaled = 1
            (desc.scale_a_per_row, desc.scale_b_per_col, desc.scale_a_stride,
             desc.scale_b_stride) = self.template_scales
        state.runtime = self.runtime
        if state.handle is not None:
            self.runtime.call_destroy(state.handle)
        state.handle = self.runtime.call_create(desc)
        if self.norm is not None and state.staging is not None:
            table, rows, tile = self.norm
            self.runtime.call_set_add_rmsnorm(state.handle, table.data_ptr(), rows, tile,
                                              DTYPE_CODES[plan.dtype])

    def _norm_buffers(self, state: StreamState) -> None:
        """A "rows" call's first fused norm on this stream: the buffer its reduced rows land in
        (an allreduce's GEMM output, reduced in place; a reduce_scatter's received rows)."""
        plan = self.template.plan
        if self.op.output == "block" and self.comm is not None:  # the received rows
            rows = plan.m // self.template.world_size
            state.staging = torch.empty(rows * plan.n, dtype=plan.result_dtype, device=self.device)
        elif state.packed is not None:  # no collective: the GEMM's own rows
            state.staging = state.packed
        else:  # an allreduce's GEMM output, reduced in place
            state.staging = torch.empty(plan.m * plan.n, dtype=plan.result_dtype, device=self.device)
        state.keep_for_comm((state.staging,))
        if state.packed is None:
            state.packed = state.staging
        if not self.python_path:
            self._make_native(state)

    # ---- per stream --------------------------------------------------------------------------
    def new_state(self) -> StreamState:
        plan = self.template.plan
        return StreamState(plan, self.device, plan.result_dtype, self.staging_numel,
                           self.packed_needed)

    def state_made(self, state: StreamState) -> None:
        if not self.python_path:
            self._make_native(state)

    def workspace_bytes(self) -> int:
        seen, total = set(), 0
        for state in list(self._states.values()):
            for t in (state.packed, state.staging, state.counters):
                if t is not None and t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    total += t.numel() * t.element_size()
        return total

    def graph_state(self, stream: int | None = None, fused: bool = False) -> int:
        """How this key's calls on ``stream`` run: 1 replaying a captured graph, 0 launch by
        launch (first call, python path, replay off), -1 the graph could not be made;
        ``fused``: its ``run_add_rmsnorm`` calls (a graph of their own)."""
        state = self.state(stream)
        if state.handle is None:
            return 0
        if fused:
            return self.runtime.call_add_rmsnorm_graph_state(state.handle)
        return self.runtime.call_graph_state(state.handle)

    def graphs_held(self, stream: int | None = None) -> int:
        """How many captured graphs this key's calls on ``stream`` hold: a "rows" call with a
        collective keeps one per ``out`` (of its last 8), so that no rank ever launches a
        collective outside a graph while another replays it; else at most one."""
        state = self.state(stream)
        return 0 if state.handle is None else self.runtime.call_graphs_held(state.handle)

    # ---- the call ----------------------------------------------------------------------------
    def _steady(self, a, b):
        """(this stream's state, the stream) in the steady state: its native call made, kernels
        loaded, operands read in place and aligned, this device current; else None."""
        stream = self.current_stream(self.index)
        state = self._states.get(stream)
        if (state is not None and self.warmed and self.direct and state.handle is not None
                and bases_aligned(a, b) and _current_device() == self.index):
            return state, stream
        return None

    def run(self, a, b, out, op):
        steady = self._steady(a, b)
        if steady is None:
            return self._run(a, b, out, op)
        state, stream = steady
        err = self.call_run(state.handle, a.data_ptr(), self.lda, b.data_ptr(), self.ldb,
                            out.data_ptr(), stream, 0)
        if err:
            self.raise_error(err)
        return out

    def run_scaled(self, a, b, scale_a, scale_b, out, op):
        """An fp8 call: ``run`` with this call's scales (the same steady state, where the
        scales can be read in place)."""
        if self.stock and not stock_aligned(out, scale_a, self.blockwise):
            return self._run_realigned(a, b, scale_a, scale_b, out, op)
        steady = self._steady(a, b) if self.scales_direct else None
        if steady is None:
            return self._run(a, b, out, op, (scale_a, scale_b))
        state, stream = steady
        err = self.call_run_scaled(state.handle, a.data_ptr(), self.lda, b.data_ptr(), self.ldb,
                                   scale_a.data_ptr(), scale_b.data_ptr(), out.data_ptr(), stream, 0)
        if err:
            self.raise_error(err)
        return out

    def _run_realigned(self, a, b, scale_a, scale_b, out, op):
        """A stock build's call (its TMA maps of the result and of block-wise scale_a need
        16-byte aligned bases) whose ``out`` or scale_a is not aligned: on aligned copies, the
        result copied into ``out`` after."""
        if self.blockwise and scale_a.data_ptr() % ALIGN_BYTES:
            scale_a = torch.empty_strided(scale_a.shape, scale_a.stride(), dtype=scale_a.dtype,
                                          device=scale_a.device).copy_(scale_a)
        return into_aligned(out, lambda target: self._run(a, b, target, op, (scale_a, scale_b)))

    def _run(self, a, b, out, op, scales=None):
        """Every other case: another device current, a first call, copied operands, the
        python path. ``scales``: an fp8 call's (scale_a, scale_b)."""
        if _current_device() != self.index:
            with torch.cuda.device(self.device):
                return self._run(a, b, out, op, scales)
        if self.python_path:
            t = self.template
            call = OverlapCall(a, b, t.plan, op, t.group, t.rank, t.world_size, out, t.recv_splits,
                               *(scales or (None, None)))
            self.run_python(call, self.state())
            return call.out
        if scales is None:
            self._run_native(a, b, lambda handle, a_ptr, lda, b_ptr, ldb, stream, warm:
                             self.call_run(handle, a_ptr, lda, b_ptr, ldb, out.data_ptr(), stream,
                                           warm))
            return out
        # the scales as the kernel reads them (float32, contiguous, on this device); a copy
        # is queued before the call, and the caching allocator orders its reuse after it
        scale_a, scale_b = (kernel_scale(x, self.blockwise) for x in scales)
        self._run_native(a, b, lambda handle, a_ptr, lda, b_ptr, ldb, stream, warm:
                         self.call_run_scaled(handle, a_ptr, lda, b_ptr, ldb, scale_a.data_ptr(),
                                              scale_b.data_ptr(), out.data_ptr(), stream, warm))
        return out

    def run_add_rmsnorm(self, a, b, op, residual, weight, eps):
        """The call with the fused residual add + RMSNorm kernel as its post-reorder (the
        python path: the post-reorder, then the add and the norm in torch)."""
        if self.python_path or self.norm is None:
            return add_rmsnorm(self.run(a, b, residual.new_empty(residual.shape), op), residual,
                               weight, eps)
        state = self.state()
        if state.staging is None:  # a "rows" call's first fused norm on this stream
            self._norm_buffers(state)
        residual, ld_residual = residual_operand(residual, self.template.plan.n)
        weight, weight_code = weight_operand(weight, residual.dtype)
        normed, resid_out = residual.new_empty(residual.shape), residual.new_empty(residual.shape)

        def issue(handle, a_ptr, lda, b_ptr, ldb, stream, warm):
            return self.norm_run(handle, a_ptr, lda, b_ptr, ldb, residual.data_ptr(), ld_residual,
                                 weight.data_ptr(), weight_code, eps, normed.data_ptr(),
                                 resid_out.data_ptr(), resid_out.stride(0), stream, warm)

        steady = self._steady(a, b)
        if steady is None:
            self._run_native(a, b, issue)
        else:
            state, stream = steady
            err = issue(state.handle, a.data_ptr(), self.lda, b.data_ptr(), self.ldb, stream, 0)
            if err:
                self.raise_error(err)
        return normed, resid_out

    def _run_native(self, a, b, issue) -> None:
        """The native call outside the steady state (another device current, a first call,
        copied operands): ``issue(handle, a_ptr, lda, b_ptr, ldb, stream, warm)`` makes it and
        returns its error code."""
        if _current_device() != self.index:
            with torch.cuda.device(self.device):
                return self._run_native(a, b, issue)
        stream = self.current_stream(self.index)
        state = self._states.get(stream) or self.state(stream)
        warm = self.needs_warm_up()
        a_ptr, lda, b_ptr, ldb, copies = self.operands.of_key(a, b)
        err = issue(state.handle, a_ptr, lda, b_ptr, ldb, stream, int(warm))
        del copies  # queued: the caching allocator orders their reuse after these kernels
        if err:
            self.raise_error(err)
        self.warmed = True

    def run_python(self, call: OverlapCall, state: StreamState, monitor=None,
                   stamps: dict | None = None) -> None:
        """The call from Python: custom ops, all_to_all without recv_splits, groups without
        NCCL, and traces. ``stamps`` (a dict, trace mode): CUDA events at the GEMM's launch and
        end, around each group's transfer (each transfer then ends on the communication stream
        before the next starts) and at the end of the call."""
        plan, device = call.plan, call.a.device

        def stamp(name, stream):
            if stamps is not None:
                event = torch.cuda.Event(enable_timing=True)
                event.record(stream)
                stamps.setdefault(name, []).append(event)

        with torch.cuda.device(device):
            runtime = self.runtime
            compute, comm = torch.cuda.current_stream(device), state.comm
            # a "rows" allreduce or custom op writes and transfers the output's rows in place
            packed = state.packed if self.packed_needed else packed_buffer(call)
            exchange = RegionExchange(call, packed)  # all_to_all: count exchange (host sync)
            comm.wait_stream(compute)
            stamp("launch", compute)
            self.gemms.launch_gemm(plan, call.a, call.b, packed, monitor=monitor,
                                     stream=compute, counters=state.counters,
                                     scales=(call.scale_a, call.scale_b))
            stamp("gemm_end", compute)
            first = self.needs_warm_up()
            if first:  # load every kernel of the call on an idle device (see module doc)
                compute.synchronize()
            with torch.cuda.stream(comm):
                for g, size in enumerate(plan.group_sizes):
                    runtime.wait_counter(state.counters.data_ptr() + 4 * g, size,
                                         WAIT_MODES[self.wait], comm.cuda_stream)
                    stamp("transfer_start", comm)
                    exchange.start(g)
                    if stamps is not None:
                        for work in exchange.works[-1:] if call.group is not None else []:
                            work.wait()  # the communication stream waits for this collective
                        stamp("transfer_end", comm)
                exchange.launch_remaining()
            if first:
                torch.cuda.synchronize(device)
            exchange.wait()  # the compute stream waits for every collective
            with torch.cuda.stream(comm):
                runtime.reset_counters(state.counters.data_ptr(), plan.num_groups, comm.cuda_stream)
            compute.wait_stream(comm)
            tables = self.blocks if self.kind != "all_to_all" or call.recv_splits is not None \
                else self._unpack_tables(exchange)
            out = call.out
            for start, rects, offs in tables:
                runtime.unpack_tiles(exchange.staging.data_ptr(), out.data_ptr() + start,
                                     out.stride(0), rects.data_ptr(), offs.data_ptr(),
                                     rects.shape[0], out.element_size(), compute.cuda_stream)
            if self.rows and self.kind == "all_to_all" and call.group is not None:
                exchange.finish()  # each source's received rows to their place (no tiles)
            stamp("end", compute)
            if first:
                torch.cuda.synchronize(device)
