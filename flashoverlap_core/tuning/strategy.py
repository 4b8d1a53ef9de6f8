"""Overlap or the plain path: the strategy of a default call, predicted on its first call.

A call without ``plan=`` whose tuning cache has no plan for it runs the overlapped plan only
where the model below predicts that it is faster than the plain path (the device's own GEMM,
then one collective on the whole result: ``Plan.strategy == "sequential"``). The prediction
needs no trial run of the call:

* :class:`GemmRates`: the device's own GEMM, measured once per (device, dtype, backend,
  versions) at three fixed shapes (a compute-bound one, a weight-streaming one at a few rows,
  a tiny one for the fixed cost): its arithmetic rate, its streaming rate and its fixed cost.
  The plain GEMM is predicted as a roofline of the three. The signaling GEMM is predicted wave
  by wave: a wave takes the longer of one tile's share of the arithmetic rate (a tile is
  computed whole, however few of its rows are real: why a few-token call gains nothing from
  128-row tiles) and its share of the streaming.
* a :class:`~.model.CostCurve` of the op's collective on the call's group, measured once per
  (device, backend, versions, collective library, world size, dtype, op) at a few sizes.
* the overlapped call is then :class:`~.model.OverlapModel` (or :class:`~.model.GatherModel`)
  on the default plan's grouping, with the contention the tuner fitted on this device when the
  cache has one, else :data:`ASSUMED_CONTENTION`; a plan of the tile layout adds its
  post-communication reorder (one read and write of the result at the streaming rate).

Both measurements are collective (every rank's slowest time counts), and whether to measure or
to take the cache's numbers is agreed first (rank 0's cached numbers when every rank has them),
so every rank predicts from the same numbers and makes the same choice. They are stored in the
tuning cache (section "rates"), keyed so that another device or library version never reuses
them. Later calls of a key pay nothing: the choice is part of the key's plan.

World size 1 with a collective op is always plain: there is nothing to overlap. A callable op
is always overlapped: the caller asked for its transfer. all_to_all at world size > 1: rows
differ by rank and by call, and its key holds none, so it is predicted on the plan of the
ranks' mean rows at the key's first call, split evenly (every rank's rows were exchanged in
the first call's agreement, so every rank predicts on the same plan); without those rows (a
caller that gives none) it is overlapped. The choice holds for the key's later calls, whatever
their rows: deciding per call would take a collective per call. ``FLASHOVERLAP_STRATEGY`` (``auto``,
``overlap``, ``plain``) overrides the choice of every default call; a tuned plan in the cache and
an explicit ``plan=`` are never overridden.

When a measurement fails, the fallback (:func:`fallback`) overlaps where M is at least
:data:`FALLBACK_MIN_ROWS` rows and runs plain below, and says so once in a warning.
"""
from __future__ import annotations

import logging
import os
import time
import warnings
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch

from ..collectives import all_gather_single, exchange_objects
from ..plan import FP8_DTYPES, Plan
from .cache import TuningCache, context_for
from .measure import device_time, measure_curve, transfer_fn
from .model import Contention, CostCurve, GatherModel, GemmTiming, OverlapModel

log = logging.getLogger("flashoverlap")

ENV_STRATEGY = "FLASHOVERLAP_STRATEGY"
CHOICES = ("auto", "overlap", "plain")
OVERLAP, PLAIN = "overlap", "sequential"  # Plan.strategy values
MIN_GAIN = 0.03  # overlap is chosen only when predicted at least 3% faster than plain
FALLBACK_MIN_ROWS = 1024
# Until the tuner has fitted this device's contention: the collective slowed by 20% while the
# GEMM runs (the GEMM's own slowdown is in its rate: a wave runs on the units it leaves free,
# GemmRates.signaling_timing), and a few microseconds between a group's last tile and its
# transfer (the device-side wait) and between two transfers. Refitted on two H200s over NVLink
# (bench/strategy_refit.py on strategy-w2-h200-20261204-174036.json: 88 of 90 rows within 3%
# of the faster strategy, against 83 with the earlier 10% each way and a wave's share).
ASSUMED_CONTENTION = Contention(gemm=1.0, comm=1.2, gap_s=4e-6, lag_s=4e-6)
RATES_FORMAT = 2  # 2: timed back to back as the device runs them (1: each from idle)


