// Prints the native all_to_all layout (csrc/cuda/a2a_layout.cuh) of the calls read from stdin,
// for tests/test_a2a_layout_cpu.py to compare with the Python plan. Input, per case:
//   bm bn n raster_m swizzle groups world  send_rows[world]  recv_rows[world]
// Output, per case: "items T" then T lines "block band col offset group" in execution order;
// "parts" then groups lines of world send element offsets; "unpack R" then R lines
// "row0 rows col0 cols offset" in the receive side's tile order; "end".
#include <cstdio>
#include <vector>

#include "a2a_layout.cuh"

using namespace fo::a2a;

int main() {
  Geometry g;
  int world;
  while (std::scanf("%d %d %d %d %d %d %d", &g.bm, &g.bn, &g.n, &g.raster_m, &g.swizzle,
                    &g.groups, &world) == 7) {
    std::vector<int> send(world), recv(world);
    for (int& r : send) std::scanf("%d", &r);
    for (int& r : recv) std::scanf("%d", &r);
    static Side s, r;
    make_side(g, send.data(), world, s);
    make_side(g, recv.data(), world, r);
    const int tiles = s.tile_start[world];
    std::vector<int64_t> items(4 * size_t(tiles), -1);
    std::vector<int32_t> groups(tiles, -1);
    for (int i = 0; i < tiles; ++i) write_item(g, s, i, items.data(), groups.data());
    std::printf("items %d\n", tiles);
    for (int i = 0; i < tiles; ++i)
      std::printf("%lld %lld %lld %lld %d\n", (long long)items[4 * i], (long long)items[4 * i + 1],
                  (long long)items[4 * i + 2], (long long)items[4 * i + 3], groups[i]);
    std::printf("parts\n");
    for (int gr = 0; gr < g.groups; ++gr) {
      for (int d = 0; d < world; ++d) std::printf("%lld ", (long long)s.part[gr][d]);
      std::printf("\n");
    }
    const int received = r.tile_start[world];
    std::vector<int32_t> tiles_out(4 * size_t(received));
    std::vector<int64_t> offsets(received);
    for (int j = 0; j < received; ++j) write_unpack(g, r, j, tiles_out.data(), offsets.data());
    std::printf("unpack %d\n", received);
    for (int j = 0; j < received; ++j)
      std::printf("%d %d %d %d %lld\n", tiles_out[4 * j], tiles_out[4 * j + 1], tiles_out[4 * j + 2],
                  tiles_out[4 * j + 3], (long long)offsets[j]);
    std::printf("end\n");
  }
  return 0;
}
