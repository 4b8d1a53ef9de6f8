"""Tuning one shape, as every rank runs it.

:func:`build_model` measures the parts of the timing model for a :class:`Job` on the kernel and
transfer actually used -- the GEMM's wave ends from traced one-group calls, the contention
fitted to traced overlapped calls (both measured afresh at every tuning, so they follow the
kernel; only the transfer's cost curve, which does not depend on it, comes from the cache) --
and calibrates it against the measured one-group call; it also measures the plain path (the
device's own GEMM, then one collective). The caller runs
:func:`~flashoverlap_core.tuning.search.predictive_search` on the result (it is the same on
every rank), :func:`sample_groupings` / :func:`measure_groupings` time real ``overlap`` calls
of candidate groupings, and :func:`tuned_plan` turns the choice and what was measured into the
plan to store: never slower than the plain path. Everything here is a module-level function of
picklable arguments, so a rank pool can run them on spawned ranks; they run in-process just as
well (one rank, no process group).
"""
from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from functools import lru_cache

import torch

from .. import fp8, registry
from ..api import overlap, overlap_scaled
from ..backend import OverlapCall, OverlapSpec
from ..collectives import resolve_group
from ..grouping import equal_splits
from ..ops import CUSTOM_OP, of
from ..plan import FP8_DTYPES, SCALINGS, Plan, dtype_name
from ..planning import make_plan
from ..tile_trace import TileTrace
from ..transfers import HostOffload
from .cache import Context, TuningCache, context_for, plan_key, transfer_key
from ..devices import current_device
from .measure import (agree, contention, gemm_timing, line_up, log_sizes, measure_curve,
                      median_time, sample_times, traced_calls, transfer_fn)
from .model import Contention, CostCurve, GemmTiming, OverlapModel
from .search import SEQUENTIAL, Choice, sizes_from_ends

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
    rounds: int = 3  # samples of ``iters`` back-to-back calls per timed grouping
    # an fp8 job's scales (fp8.example_inputs): "tensorwise", "rowwise" or "blockwise"; its
    # calls return an fp8 call's default out_dtype (``out_dtype``)
    scaling: str | None = None

    def __post_init__(self):
        if self.op not in TRANSFERS:
            raise ValueError(f"op must be one of {TRANSFERS}, got {self.op!r}")
        if self.iters < 1 or self.rounds < 1 or self.warmup < 0 or self.trace_reps < 1:
            raise ValueError(f"iters, rounds and trace_reps must be >= 1 and warmup >= 0, got "
                             f"{self.iters}, {self.rounds}, {self.trace_reps}, {self.warmup}")
        if self.fp8 and self.scaling not in SCALINGS:
            raise ValueError(f"an fp8 job needs its scaling, one of {SCALINGS}; got "
                             f"{self.scaling!r}")
        if not self.fp8 and self.scaling is not None:
            raise ValueError(f"scaling is for fp8 jobs ({', '.join(FP8_DTYPES)}), not "
                             f"{self.dtype}")
        if self.fp8 and self.op == "all_to_all":
            raise ValueError("fp8 all_to_all is not tuned (its jobs would need scales of "
                             "each call's own rows): tune all_to_all with --dtype float32")

    @property
    def fp8(self) -> bool:
        return self.dtype in FP8_DTYPES

    @property
    def out_dtype(self) -> torch.dtype | None:
        """An fp8 job's result dtype (what its transfers move); None: the inputs' own."""
        return fp8.DEFAULT_OUT_DTYPE if self.fp8 else None

    @property
    def plan_op(self) -> str:
        return CUSTOM_OP if self.op == OFFLOAD else self.op

    @property
    def transfer(self) -> str:
        """What the cache calls the callable op ("" for collectives)."""
        return HostOffload.__name__ if self.op == OFFLOAD else ""

    @property
    def shape(self) -> str:
        return f"{self.m}x{self.n}x{self.k}"


