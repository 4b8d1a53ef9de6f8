"""``flashoverlap trace``: run one overlapped call and draw its timeline (PNG).

Tiles by completion time and worker / CTA, colored by group, and each group's transfer from its
start to its end, from the backend's :meth:`~flashoverlap_core.backend.Backend.trace` on rank 0.
The grouping is ``--groups``, else the tuned plan from the cache (``--tuned``), else the
heuristic one.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..bench import pick_hardware
from ..plan import DTYPES, Plan
from .cache import TuningCache, tuned_plan
from .plot import plot_timeline
from .ranks import Ranks, command_main, ints_arg, require_trace, shape_arg
from .trace import TileTrace
from .tuner import TRANSFERS, Job, Workload, trace_rank


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", required=True, type=shape_arg,
                        help="per-rank MxNxK of a [M,K] @ [K,N]")
    parser.add_argument("--op", default="allreduce", choices=TRANSFERS)
    parser.add_argument("--dtype", choices=sorted(DTYPES),
                        help="default: float32 on the CPU, bfloat16 on accelerators")
    parser.add_argument("--world-size", type=int,
                        help="ranks (default: every device of the backend; 2 on the CPU)")
    parser.add_argument("--backend", help="default: as for flashoverlap bench")
    parser.add_argument("--groups", type=ints_arg,
                        help="comma-separated tiles per group, in execution order")
    parser.add_argument("--tuned", action="store_true", help="use the tuned plan from the cache")
    parser.add_argument("--cache", help="the tuning cache file (with --tuned)")
    parser.add_argument("--out", default="timeline.png", help="the PNG to write")
    parser.add_argument("--json", metavar="PATH", help="also write the plan and the trace")
    parser.add_argument("--timeout", type=float, default=300.0)


def tuned_groups(job: Job, cache_path: str | None) -> tuple[int, ...] | None:
    """On a rank: the group sizes of the job's tuned plan, if the cache has one."""
    work = Workload(job)
    spec = work.spec(job.plan_op)
    entries = TuningCache(cache_path).entries("plans")
    plan = tuned_plan(spec, work.backend, entries, work.context, job.transfer)
    return plan.group_sizes if plan is not None else None


def run(args: argparse.Namespace) -> int:
    hw = pick_hardware(args.backend, args.world_size)
    require_trace(hw.backend, "trace")
    dtype = args.dtype or ("float32" if hw.device_type == "cpu" else "bfloat16")
    (m, n, k), groups = args.shape, args.groups
    job = Job(m, n, k, args.op, dtype, hw.backend, device_type=hw.device_type)
    with Ranks(hw, args.timeout) as ranks:
        if args.tuned and groups is None:
            groups = ranks.run(tuned_groups, job, args.cache)
            if groups is None:
                print("flashoverlap trace: no tuned plan in the cache for this call; "
                      "tracing the heuristic plan", file=sys.stderr)
        result = ranks.run(trace_rank, job, groups)
    plan, trace = Plan.from_dict(result["plan"]), TileTrace.from_dict(result["trace"])
    title = (f"{hw.backend} {args.op} {m}x{n}x{k} {dtype}, {hw.world_size} rank(s): "
             f"{plan.num_tiles} tiles, {plan.num_waves} waves of {plan.wave_size}, "
             f"{plan.num_groups} groups")
    path = plot_timeline(trace, args.out, title)
    print(plan.describe())
    ms = lambda t: "-" if t is None else f"{t * 1e3:.3f}"  # noqa: E731
    for g, (start, end) in enumerate(zip(trace.transfer_start, trace.transfer_end)):
        print(f"group {g}: tiles ready {ms(trace.group_ready()[g])} ms, "
              f"transfer {ms(start)} - {ms(end)} ms")
    print(f"GEMM end {ms(trace.gemm_end)} ms, call end {ms(trace.call_end)} ms")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"timeline written to {path}")
    return 0


def trace_main(argv: list[str] | None = None) -> int:
    """``flashoverlap trace`` as a function (argv without the program and command names)."""
    return command_main("trace", __doc__, configure, run, argv)


if __name__ == "__main__":
    sys.exit(trace_main())
