"""allgather on the ``cuda`` backend: the gather feeds a GEMM whose tiles wait for their rows.

``fo.overlap(a, b, op="allgather", group)``: rank r's ``a`` is [m, K]; the result is
``cat(a_0 .. a_{W-1}) @ b``, [W·m, N]. The call (native, ``csrc/cuda/gather_call.cuh``):

* the rows are gathered into a row-major buffer ``gathered`` [W·m, ldg] in rank order, so a row
  of ``gathered`` is the same row of ``out`` (not the plan's chunk-major packed layout): this
  rank's rows are copied in from ``a`` on the compute stream before the GEMM (the whole device
  copies them: on the communication stream beside the waiting GEMM such a copy gets only the
  SMs it leaves free, 2-3x the GEMM's time on the H200); per chunk g of the plan (rows
  ``plan.chunk_rows(g)`` of every shard) every peer's rows arrive by NCCL send/receive, each
  (shard, chunk) setting its own flag on the device once its rows have landed;
* the GEMM (``fo_gemm_run_ex``) reads ``gathered`` and writes the tiles in place into ``out``;
  its item table runs this rank's own tiles first (``plan.local_tiles(rank)``, nothing to wait
  for), then each chunk's other tiles (``plan.arriving_tiles(rank, g)``), each waiting for the
  flag of its (shard, chunk) before loading its rows;
* the flags are zeroed on the compute stream after the GEMM and the gather: no host sync, graph
  replays and back-to-back calls start from zero.

At world size 1 the op is the plain GEMM on ``a`` (no copy, no flags), written in place.

fp8 (e4m3 a and b, sm90; issue 32): ``run_scaled`` with this rank's scales. The rows move as
their e4m3 bytes (``gathered`` holds e4m3, its rows 16-byte aligned, NCCL moves bytes), never
dequantized; rank r's rows take rank r's ``scale_a``, so the scales travel with them: each call
copies this rank's ``scale_a`` into its rows of ``gathered_scales`` (float32, a row per gathered
row: [W·m, 1], or block-wise [W·m, ceil(K/128)]; a 0-dim ``scale_a`` is repeated on each own row,
so a tensor-wise call runs as a row-wise one whose rows take their rank's scale, and every kind
of call moves alike) and gathers the peers' in one NCCL group before the chunks, which the GEMM
waits for (gather_call.cu says why it cannot wait for the flags instead). The GEMM is an e4m3
build for allgather (``fo_gemm_run_ex_scaled``: ``fo_gemm_run_ex`` with scales) that scales each
row by its row of ``gathered_scales`` and each column by ``scale_b`` (the same on every rank:
the weight's), and writes ``out_dtype``. At world size 1 the plain GEMM runs on ``a`` with the
scales as they are.

Deadlock freedom rests on the GEMM leaving SMs to the transfer (gather_call.cuh says why): its
grid is capped at SMs - ``reserve`` CTAs (:func:`gather_grid`), ``reserve`` = max(the backend's
reserved SMs, :data:`MIN_FREE_SMS`, at W > 1 the NCCL CTA bound), and the NCCL communicator of
this op is made with at most that many CTAs (``FLASHOVERLAP_CUDA_GATHER_NCCL_CTAS``, else the
reserve: :func:`gather_nccl_ctas`). Copy engines (peer ``cudaMemcpyAsync``) would need
no SM at all; they were not built because W > 1 cannot be measured here (csrc/cuda/NOTES.md).

Test knobs (environment, read when a key is prepared): ``FLASHOVERLAP_CUDA_GATHER_LOOPBACK=1``
sends a world-size-1 call through the gathered buffer and its flags: the own rows are copied
chunk by chunk on the communication stream, each chunk setting its flag, so tiles really wait;
``=2`` takes the path of the other world sizes for the own rows (one copy on the compute
stream, the GEMM on the gathered buffer; nothing waits at world size 1), to measure it.
``FLASHOVERLAP_CUDA_GATHER_DELAY_US=N`` (with ``=1``) spins N µs on the communication stream
before each chunk's copy; ``FLASHOVERLAP_CUDA_GATHER_NO_WAIT=1`` (negative control) hands the
GEMM flags that read as already set, so it does not wait and a stress test must see wrong rows.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from flashoverlap_core import fp8
from flashoverlap_core.backend import OverlapCall, PreparedCall

from . import kernels, nccl
from .call_base import CallState, NativeCall, WarmUps, new_description
from .device_state import (ALIGN_BYTES, NCCL_DTYPES, SCALE_BLOCKS, PlanTables, _current_device,
                           gemm_scales, kernel_scale, reserved_sms, scale_modes)
from .gemm import Gemms, a_operand, b_operand, into_aligned, padded_k, stock_aligned, workspace

ENV_LOOPBACK = "FLASHOVERLAP_CUDA_GATHER_LOOPBACK"
ENV_DELAY = "FLASHOVERLAP_CUDA_GATHER_DELAY_US"
ENV_NO_WAIT = "FLASHOVERLAP_CUDA_GATHER_NO_WAIT"
ENV_NCCL_CTAS = "FLASHOVERLAP_CUDA_GATHER_NCCL_CTAS"
LOOPBACK_OFF, LOOPBACK_CHUNKS, LOOPBACK_OWN_COPY = 0, 1, 2
MIN_FREE_SMS = 2  # SMs a waiting GEMM never takes, whatever FLASHOVERLAP_CUDA_RESERVED_SMS says


def _env_int(name: str, default: int, minimum: int) -> int:
    value = os.environ.get(name, "")
    if value == "":
        return default
    if not value.isdigit() or int(value) < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class GatherOptions:
    """How an allgather call runs: the NCCL CTA bound, and the test knobs (module doc)."""

    nccl_ctas: int | None = None  # None: the SMs the GEMM leaves free (reserved_sms)
    loopback: int = 0  # LOOPBACK_OFF, LOOPBACK_CHUNKS or LOOPBACK_OWN_COPY
    delay_us: int = 0
    no_wait: bool = False

    @classmethod
    def from_env(cls) -> "GatherOptions":
        loopback = _env_int(ENV_LOOPBACK, LOOPBACK_OFF, 0)
        if loopback not in (LOOPBACK_OFF, LOOPBACK_CHUNKS, LOOPBACK_OWN_COPY):
            raise ValueError(f"{ENV_LOOPBACK} must be 0, 1 or 2, got {loopback}")
        ctas = _env_int(ENV_NCCL_CTAS, 0, 1) or None
        return cls(nccl_ctas=ctas, loopback=loopback,
                   delay_us=_env_int(ENV_DELAY, 0, 0), no_wait=_env_int(ENV_NO_WAIT, 0, 0) != 0)

    def own_chunks(self, world_size: int) -> bool:
        """Whether the own rows are copied chunk by chunk on the communication stream, each
        setting its flag (the loopback test), rather than at once on the compute stream."""
        return world_size == 1 and self.loopback == LOOPBACK_CHUNKS

    def gathers(self, world_size: int) -> bool:
        """Whether the call goes through the gathered buffer (else the plain GEMM on a)."""
        return world_size > 1 or self.loopback != LOOPBACK_OFF


# ---- tables (pure: tested on the CPU) ---------------------------------------------------------

def execution_tiles(plan, rank: int, waits: bool = True) -> list:
    """The tiles in the GEMM's order on ``rank``: its own shard's first, then each chunk's
    others, each group's in the plan's execution order; without waits (world size 1, nothing
    gathered) the plan's execution order itself."""
    if not waits:
        return list(plan.grid.execution_order)
    order = list(plan.local_tiles(rank))
    for g in range(plan.num_groups):
        order += plan.arriving_tiles(rank, g)
    return order