class Workload:
    """A job's inputs, plans and calls on this rank."""

    def __init__(self, job: Job):
        self.job = job
        self.group, self.rank, self.world = resolve_group(None)
        self.backend = registry.get(job.backend)
        self.device = current_device(job.device_type or self.backend.device_type or "cpu")
        gen = torch.Generator(device=self.device).manual_seed(job.seed + self.rank)
        self.scale_a = self.scale_b = None
        if job.fp8:  # e4m3 inputs with their scales; the result (what moves): job.out_dtype
            self.a, self.b, self.scale_a, self.scale_b = fp8.example_inputs(
                job.m, job.n, job.k, job.scaling, self.device, gen)
            dtype = job.out_dtype
        else:
            dtype = getattr(torch, job.dtype)
            self.a = torch.randn(job.m, job.k, generator=gen, device=self.device, dtype=dtype)
            self.b = (torch.randn(job.n, job.k, generator=gen, device=self.device, dtype=dtype)
                      / job.k ** 0.5).t()
        self.send = self.recv = None
        if job.op == "all_to_all" and self.world > 1:
            self.send = equal_splits(job.m, self.world)
            self.recv = [self.send[self.rank]] * self.world
        self.base = self._plan(job.plan_op)
        rows = of(job.plan_op).output_rows(job.m, self.world, self.recv)
        self.out = torch.empty(rows, job.n, dtype=dtype, device=self.device)
        # a custom op's plan returns all M rows, whatever the job's collective
        self.gemm_out = (self.out if rows == job.m
                         else torch.empty(job.m, job.n, dtype=dtype, device=self.device))
        self.op = (HostOffload(self.base.packed_numel, dtype, self.device.type != "cpu")
                   if job.op == OFFLOAD else job.op)
        self.context: Context = context_for(self.backend, self.device.type, self.group)

    def spec(self, op: str) -> OverlapSpec:
        send = tuple(self.send) if self.send and op == "all_to_all" else None
        job = self.job
        return OverlapSpec(job.m, job.n, job.k, op, self.world, job.dtype, self.device.type,
                           "col", send, dtype_name(job.out_dtype) if job.fp8 else None,
                           job.scaling)

    def _plan(self, op: str) -> Plan:
        return make_plan(self.backend, self.spec(op))

    @staticmethod
    def one_group(plan: Plan) -> Plan:
        """``plan`` with every tile in one group: the transfer after the whole GEMM."""
        return dataclasses.replace(plan, group_sizes=(plan.num_tiles,))

    def plan(self, group_sizes) -> Plan:
        return dataclasses.replace(self.base, group_sizes=tuple(group_sizes))

    def run(self, plan: Plan, op=None):
        op = op if op is not None else self.op
        out = self.gemm_out if plan.op == CUSTOM_OP else self.out  # the offload: all rows
        if self.scale_a is not None:  # (no all_to_all: Job refuses fp8 ones)
            return overlap_scaled(self.a, self.b, op, scale_a=self.scale_a, scale_b=self.scale_b,
                                  out_dtype=self.out.dtype, plan=plan, out=out,
                                  backend=self.backend.name)
        if plan.op == CUSTOM_OP:  # no splits
            return overlap(self.a, self.b, op, plan=plan, out=out, backend=self.backend.name)
        return overlap(self.a, self.b, op, plan=plan, out=out, send_splits=self.send,
                       recv_splits=self.recv, backend=self.backend.name)

    def trace(self, plan: Plan) -> TileTrace:
        call = OverlapCall(self.a, self.b, plan, self.op, self.group, self.rank, self.world,
                           self.out, tuple(self.recv) if self.recv else None, self.scale_a,
                           self.scale_b)
        if self.scale_a is not None and not self.backend.native_fp8:
            call = fp8.dequantized_call(call)  # what such a backend runs (api._make_prepared)
        return self.backend.trace(call)

    def time(self, fn) -> float:
        return median_time(fn, self.device, self.group, self.job.iters, self.job.warmup)

    @property
    def moved_dtype(self) -> torch.dtype:
        """What the transfers move: the result's dtype."""
        return self.out.dtype

    def output_bytes(self) -> int:
        return self.base.packed_numel * self.out.element_size()


