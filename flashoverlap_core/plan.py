"""The overlap plan: which tiles form each wave group and where they sit in the packed buffer.

A plan is backend-neutral and inspectable. It fixes:

* the tile grid over the [M, N] output (:mod:`flashoverlap_core.tiles`), including the
  destination blocks of ``reduce_scatter`` / ``all_to_all`` and the partial edge tiles;
* the execution order (the kernel's tile order) and the wave size P (tiles finished at once);
* ``group_sizes``: how many tiles, in execution order, each group holds;
* the packed layout: group g occupies one contiguous *region*, which splits into one
  contiguous part per destination block (what ``reduce_scatter`` and ``all_to_all`` hand to
  the collective). Its ``layout`` says how a part holds its tiles:

  - ``"rows"`` (the default wherever the groups allow it): every group is whole row bands of
    each block, so a part is the group's rows of that block, row-major (row stride N). That is
    the final layout: an allreduce works in place on the output, a reduce_scatter or all_to_all
    receives straight into the output's rows, and nothing is reordered after the collective.
  - ``"tiles"``: each tile row-major at its real (possibly partial) size, back to back in the
    block's schedule order, for groups that cut bands. The parts a rank receives, concatenated
    over groups, are its block's tiles in schedule order: the post-communication reorder needs
    nothing but the block's shape.

``allgather`` turns this around: the collective feeds the GEMM instead of consuming it. Its
blocks are the source ranks' shards (m = M/W rows each), and group g is a *chunk of the
gather*: the same run of whole row bands in every shard. The chunk's rows are gathered by one
collective into a contiguous region of the packed buffer, which for this op holds the gathered
rows of a ([M, K], chunk by chunk, each chunk source by source); the chunk's tiles depend on
it. A rank computes its own shard's tiles first (they depend on nothing), then each chunk's
other tiles as the chunk arrives (:meth:`Plan.local_tiles`, :meth:`Plan.arriving_tiles`). The
output is written in place, row-major: there is no post-communication reorder.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache

import torch

from .ops import CUSTOM_OP, GATHER_OP, OPS, PLAN_OPS, OpKind, of  # noqa: F401 (the op names: re-exported)
from .tiles import Schedule, TileGrid, TileRect

STRATEGIES = ("overlap", "sequential")
"""How a backend runs the plan: "overlap" (the groups' transfers overlapped with the GEMM) or
"sequential" (the plain GEMM and one collective on all of it, one after the other, the
collective first for allgather: the tuner's fallback where overlapping would be slower; the
groups are then unused)."""
GROUPINGS = ("waves", "destinations")
"""How a plan cuts its tiles into groups. "waves": ``group_sizes`` tiles at a time, in execution
order. "destinations" (all_to_all): group g takes from each destination block the tiles
[floor(g T / G), floor((g + 1) T / G)) of the block's T tiles in schedule order, so a rank that
knows only how many rows a source sends it knows what each of that source's groups brings
(:func:`destination_chunks`): the rule every rank computes alike, with no exchange, whatever
the ranks' rows and splits. Groups may then be empty, and G is the same on every rank."""
LAYOUTS = ("rows", "tiles")
"""How a plan's packed buffer holds its tiles (see the module docstring): "rows", each group's
part for a destination is whole rows of that destination's block, row-major (no post-reorder);
"tiles", tile after tile (any group sizes; a post-reorder restores the rows)."""
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# fp8 (float8_e4m3fn a and b with float32 scales, flashoverlap_core/fp8.py): the result is in
# one of OUT_DTYPES, the plan's out_dtype
FP8_DTYPES = tuple(n for n in ("float8_e4m3fn",) if hasattr(torch, n))
DTYPES.update({n: getattr(torch, n) for n in FP8_DTYPES})
OUT_DTYPES = ("bfloat16", "float16")
# An fp8 call's scaling kind (fp8.scaling_kind): "blockwise" (1x128 groups of a along K,
# 128x128 blocks of b) runs other kernels than "tensorwise" and "rowwise", which share plans;
# a plan's ``scaling`` is "blockwise" or None (every other call)
SCALINGS = ("tensorwise", "rowwise", "blockwise")
FORMAT = "flashoverlap.plan/1"
ALL_TO_ALL_GROUPS = 4  # G of an all_to_all plan without group_sizes (the same on every rank)


def all_to_all_groups(world_size: int, tiles: int, groups: int = ALL_TO_ALL_GROUPS) -> int:
    """G of a "destinations" plan: ``groups`` on every rank at world size > 1 (whatever its
    tiles: a rank with fewer has empty groups); at world size 1, where no rank must agree,
    no more groups than tiles."""
    return groups if world_size > 1 else max(1, min(groups, tiles))


def destination_chunks(tiles: int, groups: int, unit: int = 1) -> list[tuple[int, int]]:
    """The tiles [lo, hi) of a destination block of ``tiles`` tiles that each of ``groups``
    groups takes ("destinations" grouping): the block's runs of ``unit`` tiles (a "rows"
    plan's whole strips of bands, :func:`strip_tiles`; the last may be short) shared out as
    evenly as they go."""
    units = -(-tiles // unit)
    return [(min(tiles, g * units // groups * unit), min(tiles, (g + 1) * units // groups * unit))
            for g in range(groups)]


def strip_tiles(n: int, tile: tuple[int, int], schedule: Schedule) -> int:
    """Tiles of one strip of bands (the ``swizzle`` bands a raster-"n" schedule visits column
    by column): the smallest run of a block's schedule that is whole row bands."""
    return schedule.swizzle * -(-n // tile[1])


def layout_unit(layout: str, n: int, tile: tuple[int, int], schedule: Schedule) -> int:
    """Tiles of a block that a group takes at a time: whole strips for "rows", any for "tiles"."""
    return strip_tiles(n, tile, schedule) if layout == "rows" else 1


def dtype_name(dtype) -> str:
    """Canonical name of a supported dtype (accepts torch.dtype or its name)."""
    if isinstance(dtype, torch.dtype):
        for name, value in DTYPES.items():
            if value == dtype:
                return name
        raise TypeError(f"dtype {dtype} is not supported; use one of {sorted(DTYPES)}")
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        if name in DTYPES:
            return name
        raise TypeError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
    raise TypeError(f"dtype must be a torch.dtype or its name, got {type(dtype).__name__}")


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_splits(name: str, splits, world_size: int, total: int | None) -> tuple[int, ...]:
    """Validate per-rank row counts: W non-negative ints, summing to ``total`` if given."""
    if isinstance(splits, torch.Tensor):
        splits = splits.tolist()
    if not isinstance(splits, (list, tuple)):
        raise TypeError(f"{name} must be a list of {world_size} ints, got {type(splits).__name__}")
    if len(splits) != world_size:
        raise ValueError(f"{name} must have one entry per rank ({world_size}), got {len(splits)}")
    out = tuple(splits)
    # every call of an MoE layer checks its splits: plain non-negative ints take one pass;
    # symbolic ones (a fake kernel's, under torch.compile) are checked when the call runs
    if not all(type(s) is int for s in out) or (out and min(out) < 0):
        out = tuple(s if isinstance(s, torch.SymInt) else _check_int(f"{name}[{i}]", s, 0)
                    for i, s in enumerate(out))
    if total is not None and sum(out) != total:
        raise ValueError(f"{name} must sum to the rows of a ({total}), got sum {sum(out)}")
    return out


def block_rows_for(op: str, m: int, world_size: int, send_splits) -> tuple[int, ...]:
    """Rows of c sent to each destination (one block for allreduce / custom ops); for allgather
    the rows of c computed from each source rank's shard (:meth:`OpKind.block_rows`)."""
    return of(op).block_rows(m, world_size, send_splits)


def group_unit(op: str, world_size: int, n: int, tile: tuple[int, int], layout: str = "tiles",
               schedule: Schedule | None = None) -> int:
    """Tiles every group size must be a multiple of (with the default tile order;
    :meth:`OpKind.group_unit`). A "rows" plan's groups are whole strips of bands of every
    block (x :func:`strip_tiles`)."""
    strip = layout_unit(layout, n, tile, schedule) if schedule is not None else 1
    return of(op).group_unit(world_size, n, tile, strip)


def moved_dtype(op: str, dtype: str, out_dtype: str | None) -> torch.dtype:
    """What the collective moves: the rows of a for allgather, else the result (an fp8 call's
    result is out_dtype)."""
    return DTYPES[dtype if op == GATHER_OP or out_dtype is None else out_dtype]


def check_out_dtype(dtype: str, out_dtype) -> str | None:
    """An fp8 dtype's result dtype (bfloat16 when None); None for other dtypes, which take
    none."""
    if dtype not in FP8_DTYPES:
        if out_dtype is not None:
            raise ValueError(f"out_dtype is for fp8 ({', '.join(FP8_DTYPES)}) plans, not {dtype}")
        return None
    out = "bfloat16" if out_dtype is None else dtype_name(out_dtype)
    if out not in OUT_DTYPES:
        raise ValueError(f"an fp8 plan's out_dtype must be one of {OUT_DTYPES}, got {out!r}")
    return out


def check_scaling(dtype: str, scaling) -> str | None:
    """A plan's ``scaling`` for an fp8 ``dtype``: "blockwise", or None for tensor-wise and
    row-wise scales (they share plans); None for other dtypes, which take none."""
    if scaling is not None and scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {SCALINGS} or None, got {scaling!r}")
    if dtype not in FP8_DTYPES:
        if scaling is not None:
            raise ValueError(f"scaling is for fp8 ({', '.join(FP8_DTYPES)}) plans, not {dtype}")
        return None
    return "blockwise" if scaling == "blockwise" else None


def transfer_bytes_per_tile(op: str, n: int, k: int, tile: tuple[int, int], itemsize: int) -> int:
    """About how many bytes of the group's transfer each tile accounts for: its output, or for
    allgather its share of the rows of a that its band brings (BM x K over the column tiles)."""
    if op == GATHER_OP:
        return max(1, tile[0] * k * itemsize // -(-n // tile[1]))
    return tile[0] * tile[1] * itemsize


def destination_group_sizes(grid: TileGrid, groups: int, layout: str = "tiles") -> tuple[int, ...]:
    """Tiles of each group of a "destinations" plan over ``grid``."""
    sizes = [0] * groups
    unit = layout_unit(layout, grid.n, (grid.bm, grid.bn), grid.schedule)
    for d in range(len(grid.block_rows)):
        for g, (lo, hi) in enumerate(destination_chunks(grid.tiles_per_block(d), groups, unit)):
            sizes[g] += hi - lo
    return tuple(sizes)


@dataclass(frozen=True)
class Region:
    """Group ``index``'s contiguous slice of the packed buffer."""

    index: int
    offset: int  # elements from the start of the packed buffer
    numel: int
    dest_numels: tuple[int, ...]  # contiguous part per destination block (allgather: per
    # source shard), in rank order


@dataclass(frozen=True)
class Plan:
    """A validated overlap plan. Build one with :func:`flashoverlap_core.plan`."""

    m: int
    n: int
    k: int
    op: str
    world_size: int
    dtype: str
    tile: tuple[int, int]
    wave_size: int
    group_sizes: tuple[int, ...]
    schedule: Schedule = field(default_factory=Schedule)
    send_splits: tuple[int, ...] | None = None
    backend: str | None = None
    strategy: str = "overlap"  # one of STRATEGIES
    grouping: str = "waves"  # one of GROUPINGS
    out_dtype: str | None = None  # fp8 plans: the result's dtype (OUT_DTYPES; bfloat16 if None)
    layout: str | None = None  # one of LAYOUTS; None: "tiles" (allgather: "rows", always)
    scaling: str | None = None  # fp8 plans: "blockwise", or None (tensor-wise and row-wise)

    def __post_init__(self):
        # all_to_all: a rank may have no rows to send (expert parallelism)
        _check_int("M", self.m, 0 if self.op == "all_to_all" else 1)
        for name in ("n", "k"):
            _check_int(name.upper(), getattr(self, name), 1)
        _check_int("world_size", self.world_size, 1)
        _check_int("wave_size", self.wave_size, 1)
        if self.op not in PLAN_OPS:
            raise ValueError(f"plan op must be one of {PLAN_OPS}, got {self.op!r}")
        kind = self.kind
        object.__setattr__(self, "out_dtype", check_out_dtype(dtype_name(self.dtype), self.out_dtype))
        object.__setattr__(self, "scaling", check_scaling(dtype_name(self.dtype), self.scaling))
        if not isinstance(self.tile, tuple) or len(self.tile) != 2:
            raise TypeError(f"tile must be a pair (BM, BN) of ints, got {self.tile!r}")
        _check_int("tile BM", self.tile[0], 1)
        _check_int("tile BN", self.tile[1], 1)
        if not isinstance(self.schedule, Schedule):
            raise TypeError(f"schedule must be a Schedule, got {type(self.schedule).__name__}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"plan strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.grouping not in GROUPINGS:
            raise ValueError(f"plan grouping must be one of {GROUPINGS}, got {self.grouping!r}")
        if self.grouping == "destinations" and not kind.splits:
            raise ValueError(f"the 'destinations' grouping is all_to_all's, not {self.op!r}'s")
        layout = self.layout if self.layout is not None else (
            "rows" if kind.gathers else "tiles")
        if layout not in LAYOUTS:
            raise ValueError(f"plan layout must be one of {LAYOUTS}, got {layout!r}")
        if kind.gathers and layout != "rows":
            raise ValueError("an allgather plan writes its output in place (layout 'rows'); "
                             f"got layout {layout!r}")
        object.__setattr__(self, "layout", layout)
        if kind.blocks == "ranks" and self.m % self.world_size:
            shards = " (M = W x the rows of each rank's a)" if kind.gathers else ""
            raise ValueError(f"{self.op} needs M divisible by the world size{shards}: "
                             f"M={self.m}, W={self.world_size}")
        if self.send_splits is not None:
            if not kind.splits:
                raise ValueError(f"send_splits only applies to all_to_all, not {self.op!r}")
            check_splits("send_splits", self.send_splits, self.world_size, self.m)
        elif kind.splits and self.world_size > 1:
            raise ValueError("an all_to_all plan needs send_splits (rows sent to each rank)")
        self._check_groups()

    def _check_groups(self):
        sizes = self.group_sizes
        if not isinstance(sizes, tuple) or not sizes:
            raise TypeError(f"group_sizes must be a non-empty sequence of ints, got {sizes!r}")
        for i, s in enumerate(sizes):
            _check_int(f"group_sizes[{i}]", s, 0 if self.grouping == "destinations" else 1)
        if self.grouping == "destinations":
            if self.layout == "rows" and self.schedule.raster != "n":
                raise ValueError("a 'rows' plan of grouping 'destinations' needs a raster 'n' "
                                 "schedule (its strips of bands are whole rows only in that "
                                 f"order), got raster {self.schedule.raster!r}; give layout "
                                 "'tiles'")
            want = destination_group_sizes(self.grid, len(sizes), self.layout)
            if sizes != want:
                raise ValueError(f"a 'destinations' plan of {len(sizes)} groups over "
                                 f"{self.describe_grid()} has group_sizes {list(want)}, "
                                 f"got {list(sizes)}")
            return
        total = self.grid.num_tiles
        if sum(sizes) != total:
            raise ValueError(
                f"group_sizes must sum to the tile count {total} "
                f"({self.describe_grid()}), got sum {sum(sizes)}")
        if self.op == "reduce_scatter":
            for region in self.regions:
                if len(set(region.dest_numels)) != 1:
                    raise ValueError(
                        f"reduce_scatter group {region.index} is unbalanced across ranks "
                        f"(elements per rank {list(region.dest_numels)}): with this tile order "
                        f"group sizes must be multiples of the world size {self.world_size}")
        if self.layout == "rows" and self.op != GATHER_OP and self.row_parts is None:
            unit = group_unit(self.op, self.world_size, self.n, self.tile, "rows", self.schedule)
            raise ValueError(
                f"a 'rows' plan's groups are whole row bands of every destination block, but "
                f"group_sizes {list(sizes)} cut bands ({self.describe_grid()}, schedule "
                f"raster={self.schedule.raster} swizzle={self.schedule.swizzle}: group "
                f"boundaries on multiples of {unit} tiles are whole strips of bands); give "
                f"such group sizes, or layout 'tiles'")
        unit = group_unit(self.op, self.world_size, self.n, self.tile)
        if self.op == GATHER_OP and any(s % unit for s in sizes):
            raise ValueError(
                f"allgather groups are chunks of whole row bands of every shard: group sizes "
                f"must be multiples of {unit} tiles (W={self.world_size} x "
                f"{unit // self.world_size} column tiles), got {list(sizes)}")

    # ---- derived layout -------------------------------------------------------------------
    @property
    def kind(self) -> OpKind:
        """What the plan's op means (:mod:`flashoverlap_core.ops`)."""
        return of(self.op)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype of a and b."""
        return DTYPES[self.dtype]

    @property
    def result_dtype(self) -> torch.dtype:
        """The dtype of c = a @ b and of the packed output (an fp8 plan's out_dtype)."""
        return DTYPES[self.out_dtype or self.dtype]

    @property
    def moved_dtype(self) -> torch.dtype:
        """What the collective moves (a's rows for allgather, else the result)."""
        return moved_dtype(self.op, self.dtype, self.out_dtype)

    def dequantized(self) -> "Plan":
        """This fp8 plan for the float32 call it runs as where no fp8 kernel runs it (the same
        tiles, order and groups)."""
        return _dequantized_plan(self)

    @property
    def block_rows(self) -> tuple[int, ...]:
        """Rows of c sent to each destination (one block for allreduce / custom ops)."""
        return self.kind.block_rows(self.m, self.world_size, self.send_splits)

    @cached_property
    def grid(self) -> TileGrid:
        return TileGrid(self.block_rows, self.n, self.tile[0], self.tile[1], self.schedule)

    @property
    def num_tiles(self) -> int:
        return self.grid.num_tiles

    @property
    def num_groups(self) -> int:
        return len(self.group_sizes)

    @property
    def num_waves(self) -> int:
        return -(-self.num_tiles // self.wave_size)

    @cached_property
    def groups(self) -> tuple[tuple[TileRect, ...], ...]:
        """Tiles of each group, in execution order (allgather: the tiles of the chunk's bands
        in every shard, in the grid's execution order)."""
        order, out, start = self.grid.execution_order, [], 0
        if self.grouping == "destinations":  # chunk g of every block, round-robin over blocks
            per_block = [self.grid.block_tiles(d) for d in range(len(self.block_rows))]
            unit = layout_unit(self.layout, self.n, self.tile, self.schedule)
            chunks = [destination_chunks(len(t), self.num_groups, unit) for t in per_block]
            for g in range(self.num_groups):
                parts = [t[lo:hi] for t, c in zip(per_block, chunks) for lo, hi in [c[g]]]
                longest = max((len(p) for p in parts), default=0)
                out.append(tuple(p[i] for i in range(longest) for p in parts if i < len(p)))
            return tuple(out)
        if self.op == GATHER_OP:  # a tile belongs to the chunk that brings its band
            out = [[] for _ in self.group_sizes]
            for t in order:
                out[self.group_of_band[self._band(t)]].append(t)
            return tuple(map(tuple, out))
        for size in self.group_sizes:
            out.append(order[start:start + size])
            start += size
        return tuple(out)

    # ---- allgather: groups are chunks of the gather ---------------------------------------
    @property
    def shard_rows(self) -> int:
        """allgather: rows of a on each rank (m = M / W)."""
        return self.m // self.world_size

    def _band(self, t: TileRect) -> int:
        return (t.row0 - self.grid.block_starts[t.block]) // self.tile[0]

    @cached_property
    def chunk_bands(self) -> tuple[tuple[int, int], ...]:
        """allgather: row bands [first, last) of every shard that group g gathers."""
        per_band = group_unit(self.op, self.world_size, self.n, self.tile)
        out, band = [], 0
        for size in self.group_sizes:
            out.append((band, band + size // per_band))
            band += size // per_band
        return tuple(out)

    @cached_property
    def group_of_band(self) -> tuple[int, ...]:
        """allgather: the group whose chunk brings each band of a shard."""
        return tuple(g for g, (first, last) in enumerate(self.chunk_bands) for _ in range(first, last))

    def chunk_rows(self, g: int) -> tuple[int, int]:
        """allgather: rows [start, end) of every shard that group g gathers."""
        first, last = self.chunk_bands[g]
        return first * self.tile[0], min(last * self.tile[0], self.shard_rows)

    def local_tiles(self, rank: int) -> tuple[TileRect, ...]:
        """allgather: this rank's own shard's tiles, computed first (they need no transfer),
        group by group."""
        return tuple(t for tiles in self.groups for t in tiles if t.block == rank)

    def arriving_tiles(self, rank: int, g: int) -> tuple[TileRect, ...]:
        """allgather: the tiles computed once group g's chunk has arrived (the other shards')."""
        return tuple(t for t in self.groups[g] if t.block != rank)

    @cached_property
    def packed_tiles(self) -> tuple[tuple[TileRect, int, int], ...]:
        """(tile, group, packed offset) for every tile, in packed-buffer order."""
        if self.op == GATHER_OP:
            raise ValueError("an allgather plan packs the gathered rows of a, not output tiles "
                             "(see regions and chunk_rows); its output is written in place")
        out, offset = [], 0
        starts = self.grid.block_starts
        for g, tiles in enumerate(self.groups):
            if self.layout == "rows":  # each part: the group's rows of its block, row-major
                part, parts = offset, {}
                for d, (r0, r1) in enumerate(self.row_parts[g]):
                    parts[d] = part - (starts[d] + r0) * self.n
                    part += (r1 - r0) * self.n
            for t in sorted(tiles, key=lambda t: (t.block, t.local)):
                if self.layout == "rows":
                    out.append((t, g, parts[t.block] + t.row0 * self.n + t.col0))
                else:
                    out.append((t, g, offset))
                offset += t.numel
        return tuple(out)

    @cached_property
    def row_parts(self) -> tuple[tuple[tuple[int, int], ...], ...] | None:
        """Per group, per destination block: the rows [r0, r1) of the block (counted from its
        first row) that the group's tiles cover, when they are whole row bands in one run
        ((0, 0) when it has none there); None when some group cuts a band or skips one (then
        only the "tiles" layout fits)."""
        if self.op == GATHER_OP:
            return None
        bm, cols = self.tile[0], -(-self.n // self.tile[1])
        starts, out = self.grid.block_starts, []
        for tiles in self.groups:
            count: dict[tuple[int, int], int] = {}
            for t in tiles:
                key = (t.block, (t.row0 - starts[t.block]) // bm)
                count[key] = count.get(key, 0) + 1
            parts = []
            for d, rows in enumerate(self.block_rows):
                bands = sorted(b for (blk, b) in count if blk == d)
                if not bands:
                    parts.append((0, 0))
                    continue
                if bands[-1] - bands[0] + 1 != len(bands) or any(count[(d, b)] != cols for b in bands):
                    return None
                parts.append((bands[0] * bm, min((bands[-1] + 1) * bm, rows)))
            out.append(tuple(parts))
        return tuple(out)

    @cached_property
    def slabs(self) -> tuple[tuple[tuple[int, int, int], ...], ...]:
        """A "rows" plan: per group, its non-empty parts as (first row of c, end row, packed
        offset), destination by destination: each part is those rows of c, row-major."""
        starts, out = self.grid.block_starts, []
        for region, parts in zip(self.regions, self.row_parts):
            at, mine = region.offset, []
            for d, (r0, r1) in enumerate(parts):
                if r1 > r0:
                    mine.append((starts[d] + r0, starts[d] + r1, at))
                at += (r1 - r0) * self.n
            out.append(tuple(mine))
        return tuple(out)

    def tile_stride(self, t: TileRect) -> int:
        """The row stride of tile ``t`` in the packed buffer: N for "rows", its width for
        "tiles"."""
        return self.n if self.layout == "rows" else t.cols

    def packed_view(self, packed: torch.Tensor, t: TileRect, offset: int) -> torch.Tensor:
        """Tile ``t``'s [rows, cols] view of the flat packed buffer at ``offset``."""
        return packed.as_strided((t.rows, t.cols), (self.tile_stride(t), 1),
                                 packed.storage_offset() + offset)

    @cached_property
    def regions(self) -> tuple[Region, ...]:
        if self.op == GATHER_OP:  # the gathered rows of a, chunk by chunk, source by source
            out = []
            for g in range(self.num_groups):
                start, end = self.chunk_rows(g)
                part = (end - start) * self.k
                out.append(Region(g, self.world_size * start * self.k, self.world_size * part,
                                  (part,) * self.world_size))
            return tuple(out)
        out, offset = [], 0
        blocks = len(self.block_rows)
        for g, tiles in enumerate(self.groups):
            per_dest = [0] * blocks
            for t in tiles:
                per_dest[t.block] += t.numel
            numel = sum(per_dest)
            out.append(Region(g, offset, numel, tuple(per_dest)))
            offset += numel
        return tuple(out)

    @property
    def packed_shape(self) -> tuple[int, int]:
        """The row-major array whose elements the packed buffer permutes: the output [M, N],
        or for allgather the gathered a [M, K]."""
        return (self.m, self.k) if self.op == GATHER_OP else (self.m, self.n)

    @property
    def packed_numel(self) -> int:
        return self.packed_shape[0] * self.packed_shape[1]

    @property
    def execution_order(self) -> tuple[TileRect, ...]:
        """Every tile in the order the kernel takes them: the grid's, or for a "destinations"
        plan group by group."""
        if self.grouping == "destinations":
            return tuple(t for tiles in self.groups for t in tiles)
        return self.grid.execution_order

    def for_rows(self, m: int, send_splits) -> "Plan":
        """This plan's tile, order and groups for a call of ``m`` rows split ``send_splits``
        (all_to_all: rows and splits are each call's own); a "waves" plan must fit as it is."""
        one = self.world_size == 1  # at world size 1, splits [M] and none are the same call
        send = tuple(send_splits) if send_splits is not None and not one else None
        if not self.kind.splits or (m == self.m and send == (None if one else self.send_splits)):
            return self
        if self.grouping != "destinations":
            raise ValueError(f"the plan does not fit this call: it is for M={self.m}, "
                             f"send_splits {self.send_splits}, the call has M={m}, {send}; "
                             "an all_to_all plan for calls of any rows has grouping "
                             "'destinations' (fo.plan's default for all_to_all)")
        grid = TileGrid(self.kind.block_rows(m, self.world_size, send), self.n, self.tile[0],
                        self.tile[1], self.schedule)
        groups = self.num_groups if not one else all_to_all_groups(1, grid.num_tiles)
        return replace(self, m=m, send_splits=send,
                       group_sizes=destination_group_sizes(grid, groups, self.layout))

    def wave_of_group(self, g: int) -> tuple[int, int]:
        """First and last wave (inclusive) that group g's tiles come from."""
        start = sum(self.group_sizes[:g])
        end = start + self.group_sizes[g] - 1
        return start // self.wave_size, end // self.wave_size

    def item_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Execution-order work items for a kernel: int64 [T, 4] rows of
        (block, band within block, column tile, packed offset) and int32 [T] group ids."""
        offsets = {tile: (g, off) for tile, g, off in self.packed_tiles}
        starts, (bm, bn) = self.grid.block_starts, self.tile
        rows, groups = [], []
        for t in self.execution_order:
            g, off = offsets[t]
            rows.append((t.block, (t.row0 - starts[t.block]) // bm, t.col0 // bn, off))
            groups.append(g)
        return (torch.tensor(rows, dtype=torch.int64).view(-1, 4),
                torch.tensor(groups, dtype=torch.int32))

    def packed_index(self) -> torch.Tensor:
        """Flat index into the row-major ``packed_shape`` array (c, or for allgather the
        gathered a) of every packed element (packed = c.flatten()[index])."""
        if self.op == GATHER_OP:
            rows = torch.cat([torch.arange(s * self.shard_rows + start, s * self.shard_rows + end)
                              for g in range(self.num_groups) for start, end in [self.chunk_rows(g)]
                              for s in range(self.world_size)])
            return (rows.unsqueeze(1) * self.k + torch.arange(self.k)).flatten()
        index = torch.full((self.packed_numel,), -1, dtype=torch.long)
        for t, _, offset in self.packed_tiles:
            rows = torch.arange(t.row0, t.row0 + t.rows).unsqueeze(1) * self.n
            at = torch.arange(t.rows).unsqueeze(1) * self.tile_stride(t) + offset
            index[(at + torch.arange(t.cols)).flatten()] = (rows + torch.arange(t.col0, t.col0 + t.cols)).flatten()
        return index

    # ---- checking against a call ----------------------------------------------------------
    def mismatches(self, *, m, n, k, op, world_size, dtype, send_splits=None,
                   out_dtype=None, scaling=None) -> list[str]:
        """What about a call this plan does not fit (empty when it fits). ``scaling``: an fp8
        call's kind (tensor-wise and row-wise calls fit the same plans)."""
        want = {"M": m, "N": n, "K": k, "op": op, "world_size": world_size,
                "dtype": dtype_name(dtype),
                "out_dtype": dtype_name(out_dtype) if out_dtype is not None else None,
                "scaling": "blockwise" if scaling == "blockwise" else None}
        have = {"M": self.m, "N": self.n, "K": self.k, "op": self.op,
                "world_size": self.world_size, "dtype": self.dtype, "out_dtype": self.out_dtype,
                "scaling": self.scaling}
        if of(op).splits:
            want["send_splits"] = tuple(send_splits) if send_splits is not None else None
            have["send_splits"] = self.send_splits
            if world_size == 1 and want["send_splits"] in (None, (m,)):
                want["send_splits"] = have["send_splits"]
        return [f"{key}: plan has {have[key]!r}, call has {want[key]!r}"
                for key in want if want[key] != have[key]]

    # ---- serialisation ---------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "format": FORMAT, "M": self.m, "N": self.n, "K": self.k, "op": self.op,
            "world_size": self.world_size, "dtype": self.dtype, "tile": list(self.tile),
            "wave_size": self.wave_size, "schedule": self.schedule.to_dict(),
            "group_sizes": list(self.group_sizes),
            "send_splits": list(self.send_splits) if self.send_splits is not None else None,
            "backend": self.backend, "strategy": self.strategy, "grouping": self.grouping,
            "layout": self.layout,
        } | ({"out_dtype": self.out_dtype} if self.out_dtype is not None else {}) \
          | ({"scaling": self.scaling} if self.scaling is not None else {})

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"not a plan in format {FORMAT!r}: {str(d)[:200]}")
        try:
            return cls(
                m=d["M"], n=d["N"], k=d["K"], op=d["op"], world_size=d["world_size"],
                dtype=d["dtype"], tile=tuple(d["tile"]), wave_size=d["wave_size"],
                schedule=Schedule(**d["schedule"]), group_sizes=tuple(d["group_sizes"]),
                send_splits=tuple(d["send_splits"]) if d.get("send_splits") is not None else None,
                backend=d.get("backend"), strategy=d.get("strategy", "overlap"),
                grouping=d.get("grouping", "waves"), out_dtype=d.get("out_dtype"),
                layout=d.get("layout"), scaling=d.get("scaling"))
        except KeyError as e:
            raise ValueError(f"plan JSON lacks field {e}") from None

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.from_dict(json.loads(text))

    # ---- for humans ------------------------------------------------------------------------
    def describe_grid(self) -> str:
        bm, bn = self.tile
        return (f"{len(self.block_rows)} block(s) of rows {list(self.block_rows)}, "
                f"tile {bm}x{bn}, {self.num_tiles} tiles")

    def describe(self) -> str:
        itemsize = torch.tensor([], dtype=self.moved_dtype).element_size()
        dtypes = (self.dtype + (f" -> {self.out_dtype}" if self.out_dtype else "")
                  + (f", {self.scaling} scales" if self.scaling else ""))
        lines = [
            f"Plan {self.op} of [{self.m}x{self.k}] @ [{self.k}x{self.n}] {dtypes}, "
            f"world size {self.world_size}, backend {self.backend or 'any'}",
            f"  grid: {self.describe_grid()}; schedule raster={self.schedule.raster} "
            f"swizzle={self.schedule.swizzle}",
            f"  waves: {self.num_waves} of {self.wave_size} tiles; {self.num_groups} group(s); "
            + ("output written in place" if self.op == GATHER_OP else
               "layout rows: groups of whole row bands, no post-reorder" if self.layout == "rows"
               else "layout tiles: a post-reorder restores the rows"),
        ]
        if self.strategy != "overlap":
            order = "one all-gather, then the plain GEMM" if self.op == GATHER_OP else \
                "the plain GEMM, then one collective"
            lines.append(f"  strategy {self.strategy}: {order} (the groups are not used)")
        if self.op == GATHER_OP:
            return "\n".join(lines + self._describe_chunks(itemsize))
        for r in self.regions:
            w0, w1 = self.wave_of_group(r.index)
            per_dest = f", per rank {list(r.dest_numels)}" if len(r.dest_numels) > 1 else ""
            lines.append(
                f"  group {r.index}: {self.group_sizes[r.index]} tiles (waves {w0}-{w1}), "
                f"elements [{r.offset}, {r.offset + r.numel}) = {r.numel * itemsize / 2**20:.3f} MiB"
                f"{per_dest}")
        return "\n".join(lines)

    def _describe_chunks(self, itemsize: int) -> list[str]:
        lines = [f"  each rank computes its own shard's {self.num_tiles // self.world_size} tiles "
                 "first, then each chunk's other tiles as it arrives"]
        for r in self.regions:
            start, end = self.chunk_rows(r.index)
            lines.append(
                f"  group {r.index}: gathers rows [{start}, {end}) of every shard, elements "
                f"[{r.offset}, {r.offset + r.numel}) of a = {r.numel * itemsize / 2**20:.3f} MiB; "
                f"{self.group_sizes[r.index]} tiles depend on it")
        return lines

    def __repr__(self) -> str:
        return (f"Plan(op={self.op!r}, M={self.m}, N={self.n}, K={self.k}, W={self.world_size}, "
                f"dtype={self.dtype}, tile={self.tile}, groups={list(self.group_sizes)}, "
                f"layout={self.layout!r}{'' if self.strategy == 'overlap' else f', strategy={self.strategy!r}'})")


@lru_cache(maxsize=64)
def _dequantized_plan(plan: Plan) -> Plan:
    if plan.out_dtype is None:
        return plan
    return replace(plan, dtype="float32", out_dtype=None, scaling=None)