def requested() -> str:
    """``$FLASHOVERLAP_STRATEGY``: "auto" (default), "overlap" or "plain"."""
    value = os.environ.get(ENV_STRATEGY, "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"{ENV_STRATEGY} must be one of {', '.join(CHOICES)}, got {value!r}")
    return value


# ---- the device's GEMM ----------------------------------------------------------------------
@dataclass(frozen=True)
class GemmRates:
    """The device's own GEMM in one dtype: arithmetic rate (FLOP/s), streaming rate (bytes/s of
    operands and result) and fixed cost (s)."""

    flops_per_s: float
    bytes_per_s: float
    fixed_s: float
    processors: int = 0  # the device's compute units (SMs, cores); 0: unknown

    def __post_init__(self):
        if not (self.flops_per_s > 0 and self.bytes_per_s > 0 and self.fixed_s >= 0
                and self.processors >= 0):
            raise ValueError(f"GEMM rates must be positive, got {self}")

    def plain_s(self, m: int, n: int, k: int, in_size: int, out_size: int) -> float:
        """The device's GEMM of [m, k] x [k, n]: a roofline plus the fixed cost."""
        moved = (m * k + k * n) * in_size + m * n * out_size
        return self.fixed_s + max(2.0 * m * n * k / self.flops_per_s, moved / self.bytes_per_s)

    def signaling_timing(self, plan: Plan, in_size: int, out_size: int) -> GemmTiming:
        """When each wave of ``plan``'s signaling GEMM ends: a tile is computed whole at one
        compute unit's share of the arithmetic rate (1/processors: a wave that leaves units to
        the collectives runs on fewer of them, each no faster; 1/wave_size where the count is
        unknown); the operands stream at most at the streaming rate."""
        tm, tn = plan.tile[0], plan.tile[1]
        waves = plan.num_waves
        rows = sum(plan.block_rows) if plan.block_rows else plan.m
        moved = (rows * plan.k + plan.k * plan.n) * in_size + rows * plan.n * out_size
        units = max(plan.wave_size, self.processors)
        per_tile = 2.0 * tm * tn * plan.k * units / self.flops_per_s
        wave_s = max(per_tile, moved / self.bytes_per_s / waves)
        ends = self.fixed_s + wave_s * np.arange(1, waves + 1)
        return GemmTiming(plan.wave_size, tuple(float(e) for e in ends))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "GemmRates":
        return cls(float(d["flops_per_s"]), float(d["bytes_per_s"]), float(d["fixed_s"]),
                   int(d.get("processors", 0)))


def _calibration_shapes(device: torch.device) -> dict[str, tuple[int, int, int]]:
    if device.type == "cpu":  # seconds, not minutes, on a host
        return {"compute": (512, 512, 512), "stream": (4, 2048, 2048), "fixed": (8, 64, 64)}
    return {"compute": (4096, 4096, 4096), "stream": (8, 8192, 8192), "fixed": (8, 128, 128)}


def _gemm_fn(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device):
    """The plain path's GEMM at [m, k] x [k, n]: torch.matmul, or torch._scaled_mm for fp8 where
    the device has it (else the float32 GEMM the dequantized plain path runs)."""
    if dtype.itemsize == 1 and device.type != "cpu" and hasattr(torch, "_scaled_mm"):
        a = torch.randn(m, k, device=device).to(dtype)
        b = torch.randn(n, k, device=device).to(dtype).t()
        one = torch.ones((), device=device)
        try:
            torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
            return lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one,
                                            out_dtype=torch.bfloat16)
        except (RuntimeError, TypeError):
            pass
    if dtype.itemsize == 1:
        dtype = torch.float32
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    return lambda: torch.matmul(a, b)


