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
from flashoverlap_core.ops import HostOffload
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
    """One overlapped offload call: each tile's completion time and CTA, colored by group,
    and each group's transfer span."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype)
    plan = fo.plan(m, n, k, op="custom", dtype=dtype, backend="cuda")
    offload = HostOffload.for_plan(plan)
    events = []

    def traced(region, index):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        offload(region, index)
        end.record()
        events.append((index, start, end))

    fo.overlap(a, w.t(), traced, plan=plan)  # warm
    events.clear()
    monitor = torch.zeros(plan.num_tiles, 2, dtype=torch.int64, device="cuda")
    t0 = torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    t0.record()
    from flashoverlap_core import registry
    from flashoverlap_core.backend import OverlapCall
    backend = registry.get("cuda")
    out = torch.empty(m, n, device="cuda", dtype=dtype)
    backend.run(OverlapCall(a, w.t(), plan, traced, None, 0, 1, out, options={"monitor": monitor}))
    torch.cuda.synchronize()
    mon = monitor.cpu()
    tile_ns = mon[:, 0] - mon[:, 0].min()
    # The GPU timer and CUDA events have different origins: place the first tile one wave
    # time after the kernel's launch (t0), a wave time being the span over the waves.
    wave_ms = tile_ns.max().item() / 1e6 / max(1, plan.num_waves - 1)
    times = tile_ns.double().numpy() / 1e6 + wave_ms
    cta = (mon[:, 1] & 0xFFFFFFFF).numpy()
    _, groups = plan.item_table()
    fig, ax = plt.subplots(figsize=(11, 5))
    ax.scatter(times, cta, c=groups.numpy(), cmap="tab10", s=6)
    for index, start, end in events:
        ax.axvspan(t0.elapsed_time(start), t0.elapsed_time(end), ymin=0.96, ymax=1.0,
                   color=plt.cm.tab10(index % 10), alpha=0.8)
    ax.set_xlabel("ms after launch (transfers: CUDA events; tiles: GPU timer, first tile one wave in)")
    ax.set_ylabel("CTA")
    ax.set_title(f"{m}x{n}x{k} {plan.num_groups} groups, {plan.wave_size} CTAs: tiles by "
                 f"completion (color = group), bars = each group's host transfer")
    fig.savefig(path, dpi=110, bbox_inches="tight")
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
