"""``flashoverlap bench``: the main job.

On one rank per device of the best available accelerator backend (or on 2 CPU ranks with the
reference backend when there is none), for each shape and op: time the overlapped call
``overlap(a, b, op)`` against the plain sequence ``a @ b`` then the torch.distributed
collective, and check that both agree. Agreement is judged against a float64 reference (the
same collective on float64 inputs): the overlapped result may differ from the plain one by at
most twice the plain result's own error, plus a few units of rounding of the output dtype.

Times are host wall-clock times of whole calls, with every rank started together (barrier)
and the device synchronised before and after; per iteration the slowest rank counts, and the
table shows the median over iterations after warm-up.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from . import registry, report
from .api import overlap
from .launch import RankError, RankPool, RankTimeout
from .plan import DTYPES

CPU_SHAPES = "512x512x256,1024x1024x512,2048x1024x512"
# Per-rank [M, N, K] of tensor-parallel LLM layers (tokens x hidden x sharded inner size).
ACCELERATOR_SHAPES = "4096x8192x3584,8192x8192x3584,8192x8192x8192"
OPS = ("allreduce", "reduce_scatter", "all_to_all")
SEED = 1234
ROUNDING_UNITS = 4  # output-dtype epsilons (times the largest |value|) always allowed


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", help="backend to run (default: FLASHOVERLAP_BACKEND, else "
                        "the best available accelerator backend with devices, else reference)")
    parser.add_argument("--device", metavar="TYPE", help="device type for a backend that runs "
                        "on any device, such as reference or decomposition (default: cpu)")
    parser.add_argument("--world-size", type=int, help="ranks (default: every device of the "
                        "backend; 2 on the CPU)")
    parser.add_argument("--shapes", help="comma-separated per-rank MxNxK shapes of a [M,K] @ "
                        f"[K,N] (default: {CPU_SHAPES} on the CPU, {ACCELERATOR_SHAPES} on "
                        "accelerators)")
    parser.add_argument("--ops", default=",".join(OPS),
                        help=f"comma-separated ops out of {', '.join(OPS)} (default: all; "
                        "all_to_all sends equal row blocks to every rank)")
    parser.add_argument("--dtype", choices=sorted(DTYPES),
                        help="input and output dtype (default: float32 on the CPU, bfloat16 "
                        "on accelerators)")
    parser.add_argument("--iters", type=int, help="timed iterations (default: 5 on the CPU, "
                        "20 on accelerators)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations first")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds one case may take on the ranks before they are killed")
    parser.add_argument("--json", metavar="PATH",
                        help="also write the results, with device, date, commit and versions")


# ---------------------------------------------------------------------------------------------
# Where to run
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Hardware:
    backend: str  # the backend's name
    device_type: str
    world_size: int
    reason: str
    target: str  # how the ranks ask for it: its name, or the module:attr it was given as


def pick_hardware(backend: str | None, world_size: int | None,
                  device_type: str | None = None) -> Hardware:
    """The explicit backend (``--backend``, else FLASHOVERLAP_BACKEND), else the most preferred
    available accelerator backend that has devices, else the reference backend on the CPU.
    A backend that runs on any device (reference, decomposition) runs on ``device_type``."""
    choice = registry.explicit_choice(backend)
    if choice is not None:
        target, reason = choice
        chosen = registry.get(target)
    elif device_type is None:
        with_devices = [registry.get(s.name) for s in registry.backends()
                        if s.available and s.device_type not in (None, "cpu")]
        with_devices = [b for b in with_devices if b.device_count() > 0]
        if with_devices:
            chosen = max(with_devices, key=lambda b: b.priority)
            reason = "auto detect: best available accelerator backend"
        else:
            chosen = registry.get("reference")
            reason = "auto detect: no accelerator backend with devices here"
    else:
        chosen = registry.get("reference")
        reason = f"--device {device_type} without --backend"
    if chosen.device_type not in (None, device_type or chosen.device_type):
        raise SystemExit(f"flashoverlap bench: backend {chosen.name!r} runs on "
                         f"{chosen.device_type}, not on --device {device_type}")
    device_type = chosen.device_type or device_type or "cpu"
    if device_type == "cpu":
        devices = None  # ranks share the host
    elif chosen.device_type is None:
        devices = torch.get_device_module(device_type).device_count()
    else:
        devices = chosen.device_count()
    if devices == 0:
        raise SystemExit(f"flashoverlap bench: no {device_type} device here")
    if world_size is None:
        world_size = devices if devices is not None else 2
    if world_size < 1 or (devices is not None and world_size > devices):
        raise SystemExit(f"flashoverlap bench: --world-size must be between 1 and "
                         f"{devices if devices is not None else 'any'} for backend {chosen.name!r} "
                         f"on {device_type}, got {world_size}")
    return Hardware(chosen.name, device_type, world_size, reason,
                    target if choice is not None else chosen.name)


# ---------------------------------------------------------------------------------------------
# What runs on every rank
# ---------------------------------------------------------------------------------------------
def rank_device(device_type: str):
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, dist.get_rank())


def device_name(device_type: str) -> str:
    """What the ranks run on, e.g. the accelerator's product name or the CPU model."""
    if device_type != "cpu":
        module = torch.get_device_module(device_type)
        return module.get_device_name(rank_device(device_type))
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _synchronizer(device_type: str):
    if device_type == "cpu":
        return lambda: None  # CPU work and the CPU collectives' waits are synchronous
    return torch.get_device_module(device_type).synchronize


