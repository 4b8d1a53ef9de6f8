"""Single-GPU overlap: the signaling GEMM with each finished group offloaded to pinned host
memory (op=HostOffload), against the GEMM and the transfer alone and in sequence.

    python bench/offload.py [--timeline PNG]

T_gemm: fo.overlap with a no-op op (GEMM, signals, waits, post-reorder); T_transfer: one
device-to-host copy of the packed output; T_sequential: the two one after the other;
T_overlap: fo.overlap with HostOffload. Target: T_overlap <= 1.05 x max(T_gemm, T_transfer).
Writes bench/results/offload-*.json (and the timeline PNG of one call if asked).
"""
from __future__ import annotations

import argparse

import torch

import flashoverlap_core as fo
from flashoverlap_core.transfers import HostOffload
from common import median_ms, table, write_result

SHAPES = [(8192, 8192, 8192), (8192, 8192, 16384), (4096, 8192, 16384), (16384, 8192, 4096),
          (8192, 4096, 16384)]


def noop(region, index):
    return None


def measure(m, n, k, dtype):
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype)
    plan = fo.plan(m, n, k, op="custom", dtype=dtype, backend="cuda")
    offload = HostOffload.for_plan(plan)
    out = torch.empty(m, n, device="cuda", dtype=dtype)
    t_gemm = median_ms(lambda: fo.overlap(a, w.t(), noop, plan=plan, out=out), iters=10)
    host = torch.empty(m * n, dtype=dtype, pin_memory=True)
    src = out.view(-1)
    t_transfer = median_ms(lambda: host.copy_(src, non_blocking=True), iters=10)

    def sequential():
        fo.overlap(a, w.t(), noop, plan=plan, out=out)
        host.copy_(src, non_blocking=True)

    t_seq = median_ms(sequential, iters=10)
    t_overlap = median_ms(lambda: fo.overlap(a, w.t(), offload, plan=plan, out=out), iters=10)
    torch.cuda.synchronize()
    ok = torch.equal(offload.host, out.view(-1)[plan.packed_index().cuda()].cpu())
    ideal = max(t_gemm, t_transfer)
    return {"M": m, "N": n, "K": k, "groups": plan.num_groups, "waves": plan.num_waves,
            "T_gemm": round(t_gemm, 4), "T_transfer": round(t_transfer, 4),
            "T_sequential": round(t_seq, 4), "T_overlap": round(t_overlap, 4),
            "overlap_vs_ideal": round(t_overlap / ideal, 3),
            "speedup_vs_sequential": round(t_seq / t_overlap, 3), "offload_correct": ok}


def timeline(m, n, k, dtype, path):
    """One overlapped offload call, traced: tiles by completion time and CTA, colored by
    group, and each group's host transfer."""
    from flashoverlap_core import registry
    from flashoverlap_core.backend import OverlapCall
    from flashoverlap_core.tools.plot import plot_timeline

    a = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype)
    plan = fo.plan(m, n, k, op="custom", dtype=dtype, backend="cuda")
    offload = HostOffload.for_plan(plan)
    out = torch.empty(m, n, device="cuda", dtype=dtype)
    fo.overlap(a, w.t(), offload, plan=plan, out=out)  # warm-up
    trace = registry.get("cuda").trace(OverlapCall(a, w.t(), plan, offload, None, 0, 1, out))
    plot_timeline(trace, path, title=f"{m}x{n}x{k} bf16, {plan.num_groups} groups, "
                                     f"{plan.wave_size} CTAs, offload to host")
    print(f"wrote {path}")


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--timeline", help="write the timeline PNG of one call here")
    args = p.parse_args()
    rows = [measure(m, n, k, torch.bfloat16) for m, n, k in SHAPES]
    print(table(rows, list(rows[0])))
    write_result("offload", rows, {"summary": {
        "max_overlap_vs_ideal": max(r["overlap_vs_ideal"] for r in rows)}})
    if args.timeline:
        timeline(*SHAPES[0], torch.bfloat16, args.timeline)


if __name__ == "__main__":
    main()