@lru_cache(maxsize=1)
def workload(job: Job) -> Workload:
    """The job's workload on this rank, kept for the next step of the same job (its inputs and
    the offload's pinned buffer are made once)."""
    return Workload(job)


@dataclass(frozen=True)
class ModelParts:
    """What :func:`build_model` measured for a job (picklable, the same on every rank)."""

    plan: dict  # the heuristic plan (Plan.to_dict): tile, wave size, order of the tiles
    timing: GemmTiming
    cost: CostCurve
    contention: Contention
    sequential_s: float  # measured: the call with one group
    post_s: float  # sequential_s - the uncalibrated one-group prediction (signed)
    context: Context
    plain_s: float | None = None  # measured: the plain path (the device's GEMM, one collective)

    def model(self) -> OverlapModel:
        """The model, calibrated: its one-group prediction is the measured one-group call."""
        return OverlapModel.for_plan(Plan.from_dict(self.plan), self.timing, self.cost,
                                     self.contention, self.post_s)


def _cached_curve(cache: TuningCache, key: dict, work: Workload, refresh: bool, total: int,
                  measure) -> CostCurve:
    """The transfer's cost curve from the cache when every rank has one reaching ``total``
    bytes and ``refresh`` is off, else measured (and stored by rank 0)."""
    found = None if refresh else cache.get("curves", key)
    found = CostCurve.from_dict(found) if found is not None else None
    if agree(found is not None and found.max_bytes >= total, work.device, work.group):
        return found
    value = measure()
    if work.rank == 0:
        cache.put("curves", key, value.to_dict())
    return value


