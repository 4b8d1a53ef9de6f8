"""Post-communication reorder kernel bandwidth against a plain device copy of the same bytes.

    python bench/reorder.py

Bytes counted as read + written (2 x M x N x itemsize). Target: >= 85% of the copy.
Writes bench/results/reorder-*.json.
"""
from __future__ import annotations

import torch

import flashoverlap_core as fo
from flashoverlap_backends.cuda import kernels
from flashoverlap_core.reorder import block_tiles, stream_offsets, unpack_tiles
from common import median_ms, table, write_result

SHAPES = [(4096, 4096), (8192, 8192), (16384, 8192), (4097, 4000), (16384, 4096)]


def main():
    runtime = kernels.runtime_library()
    rows = []
    for m, n in SHAPES:
        dtype = torch.bfloat16
        plan = fo.plan(m, n, 1024, op="custom", dtype=dtype, backend="cuda")
        src = torch.randn(m * n, device="cuda", dtype=dtype)
        out = torch.empty(m, n, device="cuda", dtype=dtype)
        tiles = block_tiles(m, n, plan.tile, plan.schedule)
        rects = torch.tensor([(t.row0, t.rows, t.col0, t.cols) for t in tiles],
                             dtype=torch.int32, device="cuda")
        offs = torch.tensor(stream_offsets(tiles), dtype=torch.int64, device="cuda")

        def unpack():
            runtime.unpack_tiles(src.data_ptr(), out.data_ptr(), n, rects.data_ptr(),
                                 offs.data_ptr(), len(tiles), 2,
                                 torch.cuda.current_stream().cuda_stream)

        unpack()
        torch.cuda.synchronize()
        expect = torch.empty_like(out)
        unpack_tiles(src, stream_offsets(tiles), tiles, expect)
        assert torch.equal(out, expect), "reorder kernel result differs from the reference"
        dst = torch.empty_like(src)
        t_copy = median_ms(lambda: dst.copy_(src), iters=50)
        t_unpack = median_ms(unpack, iters=50)
        nbytes = 2 * m * n * 2
        rows.append({"M": m, "N": n, "tile": list(plan.tile), "copy_ms": round(t_copy, 4),
                     "reorder_ms": round(t_unpack, 4),
                     "copy_GBps": round(nbytes / t_copy / 1e6, 1),
                     "reorder_GBps": round(nbytes / t_unpack / 1e6, 1),
                     "fraction_of_copy": round(t_copy / t_unpack, 3)})
    print(table(rows, list(rows[0])))
    write_result("reorder", rows, {"summary": {"min_fraction_of_copy":
                                               min(r["fraction_of_copy"] for r in rows)}})


if __name__ == "__main__":
    main()