def equal_splits(rows: int, world_size: int) -> list[int]:
    """Rows per destination, as equal as possible."""
    return [rows // world_size + (r < rows % world_size) for r in range(world_size)]


# torch 2.13 renamed reduce_scatter_tensor (which now warns) to reduce_scatter_single.
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def plain(op: str, a, b):
    """The baseline: the GEMM, then torch.distributed's collective on its whole output."""
    c = a @ b
    world, rank = dist.get_world_size(), dist.get_rank()
    if op == "allreduce":
        dist.all_reduce(c)
        return c
    if op == "reduce_scatter":
        out = c.new_empty(c.shape[0] // world, c.shape[1])
        _reduce_scatter(out, c)
        return out
    splits = equal_splits(c.shape[0], world)
    out = c.new_empty(splits[rank] * world, c.shape[1])
    dist.all_to_all_single(out, c, [splits[rank]] * world, splits)
    return out


def overlapped(op: str, a, b, backend: str):
    if op != "all_to_all":
        return overlap(a, b, op, backend=backend)
    world, rank = dist.get_world_size(), dist.get_rank()
    splits = equal_splits(a.shape[0], world)
    return overlap(a, b, op, backend=backend, send_splits=splits,
                   recv_splits=[splits[rank]] * world)


def _timed(fn, warmup: int, iters: int, sync) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return times


def _max_abs(t) -> float:
    return t.abs().max().item() if t.numel() else 0.0  # all_to_all may receive no rows


def run_case(shape: tuple[int, int, int], op: str, dtype: str, backend: str, device_type: str,
             warmup: int, iters: int) -> dict:
    """On every rank: inputs from a per-rank seed, ``b`` as an nn.Linear weight's transpose;
    the float64 reference, then both timings, then the errors of this rank's results."""
    m, n, k = shape
    device, torch_dtype = rank_device(device_type), getattr(torch, dtype)
    gen = torch.Generator(device=device).manual_seed(SEED + dist.get_rank())
    a = torch.randn(m, k, generator=gen, device=device, dtype=torch_dtype)
    b = (torch.randn(n, k, generator=gen, device=device, dtype=torch_dtype) / k ** 0.5).t()
    expected = plain(op, a.double(), b.double())
    sync = _synchronizer(device_type)
    base_times = _timed(lambda: plain(op, a, b), warmup, iters, sync)
    over_times = _timed(lambda: overlapped(op, a, b, backend), warmup, iters, sync)
    base, got = plain(op, a, b).double(), overlapped(op, a, b, backend).double()
    if got.shape != base.shape:
        raise ValueError(f"overlapped result has shape {tuple(got.shape)}, "
                         f"the plain one {tuple(base.shape)}")
    bound = (2 * _max_abs(base - expected)
             + ROUNDING_UNITS * torch.finfo(torch_dtype).eps * _max_abs(expected))
    error = _max_abs(got - base)
    return {"baseline_s": base_times, "overlapped_s": over_times, "error": error, "bound": bound}


# ---------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------
@dataclass
class Result:
    shape: str
    op: str
    dtype: str
    backend: str
    world_size: int
    status: str  # "ok", "mismatch", "error" or "skipped"
    baseline_ms: float | None = None
    overlapped_ms: float | None = None
    speedup: float | None = None
    max_error: float | None = None
    bound: float | None = None
    detail: str = ""
    baseline_ms_per_iter: list[float] = field(default_factory=list)
    overlapped_ms_per_iter: list[float] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return self.status in ("mismatch", "error")


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    shapes = []
    for item in text.split(","):
        try:
            m, n, k = (int(x) for x in item.strip().lower().split("x"))
        except ValueError:
            raise SystemExit(f"flashoverlap bench: a shape is MxNxK (e.g. 1024x1024x512), "
                             f"got {item!r}") from None
        if min(m, n, k) < 1:
            raise SystemExit(f"flashoverlap bench: M, N, K must be >= 1, got {item!r}")
        shapes.append((m, n, k))
    return shapes


def parse_ops(text: str) -> list[str]:
    ops = [o.strip() for o in text.split(",") if o.strip()]
    unknown = [o for o in ops if o not in OPS]
    if unknown or not ops:
        raise SystemExit(f"flashoverlap bench: --ops takes ops out of {', '.join(OPS)}, "
                         f"got {text!r}")
    return ops


def summarise(res: Result, per_rank: list[dict]) -> Result:
    """Slowest rank per iteration, median over iterations; the worst rank's error."""
    base = [max(t) * 1e3 for t in zip(*(r["baseline_s"] for r in per_rank))]
    over = [max(t) * 1e3 for t in zip(*(r["overlapped_s"] for r in per_rank))]
    res.baseline_ms_per_iter, res.overlapped_ms_per_iter = base, over
    res.baseline_ms, res.overlapped_ms = statistics.median(base), statistics.median(over)
    res.speedup = res.baseline_ms / res.overlapped_ms if res.overlapped_ms > 0 else None
    over_bound = [r for r in per_rank if not r["error"] <= r["bound"]]  # NaN errors too
    worst = over_bound[0] if over_bound else max(per_rank, key=lambda r: r["error"])
    res.max_error, res.bound = worst["error"], worst["bound"]
    res.status = "mismatch" if over_bound else "ok"
    if over_bound:
        res.detail = "overlapped result differs from the plain one by more than the bound"
    return res


def _skip_reason(shape, op, world_size) -> str:
    if op == "reduce_scatter" and shape[0] % world_size:
        return f"reduce_scatter needs M divisible by the world size {world_size}"
    return ""


def run_cases(hw: Hardware, cases, dtype: str, warmup: int, iters: int, timeout: float):
    """Run every case on one pool of ranks (a new one if a case killed it); yield Results."""
    pool, name = None, None
    try:
        for shape, op in cases:
            res = Result("x".join(map(str, shape)), op, dtype, hw.backend, hw.world_size, "ok")
            why = _skip_reason(shape, op, hw.world_size)
            if why:
                res.status, res.detail = "skipped", why
                yield res, name
                continue
            if pool is None or not pool.alive:
                pool = RankPool(hw.world_size, hw.device_type, timeout=timeout)
                name = pool.run(device_name, hw.device_type)[0]
            try:
                per_rank = pool.run(run_case, shape, op, dtype, hw.target, hw.device_type,
                                    warmup, iters, timeout=timeout)
                res = summarise(res, per_rank)
            except (RankError, RankTimeout) as e:
                res.status, res.detail = "error", str(e)
            yield res, name
    finally:
        if pool is not None and pool.alive:
            pool.close()


def _fmt(value: float | None, spec: str, unit: str = "") -> str:
    return "-" if value is None else format(value, spec) + unit


def table(results: list[Result]) -> list[str]:
    rows = [("shape MxNxK", "op", "dtype", "baseline ms", "overlapped ms", "speedup",
             "max error", "bound", "backend", "ok")]
    for r in results:
        rows.append((r.shape, r.op, r.dtype, _fmt(r.baseline_ms, ".3f"),
                     _fmt(r.overlapped_ms, ".3f"), _fmt(r.speedup, ".2f", "x"),
                     _fmt(r.max_error, ".2e"), _fmt(r.bound, ".2e"), r.backend,
                     "yes" if r.status == "ok" else r.status.upper()))
    return report.format_table(rows)


def git_commit() -> str | None:
    """$FO_COMMIT when set (a copy without .git), else the checkout's commit (``+dirty`` with
    uncommitted changes to tracked files), when run from one."""
    if os.environ.get("FO_COMMIT"):
        return os.environ["FO_COMMIT"]
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], check=True,
                                capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                "--untracked-files=no"], check=True, capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "")


