"""What the strategy model predicts on several H200s, on paper (issue 31): every figure here is
a PREDICTION of the model in ``flashoverlap_core/tuning/strategy.py``, never a measurement (the
one measurement on several GPUs, two H200s over NVLink, is ``bench/strategy.py --world-size 2``
in docs/results.md).

For the overhead benchmark's shapes (tokens 1..16384 x (N, K)) and ops, at world sizes 2, 4 and
8, over NVLink and over PCIe, it prints and writes the chosen strategy and the predicted speedup
of the chosen strategy over the plain path (plain / chosen). Inputs, all stated in the JSON:

* the device's GEMM: ``--flops`` (bf16 FLOP/s), ``--stream`` (bytes/s), ``--fixed`` (s) and
  ``--processors`` (SMs); defaults: the rates the default call measured on an H200 of the
  two-GPU run (``strategy-w2-h200-20261204-175416.json``: 791 TFLOP/s, 4.4 TB/s, 3.6 us) and
  its 132 SMs;
* each link as a latency and a bus bandwidth (NCCL's "busbw": an allreduce of S bytes takes
  latency + S * 2(W-1)/W / busbw, a reduce_scatter or allgather latency + S * (W-1)/W / busbw):
  NVLink 4 (H200 SXM): 7.5 us and 270 GB/s, from the allreduce curve measured in that run
  (64 KiB in 7.8 us, 64 MiB in 248 us at W = 2), taken for every W, which NCCL's rings and
  trees at W = 4 and 8 need not keep; PCIe Gen5 x16 (64 GB/s a direction): 25 us and 40 GB/s,
  an assumption, not a measurement;
* the plans are the reference backend's with the cuda kernel's tile (128 x 256) and its wave at
  world size > 1 (108 CTAs: the H200's 132 SMs less the 24 it leaves to the collectives), the
  default grouping; the assumed contention of the model.

    python bench/strategy_table.py [--markdown]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import flashoverlap_core as fo
from flashoverlap_core.tuning import strategy as st
from flashoverlap_core.tuning.model import CostCurve

SHAPES = ((8192, 1024), (8192, 3584), (4096, 7168), (7168, 2048), (5120, 3456))
TOKENS = (1, 16, 64, 256, 1024, 4096, 16384)
OPS = ("allreduce", "reduce_scatter", "allgather")
LINKS = {"NVLink": (7.5e-6, 270e9), "PCIe": (25e-6, 40e9)}
WORLDS = (2, 4, 8)
TILE, WAVE = (128, 256), 108  # 132 SMs - 24 left free at W > 1 (cuda device_state)


def curve(op: str, world: int, latency: float, busbw: float) -> CostCurve:
    """The op's collective time against the bytes the model gives it (see the docstring)."""
    factor = 2 * (world - 1) / world if op == "allreduce" else (world - 1) / world
    return CostCurve.affine(latency, busbw / factor, 1 << 34)


def rows_for(args) -> list[dict]:
    rates = st.GemmRates(args.flops, args.stream, args.fixed, args.processors)
    rows = []
    for link, (latency, busbw) in LINKS.items():
        for world in WORLDS:
            for op in OPS:
                costs = curve(op, world, latency, busbw)
                for m in TOKENS:
                    for n, k in SHAPES:
                        rows_total = m * world if op == "allgather" else m
                        if op in ("reduce_scatter", "allgather") and rows_total % world:
                            continue
                        if op == "reduce_scatter" and m < world:
                            continue
                        plan = fo.plan(rows_total, n, k, op=op, world_size=world,
                                       backend="reference", dtype=torch.bfloat16, tile=TILE,
                                       wave_size=WAVE)
                        began = time.perf_counter()
                        p = st.predict(plan, rates, costs)
                        spent = time.perf_counter() - began
                        chosen = p.overlap_s if p.strategy == st.OVERLAP else p.plain_s
                        rows.append({"link": link, "world_size": world, "op": op,
                                     "tokens": m, "N": n, "K": k, "strategy": p.strategy,
                                     "predicted_overlap_us": round(p.overlap_s * 1e6, 1),
                                     "predicted_plain_us": round(p.plain_s * 1e6, 1),
                                     "predicted_speedup": round(p.plain_s / chosen, 3),
                                     "prediction_ms": round(spent * 1e3, 3)})
    return rows


def markdown(rows: list[dict]) -> str:
    """One line per (link, world size, op): where overlap is chosen, and the best speedup."""
    lines = ["| link | W | op | overlap chosen at (tokens) | predicted speedup, median / max |",
             "|---|---|---|---|---|"]
    keys = sorted({(r["link"], r["world_size"], r["op"]) for r in rows},
                  key=lambda x: (x[0] != "NVLink", x[1], OPS.index(x[2])))
    for link, world, op in keys:
        sel = [r for r in rows if (r["link"], r["world_size"], r["op"]) == (link, world, op)]
        chosen = sorted({r["tokens"] for r in sel if r["strategy"] == st.OVERLAP})
        speedups = sorted(r["predicted_speedup"] for r in sel)
        where = ", ".join(str(t) for t in chosen) if chosen else "never"
        lines.append(f"| {link} | {world} | {op} | {where} | "
                     f"{speedups[len(speedups) // 2]:.2f} / {speedups[-1]:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flops", type=float, default=791e12)
    parser.add_argument("--stream", type=float, default=4.4e12)
    parser.add_argument("--fixed", type=float, default=3.6e-6)
    parser.add_argument("--processors", type=int, default=132)
    parser.add_argument("--json", default=None, help="write the rows and inputs here")
    parser.add_argument("--markdown", action="store_true", help="print the summary table")
    args = parser.parse_args(argv)
    rows = rows_for(args)
    inputs = {"gemm": {"flops_per_s": args.flops, "bytes_per_s": args.stream,
                       "fixed_s": args.fixed, "processors": args.processors},
              "links": {k: {"latency_s": v[0], "bus_bytes_per_s": v[1]} for k, v in LINKS.items()},
              "tile": TILE, "wave_size": WAVE, "contention": st.ASSUMED_CONTENTION.to_dict(),
              "note": "PREDICTED by the strategy model, not measured"}
    inputs["prediction_ms"] = {"median": statistics.median(r["prediction_ms"] for r in rows),
                               "max": max(r["prediction_ms"] for r in rows)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"inputs": inputs, "rows": rows}, f, indent=1)
    if args.markdown:
        print(markdown(rows))
    else:
        json.dump(inputs, sys.stdout, indent=1)
        print()
        print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
