"""The decomposition strategy: per wave group, sub-GEMMs, then the group's collective.

It is the baseline every signaling backend is measured against, and the fallback wherever no
signaling kernel exists; it runs on any torch device. Per group g, in group order:

1. compute stream: the group's tiles with the device's own matmul, stored in the packed layout
   (a "rows" plan: one matmul per destination part, straight into its rows; "tiles": one
   matmul per rectangle of alike tiles, then one strided copy into their packed slots);
2. compute stream: ``signal(g)``, an event recorded after those stores;
3. communication stream: ``wait(g)`` (the device-side wait), then the group's collective
   through :class:`~flashoverlap_core.collectives.RegionExchange`;

then the compute stream waits for the communication stream and the packed result is put back
in row-major order (nothing to do for the default whole-row tiles of an allreduce, whose groups
are written straight into the output). Device-specific backends reuse the stream plumbing (:class:`DeviceStreams`)
and may replace the events with their own group signals (see :meth:`signals`).

``allgather`` runs the other way round (:meth:`DecompositionBackend.run_gather`): every
chunk's all-gather is queued on the communication stream first; the compute stream multiplies
this rank's own rows meanwhile, then waits for each chunk in turn and multiplies it, writing
straight into the output.

The host has no streams: :class:`HostStreams` runs the same code with no-op stream operations,
and the overlap comes from the collectives being asynchronous.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import lru_cache

import torch

from .backend import Backend, OverlapCall, OverlapSpec
from .collectives import RegionExchange
from .gather import GatherExchange
from .plan import GATHER_OP, Plan

DEFAULT_BAND_ROWS = 128
# Sub-GEMMs with at most this many outputs get an fp32 result (see fp32_output). Larger ones
# are taken to fill the device without splitting K (a heuristic), and an fp32 result costs more
# than it is worth there (with out_dtype for every sub-GEMM, `flashoverlap bench` calls of
# 4096-8192 x 8192 x 3584-8192 took 1.3-2.9x longer on an H200, torch 2.11).
WIDE_MAX_OUTPUT = 1 << 22


class HostStreams:
    """The stream interface of the strategy, as a device without streams runs it: no-ops.

    ``compute`` is the caller's stream (GEMM, post-reorder), ``comm`` the communication
    stream; ``record()`` marks the compute stream's progress, ``wait_event`` makes the
    communication stream wait for a mark, ``communicating()`` makes the communication stream
    current, ``join()`` makes the compute stream wait for all communication launched so far.
    """

    compute = None
    comm = None

    def record(self):
        return None

    def wait_event(self, event) -> None:
        pass

    def communicating(self):
        return contextlib.nullcontext()

    def join(self) -> None:
        pass


class DeviceStreams(HostStreams):
    """The caller's current stream and a communication stream of one device, through the
    device's torch module (``torch.get_device_module``)."""

    def __init__(self, device: torch.device):
        self.module = torch.get_device_module(device.type)
        index = device.index if device.index is not None else self.module.current_device()
        self.compute = self.module.current_stream(index)
        self.comm = communication_stream(device.type, index)

    def record(self):
        event = self.module.Event()
        event.record(self.compute)
        return event

    def wait_event(self, event) -> None:
        self.comm.wait_event(event)

    def communicating(self):
        return self.module.stream(self.comm)

    def join(self) -> None:
        self.compute.wait_stream(self.comm)


@lru_cache(maxsize=None)
def communication_stream(device_type: str, index: int):
    """One high-priority communication stream per device, made once: the collectives it
    releases should get the device ahead of queued GEMM work."""
    module = torch.get_device_module(device_type)
    return module.Stream(device=torch.device(device_type, index), priority=-1)


def streams_for(device: torch.device) -> HostStreams:
    return HostStreams() if device.type == "cpu" else DeviceStreams(device)


class EventSignals:
    """Group signals as events: ``signal(g)`` on the compute stream after group g's stores,
    ``wait(g)`` holds the communication stream until then."""

    def __init__(self, streams: HostStreams):
        self.streams = streams
        self.events: dict[int, object] = {}

    def signal(self, g: int) -> None:
        self.events[g] = self.streams.record()

    def wait(self, g: int) -> None:
        self.streams.wait_event(self.events.pop(g))


@dataclass(frozen=True)
class PackedRect:
    """Alike tiles covering rows [row0, +bands*tile_rows) x columns [col0, +cols*tile_cols) of
    c, computed by one matmul. Tile (i, j) (band i, column tile j) sits at packed element
    ``offset + i*band_stride + j*col_stride``, row-major at its size."""

    row0: int
    col0: int
    bands: int
    cols: int
    tile_rows: int
    tile_cols: int
    offset: int
    band_stride: int
    col_stride: int

    @property
    def rows(self) -> tuple[int, int]:
        return self.row0, self.row0 + self.bands * self.tile_rows

    @property
    def columns(self) -> tuple[int, int]:
        return self.col0, self.col0 + self.cols * self.tile_cols

    @property
    def row_major(self) -> bool:
        """Whether the packed slots are the matmul's own [rows, columns] output layout."""
        numel = self.tile_rows * self.tile_cols
        return self.cols == 1 and (self.bands == 1 or self.band_stride == numel)