def measure_rates(dtype: torch.dtype, device: torch.device, group) -> GemmRates:
    """Measure the device's GEMM (collective: the slowest rank's times, so all ranks agree)."""
    shapes = _calibration_shapes(device)
    seconds = {}
    for name, (m, n, k) in shapes.items():
        seconds[name] = max(device_time(_gemm_fn(m, n, k, dtype, device), device, group,
                                        rounds=3, warmup=2), 1e-9)
    fixed = seconds["fixed"]
    size = max(dtype.itemsize, 2)
    m, n, k = shapes["compute"]
    flops = 2.0 * m * n * k / max(seconds["compute"] - fixed, 1e-9)
    m, n, k = shapes["stream"]
    moved = (m * k + k * n) * size + m * n * size
    stream = moved / max(seconds["stream"] - fixed, 1e-9)
    return GemmRates(flops, stream, fixed, processors(device))


def processors(device: torch.device) -> int:
    """The compute units of ``device`` as its device module reports them (0: not reported)."""
    if device.type == "cpu":
        return 0
    try:
        props = torch.get_device_module(device.type).get_device_properties(device)
    except (AttributeError, RuntimeError, AssertionError):
        return 0
    return int(getattr(props, "multi_processor_count", 0) or 0)


# ---- the collective --------------------------------------------------------------------------
CURVE_SIZES = (1 << 16, 1 << 20, 1 << 23, 1 << 26)  # bytes: 64 KiB .. 64 MiB
CPU_CURVE_SIZES = (1 << 12, 1 << 16, 1 << 20)


