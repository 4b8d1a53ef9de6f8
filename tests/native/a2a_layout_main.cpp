// Prints the native all_to_all layout (csrc/cuda/a2a_layout.cuh) of the calls read from stdin,
// for tests/test_a2a_layout_cpu.py to compare with the Python plan. Input, per case:
//   bm bn n raster_m swizzle groups rows world  send_rows[world]  recv_rows[world]
// (rows: 0 layout "tiles", 1 layout "rows"). Output, per case: "items T" then T lines
// "block band col offset group" in execution order; "send" then `groups` lines of `world`
// pairs "offset count" (each part's start and elements on the send side), "recv" the same for
// the receive side; "unpack R" then R lines "row0 rows col0 cols offset" in the receive side's
// tile order ("tiles" layout only: a "rows" call has no post-reorder); "end".
#include <cstdio>
#include <vector>

#include "a2a_layout.cuh"

using namespace fo::a2a;

static void print_parts(const char* name, const Geometry& g, const Side& s) {
  std::printf("%s\n", name);
  for (int gr = 0; gr < g.groups; ++gr) {
    for (int d = 0; d < s.world; ++d)
      std::printf("%lld %lld ", (long long)s.part[gr][d], (long long)part_numel(g, s, gr, d));
    std::printf("\n");
  }
}

int main() {
  Geometry g;
  int world;
  while (std::scanf("%d %d %d %d %d %d %d %d", &g.bm, &g.bn, &g.n, &g.raster_m, &g.swizzle,
                    &g.groups, &g.rows, &world) == 8) {
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
    print_parts("send", g, s);
    print_parts("recv", g, r);
    const int received = g.rows ? 0 : r.tile_start[world];
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