def flag_index(plan, shard: int, g: int) -> int:
    """The flag that says chunk g of ``shard``'s rows has arrived."""
    return shard * plan.num_groups + g


def gather_items(plan, rank: int, waits: bool, own_waits: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The GEMM's item table for ``rank`` (int64 [T, 4]: block, band within the block, column
    tile, element offset of the tile in the row-major out) and each item's flag (int32 [T]):
    -1 (none) for the own shard's tiles unless ``own_waits`` (the loopback test), and
    everywhere without ``waits``."""
    (bm, bn), starts = plan.tile, plan.grid.block_starts
    rows, wait = [], []
    for t in execution_tiles(plan, rank, waits):
        band = (t.row0 - starts[t.block]) // bm
        rows.append((t.block, band, t.col0 // bn, t.row0 * plan.n + t.col0))
        flagged = waits and (t.block != rank or own_waits)
        wait.append(flag_index(plan, t.block, plan.group_of_band[band]) if flagged else -1)
    return (torch.tensor(rows, dtype=torch.int64).view(-1, 4),
            torch.tensor(wait, dtype=torch.int32))


def chunk_table(plan) -> list[int]:
    """[start, end) of every chunk within a shard, flattened (fo_gather_desc.chunk_rows)."""
    return [row for g in range(plan.num_groups) for row in plan.chunk_rows(g)]


def gather_reserve(world_size: int, options: GatherOptions) -> int:
    """SMs the waiting GEMM leaves free (0 when nothing waits)."""
    if world_size > 1:
        return max(reserved_sms(world_size), MIN_FREE_SMS, options.nccl_ctas or 0)
    return max(reserved_sms(world_size), MIN_FREE_SMS) if options.own_chunks(world_size) else 0


def gather_nccl_ctas(world_size: int, options: GatherOptions) -> int:
    """The CTA bound of the allgather's communicator: the option, else the GEMM's reserve."""
    return options.nccl_ctas or max(reserved_sms(world_size), MIN_FREE_SMS)


def gather_grid(wave_size: int, sms: int, max_ctas: int, reserve: int, multiple: int) -> int:
    """The GEMM's grid: the plan's wave size, capped at ``sms - reserve`` CTAs (so that at least
    ``reserve`` SMs hold none of them) and at what is resident at once, in whole clusters."""
    cap = min(wave_size, max_ctas, sms - reserve if reserve else wave_size)
    grid = cap // multiple * multiple
    if grid < multiple:
        raise ValueError(f"the allgather GEMM needs {reserve} of {sms} SMs left free and CTAs in "
                         f"multiples of {multiple}: no grid fits (wave size {wave_size}); lower "
                         "FLASHOVERLAP_CUDA_RESERVED_SMS or FLASHOVERLAP_CUDA_GATHER_NCCL_CTAS")
    return grid


def round_up(x: int, step: int) -> int:
    return -(-x // step) * step


def row_align(dtype: torch.dtype) -> int:
    """Elements per 16 bytes: gathered's row stride is a multiple of it, as the kernels' TMA
    and 16-byte loads want it (8 for 16-bit rows, 16 for e4m3)."""
    return ALIGN_BYTES // dtype.itemsize


def scale_groups(k: int, blockwise: bool) -> int:
    """Columns of gathered_scales: 1 (a scale per row), block-wise ceil(K/128)."""
    return fp8.blocks(k) if blockwise else 1


def scale_strides(scale_a: torch.Tensor, scale_b: torch.Tensor, blockwise: bool) -> tuple:
    """(a0, a1, b0, b1): the element strides through which the native call reads this rank's
    scale_a (a 0-dim one (0, 0): repeated on every row) and, block-wise, scale_b (else (0, 0):
    the GEMM reads a row-wise scale_b as consecutive floats, kernel_scale)."""
    a = tuple(scale_a.stride()) if scale_a.dim() == 2 else (0, 0)
    return a + (tuple(scale_b.stride()) if blockwise else (0, 0))


# ---- the prepared call -------------------------------------------------------------------------

class GatherState(CallState):
    """The state of one compute stream (:class:`CallState`): the gathered rows, the arrival
    flags, and (fp8) every gathered row's scale_a."""

    def __init__(self, call: "CudaGatherCall"):
        plan, device = call.template.plan, call.device
        super().__init__(device, call.runtime)
        # zeros: sm80 reads K padded to 8, whose padding must stay zero (copies write K columns)
        self.gathered = torch.zeros(plan.m, call.ldg, dtype=plan.torch_dtype, device=device)
        flags = plan.world_size * plan.num_groups
        self.flags = torch.zeros(flags, dtype=torch.int32, device=device)
        self.wait_flags = torch.ones_like(self.flags) if call.options.no_wait else self.flags
        # fp8: [W·m, G] row-major, written whole by every call (its own rows, then the peers')
        self.scales = (torch.empty(plan.m, call.scale_groups, dtype=torch.float32, device=device)
                       if call.scaled else None)
        self.keep_for_comm((self.gathered, self.flags, self.wait_flags, self.scales))
        self.handle = self.runtime.gather_create(call.description(self))

    def destroy(self) -> None:
        self.runtime.gather_destroy(self.handle)


