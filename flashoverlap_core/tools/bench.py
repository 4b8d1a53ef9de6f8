"""``flashoverlap bench``: the main job.

On one rank per device of the best available accelerator backend (or on 2 CPU ranks with the
reference backend when there is none), for each shape and op: time the overlapped call
``overlap(a, b, op)`` against the plain sequence ``a @ b`` then the torch.distributed
collective, and check that both agree. Agreement is judged against a float64 reference (the
same collective on float64 inputs): the overlapped result may differ from the plain one by at
most twice the plain result's own error, plus a few units of rounding of the output dtype.

Times come from :func:`flashoverlap_core.tuning.measure.timed`: every rank starts each
iteration together with an idle device, the slowest rank counts, and the table shows the median
over iterations after warm-up.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import sys
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

import torch
import torch.distributed as dist

from .. import registry
from ..api import overlap, overlap_scaled
from ..backend import OverlapSpec, call_reasons
from ..collectives import all_gather_single, reduce_scatter_single, resolve_group
from ..devices import current_device, device_name
from ..grouping import equal_splits
from ..ops import OPS, of
from ..plan import DTYPES, FP8_DTYPES
from ..tuning.measure import timed
from .args import at_least, choices_arg, shapes_arg
from .hardware import Hardware, pick_hardware
from .ranks import RankError, Ranks, RankTimeout
from .report import collect, git_commit
from .table import format_table

CPU_SHAPES = "512x512x256,1024x1024x512,2048x1024x512"
# Per-rank [M, N, K] of tensor-parallel LLM layers (tokens x hidden x sharded inner size).
ACCELERATOR_SHAPES = "4096x8192x3584,8192x8192x3584,8192x8192x8192"
SEED = 1234
ROUNDING_UNITS = 4  # output-dtype epsilons (times the largest |value|) always allowed
FP8_OUT = torch.bfloat16  # fp8 runs: e4m3 a and b with row-wise scales, bf16 out
FP8_TORCH = tuple(getattr(torch, name) for name in FP8_DTYPES)
LEGEND = (
    "baseline: a @ b, then torch.distributed's collective on the whole output, one after the "
    "other (allgather: the all-gather of a, then the GEMM); overlapped: fo.overlap(a, b, op), the same result with each wave group's "
    "collective started as soon as the GEMM has written the group; speedup = baseline / "
    "overlapped (medians, slowest rank). max error: the largest difference between the two "
    "results; bound: what it may be (twice the baseline's own error against float64, plus "
    f"{ROUNDING_UNITS} units of rounding of the output dtype). fp8 (float8_e4m3fn): a @ b is "
    "torch._scaled_mm with the same row-wise scales and a bf16 result (the dequantized "
    "product where the device has no _scaled_mm).")
HOST_NOTE = (
    "On CPU ranks this run checks that the results agree; it does not measure overlap: the "
    "GEMM and gloo's collective share the same cores, and the reference backend computes tile "
    "by tile in plain torch (it is the executable specification, not a fast path), so speedups "
    "below 1 are expected. Accelerator figures: README.md, 'Measured on one H200', and the "
    "files in bench/results/.")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", help="backend to run (default: FLASHOVERLAP_BACKEND, else "
                        "the best available accelerator backend with devices, else reference)")
    parser.add_argument("--device", metavar="TYPE", help="device type for a backend that runs "
                        "on any device, such as reference or decomposition (default: cpu)")
    parser.add_argument("--world-size", type=at_least(1), help="ranks (default: every device "
                        "of the backend; 2 on the CPU)")
    parser.add_argument("--shapes", type=shapes_arg, help="comma-separated per-rank MxNxK "
                        f"shapes of a [M,K] @ [K,N] (default: {CPU_SHAPES} on the CPU, "
                        f"{ACCELERATOR_SHAPES} on accelerators)")
    parser.add_argument("--ops", type=choices_arg(OPS), default=list(OPS),
                        help=f"comma-separated ops out of {', '.join(OPS)} (default: all; "
                        "all_to_all sends equal row blocks to every rank; for allgather M is "
                        "each rank's rows of a)")
    parser.add_argument("--dtype", choices=sorted(DTYPES),
                        help="input and output dtype (default: float32 on the CPU, bfloat16 "
                        "on accelerators); float8_e4m3fn: e4m3 a and b with row-wise float32 "
                        "scales, bf16 out, against torch._scaled_mm (where the device has "
                        "none, the dequantized product) then the collective")
    parser.add_argument("--iters", type=at_least(1), help="timed iterations (default: 5 on "
                        "the CPU, 20 on accelerators)")
    parser.add_argument("--warmup", type=at_least(0), default=2,
                        help="untimed iterations first (default: 2)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds one case may take on the ranks before they are killed "
                        "(default: 300)")
    parser.add_argument("--json", metavar="PATH",
                        help="also write the results, with device, date, commit and versions")
    parser.add_argument("--strategy", choices=("overlap", "auto"), default="overlap",
                        help="the overlapped column's FLASHOVERLAP_STRATEGY: overlap (default: "
                        "the overlapped path is what this compares) or auto (the default "
                        "call's own choice, which at world size 1 is the plain path)")


# ---------------------------------------------------------------------------------------------
# What runs on every rank
# ---------------------------------------------------------------------------------------------
def matmul(a, b, scales=None):
    """a @ b; fp8 (``scales`` = (scale_a, scale_b)): the scaled GEMM in FP8_OUT, with
    torch._scaled_mm where the device takes it, else the dequantized product."""
    if scales is None:
        return a @ b
    sa, sb = scales
    if scaled_mm_runs(a.device.type):
        return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=FP8_OUT,
                                use_fast_accum=True)
    return ((a.float() * sa) @ (b.float() * sb)).to(FP8_OUT)


@lru_cache(maxsize=None)
def scaled_mm_runs(device_type: str) -> bool:
    """Whether torch._scaled_mm runs a row-wise scaled e4m3 GEMM on this device type (tried
    once on 16 x 16 x 16)."""
    device = current_device(device_type)
    f8 = FP8_TORCH[0]
    a = torch.ones(16, 16, device=device).to(f8)
    ones = torch.ones(16, 1, device=device)
    try:
        torch._scaled_mm(a, a.t(), scale_a=ones, scale_b=ones.t(), out_dtype=FP8_OUT)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def gather_rows(t):
    """Every rank's rows of ``t``, in rank order (fp8 as bytes)."""
    world = dist.get_world_size()
    flat = t.contiguous()
    raw = flat.view(torch.uint8) if flat.dtype in FP8_TORCH else flat
    out = raw.new_empty(raw.shape[0] * world, *raw.shape[1:])
    all_gather_single(out, raw)
    return out.view(t.dtype) if raw is not flat else out


