"""The README's multi-GPU table from bench/multigpu.py result files.

    python bench/multigpu_report.py bench/results/multigpu-w*.json [--out PATH]

One markdown row per (world size, shape, op), allgather included: sequential, decomposition,
symmetric-memory, FlashOverlap (default arguments, predicted and best) times in ms, their
speedups over sequential, the ideal max(T_gemm, T_comm), the efficiency ideal / T_overlap, the
predictor's error and the backend FlashOverlap's plan ran on; then a per-world-size summary
(geometric-mean speedups per op, drift and rank-failure checks) and, once per reason, why a
symmetric-memory cell is empty.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HEADER = ("W", "shape MxNxK", "op", "sequential ms", "decomposition", "symm-mem",
          "FO default", "FO predicted", "FO best", "ideal", "efficiency", "predictor error",
          "FO ran on", "ok")
OPS = ("allreduce", "reduce_scatter", "all_to_all", "allgather")


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
            timed("decomposition"), timed("symm_mem"), timed("fo_default"),
            timed("fo_predicted"), timed("fo_best"), timed("ideal"),
            _x(r.get("efficiency_fo_predicted")).rstrip("x"),
            "-" if err is None else f"{err:+.1f}%", ran_on(r),
            "yes" if r["status"] == "ok" else r["status"].upper()]


def ran_on(r: dict) -> str:
    """The backend/strategy FlashOverlap's predicted plan ran on ('-' in older files)."""
    ran = ((r.get("notes") or {}).get("ran") or {}).get("fo_predicted")
    return ran.split(" (")[0] if ran else "-"


def symm_mem_reasons(docs: list[dict]) -> list[str]:
    """Each distinct reason a symmetric-memory cell is empty, with the ops it applies to."""
    found: dict[str, set] = {}
    for doc in docs:
        for r in doc["rows"]:
            why = (r.get("notes") or {}).get("symm_mem", "")
            if r.get("symm_mem_ms") is None and why.startswith("unavailable"):
                found.setdefault(why, set()).add(r["op"])
    return [f"- symm-mem {', '.join(sorted(ops))}: {why}" for why, ops in found.items()]


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
        for op in OPS:
            if op in s:
                o = s[op]
                parts.append(f"{op} geomean speedup FO {_x(o['geomean_speedup_fo_predicted'])} "
                             f"(best {_x(o['geomean_speedup_fo_best'])}, default "
                             f"{_x(o.get('geomean_speedup_fo_default'))}, decomposition "
                             f"{_x(o['geomean_speedup_decomposition'])}, symm-mem "
                             f"{_x(o.get('geomean_speedup_symm_mem'))}, ideal "
                             f"{_x(o['geomean_speedup_ideal'])});")
        if rob:
            rf = rob.get("rank_failure", {})
            parts.append(f"drift: {'none' if s.get('drift_ok') else 'FOUND'}; rank failure: "
                         f"{rf.get('status')} (others failed after {rf.get('max_wait_s')} s, "
                         f"pg timeout {rf.get('pg_timeout_s')} s).")
        if s.get("mismatches"):
            parts.append(f"MISMATCHES: {len(s['mismatches'])}.")
        lines.append("- " + " ".join(parts))
    lines += symm_mem_reasons(docs)
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
