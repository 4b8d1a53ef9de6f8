"""The timing model of an overlapped call, and its simulation.

Four measured pieces (see :mod:`~flashoverlap_core.tuning.measure` and :mod:`.tuner`):

* :class:`GemmTiming`: when each wave of the GEMM ends, the GEMM alone on the device (no
  transfer beside it), from traced calls. A group can be sent once its last wave has ended.
* :class:`CostCurve`: how long one transfer (collective or custom op) of a region takes by
  itself, against the region's bytes.
* :class:`Contention`: what running in one call costs, fitted to traced overlapped calls
  (:func:`fit_contention`): each side's slowdown while both run, as rate ratios (beside a
  transfer the GEMM advances ``1/gemm`` of a second of its own work per second, a transfer
  beside the GEMM ``1/comm``), and the communication stream's fixed delays -- ``gap_s`` from
  one transfer's end to the next one's start when that group was already finished (the wait is
  passed at once), ``lag_s`` from a group's last tile to its transfer's start when the stream
  was already waiting for it.
* ``post_s``: the rest of the call (post-communication reorder, fixed overhead), calibrated so
  that the one-group prediction is the measured one-group call; signed, since a trace's origin
  may lie before the device starts the GEMM in a measured call (host launch time that
  back-to-back calls hide), and measurements on a busy host disagree. A positive ``post_s`` is
  added to every prediction; a negative one scales every prediction by the measured one-group
  call over its simulation instead (:func:`calibrate`): taken off as a shift, it could exceed
  what a well-overlapped grouping is simulated to take and predict no time at all.

:class:`OverlapModel` joins them for one plan's tile grid and predicts the duration of a call
for any grouping. The order of the groups matters through the GEMM: group g's transfer starts
once its tiles are finished and transfer g-1 has ended (plus the stream's delay), and while a
transfer runs the GEMM is slowed, which makes every later group ready later; so where the
large groups sit decides how long the transfers wait and how long both run together.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np
import torch

from ..plan import group_unit

MAX_SLOWDOWN = 8.0  # contention factors are clipped here (a fit with almost no overlap)
CLOCK_SLACK_S = 5e-6  # traces: tile and transfer stamps closer than this are not ordered


@dataclass(frozen=True)
class CostCurve:
    """Seconds one transfer takes against the bytes of the region it moves.

    Between measured sizes the time is interpolated linearly; below the smallest it is the
    smallest size's time (the fixed latency dominates there); above the largest it grows at
    the bandwidth of the last segment. Noise that makes a larger size faster is ironed out.
    """

    sizes: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self):
        if not self.sizes or len(self.sizes) != len(self.seconds):
            raise ValueError(f"a cost curve needs as many sizes as times (>= 1), got "
                             f"{len(self.sizes)} and {len(self.seconds)}")
        if any(b <= a for a, b in zip(self.sizes, self.sizes[1:])) or self.sizes[0] < 0:
            raise ValueError(f"cost curve sizes must be increasing and >= 0, got {self.sizes}")
        if any(s < 0 for s in self.seconds):
            raise ValueError(f"cost curve times must be >= 0, got {self.seconds}")

    @classmethod
    def free(cls) -> "CostCurve":
        """The cost of a transfer that does nothing (world size 1 without a process group)."""
        return cls((0,), (0.0,))

    @classmethod
    def affine(cls, latency_s: float, bytes_per_s: float, max_bytes: int) -> "CostCurve":
        """latency + bytes / bandwidth, sampled at 0 and ``max_bytes`` (for synthetic models)."""
        return cls((0, max_bytes), (latency_s, latency_s + max_bytes / bytes_per_s))

    @cached_property
    def _points(self) -> tuple[np.ndarray, np.ndarray, float]:
        x = np.asarray(self.sizes, dtype=np.float64)
        y = np.maximum.accumulate(np.asarray(self.seconds, dtype=np.float64))
        if len(x) == 1:
            slope = y[0] / x[0] if x[0] > 0 else 0.0
        else:
            slope = (y[-1] - y[-2]) / (x[-1] - x[-2])
        return x, y, slope

    def __call__(self, nbytes):
        """Seconds for regions of ``nbytes`` (a number or an array of them)."""
        x, y, slope = self._points
        b = np.asarray(nbytes, dtype=np.float64)
        out = np.interp(b, x, y) + np.maximum(b - x[-1], 0.0) * slope
        return float(out) if out.ndim == 0 else out

    @property
    def max_bytes(self) -> int:
        return self.sizes[-1]

    def to_dict(self) -> dict:
        return {"sizes": list(self.sizes), "seconds": list(self.seconds)}

    @classmethod
    def from_dict(cls, d: dict) -> "CostCurve":
        return cls(tuple(int(s) for s in d["sizes"]), tuple(float(s) for s in d["seconds"]))


@dataclass(frozen=True)
class Contention:
    """What the GEMM and the transfers cost each other in one call (see the module docstring):
    slowdowns (>= 1; 1 = none) and the communication stream's delays (seconds, >= 0)."""

    gemm: float = 1.0
    comm: float = 1.0
    gap_s: float = 0.0
    lag_s: float = 0.0

    def __post_init__(self):
        if not (self.gemm >= 1.0 and self.comm >= 1.0):
            raise ValueError(f"contention factors must be >= 1, got gemm={self.gemm}, "
                             f"comm={self.comm}")
        if not (self.gap_s >= 0.0 and self.lag_s >= 0.0):
            raise ValueError(f"stream delays must be >= 0, got gap_s={self.gap_s}, "
                             f"lag_s={self.lag_s}")

    def to_dict(self) -> dict:
        return {"gemm": self.gemm, "comm": self.comm, "gap_s": self.gap_s, "lag_s": self.lag_s}

    @classmethod
    def from_dict(cls, d: dict) -> "Contention":
        return cls(float(d["gemm"]), float(d["comm"]), float(d.get("gap_s", 0.0)),
                   float(d.get("lag_s", 0.0)))


