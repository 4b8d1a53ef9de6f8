// Decodes work items on the host with the kernels' own decode_item (csrc/cuda/common.cuh), for
// tests/test_a2a_layout_cpu.py. Input lines:
//   blocks BM BN N raster_m swizzle groups layout world rows[world]
//       the items of all_to_all's per-call layout (a2a_layout.cuh) over unequal blocks, in the
//       "tiles" (layout 0) or "rows" layout (1: offsets in the row-major [M, N], ldo = N)
//   uniform BM BN L block_rows N T  then T lines "block band col offset group"
//       a plan's item table over L equal blocks
// Output per line: T lines "row0 rows col0 cols offset group" in item order, then "end".
// A malformed item aborts (the kernel traps). Equal blocks are decoded as both builds do
// (FO_BLOCKS 0 and 1), which must agree.
#include <cstdio>
#include <vector>

#include "a2a_layout.cuh"
#include "common.cuh"

// Blocks: the decoding of the FO_BLOCKS=1 builds; both builds must agree on equal blocks.
template <int BM, int BN, bool Blocks>
std::vector<fo::WorkTile> decode_all(const fo::ItemTable& t) {
  std::vector<fo::WorkTile> out;
  for (int i = 0; i < t.num_items; ++i) out.push_back(fo::decode_item<BM, BN, true, Blocks>(t, i));
  return out;
}

template <int BM, int BN>
void print_decoded(const fo::ItemTable& t) {
  // equal blocks: the plain build's checks first (the malformed-item tests), then the other's
  const std::vector<fo::WorkTile> plain =
      t.block_starts == nullptr ? decode_all<BM, BN, false>(t) : std::vector<fo::WorkTile>();
  const std::vector<fo::WorkTile> tiles = decode_all<BM, BN, true>(t);
  if (t.block_starts == nullptr) {
    for (size_t i = 0; i < tiles.size(); ++i)
      if (plain[i].row0 != tiles[i].row0 || plain[i].rows != tiles[i].rows ||
          plain[i].col0 != tiles[i].col0 || plain[i].cols != tiles[i].cols) {
        std::printf("the two builds decode item %zu differently\n", i);
        std::exit(3);
      }
  }
  for (const fo::WorkTile& w : tiles)
    std::printf("%d %d %d %d %lld %d\n", w.row0, w.rows, w.col0, w.cols, (long long)w.offset, w.group);
}

void decode(int bm, int bn, const fo::ItemTable& t) {
  if (bm == 128 && bn == 256) return print_decoded<128, 256>(t);
  if (bm == 128 && bn == 128) return print_decoded<128, 128>(t);
  if (bm == 64 && bn == 64) return print_decoded<64, 64>(t);
  std::fprintf(stderr, "tile %dx%d is not instantiated here\n", bm, bn);
  std::exit(2);
}

int main() {
  char mode[16];
  while (std::scanf("%15s", mode) == 1) {
    fo::a2a::Geometry g;
    std::vector<int64_t> items;
    std::vector<int32_t> groups, starts;
    fo::ItemTable t = {};
    if (std::string(mode) == "blocks") {
      int world;
      std::scanf("%d %d %d %d %d %d %d %d", &g.bm, &g.bn, &g.n, &g.raster_m, &g.swizzle, &g.groups,
                 &g.rows, &world);
      std::vector<int> rows(world);
      for (int& r : rows) std::scanf("%d", &r);
      static fo::a2a::Side s;
      fo::a2a::make_side(g, rows.data(), world, s);
      const int tiles = s.tile_start[world];
      items.assign(4 * size_t(tiles), 0);
      groups.assign(tiles, 0);
      for (int i = 0; i < tiles; ++i) fo::a2a::write_item(g, s, i, items.data(), groups.data());
      starts.assign(s.row_start, s.row_start + world + 1);
      t = fo::ItemTable{items.data(), groups.data(), tiles, 0, world, s.row_start[world], g.n,
                        int64_t(s.row_start[world]) * g.n, g.rows ? g.n : 0, starts.data()};
    } else {
      int L, block_rows, n, count;
      std::scanf("%d %d %d %d %d %d", &g.bm, &g.bn, &L, &block_rows, &n, &count);
      items.assign(4 * size_t(count), 0);
      groups.assign(count, 0);
      for (int i = 0; i < count; ++i) {
        long long f[5];
        std::scanf("%lld %lld %lld %lld %lld", &f[0], &f[1], &f[2], &f[3], &f[4]);
        for (int k = 0; k < 4; ++k) items[4 * size_t(i) + k] = f[k];
        groups[i] = int32_t(f[4]);
      }
      t = fo::ItemTable{items.data(), groups.data(), count, block_rows, L, L * block_rows, n,
                        int64_t(L) * block_rows * n, 0, nullptr};
    }
    decode(g.bm, g.bn, t);
    std::printf("end\n");
    std::fflush(stdout);
  }
  return 0;
}