def write_json(path: str, hw: Hardware, device: str | None, results: list[Result],
               settings: dict) -> None:
    record = {
        "format": "flashoverlap.bench/1",
        "device": device,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "command": shlex.join(["flashoverlap"] + sys.argv[1:]),
        "hardware": asdict(hw),
        "settings": settings,
        "environment": report.collect(),
        "results": [asdict(r) for r in results],
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(record, indent=2) + "\n")


def run(args: argparse.Namespace) -> int:
    try:
        hw = pick_hardware(args.backend, args.world_size, args.device)
    except registry.BackendError as e:
        print(f"flashoverlap bench: {e}", file=sys.stderr)
        return 2
    on_cpu = hw.device_type == "cpu"
    shapes = parse_shapes(args.shapes or (CPU_SHAPES if on_cpu else ACCELERATOR_SHAPES))
    ops = parse_ops(args.ops)
    dtype = args.dtype or ("float32" if on_cpu else "bfloat16")
    iters = args.iters if args.iters is not None else (5 if on_cpu else 20)
    if iters < 1 or args.warmup < 0:
        raise SystemExit("flashoverlap bench: --iters must be >= 1 and --warmup >= 0")
    print(f"flashoverlap bench: backend {hw.backend} on {hw.world_size} {hw.device_type} "
          f"rank(s) ({hw.reason}); {dtype}, median of {iters} after {args.warmup} warm-up",
          flush=True)

    cases = [(s, op) for s in shapes for op in ops]
    results, device = [], None
    for i, (res, device) in enumerate(run_cases(hw, cases, dtype, args.warmup, iters,
                                                args.timeout), 1):
        results.append(res)
        print(f"[{i}/{len(cases)}] {res.shape} {res.op}: {res.status}", file=sys.stderr,
              flush=True)
    print(f"device: {device or 'not started'}")
    print("\n".join(table(results)))
    for r in results:
        if r.detail:
            print(f"{r.shape} {r.op}: {r.status}: {r.detail}")
    if args.json:
        settings = {"shapes": ["x".join(map(str, s)) for s in shapes], "ops": ops, "dtype": dtype,
                    "iters": iters, "warmup": args.warmup}
        write_json(args.json, hw, device, results, settings)
        print(f"results written to {args.json}")
    failed = [r for r in results if r.failed]
    print(f"{len(results) - len(failed)} of {len(results)} case(s) without failure"
          + (f"; {len(failed)} FAILED" if failed else ""))
    return 1 if failed else 0
