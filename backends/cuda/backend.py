"""The ``cuda`` backend: CUTLASS signaling GEMM, device-side waits, NCCL called directly.

A call, on the caller's (compute) stream and a high-priority communication stream:

1. the signaling GEMM is launched on the compute stream; it writes each finished tile to its
   packed slot and bumps its group's counter;
2. on the communication stream, per group: a device-side wait until the counter reaches the
   group's tile count, then the group's collective on its contiguous region;
3. the compute stream waits for the communication stream, and the post-reorder kernel writes
   the row-major result and zeroes the counters (so back-to-back calls and graph replays need
   no host sync).

The call path is prepared once per key (:meth:`CudaBackend.prepare`): device tables, the kernel
library, the NCCL communicator of the process group (:mod:`.nccl`), and per compute stream its
own counters, packed buffer, staging buffer and communication stream (two calls in flight on
two streams share none of them). A later call is one native function (``fo_call_run``) that
issues all of the above. Custom ops (a Python callable per group), all_to_all without
``recv_splits`` (the sizes are exchanged per call) and groups that do not use NCCL take the
Python path, with the same per-stream state, collectives through torch.distributed.

The first call of a (kernel, group, op) runs its phases one after the other with host syncs,
so every kernel it uses (GEMM, waiter, NCCL's, reorder) is loaded before any call overlaps:
under CUDA's lazy loading a kernel's first launch waits for an idle device, which would
serialise or deadlock an overlapped call (docs/design.md, "The call path"). Such a first call inside CUDA-graph
capture raises a ValueError that says to run it once outside capture first.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ctypes import c_int32, c_int64, c_void_p

from flashoverlap_core.backend import Backend, OverlapCall, OverlapSpec, PreparedCall
from flashoverlap_core.collectives import RegionExchange, collective_steps, unpack_layouts
from flashoverlap_core.plan import GATHER_OP
from flashoverlap_core.tile_trace import TileTrace
from flashoverlap_core.tiles import Schedule

from . import kernels, nccl
from .runtime import WAIT_MODES, CallDescription

log = logging.getLogger("flashoverlap")

ENV_RESERVED_SMS = "FLASHOVERLAP_CUDA_RESERVED_SMS"
ENV_WAIT = "FLASHOVERLAP_CUDA_WAIT"
ENV_ARCH = "FLASHOVERLAP_CUDA_ARCH"
ENV_GRAPH = "FLASHOVERLAP_CUDA_GRAPH"
DEFAULT_RESERVED_SMS = 4  # 128 CTAs: measured faster than 132 for the cluster-2 kernels (csrc/cuda/NOTES.md)
DEFAULT_WAIT = "stream_wait_value"
ALIGN_BYTES = 16  # TMA: global strides and base addresses 16-byte aligned


def reserved_sms() -> int:
    value = os.environ.get(ENV_RESERVED_SMS, str(DEFAULT_RESERVED_SMS))
    if not value.isdigit():
        raise ValueError(f"{ENV_RESERVED_SMS} must be a non-negative int, got {value!r}")
    return int(value)


def replay_graphs() -> bool:
    """Whether prepared calls replay a captured graph of the whole call (the default; 0 turns
    it off: every call then launches each kernel, wait and collective itself)."""
    value = os.environ.get(ENV_GRAPH, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV_GRAPH} must be 0 or 1, got {value!r}")
    return value == "1"


def outside_graph_pools(fn, stream: torch.cuda.Stream):
    """``fn()`` run in a short-lived thread whose current stream is ``stream``.

    What a prepared call keeps between calls (tables, counters, buffers, communication streams)
    must come from the ordinary caching allocator. torch.compile's CUDA graphs (cudagraph trees)
    send every allocation *of the calling thread* to their private pool while they warm up and
    record a graph, and then refuse a pool holding tensors that are not the graph's outputs.
    Another thread's allocations stay in the ordinary pool.
    """
    result: dict = {}

    def target():
        try:
            with torch.cuda.device(stream.device), torch.cuda.stream(stream):
                result["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            result["error"] = e

    worker = threading.Thread(target=target, name="flashoverlap-prepare")
    worker.start()
    worker.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


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
class PlanTables:
    """Device-resident, read-only tables of one plan on one device, shared by every stream."""

    items_host: torch.Tensor
    items: torch.Tensor
    item_group: torch.Tensor
    counters: torch.Tensor  # for launch_gemm outside a call (benchmarks), not for calls
    cluster_fits: dict = field(default_factory=dict)  # cluster shape -> bool


class StreamState:
    """What the calls of one key on one compute stream use, and no other call: the group
    counters, the packed and staging buffers and the communication stream."""

    def __init__(self, plan, device: torch.device, dtype: torch.dtype, staging_numel: int | None):
        low, high = torch.cuda.Stream.priority_range()
        self.comm = torch.cuda.Stream(device=device, priority=high)
        self.counters = torch.zeros(plan.num_groups, dtype=torch.int32, device=device)
        self.packed = torch.empty(plan.packed_numel, dtype=dtype, device=device)
        self.staging = (self.packed if staging_numel is None
                        else torch.empty(staging_numel, dtype=dtype, device=device))
        for t in (self.counters, self.packed, self.staging):
            t.record_stream(self.comm)  # freed only once the communication stream is done
        self.handle = None  # the native call (fo_call), when the key takes the native path
        self.runtime = None

    def __del__(self):
        if self.handle is not None and self.runtime is not None:
            self.runtime.call_destroy(self.handle)


class CudaBackend(Backend):
    name = "cuda"
    device_type = "cuda"
    priority = 100

    MAX_PLANS = 64  # device tables kept for this many recent (plan, device) pairs

    def __init__(self):
        self._tables: OrderedDict = OrderedDict()
        self._warmed: set = set()  # (kernel library, group, op, dtype) that ran once with syncs
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

    def rank_environment(self, rank: int, world_size: int, shared_devices: bool) -> dict[str, str]:
        """Ranks sharing a GPU: NCCL refuses two ranks of one communicator on one GPU only when
        their host hashes match ("Duplicate GPU detected"); NCCL_HOSTID sets that hash, so each
        rank gets its own, and NCCL then joins them over its socket transport on loopback
        (docs/design.md, "Ranks that share devices"). NVLink SHARP (multicast) is off: a
        topology of one GPU has none. Correctness only: the ranks time-slice the GPU."""
        if not shared_devices:
            return {}
        return {"NCCL_HOSTID": f"{socket.gethostname()}-flashoverlap-rank{rank}-of-{world_size}",
                "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1", "NCCL_NVLS_ENABLE": "0"}

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
        if spec.op == "all_to_all" and spec.world_size > 1 and spec.send_splits is None:
            # what the ranks agree on cannot depend on one rank's splits (api._agree)
            reasons.append("all_to_all at world size > 1 takes each rank's own rows and splits, "
                           "which may be unequal on any rank, and the signaling GEMM needs equal "
                           "destination blocks (name backend='cuda' to run equal splits on it)")
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
        return kernels.default_tile(self._arch(), spec, self.wave_size(spec, None))

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

    # ---- per-plan tables and kernels ----------------------------------------------------------
    def plan_tables(self, plan, device) -> PlanTables:
        key = (plan, device)
        with self._lock:
            tables = self._tables.get(key)
            if tables is None:
                items, groups = plan.item_table()
                tables = PlanTables(items, items.to(device), groups.to(device),
                                    torch.zeros(plan.num_groups, dtype=torch.int32, device=device))
                self._tables[key] = tables
                while len(self._tables) > self.MAX_PLANS:
                    self._tables.popitem(last=False)
            self._tables.move_to_end(key)
            return tables

    def gemm_for(self, plan, tables: PlanTables, b: torch.Tensor):
        """(kernel library, b taken column-major?, arch) that runs ``plan`` with this b."""
        arch = self._arch()
        # sm80 loads 8-element vectors along K, and along N for a row-major b: such a b with
        # N % 8 != 0 runs as the column-major kernel on a transposed copy.
        col = b_col_major(b) or (arch == 80 and b.shape[1] % 8 != 0)
        cluster = kernels.preferred_cluster(arch, plan.tile)
        fits = tables.cluster_fits.get(cluster)
        if fits is None:
            fits = tables.cluster_fits[cluster] = kernels.cluster_fits(tables.items_host, cluster)
        if not fits:
            cluster = (1, 1)
        return kernels.gemm_library(kernels.gemm_config(arch, plan.tile, plan.dtype, col, cluster)), col, arch

    def launch_gemm(self, plan, a: torch.Tensor, b: torch.Tensor, packed: torch.Tensor, *,
                    signal: bool = True, monitor: torch.Tensor | None = None,
                    stream: torch.cuda.Stream | None = None,
                    counters: torch.Tensor | None = None) -> PlanTables:
        """Launch the signaling GEMM of ``plan`` writing ``packed`` (no waits, no collective).

        ``signal=False`` runs the same kernel with no counters (for measuring what signaling
        costs); ``counters`` default to the plan's benchmark counters (``tables.counters``);
        ``monitor`` (uint64 [T, 2]) records each tile's completion.
        """
        tables = self.plan_tables(plan, a.device)
        gemm, col, arch = self.gemm_for(plan, tables, b)
        a_op, b_op, k = self._operands(arch, a, b, col)
        blocks, rows = len(plan.block_rows), plan.block_rows[0]
        workspace = self._workspace(gemm, plan, k, a.device)
        stream = stream or torch.cuda.current_stream(a.device)
        counters = counters if counters is not None else tables.counters
        gemm.run(a_op.data_ptr(), b_op.data_ptr(), packed.data_ptr(), blocks, rows, plan.n,
                 k, a_op.stride(0), b_op.stride(0), tables.items.data_ptr(),
                 tables.item_group.data_ptr(), plan.num_tiles,
                 counters.data_ptr() if signal else None, plan.wave_size,
                 monitor.data_ptr() if monitor is not None else None,
                 workspace.data_ptr() if workspace is not None else None, stream.cuda_stream)
        return tables

    @staticmethod
    def _workspace(gemm, plan, k, device) -> torch.Tensor | None:
        size = gemm.workspace_size(len(plan.block_rows), plan.block_rows[0], plan.n, k,
                                   plan.wave_size)
        return torch.empty(size, dtype=torch.uint8, device=device) if size else None

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
    def prepare(self, template: OverlapCall) -> PreparedCall:
        stream = torch.cuda.current_stream(template.a.device)
        if template.plan.op == GATHER_OP:  # the gather feeds a waiting GEMM (gather.py)
            from .gather import CudaGatherCall  # it imports this module

            return outside_graph_pools(
                lambda: CudaGatherCall(self, template, stream=stream.cuda_stream), stream)
        return outside_graph_pools(lambda: CudaCall(self, template, stream=stream.cuda_stream),
                                   stream)

    def run(self, call: OverlapCall) -> torch.Tensor:
        """One call without a kept preparation (``fo.overlap`` prepares once per key)."""
        return self.prepare(call).run(call.a, call.b, call.out, call.op)

    def warm_up(self, key) -> bool:
        """Whether a call of this (library, group, op, dtype) must run with host syncs first
        (then marked as done); in CUDA-graph capture that is an error that says what to do."""
        if key in self._warmed:
            return False
        if torch.cuda.is_current_stream_capturing():
            raise ValueError(
                "the first call of this shape, op and process group cannot be captured in a CUDA "
                "graph: it loads its kernels with host synchronisation. Run it once outside the "
                "capture (a warm-up call, as torch.cuda.graphs recommends), then capture")
        self._warmed.add(key)
        return True

    def trace(self, call: OverlapCall):
        """Run the call with the monitor on: each tile's completion (GPU global timer) and CTA,
        each group's transfer (CUDA events), on one clock whose origin is the GEMM's launch.
        The tile clock is aligned so that the last tile ends when the GEMM kernel does."""
        plan = call.plan
        if plan.op == GATHER_OP:
            # Its GEMM waits for rows instead of signalling tiles: there is no monitored
            # signalling run to trace (and the tuner has no allgather workload).
            raise ValueError("the cuda backend cannot trace an allgather call (its GEMM waits for "
                             "arriving rows; the tile monitor belongs to the signalling GEMM): "
                             "trace it with backend='reference'")
        monitor = torch.zeros(plan.num_tiles, 2, dtype=torch.int64, device=call.a.device)
        stamps: dict = {}
        prepared = CudaCall(self, call, python_path=True)
        prepared.run_python(call, prepared.state(), monitor, stamps)
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


NCCL_DTYPES = {"bfloat16": 9, "float16": 6, "float32": 7}
COLLECTIVES = {"allreduce": 1, "reduce_scatter": 2, "all_to_all": 3}


def _current_stream_getter():
    """The fastest way to read the current stream's raw handle (a per-call read)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw
    return lambda index: torch.cuda.current_stream(index).cuda_stream