def _transfer(op: str, group, world: int):
    if op == "allgather":  # the gathered bytes, as GatherModel's cost curve counts them
        return lambda region: all_gather_single(region, region[:region.numel() // world],
                                                group=group)
    return transfer_fn(op, group, world)


def curve_sizes(device: torch.device, world: int) -> list[int]:
    """The byte sizes a collective's cost curve is measured at on ``device``: multiples of 16
    bytes per rank, so that every op splits each evenly."""
    align = world * 16
    sizes = CPU_CURVE_SIZES if device.type == "cpu" else CURVE_SIZES
    return sorted({max(align, s // align * align) for s in sizes})


def measure_collective(op: str, dtype: torch.dtype, device: torch.device, group,
                       world: int) -> CostCurve:
    """The op's collective on ``group`` at a few sizes (well under a second)."""
    return measure_curve(_transfer(op, group, world), curve_sizes(device, world), dtype, device,
                         group, iters=3, warmup=2)


# ---- the facts of a group, agreed --------------------------------------------------------------
_memo: dict = {}
_warned: set = set()


def _rates_key(ctx, *, what: str, dtype: str, world: int, op: str = "") -> dict:
    return {**ctx.key(), "what": what, "dtype": dtype, "world_size": world, "op": op,
            "format": RATES_FORMAT}


def group_facts(plan: Plan, backend, group, device: torch.device,
                cache: TuningCache | None = None) -> tuple[GemmRates, CostCurve]:
    """The GEMM rates and the collective's cost curve for ``plan``'s call on ``group``: from
    this process's memory, else agreed from the ranks' caches, else measured (collectively)."""
    ctx = context_for(backend, device.type, group)
    moved = plan.moved_dtype
    dtype_name = str(plan.dtype)
    world = plan.world_size
    rates_key = _rates_key(ctx, what="gemm", dtype=dtype_name, world=world)
    curve_key = _rates_key(ctx, what="collective", dtype=str(moved).replace("torch.", ""),
                           world=world, op=plan.op)
    memo_key = (repr(rates_key), repr(curve_key), id(group))
    if memo_key in _memo:
        return _memo[memo_key]
    cache = cache or TuningCache()
    mine = (cache.get("rates", rates_key), cache.get("rates", curve_key))
    views = exchange_objects(mine, group) if group is not None and world > 1 else [mine]
    first = views[0]
    if all(v[0] is not None for v in views):
        rates = GemmRates.from_dict(first[0])
    else:
        rates = measure_rates(_torch_dtype(dtype_name), device, group)
        cache.put("rates", rates_key, rates.to_dict())
    if all(v[1] is not None for v in views):
        curve = CostCurve.from_dict(first[1])
    else:
        curve = measure_collective(plan.op, moved, device, group, world)
        cache.put("rates", curve_key, curve.to_dict())
    _memo[memo_key] = (rates, curve)
    return rates, curve


def _torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def forget() -> None:
    """Drop the facts measured in this process (the disk cache stays)."""
    _memo.clear()


# ---- the prediction ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Prediction:
    """The strategy of a call and why: both predicted durations (seconds; None when not
    predicted) and a short reason."""

    strategy: str
    overlap_s: float | None
    plain_s: float | None
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)


def assumed_contention(op: str | None = None) -> Contention:
    """The contention assumed for ``op`` until the tuner fits one: :data:`ASSUMED_CONTENTION`,
    with all_to_all's GEMM slowed by 10% more (its "destinations" plans run one block of rows
    per destination, each ending in a partial wave: on two H200s its overlapped call measured
    10-17% above the model at 1024-16384 rows, where the other ops' were within a few percent;
    bench/results/strategy-w2-h200-20261204-174529.json)."""
    if op == "all_to_all":
        return replace(ASSUMED_CONTENTION, gemm=ASSUMED_CONTENTION.gemm * 1.1)
    return ASSUMED_CONTENTION


def fitted_contention(backend, device: torch.device, group, cache: TuningCache,
                      op: str | None = None) -> Contention:
    """The contention the tuner fitted on this device and group, else the one assumed for
    ``op``."""
    ctx = context_for(backend, device.type, group).key()
    for entry in cache.entries("contention"):
        if all(entry["key"].get(k) == v for k, v in ctx.items()):
            try:
                return Contention.from_dict(entry["value"])
            except (KeyError, TypeError, ValueError):
                continue
    return assumed_contention(op)


def predict(plan: Plan, rates: GemmRates, curve: CostCurve,
            contention: Contention = ASSUMED_CONTENTION) -> Prediction:
    """Overlapped ``plan`` against the plain path, from the rates and the collective's curve."""
    in_size = torch.empty((), dtype=_torch_dtype(str(plan.dtype))).element_size()
    out_size = plan.result_dtype.itemsize
    timing = rates.signaling_timing(plan, in_size, out_size)
    if plan.op == "allgather":
        gathered_rows = plan.shard_rows * plan.world_size
        plain = (curve(plan.shard_rows * plan.k * in_size * plan.world_size)
                 + rates.plain_s(gathered_rows, plan.n, plan.k, in_size, out_size))
        model = GatherModel.for_plan(plan, timing, curve, contention)
    else:
        model = OverlapModel.for_plan(plan, timing, curve, contention)
        result_bytes = int(model.prefix_bytes[-1])
        plain = rates.plain_s(plan.m, plan.n, plan.k, in_size, out_size) + curve(result_bytes)
        if plan.layout != "rows":  # the post-communication reorder: one read and write
            model = replace(model, post_s=2.0 * result_bytes / rates.bytes_per_s)
    # (an all_to_all plan's destination chunks may hold no tiles at a few rows: they move nothing)
    overlap = model.predict([g for g in plan.group_sizes if g])
    plain, overlap = float(plain), float(overlap)
    if overlap <= plain * (1.0 - MIN_GAIN):
        return Prediction(OVERLAP, overlap, plain, "overlap predicted faster")
    return Prediction(PLAIN, overlap, plain, "the plain path predicted no slower")


def fixed_choice(plan: Plan, predicted_rows: bool = True) -> Prediction | None:
    """The choice that needs no prediction: a callable op overlaps, world size 1 is plain, and
    ``$FLASHOVERLAP_STRATEGY`` when it is not "auto"; an all_to_all key overlaps when no plan
    of expected rows is given to predict on (``predicted_rows`` False)."""
    asked = requested()
    if plan.op == "custom":
        return Prediction(OVERLAP, None, None, "a callable op is always overlapped")
    if asked == "overlap":
        return Prediction(OVERLAP, None, None, f"{ENV_STRATEGY}=overlap")
    if asked == "plain":
        return Prediction(PLAIN, None, None, f"{ENV_STRATEGY}=plain")
    if plan.world_size == 1:
        return Prediction(PLAIN, None, None, "world size 1: nothing to overlap")
    if plan.kind.splits and not predicted_rows:  # the key's plan holds no rows to predict on
        return Prediction(OVERLAP, None, None, "all_to_all at world size > 1 without the ranks' "
                          "expected rows: overlapped")
    return None


def fallback(plan: Plan, error: BaseException) -> Prediction:
    """The documented choice when measuring failed (warned once per kind of failure)."""
    what = f"{type(error).__name__}: {error}"
    if what not in _warned:
        _warned.add(what)
        warnings.warn(f"flashoverlap: could not measure the device or collective to choose "
                      f"between overlap and the plain path ({what}); overlapping where M >= "
                      f"{FALLBACK_MIN_ROWS}, plain below", RuntimeWarning, stacklevel=3)
    rows = plan.m if plan.op != "allgather" else plan.shard_rows * plan.world_size
    strategy = OVERLAP if rows >= FALLBACK_MIN_ROWS else PLAIN
    return Prediction(strategy, None, None, f"fallback after a failed measurement ({what})")


def choose(plan: Plan, backend, group, device: torch.device,
           cache: TuningCache | None = None, predict_on: Plan | None = None
           ) -> tuple[Plan, Prediction]:
    """``plan`` with its predicted strategy, and the prediction. Collective over ``group`` at a
    group's first prediction of an op and dtype (the agreement, and a measurement when some
    rank has no cached numbers); local afterwards. ``predict_on``: the plan whose times are
    predicted (an all_to_all key's: that of the ranks' mean rows), else ``plan``."""
    fixed = fixed_choice(plan, predict_on is not None or not plan.kind.splits)
    if fixed is None:
        began = time.perf_counter()
        cache = cache or TuningCache()
        on = predict_on or plan
        try:
            rates, curve = group_facts(on, backend, group, device, cache)
            fixed = predict(on, rates, curve,
                            fitted_contention(backend, device, group, cache, on.op))
        except (RuntimeError, ValueError, OSError) as e:
            fixed = fallback(on, e)
        log.debug("flashoverlap: strategy %s in %.2f ms", fixed.strategy,
                  1e3 * (time.perf_counter() - began))
    if fixed.strategy == PLAIN and requested() != "plain" and not plain_gemm_native(plan, device):
        fixed = Prediction(OVERLAP, None, None, "torch's fp8 GEMM does not take this K and N "
                           "(this device's wants multiples of 16): the plain path would run dequantized")
    if fixed.strategy != plan.strategy:
        plan = replace(plan, strategy=fixed.strategy)
    return plan, fixed


def plain_gemm_native(plan: Plan, device: torch.device) -> bool:
    """Whether the plain path's GEMM is torch's own fp8 kernel for an fp8 (tensor-wise or
    row-wise) plan: False where torch's ``_scaled_mm`` refuses the shape, and the plain path
    would run the dequantized product in float32. Always True for other plans."""
    if plan.dtype not in FP8_DTYPES or plan.scaling is not None:
        return True
    from ..fp8 import scaled_mm_takes

    return scaled_mm_takes(device, getattr(torch, plan.dtype), plan.k, plan.n, True,
                           plan.result_dtype)


class StrategyChoice:
    """What the API asks (``planning.set_strategy``): how this rank would choose a default
    plan's strategy, and the choice itself."""

    def mode(self, plan: Plan) -> str:
        fixed = fixed_choice(plan)
        return fixed.strategy if fixed is not None else "predict"

    def decide(self, plan: Plan, backend, group, device: torch.device,
               predict_on: Plan | None = None) -> tuple[Plan, dict]:
        chosen, prediction = choose(plan, backend, group, device, predict_on=predict_on)
        return chosen, prediction.to_dict()
