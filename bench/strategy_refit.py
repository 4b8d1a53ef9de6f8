"""Refit the strategy model on a multi-GPU decision run (``bench/strategy.py --world-size W``).

Each row of such a run holds both strategies measured and the facts the default call
predicted from (the device's GEMM rates, the collective's cost curve, the contention; on cuda
also the collective timed on the overlapped calls' bounded communicator). This script
predicts every row again under variants of the model, without a device, and reports for each
how often its choice is within 3% of the faster strategy and how far its times are from the
measured ones:

* ``contention`` (GEMM and collective slowdowns while both run) on a grid;
* ``share``: a tile of a wave at 1/wave_size of the device's GEMM rate (the model until
  2026-12-04) or at one SM's share, 1/SMs (the rates' ``processors``, else ``--sms``), which a
  wave that leaves SMs to the collective runs at (the model since);
* ``curve``: the collective timed on torch's communicator (the model as it is) or on the
  bounded one (where the row has it).

all_to_all rows are left out (this script rebuilds each row's plan without splits; runs before
tree 94e0b49 chose them by a fixed rule). Prints the best variants; ``--json``
writes them all.

    python bench/strategy_refit.py bench/results/strategy-w2-<device>-<date>.json [...] [--sms 132]
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from dataclasses import replace

import torch

import flashoverlap_core as fo
from flashoverlap_core.tuning import strategy as st
from flashoverlap_core.tuning.model import Contention, CostCurve

TARGET_LOSS = 0.03
GEMM_SLOWDOWNS = (1.0, 1.05, 1.1, 1.2, 1.3)
COMM_SLOWDOWNS = (1.0, 1.1, 1.2, 1.3, 1.5)


def usable(rows: list[dict]) -> list[dict]:
    """Rows with both times, the facts and the plan's tile (runs from b3bfd15 on)."""
    return [r for r in rows if r.get("op") not in (None, "all_to_all") and r.get("facts")
            and r.get("tile") and r.get("T_overlap_ms") and r.get("T_plain_ms")]


def plan_of(row: dict):
    return fo.plan(row["M"], row["N"], row["K"], op=row["op"], world_size=row["world_size"],
                   backend="reference", dtype=torch.bfloat16, tile=tuple(row["tile"]),
                   wave_size=row["wave_size"], layout=row.get("layout"))


def predict(row: dict, plan, contention: Contention, share: str, curve: str, sms: int):
    """(overlap s, plain s, choice) of one row under one variant."""
    facts = row["facts"]
    rates = st.GemmRates.from_dict(facts["gemm_rates"])
    torch_curve = CostCurve.from_dict(facts["curve"])
    bounded = facts.get("bounded_curve") or {}
    overlap_curve = (CostCurve.from_dict(bounded) if curve == "bounded" and "sizes" in bounded
                     else torch_curve)
    plain = st.predict(plan, rates, torch_curve, contention).plain_s
    # a tile at 1/sms of the rate (the model from tree 2026-12-04 18:00 on, with the device's
    # count in the rates) or at 1/wave_size (before)
    overlap_rates = replace(rates, processors=(rates.processors or sms) if share == "sm" else 0)
    overlap = st.predict(plan, overlap_rates, overlap_curve, contention).overlap_s
    choice = st.OVERLAP if overlap <= plain * (1.0 - st.MIN_GAIN) else st.PLAIN
    return overlap, plain, choice


def score(rows: list[dict], plans: list, contention: Contention, share: str, curve: str,
          sms: int) -> dict:
    within, right, errors, worst = 0, 0, [], 0.0
    for row, plan in zip(rows, plans):
        overlap, plain, choice = predict(row, plan, contention, share, curve, sms)
        measured = {st.OVERLAP: row["T_overlap_ms"], st.PLAIN: row["T_plain_ms"]}
        best = min(measured.values())
        loss = measured[choice] / best - 1.0
        within += loss <= TARGET_LOSS
        right += measured[choice] == best
        worst = max(worst, loss)
        errors += [abs(overlap * 1e3 / measured[st.OVERLAP] - 1.0),
                   abs(plain * 1e3 / measured[st.PLAIN] - 1.0)]
    return {"contention": contention.to_dict(), "share": share, "curve": curve,
            "rows_within_3pct": within, "right": right, "rows": len(rows),
            "max_loss": round(worst, 4),
            "median_abs_error": round(statistics.median(errors), 4) if errors else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", help="strategy-w<W>-*.json of bench/strategy.py")
    p.add_argument("--sms", type=int, default=132, help="the device's SMs (H200: 132)")
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--json", help="write every variant's score here")
    args = p.parse_args(argv)
    rows = []
    for path in args.files:
        with open(path) as f:
            rows += usable(json.load(f)["rows"])
    if not rows:
        print("no usable rows: they need both times, 'facts' and 'tile' (bench/strategy.py "
              "--world-size from b3bfd15 on); all_to_all rows are left out", file=sys.stderr)
        return 1
    plans = [plan_of(r) for r in rows]
    gaps = {(r["facts"]["contention"]["gap_s"], r["facts"]["contention"]["lag_s"]) for r in rows}
    gap_s, lag_s = sorted(gaps)[0]
    scores = []
    for gemm, comm, share, curve in itertools.product(GEMM_SLOWDOWNS, COMM_SLOWDOWNS,
                                                      ("wave", "sm"), ("torch", "bounded")):
        contention = Contention(gemm=gemm, comm=comm, gap_s=gap_s, lag_s=lag_s)
        scores.append(score(rows, plans, contention, share, curve, args.sms))
    shared = "sm" if rows[0]["facts"]["gemm_rates"].get("processors") else "wave"
    as_run = next((s for s in scores if s["share"] == shared and s["curve"] == "torch"
                   and s["contention"] == Contention.from_dict(
                       rows[0]["facts"]["contention"]).to_dict()), None)
    scores.sort(key=lambda s: (-s["rows_within_3pct"], s["max_loss"], s["median_abs_error"]))
    print(f"{len(rows)} rows from {len(args.files)} file(s); the model as run: {as_run}")
    for s in scores[:args.top]:
        print(s)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": len(rows), "as_run": as_run, "variants": scores}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
