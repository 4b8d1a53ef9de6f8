"""The tile grid and the order in which a kernel finishes its tiles.

The output rows are first cut into *destination blocks*: the rows that go to one rank
(``reduce_scatter``: M/W rows each; ``all_to_all``: ``send_splits``; otherwise one block of
all M rows). For ``allgather`` the blocks are sources instead: the M/W rows computed from each
rank's shard of a. Each block is cut into *bands* of at most BM rows and each band into tiles of at
most BN columns, so no tile ever straddles two destinations and edge tiles are partial.

Inside one block the tiles are visited in the order of a :class:`Schedule` (raster direction
and swizzle, like a persistent GEMM's tile scheduler). The blocks are then merged round-robin:
the i-th tile of every block before the (i+1)-th tile of any block. With W equal blocks this
is a batched GEMM whose batch index varies fastest, and every run of W consecutive tiles holds
one tile per destination; the order restricted to one block is always that block's own
schedule, which is what lets a receiver rebuild rows from the tiles alone.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

RASTERS = ("n", "m")


@dataclass(frozen=True)
class Schedule:
    """Tile visiting order inside one block.

    ``raster="n"``: consecutive tiles move along N (across columns); bands are taken
    ``swizzle`` at a time, and inside such a chunk the tiles go column by column, band by
    band. ``raster="m"`` is the transpose. ``swizzle=1`` is a plain row-major
    (``"n"``) or column-major (``"m"``) raster.
    """

    raster: str = "n"
    swizzle: int = 1

    def __post_init__(self):
        if self.raster not in RASTERS:
            raise ValueError(f"schedule raster must be one of {RASTERS}, got {self.raster!r}")
        if not isinstance(self.swizzle, int) or isinstance(self.swizzle, bool) or self.swizzle < 1:
            raise ValueError(f"schedule swizzle must be an int >= 1, got {self.swizzle!r}")

    def order(self, bands: int, cols: int) -> list[tuple[int, int]]:
        """(band, col) pairs of a bands x cols grid in visiting order."""
        outer, inner = (bands, cols) if self.raster == "n" else (cols, bands)
        seq = []
        for start in range(0, outer, self.swizzle):
            width = min(self.swizzle, outer - start)
            for j in range(inner):
                for k in range(start, start + width):
                    seq.append((k, j) if self.raster == "n" else (j, k))
        return seq

    def to_dict(self) -> dict:
        return {"raster": self.raster, "swizzle": self.swizzle}


@dataclass(frozen=True)
class TileRect:
    """One output tile: rows [row0, row0+rows) and columns [col0, col0+cols) of c."""

    row0: int
    rows: int
    col0: int
    cols: int
    block: int  # destination block (rank the rows go to; 0 when there is one block)
    local: int  # position in its block's schedule

    @property
    def numel(self) -> int:
        return self.rows * self.cols


def split_evenly(total: int, step: int) -> list[tuple[int, int]]:
    """(start, length) pieces of at most ``step`` covering [0, total)."""
    return [(s, min(step, total - s)) for s in range(0, total, step)]


@dataclass(frozen=True)
class TileGrid:
    """Destination blocks x bands x column tiles over an [M, N] output."""

    block_rows: tuple[int, ...]  # rows of each destination block, in row order
    n: int
    bm: int
    bn: int
    schedule: Schedule

    @cached_property
    def block_starts(self) -> tuple[int, ...]:
        starts, acc = [], 0
        for rows in self.block_rows:
            starts.append(acc)
            acc += rows
        return tuple(starts)

    def block_tiles(self, block: int) -> list[TileRect]:
        """Tiles of one block in that block's schedule order."""
        start, rows = self.block_starts[block], self.block_rows[block]
        bands = split_evenly(rows, self.bm)
        cols = split_evenly(self.n, self.bn)
        return [
            TileRect(start + bands[b][0], bands[b][1], cols[c][0], cols[c][1], block, i)
            for i, (b, c) in enumerate(self.schedule.order(len(bands), len(cols)))
        ]

    @cached_property
    def execution_order(self) -> tuple[TileRect, ...]:
        """Every tile, in the order the kernel finishes them (round-robin over blocks)."""
        per_block = [self.block_tiles(d) for d in range(len(self.block_rows))]
        longest = max((len(t) for t in per_block), default=0)
        return tuple(t[i] for i in range(longest) for t in per_block if i < len(t))

    @property
    def num_tiles(self) -> int:
        return len(self.execution_order)

    def tiles_per_block(self, block: int) -> int:
        return math.ceil(self.block_rows[block] / self.bm) * math.ceil(self.n / self.bn)
