"""The cost of ``fo.overlap(a, b, op="allgather")`` at world size 1 on the cuda backend.

At world size 1 the op is ``a @ b``: the cuda backend runs its GEMM on a, writing the tiles in
place into out (no gather, no flags). Per shape (bf16, b = w.t()), against ``a @ b`` (cuBLAS):
- ``eager``: device-bound time per call of back-to-back eager calls with default arguments;
- ``graph``: the same call replayed from a CUDA graph (device time, no Python);
- ``own_copy``: the own rows' path of the other world sizes (FLASHOVERLAP_CUDA_GATHER_LOOPBACK=2):
  a copied in one piece on the compute stream into the gathered buffer, then the GEMM on it;
- ``loopback``: the waiting path at world size 1 (FLASHOVERLAP_CUDA_GATHER_LOOPBACK=1): a is
  copied chunk by chunk into the gathered buffer on the communication stream, each chunk setting
  its flag, while the GEMM's tiles wait for them: the default plan (one chunk or a few) and
  ``--chunks`` chunks, graph time. The copies there get only the SMs the waiting GEMM leaves
  free, so this is the waiting path under a slow transfer, not the op at other world sizes.
The ratios are cuBLAS time / ours (> 1: faster than cuBLAS). Shapes include ragged ones (tile
counts not multiples of the grid) and decode-like ones (few rows).

Writes allgather-<device>-<date>.json (device, date, commit, command, rows, summary) to
$FO_RESULTS_DIR or bench/results/.

    python bench/allgather.py [--shapes 16x8192x8192,...] [--chunks 8]
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from callpath import device_ms, graph_ms  # noqa: E402
from common import table, write_result  # noqa: E402

import flashoverlap_core as fo  # noqa: E402
from flashoverlap_core import api  # noqa: E402
from flashoverlap_core.devices import device_name  # noqa: E402
from flashoverlap_core.tools.args import shapes_arg  # noqa: E402

SHAPES = ("16x8192x8192,128x4096x4096,4096x4096x4096,8192x8192x2048,16384x4096x4096,"
          "5120x5120x4096,3072x7168x4096,12288x4096x1536")
LOOPBACK = "FLASHOVERLAP_CUDA_GATHER_LOOPBACK"


def chunked(m, n, k, chunks: int) -> fo.Plan:
    """The default plan's tile with its bands cut into ``chunks`` chunks (as equal as can be)."""
    base = fo.plan(m, n, k, op="allgather", dtype=torch.bfloat16, backend="cuda")
    unit = -(-n // base.tile[1])
    bands = base.num_tiles // unit
    chunks = max(1, min(chunks, bands))
    cuts = [round(bands * i / chunks) for i in range(chunks + 1)]
    sizes = [unit * (y - x) for x, y in zip(cuts, cuts[1:]) if y > x]
    return fo.plan(m, n, k, op="allgather", dtype=torch.bfloat16, backend="cuda",
                   tile=base.tile, group_sizes=sizes)


def with_loopback(mode: int) -> None:
    """FLASHOVERLAP_CUDA_GATHER_LOOPBACK for the keys prepared from now on (0: off)."""
    if mode:
        os.environ[LOOPBACK] = str(mode)
    else:
        os.environ.pop(LOOPBACK, None)
    api.forget_prepared()


def max_error(out, a, b) -> float:
    ref = a.double() @ b.double()
    return ((out.double() - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()


def measure(m, n, k, chunks: int) -> dict:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()
    plan = chunked(m, n, k, chunks)
    row = {"shape": f"{m}x{n}x{k}", "tile": "x".join(map(str, plan.tile))}
    with_loopback(0)
    default = lambda: fo.overlap(a, b, op="allgather")  # noqa: E731 - what users call
    row["error"] = max_error(default(), a, b)
    row["cublas_ms"] = graph_ms(lambda: a @ b)
    row["eager_ms"] = device_ms(default)
    row["graph_ms"] = graph_ms(default)
    with_loopback(2)
    row["own_copy_error"] = max_error(default(), a, b)
    row["own_copy_ms"] = graph_ms(default)
    with_loopback(1)
    row["loopback_error"] = max_error(default(), a, b)
    row["loopback_ms"] = graph_ms(default)
    chunked_call = lambda: fo.overlap(a, b, op="allgather", plan=plan)  # noqa: E731
    row["loopback_chunks"] = plan.num_groups
    row["loopback_chunked_ms"] = graph_ms(chunked_call)
    with_loopback(0)
    for name in ("eager", "graph", "own_copy", "loopback", "loopback_chunked"):
        row[f"{name}_vs_cublas"] = row["cublas_ms"] / row[f"{name}_ms"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=shapes_arg, default=shapes_arg(SHAPES))
    parser.add_argument("--chunks", type=int, default=8, help="chunks of the loopback's chunked plan")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/allgather.py needs a CUDA device")
    rows = []
    for m, n, k in args.shapes:
        rows.append(measure(m, n, k, args.chunks))
        print(table(rows[-1:], list(rows[-1])), flush=True)
    ratios = [r["graph_vs_cublas"] for r in rows]
    summary = {"min_graph_vs_cublas": min(ratios), "median_graph_vs_cublas": statistics.median(ratios),
               "min_eager_vs_cublas": min(r["eager_vs_cublas"] for r in rows),
               "median_own_copy_vs_cublas": statistics.median(r["own_copy_vs_cublas"] for r in rows),
               "median_loopback_chunked_vs_cublas": statistics.median(
                   r["loopback_chunked_vs_cublas"] for r in rows),
               "max_error": max(max(r["error"], r["own_copy_error"], r["loopback_error"])
                                for r in rows)}
    print(table(rows, ["shape", "tile", "cublas_ms", "eager_ms", "graph_ms", "graph_vs_cublas",
                       "own_copy_ms", "own_copy_vs_cublas", "loopback_ms", "loopback_chunked_ms",
                       "loopback_chunked_vs_cublas"]))
    print(summary, flush=True)
    device = re.sub(r"[^a-z0-9]+", "-", device_name("cuda").lower()).strip("-")
    device = "h200" if "h200" in device else device
    write_result(f"allgather-{device}", rows, {"summary": summary, "world_size": 1,
                                               "dtype": "bfloat16", "b": "w.t()"})


if __name__ == "__main__":
    main()
