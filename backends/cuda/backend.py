"""The ``cuda`` backend: CUTLASS signaling GEMM, device-side waits, NCCL via torch.distributed.

One call, on the caller's (compute) stream and a high-priority communication stream:

1. the signaling GEMM is launched on the compute stream; it writes each finished tile to its
   packed slot and bumps its group's counter;
2. on the communication stream, per group: a device-side wait until the counter reaches the
   group's tile count, then the group's collective on its contiguous region (launched through
   torch.distributed, which orders it after the wait);
3. the communication stream resets the counters (so back-to-back calls and graph replays need
   no host sync), the compute stream waits for all communication, and the post-reorder kernel
   writes the row-major result.

The first call of a plan on a process group runs its phases one after the other with host
syncs, so every kernel it uses (GEMM, waiter, the collective's, reorder, torch's own) is loaded
before any call overlaps: under CUDA's lazy loading a kernel's first launch waits for an idle
device, which would serialise or deadlock an overlapped call (GPU-FACTS.md).
"""
from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from flashoverlap_core.backend import Backend, OverlapCall, OverlapSpec
from flashoverlap_core.collectives import RegionExchange
from flashoverlap_core.tiles import Schedule

from . import kernels

log = logging.getLogger("flashoverlap")

ENV_RESERVED_SMS = "FLASHOVERLAP_CUDA_RESERVED_SMS"
ENV_WAIT = "FLASHOVERLAP_CUDA_WAIT"
ENV_ARCH = "FLASHOVERLAP_CUDA_ARCH"
DEFAULT_RESERVED_SMS = 4  # 128 CTAs: measured faster than 132 for the cluster-2 kernels (csrc/cuda/NOTES.md)
DEFAULT_WAIT = "stream_wait_value"
ALIGN_BYTES = 16  # TMA: global strides and base addresses 16-byte aligned


def reserved_sms() -> int:
    value = os.environ.get(ENV_RESERVED_SMS, str(DEFAULT_RESERVED_SMS))
    if not value.isdigit():
        raise ValueError(f"{ENV_RESERVED_SMS} must be a non-negative int, got {value!r}")
    return int(value)


def wait_mode() -> str:
    mode = os.environ.get(ENV_WAIT, DEFAULT_WAIT)
    if mode not in kernels.WAIT_MODES:
        raise ValueError(f"{ENV_WAIT} must be one of {sorted(kernels.WAIT_MODES)}, got {mode!r}")
    return mode


