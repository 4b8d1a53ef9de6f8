// all_to_all with each call's own rows and splits (expert parallelism): the plan's layout
// ("destinations" grouping, flashoverlap_core/plan.py) computed in closed form from the rows of
// each destination block, on the host (the collectives' counts) and on the device (the GEMM's
// work items and the post-reorder's tiles), by the same functions. Host-only programs include
// it too (tests/test_a2a_layout_cpu.py checks it against the Python plan).
//
// A block of `rows` rows is cut into bands of bm rows and column tiles of bn columns, visited in
// the schedule's order (raster "n": `swizzle` bands at a time, column by column, band by band;
// raster "m": the transpose). Two layouts (plan.py's LAYOUTS):
//   "tiles": group g takes the block's tiles [g T / G, (g + 1) T / G) of its T tiles. The
//     packed buffer holds group by group, destination by destination, each tile
//     row-major at its real size; so the part (g, d) starts at the sum of the chunk sizes of
//     every (g', d') before it in that order, and a tile's offset in it is the elements of the
//     tiles before it in its block's order, minus those before its chunk: `prefix_numel`, a
//     closed form. The receiver's post-reorder puts the rows back.
//   "rows" (raster "n" only): a group takes whole strips of `swizzle` bands of each block
//     (chunk g = strips [g U / G, (g + 1) U / G) of the block's U strips, the last strip maybe
//     short), so what group g sends destination d is whole rows of d's block: contiguous rows
//     of the row-major product [M, N], written there by the GEMM at each tile's final place
//     (row stride N). The receiver gets from source s, in group g, the same chunk of s's
//     block: its next whole rows, which land at their final rows of the output (source's first
//     row + chunk's first row). No packed buffer, no staging buffer, no post-reorder.
#pragma once
#include <stdint.h>

#ifdef __CUDACC__
#define FO_HD __host__ __device__ inline
#else
#define FO_HD inline
#endif