@dataclass(frozen=True)
class GemmTiming:
    """When each wave of the GEMM ends (seconds from the call's start, running maximum), the
    GEMM alone on the device, for one kernel configuration, wave size and shape."""

    wave_size: int
    wave_ends: tuple[float, ...]

    def __post_init__(self):
        if not self.wave_ends or self.wave_size < 1:
            raise ValueError("a GEMM timing needs a wave size >= 1 and at least one wave")

    @classmethod
    def from_traces(cls, traces) -> "GemmTiming":
        """The median over several traces of the same plan, wave by wave."""
        traces = list(traces)
        if not traces:
            raise ValueError("GemmTiming.from_traces needs at least one trace")
        ends = np.median(np.array([t.wave_ends() for t in traces]), axis=0)
        return cls(traces[0].wave_size, tuple(float(e) for e in np.maximum.accumulate(ends)))

    @property
    def end(self) -> float:
        return self.wave_ends[-1]

    @property
    def num_waves(self) -> int:
        return len(self.wave_ends)

    def ready(self, tiles):
        """When the first ``tiles`` tiles (execution order) are all finished (array-friendly)."""
        index = (np.asarray(tiles) - 1) // self.wave_size
        return np.asarray(self.wave_ends)[np.clip(index, 0, self.num_waves - 1)]

    def to_dict(self) -> dict:
        return {"wave_size": self.wave_size, "wave_ends": list(self.wave_ends)}

    @classmethod
    def from_dict(cls, d: dict) -> "GemmTiming":
        return cls(int(d["wave_size"]), tuple(float(e) for e in d["wave_ends"]))


