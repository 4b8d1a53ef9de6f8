// Host program (no GPU needed): checks, for one sm90 configuration (same -D macros as
// gemm_sm90.cu), the assumptions the vectorised epilogues make about CUTLASS's accumulator
// layout, and simulates the tma and vec16 epilogues' data movement end to end:
//   1. FragWord: for every math thread, accumulator word(m, h, j) + c holds tile element
//      (row_base[m] + 8h + lane / 4, 8j + 2 (lane % 4) + c), row_base a warp-uniform multiple of
//      8, and the threads cover the tile exactly once;
//   2. tma: stmatrix (PTX semantics: lanes 8k..8k+7 give the row addresses of matrix k, lane
//      4r + q holds row r, columns 2q, 2q + 1 of each matrix) into a slot at slot_offset, then a
//      TMA store with the slot rows' swizzle (64-column blocks: 128 bytes, 16-byte chunk ^=
//      address bits 7..9; 32-column blocks: 64 bytes, chunk ^= bits 7..8), for a 1024-byte
//      aligned slot and a merely 128-byte aligned one: every element lands at its place in the
//      tile's packed slot;
//      (FragWord::row and ::col, which the fp8 scaling uses, say the same);
//   3. vec16: quad_transpose's butterfly (quad_send_index) gives each lane 16 contiguous bytes
//      at the column store_full_tile_vec16 writes them to;
//   4. fp8 builds: what stage_scales copies (scale_copy), read back as apply_scales reads it,
//      multiplies every accumulator of a full, partial or filler tile by scale_a of its row
//      times scale_b of its column (each per row/column or tensor-wise), and by 0 outside;
//   5. block-scaled builds: value i of ColMma's fragment of column block c (what
//      block_scaled_mainloop promotes) is the tile element of the full fragment's value
//      i + 64 c, 128 c columns to the left, and ColMma's B partition of column block c, K
//      block k, stage s starts at row 128 c, column 32 k of that stage's B tile.
// Build: nvcc <flags of build.py> -DFO_LAYOUT_SELFTEST [config -D macros] gemm_sm90_selftest.cu
// -o selftest && ./selftest  (prints "ok ..." and exits 0, or lists the first mismatches).
#define FO_LAYOUT_SELFTEST 1
#include "gemm_sm90.cu"

#include <cstdio>
#include <cstring>
#include <vector>

using namespace fo::sm90;
using fo::quad_send_index;

