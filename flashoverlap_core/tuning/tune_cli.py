"""``flashoverlap tune``: choose the wave groups of each shape and store them in the cache.

For each shape, on the ranks: the timing model is measured (transfer cost curve, the GEMM's
wave ends from traced calls, contention, a sequential call for calibration; cached parts are
reused), the predictive search picks a grouping, and the chosen grouping, the heuristic one and
one group are timed with real calls (``--exhaustive``: every candidate of the measured search
too). The fastest measured grouping is stored for ``overlap`` to use; the table shows predicted
against measured times.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from dataclasses import asdict
from pathlib import Path

from ..bench import pick_hardware
from ..plan import DTYPES, Plan
from .cache import ENV_CACHE, TuningCache, plan_key
from .ranks import Progress, Ranks, command_main, require_trace, shapes_arg
from .search import measured_candidates, predictive_search
from .tuner import TRANSFERS, Job, build_model, measure_groupings

BATCH = 8  # groupings timed per step of the progress bar


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", required=True, type=shapes_arg,
                        help="comma-separated per-rank MxNxK shapes of a [M,K] @ [K,N]")
    parser.add_argument("--op", default="allreduce", choices=TRANSFERS,
                        help="the transfer (offload: every group copied to host memory, "
                        "op=HostOffload; the transfer one device has)")
    parser.add_argument("--dtype", choices=sorted(DTYPES),
                        help="default: float32 on the CPU, bfloat16 on accelerators")
    parser.add_argument("--world-size", type=int,
                        help="ranks (default: every device of the backend; 2 on the CPU)")
    parser.add_argument("--backend", help="default: FLASHOVERLAP_BACKEND, else the best "
                        "available accelerator backend with devices, else reference")
    parser.add_argument("--exhaustive", action="store_true",
                        help="also time every candidate grouping (validation of the predictor)")
    parser.add_argument("--candidates", type=int, default=64,
                        help="at most this many groupings in the exhaustive search")
    parser.add_argument("--iters", type=int, default=10, help="timed calls per measurement")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls first")
    parser.add_argument("--refresh", action="store_true",
                        help="measure again what the cache already holds")
    parser.add_argument("--cache", help="the cache file (default: $FLASHOVERLAP_TUNING_CACHE, "
                        "else ~/.cache/flashoverlap/tuning.json)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds one step may take on the ranks")
    parser.add_argument("--json", metavar="PATH", help="also write the table as JSON")


def tune_shape(ranks: Ranks, job: Job, args, progress: Progress) -> dict:
    progress.begin(f"{job.shape}: measuring the model")
    parts = ranks.run(build_model, job, args.cache, args.refresh)
    progress.end()
    model = parts.model()
    choice = predictive_search(model)
    heuristic = tuple(parts.plan["group_sizes"])
    groupings = list(dict.fromkeys([choice.group_sizes, heuristic, (model.num_tiles,)]))
    if args.exhaustive:
        groupings += [g for g in measured_candidates(model, args.candidates)
                      if g not in groupings]
    batches = [groupings[i:i + BATCH] for i in range(0, len(groupings), BATCH)]
    progress.add(len(batches) - 1)
    measured = {}
    for batch in batches:
        progress.begin(f"{job.shape}: timing {len(batch)} grouping(s)")
        measured.update(zip(batch, ranks.run(measure_groupings, job, batch)))
        progress.end()
    best = min(measured, key=measured.get)
    row = {
        "shape": job.shape, "op": job.op, "dtype": job.dtype, "backend": job.backend,
        "waves": len(model.timing.wave_ends), "chosen_groups": list(choice.group_sizes),
        "fell_back": choice.fell_back, "predicted_ms": choice.predicted_s * 1e3,
        "measured_ms": measured[choice.group_sizes] * 1e3,
        "sequential_predicted_ms": choice.sequential_s * 1e3,
        "sequential_ms": measured[(model.num_tiles,)] * 1e3,
        "heuristic_ms": measured[heuristic] * 1e3, "search_ms": choice.search_s * 1e3,
        "stored_groups": list(best), "stored_ms": measured[best] * 1e3,
        "contention": parts.contention.to_dict(), "candidates_timed": len(measured),
    }
    row["error_pct"] = 100 * (row["predicted_ms"] / row["measured_ms"] - 1)
    if args.exhaustive:
        row["exhaustive_best_ms"] = row["stored_ms"]
        row["choice_vs_best"] = row["measured_ms"] / row["stored_ms"]
    plan = Plan.from_dict({**parts.plan, "group_sizes": list(best)})
    key = plan_key(parts.context, dtype=job.dtype, m=job.m, n=job.n, k=job.k, op=job.plan_op,
                   world_size=plan.world_size, transfer=job.transfer)
    TuningCache(args.cache).put("plans", key, {
        "plan": plan.to_dict(), "measured_ms": row["stored_ms"],
        "predicted_ms": row["predicted_ms"], "sequential_ms": row["sequential_ms"],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")})
    return row


COLUMNS = [("shape", "shape", "{}"), ("op", "op", "{}"), ("waves", "waves", "{}"),
           ("groups", "chosen_groups", "{}"), ("predicted ms", "predicted_ms", "{:.3f}"),
           ("measured ms", "measured_ms", "{:.3f}"), ("error", "error_pct", "{:+.1f}%"),
           ("sequential ms", "sequential_ms", "{:.3f}"), ("heuristic ms", "heuristic_ms", "{:.3f}"),
           ("stored ms", "stored_ms", "{:.3f}"), ("search ms", "search_ms", "{:.1f}")]


def table(rows: list[dict]) -> str:
    cells = [[name for name, _, _ in COLUMNS]]
    cells += [[fmt.format(r[key]) if not isinstance(r[key], list) else
               ",".join(map(str, r[key])) if len(r[key]) <= 6 else f"{len(r[key])} groups"
               for _, key, fmt in COLUMNS] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells)


def run(args: argparse.Namespace) -> int:
    hw = pick_hardware(args.backend, args.world_size)
    require_trace(hw.backend, "tune")
    dtype = args.dtype or ("float32" if hw.device_type == "cpu" else "bfloat16")
    shapes = args.shapes
    if args.iters < 1 or args.warmup < 0:
        raise SystemExit("flashoverlap tune: --iters must be >= 1 and --warmup >= 0")
    if args.op == "reduce_scatter":
        bad = [s for s in shapes if s[0] % hw.world_size]
        if bad:
            raise SystemExit(f"flashoverlap tune: reduce_scatter needs M divisible by the "
                             f"world size {hw.world_size}: {bad}")
    cache = TuningCache(args.cache)
    print(f"flashoverlap tune: backend {hw.backend} on {hw.world_size} {hw.device_type} "
          f"rank(s) ({hw.reason}); {args.op}, {dtype}; cache {cache.path}", flush=True)
    jobs = [Job(m, n, k, args.op, dtype, hw.backend, args.iters, args.warmup,
                device_type=hw.device_type) for m, n, k in shapes]
    progress = Progress(2 * len(jobs))
    with Ranks(hw, args.timeout) as ranks:
        rows = [tune_shape(ranks, job, args, progress) for job in jobs]
    progress.finish()
    print(table(rows))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"hardware": asdict(hw), "rows": rows}, indent=1))
    print(f"{len(rows)} tuned plan(s) written to {cache.path}" if cache.path is not None else
          f"the tuning cache is off ({ENV_CACHE}=off): nothing was stored")
    return 0


def tune_main(argv: list[str] | None = None) -> int:
    """``flashoverlap tune`` as a function (argv without the program and command names)."""
    return command_main("tune", __doc__, configure, run, argv)


if __name__ == "__main__":
    sys.exit(tune_main())
