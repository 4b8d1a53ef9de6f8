"""The figures of README.md and docs/results.md, drawn from the result files in bench/results/.

    python bench/plots.py [--results DIR] [--out DIR]

Each figure is drawn from the newest result file of its benchmark (by the "date" inside it) and
names that file in its footer and in the PNG's "Source" text field (tests/test_readme.py checks
that the README names the same file). No number is typed here: every value comes from the file.

    gemm-vs-cublas.png   signaling GEMM / torch.matmul per shape     gemm-h200-*.json
    host-time.png        host time per call against a @ b            callpath-h200-*.json
    timeline.png         one traced call with host offload, measured
                         against predicted, and the plain path       tuning-h200-*.json

Run it again whenever one of those files changes; it needs matplotlib (extra "plot").
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
OUT = ROOT / "docs" / "img"


def newest(results: Path, pattern: str) -> tuple[Path, dict]:
    """The result file matching ``pattern`` with the latest "date", and its contents."""
    docs = [(json.loads(p.read_text()), p) for p in sorted(results.glob(pattern))]
    if not docs:
        raise SystemExit(f"bench/plots.py: no {pattern} in {results}")
    doc, path = max(docs, key=lambda d: d[0]["date"])
    return path, doc


def shape_label(row: dict) -> str:
    return f"{row['M']}x{row['N']}x{row['K']}"


def save(fig, path: Path, source: Path, doc: dict) -> Path:
    """Write the figure with its source file named in a footer and in the PNG metadata."""
    name = source.relative_to(ROOT).as_posix() if source.is_relative_to(ROOT) else str(source)
    fig.text(0.005, 0.005, f"{doc['device']}, {doc['date'][:10]}; data: {name}",
             fontsize=8, color="dimgray", ha="left", va="bottom")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, metadata={"Source": name, "Software": None})
    print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path} from {name}")
    return path


def gemm_vs_cublas(plt, results: Path, out: Path) -> Path:
    """Per shape and dtype: the signaling GEMM's time over torch.matmul's (warm L2 bars, cold
    L2 dots), the K sweep left out (it shares its shapes' role with the facts set)."""
    source, doc = newest(results, "gemm-h200-*.json")
    rows = [r for r in doc["rows"] if r["set"] != "ksweep"]
    shapes = list(dict.fromkeys(shape_label(r) for r in rows))
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    by = {(shape_label(r), r["dtype"]): r for r in rows}
    fig, ax = plt.subplots(figsize=(11, 4.8))
    width = 0.8 / len(dtypes)
    for d, dtype in enumerate(dtypes):
        xs = [i - 0.4 + width * (d + 0.5) for i in range(len(shapes))]
        warm = [by[(s, dtype)]["warm_product_vs_cublas"] for s in shapes]
        cold = [by[(s, dtype)]["cold_product_vs_cublas"] for s in shapes]
        ax.bar(xs, warm, width * 0.9, label=f"{dtype}, warm L2", color=f"C{d}")
        ax.plot(xs, cold, "o", ms=4, color="black" if d == 0 else "dimgray",
                label=f"{dtype}, cold L2")
    ax.axhline(1.0, color="black", lw=0.8)
    low = min(r["cold_product_vs_cublas"] for r in rows)
    high = max(r["warm_product_vs_cublas"] for r in rows)
    ax.set_ylim(low - 0.02, high + 0.02)
    tiles = {s: "x".join(map(str, by[(s, dtypes[0])]["tile"])) for s in shapes}
    ax.set_xticks(range(len(shapes)),
                  [f"{s}\n{by[(s, dtypes[0])]['set']}, {tiles[s]}" for s in shapes],
                  rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("torch.matmul time / signaling GEMM time\n(above 1: the signaling GEMM is faster)")
    s = doc["summary"]
    ax.set_title(f"Signaling GEMM against cuBLAS (torch.matmul), {s['rows']} shape x dtype "
                 f"pairs: min {round(s['min_vs_cublas'], 4)}x, median {round(s['median_vs_cublas'], 4)}x")
    ax.legend(ncol=2, fontsize=8, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    return save(fig, out / "gemm-vs-cublas.png", source, doc)


def host_time(plt, results: Path, out: Path) -> Path:
    """Per shape: the host time of one fo.overlap call (steady state) and of a @ b alone."""
    source, doc = newest(results, "callpath-h200-*.json")
    rows = doc["rows"]
    series = (("host_us_default", "fo.overlap, default arguments"),
              ("host_us_plan4", "fo.overlap, a 4-group plan"),
              ("host_us_default_moving_a", "fo.overlap, a new a every call"),
              ("host_us_matmul", "a @ b"))
    fig, ax = plt.subplots(figsize=(10, 4.4))
    width = 0.8 / len(series)
    for k, (key, label) in enumerate(series):
        xs = [i - 0.4 + width * (k + 0.5) for i in range(len(rows))]
        ax.bar(xs, [r[key] for r in rows], width * 0.9, label=label,
               color="dimgray" if key == "host_us_matmul" else f"C{k}")
    ax.set_xticks(range(len(rows)), [r["shape"] for r in rows], fontsize=8)
    ax.set_xlabel("shape MxNxK")
    ax.set_ylabel("host time per call, µs")
    ax.set_title(f"Host time per call, allreduce, {doc['dtype']}, NCCL group of one rank "
                 f"({doc['summary']['host_method'].split(':')[0]})")
    ax.legend(fontsize=8, ncol=2, loc="upper left")
    ax.set_ylim(0, max(r[key] for r in rows for key, _ in series) * 1.35)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    return save(fig, out / "host-time.png", source, doc)


def timeline(plt, results: Path, out: Path) -> Path:
    """The traced call of the first shape's chosen plan: the GEMM, each group's ready time and
    transfer, measured and predicted; under it the plain path (GEMM, then one transfer)."""
    source, doc = newest(results, "tuning-h200-*.json")
    shape = doc["shapes"][0]
    traced = [t for t in doc["order_study"]["traces"] if t["shape"] == shape["shape"]
              and t["group_sizes"] == shape["chosen_groups"]]
    if not traced:
        raise SystemExit(f"bench/plots.py: {source.name} has no trace of the chosen plan")
    trace = traced[0]
    fig, ax = plt.subplots(figsize=(11, 3.6))
    lanes = [("measured", trace["measured"], None), ("predicted", trace["predicted"], "//")]
    for y, (_, part, hatch) in enumerate(lanes):
        ax.barh(y - 0.22, part["gemm_end"], 0.3, color="lightgray", edgecolor="black",
                lw=0.5, hatch=hatch)
        for g, (ready, start, end) in enumerate(zip(part["ready"], part["start"], part["end"])):
            ax.barh(y + 0.15, end - start, 0.3, left=start, color=f"C{g}", edgecolor="black",
                    lw=0.5, hatch=hatch)
            ax.plot([ready, ready], [y - 0.37, y - 0.07], color=f"C{g}", lw=2)
    plain = len(lanes)
    ax.barh(plain - 0.22, shape["gemm_ms"], 0.3, color="lightgray", edgecolor="black", lw=0.5)
    ax.barh(plain + 0.15, shape["plain_ms"] - shape["gemm_ms"], 0.3, left=shape["gemm_ms"],
            color="darkgray", edgecolor="black", lw=0.5)
    ax.axvline(trace["measured"]["call_end"], color="black", ls="--", lw=0.8)
    ax.set_yticks(range(plain + 1), [f"overlapped,\n{name}" for name, _, _ in lanes]
                  + ["plain path\n(timed): GEMM,\nthen one transfer"], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms from the call's start (upper bar of a lane: the GEMM, its ticks: a group's "
                  "last tile written; lower bars: each group's transfer; dashed: call complete)",
                  fontsize=8)
    ax.set_title(f"One traced call with host offload on one GPU, {shape['shape']}, groups "
                 f"{shape['chosen_groups']} of {shape['tiles']} tiles ({shape['waves']} waves)\n"
                 f"timed back to back: tuned plan {shape['chosen_ms']:.2f} ms, plain path "
                 f"{shape['plain_ms']:.2f} ms", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return save(fig, out / "timeline.png", source, doc)


FIGURES = (gemm_vs_cublas, host_time, timeline)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--results", type=Path, default=RESULTS, help="where the result files are")
    p.add_argument("--out", type=Path, default=OUT, help="where the PNGs go")
    args = p.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for figure in FIGURES:
        figure(plt, args.results.resolve(), args.out.resolve())
        plt.close("all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
