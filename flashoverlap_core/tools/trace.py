"""``flashoverlap trace``: run one overlapped call and draw its timeline (PNG).

Tiles by completion time and worker / CTA, colored by group, and each group's transfer from its
start to its end, from the backend's :meth:`~flashoverlap_core.backend.Backend.trace` on rank 0.
The grouping is ``--groups``, else the tuned plan from the cache (``--tuned``), else the
heuristic one. The heuristic keeps every group at least 1 MiB of output, so a small output is
one group and shows no overlap: the default shape is large enough for several groups.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

from ..planning import plan as make_plan
from ..grouping import equal_splits
from ..plan import Plan
from ..tile_trace import TileTrace
from ..tuning.cache import TuningCache, tuned_plan
from ..tuning.tuner import TRANSFERS, Job, Workload, trace_rank
from .args import UsageError, add_dtype_options, at_least, dtype_and_scaling, ints_arg, shape_arg
from .hardware import Hardware, pick_hardware, require_trace
from .plot import plot_timeline
from .ranks import Ranks

DEFAULT_SHAPE = {"cpu": "1024x1024x512", "accelerator": "8192x8192x3584"}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", type=shape_arg,
                        help="per-rank MxNxK of a [M,K] @ [K,N] (default: "
                        f"{DEFAULT_SHAPE['cpu']} on the CPU, {DEFAULT_SHAPE['accelerator']} on "
                        "accelerators: 4 groups with the default plan)")
    parser.add_argument("--op", default="allreduce", choices=TRANSFERS,
                        help="the transfer (default: allreduce)")
    add_dtype_options(parser)
    parser.add_argument("--world-size", type=at_least(1),
                        help="ranks (default: every device of the backend; 2 on the CPU)")
    parser.add_argument("--backend", help="default: as for flashoverlap bench")
    parser.add_argument("--groups", type=ints_arg,
                        help="comma-separated tiles per group, in execution order, summing to "
                        "the tile count (default: the heuristic plan's groups)")
    parser.add_argument("--tuned", action="store_true", help="use the tuned plan from the cache")
    parser.add_argument("--cache", help="the tuning cache file (with --tuned)")
    parser.add_argument("--out", default="timeline.png",
                        help="the PNG to write (default: timeline.png in the current directory)")
    parser.add_argument("--json", metavar="PATH", help="also write the plan and the trace")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds the ranks may take (default: 300)")


def check_groups(hw: Hardware, job: Job, groups: tuple[int, ...]) -> None:
    """A :class:`UsageError`, before any rank starts, when ``--groups`` does not fit the plan
    the ranks will make (the same backend defaults, the same splits)."""
    world = hw.world_size
    send = equal_splits(job.m, world) if job.op == "all_to_all" and world > 1 else None
    try:
        base = make_plan(job.m, job.n, job.k, job.plan_op, world, getattr(torch, job.dtype),
                         backend=hw.target, send_splits=send,
                         out_dtype=job.out_dtype, scaling=job.scaling)
        dataclasses.replace(base, group_sizes=groups)
    except (ValueError, TypeError) as e:
        raise UsageError(f"--groups {','.join(map(str, groups))}: {e}") from None


def tuned_groups(job: Job, cache_path: str | None) -> tuple[int, ...] | None:
    """On a rank: the group sizes of the job's tuned plan, if the cache has one."""
    work = Workload(job)
    spec = work.spec(job.plan_op)
    entries = TuningCache(cache_path).entries("plans")
    plan = tuned_plan(spec, work.backend, entries, work.context, job.transfer)
    return plan.group_sizes if plan is not None else None


def run(args: argparse.Namespace) -> int:
    hw = pick_hardware(args.backend, args.world_size)
    require_trace(hw.backend)
    on_cpu = hw.device_type == "cpu"
    dtype, scaling = dtype_and_scaling(args, on_cpu)
    m, n, k = args.shape or shape_arg(DEFAULT_SHAPE["cpu" if on_cpu else "accelerator"])
    groups = args.groups
    try:
        job = Job(m, n, k, args.op, dtype, hw.backend, device_type=hw.device_type,
                  scaling=scaling)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if groups is not None:
        check_groups(hw, job, groups)
    with Ranks(hw.world_size, hw.device_type, timeout=args.timeout, in_process=True) as ranks:
        if args.tuned and groups is None:
            groups = ranks.run(tuned_groups, job, args.cache)[0]
            if groups is None:
                print("flashoverlap trace: no tuned plan in the cache for this call; "
                      "tracing the heuristic plan", file=sys.stderr)
        result = ranks.run(trace_rank, job, groups)[0]
    plan, trace = Plan.from_dict(result["plan"]), TileTrace.from_dict(result["trace"])
    title = (f"{hw.backend} {args.op} {m}x{n}x{k} {dtype}, {hw.world_size} rank(s): "
             f"{plan.num_tiles} tiles, {plan.num_waves} waves of {plan.wave_size}, "
             f"{plan.num_groups} groups")
    path = plot_timeline(trace, args.out, title).resolve()
    print(plan.describe())
    ms = lambda t: "-" if t is None else f"{t * 1e3:.3f}"  # noqa: E731
    for g, (start, end) in enumerate(zip(trace.transfer_start, trace.transfer_end)):
        print(f"group {g}: tiles ready {ms(trace.group_ready()[g])} ms, "
              f"transfer {ms(start)} - {ms(end)} ms")
    print(f"GEMM end {ms(trace.gemm_end)} ms, call end {ms(trace.call_end)} ms")
    if plan.num_groups == 1:
        print("one group: its transfer starts after the whole GEMM, so nothing overlaps; pass "
              "--groups or a larger --shape to see the overlap")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"timeline written to {path}")
    return 0