class CudaGatherCall(NativeCall, PreparedCall):
    """The prepared allgather calls of one key on the cuda backend (module doc):
    ``run(a, b, out, op)``; an fp8 key's ``run_scaled(a, b, scale_a, scale_b, out, op)``."""

    def __init__(self, backend, call: OverlapCall, gemms: Gemms, warm_ups: WarmUps,
                 options: GatherOptions | None = None, stream: int | None = None):
        PreparedCall.__init__(self, backend, call)
        NativeCall.__init__(self, call.a.device, warm_ups)
        plan, device = call.plan, call.a.device
        self.options = options if options is not None else GatherOptions.from_env()
        self.world, self.rank = call.world_size, call.rank
        self.gathers = self.options.gathers(self.world)
        self.own_chunks = self.options.own_chunks(self.world)
        if self.world > 1 and not nccl.uses_nccl(call.group):
            raise ValueError("the cuda backend gathers allgather's rows with NCCL; this process "
                             "group does not use NCCL (use backend='decomposition')")
        items, self.item_wait_host = gather_items(plan, self.rank, self.gathers, self.own_chunks)
        self.tables = PlanTables(items, items.to(device),
                                 torch.zeros(items.shape[0], dtype=torch.int32, device=device),
                                 counters=None)
        self.item_wait = self.item_wait_host.to(device)
        # fp8: the e4m3 build for allgather (fo_gemm_run_ex_scaled); the scales' modes are the
        # key's (their kind), their pointers each call's own
        self.scaled = call.scale_a is not None
        self.blockwise = plan.scaling == "blockwise"
        self.gemm, self.col, self.arch = gemms.gemm_for(plan, self.tables, call.b, gather=True)
        # CUTLASS's kernel (gemm_sm90_stock_ex_scaled.cu, where kernels.stock_fits): its TMA map
        # of the result needs a 16-byte aligned base (_run realigns one that is not)
        self.stock = kernels.is_stock(self.gemm)
        if self.scaled and not self.gemm.run_ex_scaled_address:
            raise RuntimeError(f"{self.gemm.path} has no fo_gemm_run_ex_scaled (fp8 allgather's "
                               "GEMM): rebuild it (flashoverlap build)")
        self.scale_groups = scale_groups(plan.k, self.blockwise)
        # scale_b's mode (fo_gemm_scales); the gathered scale_a is per row (or block-wise)
        self.scale_b_mode = (scale_modes(call.scale_a, call.scale_b, self.blockwise)[1]
                             if self.scaled else 0)
        self.k = padded_k(self.arch, plan.k)
        self.row_align = row_align(plan.torch_dtype)
        self.ldg = round_up(plan.k, self.row_align)
        self.workspace = workspace(self.gemm, plan, self.k, device)
        self.runtime = kernels.runtime_library()
        self.ctas = plan.wave_size
        if not self.gathers:
            return
        reserve = gather_reserve(self.world, self.options)
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.ctas = gather_grid(plan.wave_size, sms, self.gemm.max_ctas(self.index), reserve,
                                self.gemm.description.cta_multiple)
        self.runtime.gather_load_kernels()
        self.comm = (nccl.communicator(call.group, device,
                                       max_ctas=gather_nccl_ctas(self.world, self.options))
                     if self.world > 1 else None)
        self.chunks = chunk_table(plan)
        self.warm_key = (self.gemm.path, call.group, "allgather", plan.dtype, self.options)
        with torch.cuda.device(device):
            first = self.current_stream(self.index) if stream is None else stream
            self._states[first] = GatherState(self)

    def description(self, state: GatherState):
        """The runtime's GatherDescription of this key's calls on ``state``'s stream."""
        plan, d = self.template.plan, new_description(self.runtime.GatherDescription)
        d.gemm_run_ex = self.gemm.run_ex_address
        if self.scaled:  # fp8 (gather_call.cu): the scaled GEMM, the gathered scale_a's rows
            d.gemm_run_ex_scaled, d.scaled = self.gemm.run_ex_scaled_address, 1
            d.scale_a_per_row = SCALE_BLOCKS if self.blockwise else 1
            d.scale_b_per_col = self.scale_b_mode
            d.gathered_scales = state.scales.data_ptr()
        d.world, d.rank, d.block_rows = self.world, self.rank, plan.shard_rows
        d.N, d.K, d.copy_cols = plan.n, self.k, plan.k
        d.items, d.item_group = self.tables.items.data_ptr(), self.tables.item_group.data_ptr()
        d.item_wait, d.num_items, d.num_ctas = self.item_wait.data_ptr(), plan.num_tiles, self.ctas
        d.workspace = self.workspace.data_ptr() if self.workspace is not None else None
        d.gathered, d.ldg = state.gathered.data_ptr(), self.ldg
        d.arrive_flags, d.wait_flags = state.flags.data_ptr(), state.wait_flags.data_ptr()
        d.num_chunks, d.chunk_rows = plan.num_groups, self.chunks
        d.elem_size = state.gathered.element_size()  # fp8: 1, moved as bytes (NCCL_DTYPES)
        d.nccl_comm, d.nccl_dtype = self.comm, NCCL_DTYPES[plan.dtype]
        d.own_chunks = int(self.own_chunks)
        d.delay_us = self.options.delay_us if self.own_chunks else 0
        d.comm_stream = state.comm.cuda_stream
        return d

    def new_state(self) -> GatherState:
        return GatherState(self)

    # ---- operands ----------------------------------------------------------------------------
    def b_operand(self, b: torch.Tensor):
        """(b's address, its row stride, the operand to keep alive) as the kernel takes b
        (:func:`.gemm.b_operand`)."""
        rows = b_operand(b, self.col, self.k)
        return rows.data_ptr(), rows.stride(0), rows

    @staticmethod
    def a_rows(a: torch.Tensor) -> torch.Tensor:
        """a with unit column stride and a row stride >= K (what a 2-D device copy reads)."""
        if a.stride(1) == 1 and (a.shape[0] == 1 or a.stride(0) >= a.shape[1]):
            return a
        return a.contiguous()

    # ---- the call ----------------------------------------------------------------------------
    def run(self, a, b, out, op):
        return self._run(a, b, out, None)

    def run_scaled(self, a, b, scale_a, scale_b, out, op):
        """An fp8 call (checked by the caller): ``run`` with this call's scales, this rank's
        ``scale_a`` (its rows': the native call gathers it with them) and ``scale_b``."""
        return self._run(a, b, out, (scale_a, scale_b))

    def _run(self, a, b, out, scales):
        if _current_device() != self.index:
            with torch.cuda.device(self.device):
                return self._run(a, b, out, scales)
        if self.stock and not stock_aligned(out, None, False):
            return into_aligned(out, lambda target: self._run(a, b, target, scales))
        stream = self.current_stream(self.index)
        if not self.gathers:
            return self.run_plain(a, b, out, stream, scales)
        state = self._states.get(stream) or self.state(stream)
        warm = self.needs_warm_up()
        a_rows = self.a_rows(a)
        lda = a_rows.stride(0) if a_rows.shape[0] > 1 else a_rows.shape[1]
        b_ptr, ldb, _keep = self.b_operand(b)
        if scales is None:
            err = self.runtime.gather_run(state.handle, a_rows.data_ptr(), lda, b_ptr, ldb,
                                          out.data_ptr(), out.stride(0), stream, int(warm))
            what = "fo_gather_run"
        else:
            # scale_a is read through its strides (the own scales' copy, gather_call.cu);
            # scale_b as the GEMM reads it (a copy, if one, is queued before the call, and the
            # caching allocator orders its reuse after it)
            scale_a, scale_b = scales[0], kernel_scale(scales[1], self.blockwise)
            err = self.runtime.gather_run_scaled(
                state.handle, a_rows.data_ptr(), lda, b_ptr, ldb, scale_a.data_ptr(),
                scale_b.data_ptr(), scale_strides(scale_a, scale_b, self.blockwise),
                out.data_ptr(), out.stride(0), stream, int(warm))
            what = "fo_gather_run_scaled"
        if err:
            self.raise_error(err, what)
        return out

    def run_plain(self, a, b, out, stream: int, scales=None):
        """World size 1: the GEMM on a, written in place, nothing to wait for (fp8: with the
        scales as they are)."""
        plan = self.template.plan
        a_op = a_operand(a, self.k)
        # One row: its stride means nothing (a [1, K] view may have any); the kernel wants one
        # >= K and a multiple of 16 bytes, and reads no second row.
        lda = a_op.stride(0)
        if a_op.shape[0] == 1 and lda < self.k:
            lda = round_up(self.k, self.row_align)
        b_ptr, ldb, _keep = self.b_operand(b)
        args = (out.data_ptr(), 1, plan.m, plan.n, self.k, lda, ldb, out.stride(0),
                self.tables.items.data_ptr(), self.tables.item_group.data_ptr(), None, None, 0,
                plan.num_tiles, None, self.ctas, None,
                self.workspace.data_ptr() if self.workspace is not None else None, stream)
        if scales is None:
            self.gemm.run_ex(a_op.data_ptr(), b_ptr, *args)
        else:
            scale_a, scale_b = (kernel_scale(t, self.blockwise) for t in scales)
            self.gemm.run_ex_scaled(a_op.data_ptr(), b_ptr,
                                    gemm_scales(scale_a, scale_b, self.blockwise), *args)
        return out
