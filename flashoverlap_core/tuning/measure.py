"""Measurements on the caller's device and process group, for any backend and device type.

Times come from the device module's events (``torch.get_device_module``) on accelerators and
from ``time.perf_counter`` on the host. Every measurement is collective over the group: ranks
start each timed iteration together (barrier) and the slowest rank's time counts, so that
every rank builds the same model and chooses the same plan.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from ..collectives import reduce_scatter_single
from .model import Contention, CostCurve, GemmTiming, OverlapModel, fit_contention


class Clock:
    """Marks on the current stream of ``device`` (device events) or on the host clock."""

    def __init__(self, device: torch.device):
        self.device = device
        self.module = None if device.type == "cpu" else torch.get_device_module(device.type)

    def mark(self):
        if self.module is None:
            return time.perf_counter()
        event = self.module.Event(enable_timing=True)
        event.record()
        return event

    def sync(self) -> None:
        if self.module is not None:
            self.module.synchronize(self.device)

    def seconds(self, start, end) -> float:
        """From mark ``start`` to mark ``end`` (after :meth:`sync`)."""
        if self.module is None:
            return end - start
        return start.elapsed_time(end) / 1e3


def slowest(values, device: torch.device, group) -> np.ndarray:
    """Element-wise maximum of ``values`` over the ranks of ``group`` (None: this process)."""
    values = np.asarray(values, dtype=np.float64)
    if group is None:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.cpu().numpy()


def agree(flag: bool, device: torch.device, group) -> bool:
    """True only when ``flag`` is true on every rank (so all ranks take the same branch)."""
    if group is None:
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item())


def line_up(device: torch.device, group) -> None:
    """Wait until the device is idle and every rank of ``group`` got here."""
    if group is not None:
        dist.barrier(group=group)
    Clock(device).sync()


def timed(fn: Callable[[], object], device: torch.device, group, iters: int = 10,
          warmup: int = 3) -> list[float]:
    """Seconds of ``fn()`` per iteration, the slowest rank's; ranks start each one together."""
    for _ in range(warmup):
        fn()
    clock, times = Clock(device), []
    for _ in range(iters):
        line_up(device, group)
        start = clock.mark()
        fn()
        end = clock.mark()
        clock.sync()
        times.append(clock.seconds(start, end))
    return [float(t) for t in slowest(times, device, group)]


def median_time(fn, device, group, iters: int = 10, warmup: int = 3) -> float:
    return statistics.median(timed(fn, device, group, iters, warmup))


BACK_TO_BACK_CALLS = 5  # calls per sample of a back-to-back measurement


def device_time(fn, device, group, rounds: int = 3, warmup: int = 2) -> float:
    """Seconds of one ``fn()`` as the device runs it among others queued ahead of it (the
    median of :func:`sample_times`' rounds; the slowest rank's)."""
    return float(np.median(sample_times([fn], device, group, rounds, BACK_TO_BACK_CALLS,
                                        warmup)))