def _rectangles(tiles) -> list[PackedRect]:
    """Cover ``tiles`` ((tile, offset) pairs, in packed order) with rectangles of alike tiles
    whose packed offsets are affine in (band, column tile): greedily, widest first."""
    at = {(t.row0, t.col0): (t, off) for t, off in tiles}
    taken: set = set()

    def tile_at(row0, col0, like):
        found = at.get((row0, col0))
        if found is None or (row0, col0) in taken:
            return None
        t, off = found
        return off if (t.rows, t.cols) == (like.rows, like.cols) else None

    out = []
    for t, off in tiles:
        if (t.row0, t.col0) in taken:
            continue
        cols, col_stride = 1, t.numel
        nxt = tile_at(t.row0, t.col0 + t.cols, t)
        if nxt is not None and nxt > off:
            col_stride = nxt - off
            while tile_at(t.row0, t.col0 + cols * t.cols, t) == off + cols * col_stride:
                cols += 1
        bands, band_stride = 1, t.numel * cols
        below = tile_at(t.row0 + t.rows, t.col0, t)
        if below is not None and below > off:
            band_stride = below - off

            def band_fits(i):
                return all(tile_at(t.row0 + i * t.rows, t.col0 + j * t.cols, t)
                           == off + i * band_stride + j * col_stride for j in range(cols))

            while band_fits(bands):
                bands += 1
        taken.update((t.row0 + i * t.rows, t.col0 + j * t.cols)
                     for i in range(bands) for j in range(cols))
        out.append(PackedRect(t.row0, t.col0, bands, cols, t.rows, t.cols, off,
                              band_stride, col_stride))
    return out


@lru_cache(maxsize=64)
def packed_rects(plan: Plan) -> tuple[tuple[PackedRect, ...], ...]:
    """Each group's tiles as rectangles, one matmul each."""
    per_group: list[list] = [[] for _ in range(plan.num_groups)]
    for tile, g, offset in plan.packed_tiles:
        per_group[g].append((tile, offset))
    return tuple(tuple(_rectangles(tiles)) for tiles in per_group)


