"""The strategy decision itself (issue 31): for each row, the model's predicted choice between the
overlapped call and the plain path, against both measured.

On one GPU a collective at world size 1 moves nothing, so the default call's choice is a fixed
rule there (plain). The one second resource a single GPU has is the host link: a callable op
that offloads each finished group to pinned host memory (``transfers.HostOffload``) overlaps
the GEMM with a device-to-host copy whose bandwidth is real. ``fo.overlap`` always overlaps a
callable op (the caller asked for its transfer); this benchmark lets the model decide it
explicitly, with the same pieces the default call uses for a collective
(``flashoverlap_core.tuning.strategy``):

* the device's GEMM rates (``measure_rates``), measured once;
* the op's cost curve: the offload itself timed at the default choice's four sizes
  (``measure_curve`` on a device-to-host copy into pinned memory);
* ``predict(plan, rates, curve)`` on the default plan of each shape.

Then both strategies run on the same inputs (the default plan, and the same plan with
``strategy="sequential"``: ``a @ b`` on the device's own GEMM, then one offload of the whole
result), alternated in rounds; each row says which was faster, whether the prediction picked
it, and what it lost when it did not. Target: the predicted choice is never more than 3% slower
than the better of the two. Rows at world size 1 with a collective op (an NCCL group of one)
check the fixed rule the same way.

    python bench/strategy.py [--shapes MxNxK,...] [--rounds 5]

Writes bench/results/strategy-<device>-<date>.json (summary: worst loss, rows met).
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch
import torch.distributed as dist

import flashoverlap_core as fo
from flashoverlap_core import api
from flashoverlap_core.transfers import HostOffload
from flashoverlap_core.tuning import strategy
from flashoverlap_core.tuning.measure import measure_curve
from common import device_tag, median_ms, nccl_group_of_one, table, write_result

# (M, N, K): the host link (~50 GB/s) against the GEMM: from transfer-bound (small K, where the
# overlap can hide only the GEMM's short time) to GEMM-bound (large K), and decode rows.
OFFLOAD_SHAPES = ((16, 8192, 4096), (256, 8192, 4096), (1024, 8192, 1024), (1024, 8192, 8192),
                  (4096, 8192, 1024), (4096, 8192, 4096), (4096, 8192, 16384),
                  (8192, 8192, 8192), (16384, 4096, 16384), (16384, 8192, 2048))
COLLECTIVE_SHAPES = ((16, 8192, 1024), (4096, 8192, 1024), (16384, 8192, 3584))
TARGET_LOSS = 0.03
DTYPE = torch.bfloat16


def offload_curve(device: torch.device):
    """The device-to-host copy into pinned memory at the model's curve sizes."""
    host = torch.empty(max(strategy.CURVE_SIZES) // 2, dtype=DTYPE, pin_memory=True)
    return measure_curve(lambda region: host[:region.numel()].copy_(region, non_blocking=True),
                         list(strategy.CURVE_SIZES), DTYPE, device, None, iters=10, warmup=3)


def both(fns: dict, rounds: int) -> dict:
    """{name: median ms}: each function timed in every round, the order alternating."""
    names = list(fns)
    samples = {name: [] for name in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            samples[name].append(median_ms(fns[name], warmup=2, iters=5, inner=3))
    return {name: statistics.median(s) for name, s in samples.items()}


def row(kind, m, n, k, predicted, times, plan) -> dict:
    faster = min(times, key=times.get)
    loss = times[predicted] / times[faster] - 1.0
    return {"kind": kind, "M": m, "N": n, "K": k, "groups": plan.num_groups,
            "layout": plan.layout, "predicted": predicted,
            "T_overlap_ms": round(times[strategy.OVERLAP], 4),
            "T_plain_ms": round(times[strategy.PLAIN], 4), "faster": faster,
            "right": predicted == faster, "loss": round(loss, 4), "met": loss <= TARGET_LOSS}


def offload_row(m, n, k, rates, curve, rounds) -> dict:
    a = torch.randn(m, k, device="cuda", dtype=DTYPE)
    w = torch.randn(n, k, device="cuda", dtype=DTYPE)
    overlap = fo.plan(m, n, k, op="custom", dtype=DTYPE, backend="cuda")
    plain = replace(overlap, strategy=strategy.PLAIN)
    began = time.perf_counter()
    prediction = strategy.predict(overlap, rates, curve)
    predict_ms = (time.perf_counter() - began) * 1e3
    offload = HostOffload.for_plan(overlap)
    out = torch.empty(m, n, device="cuda", dtype=DTYPE)
    fns = {strategy.OVERLAP: lambda: fo.overlap(a, w.t(), offload, plan=overlap, out=out),
           strategy.PLAIN: lambda: fo.overlap(a, w.t(), offload, plan=plain, out=out)}
    times = both(fns, rounds)
    torch.cuda.synchronize()
    r = row("offload", m, n, k, prediction.strategy, times, overlap)
    r.update(predicted_overlap_ms=round(prediction.overlap_s * 1e3, 4),
             predicted_plain_ms=round(prediction.plain_s * 1e3, 4),
             predict_ms=round(predict_ms, 3))
    return r


def collective_row(m, n, k, rounds) -> dict:
    """World size 1, allreduce: the default call's fixed rule (plain) against forced overlap."""
    a = torch.randn(m, k, device="cuda", dtype=DTYPE)
    w = torch.randn(n, k, device="cuda", dtype=DTYPE)
    api.forget_prepared()
    fo.overlap(a, w.t(), "allreduce")  # the default call: its choice, from fo.prepared_calls()
    entry = fo.prepared_calls()[-1]
    predicted = entry["strategy"]
    overlap = fo.plan(m, n, k, op="allreduce", dtype=DTYPE, backend="cuda", world_size=1)
    overlap = replace(overlap, strategy=strategy.OVERLAP)
    plain = replace(overlap, strategy=strategy.PLAIN)
    fns = {strategy.OVERLAP: lambda: fo.overlap(a, w.t(), "allreduce", plan=overlap),
           strategy.PLAIN: lambda: fo.overlap(a, w.t(), "allreduce", plan=plain)}
    r = row("allreduce W=1", m, n, k, predicted, both(fns, rounds), overlap)
    r["reason"] = entry.get("strategy_reason")
    return r


def parse_shapes(text: str | None, default):
    if not text:
        return default
    return tuple(tuple(int(x) for x in s.split("x")) for s in text.split(","))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", help="offload rows, MxNxK comma-separated (default: the table)")
    p.add_argument("--collective-shapes", help="world-size-1 allreduce rows, MxNxK")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/strategy.py needs a CUDA device (the host link is its subject)")
    device = torch.device("cuda", torch.cuda.current_device())
    nccl_group_of_one("strategy")
    try:
        began = time.perf_counter()
        rates = strategy.measure_rates(DTYPE, device, None)
        curve = offload_curve(device)
        facts_s = time.perf_counter() - began
        rows = [offload_row(m, n, k, rates, curve, args.rounds)
                for m, n, k in parse_shapes(args.shapes, OFFLOAD_SHAPES)]
        rows += [collective_row(m, n, k, args.rounds)
                 for m, n, k in parse_shapes(args.collective_shapes, COLLECTIVE_SHAPES)]
    finally:
        dist.destroy_process_group()
    print(table(rows, ["kind", "M", "N", "K", "groups", "predicted", "T_overlap_ms",
                       "T_plain_ms", "faster", "loss", "met"]))
    default_run = not (args.shapes or args.collective_shapes) and args.rounds == 5
    summary = {"rows": len(rows), "rows_met": sum(r["met"] for r in rows),
               "right": sum(r["right"] for r in rows),
               "max_loss": max(r["loss"] for r in rows),
               "target": f"the predicted choice at most {TARGET_LOSS:.0%} slower than the better",
               "met": all(r["met"] for r in rows), "default_run": default_run,
               "facts_measured_s": round(facts_s, 3),
               "offload_curve": {"bytes": list(curve.sizes),
                                 "seconds": [float(s) for s in curve.seconds]},
               "gemm_rates": rates.to_dict()}
    write_result(f"strategy-{device_tag()}", rows, {"summary": summary})


if __name__ == "__main__":
    main()
