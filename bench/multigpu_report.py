"""The README's multi-GPU table from bench/multigpu.py result files.

    python bench/multigpu_report.py bench/results/multigpu-w*.json [--out PATH]

One markdown row per (world size, shape, op): sequential, decomposition, symmetric-memory,
FlashOverlap (predicted and best) times in ms, their speedups over sequential, the ideal
max(T_gemm, T_comm), the efficiency ideal / T_overlap and the predictor's error; then a
per-world-size summary (geometric-mean speedups, drift and rank-failure checks).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HEADER = ("W", "shape MxNxK", "op", "sequential ms", "decomposition", "symm-mem",
          "FO predicted", "FO best", "ideal", "efficiency", "predictor error", "ok")


def _ms(v):
    return "-" if v is None else f"{v:.3f}"


def _x(v):
    return "-" if v is None else f"{v:.2f}x"


def row_cells(r: dict) -> list[str]:
    def timed(key):
        ms = r.get(f"{key}_ms")
        return "-" if ms is None else f"{ms:.3f} ({_x(r.get(f'speedup_{key}'))})"
    err = r.get("predictor_error_pct")
    return [str(r["world_size"]), r["shape"], r["op"], _ms(r.get("sequential_ms")),
            timed("decomposition"), timed("symm_mem"), timed("fo_predicted"), timed("fo_best"),
            timed("ideal"), _x(r.get("efficiency_fo_predicted")).rstrip("x"),
            "-" if err is None else f"{err:+.1f}%",
            "yes" if r["status"] == "ok" else r["status"].upper()]


def markdown(docs: list[dict]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for doc in sorted(docs, key=lambda d: d["world_size"]):
        for r in doc["rows"]:
            lines.append("| " + " | ".join(row_cells(r)) + " |")
    lines.append("")
    for doc in sorted(docs, key=lambda d: d["world_size"]):
        s, rob = doc["summary"], doc.get("robustness") or {}
        parts = [f"W={doc['world_size']} on {doc['device']} ({doc['date']}, commit "
                 f"{str(doc['commit'])[:12]}):"]
        for op in ("allreduce", "reduce_scatter", "all_to_all"):
            if op in s:
                o = s[op]
                parts.append(f"{op} geomean speedup FO {_x(o['geomean_speedup_fo_predicted'])} "
                             f"(best {_x(o['geomean_speedup_fo_best'])}, decomposition "
                             f"{_x(o['geomean_speedup_decomposition'])}, ideal "
                             f"{_x(o['geomean_speedup_ideal'])});")
        if rob:
            rf = rob.get("rank_failure", {})
            parts.append(f"drift: {'none' if s.get('drift_ok') else 'FOUND'}; rank failure: "
                         f"{rf.get('status')} (others failed after {rf.get('max_wait_s')} s, "
                         f"pg timeout {rf.get('pg_timeout_s')} s).")
        if s.get("mismatches"):
            parts.append(f"MISMATCHES: {len(s['mismatches'])}.")
        lines.append("- " + " ".join(parts))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("files", nargs="+")
    p.add_argument("--out", help="write the table here too")
    args = p.parse_args(argv)
    docs = [json.loads(Path(f).read_text()) for f in args.files]
    text = markdown([d for d in docs if d.get("format") == "flashoverlap.multigpu/1"])
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
