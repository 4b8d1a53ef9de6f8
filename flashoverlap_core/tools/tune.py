"""``flashoverlap tune``: choose the wave groups of each shape and store them in the cache.

For each shape, on the ranks: the timing model is measured (the transfer's cost curve, the
GEMM's wave ends from traced calls, contention, the one-group call and the plain path for
calibration), the predictive search picks a grouping, and the chosen grouping, the heuristic
one, one group and the plain path (``a @ b`` then one collective) are timed with real calls
(``--exhaustive``: every candidate of the measured search too). What is stored for ``overlap``
(:func:`~flashoverlap_core.tuning.tuner.tuned_plan`) is the fastest grouping timed, or the
plain path when nothing beats it, with the shape's table row.

What the cache already holds is reused: a shape tuned before is not measured again (its stored
row is shown, marked "cache"), nor is the transfer's cost curve. ``--refresh`` measures
everything again.
"""
from __future__ import annotations

import argparse
import datetime
import json
from dataclasses import asdict
from pathlib import Path

from .. import registry
from ..collectives import resolve_group
from ..tuning.cache import ENV_CACHE, TuningCache, context_for, plan_key
from ..tuning.search import SEQUENTIAL, measured_candidates, predictive_search
from ..tuning.tuner import (TRANSFERS, Job, build_model, measure_groupings, store_plan,
                            tuned_plan)
from .args import UsageError, add_dtype_options, at_least, dtype_and_scaling, shapes_arg
from .hardware import pick_hardware, require_trace
from .progress import Progress
from .ranks import Ranks
from .table import format_table

BATCH = 8  # groupings timed per step of the progress bar


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", required=True, type=shapes_arg,
                        help="comma-separated per-rank MxNxK shapes of a [M,K] @ [K,N]")
    parser.add_argument("--op", default="allreduce", choices=TRANSFERS,
                        help="the transfer (default: allreduce; offload: every group copied "
                        "to host memory, op=HostOffload, the transfer one device has)")
    add_dtype_options(parser)
    parser.add_argument("--world-size", type=at_least(1),
                        help="ranks (default: every device of the backend; 2 on the CPU)")
    parser.add_argument("--backend", help="default: FLASHOVERLAP_BACKEND, else the best "
                        "available accelerator backend with devices, else reference")
    parser.add_argument("--exhaustive", action="store_true",
                        help="also time every candidate grouping (validation of the predictor)")
    parser.add_argument("--candidates", type=at_least(1), default=64,
                        help="at most this many groupings in the exhaustive search (default: 64)")
    parser.add_argument("--iters", type=at_least(1), default=10,
                        help="timed calls per measurement (default: 10)")
    parser.add_argument("--warmup", type=at_least(0), default=3,
                        help="untimed calls first (default: 3)")
    parser.add_argument("--refresh", action="store_true",
                        help="measure again what the cache already holds: the tuned plans of "
                        "these shapes and the model's parts (default: reuse them)")
    parser.add_argument("--cache", help="the cache file (default: $FLASHOVERLAP_TUNING_CACHE, "
                        "else ~/.cache/flashoverlap/tuning.json)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds one step may take on the ranks (default: 600)")
    parser.add_argument("--json", metavar="PATH", help="also write the table as JSON")


def stored_row(job: Job, cache_path: str | None) -> dict | None:
    """On a rank: the table row stored with the job's tuned plan, if the cache has one."""
    backend = registry.get(job.backend)
    group, _, world = resolve_group(None)
    ctx = context_for(backend, job.device_type or backend.device_type or "cpu", group)
    key = plan_key(ctx, dtype=job.dtype, m=job.m, n=job.n, k=job.k, op=job.plan_op,
                   world_size=world, transfer=job.transfer, scaling=job.scaling)
    value = TuningCache(cache_path).get("plans", key)
    return value.get("row") if value is not None else None


