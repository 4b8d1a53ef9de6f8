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

Each call kind has one home: :mod:`.overlap_call` (allreduce, reduce_scatter, callable ops; the
fused norm is its phase), :mod:`.all_to_all_call` and :mod:`.gather_call`, over what they share
(:mod:`.call_base`: per-stream state, warm-up, errors; :mod:`.gemm`: the GEMM and its operands).
This module only builds them, handing them its :class:`~.gemm.Gemms` and
:class:`~.call_base.WarmUps`; none of them imports it.
"""
from __future__ import annotations

import logging
import os
import socket

import torch

from flashoverlap_core.backend import Backend, OverlapCall, OverlapSpec, PreparedCall
from flashoverlap_core.ops import of
from flashoverlap_core.plan import dtype_name
from flashoverlap_core.tile_trace import TileTrace
from flashoverlap_core.tiles import Schedule

from . import all_to_all_call, gemm, kernels, nccl
from .add_rmsnorm import add_rmsnorm_rows
from .call_base import WarmUps
from .device_state import (ENV_ARCH, ENV_FP8_BLOCK, ENV_RESERVED_SMS, PlanTables,
                           outside_graph_pools, overlap_nccl_ctas, reserved_sms)
from .gather_call import CudaGatherCall
from .overlap_call import CudaCall

log = logging.getLogger("flashoverlap")

__all__ = ["CudaBackend", "ENV_ARCH", "ENV_RESERVED_SMS"]


class CudaBackend(Backend):
    name = "cuda"
    device_type = "cuda"
    priority = 100
    native_fp8 = True  # sm_90a: the e4m3 signaling GEMM (fp8_reasons says what it declines)

    MAX_PLANS = gemm.MAX_PLANS  # device tables kept for this many recent (plan, device) pairs

    def __init__(self):
        self.gemms = gemm.Gemms(self.MAX_PLANS)  # the plans' device tables, their kernels
        self.warm_ups = WarmUps()  # (kernel library, group, op, dtype) that ran once with syncs

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
        # the SMs a plan's GEMM leaves free (world size 1 / above) and the CTAs its collectives
        # take: in the tuning cache's context, so a plan or a measurement made under other ones
        # (another wave size) is not matched
        ctas = overlap_nccl_ctas(2)
        out["sm reserve"] = (f"{reserved_sms(1)}/{reserved_sms(2)}, nccl ctas "
                             f"{ctas if ctas else 'nccl'}")
        return out

    # ---- capabilities ------------------------------------------------------------------------
    def unsupported_reasons(self, spec: OverlapSpec) -> list[str]:
        if spec.fp8:
            return self.fp8_reasons(spec)
        reasons = []
        if spec.dtype not in kernels.DTYPES:
            reasons.append(f"the signaling GEMM takes {sorted(kernels.DTYPES)}, not {spec.dtype} "
                           "(use backend='decomposition' or 'reference')")
        if of(spec.op).splits:
            reasons += all_to_all_call.unsupported(None, spec.world_size)
        if spec.device_type == "cuda" and torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            if major < 8:
                reasons.append(f"compute capability {major}.{minor} < 8.0 (needs Ampere or newer)")
        return reasons

    def fp8_reasons(self, spec: OverlapSpec) -> list[str]:
        """What the fp8 signaling GEMM declines: anything but sm_90 (every op runs on it there:
        allgather on its waiting GEMM with scales, gather_call.py, all_to_all on its scaled GEMM
        over unequal blocks), fp8 dtypes it has no build for, b not column-major, and the
        switch that turns block-wise scales off."""
        reasons = []
        if spec.dtype not in kernels.FP8_DTYPES or spec.out_dtype not in kernels.DTYPES:
            reasons.append(f"the fp8 signaling GEMM takes {list(kernels.FP8_DTYPES)} a and b with "
                           f"a {list(kernels.DTYPES)} result, not {spec.dtype} -> {spec.out_dtype}")
        if of(spec.op).splits:  # all_to_all: the scaled GEMM over unequal destination blocks
            reasons += all_to_all_call.unsupported(None, spec.world_size)
        if spec.b_layout != "col":
            reasons.append("fp8 b must be column-major [K, N] (weight.t()), as the e4m3 tensor "
                           "cores read both operands K-major")
        forced = os.environ.get(ENV_ARCH)
        if forced or (spec.device_type == "cuda" and torch.cuda.is_available()):
            if gemm.arch() != 90:
                why = (f"{ENV_ARCH}={forced}" if forced else
                       "this GPU is sm_%d%d" % torch.cuda.get_device_capability())
                what = ("fp8 with block-wise scales (its block-scaled main loop)"
                        if spec.scaling == "blockwise" else "fp8")
                reasons.append(f"{what} needs sm_90a's e4m3 tensor cores (wgmma); {why} runs the "
                               "sm_80 kernels, which take bf16 and fp16 only (Ada's sm_89 fp8 "
                               "is not built)")
        if spec.scaling == "blockwise" and os.environ.get(ENV_FP8_BLOCK) == "0":
            reasons.append(f"{ENV_FP8_BLOCK}=0 turns the block-scaled fp8 signaling GEMM off: "
                           "block-wise calls run dequantized")
        return reasons

    def prebuild(self, archs=None, jobs=None) -> list[str]:
        """Every kernel configuration a plan can pick, for ``archs`` (default 90 and 80)."""
        configs = kernels.all_configs(archs or sorted(kernels.CONFIGS, reverse=True))
        return [str(p) for p in kernels.build.prebuild(configs, jobs)]

    def default_tile(self, spec: OverlapSpec) -> tuple[int, int]:
        return kernels.default_tile(gemm.arch(), spec, self.wave_size(spec, None))

    def wave_size(self, spec: OverlapSpec, tile: tuple[int, int]) -> int:
        sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        multiple = kernels.CTA_MULTIPLE
        return max(multiple, (sms - reserved_sms(spec.world_size)) // multiple * multiple)

    def schedule(self, spec: OverlapSpec, tile=None) -> Schedule:
        # Chunks of bands, column by column: a wave reads a few bands of A and sweeps B.
        return Schedule("n", kernels.schedule_bands(spec, tile))

    def add_rmsnorm_rows(self, x, residual, weight, eps):
        """The plain path's add + RMSNorm: the fused kernel over rows (add_rmsnorm.py)."""
        if x.device.type != "cuda":
            return None
        return add_rmsnorm_rows(kernels.runtime_library(), x, residual, weight, eps)

    def plain_collectives(self, call):
        """The plain path's collectives on FlashOverlap's own NCCL communicator of the group
        (nccl.PlainCollectives: a few microseconds of host time per call, where
        torch.distributed's path costs tens); None off NCCL groups and CUDA tensors."""
        if call.group is None or call.a.device.type != "cuda" or not nccl.uses_nccl(call.group):
            return None
        return nccl.PlainCollectives(call.group, call.a.device)

    def layouts(self, spec: OverlapSpec) -> tuple[str, ...]:
        # every op in both layouts, "rows" first: all_to_all's per-call layout writes and
        # receives whole rows too (a2a_layout.cuh), for its "destinations" plans in raster "n"
        # (plan_reasons; explicit group sizes keep "tiles")
        return ("rows", "tiles")

    def plan_reasons(self, plan) -> list[str]:
        reasons = []
        dtype = dtype_name(plan.dtype)
        tiles = kernels.supported_tiles(gemm.arch(), plan.scaling, dtype)
        if tuple(plan.tile) not in tiles:
            what = (" with block-wise fp8 scales" if plan.scaling == "blockwise"
                    else f" for {dtype}" if dtype in kernels.FP8_DTYPES else "")
            reasons.append(f"tile {plan.tile} has no CUDA kernel{what} on sm_{gemm.arch()}; "
                           f"available: {sorted(tiles)}")
        if plan.kind.splits:
            reasons += all_to_all_call.unsupported(plan, plan.world_size)
            if plan.grouping != "destinations" and len(set(plan.block_rows)) > 1:
                reasons.append("an all_to_all plan of grouping 'waves' runs equal destination "
                               "blocks only; the 'destinations' grouping (fo.plan's default for "
                               "all_to_all) takes any rows and splits")
        return reasons

    # ---- per-plan tables and kernels ----------------------------------------------------------
    def plan_tables(self, plan, device) -> PlanTables:
        return self.gemms.plan_tables(plan, device)

    def gemm_for(self, plan, tables: PlanTables, b: torch.Tensor, scales=None):
        """(kernel library, b taken column-major?, arch) that runs ``plan`` with this b (and an
        fp8 call's ``scales`` as the kernel reads them: :meth:`.gemm.Gemms.gemm_for`)."""
        return self.gemms.gemm_for(plan, tables, b, scales=scales)

    def launch_gemm(self, plan, a: torch.Tensor, b: torch.Tensor, packed: torch.Tensor,
                    **options) -> PlanTables:
        """Launch the signaling GEMM of ``plan`` writing ``packed``, outside a call
        (:meth:`.gemm.Gemms.launch_gemm` says what ``options`` take)."""
        return self.gemms.launch_gemm(plan, a, b, packed, **options)

    # ---- the call ----------------------------------------------------------------------------
    def prepare(self, template: OverlapCall) -> PreparedCall:
        stream = torch.cuda.current_stream(template.a.device)
        if template.plan.kind.gathers:  # the gather feeds a waiting GEMM (gather_call.py)
            return outside_graph_pools(
                lambda: CudaGatherCall(self, template, self.gemms, self.warm_ups,
                                       stream=stream.cuda_stream), stream)
        return outside_graph_pools(
            lambda: CudaCall(self, template, self.gemms, self.warm_ups, stream=stream.cuda_stream),
            stream)

    def prepare_all_to_all(self, template: OverlapCall):
        """all_to_all laid out per call from its own splits (:mod:`.all_to_all_call`) on NCCL groups
        (or none); None (a plan per split) on a group of another collective library."""
        group = template.group
        if group is not None and template.world_size > 1 and not nccl.uses_nccl(group):
            return None
        stream = torch.cuda.current_stream(template.a.device)
        return outside_graph_pools(
            lambda: all_to_all_call.CudaAllToAllCall(template, self.warm_ups), stream)

    def run(self, call: OverlapCall) -> torch.Tensor:
        """One call without a kept preparation (``fo.overlap`` prepares once per key)."""
        prepared = self.prepare(call)
        if call.scale_a is not None:
            return prepared.run_scaled(call.a, call.b, call.scale_a, call.scale_b, call.out, call.op)
        return prepared.run(call.a, call.b, call.out, call.op)

    def warm_up(self, key) -> bool:
        """Whether a call of this (library, group, op, dtype) must run with host syncs first
        (then marked as done); in CUDA-graph capture that is an error that says what to do."""
        return self.warm_ups.first(key)

    def trace(self, call: OverlapCall):
        """Run the call with the monitor on: each tile's completion (GPU global timer) and CTA,
        each group's transfer (CUDA events), on one clock whose origin is the GEMM's launch.
        The tile clock is aligned so that the last tile ends when the GEMM kernel does."""
        plan = call.plan
        if plan.kind.gathers:
            # Its GEMM waits for rows instead of signalling tiles: there is no monitored
            # signalling run to trace (and the tuner has no allgather workload).
            raise ValueError("the cuda backend cannot trace an allgather call (its GEMM waits for "
                             "arriving rows; the tile monitor belongs to the signalling GEMM): "
                             "trace it with backend='reference'")
        monitor = torch.zeros(plan.num_tiles, 2, dtype=torch.int64, device=call.a.device)
        stamps: dict = {}
        prepared = CudaCall(self, call, self.gemms, self.warm_ups, python_path=True)
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