def advance_transfer(t, gemm_done, ready, work, gemm_end, contention: Contention):
    """One group's transfer under the model; works on scalars and numpy arrays.

    ``t``: when the previous transfer ended (0 for the first group); ``gemm_done``: the GEMM's
    progress then, in seconds of GEMM-alone work; ``ready``: the progress at which the group's
    tiles are finished; ``work``: the transfer's cost alone. Until the transfer starts the GEMM
    runs alone; then both run, each slowed, until one of them ends. Returns (start, progress at
    start, end, progress at end). Starting later, or with less progress, never ends earlier or
    with more progress while ``gemm * (1 - 1/comm) <= 1`` (running both together beats running
    them one after the other); the dynamic program of :mod:`.search` relies on it.
    """
    k = contention
    t = np.asarray(t, dtype=np.float64)
    done = np.asarray(gemm_done, dtype=np.float64)
    idle = np.where(done < ready, np.maximum(k.gap_s, ready - done + k.lag_s), k.gap_s)
    start = t + idle
    done = np.minimum(done + idle, gemm_end)  # the GEMM runs alone meanwhile
    both = np.minimum(work * k.comm, np.maximum(gemm_end - done, 0.0) * k.gemm)
    end = start + both + (work - both / k.comm)
    return start, done, end, done + both / k.gemm


@dataclass(frozen=True)
class PredictedGroup:
    ready: float  # GEMM-alone seconds of work after which its tiles are finished
    ready_at: float  # when that is, in the call (later than ``ready`` when the GEMM was slowed)
    start: float
    end: float


@dataclass(frozen=True)
class PredictedCall:
    """A predicted call (before ``post_s``): every group's transfer, and the GEMM's progress
    over time as the breakpoints of a piecewise-linear, non-decreasing curve."""

    groups: tuple[PredictedGroup, ...]
    times: np.ndarray = field(compare=False)
    progress: np.ndarray = field(compare=False)

    @property
    def end(self) -> float:
        return self.groups[-1].end

    def when(self, progress):
        """When the GEMM reached ``progress`` seconds of its own work (array-friendly)."""
        return _when(self.times, self.progress, progress)


def calibrate(simulated: float, one_group: float, post_s: float) -> float:
    """A prediction from a simulated duration: ``post_s`` added when it is >= 0, else the
    duration scaled by ``(one_group + post_s) / one_group`` (``one_group``: the simulated
    one-group call), which gives the same one-group prediction and stays positive."""
    if post_s >= 0 or one_group <= 0:
        return max(simulated + post_s, 0.0)
    return simulated * max(one_group + post_s, 0.0) / one_group


def _when(times, progress, value):
    rising = np.concatenate([[True], np.diff(progress) > 0])
    return np.interp(value, progress[rising], times[rising])


