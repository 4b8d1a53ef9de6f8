"""Measurements on the caller's device and process group, for any backend and device type.

Times come from the device module's events (``torch.get_device_module``) on accelerators and
from ``time.perf_counter`` on the host. Every measurement is collective over the group: ranks
start each timed iteration together (barrier) and the slowest rank's time counts, so that
every rank builds the same model and chooses the same plan.
"""
from __future__ import annotations

import statistics
import threading
import time
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from .model import Contention, CostCurve, GemmTiming

MAX_SLOWDOWN = 8.0  # contention factors are clipped here (a measurement with almost no overlap)

# torch 2.13 renamed reduce_scatter_tensor (which now warns) to reduce_scatter_single.
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def current_device(device_type: str) -> torch.device:
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, torch.get_device_module(device_type).current_device())


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
        return lambda region: _reduce_scatter(region.new_empty(region.numel() // world_size),
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
    """The median time of one transfer of each size (bytes, multiples of the element size)."""
    if send is None:
        return CostCurve.free()
    itemsize = torch.empty((), dtype=dtype).element_size()
    buf = torch.zeros(max(sizes) // itemsize, dtype=dtype, device=device)
    seconds = [median_time(lambda: send(buf[:size // itemsize]), device, group, iters, warmup)
               for size in sizes]
    return CostCurve(tuple(sizes), tuple(seconds))


# ---- the GEMM ------------------------------------------------------------------------------------
def traced_timing(trace_once: Callable[[], object], device: torch.device, group,
                  reps: int = 5) -> tuple[GemmTiming, list]:
    """The GEMM's wave ends from ``reps`` traced calls (``trace_once()`` returns a TileTrace of
    a one-group call, so nothing runs beside the GEMM): per wave the slowest rank, then the
    median over calls. Also returns this rank's traces."""
    traces = []
    for _ in range(reps):
        line_up(device, group)
        traces.append(trace_once())
    ends = np.array([t.wave_ends() for t in traces])
    ends = slowest(ends.ravel(), device, group).reshape(ends.shape)
    ends = np.maximum.accumulate(np.median(ends, axis=0))
    return GemmTiming(traces[0].wave_size, tuple(float(e) for e in ends)), traces


# ---- both at once -------------------------------------------------------------------------------
def _run_together(gemm, transfers, clock: Clock, side) -> tuple[float, float, float, float]:
    """Start of the GEMM, its end, start of the transfers, their end (seconds, one origin)."""
    if clock.module is None:  # host: the transfers in a thread beside the GEMM
        marks = {}

        def beside():
            marks["c0"] = time.perf_counter()
            transfers()
            marks["c1"] = time.perf_counter()

        worker = threading.Thread(target=beside)
        origin = time.perf_counter()
        worker.start()
        g0 = time.perf_counter()
        gemm()
        g1 = time.perf_counter()
        worker.join()
        return g0 - origin, g1 - origin, marks["c0"] - origin, marks["c1"] - origin
    origin = clock.mark()
    gemm()
    g1 = clock.mark()
    with clock.module.stream(side):
        side.wait_event(origin)
        c0 = clock.mark()
        transfers()
        c1 = clock.mark()
    clock.sync()
    return 0.0, clock.seconds(origin, g1), clock.seconds(origin, c0), clock.seconds(origin, c1)


def _slowdown(alone: float, span: float, overlap: float) -> float:
    """Rate-model slowdown of a job taking ``alone`` seconds by itself and ``span`` seconds
    with ``overlap`` of them beside the other job: overlap/f + (span - overlap) = alone."""
    extra = span - alone
    if overlap <= 0 or extra <= 0:
        return 1.0
    if overlap <= extra:
        return MAX_SLOWDOWN
    return float(min(MAX_SLOWDOWN, overlap / (overlap - extra)))


def measure_contention(gemm: Callable[[], object], send: Callable[[torch.Tensor], None] | None,
                       region: torch.Tensor, device: torch.device, group, iters: int = 5,
                       warmup: int = 2) -> Contention:
    """How much the GEMM and the transfer slow each other: transfers of ``region`` back to back
    on a side stream (a thread on the host) for about 60% of the GEMM's time, beside the GEMM."""
    if send is None:
        return Contention()
    t_gemm = median_time(gemm, device, group, iters, warmup)
    t_send = median_time(lambda: send(region), device, group, iters, warmup)
    reps = int(min(1000, max(1, 0.6 * t_gemm / max(t_send, 1e-9))))

    def transfers():
        for _ in range(reps):
            send(region)

    clock = Clock(device)
    side = clock.module.Stream(device=device) if clock.module is not None else None
    spans = []
    for i in range(warmup + iters):
        line_up(device, group)
        g0, g1, c0, c1 = _run_together(gemm, transfers, clock, side)
        if i >= warmup:
            spans.append((g1 - g0, c1 - c0, max(0.0, min(g1, c1) - max(g0, c0))))
    gemm_span, comm_span, overlap = np.median(np.array(spans), axis=0)
    factors = [_slowdown(t_gemm, gemm_span, overlap), _slowdown(reps * t_send, comm_span, overlap)]
    gemm_factor, comm_factor = slowest(factors, device, group)
    return Contention(float(gemm_factor), float(comm_factor))
