"""What one overlapped call did, tile by tile: the input of the GEMM timing model and of the
timeline plot.

A :class:`TileTrace` is what :meth:`Backend.trace <flashoverlap_core.backend.Backend.trace>`
returns. All times are seconds from the call's start on one clock; a backend whose tiles and
transfers are stamped by different clocks must put them on one origin before building it. On a
device, the call's start is best stamped on the compute stream just before the GEMM (so that
it is no earlier than what a device event recorded before the call would show): the tuner
calibrates a constant offset between the two away, but an origin earlier than the call's start
as events see it makes the calibration clip at zero and the predictions run long.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

FORMAT = "flashoverlap.trace/1"


def _floats(values) -> tuple[float, ...]:
    return tuple(float(v) for v in values)


def _optional_floats(values) -> tuple[float | None, ...]:
    return tuple(None if v is None else float(v) for v in values)


@dataclass(frozen=True)
class TileTrace:
    """One overlapped call as it ran.

    Per execution item ``i`` (the i-th tile of the plan's execution order, ``item_table()``
    row i): ``item_end[i]``, when its tile was finished and signaled, and ``item_worker[i]``,
    the CTA / worker that computed it. Per group ``g``: ``transfer_start[g]`` and
    ``transfer_end[g]``, when its collective (or custom transfer) began and ended, ``None``
    where the backend cannot tell. ``call_end``: when the result was complete (after the
    post-communication reorder), ``None`` if unknown. ``clock`` says what stamped the times
    (e.g. "host perf_counter", "device timer").
    """

    wave_size: int
    group_sizes: tuple[int, ...]
    item_end: tuple[float, ...]
    item_worker: tuple[int, ...]
    transfer_start: tuple[float | None, ...]
    transfer_end: tuple[float | None, ...]
    call_end: float | None = None
    clock: str = ""

    def __post_init__(self):
        items, groups = len(self.item_end), len(self.group_sizes)
        if self.wave_size < 1:
            raise ValueError(f"wave_size must be >= 1, got {self.wave_size}")
        if len(self.item_worker) != items:
            raise ValueError(f"item_worker has {len(self.item_worker)} entries, item_end {items}")
        if sum(self.group_sizes) != items:
            raise ValueError(f"group_sizes sum to {sum(self.group_sizes)}, but {items} items "
                             "were traced")
        for name in ("transfer_start", "transfer_end"):
            if len(getattr(self, name)) != groups:
                raise ValueError(f"{name} needs one entry per group ({groups}), "
                                 f"got {len(getattr(self, name))}")

    @classmethod
    def from_stamps(cls, *, wave_size: int, group_sizes, item_end, item_worker,
                    transfer_start=None, transfer_end=None, call_end=None,
                    clock: str = "") -> "TileTrace":
        """Build a trace from any sequences (lists, numpy arrays, 1-D tensors) of seconds;
        missing transfer times become ``None``."""
        group_sizes = tuple(int(s) for s in group_sizes)
        unknown = [None] * len(group_sizes)
        return cls(int(wave_size), group_sizes, _floats(item_end),
                   tuple(int(w) for w in item_worker),
                   _optional_floats(unknown if transfer_start is None else transfer_start),
                   _optional_floats(unknown if transfer_end is None else transfer_end),
                   None if call_end is None else float(call_end), clock)

    @property
    def num_items(self) -> int:
        return len(self.item_end)

    @property
    def num_waves(self) -> int:
        return -(-self.num_items // self.wave_size)

    @property
    def gemm_end(self) -> float:
        """When the last tile was finished."""
        return max(self.item_end)

    def wave_ends(self) -> tuple[float, ...]:
        """Per wave w: when every tile of waves 0..w was finished (a running maximum, so a
        late tile of an early wave holds back every later wave too)."""
        out, latest = [], float("-inf")
        for w in range(self.num_waves):
            latest = max(latest, *self.item_end[w * self.wave_size:(w + 1) * self.wave_size])
            out.append(latest)
        return tuple(out)

    def group_ready(self) -> tuple[float, ...]:
        """Per group: when its last tile was finished (its counter complete)."""
        out, start = [], 0
        for size in self.group_sizes:
            out.append(max(self.item_end[start:start + size]))
            start += size
        return tuple(out)

    def to_dict(self) -> dict:
        return {"format": FORMAT, "wave_size": self.wave_size,
                "group_sizes": list(self.group_sizes), "item_end": list(self.item_end),
                "item_worker": list(self.item_worker),
                "transfer_start": list(self.transfer_start),
                "transfer_end": list(self.transfer_end), "call_end": self.call_end,
                "clock": self.clock}

    @classmethod
    def from_dict(cls, d: dict) -> "TileTrace":
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"not a trace in format {FORMAT!r}: {str(d)[:200]}")
        return cls.from_stamps(**{k: v for k, v in d.items() if k != "format"})


class HostRecorder:
    """Builds a :class:`TileTrace` of a call that a backend drives from the host, on the host
    clock (``time.perf_counter``): the backend calls :meth:`tile_done` after each tile in
    execution order, :meth:`transfer_started` / :meth:`transfer_launched` around each group's
    collective, then :meth:`trace`. Asynchronous collectives are joined in launch order by a
    waiter thread, which stamps each one's end as it completes. Worker ids are
    ``item index % wave size`` (the host has no CTAs). ``sync`` (e.g. the device module's
    ``synchronize``) is called before every stamp, so device work is stamped when it is done.
    """

    def __init__(self, plan, sync=None):
        self.plan, self.sync = plan, sync or (lambda: None)
        self.item_end: list[float] = []
        groups = plan.num_groups
        self.transfer_start: list[float | None] = [None] * groups
        self.transfer_end: list[float | None] = [None] * groups
        self._pending: queue.Queue = queue.Queue()
        self._waiter = threading.Thread(target=self._wait_in_order, daemon=True)
        self._waiter.start()
        self.t0 = time.perf_counter()

    def now(self) -> float:
        self.sync()
        return time.perf_counter() - self.t0

    def tile_done(self) -> None:
        self.item_end.append(self.now())

    def transfer_started(self, g: int) -> None:
        self.transfer_start[g] = self.now()

    def transfer_launched(self, g: int, works) -> None:
        """Group g's transfer was handed over: ``works`` are its asynchronous collectives (none
        when it ran synchronously, e.g. a custom op or the identity)."""
        if works:
            self._pending.put((g, list(works)))
        else:
            self.transfer_end[g] = self.now()

    def _wait_in_order(self) -> None:
        while (item := self._pending.get()) is not None:
            g, works = item
            for work in works:
                work.wait()
            self.transfer_end[g] = self.now()

    def join(self) -> None:
        """Wait until every launched collective has completed (call before the backend's own
        wait, so that no collective is waited for from two threads at once)."""
        self._pending.put(None)
        self._waiter.join()

    def trace(self) -> TileTrace:
        """The trace, with the call's end stamped now (after the post-communication reorder)."""
        if self._waiter.is_alive():
            self.join()
        return TileTrace.from_stamps(
            wave_size=self.plan.wave_size, group_sizes=self.plan.group_sizes,
            item_end=self.item_end,
            item_worker=[i % self.plan.wave_size for i in range(len(self.item_end))],
            transfer_start=self.transfer_start, transfer_end=self.transfer_end,
            call_end=self.now(), clock="host perf_counter")


class NoRecorder:
    """The recorder of an untraced call: every stamp is a no-op."""

    def tile_done(self) -> None:
        pass

    def transfer_started(self, g: int) -> None:
        pass

    def transfer_launched(self, g: int, works) -> None:
        pass

    def join(self) -> None:
        pass
