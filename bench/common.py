"""Shared pieces of the benchmark scripts: timing and result files.

Every script writes one JSON file under bench/results/ (or $FO_RESULTS_DIR) holding the device,
the date, the commit and the exact command, so that every number quoted elsewhere can be traced
to a run.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

RESULTS = Path(os.environ.get("FO_RESULTS_DIR", Path(__file__).resolve().parent / "results"))


def commit() -> str:
    if os.environ.get("FO_COMMIT"):
        return os.environ["FO_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_name(device_type: str = "cuda") -> str:
    if device_type == "cpu":
        return platform.processor() or platform.machine()
    return torch.get_device_module(device_type).get_device_name()


def median_ms(fn, warmup: int = 5, iters: int = 20, device_type: str = "cuda",
              inner: int = 1) -> float:
    """Median time of ``fn()`` in ms, from device events (host clock + sync on CPU).

    ``inner`` > 1 queues that many calls between the two events and divides: the device time
    of back-to-back launches, without the host's launch latency between them."""
    for _ in range(warmup):
        fn()
    times = []
    if device_type == "cpu":
        import time
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    else:
        mod = torch.get_device_module(device_type)
        mod.synchronize()
        for _ in range(iters):
            start, end = mod.Event(enable_timing=True), mod.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / inner)
    times.sort()
    return times[len(times) // 2]


def write_result(name: str, rows: list[dict], extra: dict | None = None,
                 device_type: str = "cuda") -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    now = _dt.datetime.now(_dt.timezone.utc)
    doc = {
        "benchmark": name,
        "device": device_name(device_type),
        "date": now.isoformat(timespec="seconds"),
        "commit": commit(),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        **(extra or {}),
        "rows": rows,
    }
    path = RESULTS / f"{name}-{now.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(doc, indent=1))
    print(f"wrote {path}")
    return path


def table(rows: list[dict], columns: list[str]) -> str:
    cells = [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c)
              for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)