def aligned_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (row-major rows) with a 16-byte aligned row stride and base; copies if needed."""
    step = ALIGN_BYTES // t.element_size()
    if t.stride(1) == 1 and t.stride(0) % step == 0 and t.data_ptr() % ALIGN_BYTES == 0:
        return t
    rows, cols = t.shape
    buf = torch.empty((rows, -(-cols // step) * step), dtype=t.dtype, device=t.device)
    buf[:, :cols].copy_(t)
    return buf[:, :cols]


@dataclass
class PlanState:
    """Device-resident tables of one plan on one device."""

    items_host: torch.Tensor
    items: torch.Tensor
    item_group: torch.Tensor
    counters: torch.Tensor
    group_sizes: list[int]
    unpack: dict = field(default_factory=dict)  # op kind -> [(out byte offset, tiles, offsets)]
    cluster_fits: dict = field(default_factory=dict)  # cluster shape -> bool


class CudaBackend(Backend):
    name = "cuda"
    device_type = "cuda"
    priority = 100

    MAX_PLANS = 64  # device tables kept for this many recent (plan, device) pairs

    def __init__(self):
        self._states: OrderedDict = OrderedDict()
        self._streams: dict = {}
        self._warmed: set = set()  # (device, group, op, dtype) that ran once with host syncs
        self._lock = threading.Lock()

    # ---- discovery ---------------------------------------------------------------------------
    def probe(self) -> str | None:
        if torch.version.cuda is None:
            return "this torch build has no CUDA support (torch.version.cuda is None)"
        if not torch.cuda.is_available():
            return "no CUDA device is visible (torch.cuda.is_available() is False)"
        return kernels.toolchain_problem()

    def device_count(self) -> int:
        return torch.cuda.device_count() if torch.version.cuda else 0

    def versions(self) -> dict[str, str]:
        out = {"cuda (torch)": str(torch.version.cuda)}
        if torch.version.cuda and hasattr(torch.cuda, "nccl"):
            try:
                out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
            except Exception as e:  # noqa: BLE001 - report, don't fail
                out["nccl"] = f"unknown ({e})"
        out.update(kernels.toolchain_versions())
        return out

    # ---- capabilities ------------------------------------------------------------------------
    def unsupported_reasons(self, spec: OverlapSpec) -> list[str]:
        reasons = []
        if spec.dtype not in kernels.DTYPES:
            reasons.append(f"the signaling GEMM takes {sorted(kernels.DTYPES)}, not {spec.dtype} "
                           "(use backend='decomposition' or 'reference')")
        if spec.op == "all_to_all" and spec.send_splits and len(set(spec.send_splits)) > 1:
            reasons.append("all_to_all with unequal send_splits needs a grouped GEMM, which this "
                           "backend does not have yet (use backend='decomposition')")
        if spec.device_type == "cuda" and torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            if major < 8:
                reasons.append(f"compute capability {major}.{minor} < 8.0 (needs Ampere or newer)")
        return reasons

    def _arch(self) -> int:
        """90 (sm_90a kernels) on Hopper, else 80; FLASHOVERLAP_CUDA_ARCH=80 forces the
        Ampere/Ada kernels (they run on Hopper too, which is how they are tested here)."""
        forced = os.environ.get(ENV_ARCH)
        if forced:
            if forced not in ("80", "90"):
                raise ValueError(f"{ENV_ARCH} must be 80 or 90, got {forced!r}")
            return int(forced)
        major, _ = torch.cuda.get_device_capability()
        return 90 if major == 9 else 80

    def prebuild(self, archs=None, jobs=None) -> list[str]:
        """Every kernel configuration a plan can pick, for ``archs`` (default 90 and 80)."""
        configs = kernels.all_configs(archs or sorted(kernels.CONFIGS, reverse=True))
        return [str(p) for p in kernels.build.prebuild(configs, jobs)]

    def default_tile(self, spec: OverlapSpec) -> tuple[int, int]:
        return kernels.default_tile(self._arch())

    def wave_size(self, spec: OverlapSpec, tile: tuple[int, int]) -> int:
        sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        multiple = kernels.CTA_MULTIPLE
        return max(multiple, (sms - reserved_sms()) // multiple * multiple)

    def schedule(self, spec: OverlapSpec) -> Schedule:
        # Chunks of 8 bands, column by column: a wave reads a few bands of A and sweeps B.
        return Schedule("n", 8)

    def plan_reasons(self, plan) -> list[str]:
        reasons = []
        tiles = kernels.supported_tiles(self._arch())
        if tuple(plan.tile) not in tiles:
            reasons.append(f"tile {plan.tile} has no CUDA kernel on sm_{self._arch()}; "
                           f"available: {sorted(tiles)}")
        if len(set(plan.block_rows)) > 1:
            reasons.append("destination blocks of unequal rows need a grouped GEMM")
        return reasons

    # ---- per-device state --------------------------------------------------------------------
    def _comm_stream(self, device: torch.device) -> torch.cuda.Stream:
        with self._lock:
            if device not in self._streams:
                low, high = torch.cuda.Stream.priority_range()
                self._streams[device] = torch.cuda.Stream(device=device, priority=high)
            return self._streams[device]

    def _state(self, plan, device) -> PlanState:
        key = (plan, device)
        with self._lock:
            state = self._states.get(key)
            if state is None:
                items, groups = plan.item_table()
                state = PlanState(items, items.to(device), groups.to(device),
                                  torch.zeros(plan.num_groups, dtype=torch.int32, device=device),
                                  list(plan.group_sizes))
                self._states[key] = state
                while len(self._states) > self.MAX_PLANS:
                    self._states.popitem(last=False)
            self._states.move_to_end(key)
            return state

    # ---- the pieces ---------------------------------------------------------------------------
    def launch_gemm(self, plan, a: torch.Tensor, b: torch.Tensor, packed: torch.Tensor, *,
                    signal: bool = True, monitor: torch.Tensor | None = None,
                    stream: torch.cuda.Stream | None = None) -> PlanState:
        """Launch the signaling GEMM of ``plan`` writing ``packed`` (no waits, no collective).

        ``signal=False`` runs the same kernel with no counters (for measuring what signaling
        costs); ``monitor`` (uint64 [T, 2]) records each tile's completion.
        """
        device = a.device
        arch = self._arch()
        # sm80 loads 8-element vectors along K, and along N for a row-major b: such a b with
        # N % 8 != 0 runs as the column-major kernel on a transposed copy.
        col = b_col_major(b) or (arch == 80 and b.shape[1] % 8 != 0)
        state = self._state(plan, device)
        cluster = kernels.preferred_cluster(arch, plan.tile)
        fits = state.cluster_fits.get(cluster)
        if fits is None:
            fits = state.cluster_fits[cluster] = kernels.cluster_fits(state.items_host, cluster)
        if not fits:
            cluster = (1, 1)
        gemm = kernels.gemm_library(kernels.gemm_config(arch, plan.tile, plan.dtype, col, cluster))
        a_op, b_op, k = self._operands(arch, a, b, col)
        blocks, rows = len(plan.block_rows), plan.block_rows[0]
        size = gemm.workspace_size(blocks, rows, plan.n, k, plan.wave_size)
        workspace = torch.empty(size, dtype=torch.uint8, device=device) if size else None
        stream = stream or torch.cuda.current_stream(device)
        gemm.run(a_op.data_ptr(), b_op.data_ptr(), packed.data_ptr(), blocks, rows, plan.n,
                 k, a_op.stride(0), b_op.stride(0), state.items.data_ptr(),
                 state.item_group.data_ptr(), plan.num_tiles,
                 state.counters.data_ptr() if signal else None, plan.wave_size,
                 monitor.data_ptr() if monitor is not None else None,
                 workspace.data_ptr() if workspace is not None else None, stream.cuda_stream)
        return state

    @staticmethod
    def _operands(arch: int, a: torch.Tensor, b: torch.Tensor, col: bool):
        """(a rows, b rows, K) as the kernel takes them: 16-byte aligned row strides; for sm80
        also K padded with zeros to a multiple of 8 (zeros add nothing to the products)."""
        b_rows = b.t() if col else b
        k = a.shape[1]
        if arch == 80 and k % 8:
            k = -(-k // 8) * 8
            a_pad = a.new_zeros(a.shape[0], k)
            a_pad[:, :a.shape[1]] = a
            if col:
                b_pad = b.new_zeros(b.shape[1], k)
                b_pad[:, :a.shape[1]] = b_rows
            else:
                b_pad = b.new_zeros(k, b.shape[1])
                b_pad[:a.shape[1]] = b_rows
            return a_pad, b_pad, k
        return aligned_rows(a), aligned_rows(b_rows), k

    # ---- the call ----------------------------------------------------------------------------
    def run(self, call: OverlapCall) -> torch.Tensor:
        self._run(call, call.options.get("monitor"), None)
        return call.out

    def _run(self, call: OverlapCall, monitor, stamps: dict | None) -> None:
        """One overlapped call. ``stamps`` (a dict, trace mode): CUDA events at the GEMM's
        launch and end, around each group's transfer (each transfer then ends on the
        communication stream before the next starts) and at the end of the call."""
        plan, a, device = call.plan, call.a, call.a.device

        def stamp(name, stream):
            if stamps is not None:
                event = torch.cuda.Event(enable_timing=True)
                event.record(stream)
                stamps.setdefault(name, []).append(event)

        with torch.cuda.device(device):
            runtime = kernels.runtime_library()
            compute, comm = torch.cuda.current_stream(device), self._comm_stream(device)
            packed = torch.empty(plan.packed_numel, dtype=a.dtype, device=device)
            exchange = RegionExchange(call, packed)  # all_to_all: count exchange (host sync)
            comm.wait_stream(compute)
            stamp("launch", compute)
            state = self.launch_gemm(plan, a, call.b, packed, monitor=monitor, stream=compute)
            stamp("gemm_end", compute)
            warm_key = (device, id(call.group), exchange.kind, plan.dtype)
            first = warm_key not in self._warmed
            if first:  # load every kernel of the call on an idle device (see module doc)
                compute.synchronize()
            mode = wait_mode()
            with torch.cuda.stream(comm):
                for g, size in enumerate(state.group_sizes):
                    runtime.wait_counter(state.counters.data_ptr() + 4 * g, size, mode,
                                         comm.cuda_stream)
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
            self._unpack(runtime, exchange, state, compute)
            stamp("end", compute)
            if first:
                torch.cuda.synchronize(device)
                self._warmed.add(warm_key)

    def trace(self, call: OverlapCall):
        """Run the call with the monitor on: each tile's completion (GPU global timer) and CTA,
        each group's transfer (CUDA events), on one clock whose origin is the GEMM's launch.
        The tile clock is aligned so that the last tile ends when the GEMM kernel does."""
        from flashoverlap_core.tuning.trace import TileTrace

        plan = call.plan
        monitor = torch.zeros(plan.num_tiles, 2, dtype=torch.int64, device=call.a.device)
        stamps: dict = {}
        self._run(call, monitor, stamps)
        torch.cuda.synchronize(call.a.device)
        origin = stamps["launch"][0]
        gemm_s = origin.elapsed_time(stamps["gemm_end"][0]) / 1e3
        mon = monitor.cpu()
        ends = ((mon[:, 0] - mon[:, 0].max()).double() / 1e9 + gemm_s).clamp(min=0)
        since = lambda events: [origin.elapsed_time(e) / 1e3 for e in events]  # noqa: E731
        return TileTrace.from_stamps(
            wave_size=plan.wave_size, group_sizes=plan.group_sizes, item_end=ends.tolist(),
            item_worker=(mon[:, 1] & 0xFFFFFFFF).tolist(),
            transfer_start=since(stamps["transfer_start"]),
            transfer_end=since(stamps["transfer_end"]), call_end=since(stamps["end"])[0],
            clock="tiles: device globaltimer aligned to the GEMM's end; transfers: CUDA events")

    def _unpack(self, runtime, exchange, state, stream) -> None:
        """Post-communication reorder kernel, one launch per received block. The tile tables
        of a plan's fixed layouts (all but all_to_all's) are built once and kept on the device."""
        tables = state.unpack.get(exchange.kind) if exchange.kind != "all_to_all" else None
        if tables is None:
            tables = []
            for rows_view, tiles, offsets in exchange.block_layouts():
                if not tiles:
                    continue
                start = rows_view.data_ptr() - exchange.call.out.data_ptr()
                rects = torch.tensor([(t.row0, t.rows, t.col0, t.cols) for t in tiles],
                                     dtype=torch.int32).to(rows_view.device)
                offs = torch.tensor(offsets, dtype=torch.int64).to(rows_view.device)
                tables.append((start, rects, offs))
            if exchange.kind != "all_to_all":
                state.unpack[exchange.kind] = tables
        out = exchange.call.out
        for start, rects, offs in tables:
            runtime.unpack_tiles(exchange.staging.data_ptr(), out.data_ptr() + start,
                                 out.stride(0), rects.data_ptr(), offs.data_ptr(),
                                 rects.shape[0], out.element_size(), stream.cuda_stream)


def b_col_major(b: torch.Tensor) -> bool:
    """True when b is the transpose of a row-major [N, K] (``weight.t()``)."""
    return b.stride(0) == 1 and b.stride(1) != 1