@lru_cache(maxsize=None)
def fp32_output(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.mm`` on ``device`` returns fp32 from ``dtype`` inputs (``out_dtype``).

    Then small sub-GEMMs accumulate in fp32 and round once, as the design asks: a device's
    own half-precision GEMM may split K when the output is too small to fill the device and
    add the partial sums in half precision (on an H200, [16, 129] @ [129, 257] in bf16 came out
    4 ulps off). Where ``out_dtype`` is missing (the host, whose half-precision GEMMs
    accumulate in fp32) the plain matmul is used.
    """
    if dtype not in (torch.float16, torch.bfloat16):
        return False
    one = torch.ones(1, 1, dtype=dtype, device=device)
    try:
        torch.mm(one, one, out_dtype=torch.float32)
    except (RuntimeError, TypeError):  # NotImplementedError is a RuntimeError
        return False
    return True


def _wide(x: torch.Tensor, outputs: int) -> bool:
    """Whether a sub-GEMM of ``outputs`` elements from ``x`` gets an fp32 result."""
    return outputs <= WIDE_MAX_OUTPUT and fp32_output(x.device, x.dtype)


def product_into(x: torch.Tensor, y: torch.Tensor, dest: torch.Tensor) -> None:
    """``dest`` (any view holding the [rows of x, N] result in row order) = x @ y."""
    if _wide(x, dest.numel()):
        dest.copy_(torch.mm(x, y, out_dtype=torch.float32).view(dest.shape))
    elif dest.is_contiguous():
        torch.matmul(x, y, out=dest.view(x.shape[0], y.shape[1]))
    else:
        dest.copy_((x @ y).view(dest.shape))


def compute_rect(a: torch.Tensor, b: torch.Tensor, packed: torch.Tensor, r: PackedRect) -> None:
    """Store the tiles of ``r`` of a @ b in their packed slots."""
    (r0, r1), (c0, c1) = r.rows, r.columns
    a_rows, b_cols = a[r0:r1], b[:, c0:c1]
    if r.row_major:
        product_into(a_rows, b_cols, packed[r.offset:r.offset + (r1 - r0) * (c1 - c0)])
        return
    wide = _wide(a, (r1 - r0) * (c1 - c0))
    value = torch.mm(a_rows, b_cols, out_dtype=torch.float32) if wide else a_rows @ b_cols
    slots = packed.as_strided((r.bands, r.cols, r.tile_rows, r.tile_cols),
                              (r.band_stride, r.col_stride, r.tile_cols, 1),
                              packed.storage_offset() + r.offset)
    slots.copy_(value.view(r.bands, r.tile_rows, r.cols, r.tile_cols).transpose(1, 2))


def compute_group(a: torch.Tensor, b: torch.Tensor, packed: torch.Tensor, plan: Plan, g: int) -> None:
    """Group g's tiles of a @ b in their packed slots: a "rows" plan's parts are whole rows of
    c (one matmul each), a "tiles" plan's are rectangles of alike tiles."""
    if plan.layout == "rows":
        for row0, row1, offset in plan.slabs[g]:
            product_into(a[row0:row1], b, packed[offset:offset + (row1 - row0) * plan.n])
        return
    for r in packed_rects(plan)[g]:
        compute_rect(a, b, packed, r)


def rows_in_order(plan: Plan) -> bool:
    """Whether the packed buffer of ``plan`` is its row-major result, as the collective leaves
    it: an allreduce or custom op (one block, reduced or transferred in place) whose groups
    are whole rows ("rows" layout), or whose tiles span all N columns, whose schedule order is
    then the row order."""
    return plan.kind.in_place and (plan.layout == "rows" or plan.tile[1] >= plan.n)


class DecompositionBackend(Backend):
    """Per-group sub-GEMMs on the compute stream, collectives on a communication stream.

    Priority 10: above the reference (0), which computes tile by tile and exists to be
    read, not run fast; auto-selection already puts every device-specific backend (the
    signaling kernels) before any generic one, whatever its priority.
    """

    name = "decomposition"
    device_type = None
    priority = 10

    def default_tile(self, spec: OverlapSpec) -> tuple[int, int]:
        # Whole-row tiles: each group is a run of row bands, one matmul writing one contiguous
        # region; for allreduce and custom ops that region is the output's own rows.
        return (DEFAULT_BAND_ROWS, spec.n)

    def wave_size(self, spec: OverlapSpec, tile: tuple[int, int]) -> int:
        return 1  # sub-GEMMs finish one after the other

    def streams(self, device: torch.device) -> HostStreams:
        return streams_for(device)

    def signals(self, streams: HostStreams, call: OverlapCall):
        """How the compute stream tells the communication stream that a group is stored."""
        return EventSignals(streams)

    def run(self, call: OverlapCall) -> torch.Tensor:
        if call.plan.op == GATHER_OP:
            return self.run_gather(call)
        a, b, plan = call.a, call.b, call.plan
        streams = self.streams(a.device)
        in_place = rows_in_order(plan)
        if in_place:  # the packed layout is the output's: no post-reorder
            packed = call.out.view(-1)
        else:
            packed = torch.empty(plan.packed_numel, dtype=a.dtype, device=a.device)
        exchange = RegionExchange(call, packed)
        signals = self.signals(streams, call)
        for g in range(plan.num_groups):
            compute_group(a, b, packed, plan, g)
            signals.signal(g)
            with streams.communicating():
                signals.wait(g)
                exchange.start(g)
        with streams.communicating():
            exchange.wait()
        streams.join()
        return call.out if in_place else exchange.finish()

    def run_gather(self, call: OverlapCall) -> torch.Tensor:
        """allgather: every chunk's all-gather queued on the communication stream; on the
        compute stream, this rank's own rows (one matmul), then per chunk a wait for it and
        one matmul per run of other ranks' shards in it, stored straight into the output."""
        b, plan, out, rank, w = call.b, call.plan, call.out, call.rank, call.world_size
        streams = self.streams(call.a.device)
        exchange = GatherExchange(call)
        ready = streams.record()  # a's rows are ready on the compute stream
        with streams.communicating():
            streams.wait_event(ready)
            for g in range(plan.num_groups):
                exchange.start(g)
        m = plan.shard_rows
        product_into(exchange.local, b, out[rank * m:(rank + 1) * m])
        shards = out.view(w, m, -1)
        for g in range(plan.num_groups):
            exchange.wait(g)
            start, end = plan.chunk_rows(g)
            for lo, hi in ((0, rank), (rank + 1, w)):
                if lo < hi:
                    product_into(exchange.chunk(g)[lo:hi].flatten(0, 1), b, shards[lo:hi, start:end])
        return out


class AcceleratorDecomposition(DecompositionBackend):
    """The decomposition strategy with this machine's accelerator (``torch.accelerator``) as
    its device type.

    The generic backend runs wherever the tensors are, so the conformance suite and
    ``flashoverlap bench``, which put a generic backend's tensors on the host, test it there;
    this one makes them test it on device tensors, e.g.
    ``--fo-backend flashoverlap_core.decomposition:AcceleratorDecomposition``. It keeps the
    name ``decomposition``: it is that backend, and spawned ranks that only know the name run
    the same code.
    """

    priority = 0  # never chosen automatically: the generic backend covers the same calls

    def __init__(self):
        found = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        self.device_type = found.type if found is not None else "accelerator"

    def probe(self) -> str | None:
        if not torch.accelerator.is_available():
            return "no accelerator is visible (torch.accelerator.is_available() is False)"
        return None

    def device_count(self) -> int:
        return torch.accelerator.device_count()
