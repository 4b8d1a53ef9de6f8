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
    std::vector<long long> rows(5 * size_t(tiles), -1);
    for (int i = 0; i < tiles; ++i) {
      const Placed p = place(g, s, i);
      const int item = item_index(g, s, p);
      long long* row = &rows[5 * size_t(item)];
      row[0] = p.block, row[1] = p.at.band, row[2] = p.at.col, row[3] = p.offset, row[4] = p.group;
    }
    std::printf("items %d\n", tiles);
    for (int i = 0; i < tiles; ++i)
      std::printf("%lld %lld %lld %lld %lld\n", rows[5 * i], rows[5 * i + 1], rows[5 * i + 2],
                  rows[5 * i + 3], rows[5 * i + 4]);
    std::printf("parts\n");
    for (int gr = 0; gr < g.groups; ++gr) {
      for (int d = 0; d < world; ++d) std::printf("%lld ", (long long)s.part[gr][d]);
      std::printf("\n");
    }
    const int received = r.tile_start[world];
    std::printf("unpack %d\n", received);
    for (int i = 0; i < received; ++i) {
      const Placed p = place(g, r, i);
      const int row0 = r.row_start[p.block] + p.at.band * g.bm;
      const int nrows = min_int(g.bm, r.rows[p.block] - p.at.band * g.bm);
      const int col0 = p.at.col * g.bn;
      std::printf("%d %d %d %d %lld\n", row0, nrows, col0, min_int(g.bn, g.n - col0), (long long)p.offset);
    }
    std::printf("end\n");
  }
  return 0;
}