def tune_shape(ranks: Ranks, job: Job, args, progress: Progress) -> dict:
    progress.begin(f"{job.shape}: measuring the model{'' if args.refresh else ' (unless cached)'}")
    row = None if args.refresh else ranks.run(stored_row, job, args.cache)[0]
    if row is not None:
        progress.end()
        progress.end()  # no groupings to time either
        return {**row, "source": "cache"}
    parts = ranks.run(build_model, job, args.cache, args.refresh)[0]
    progress.end()
    model = parts.model()
    choice = predictive_search(model, plain_s=parts.plain_s)
    heuristic, one = tuple(parts.plan["group_sizes"]), (model.num_tiles,)
    groupings = list(dict.fromkeys([choice.group_sizes, heuristic, one]))
    if args.exhaustive:
        groupings += [g for g in measured_candidates(model, args.candidates)
                      if g not in groupings]
    timed = groupings + [SEQUENTIAL]  # and the plain path: the GEMM, then one collective
    batches = [timed[i:i + BATCH] for i in range(0, len(timed), BATCH)]
    progress.add(len(batches) - 1)
    measured = {}
    for batch in batches:
        progress.begin(f"{job.shape}: timing {len(batch)} grouping(s)")
        measured.update(zip(batch, ranks.run(measure_groupings, job, batch)[0]))
        progress.end()
    plan = tuned_plan(parts, choice, measured)
    chosen = SEQUENTIAL if choice.strategy == SEQUENTIAL else choice.group_sizes
    stored = SEQUENTIAL if plan.strategy == SEQUENTIAL else plan.group_sizes
    ms = {g: t * 1e3 for g, t in measured.items()}
    row = {
        "shape": job.shape, "op": job.op, "dtype": job.dtype, "scaling": job.scaling,
        "backend": job.backend,
        "waves": len(model.timing.wave_ends), "chosen_groups": _groups(chosen),
        "fell_back": choice.fell_back, "predicted_ms": choice.predicted_s * 1e3,
        "measured_ms": ms[chosen], "one_group_predicted_ms": choice.sequential_s * 1e3,
        "one_group_ms": ms[one], "plain_ms": ms[SEQUENTIAL], "heuristic_ms": ms[heuristic],
        "search_ms": choice.search_s * 1e3, "stored_groups": _groups(stored),
        "stored_ms": ms[stored], "contention": parts.contention.to_dict(),
        "candidates_timed": len(groupings), "strategy": plan.strategy, "source": "measured",
    }
    row["error_pct"] = 100 * (row["predicted_ms"] / row["measured_ms"] - 1)
    if args.exhaustive:
        row["exhaustive_best_ms"] = min(ms[g] for g in groupings)
        row["choice_vs_best"] = row["measured_ms"] / row["exhaustive_best_ms"]
    store_plan(job, parts, plan, args.cache, measured_ms=row["stored_ms"],
               predicted_ms=row["predicted_ms"], one_group_ms=row["one_group_ms"],
               plain_ms=row["plain_ms"], row=row,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    return row


def _groups(grouping) -> list[int] | str:
    return grouping if grouping == SEQUENTIAL else list(grouping)


# (header, row key, format); "tiles per group" lists group sizes, in tiles, in execution order
COLUMNS = [("shape", "shape", "{}"), ("op", "op", "{}"), ("waves", "waves", "{}"),
           ("chosen: tiles per group", "chosen_groups", "{}"), ("fell back", "fell_back", "{}"),
           ("predicted ms", "predicted_ms", "{:.3f}"), ("measured ms", "measured_ms", "{:.3f}"),
           ("error", "error_pct", "{:+.1f}%"), ("one group ms", "one_group_ms", "{:.3f}"),
           ("plain ms", "plain_ms", "{:.3f}"), ("heuristic ms", "heuristic_ms", "{:.3f}"),
           ("stored: tiles per group", "stored_groups", "{}"), ("stored ms", "stored_ms", "{:.3f}"),
           ("search ms", "search_ms", "{:.1f}"), ("from", "source", "{}")]
LEGEND = ("chosen: the predictive search's grouping (fell back: overlap was predicted not to pay, "
          "so one group or 'sequential', the plain path); predicted / measured ms: its call; "
          "one group: the overlapped call with every tile in one group; plain: a @ b, then one "
          "collective; heuristic: overlap's default grouping; stored: what overlap will use, the "
          "fastest timed (never slower than plain); from: measured now, or the cache "
          "(--refresh measures again).")


def _cell(value, fmt: str) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return ",".join(map(str, value)) if len(value) <= 6 else f"{len(value)} groups"
    return fmt.format(value)


def table(rows: list[dict]) -> str:
    cells = [[name for name, _, _ in COLUMNS]]
    cells += [[_cell(r[key], fmt) for _, key, fmt in COLUMNS] for r in rows]
    return "\n".join(format_table(cells, right=True))


def run(args: argparse.Namespace) -> int:
    hw = pick_hardware(args.backend, args.world_size)
    require_trace(hw.backend)
    dtype, scaling = dtype_and_scaling(args, hw.device_type == "cpu")
    shapes = args.shapes
    if args.op == "reduce_scatter":
        bad = ["x".join(map(str, s)) for s in shapes if s[0] % hw.world_size]
        if bad:
            raise UsageError(f"reduce_scatter needs M divisible by the world size "
                             f"{hw.world_size}: {', '.join(bad)}")
    try:  # (Job refuses what it cannot tune, fp8 all_to_all say, before any rank starts)
        jobs = [Job(m, n, k, args.op, dtype, hw.backend, args.iters, args.warmup,
                    device_type=hw.device_type, scaling=scaling) for m, n, k in shapes]
    except ValueError as e:
        raise UsageError(str(e)) from None
    cache = TuningCache(args.cache)
    print(f"flashoverlap tune: backend {hw.backend} on {hw.world_size} {hw.device_type} "
          f"rank(s) ({hw.reason}); {args.op}, {dtype}{f' ({scaling} scales)' if scaling else ''}; "
          f"cache {cache.path}", flush=True)
    progress = Progress(2 * len(jobs))
    with Ranks(hw.world_size, hw.device_type, timeout=args.timeout, in_process=True) as ranks:
        rows = [tune_shape(ranks, job, args, progress) for job in jobs]
    progress.finish()
    print(table(rows))
    print(LEGEND)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"hardware": asdict(hw), "rows": rows}, indent=1))
    fresh = sum(r["source"] == "measured" for r in rows)
    print(f"{fresh} tuned plan(s) written to {cache.path}" if cache.path is not None else
          f"the tuning cache is off ({ENV_CACHE}=off): nothing was stored")
    return 0