def calibration_groupings(model: OverlapModel) -> list[tuple[int, ...]]:
    """The groupings traced to fit the contention: one group per wave (transfers beside the
    whole GEMM: both slowdowns, and each group's lag or gap), and half of the waves in a first
    group, then one per wave (the next groups queue behind a long first transfer: gaps). None
    when the tiles fit in one wave (nothing can overlap)."""
    ends = [int(e) for e in model.boundaries()]
    if len(ends) < 2:
        return []
    half = ends[(len(ends) - 1) // 2]
    late = [half] + [e for e in ends if e > half]
    return list(dict.fromkeys(sizes_from_ends(e) for e in (ends, late)))


def build_model(job: Job, cache_path: str | None = None, refresh: bool = False) -> ModelParts:
    """Measure the model of ``job`` on this rank's device and group (all ranks together);
    reuses a cached cost curve of the transfer unless ``refresh``."""
    work, cache = workload(job), TuningCache(cache_path)
    plan, dev, group = work.base, work.device, work.group
    send = transfer_fn(work.op, group, work.world)
    moved = work.moved_dtype  # the result's dtype (an fp8 job's: job.out_dtype)
    itemsize, total = moved.itemsize, work.output_bytes()
    align = itemsize * (work.world if job.op in ("reduce_scatter", "all_to_all") else 1)
    key = transfer_key(work.context, transfer=job.transfer or job.op, world_size=work.world,
                       dtype=dtype_name(moved))
    cost = _cached_curve(cache, key, work, refresh, total, lambda: measure_curve(
        send, log_sizes(min(plan.tile[0] * plan.tile[1] * itemsize, total), total, align),
        moved, dev, group, job.iters, job.warmup))
    one_group = work.one_group(plan)
    work.run(one_group)  # warm-up: loads every kernel before anything is traced
    timing = gemm_timing(traced_calls(lambda: work.trace(one_group), dev, group,
                                      job.trace_reps), dev, group)
    bare = OverlapModel.for_plan(plan, timing, cost)
    fit = Contention()
    if send is not None and calibration_groupings(bare):
        traces = []
        for sizes in calibration_groupings(bare):
            calibrating = work.plan(sizes)
            work.run(calibrating)
            traces += traced_calls(lambda: work.trace(calibrating), dev, group, job.trace_reps)
        fit = contention(traces, bare, dev, group)
    plain = dataclasses.replace(plan, strategy=SEQUENTIAL)
    one_s, plain_s = (float(statistics.median(t)) for t in sample_times(
        [lambda: work.run(one_group), lambda: work.run(plain)], dev, group, job.rounds,
        job.iters, job.warmup, job.seed))
    raw = OverlapModel.for_plan(plan, timing, cost, fit)
    post = one_s - raw.simulate((raw.num_tiles,)).end
    return ModelParts(plan.to_dict(), timing, cost, fit, one_s, post, work.context, plain_s)


def sample_groupings(job: Job, groupings) -> list[list[float]]:
    """Seconds per call (slowest rank) of the job's call with each grouping (group sizes, or
    "sequential" for the plain path): ``job.rounds`` samples of ``job.iters`` back-to-back
    calls each, the groupings shuffled in every round (:func:`~.measure.sample_times`)."""
    work = workload(job)
    plans = [dataclasses.replace(work.base, strategy=SEQUENTIAL) if sizes == SEQUENTIAL
             else work.plan(sizes) for sizes in groupings]
    samples = sample_times([lambda p=p: work.run(p) for p in plans], work.device, work.group,
                           job.rounds, job.iters, job.warmup, job.seed)
    return samples.tolist()


def measure_groupings(job: Job, groupings) -> list[float]:
    """Measured seconds (median of :func:`sample_groupings`) of each grouping's call."""
    return [statistics.median(s) for s in sample_groupings(job, groupings)]


def tuned_plan(parts: ModelParts, choice: Choice, measured: dict | None = None) -> Plan:
    """The plan to store for the job: the fastest of the groupings in ``measured`` (grouping ->
    seconds, "sequential" for the plain path), unless the plain path measured faster
    (``measured``'s "sequential", else ``parts.plain_s``): then the plain path (strategy
    "sequential"), never slower than the GEMM followed by one collective. What was timed
    decides, whatever was predicted; with nothing timed (``measured`` None or empty), the
    predicted choice does (``choice.strategy``)."""
    base = Plan.from_dict(parts.plan)
    measured = dict(measured or {})
    plain = measured.pop(SEQUENTIAL, parts.plain_s)
    if measured:
        best = min(measured, key=measured.get)
        sequential = plain is not None and measured[best] >= plain
    else:
        best, sequential = choice.group_sizes, choice.strategy == SEQUENTIAL
    if sequential:
        return dataclasses.replace(base, group_sizes=(base.num_tiles,), strategy=SEQUENTIAL)
    return dataclasses.replace(base, group_sizes=tuple(best))


def store_plan(job: Job, parts: ModelParts, plan: Plan, cache_path: str | None = None,
               **info) -> dict:
    """Store ``plan`` as the job's tuned plan, where ``overlap`` looks it up (``info``: what
    else the entry records, e.g. measured times); returns the cache key."""
    key = plan_key(parts.context, dtype=job.dtype, m=job.m, n=job.n, k=job.k, op=job.plan_op,
                   world_size=plan.world_size, transfer=job.transfer, scaling=job.scaling)
    TuningCache(cache_path).put("plans", key, {"plan": plan.to_dict(), **info})
    return key


def trace_rank(job: Job, group_sizes=None) -> dict:
    """One traced call with ``group_sizes`` (default: the heuristic plan's), after a warm-up
    call: {"plan": Plan.to_dict(), "trace": TileTrace.to_dict()} of this rank."""
    work = workload(job)
    plan = work.plan(group_sizes) if group_sizes is not None else work.base
    work.run(plan)
    line_up(work.device, work.group)
    return {"plan": plan.to_dict(), "trace": work.trace(plan).to_dict()}
