"""Tuning one shape, as every rank runs it.

:func:`build_model` measures (or takes from the cache) the three parts of the timing model for
a :class:`Job` and calibrates it against a measured sequential call; the caller runs
:func:`~flashoverlap_core.tuning.search.search` on the result (it is the same on every rank)
and :func:`measure_groupings` times real ``overlap`` calls of the candidate groupings. Both are
module-level functions of picklable arguments, so a :class:`~flashoverlap_core.launch.RankPool`
can run them on spawned ranks; they run in-process just as well (one rank, no process group).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .. import registry
from ..api import make_plan, overlap
from ..backend import OverlapCall, OverlapSpec
from ..bench import equal_splits
from ..collectives import resolve_group
from ..ops import HostOffload
from ..plan import Plan
from .cache import Context, TuningCache, context_for, kernel_key, transfer_key
from .measure import (agree, current_device, log_sizes, measure_contention, measure_curve,
                      line_up, median_time, traced_timing, transfer_fn)
from .model import Contention, CostCurve, GemmTiming, OverlapModel
from .trace import TileTrace

TRANSFERS = ("allreduce", "reduce_scatter", "all_to_all", "offload")
OFFLOAD = "offload"  # op=HostOffload: every group copied to host memory (one device suffices)


@dataclass(frozen=True)
class Job:
    """One shape to tune: per-rank a [M, K] @ b [K, N] (b an nn.Linear weight's transpose)."""

    m: int
    n: int
    k: int
    op: str  # one of TRANSFERS
    dtype: str
    backend: str
    iters: int = 10
    warmup: int = 3
    trace_reps: int = 5
    seed: int = 1234
    device_type: str | None = None  # default: the backend's (the host for backends of any device)

    def __post_init__(self):
        if self.op not in TRANSFERS:
            raise ValueError(f"op must be one of {TRANSFERS}, got {self.op!r}")

    @property
    def plan_op(self) -> str:
        return "custom" if self.op == OFFLOAD else self.op

    @property
    def transfer(self) -> str:
        """What the cache calls the callable op ("" for collectives)."""
        return HostOffload.__name__ if self.op == OFFLOAD else ""

    @property
    def shape(self) -> str:
        return f"{self.m}x{self.n}x{self.k}"


def noop(region, index) -> None:
    """A transfer that does nothing: the call is the GEMM, its signals and the reorder."""


class Workload:
    """A job's inputs, plans and calls on this rank."""

    def __init__(self, job: Job):
        self.job = job
        self.group, self.rank, self.world = resolve_group(None)
        self.backend = registry.get(job.backend)
        self.device = current_device(job.device_type or self.backend.device_type or "cpu")
        dtype = getattr(torch, job.dtype)
        gen = torch.Generator(device=self.device).manual_seed(job.seed + self.rank)
        self.a = torch.randn(job.m, job.k, generator=gen, device=self.device, dtype=dtype)
        self.b = (torch.randn(job.n, job.k, generator=gen, device=self.device, dtype=dtype)
                  / job.k ** 0.5).t()
        self.send = self.recv = None
        if job.op == "all_to_all" and self.world > 1:
            self.send = equal_splits(job.m, self.world)
            self.recv = [self.send[self.rank]] * self.world
        self.base = self._plan(job.plan_op)
        self.gemm_plan = self.one_group(self._plan("custom"))  # the GEMM with no transfer
        rows = {"reduce_scatter": job.m // self.world,
                "all_to_all": sum(self.recv) if self.recv else job.m}.get(job.op, job.m)
        self.out = torch.empty(rows, job.n, dtype=dtype, device=self.device)
        # the GEMM-only plan (a custom op) returns all M rows, whatever the job's collective
        self.gemm_out = (self.out if rows == job.m
                         else torch.empty(job.m, job.n, dtype=dtype, device=self.device))
        self.op = (HostOffload(self.base.packed_numel, dtype, self.device.type != "cpu")
                   if job.op == OFFLOAD else job.op)
        self.context: Context = context_for(self.backend, self.device.type, self.group)

    def spec(self, op: str) -> OverlapSpec:
        send = tuple(self.send) if self.send and op == "all_to_all" else None
        return OverlapSpec(self.job.m, self.job.n, self.job.k, op, self.world, self.job.dtype,
                           self.device.type, "col", send)

    def _plan(self, op: str) -> Plan:
        return make_plan(self.backend, self.spec(op))

    @staticmethod
    def one_group(plan: Plan) -> Plan:
        """``plan`` with every tile in one group: the transfer after the whole GEMM."""
        return dataclasses.replace(plan, group_sizes=(plan.num_tiles,))

    def plan(self, group_sizes) -> Plan:
        return dataclasses.replace(self.base, group_sizes=tuple(group_sizes))

    def run(self, plan: Plan, op=None):
        if plan.op == "custom":  # the GEMM alone, or the offload: all rows, no splits
            return overlap(self.a, self.b, op if op is not None else self.op, plan=plan,
                           out=self.gemm_out, backend=self.backend.name)
        return overlap(self.a, self.b, op if op is not None else self.op, plan=plan,
                       out=self.out, send_splits=self.send, recv_splits=self.recv,
                       backend=self.backend.name)

    def trace(self, plan: Plan) -> TileTrace:
        call = OverlapCall(self.a, self.b, plan, self.op, self.group, self.rank, self.world,
                           self.out, tuple(self.recv) if self.recv else None)
        return self.backend.trace(call)

    def time(self, fn) -> float:
        return median_time(fn, self.device, self.group, self.job.iters, self.job.warmup)

    def output_bytes(self) -> int:
        return self.base.packed_numel * self.a.element_size()


@dataclass(frozen=True)
class ModelParts:
    """What :func:`build_model` measured for a job (picklable, the same on every rank)."""

    plan: dict  # the heuristic plan (Plan.to_dict): tile, wave size, order of the tiles
    timing: GemmTiming
    cost: CostCurve
    contention: Contention
    sequential_s: float  # measured: the call with one group
    post_s: float  # sequential_s - (GEMM end + one transfer of everything), as measured
    context: Context

    def model(self) -> OverlapModel:
        """The model, calibrated: its one-group prediction is the measured sequential call.
        What that call takes beyond the GEMM and one transfer is the post-communication
        reorder and the call's fixed costs; a negative rest (noisy parts, or a trace whose
        origin is earlier than the call's start) counts as none."""
        return OverlapModel.for_plan(Plan.from_dict(self.plan), self.timing, self.cost,
                                     self.contention, max(0.0, self.post_s))


def _cached(cache: TuningCache, section: str, key: dict, kind, work: Workload, refresh: bool,
            measure, usable=lambda value: True):
    """A ``kind`` (CostCurve, GemmTiming, Contention) from the cache when every rank has a
    usable one and ``refresh`` is off, else measured (and stored by rank 0)."""
    found = None if refresh else cache.get(section, key)
    found = kind.from_dict(found) if found is not None else None
    if agree(found is not None and usable(found), work.device, work.group):
        return found
    value = measure()
    if work.rank == 0:
        cache.put(section, key, value.to_dict())
    return value


def build_model(job: Job, cache_path: str | None = None, refresh: bool = False) -> ModelParts:
    """Measure the model of ``job`` on this rank's device and group (all ranks together);
    reuses cached cost curves, GEMM timings and contention unless ``refresh``."""
    work, cache = Workload(job), TuningCache(cache_path)
    ctx, plan = work.context, work.base
    send = transfer_fn(work.op, work.group, work.world)
    itemsize, total = work.a.element_size(), work.output_bytes()
    align = itemsize * (work.world if job.op in ("reduce_scatter", "all_to_all") else 1)
    tile_bytes = plan.tile[0] * plan.tile[1] * itemsize
    transfer = job.transfer or job.op

    cost = _cached(
        cache, "curves", transfer_key(ctx, transfer=transfer, world_size=work.world,
                                      dtype=job.dtype), CostCurve, work, refresh,
        lambda: measure_curve(send, log_sizes(min(tile_bytes, total), total, align),
                              work.a.dtype, work.device, work.group, job.iters, job.warmup),
        usable=lambda curve: curve.max_bytes >= total or send is None)
    one_group = work.one_group(plan)
    work.run(one_group)  # warm-up: loads every kernel before anything is traced
    timing = _cached(
        cache, "gemm", kernel_key(ctx, plan), GemmTiming, work, refresh,
        lambda: traced_timing(lambda: work.trace(one_group), work.device, work.group,
                              job.trace_reps)[0])
    region = torch.zeros(max(align, total // 4 // align * align) // itemsize,
                         dtype=work.a.dtype, device=work.device)
    contention = _cached(
        cache, "contention", {**kernel_key(ctx, plan), "transfer": transfer,
                              "world_size": work.world}, Contention, work, refresh,
        lambda: measure_contention(lambda: work.run(work.gemm_plan, noop), send, region,
                                   work.device, work.group, max(3, job.iters // 2),
                                   job.warmup))
    sequential = work.time(lambda: work.run(one_group))
    post = sequential - (timing.end + cost(total))
    return ModelParts(plan.to_dict(), timing, cost, contention, sequential, post, ctx)


def measure_groupings(job: Job, groupings) -> list[float]:
    """Measured seconds (median, slowest rank) of the job's call with each grouping."""
    work = Workload(job)
    out = []
    for sizes in groupings:
        plan = work.plan(sizes)
        out.append(work.time(lambda: work.run(plan)))
    return out


def trace_rank(job: Job, group_sizes=None) -> dict:
    """One traced call with ``group_sizes`` (default: the heuristic plan's), after a warm-up
    call: {"plan": Plan.to_dict(), "trace": TileTrace.to_dict()} of this rank."""
    work = Workload(job)
    plan = work.plan(group_sizes) if group_sizes is not None else work.base
    work.run(plan)
    line_up(work.device, work.group)
    return {"plan": plan.to_dict(), "trace": work.trace(plan).to_dict()}