_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


class CudaCall(PreparedCall):
    """The prepared calls of one key on the cuda backend (see the module docstring).

    ``run`` costs a few microseconds of Python: find this stream's state, check the operands'
    alignment, one native call that issues the GEMM, every wait and collective, and the
    post-reorder."""

    def __init__(self, backend: CudaBackend, call: OverlapCall, python_path: bool = False,
                 stream: int | None = None):
        super().__init__(backend, call)
        plan, a, device = call.plan, call.a, call.a.device
        self.device, self.index = device, device.index
        self.kind = call.op if isinstance(call.op, str) else "custom"
        self.tables = backend.plan_tables(plan, device)
        self.gemm, self.col, self.arch = backend.gemm_for(plan, self.tables, call.b)
        self.k = a.shape[1] if self.arch != 80 else -(-a.shape[1] // 8) * 8
        self.direct = self._takes_directly(a, call.b)
        self.workspace = backend._workspace(self.gemm, plan, self.k, device)
        self.wait = wait_mode()
        self.use_graph = replay_graphs()
        self.runtime = kernels.runtime_library()
        self.call_run = self.runtime.call_run
        self.warmed = False  # this key's first call ran (with host syncs where needed)
        # The key fixes the strides: what the kernel takes as lda and ldb.
        self.lda, self.ldb = a.stride(0), (call.b.stride(1) if self.col else call.b.stride(0))
        self.current_stream = _current_stream_getter()
        group = call.group
        self.python_path = python_path or self.kind == "custom" or (
            group is not None and not nccl.uses_nccl(group)) or (
            self.kind == "all_to_all" and call.world_size > 1 and call.recv_splits is None)
        self.comm = nccl.communicator(group, device) if group is not None and not self.python_path else None
        self.warm_key = (self.gemm.path, group, self.kind if not self.python_path else "python",
                         plan.dtype)
        self._states: dict[int, StreamState] = {}
        first = StreamState(plan, device, plan.torch_dtype, None)
        self._states[self.current_stream(self.index) if stream is None else stream] = first
        with torch.cuda.device(device):
            # The layouts of the regions and of the post-reorder, from the first call: with a
            # communicator, all_to_all's counts are exchanged here, once.
            exchange = RegionExchange(call, first.packed)
            self.staging_numel = exchange.staging.numel() if exchange.staging is not first.packed else None
            if self.staging_numel is not None:
                first.staging = exchange.staging
                first.staging.record_stream(first.comm)
            self.blocks = self._unpack_tables(exchange)
            self.steps, self.num_steps, self.per_step = collective_steps(exchange)
        if not self.python_path:
            self._make_native(first)

    # ---- operands ------------------------------------------------------------------------
    def _takes_directly(self, a, b) -> bool:
        """Whether the key's strides let the kernel read a and b in place (per call only
        their base addresses are checked for 16-byte alignment)."""
        b_rows = b.t() if self.col else b
        ok = lambda t: t.stride(1) == 1 and t.stride(0) % (ALIGN_BYTES // t.element_size()) == 0  # noqa: E731
        return ok(a) and ok(b_rows) and self.k == a.shape[1]

    def operands(self, a, b):
        """(a, lda, b, ldb, copies) for the kernel; copies only when a and b cannot be read in
        place. The caller keeps ``copies`` alive until the launch is queued, and no longer:
        kept on the call, they would sit in a CUDA-graph pool as tensors no graph output owns
        (torch.compile's cudagraph trees refuse that)."""
        if self.direct and (a.data_ptr() | b.data_ptr()) & (ALIGN_BYTES - 1) == 0:
            return a.data_ptr(), a.stride(0), b.data_ptr(), b.stride(1) if self.col else b.stride(0), None
        a_op, b_op, _ = CudaBackend._operands(self.arch, a, b, self.col)
        return a_op.data_ptr(), a_op.stride(0), b_op.data_ptr(), b_op.stride(0), (a_op, b_op)

    # ---- tables built once -----------------------------------------------------------------
    def _unpack_tables(self, exchange) -> list:
        """Per received block: (byte offset in out, tiles table, source offsets) on the device."""
        size = exchange.call.out.element_size()
        return [(start * size, torch.tensor(rects, dtype=torch.int32).to(self.device),
                 torch.tensor(offsets, dtype=torch.int64).to(self.device))
                for start, rects, offsets in unpack_layouts(exchange)]

    def _make_native(self, state: StreamState) -> None:
        plan = self.template.plan
        desc = CallDescription()
        desc.abi_version = 1
        desc.gemm_run = self.gemm.run_address
        desc.L, desc.block_rows = len(plan.block_rows), plan.block_rows[0]
        desc.N, desc.K = plan.n, self.k
        desc.items, desc.item_group = self.tables.items.data_ptr(), self.tables.item_group.data_ptr()
        desc.num_items, desc.num_ctas = plan.num_tiles, plan.wave_size
        desc.workspace = self.workspace.data_ptr() if self.workspace is not None else None
        desc.packed, desc.staging = state.packed.data_ptr(), state.staging.data_ptr()
        desc.counters, desc.num_groups = state.counters.data_ptr(), plan.num_groups
        desc.group_sizes = (c_int32 * plan.num_groups)(*plan.group_sizes)
        desc.wait_mode = WAIT_MODES[self.wait]
        desc.collective = COLLECTIVES[self.kind] if self.comm is not None else 0
        desc.nccl_comm = self.comm
        desc.nccl_dtype = NCCL_DTYPES[plan.dtype]
        desc.num_steps, desc.per_step = self.num_steps, self.per_step
        desc.steps = (c_int64 * max(1, len(self.steps)))(*self.steps)
        desc.num_blocks = len(self.blocks)
        desc.block_out_offset = (c_int64 * max(1, len(self.blocks)))(*[b[0] for b in self.blocks])
        desc.block_tiles = (c_void_p * max(1, len(self.blocks)))(*[b[1].data_ptr() for b in self.blocks])
        desc.block_offsets = (c_void_p * max(1, len(self.blocks)))(*[b[2].data_ptr() for b in self.blocks])
        desc.block_num_tiles = (c_int32 * max(1, len(self.blocks)))(*[b[1].shape[0] for b in self.blocks])
        desc.ldo, desc.elem_size = plan.n, state.packed.element_size()
        desc.comm_stream = state.comm.cuda_stream
        desc.gemm_set_node = self.gemm.set_node_address
        desc.use_graph = int(self.use_graph)
        state.runtime = self.runtime
        state.handle = self.runtime.call_create(desc)

    # ---- per stream --------------------------------------------------------------------------
    def state(self, stream: int | None = None) -> StreamState:
        """This compute stream's state, made on its first call (outside graph pools)."""
        if stream is None:
            stream = self.current_stream(self.index)
        state = self._states.get(stream)
        if state is None:
            plan = self.template.plan
            current = torch.cuda.current_stream(self.device)
            state = outside_graph_pools(
                lambda: StreamState(plan, self.device, plan.torch_dtype, self.staging_numel),
                current)
            if not self.python_path:
                self._make_native(state)
            self._states[stream] = state
        return state

    def graph_state(self, stream: int | None = None) -> int:
        """How this key's calls on ``stream`` run: 1 replaying a captured graph, 0 launch by
        launch (first call, python path, replay off), -1 the graph could not be made."""
        state = self.state(stream)
        return 0 if state.handle is None else self.runtime.call_graph_state(state.handle)

    # ---- the call ----------------------------------------------------------------------------
    def run(self, a, b, out, op):
        # The steady state: this stream's native call, operands read in place, kernels loaded.
        stream = self.current_stream(self.index)
        state = self._states.get(stream)
        if state is not None and self.warmed and self.direct and state.handle is not None:
            a_ptr, b_ptr = a.data_ptr(), b.data_ptr()
            if (a_ptr | b_ptr) & (ALIGN_BYTES - 1) == 0 and _current_device() == self.index:
                err = self.call_run(state.handle, a_ptr, self.lda, b_ptr, self.ldb,
                                    out.data_ptr(), stream, 0)
                if err:
                    self._raise(err)
                return out
        return self._run(a, b, out, op)

    def _run(self, a, b, out, op):
        """Every other case: another device current, a first call, copied operands, the
        python path."""
        if _current_device() != self.index:
            with torch.cuda.device(self.device):
                return self._run(a, b, out, op)
        stream = self.current_stream(self.index)
        state = self._states.get(stream) or self.state(stream)
        if self.python_path:
            t = self.template
            call = OverlapCall(a, b, t.plan, op, t.group, t.rank, t.world_size, out, t.recv_splits)
            self.run_python(call, state)
            return call.out
        warm = self.backend.warm_up(self.warm_key)
        a_ptr, lda, b_ptr, ldb, copies = self.operands(a, b)
        err = self.call_run(state.handle, a_ptr, lda, b_ptr, ldb, out.data_ptr(), stream, int(warm))
        del copies  # queued: the caching allocator orders their reuse after these kernels
        if err:
            self._raise(err)
        self.warmed = True
        return out

    def _raise(self, err: int) -> None:
        gemm_detail = self.gemm.lib.fo_last_error()
        self.runtime.check(err, "fo_call_run" + (
            f" (GEMM library: {gemm_detail.decode()})" if gemm_detail else ""))

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
            exchange = RegionExchange(call, state.packed)  # all_to_all: count exchange (host sync)
            comm.wait_stream(compute)
            stamp("launch", compute)
            self.backend.launch_gemm(plan, call.a, call.b, state.packed, monitor=monitor,
                                     stream=compute, counters=state.counters)
            stamp("gemm_end", compute)
            first = self.backend.warm_up(self.warm_key)
            if first:  # load every kernel of the call on an idle device (see module doc)
                compute.synchronize()
            with torch.cuda.stream(comm):
                for g, size in enumerate(plan.group_sizes):
                    runtime.wait_counter(state.counters.data_ptr() + 4 * g, size, self.wait,
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
            tables = self.blocks if self.kind != "all_to_all" or call.recv_splits is not None \
                else self._unpack_tables(exchange)
            out = call.out
            for start, rects, offs in tables:
                runtime.unpack_tiles(exchange.staging.data_ptr(), out.data_ptr() + start,
                                     out.stride(0), rects.data_ptr(), offs.data_ptr(),
                                     rects.shape[0], out.element_size(), compute.cuda_stream)
            stamp("end", compute)
            if first:
                torch.cuda.synchronize(device)


def b_col_major(b: torch.Tensor) -> bool:
    """True when b is the transpose of a row-major [N, K] (``weight.t()``)."""
    return b.stride(0) == 1 and b.stride(1) != 1
