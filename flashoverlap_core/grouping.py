"""Default wave grouping, used until a tuned plan exists for a shape.

Group g's collective overlaps the computation of the groups after it; the last group's
collective is always exposed. Equal groups of whole waves keep each collective about as long as
the computation it hides behind, and a few groups keep each collective large enough to run near
its bandwidth. So: up to ``max_groups`` groups of whole waves, each at least
``min_group_bytes`` of output, group boundaries on multiples of ``unit`` tiles (the world size
for reduce_scatter, so each group holds the same rows for every rank; whole strips of row
bands for a "rows" plan, whose last strip may be short).
"""
from __future__ import annotations

MAX_GROUPS = 4
MIN_GROUP_BYTES = 1 << 20


def wave_group_sizes(num_tiles: int, wave_size: int, *, unit: int = 1, bytes_per_tile: int = 0,
                     max_groups: int = MAX_GROUPS, min_group_bytes: int = MIN_GROUP_BYTES
                     ) -> tuple[int, ...]:
    """Tiles per group: up to ``max_groups`` near-equal runs of whole waves, each ending on a
    multiple of ``unit`` tiles or at the last tile."""
    waves = -(-num_tiles // wave_size)
    groups = min(max_groups, waves)
    if bytes_per_tile:
        groups = min(groups, max(1, num_tiles * bytes_per_tile // min_group_bytes))
    groups = max(groups, 1)
    bounds = []
    for g in range(1, groups):
        tile = (g * waves // groups) * wave_size
        bounds.append(min(num_tiles, tile // unit * unit))
    edges = sorted(set([0] + bounds + [num_tiles]))
    return tuple(b - a for a, b in zip(edges, edges[1:]) if b > a)


def equal_splits(rows: int, world_size: int) -> list[int]:
    """Rows per destination, as equal as possible (the first ``rows % world_size`` get one
    more): the all_to_all the tools and the tuner run when no splits are given."""
    return [rows // world_size + (r < rows % world_size) for r in range(world_size)]