def plain(op: str, a, b, scales=None):
    """The baseline: the GEMM, then torch.distributed's collective on its whole output (for
    allgather the other way round: the all-gather of a, then the GEMM)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if op == "allgather":
        if scales is not None and scales[0].dim():  # row-wise: this rank's rows' scales too
            scales = (gather_rows(scales[0]), scales[1])
        return matmul(gather_rows(a), b, scales)
    c = matmul(a, b, scales)
    if op == "allreduce":
        dist.all_reduce(c)
        return c
    if op == "reduce_scatter":
        out = c.new_empty(c.shape[0] // world, c.shape[1])
        reduce_scatter_single(out, c)
        return out
    splits = equal_splits(c.shape[0], world)
    out = c.new_empty(splits[rank] * world, c.shape[1])
    dist.all_to_all_single(out, c, [splits[rank]] * world, splits)
    return out


def overlapped(op: str, a, b, backend: str, scales=None):
    kwargs = {}
    if op == "all_to_all":
        world, rank = dist.get_world_size(), dist.get_rank()
        splits = equal_splits(a.shape[0], world)
        kwargs = {"send_splits": splits, "recv_splits": [splits[rank]] * world}
    if scales is None:
        return overlap(a, b, op, backend=backend, **kwargs)
    return overlap_scaled(a, b, op, scale_a=scales[0], scale_b=scales[1], out_dtype=FP8_OUT,
                          backend=backend, **kwargs)


def inputs(shape, dtype: str, device, gen):
    """This rank's a, b (an nn.Linear weight's transpose) and, for fp8, row-wise scales."""
    m, n, k = shape
    if dtype not in FP8_DTYPES:
        torch_dtype = getattr(torch, dtype)
        a = torch.randn(m, k, generator=gen, device=device, dtype=torch_dtype)
        return a, (torch.randn(n, k, generator=gen, device=device, dtype=torch_dtype) / k ** 0.5).t(), None
    f8 = getattr(torch, dtype)
    a = torch.randn(m, k, generator=gen, device=device).to(f8)
    b = torch.randn(n, k, generator=gen, device=device).to(f8).t()
    sa = torch.rand(m, 1, generator=gen, device=device) + 0.5
    sb = (torch.rand(1, n, generator=gen, device=device) + 0.5) / k ** 0.5
    return a, b, (sa, sb)


def max_abs(t) -> float:
    return t.abs().max().item() if t.numel() else 0.0  # all_to_all may receive no rows


def agreement_bound(base: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> float:
    """How far an overlapped result may be from the plain one ``base``: twice the plain
    result's own error against the float64 ``expected``, plus a few units of rounding of the
    output dtype."""
    return (2 * max_abs(base - expected)
            + ROUNDING_UNITS * torch.finfo(dtype).eps * max_abs(expected))


def run_case(shape: tuple[int, int, int], op: str, dtype: str, backend: str, device_type: str,
             warmup: int, iters: int) -> dict:
    """On every rank: inputs from a per-rank seed, ``b`` as an nn.Linear weight's transpose;
    the float64 reference, then both timings, then the errors of this rank's results."""
    device = current_device(device_type)
    group = resolve_group(None)[0]
    gen = torch.Generator(device=device).manual_seed(SEED + dist.get_rank())
    a, b, scales = inputs(shape, dtype, device, gen)
    if scales is None:
        expected = plain(op, a.double(), b.double())
        out_dtype = a.dtype
    else:  # float64 of the dequantized inputs (allgather gathers its scaled rows)
        expected = plain(op, a.double() * scales[0].double(), b.double() * scales[1].double())
        out_dtype = FP8_OUT
    base_times = timed(lambda: plain(op, a, b, scales), device, group, iters, warmup)
    over_times = timed(lambda: overlapped(op, a, b, backend, scales), device, group, iters, warmup)
    base = plain(op, a, b, scales).double()
    got = overlapped(op, a, b, backend, scales).double()
    if got.shape != base.shape:
        raise ValueError(f"overlapped result has shape {tuple(got.shape)}, "
                         f"the plain one {tuple(base.shape)}")
    return {"baseline_s": base_times, "overlapped_s": over_times, "error": max_abs(got - base),
            "bound": agreement_bound(base, expected, out_dtype)}


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


