"""Where a kernel's warps stall, instruction by instruction, from Nsight Compute's source page.

``ci/round.sh ncu-fp8`` with ``FO_NCU_SOURCE=1`` writes ``fp8-ncu-source.csv``: ``ncu --import
REPORT --csv --page source --print-source sass``, one table per profiled kernel (a header row,
then one row per SASS instruction with its sampled warp stalls). This script reads it and
writes, per kernel, the share of the samples by stall reason and the instructions that hold
the most samples, with their reasons: what issue 32's row-wise study compares between our
kernel and torch's.

    python bench/ncu_source.py OUT/fp8-ncu-source.csv [--top 25] [--json extract.json]

Column names differ between Nsight Compute versions, so they are found by what they contain:
the address, the source text, "Warp Stall Sampling (All Samples)", "Instructions Executed",
and one column per stall reason (its name starting with "stall_" or holding "Stall"). A table
whose columns cannot be found is reported, not guessed at.
"""
from __future__ import annotations

import argparse
import csv
import json
import re
import sys


def _number(text: str) -> float:
    text = (text or "").replace(",", "").strip()
    try:
        return float(text)
    except ValueError:
        return 0.0


def _reason(name: str) -> str | None:
    """The stall reason a column counts, shortened (stall_long_sb -> long_sb), else None."""
    low = name.strip().lower()
    if "sampling" in low or "samples" in low:
        return None  # the totals
    for prefix in ("smsp__pcsamp_warps_issue_stalled_", "stall_", "warp stall "):
        if low.startswith(prefix):
            return re.sub(r"[^a-z0-9]+", "_", low[len(prefix):]).strip("_") or None
    if "stall" in low:
        return re.sub(r"[^a-z0-9]+", "_", low.replace("stall", "")).strip("_") or None
    return None


def tables(lines):
    """(title, header, rows) for each table of the CSV; the title is the last non-table line
    before its header (the kernel's name where ncu prints one)."""
    title, header, rows, out = "", None, [], []
    for record in csv.reader(lines):
        if not record:
            continue
        if any("Address" in c for c in record) and any(c.strip() == "Source" for c in record):
            if header is not None:
                out.append((title, header, rows))
            header, rows = record, []
            continue
        if header is None or len(record) < len(header) // 2:
            if header is not None and rows:
                out.append((title, header, rows))
                header, rows = None, []
            title = ",".join(record).strip() or title
            continue
        rows.append(record)
    if header is not None:
        out.append((title, header, rows))
    return out


def summarize(title: str, header: list[str], rows: list[list[str]], top: int) -> dict:
    def column(predicate):
        return next((i for i, c in enumerate(header) if predicate(c.strip())), None)

    address = column(lambda c: "Address" in c)
    source = column(lambda c: c == "Source")
    samples = column(lambda c: "Stall Sampling (All" in c or c == "Warp Stall Sampling")
    executed = column(lambda c: c == "Instructions Executed")
    reasons = {i: r for i, c in enumerate(header) if (r := _reason(c))}
    if None in (address, source, samples):
        return {"kernel": title, "error": "columns not found", "header": header}
    total = sum(_number(r[samples]) for r in rows if len(r) > samples)
    by_reason: dict[str, float] = {}
    instructions = []
    for r in rows:
        if len(r) <= max(address, source, samples):
            continue
        stalls = {name: _number(r[i]) for i, name in reasons.items() if i < len(r) and _number(r[i])}
        for name, v in stalls.items():
            by_reason[name] = by_reason.get(name, 0.0) + v
        instructions.append({
            "offset": r[address].strip(), "sass": r[source].strip(),
            "samples": _number(r[samples]),
            "executed": r[executed].strip() if executed is not None and executed < len(r) else None,
            "stalls": stalls})
    reason_total = sum(by_reason.values()) or 1.0
    instructions.sort(key=lambda x: -x["samples"])
    for x in instructions:
        x["samples_pct"] = round(100.0 * x["samples"] / total, 2) if total else 0.0
    return {"kernel": title, "samples": total, "instructions": len(instructions),
            "stall_share_pct": {k: round(100.0 * v / reason_total, 2)
                                for k, v in sorted(by_reason.items())},
            "top_instructions": instructions[:top]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("csv", help="ncu --csv --page source --print-source sass output")
    p.add_argument("--top", type=int, default=25, help="instructions listed per kernel")
    p.add_argument("--json", help="write the extract here")
    p.add_argument("--source", default="", help="what was profiled (recorded in the JSON)")
    args = p.parse_args(argv)
    with open(args.csv, newline="", errors="replace") as f:
        found = tables(f)
    if not found:
        print(f"no table with an address and a source column in {args.csv}", file=sys.stderr)
        return 1
    kernels = [summarize(*t, args.top) for t in found]
    for k in kernels:
        if "error" in k:
            print(f"{k['kernel']}: {k['error']}: {k['header']}")
            continue
        print(f"== {k['kernel'][:100]}: {k['samples']:.0f} samples, {k['instructions']} "
              f"instructions")
        shares = sorted(k["stall_share_pct"].items(), key=lambda kv: -kv[1])
        print("   " + ", ".join(f"{n} {v:.1f}%" for n, v in shares if v >= 0.5))
        for x in k["top_instructions"][:args.top]:
            why = ", ".join(f"{n} {v:.0f}" for n, v in sorted(x["stalls"].items(),
                                                              key=lambda kv: -kv[1])[:3])
            print(f"   {x['samples_pct']:5.2f}% {x['offset']:>8} {x['sass'][:60]:60} {why}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"source": args.source, "kernels": kernels}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