namespace fo::a2a {

constexpr int kMaxRanks = 64;   // world sizes the native all_to_all takes
constexpr int kMaxGroups = 16;  // groups of its plan

// What every rank shares: the plan's tile, tile order, N, number of groups and layout.
struct Geometry {
  int bm, bn, n;
  int raster_m;  // 0: raster "n", 1: raster "m"
  int swizzle;
  int groups;
  int rows;      // 0: layout "tiles", 1: layout "rows" (with raster "n")
};

// One destination (send side) or source (receive side) block.
struct Block {
  int rows, bands, cols, tiles;
};

FO_HD int ceil_div(int a, int b) { return (a + b - 1) / b; }
FO_HD int min_int(int a, int b) { return a < b ? a : b; }

FO_HD Block block_of(const Geometry& g, int rows) {
  Block b;
  b.rows = rows;
  b.bands = ceil_div(rows, g.bm);
  b.cols = ceil_div(g.n, g.bn);
  b.tiles = b.bands * b.cols;
  return b;
}

// Tiles of a block that a group takes at a time: whole strips of `swizzle` bands in the "rows"
// layout, any run in "tiles" (plan.layout_unit).
FO_HD int unit_tiles(const Geometry& g, const Block& b) { return g.rows ? g.swizzle * b.cols : 1; }

// First tile of group `group`'s chunk of block b (group == groups: the end): the block's runs of
// unit_tiles shared out as evenly as they go (plan.destination_chunks).
FO_HD int chunk_start(const Geometry& g, const Block& b, int group) {
  const int unit = unit_tiles(g, b);
  const int64_t first = int64_t(group) * ceil_div(b.tiles, unit) / g.groups * unit;
  return first < b.tiles ? int(first) : b.tiles;
}

// "rows" layout: the first row (counted from the block's first) of the band where the block's
// scheduled tile t starts a strip, or the block's rows for t = its tile count.
FO_HD int band_row(const Geometry& g, const Block& b, int t) {
  return min_int(b.rows, t / b.cols * g.bm);
}

struct Position {
  int band, col;
};

// Where the block's scheduled tile t sits, and how the schedule reaches it: sb-th run of
// `swizzle` outer lines, starting at line `start`, `width` lines wide; inner index j, outer
// index start + k.
struct Visit {
  int start, width, j, k;
};

FO_HD Visit visit(const Geometry& g, const Block& b, int t) {
  const int outer = g.raster_m ? b.cols : b.bands, inner = g.raster_m ? b.bands : b.cols;
  Visit v;
  v.start = t / (g.swizzle * inner) * g.swizzle;
  v.width = min_int(g.swizzle, outer - v.start);
  const int pos = t - v.start * inner;
  v.j = pos / v.width;
  v.k = pos % v.width;
  return v;
}

FO_HD Position tile_at(const Geometry& g, const Block& b, int t) {
  const Visit v = visit(g, b, t);
  return g.raster_m ? Position{v.j, v.start + v.k} : Position{v.start + v.k, v.j};
}

// Elements of the block's tiles [0, t) in schedule order. Only the last band and the last
// column tile are partial, and both lie in the last run of outer lines, so every run before
// t's is whole lines of full tiles, every inner line before j within t's run is full in the
// inner direction, and the k tiles before t in line j are full in the outer direction.
FO_HD int64_t prefix_numel(const Geometry& g, const Block& b, int t) {
  if (t >= b.tiles) return int64_t(b.rows) * g.n;
  const Visit v = visit(g, b, t);
  if (!g.raster_m) {
    const int run_rows = min_int(b.rows, (v.start + v.width) * g.bm) - v.start * g.bm;
    const int col_width = min_int(g.bn, g.n - v.j * g.bn);
    return int64_t(v.start) * g.bm * g.n + int64_t(run_rows) * v.j * g.bn +
           int64_t(v.k) * g.bm * col_width;
  }
  const int run_cols = min_int(g.n, (v.start + v.width) * g.bn) - v.start * g.bn;
  const int band_rows = min_int(g.bm, b.rows - v.j * g.bm);
  return int64_t(v.start) * g.bn * b.rows + int64_t(run_cols) * v.j * g.bm +
         int64_t(v.k) * g.bn * band_rows;
}

// Elements of group `group`'s chunk of the block ("rows": whole rows, times N).
FO_HD int64_t chunk_numel(const Geometry& g, const Block& b, int group) {
  return prefix_numel(g, b, chunk_start(g, b, group + 1)) -
         prefix_numel(g, b, chunk_start(g, b, group));
}

// One side of a call's layout (the blocks this rank sends, or the blocks it receives), for
// world <= kMaxRanks blocks and groups <= kMaxGroups: per (group, block), the chunk's first
// tile and where its part starts, and per group its first item. A part starts in the packed
// (send) or staging (receive) buffer in the "tiles" layout; in the "rows" layout at its final
// place, the first element of its rows in the row-major product (send) or output (receive).
struct Side {
  int world;
  int rows[kMaxRanks];
  int tile_start[kMaxRanks + 1];  // first tile of each block when blocks are numbered in order
  int row_start[kMaxRanks + 1];
  int lo[kMaxGroups + 1][kMaxRanks];
  int64_t part[kMaxGroups][kMaxRanks];  // element offset of part (group, block)
  int item_start[kMaxGroups + 1];       // first work item of each group (execution order)
};

FO_HD void side_starts(const Geometry& g, Side& s) {
  s.tile_start[0] = 0, s.row_start[0] = 0;
  for (int d = 0; d < s.world; ++d) {
    const Block b = block_of(g, s.rows[d]);
    s.tile_start[d + 1] = s.tile_start[d] + b.tiles;
    s.row_start[d + 1] = s.row_start[d] + b.rows;
    for (int gr = 0; gr <= g.groups; ++gr) s.lo[gr][d] = chunk_start(g, b, gr);
  }
}

// Part (group, block)'s size, for one (group, block) pair: the device computes them in
// parallel, then one thread runs side_scan.
FO_HD void part_size(const Geometry& g, Side& s, int group, int d) {
  s.part[group][d] = chunk_numel(g, block_of(g, s.rows[d]), group);
}

// Sizes to offsets ("tiles": back to back in (group, block) order; "rows": the part's first row
// of the row-major buffer, its block's first row plus its chunk's), and the groups' first items.
FO_HD void side_scan(const Geometry& g, Side& s) {
  int64_t offset = 0;
  int items = 0;
  for (int gr = 0; gr < g.groups; ++gr) {
    s.item_start[gr] = items;
    for (int d = 0; d < s.world; ++d) {
      const int64_t size = s.part[gr][d];
      if (g.rows) {
        const Block b = block_of(g, s.rows[d]);
        s.part[gr][d] = int64_t(s.row_start[d] + band_row(g, b, s.lo[gr][d])) * g.n;
      } else {
        s.part[gr][d] = offset;
        offset += size;
      }
      items += s.lo[gr + 1][d] - s.lo[gr][d];
    }
  }
  s.item_start[g.groups] = items;
}

// The whole side, serially.
FO_HD void make_side(const Geometry& g, const int* rows, int world, Side& s) {
  s.world = world;
  for (int d = 0; d < world; ++d) s.rows[d] = rows[d];
  side_starts(g, s);
  for (int gr = 0; gr < g.groups; ++gr)
    for (int d = 0; d < world; ++d) part_size(g, s, gr, d);
  side_scan(g, s);
}

// Elements of part (group, block), once side_scan has run: its chunk's rows times N ("rows"),
// or up to the next part's offset ("tiles").
FO_HD int64_t part_numel(const Geometry& g, const Side& s, int group, int d) {
  if (g.rows) {
    const Block b = block_of(g, s.rows[d]);
    return int64_t(band_row(g, b, s.lo[group + 1][d]) - band_row(g, b, s.lo[group][d])) * g.n;
  }
  const int64_t end = d + 1 < s.world      ? s.part[group][d + 1]
                      : group + 1 < g.groups ? s.part[group + 1][0]
                                             : int64_t(s.row_start[s.world]) * g.n;
  return end - s.part[group][d];
}

// Tiles of group `group` (over every block).
FO_HD int group_tiles(const Side& s, int group) {
  return s.item_start[group + 1] - s.item_start[group];
}

// Block of the side's tile number i (blocks' tiles numbered in block order): the block d with
// tile_start[d] <= i < tile_start[d + 1] (empty blocks are skipped).
FO_HD int block_of_tile(const Side& s, int i) {
  int d = 0;
  while (s.tile_start[d + 1] <= i) ++d;
  return d;
}

// The group whose chunk of block d holds the block's tile t.
FO_HD int group_of_tile(const Geometry& g, const Side& s, int d, int t) {
  int gr = 0;
  while (s.lo[gr + 1][d] <= t) ++gr;
  return gr;
}

// A tile of one side: its block, place in the block's schedule, group, and element offset in
// the packed (send) or staging (receive) buffer; "rows": in the row-major product [M, N].
struct Placed {
  int block, t, group;
  Position at;
  int64_t offset;
};

FO_HD Placed place(const Geometry& g, const Side& s, int i) {
  Placed p;
  p.block = block_of_tile(s, i);
  p.t = i - s.tile_start[p.block];
  p.group = group_of_tile(g, s, p.block, p.t);
  const Block b = block_of(g, s.rows[p.block]);
  p.at = tile_at(g, b, p.t);
  if (g.rows)
    p.offset = (int64_t(s.row_start[p.block]) + int64_t(p.at.band) * g.bm) * g.n +
               int64_t(p.at.col) * g.bn;
  else
    p.offset = s.part[p.group][p.block] + prefix_numel(g, b, p.t) -
               prefix_numel(g, b, s.lo[p.group][p.block]);
  return p;
}

// Execution-order index of a placed send tile: the groups one after the other; inside group
// g, the i-th tile of every block's chunk before the (i+1)-th of any (plan.py's round robin).
FO_HD int item_index(const Geometry& g, const Side& s, const Placed& p) {
  const int i = p.t - s.lo[p.group][p.block];
  int index = s.item_start[p.group];
  for (int d = 0; d < s.world; ++d) {
    const int len = s.lo[p.group + 1][d] - s.lo[p.group][d];
    index += len < i ? len : i;
    if (d < p.block && len > i) ++index;
  }
  return index;
}

// Send tile i's work item, written where the kernel finds it: items[4 * index] = {block, band,
// column tile, packed offset ("rows": offset in the row-major product, row stride N)} and
// item_group[index] (the GEMM's table, fo_gemm_run_blocks).
FO_HD void write_item(const Geometry& g, const Side& s, int i, int64_t* items, int32_t* item_group) {
  const Placed p = place(g, s, i);
  const int index = item_index(g, s, p);
  int64_t* it = items + 4 * int64_t(index);
  it[0] = p.block, it[1] = p.at.band, it[2] = p.at.col, it[3] = p.offset;
  item_group[index] = p.group;
}

// Receive tile j's post-reorder entry ("tiles" layout only): tiles[4 j] = {first row in out, rows, first column,
// columns} and its staging offset (the unpack kernel's tables).
FO_HD void write_unpack(const Geometry& g, const Side& r, int j, int32_t* tiles, int64_t* offsets) {
  const Placed p = place(g, r, j);
  const int row0 = p.at.band * g.bm, col0 = p.at.col * g.bn;
  int32_t* u = tiles + 4 * int64_t(j);
  u[0] = r.row_start[p.block] + row0;
  u[1] = min_int(g.bm, r.rows[p.block] - row0);
  u[2] = col0;
  u[3] = min_int(g.bn, g.n - col0);
  offsets[j] = p.offset;
}

}  // namespace fo::a2a
