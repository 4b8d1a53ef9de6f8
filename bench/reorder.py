"""Post-communication reorder kernel bandwidth against a plain device copy of the same bytes.

    python bench/reorder.py [--reps 50] [--inner 10]

Method (bench/gemm.py's): the reorder (fo_unpack_tiles, the cuda plan's tiles in stream order)
and the copy (``dst.copy_(src)``) are each captured in a CUDA graph, and one replay is timed
between two events: device time only, the two alternating within every repetition, median over
``--reps``. Warm: ``--inner`` back-to-back launches per replay (as a model's layers run them),
time / inner. Cold: one launch per replay after a 256 MiB write (the H200's L2 is 50 MB).
Until 2026-12 this script timed one eager launch from Python between events, which counted the
host's launch latency (more for the reorder's ctypes call than for torch's copy) into both: it
understated the reorder most where the kernels are short (78% at 4096x4096).

Bytes counted as read + written (2 x M x N x itemsize). Target: >= 85% of the copy at every
shape, warm and cold (``summary.met``). Writes bench/results/reorder-<device>-<date>.json.
"""
from __future__ import annotations

import argparse

import torch

import flashoverlap_core as fo
from flashoverlap_backends.cuda import kernels
from flashoverlap_core.reorder import unpack_tiles
from common import FLUSH_BYTES, device_tag, stats, table, time_alternating, write_result

SHAPES = [(4096, 4096), (8192, 8192), (16384, 8192), (4097, 4000), (16384, 4096)]
TARGET = 0.85


def measure(runtime, m: int, n: int, args, flush) -> dict:
    dtype = torch.bfloat16
    plan = fo.plan(m, n, 1024, op="custom", dtype=dtype, backend="cuda")
    tiles = [t for t, _, _ in plan.packed_tiles]
    offsets = [offset for _, _, offset in plan.packed_tiles]
    src = torch.randn(m * n, device="cuda", dtype=dtype)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
    rects = torch.tensor([(t.row0, t.rows, t.col0, t.cols) for t in tiles], dtype=torch.int32,
                         device="cuda")
    offs = torch.tensor(offsets, dtype=torch.int64, device="cuda")

    def reorder():
        runtime.unpack_tiles(src.data_ptr(), out.data_ptr(), n, rects.data_ptr(), offs.data_ptr(),
                             len(tiles), src.element_size(), torch.cuda.current_stream().cuda_stream)

    reorder()
    torch.cuda.synchronize()
    expect = unpack_tiles(src, offsets, tiles, torch.empty_like(out))
    assert torch.equal(out, expect), f"{m}x{n}: the reorder kernel's result differs from the reference"
    dst = torch.empty_like(src)
    row = {"M": m, "N": n, "tile": list(plan.tile), "MiB": round(m * n * 2 / 2**20, 1)}
    nbytes = 2 * m * n * src.element_size()
    for mode, inner, buf in (("warm", args.inner, None), ("cold", 1, flush)):
        times = time_alternating({"copy": lambda: dst.copy_(src), "reorder": reorder},
                                 args.reps, inner, buf)
        copy, unpack = stats(times["copy"])["median"], stats(times["reorder"])["median"]
        row.update({f"{mode}_copy_ms": round(copy, 5), f"{mode}_reorder_ms": round(unpack, 5),
                    f"{mode}_copy_GBps": round(nbytes / copy / 1e6, 1),
                    f"{mode}_reorder_GBps": round(nbytes / unpack / 1e6, 1),
                    f"{mode}_fraction_of_copy": round(copy / unpack, 3)})
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=50, help="timed replays per kernel and mode")
    parser.add_argument("--inner", type=int, default=10, help="launches per warm replay")
    args = parser.parse_args()
    runtime = kernels.runtime_library()
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    rows = [measure(runtime, m, n, args, flush) for m, n in SHAPES]
    print(table(rows, ["M", "N", "tile", "warm_copy_GBps", "warm_reorder_GBps",
                       "warm_fraction_of_copy", "cold_copy_GBps", "cold_reorder_GBps",
                       "cold_fraction_of_copy"]))
    worst = {mode: min(r[f"{mode}_fraction_of_copy"] for r in rows) for mode in ("warm", "cold")}
    summary = {"min_fraction_of_copy_warm": worst["warm"], "min_fraction_of_copy_cold": worst["cold"],
               "target": TARGET, "met": min(worst.values()) >= TARGET}
    print(summary)
    write_result(f"reorder-{device_tag()}", rows, {
        "summary": summary, "method": "CUDA-graph replays between events, reorder and copy "
        f"alternated, median of {args.reps}; warm: {args.inner} launches per replay; cold: one "
        f"launch after a {FLUSH_BYTES >> 20} MiB write", "dtype": "bfloat16"})


if __name__ == "__main__":
    main()