# ---- transfers -----------------------------------------------------------------------------------
def transfer_fn(op, group, world_size: int) -> Callable[[torch.Tensor], None] | None:
    """One transfer of a region, as an overlapped call makes it: the collective of ``op`` on
    ``group``, or a callable op as ``op(region, 0)``; ``None`` when it does nothing (a
    collective without a process group)."""
    if callable(op) and not isinstance(op, str):
        return lambda region: op(region, 0)
    if group is None:
        return None
    if op == "allreduce":
        return lambda region: dist.all_reduce(region, group=group)
    if op == "reduce_scatter":
        return lambda region: reduce_scatter_single(region.new_empty(region.numel() // world_size),
                                              region, group=group)
    if op == "all_to_all":
        return lambda region: dist.all_to_all_single(torch.empty_like(region), region,
                                                     group=group)
    raise ValueError(f"no transfer for op {op!r}")


def log_sizes(smallest: int, largest: int, align: int = 1, per_octave: int = 1) -> list[int]:
    """Byte sizes from ``smallest`` to ``largest`` (both included), ``per_octave`` per doubling,
    multiples of ``align``."""
    smallest = max(align, smallest // align * align)
    largest = max(smallest, largest // align * align)
    steps = max(1, round(np.log2(largest / smallest) * per_octave))
    raw = np.geomspace(smallest, largest, steps + 1)
    return sorted({int(s) // align * align or align for s in raw} | {largest})


def measure_curve(send: Callable[[torch.Tensor], None] | None, sizes: list[int],
                  dtype: torch.dtype, device: torch.device, group, iters: int = 10,
                  warmup: int = 3) -> CostCurve:
    """The median time of one transfer of each size (bytes, multiples of the element size), as
    the device runs it among others queued ahead of it (:func:`sample_times`, ``iters``
    rounds), without the host's time to issue it. (Until 2026-12-04 each was timed alone from
    an idle device, the launch in it: curves of that timing are not reused, see
    ``cache.CURVE_TIMING`` and ``strategy.RATES_FORMAT``.)"""
    if send is None:
        return CostCurve.free()
    itemsize = torch.empty((), dtype=dtype).element_size()
    buf = torch.zeros(max(sizes) // itemsize, dtype=dtype, device=device)
    fns = [lambda size=size: send(buf[:size // itemsize]) for size in sizes]
    samples = sample_times(fns, device, group, rounds=iters, calls=BACK_TO_BACK_CALLS,
                           warmup=warmup)
    return CostCurve(tuple(sizes), tuple(float(np.median(s)) for s in samples))


# ---- back-to-back calls, in rounds --------------------------------------------------------------
def _cycles_per_second(device: torch.device) -> float | None:
    """How many cycles of the device module's spin kernel (``_sleep``) make a second on
    ``device``, measured once (None where the module has no such kernel, and on the host)."""
    module = None if device.type == "cpu" else torch.get_device_module(device.type)
    spin = getattr(module, "_sleep", None)
    if spin is None:
        return None
    key = (device.type, device.index)
    if key not in _SPIN_RATE:
        cycles = 1 << 20
        spin(cycles)  # loads the kernel
        clock = Clock(device)
        start = clock.mark()
        spin(cycles)
        end = clock.mark()
        clock.sync()
        _SPIN_RATE[key] = cycles / max(clock.seconds(start, end), 1e-6)
    return _SPIN_RATE[key]


_SPIN_RATE: dict = {}
MAX_HOLD_S = 0.05


def hold(device: torch.device, seconds: float) -> bool:
    """Keep the current stream of ``device`` busy for about ``seconds`` (the device module's
    spin kernel), so that what the host queues next waits behind it and is timed as the device
    runs it, not as the host issues it. False where the device cannot (then nothing is held)."""
    rate = _cycles_per_second(device)
    if rate is None:
        return False
    torch.get_device_module(device.type)._sleep(int(rate * min(seconds, MAX_HOLD_S)))
    return True


def sample_times(fns, device: torch.device, group, rounds: int = 5, calls: int = 5,
                 warmup: int = 3, seed: int = 0, report: dict | None = None) -> np.ndarray:
    """Seconds per call of each of ``fns``: [len(fns), rounds].

    A sample is ``calls`` calls queued back to back between two marks, divided by ``calls``,
    after one more call that the first mark queues behind, all queued while the device is held
    busy (:func:`hold`, for a few times what the host took to issue them before): the device
    time of a call when the host keeps ahead (as it does in a model's forward or a captured
    graph), not the host's launch time, whose jitter would otherwise be measured too (on the
    host clock the calls are simply timed one after the other). Every round samples every
    function once, in a shuffled order (the same on every rank), so that a drift of the device
    over the run spreads over all of them instead of biasing the ones measured last; the
    spread of the rounds is the measurement's noise. The slowest rank's time counts.

    ``report`` (a dict) receives ``host_s``, the host's seconds per call issuing each sample
    (the slowest rank's), and ``ahead``, whether the host had queued each sample's calls
    before the device reached them (on every rank; False where nothing could be held, or for
    a call that waits for the device on the host).
    """
    fns = list(fns)
    clock, rng = Clock(device), np.random.default_rng(seed)
    issue = np.full(len(fns), 1e-3 / max(calls, 1))  # host seconds per call, last seen
    for i, fn in enumerate(fns):
        for _ in range(warmup):
            began = time.perf_counter()
            fn()
            issue[i] = time.perf_counter() - began
    out = np.zeros((len(fns), rounds))
    host = np.zeros((len(fns), rounds))
    ahead = np.zeros((len(fns), rounds))
    for r in range(rounds):
        for i in rng.permutation(len(fns)):
            line_up(device, group)
            held = hold(device, 3.0 * issue[i] * (calls + 1) + 2e-4)
            began = time.perf_counter()
            fns[i]()  # the device is busy with it while the timed calls are queued
            start = clock.mark()
            for _ in range(calls):
                fns[i]()
            end = clock.mark()
            issued = time.perf_counter() - began
            ahead[i, r] = float(held and not start.query())
            clock.sync()
            issue[i] = issued / (calls + 1)
            out[i, r] = clock.seconds(start, end) / calls
            host[i, r] = issue[i]
    if report is not None:
        report["host_s"] = slowest(host.ravel(), device, group).reshape(host.shape)
        report["ahead"] = -slowest(-ahead.ravel(), device, group).reshape(ahead.shape) > 0.5
    return slowest(out.ravel(), device, group).reshape(out.shape)


# ---- traced calls: the GEMM alone, and what running together costs --------------------------
def traced_calls(trace_once: Callable[[], object], device: torch.device, group,
                 reps: int = 5) -> list:
    """``reps`` traces (``trace_once()`` returns a TileTrace), every rank starting together."""
    traces = []
    for _ in range(reps):
        line_up(device, group)
        traces.append(trace_once())
    return traces


def gemm_timing(traces, device: torch.device, group) -> GemmTiming:
    """The GEMM's wave ends from traces of one-group calls (nothing runs beside the GEMM):
    per wave the slowest rank, then the median over calls."""
    ends = np.array([t.wave_ends() for t in traces])
    ends = slowest(ends.ravel(), device, group).reshape(ends.shape)
    ends = np.maximum.accumulate(np.median(ends, axis=0))
    return GemmTiming(traces[0].wave_size, tuple(float(e) for e in ends))


def contention(traces, model: OverlapModel, device: torch.device, group) -> Contention:
    """:func:`~.model.fit_contention` of this rank's traces of overlapped calls; each part the
    largest over the ranks (every rank builds the same model)."""
    fitted = fit_contention(traces, model)
    values = slowest([fitted.gemm, fitted.comm, fitted.gap_s, fitted.lag_s], device, group)
    return Contention(*(float(v) for v in values))