def _skip_reason(hw: Hardware, shape, op: str, dtype: str) -> str:
    """Why the case cannot run here: the op's own rule, or the backend declining the call."""
    m, n, k = shape
    world = hw.world_size
    if op == "reduce_scatter" and m % world:
        return f"reduce_scatter needs M divisible by the world size {world}"
    send = tuple(equal_splits(m, world)) if op == "all_to_all" else None
    fp8 = dtype in FP8_DTYPES and op != "all_to_all"  # an fp8 all_to_all runs as float32
    spec = OverlapSpec(of(op).result_rows(m, world), n, k, op, world,
                       "float32" if dtype in FP8_DTYPES and not fp8 else dtype,
                       hw.device_type, "col", send, "bfloat16" if fp8 else None)
    reasons = call_reasons(registry.get(hw.target), spec)
    return f"backend {hw.backend!r} declines it: " + "; ".join(reasons) if reasons else ""


def run_cases(hw: Hardware, cases, dtype: str, warmup: int, iters: int, timeout: float):
    """Run every case on one pool of ranks (a new one if a case killed it); yield
    (Result, the device's name, once ranks have started)."""
    name = None
    with Ranks(hw.world_size, hw.device_type, timeout=timeout) as ranks:
        for shape, op in cases:
            res = Result("x".join(map(str, shape)), op, dtype, hw.backend, hw.world_size, "ok")
            why = _skip_reason(hw, shape, op, dtype)
            if why:
                res.status, res.detail = "skipped", why
                yield res, name
                continue
            try:
                name = name or ranks.run(device_name, hw.device_type)[0]
                per_rank = ranks.run(run_case, shape, op, dtype, hw.target, hw.device_type,
                                     warmup, iters)
                res = summarise(res, per_rank)
            except (RankError, RankTimeout) as e:
                res.status, res.detail = "error", str(e)
            yield res, name


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
    return format_table(rows)


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
        "environment": collect(),
        "results": [asdict(r) for r in results],
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(record, indent=2) + "\n")


def run(args: argparse.Namespace) -> int:
    os.environ["FLASHOVERLAP_STRATEGY"] = args.strategy  # the ranks inherit it
    hw = pick_hardware(args.backend, args.world_size, args.device)
    on_cpu = hw.device_type == "cpu"
    shapes = args.shapes or shapes_arg(CPU_SHAPES if on_cpu else ACCELERATOR_SHAPES)
    dtype = args.dtype or ("float32" if on_cpu else "bfloat16")
    iters = args.iters if args.iters is not None else (5 if on_cpu else 20)
    print(f"flashoverlap bench: backend {hw.backend} on {hw.world_size} {hw.device_type} "
          f"rank(s) ({hw.reason}); {dtype}, median of {iters} after {args.warmup} warm-up",
          flush=True)

    cases = [(s, op) for s in shapes for op in args.ops]
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
    print(LEGEND)
    if on_cpu:
        print(HOST_NOTE)
    if args.json:
        settings = {"shapes": ["x".join(map(str, s)) for s in shapes], "ops": args.ops,
                    "dtype": dtype, "iters": iters, "warmup": args.warmup}
        write_json(args.json, hw, device, results, settings)
        print(f"results written to {args.json}")
    failed = [r for r in results if r.failed]
    print(f"{len(results) - len(failed)} of {len(results)} case(s) without failure"
          + (f"; {len(failed)} FAILED" if failed else ""))
    return 1 if failed else 0
