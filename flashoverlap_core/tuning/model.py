"""The timing model of an overlapped call, and its simulation.

Three measured pieces (see :mod:`~flashoverlap_core.tuning.measure`):

* :class:`GemmTiming`: when each wave of the GEMM ends, the GEMM alone on the device (no
  transfer beside it), from traced calls. A group can be sent once its last wave has ended.
* :class:`CostCurve`: how long one transfer (collective or custom op) of a region takes,
  against the region's bytes.
* :class:`Contention`: how much slower each side runs while both run, as rate ratios: beside
  a transfer the GEMM advances ``1/gemm`` of a second of its own work per second, and a
  transfer beside the GEMM ``1/comm``.

:class:`OverlapModel` joins them for one plan's tile grid and predicts the duration of a call
for any grouping: group g's transfer starts when its tiles are ready and transfer g-1 has
ended, and lasts its cost, slowed while the GEMM still runs (which is slowed in turn); the
call ends with the last transfer, plus the post-communication reorder and the call's fixed
overhead (``post_s``, calibrated so that the one-group prediction is the measured sequential
time).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch


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
    """Slowdown of each side while the GEMM and a transfer run together (>= 1; 1 = none)."""

    gemm: float = 1.0
    comm: float = 1.0

    def __post_init__(self):
        if not (self.gemm >= 1.0 and self.comm >= 1.0):
            raise ValueError(f"contention factors must be >= 1, got gemm={self.gemm}, "
                             f"comm={self.comm}")

    def to_dict(self) -> dict:
        return {"gemm": self.gemm, "comm": self.comm}

    @classmethod
    def from_dict(cls, d: dict) -> "Contention":
        return cls(float(d["gemm"]), float(d["comm"]))


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
    """One group's transfer under the rate model; works on scalars and numpy arrays.

    ``t``: when the previous transfer ended; ``gemm_done``: the GEMM's progress then, in
    seconds of GEMM-alone work; ``ready``: the GEMM progress at which the group's tiles are
    finished; ``work``: the transfer's cost alone. Returns (start, end, GEMM progress at end).
    """
    gemm_done = np.asarray(gemm_done, dtype=np.float64)
    start = t + np.maximum(ready - gemm_done, 0.0)  # the GEMM runs alone until the group is ready
    gemm_done = np.maximum(gemm_done, ready)
    both = np.minimum(work * contention.comm,
                      np.maximum(gemm_end - gemm_done, 0.0) * contention.gemm)
    end = start + both + (work - both / contention.comm)
    return start, end, gemm_done + both / contention.gemm


@dataclass(frozen=True)
class PredictedGroup:
    ready: float  # GEMM-alone time at which its tiles are finished
    start: float
    end: float


@dataclass(frozen=True)
class OverlapModel:
    """Predicts an overlapped call's duration for any grouping of one plan's tiles."""

    timing: GemmTiming
    prefix_bytes: np.ndarray = field(compare=False)  # bytes of the first t tiles, t = 0..T
    cost: CostCurve
    contention: Contention = Contention()
    post_s: float = 0.0
    unit: int = 1  # group sizes must be multiples of this (the world size for reduce_scatter)

    @classmethod
    def for_plan(cls, plan, timing: GemmTiming, cost: CostCurve,
                 contention: Contention = Contention(), post_s: float = 0.0) -> "OverlapModel":
        """The model of ``plan``'s tile grid (its grouping does not matter)."""
        itemsize = torch.empty((), dtype=plan.torch_dtype).element_size()
        numel = np.fromiter((t.numel for t in plan.grid.execution_order), dtype=np.int64)
        prefix = np.concatenate([[0], np.cumsum(numel)]) * itemsize
        unit = plan.world_size if plan.op == "reduce_scatter" else 1
        return cls(timing, prefix, cost, contention, post_s, unit)

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

    def schedule(self, group_sizes) -> list[PredictedGroup]:
        """Predicted ready, start and end of every group's transfer."""
        sizes = np.asarray(group_sizes, dtype=np.int64)
        if sizes.sum() != self.num_tiles or (sizes < 1).any():
            raise ValueError(f"group sizes {list(group_sizes)} do not partition "
                             f"{self.num_tiles} tiles")
        ends = np.cumsum(sizes)
        works = self.cost(np.diff(self.prefix_bytes[np.concatenate([[0], ends])]))
        t, done, out = 0.0, 0.0, []
        for ready, work in zip(self.timing.ready(ends), np.atleast_1d(works)):
            start, t, done = advance_transfer(t, done, float(ready), float(work),
                                              self.timing.end, self.contention)
            out.append(PredictedGroup(float(ready), float(start), float(t)))
        return out

    def predict(self, group_sizes) -> float:
        """Predicted seconds of the whole call with this grouping."""
        return self.schedule(group_sizes)[-1].end + self.post_s

    def sequential(self) -> float:
        """Predicted seconds with one group: the GEMM, then one transfer (no overlap)."""
        return self.predict((self.num_tiles,))
