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