namespace {

int g_errors = 0;

void expect(bool ok, const char* what, int a, int b, int c) {
  if (ok) return;
  if (g_errors++ < 20) std::printf("MISMATCH %s (%d, %d, %d)\n", what, a, b, c);
}

// Tile element (row, col) of accumulator i of math thread t.
struct Coords {
  std::vector<int> row, col;  // [thread][accumulator]
  int per_thread = 0;
};

Coords thread_coords() {
  Coords out;
  TiledMma mma;
  for (int t = 0; t < kTileThreads; ++t) {
    auto coord = mma.get_slice(t).partition_C(make_identity_tensor(make_shape(Int<kBM>{}, Int<kBN>{})));
    out.per_thread = int(size(coord));
    for (int i = 0; i < out.per_thread; ++i) {
      out.row.push_back(int(get<0>(coord(i))));
      out.col.push_back(int(get<1>(coord(i))));
    }
  }
  return out;
}

int row_base_of(const Coords& c, int t, int m) {
  return c.row[t * c.per_thread + FragWord{}(m, 0, 0)] - (t % 32) / 4;
}

void check_fragment(const Coords& c) {
  expect(c.per_thread == kMmaM * kBN / 2, "accumulators per thread", c.per_thread, 0, 0);
  std::vector<int> seen(kBM * kBN, 0);
  for (int t = 0; t < kTileThreads; ++t) {
    const int lane = t % 32, warp0 = t - lane;
    for (int m = 0; m < kMmaM; ++m) {
      const int rb = row_base_of(c, t, m);
      expect(rb % 8 == 0 && rb >= 0 && rb + 16 <= kBM, "row_base range", t, m, rb);
      expect(rb == row_base_of(c, warp0, m), "row_base warp-uniform", t, m, rb);
      for (int h = 0; h < 2; ++h)
        for (int j = 0; j < kBN / 8; ++j)
          for (int v = 0; v < 2; ++v) {
            const int i = FragWord{}(m, h, j) + v;
            const int r = c.row[t * c.per_thread + i], col = c.col[t * c.per_thread + i];
            expect(r == rb + 8 * h + lane / 4, "fragment row", t, i, r);
            expect(col == 8 * j + 2 * (lane % 4) + v, "fragment column", t, i, col);
            // what the fp8 scaling reads for this accumulator (apply_scales)
            expect(FragWord::row(rb, h, lane) == r && FragWord::col(j, v, lane) == col,
                   "FragWord::row/col", t, i, r);
            if (r >= 0 && r < kBM && col >= 0 && col < kBN) seen[r * kBN + col]++;
          }
    }
  }
  for (int e = 0; e < kBM * kBN; ++e) expect(seen[e] == 1, "tile coverage", e / kBN, e % kBN, seen[e]);
}

// Value of tile element (r, col): unique within a tile (kBM * kBN <= 65536).
uint16_t tag(int r, int col) { return uint16_t(r * kBN + col); }

void check_tma(const Coords& c, uint32_t slot_addr) {
  static_assert(kBM * kBN <= 65536, "tags must fit 16 bits");
  for (int cb = 0; cb < kColBlocks; ++cb) {
    std::vector<uint8_t> smem(kSlotBytes + 1024, 0xff);
    auto put = [&](uint32_t offset, uint16_t value) {
      expect(offset + 2 <= uint32_t(kSlotBytes), "slot bounds", int(offset), cb, 0);
      if (offset + 2 <= uint32_t(kSlotBytes)) std::memcpy(&smem[offset], &value, 2);
    };
    for (int warp = 0; warp < kTileThreads / 32; ++warp)
      for (int m = 0; m < kMmaM; ++m)
        for (int p = 0; p < kColW / 16; ++p)
          for (int k = 0; k < 4; ++k)     // matrix
            for (int r = 0; r < 8; ++r) {  // its row r: address from lane 8k + r
              const int t_addr = 32 * warp + 8 * k + r;
              const StsmStep s = stsm_address(row_base_of(c, t_addr, m), p, t_addr % 32);
              const uint32_t row_offset = slot_offset(slot_addr, s.row, s.col);
              for (int q = 0; q < 4; ++q) {  // data of lane 4r + q: word k of its stmatrix
                const int t = 32 * warp + 4 * r + q;
                const int i = FragWord{}(m, k & 1, (kColW / 8) * cb + 2 * p + (k >> 1));
                for (int v = 0; v < 2; ++v) {
                  const int e = t * c.per_thread + i + v;
                  put(row_offset + 4 * q + 2 * v, tag(c.row[e], c.col[e]));
                }
              }
            }
    // The TMA store of box (kColW columns, kBM rows) with the swizzle of its row bytes (the
    // map's: CU_TENSOR_MAP_SWIZZLE_128B for 128-byte rows, _64B for 64-byte ones).
    const uint32_t row_bytes = kColW * 2, chunk_mask = row_bytes == 128 ? 7 : 3;
    for (int r = 0; r < kBM; ++r)
      for (int col = 0; col < kColW; ++col) {
        const uint32_t row_addr = slot_addr + uint32_t(r) * row_bytes;
        const uint32_t chunk = (uint32_t(col) / 8) ^ ((row_addr >> 7) & chunk_mask);
        uint16_t got;
        std::memcpy(&got, &smem[r * row_bytes + chunk * 16 + (col % 8) * 2], 2);
        expect(got == tag(r, kColW * cb + col), "tma slot element", r, kColW * cb + col, got);
      }
  }
}

void check_vec16(const Coords& c) {
  if constexpr (kBN % 32 == 0) {
    for (int t0 = 0; t0 < kTileThreads; t0 += 4)  // one quad at a time
      for (int m = 0; m < kMmaM; ++m)
        for (int h = 0; h < 2; ++h)
          for (int g = 0; g < kBN / 32; ++g) {
            uint32_t x[4][4];  // [lane in quad][word]
            for (int q = 0; q < 4; ++q)
              for (int k = 0; k < 4; ++k) {
                const int e = (t0 + q) * c.per_thread + FragWord{}(m, h, 4 * g + k);
                x[q][k] = uint32_t(tag(c.row[e], c.col[e])) |
                          (uint32_t(tag(c.row[e + 1], c.col[e + 1])) << 16);
              }
            for (int bit = 1; bit <= 2; bit <<= 1)  // the butterfly, all 4 lanes in lockstep
              for (int a = 0; a < 4; ++a) {
                if (a & bit) continue;
                uint32_t sent[4];
                for (int q = 0; q < 4; ++q) sent[q] = x[q][quad_send_index(q, a, bit)];
                for (int q = 0; q < 4; ++q) x[q][quad_send_index(q, a, bit)] = sent[q ^ bit];
              }
            for (int q = 0; q < 4; ++q) {
              const int t = t0 + q, lane = t % 32;
              const int row = row_base_of(c, t, m) + 8 * h + lane / 4, col = 8 * (4 * g + q);
              for (int k = 0; k < 4; ++k) {
                expect((x[q][k] & 0xffff) == tag(row, col + 2 * k), "vec16 element", row, col + 2 * k, 0);
                expect((x[q][k] >> 16) == tag(row, col + 2 * k + 1), "vec16 element", row, col + 2 * k + 1, 0);
              }
            }
          }
  }
}

void check_scales(const Coords& c) {
  if constexpr (kFp8) {
    std::vector<float> sa(4096), sb(4096);  // distinct values: a wrong index shows
    for (size_t i = 0; i < sa.size(); ++i) sa[i] = 1.0f + float(i), sb[i] = 1.0f / (3.0f + float(i));
    struct Case { int row0, rows, col0, cols; bool valid; };
    const Case cases[] = {{0, kBM, 0, kBN, true}, {300, 17, 2 * kBN, 40, true},
                          {5, kBM, kBN, kBN - 8, true}, {7, 1, 0, 1, true}, {0, kBM, 0, kBN, false}};
    for (const Case& k : cases)
      for (int a_per_row = 0; a_per_row < 2; ++a_per_row)
        for (int b_per_col = 0; b_per_col < 2; ++b_per_col) {
          const fo_gemm_scales sc{sa.data(), sb.data(), a_per_row, b_per_col, {0, 0}, {0, 0}};
          fo::WorkTile w{};
          w.row0 = k.row0, w.rows = k.rows, w.col0 = k.col0, w.cols = k.cols, w.valid = k.valid;
          std::vector<float> staged(kBM + kBN);
          for (int i = 0; i < kBM + kBN; ++i) {
            const ScaleCopy copy = scale_copy(sc, w, i);
            staged[i] = copy.copy ? (i < kBM ? sa : sb)[copy.src] : 0.0f;
          }
          for (int t = 0; t < kTileThreads; ++t) {
            const int lane = t % 32;
            for (int m = 0; m < kMmaM; ++m)
              for (int h = 0; h < 2; ++h)
                for (int j = 0; j < kBN / 8; ++j)
                  for (int v = 0; v < 2; ++v) {
                    const int r = FragWord::row(row_base_of(c, t, m), h, lane);
                    const int col = FragWord::col(j, v, lane);
                    const float got = staged[r] * staged[kBM + col];
                    const bool inside = k.valid && r < k.rows && col < k.cols;
                    const float want = inside ? sa[a_per_row ? k.row0 + r : 0] *
                                                    sb[b_per_col ? k.col0 + col : 0]
                                              : 0.0f;
                    expect(got == want, "fp8 scale of an accumulator", r, col,
                           a_per_row * 2 + b_per_col);
                  }
          }
        }
  }
}

void check_column_blocks(const Coords& c) {
  if constexpr (kBlockScaled) {
    constexpr int kPart = FO_SCALE_BLOCK / 2;
    ColMma col_mma;
    for (int t = 0; t < kTileThreads; ++t) {
      auto coord = col_mma.get_slice(t).partition_C(
          make_identity_tensor(make_shape(Int<kBM>{}, Int<FO_SCALE_BLOCK>{})));
      expect(int(size(coord)) == kPart, "column block accumulators", t, int(size(coord)), 0);
      for (int cb = 0; cb < kScaleCols; ++cb)
        for (int i = 0; i < kPart; ++i) {
          const int e = t * c.per_thread + i + cb * kPart;
          expect(int(get<0>(coord(i))) == c.row[e], "column block row", t, cb, i);
          expect(int(get<1>(coord(i))) + FO_SCALE_BLOCK * cb == c.col[e], "column block column",
                 t, cb, i);
        }
    }
    // the B tiles' layout without its swizzle (which the wgmma descriptors apply by address)
    const ElementIn* base = nullptr;
    Tensor sB = make_tensor(make_gmem_ptr(base), typename Mainloop::SmemLayoutB{}.layout_b());
    for (int wg = 0; wg < 2; ++wg) {
      Tensor tCsB = col_mma.get_slice(wg * 128).partition_B(sB);  // (MMA, kScaleCols, MMA_K, PIPE)
      expect(int(size<1>(tCsB)) == kScaleCols, "column blocks of B", wg, int(size<1>(tCsB)), 0);
      for (int cb = 0; cb < int(size<1>(tCsB)); ++cb)
        for (int k = 0; k < int(size<2>(tCsB)); ++k)
          for (int st = 0; st < int(size<3>(tCsB)); ++st) {
            const auto got = &tCsB(0, cb, k, st) - base;
            const auto want = &sB(FO_SCALE_BLOCK * cb, (kBK / int(size<2>(tCsB))) * k, st) - base;
            expect(got == want, "B column block origin", cb, k, st);
          }
    }
  }
}

}  // namespace

int main() {
  const Coords c = thread_coords();
  check_fragment(c);
  if (g_errors == 0) {
    check_vec16(c);
    check_scales(c);
    check_column_blocks(c);
    if (kBN % kColW == 0) {  // column blocks cover the tile (every tma build)
      check_tma(c, 5 * 1024);        // 1024-byte aligned slot
      check_tma(c, 5 * 1024 + 384);  // only 128-byte aligned: the swizzle follows the address
    }
  }
  std::printf("%s tile %dx%dx%d %s %s epilogue %d slots %d x %d columns stages %d smem %d bytes\n",
              g_errors ? "FAILED" : "ok", kBM, kBN, kBK, kFp8 ? "e4m3" : "16-bit",
              kPingpong ? "pingpong" : "cooperative", kEpilogue, kSlots, kColW,
              int(Mainloop::DispatchPolicy::Stages), kSmemBytes);
  return g_errors ? 1 : 0;
}