@dataclass(frozen=True)
class OverlapModel:
    """Predicts an overlapped call's duration for any grouping of one plan's tiles."""

    timing: GemmTiming
    prefix_bytes: np.ndarray = field(compare=False)  # bytes of the first t tiles, t = 0..T
    cost: CostCurve
    contention: Contention = Contention()
    post_s: float = 0.0
    unit: int = 1  # group boundaries fall on multiples of this (plan.group_unit), or at the end

    @classmethod
    def for_plan(cls, plan, timing: GemmTiming, cost: CostCurve,
                 contention: Contention = Contention(), post_s: float = 0.0) -> "OverlapModel":
        """The model of ``plan``'s tile grid (its grouping does not matter)."""
        return cls(timing, prefix_bytes(plan), cost, contention, post_s,
                   group_unit(plan.op, plan.world_size, plan.n, plan.tile, plan.layout, plan.schedule))

    @property
    def num_tiles(self) -> int:
        return len(self.prefix_bytes) - 1

    def boundaries(self) -> np.ndarray:
        """Where a group may end: each wave's end, rounded down to a multiple of ``unit``
        tiles; always including the last tile."""
        waves = -(-self.num_tiles // self.timing.wave_size)
        ends = np.minimum(np.arange(1, waves + 1) * self.timing.wave_size, self.num_tiles)
        ends = ends // self.unit * self.unit
        return np.unique(np.append(ends[ends > 0], self.num_tiles))

    def works(self, group_sizes) -> np.ndarray:
        """Each group's transfer cost alone (seconds)."""
        sizes = np.asarray(group_sizes, dtype=np.int64)
        if sizes.sum() != self.num_tiles or (sizes < 1).any():
            raise ValueError(f"group sizes {list(group_sizes)} do not partition "
                             f"{self.num_tiles} tiles")
        ends = np.concatenate([[0], np.cumsum(sizes)])
        return np.atleast_1d(self.cost(np.diff(self.prefix_bytes[ends])))

    def simulate(self, group_sizes) -> PredictedCall:
        """The predicted call with this grouping (before ``post_s``)."""
        works = self.works(group_sizes)
        readies = self.timing.ready(np.cumsum(group_sizes))
        t, done, spans, slow = 0.0, 0.0, [], self.contention.gemm
        times, progress = [0.0], [0.0]
        for ready, work in zip(readies, works):
            start, at_start, end, after = (float(x) for x in advance_transfer(
                t, done, float(ready), float(work), self.timing.end, self.contention))
            # alone until the start (flat once the GEMM is done), then slowed beside the transfer
            times += [t + (at_start - done), start, start + (after - at_start) * slow]
            progress += [at_start, at_start, after]
            spans.append((float(ready), start, end))
            t, done = end, after
        times, progress = np.array(times), np.array(progress)
        ready_at = _when(times, progress, [r for r, _, _ in spans])
        return PredictedCall(tuple(PredictedGroup(r, float(a), s, e)
                                   for (r, s, e), a in zip(spans, ready_at)), times, progress)

    # the state of the search (:func:`~.search.best_ends`): two numbers, lower is better
    def initial(self) -> tuple[float, float]:
        """Before the first group: (when the last transfer ended, -the GEMM's progress)."""
        return 0.0, 0.0

    def step(self, previous, ended, behind, tiles: int):
        """The state after one more group, from the tile count ``previous`` (arrays of states)
        up to ``tiles``: (when its transfer ends, -the GEMM's progress then)."""
        work = self.cost(self.prefix_bytes[tiles] - self.prefix_bytes[previous])
        _, _, end, done = advance_transfer(ended, -np.asarray(behind), self.timing.ready(tiles),
                                           work, self.timing.end, self.contention)
        return end, -done

    def schedule(self, group_sizes) -> list[PredictedGroup]:
        """Predicted ready, start and end of every group's transfer."""
        return list(self.simulate(group_sizes).groups)

    def predict(self, group_sizes) -> float:
        """Predicted seconds of the whole call with this grouping (:func:`calibrate`)."""
        return calibrate(self.simulate(group_sizes).end, self._one_group, float(self.post_s))

    @cached_property
    def _one_group(self) -> float:
        return self.simulate((self.num_tiles,)).end

    def sequential(self) -> float:
        """Predicted seconds with one group: the GEMM, then one transfer (no overlap)."""
        return self.predict((self.num_tiles,))

    def calibrated(self, one_group_s: float) -> "OverlapModel":
        """This model with ``post_s`` set so that the one-group prediction is ``one_group_s``
        (a measured one-group call)."""
        raw = self.simulate((self.num_tiles,)).end
        return replace(self, post_s=float(one_group_s - raw))


@dataclass(frozen=True)
class GatherModel:
    """Predicts an allgather call (the collective feeds the GEMM) for any grouping into chunks.

    Every chunk's gather is launched at once, in group order, back to back on the
    communication stream (``gap_s`` between two); the GEMM first computes the rank's own
    shard's tiles, which need nothing, then group by group the other shards' tiles, each group
    once its chunk has arrived (``lag_s`` after). The GEMM's speed is its alone speed per wave
    of tiles, every wait starting a new wave; the last group's computation is always exposed
    (the mirror image of the output-side ops, whose last transfer is). The slowdowns of
    :class:`Contention` are not modelled here: no backend traces an allgather GEMM yet to fit
    them to.
    """

    timing: GemmTiming  # the GEMM alone (its wave time)
    prefix_bytes: np.ndarray = field(compare=False)  # gathered bytes of the first t tiles' bands
    cost: CostCurve  # one chunk's all-gather, against the gathered bytes
    world_size: int
    contention: Contention = Contention()
    post_s: float = 0.0
    unit: int = 1  # tiles of one row band of every shard: groups are whole bands

    @classmethod
    def for_plan(cls, plan, timing: GemmTiming, cost: CostCurve,
                 contention: Contention = Contention(), post_s: float = 0.0) -> "GatherModel":
        """The model of an allgather ``plan``'s grid (its grouping does not matter)."""
        itemsize = torch.empty((), dtype=plan.moved_dtype).element_size()
        unit = group_unit(plan.op, plan.world_size, plan.n, plan.tile)
        rows = np.minimum(np.arange(plan.num_tiles + 1) / unit * plan.tile[0], plan.shard_rows)
        gathered = (rows * plan.k * itemsize * plan.world_size).astype(np.int64)
        return cls(timing, gathered, cost, plan.world_size, contention, post_s, unit)

    @property
    def num_tiles(self) -> int:
        return len(self.prefix_bytes) - 1

    def boundaries(self) -> np.ndarray:
        """Where a chunk may end: after every row band."""
        return np.arange(self.unit, self.num_tiles + 1, self.unit)

    def compute(self, tiles):
        """GEMM-alone seconds for ``tiles`` tiles started together (whole waves)."""
        t = self.timing
        wave_s = (t.end - t.wave_ends[0]) / (t.num_waves - 1) if t.num_waves > 1 else t.end
        return -(-np.asarray(tiles) // t.wave_size) * wave_s

    def initial(self) -> tuple[float, float]:
        """(when the GEMM is free, when the last chunk launched so far arrives): the own
        shard's tiles first, from the GEMM's start (its first wave's end less a wave)."""
        t = self.timing
        start = t.wave_ends[0] - float(self.compute(1)) if t.num_waves > 1 else 0.0
        return start + float(self.compute(self.num_tiles // self.world_size)), 0.0

    def step(self, previous, free, arrived, tiles: int):
        """The state after one more chunk, from tile count ``previous`` up to ``tiles``."""
        previous = np.asarray(previous)
        k = self.contention
        moved = self.cost(self.prefix_bytes[tiles] - self.prefix_bytes[previous])
        arrived = np.asarray(arrived) + np.where(previous > 0, k.gap_s, 0.0) + moved
        remote = (tiles - previous) * (self.world_size - 1) // self.world_size
        return np.maximum(free, arrived + k.lag_s) + self.compute(remote), arrived

    def predict(self, group_sizes) -> float:
        """Predicted seconds of the whole call with this grouping."""
        sizes = np.asarray(group_sizes, dtype=np.int64)
        if sizes.sum() != self.num_tiles or (sizes < 1).any() or (sizes % self.unit).any():
            raise ValueError(f"group sizes {list(group_sizes)} are not whole row bands "
                             f"({self.unit} tiles) partitioning {self.num_tiles} tiles")
        return calibrate(self._simulate(sizes), self._one_group, float(self.post_s))

    def _simulate(self, sizes) -> float:
        free, arrived = self.initial()
        previous = 0
        for end in np.cumsum(sizes):
            free, arrived = self.step(previous, free, arrived, int(end))
            previous = int(end)
        return float(free)

    @cached_property
    def _one_group(self) -> float:
        return self._simulate((self.num_tiles,))

    def sequential(self) -> float:
        """Predicted seconds with one chunk: the whole gather, then the other shards' tiles."""
        return self.predict((self.num_tiles,))


def prefix_bytes(plan) -> np.ndarray:
    """Bytes of the first t tiles of ``plan``'s execution order, t = 0..T."""
    itemsize = torch.empty((), dtype=plan.moved_dtype).element_size()
    numel = np.fromiter((t.numel for t in plan.grid.execution_order), dtype=np.int64)
    return np.concatenate([[0], np.cumsum(numel)]) * itemsize


# ---- fitting the contention to traced calls ----------------------------------------------------
def slowdown(alone: float, span: float, overlap: float) -> float:
    """Rate-model slowdown of a job taking ``alone`` seconds by itself and ``span`` seconds
    with ``overlap`` of them beside the other job: overlap/f + (span - overlap) = alone."""
    extra = span - alone
    if overlap <= 0 or extra <= 0:
        return 1.0
    if overlap <= extra:
        return MAX_SLOWDOWN
    return float(min(MAX_SLOWDOWN, overlap / (overlap - extra)))


@dataclass
class _Samples:
    gemm: list = field(default_factory=list)  # one slowdown per trace
    overlap: list = field(default_factory=list)  # per transfer: seconds beside the GEMM
    excess: list = field(default_factory=list)  # per transfer: duration - cost alone
    gaps: list = field(default_factory=list)
    lags: list = field(default_factory=list)

    def add(self, trace, timing: GemmTiming, works: np.ndarray) -> None:
        start = np.array(trace.transfer_start, dtype=np.float64)
        end = np.array(trace.transfer_end, dtype=np.float64)
        ready = np.array(trace.group_ready())
        gemm_end = trace.gemm_end
        beside = np.clip(np.minimum(end, gemm_end) - start, 0.0, None)
        self.gemm.append(slowdown(timing.end, gemm_end, float(beside.sum())))
        self.overlap += list(beside)
        self.excess += list(end - start - works)
        previous = np.concatenate([[-np.inf], end[:-1]])
        chained = ready < previous - CLOCK_SLACK_S  # finished before the stream got to it
        waited = ready > previous + CLOCK_SLACK_S
        self.gaps += list(start[chained] - previous[chained])
        self.lags += list(start[waited] - ready[waited])

    def contention(self) -> Contention:
        o, x = np.array(self.overlap), np.array(self.excess)
        # What a transfer takes in the call beyond its cost alone, where the GEMM had ended
        # (the stream's own cost, folded into its delays below); needs two such transfers.
        alone = o <= CLOCK_SLACK_S
        extra = float(np.median(x[alone])) if alone.sum() >= 2 else 0.0
        # the rest of the excess = overlap * (1 - 1/comm): least squares through the origin
        slope = float(o @ (x - extra) / (o @ o)) if (o @ o) > 0 else 0.0
        comm = 1.0 / (1.0 - slope) if 0.0 < slope < 1.0 - 1.0 / MAX_SLOWDOWN else \
            (MAX_SLOWDOWN if slope > 0 else 1.0)
        return Contention(float(np.median(self.gemm)), comm, _delay(self.gaps, extra),
                          _delay(self.lags, extra))


def _delay(samples: list, extra: float) -> float:
    return max(0.0, (float(np.median(samples)) if samples else 0.0) + extra)


def fit_contention(traces, model: OverlapModel) -> Contention:
    """The contention that explains traced overlapped calls (any groupings of ``model``'s
    grid, each with every transfer's start and end): the GEMM's slowdown from how much longer
    it took than alone against how long transfers ran beside it; the transfers' from how much
    longer each took than its cost alone against its time beside the GEMM (beyond what the
    transfers after the GEMM's end took more than alone, which counts as the stream's own
    cost); the gap and lag as the medians of the stream's delays where a group was finished
    before, or after, the stream got to its wait, plus that own cost."""
    samples = _Samples()
    for trace in traces:
        if None in trace.transfer_start or None in trace.transfer_end:
            raise ValueError("fit_contention needs traces with every transfer's start and end")
        samples.add(trace, model.timing, model.works(trace.group_sizes))
    if not samples.gemm:
        raise ValueError("fit_contention needs at least one trace")
    return samples.contention()
