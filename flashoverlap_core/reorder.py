"""Pre- and post-communication reorder, in plain torch (the executable specification).

A signaling GEMM's epilogue writes each finished tile into its packed slot
(:meth:`~flashoverlap_core.plan.Plan.packed_view`); ``unpack_block`` turns one destination block's tile stream (its tiles in schedule order,
each row-major at its real size, back to back) into row-major rows. Backends with their own
kernels must produce the same bytes.

The post-reorder fused into the next op reads rows instead of tiles: ``band_offsets`` is its
table (per band of BM rows, where each of the band's column tiles starts), ``row_index`` the
addressing a fused kernel does with it, and ``add_rmsnorm`` the op it feeds (residual add +
RMSNorm, ``fo.overlap_add_rmsnorm``).
"""
from __future__ import annotations

import math

import torch

from .tiles import Schedule, TileGrid, TileRect


def block_tiles(rows: int, n: int, tile: tuple[int, int], schedule: Schedule) -> list[TileRect]:
    """A block's tiles in schedule order, with rows counted from the block's first row."""
    return TileGrid((rows,), n, tile[0], tile[1], schedule).block_tiles(0)


def stream_offsets(tiles: list[TileRect]) -> list[int]:
    """Offsets of tiles stored back to back in the given order."""
    out, acc = [], 0
    for t in tiles:
        out.append(acc)
        acc += t.numel
    return out


def unpack_tiles(src: torch.Tensor, offsets: list[int], tiles: list[TileRect],
                 out: torch.Tensor) -> torch.Tensor:
    """Post-communication reorder: tile i, row-major at ``src[offsets[i]:]``, into ``out``."""
    for t, o in zip(tiles, offsets):
        out[t.row0:t.row0 + t.rows, t.col0:t.col0 + t.cols].copy_(
            src[o:o + t.numel].view(t.rows, t.cols))
    return out


def unpack_block(stream: torch.Tensor, out: torch.Tensor, tile: tuple[int, int],
                 schedule: Schedule) -> torch.Tensor:
    """Post-communication reorder of one block: ``stream`` (flat) into ``out`` ([rows, N])."""
    rows, n = out.shape
    if stream.numel() != rows * n:
        raise ValueError(f"a block of {rows}x{n} needs {rows * n} elements, got {stream.numel()}")
    tiles = block_tiles(rows, n, tile, schedule)
    return unpack_tiles(stream, stream_offsets(tiles), tiles, out)


# ---- the post-reorder fused into the next op: rows read through a table of bands ---------------

def band_offsets(tiles: list[TileRect], offsets: list[int], rows: int, n: int,
                 tile: tuple[int, int]) -> list[list[int]]:
    """The fused post-reorder's table of a block of ``rows`` x ``n`` whose tiles (``tile`` =
    (BM, BN), rows counted from the block's first) start at ``offsets`` of the source: entry
    [b][j] is where the tile of band b (rows [b*BM, ...)) and column tile j starts. Row r's
    columns are then, column tile by column tile, the ``cols_j = min(BN, n - j*BN)`` elements at
    ``[b][j] + (r - b*BM) * cols_j`` with b = r // BM (see :func:`row_index`)."""
    bm, bn = tile
    table = [[-1] * math.ceil(n / bn) for _ in range(math.ceil(rows / bm))]
    for t, offset in zip(tiles, offsets, strict=True):
        if (t.row0 % bm or t.col0 % bn or t.rows != min(bm, rows - t.row0)
                or t.cols != min(bn, n - t.col0) or table[t.row0 // bm][t.col0 // bn] != -1):
            raise ValueError(f"tile {t} is not one tile of the {tile} grid over {rows}x{n}, once")
        table[t.row0 // bm][t.col0 // bn] = offset
    if any(-1 in band for band in table):
        raise ValueError(f"the tiles do not cover the {rows}x{n} block")
    return table


def row_index(table: list[list[int]], rows: int, n: int, tile: tuple[int, int]) -> torch.Tensor:
    """[rows, n] source positions of the block's row-major elements through ``table``
    (:func:`band_offsets`): ``source.flatten()[row_index(...)]`` is the post-reordered block."""
    bm, bn = tile
    r = torch.arange(rows).unsqueeze(1)
    c = torch.arange(n).unsqueeze(0)
    j = c // bn
    cols = (n - j * bn).clamp(max=bn)
    starts = torch.tensor(table, dtype=torch.int64)[r // bm, j]
    return starts + (r % bm) * cols + (c - j * bn)


def add_rmsnorm(reduced, residual, weight, eps: float):
    """(normed, residual_out) from the reduced product: ``residual_out = residual + reduced``,
    ``normed = residual_out * rsqrt(mean(residual_out ** 2, -1) + eps) * weight``, in float32
    math (on the unrounded sum), both in ``reduced``'s dtype."""
    resid = residual.float() + reduced.float()
    rstd = torch.rsqrt(resid.pow(2).mean(-1, keepdim=True) + eps)
    return (resid * rstd * weight.float()).to(reduced.dtype), resid.to(reduced.dtype)
