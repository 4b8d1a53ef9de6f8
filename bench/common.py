"""Shared pieces of the benchmark scripts: timing and result files.

Every script writes one JSON file under bench/results/ (or $FO_RESULTS_DIR) holding the device,
the date, the commit and the exact command, so that every number quoted elsewhere can be traced
to a run.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from flashoverlap_core.devices import current_device, device_name
from flashoverlap_core.tools.report import git_commit
from flashoverlap_core.tools.table import format_table
from flashoverlap_core.tuning.measure import median_time

RESULTS = Path(os.environ.get("FO_RESULTS_DIR", Path(__file__).resolve().parent / "results"))
FLUSH_BYTES = 256 << 20  # written before a cold replay: more than the H200's 50 MB of L2


def device_tag(name: str | None = None) -> str:
    """A GPU's short name for result file names: its model ("NVIDIA H200" -> "h200",
    "NVIDIA H100 80GB HBM3" -> "h100", "NVIDIA A100-SXM4-80GB" -> "a100"), else its last word.
    ``name``: the current device's."""
    name = torch.cuda.get_device_name() if name is None else name
    words = name.split()
    for word in words:
        model = re.match(r"[A-Za-z]+\d+[A-Za-z]*", word)
        if model and word.upper() != "NVIDIA":
            return model.group(0).lower()
    return words[-1].lower() if words else "gpu"


def median_ms(fn, warmup: int = 5, iters: int = 20, device_type: str = "cuda",
              inner: int = 1) -> float:
    """Median time of ``fn()`` in ms on this process's current device, timed as the tuner
    times (:func:`flashoverlap_core.tuning.measure.median_time`: device events, host clock on
    the CPU). ``inner`` > 1 queues that many calls per timed iteration and divides: the device
    time of back-to-back launches, without the host's launch latency between them."""
    def repeated():
        for _ in range(inner):
            fn()

    device = current_device(device_type)
    return median_time(repeated, device, None, iters, warmup) * 1e3 / inner


def steady_times(fns: dict, iters: int = 45, inner: int = 1, warmup: int = 3) -> dict:
    """{name: (median device ms, median host µs) per call} of each function on the current CUDA
    device, timed as a call in a running program sees it: each timed batch queues ``inner``
    calls right behind one more untimed call, so the device is still busy with that one while
    the host queues the batch (a layer's call runs behind the layer before it). On an idle
    device the first call's host time (its launch latency) would count as device time, once per
    batch; here it counts only where the host cannot keep up (a host-bound call is timed at the
    host's pace). The host time is the host clock over queuing the batch. The functions' batches
    alternate (the order rotated each iteration), so clock drift reaches every function alike."""
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    device_ms = {name: [] for name in names}
    host_us = {name: [] for name in names}
    for it in range(iters):
        for name in names[it % len(names):] + names[:it % len(names)]:
            fn = fns[name]
            torch.cuda.synchronize()
            fn()  # the lead: untimed
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            t1 = time.perf_counter()
            end.record()
            torch.cuda.synchronize()
            device_ms[name].append(start.elapsed_time(end) / inner)
            host_us[name].append((t1 - t0) * 1e6 / inner)
    return {name: (statistics.median(device_ms[name]), statistics.median(host_us[name]))
            for name in names}


def nccl_group_of_one(prefix: str) -> None:
    """An NCCL process group of one rank on the current GPU (its collectives move nothing):
    the world-size-1 benchmarks' group, NVLink multicast off."""
    import torch.distributed as dist

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    store = dist.FileStore(tempfile.mktemp(prefix=f"fo-{prefix}-"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1,
                            device_id=torch.device("cuda", torch.cuda.current_device()))


# ---- device time from CUDA-graph replays (bench/gemm.py's method) ------------------------------

def graph(fn, inner: int):
    """fn captured `inner` times in one CUDA graph (warmed up first on the capture stream)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        for _ in range(inner):
            fn()
    torch.cuda.synchronize()
    return g


def time_alternating(fns: dict, reps: int, inner: int, flush=None, comm=None) -> dict:
    """{name: [ms per launch, one per repetition]}: one replay per kernel per repetition,
    kernels in rotated order; `flush` (a buffer) is overwritten before each replay."""
    graphs = {name: graph(fn, inner) for name, fn in fns.items()}
    names = list(graphs)
    marks = []
    for r in range(reps + 2):  # 2 warm-up rounds, not counted
        for name in names[r % len(names):] + names[:r % len(names)]:
            if flush is not None:
                flush.zero_()
            if comm is not None:
                comm()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graphs[name].replay()
            end.record()
            if r >= 2:
                marks.append((name, start, end))
    torch.cuda.synchronize()
    out = {name: [] for name in names}
    for name, start, end in marks:
        out[name].append(start.elapsed_time(end) / inner)
    return out


def stats(samples: list[float]) -> dict:
    s = sorted(samples)
    pick = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
    return {"median": statistics.median(s), "p10": pick(0.1), "p90": pick(0.9)}


def trace_events(prof, categories=("kernel",)) -> list[dict]:
    """The events of a finished ``torch.profiler`` run whose category is in ``categories``
    (its chrome trace, read back from a temporary file)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.loads(Path(f.name).read_text())
    return [e for e in trace.get("traceEvents", []) if e.get("cat") in categories]


def write_result(name: str, rows: list[dict], extra: dict | None = None,
                 device_type: str = "cuda", path: Path | None = None) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    now = _dt.datetime.now(_dt.timezone.utc)
    doc = {
        "benchmark": name,
        "device": device_name(device_type),
        "date": now.isoformat(timespec="seconds"),
        "commit": git_commit() or "unknown",
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        **(extra or {}),
        "rows": rows,
    }
    # ``path``: rewrite that file (a run that writes as it goes), else a new one
    path = path or RESULTS / f"{name}-{now.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(doc, indent=1))
    print(f"wrote {path}")
    return path


def table(rows: list[dict], columns: list[str]) -> str:
    """The rows' values of ``columns``, right-aligned under their names."""
    return "\n".join(format_table([columns] + [[r.get(c, "") for c in columns] for r in rows],
                                   right=True))
