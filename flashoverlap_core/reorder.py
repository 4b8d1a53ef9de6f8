"""Pre- and post-communication reorder, in plain torch (the executable specification).

``pack_tile`` writes one finished tile into its packed slot (what a signaling GEMM's epilogue
does); ``unpack_block`` turns one destination block's tile stream (its tiles in schedule order,
each row-major at its real size, back to back) into row-major rows. Backends with their own
kernels must produce the same bytes.
"""
from __future__ import annotations

import torch

from .tiles import Schedule, TileGrid, TileRect


def pack_tile(packed: torch.Tensor, offset: int, tile: TileRect, value: torch.Tensor) -> None:
    """Store ``value`` ([rows, cols]) as tile ``tile`` at ``offset`` of the flat packed buffer."""
    packed[offset:offset + tile.numel].view(tile.rows, tile.cols).copy_(value)


def block_tiles(rows: int, n: int, tile: tuple[int, int], schedule: Schedule) -> list[TileRect]:
    """A block's tiles in schedule order, with rows counted from the block's first row."""
    return TileGrid((rows,), n, tile[0], tile[1], schedule).block_tiles(0)


def unpack_block(stream: torch.Tensor, out: torch.Tensor, tile: tuple[int, int],
                 schedule: Schedule) -> torch.Tensor:
    """Post-communication reorder of one block: ``stream`` (flat) into ``out`` ([rows, N])."""
    rows, n = out.shape
    if stream.numel() != rows * n:
        raise ValueError(f"a block of {rows}x{n} needs {rows * n} elements, got {stream.numel()}")
    offset = 0
    for t in block_tiles(rows, n, tile, schedule):
        out[t.row0:t.row0 + t.rows, t.col0:t.col0 + t.cols].copy_(
            stream[offset:offset + t.numel].view(t.rows, t.cols))
        offset += t.numel
    return out
