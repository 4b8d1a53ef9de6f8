"""Predictive wave-group tuning on one GPU, against measurement, with the host offload as the
transfer (op=HostOffload: every group copied to pinned host memory as soon as it is written).

    python bench/tuning.py [--shapes 8192x8192x8192,...] [--candidates 32] [--timeline PNG]

Per shape: the timing model is measured (the GEMM's wave ends from the backend's traced calls,
the offload's cost curve, contention, one sequential call for calibration), the predictive
search picks a grouping, and every candidate of the measured ("exhaustive") search -- every
grouping over a grid of up to --candidates wave boundaries, plus the predicted choice and the
heuristic grouping -- is timed with real fo.overlap calls. Reported:

* predicted against measured T_overlap for every (shape, grouping) pair (target: within 10%);
  the one-group pair is the calibration point of the model, so the summary leaves it out;
* the predictive choice's measured time against the fastest candidate (target: within 3%);
* the search's time, per shape and on a 500-wave model built from the measured parts (< 1 s).

Writes bench/results/tuning-*.json and a timeline PNG of the chosen plan of the first shape
(tiles by completion time and CTA, the measured and the predicted transfers). Needs a backend
that implements Backend.trace() (default: cuda).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import RESULTS, table, write_result

from flashoverlap_core.tuning.model import GemmTiming, OverlapModel
from flashoverlap_core.tuning.plot import plot_timeline
from flashoverlap_core.tuning.search import measured_candidates, predictive_search
from flashoverlap_core.tuning.trace import TileTrace
from flashoverlap_core.tuning.tuner import Job, build_model, measure_groupings, trace_rank

SHAPES = ("8192x8192x8192,8192x8192x4096,4096x8192x8192,16384x8192x2048,8192x4096x16384,"
          "4096x4096x8192")
ERROR_TARGET, CHOICE_TARGET = 0.10, 1.03


def tune_shape(job: Job, cache: str, candidates: int) -> tuple[list[dict], dict, object]:
    parts = build_model(job, cache)
    model = parts.model()
    choice = predictive_search(model)
    heuristic = tuple(parts.plan["group_sizes"])
    groupings = measured_candidates(model, candidates, extra=[choice.group_sizes, heuristic])
    measured = dict(zip(groupings, measure_groupings(job, groupings)))
    best = min(measured, key=measured.get)
    pairs = []
    for sizes, seconds in measured.items():
        predicted = model.predict(sizes)
        pairs.append({
            "shape": job.shape, "groups": len(sizes), "group_sizes": list(sizes),
            "predicted_ms": round(predicted * 1e3, 4), "measured_ms": round(seconds * 1e3, 4),
            "error_pct": round(100 * (predicted / seconds - 1), 2),
            "calibration": sizes == (model.num_tiles,), "chosen": sizes == choice.group_sizes,
            "heuristic": sizes == heuristic, "best": sizes == best})
    summary = {
        "shape": job.shape, "waves": model.timing.num_waves, "tiles": model.num_tiles,
        "wave_size": model.timing.wave_size, "chosen_groups": list(choice.group_sizes),
        "fell_back": choice.fell_back, "chosen_ms": round(measured[choice.group_sizes] * 1e3, 4),
        "best_ms": round(measured[best] * 1e3, 4), "best_groups": list(best),
        "heuristic_ms": round(measured[heuristic] * 1e3, 4),
        "sequential_ms": round(measured[(model.num_tiles,)] * 1e3, 4),
        "gemm_ms": round(model.timing.end * 1e3, 4),
        "transfer_ms": round(parts.cost(model.prefix_bytes[-1]) * 1e3, 4),
        "choice_vs_best": round(measured[choice.group_sizes] / measured[best], 4),
        "search_ms": round(choice.search_s * 1e3, 3), "candidates": len(measured),
        "contention": parts.contention.to_dict(), "post_ms": round(parts.post_s * 1e3, 4)}
    return pairs, summary, model


def search_time_on_500_waves(model) -> float:
    """Seconds of the predictive search on the measured model stretched to 500 waves."""
    wave_s = model.timing.end / model.timing.num_waves
    waves = 500
    tiles = waves * model.timing.wave_size
    per_tile = model.prefix_bytes[-1] / model.num_tiles
    stretched = OverlapModel(GemmTiming(model.timing.wave_size,
                                        tuple(wave_s * (w + 1) for w in range(waves))),
                             (per_tile * np.arange(tiles + 1)).astype(np.int64),
                             model.cost, model.contention, model.post_s)
    began = time.perf_counter()
    predictive_search(stretched)
    return time.perf_counter() - began


def timeline(job: Job, model, group_sizes, path: Path) -> None:
    traced = trace_rank(job, group_sizes)
    trace = TileTrace.from_dict(traced["trace"])
    predicted = [(g.start, g.end) for g in model.schedule(group_sizes)]
    plot_timeline(trace, path, predicted=predicted, title=(
        f"{job.backend} {job.shape} {job.dtype}, offload to host: {trace.num_items} tiles, "
        f"waves of {trace.wave_size}, groups {list(group_sizes)}"))
    print(f"wrote {path}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", default=SHAPES, help="comma-separated MxNxK")
    p.add_argument("--backend", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda", help="device type of the tensors")
    p.add_argument("--candidates", type=int, default=32,
                   help="groupings of the measured search per shape (plus the chosen one)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--cache", help="tuning cache (default: a fresh one, so all is measured)")
    p.add_argument("--timeline", default=str(RESULTS / "tuning-timeline.png"))
    args = p.parse_args()
    cache = args.cache or str(Path(tempfile.mkdtemp(prefix="fo-tuning-")) / "tuning.json")
    jobs = [Job(*(int(x) for x in s.split("x")), "offload", args.dtype, args.backend,
                args.iters, args.warmup, device_type=args.device)
            for s in args.shapes.split(",")]
    pairs, shapes, models = [], [], []
    for job in jobs:
        try:
            rows, summary, model = tune_shape(job, cache, args.candidates)
        except NotImplementedError as e:
            sys.exit(f"bench/tuning.py: {e}")
        pairs += rows
        shapes.append(summary)
        models.append(model)
        print(f"{job.shape}: chosen {summary['chosen_groups']} {summary['chosen_ms']} ms, "
              f"best {summary['best_groups']} {summary['best_ms']} ms, "
              f"sequential {summary['sequential_ms']} ms", flush=True)
    print(table(pairs, ["shape", "groups", "predicted_ms", "measured_ms", "error_pct", "chosen",
                        "best"]))
    print(table(shapes, ["shape", "waves", "chosen_ms", "best_ms", "choice_vs_best",
                         "heuristic_ms", "sequential_ms", "gemm_ms", "transfer_ms", "search_ms"]))
    validated = [abs(r["error_pct"]) / 100 for r in pairs if not r["calibration"]]
    search_500 = search_time_on_500_waves(models[0])
    summary = {
        "pairs": len(validated),
        "max_abs_error": round(float(max(validated)), 4),
        "median_abs_error": round(float(statistics.median(validated)), 4),
        "within_10pct": round(sum(e <= ERROR_TARGET for e in validated) / len(validated), 3),
        "max_choice_vs_best": max(s["choice_vs_best"] for s in shapes),
        "max_search_ms": max(s["search_ms"] for s in shapes),
        "search_ms_500_waves": round(search_500 * 1e3, 2),
        "targets": {"error": ERROR_TARGET, "choice_vs_best": CHOICE_TARGET, "search_s": 1.0},
    }
    summary["met"] = bool(summary["max_abs_error"] <= ERROR_TARGET
                      and summary["max_choice_vs_best"] <= CHOICE_TARGET
                      and search_500 < 1.0)
    print(summary)
    write_result("tuning", pairs, {"summary": summary, "shapes": shapes},
                 device_type=args.device)
    timeline(jobs[0], models[0], tuple(shapes[0]["chosen_groups"]), Path(args.timeline))
    return 0


if __name__ == "__main__":
    sys.exit(main())
