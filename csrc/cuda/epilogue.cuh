// The GEMM epilogue pieces shared by the sm90 and sm80 kernels: store a finished tile from the
// math threads' accumulators at its packed slot (row-major at the tile's real size).
//
// Fragments. In both the sm80 mma.sync and the sm90 wgmma accumulator layouts, the lanes of a
// warp hold an 8-row by 8-column block as "quads": lane l holds row l / 4, columns
// 2 * (l % 4) and + 1. The vectorised paths below rely on that (the kernels check it with
// assert_pairs and, for sm90, the layout self-test in gemm_sm90.cu).
#pragma once
#include "common.cuh"
#include "cute/tensor.hpp"

namespace fo {

// Two fp32 accumulators -> two packed 16-bit values in one 32-bit word.
template <class T>
__device__ inline uint32_t pack2(float x, float y) {
  T a = T(x), b = T(y);
  return uint32_t(a.raw()) | (uint32_t(b.raw()) << 16);
}

// Stores this thread's accumulators of the first `rows` x `cols` of a tile into rows of stride
// `ld` elements at `dst`. `coord` maps each accumulator to its (row, col) in the tile.
// Accumulators come in pairs of adjacent columns (true of the sm80 mma and sm90 wgmma layouts;
// checked below at compile time by constant folding), stored as one 32-bit word when the
// address allows. The checked path every kernel keeps for partial tiles, unaligned slots, and
// tiles written in place into a row-major output (allgather: ld = the output's row stride).
template <class T, class Acc, class Coord>
__device__ inline void store_tile_rows(const Acc& acc, const Coord& coord, T* dst, int rows,
                                       int cols, int64_t ld) {
  const bool words = ((reinterpret_cast<uintptr_t>(dst) & 3) == 0) && ((ld & 1) == 0);
#pragma unroll
  for (int i = 0; i < int(cute::size(acc)); i += 2) {
    int r = cute::get<0>(coord(i)), c = cute::get<1>(coord(i));
    if (r >= rows) continue;
    T* p = dst + r * ld + c;
    if (words && c + 1 < cols) {
      *reinterpret_cast<uint32_t*>(p) = pack2<T>(acc(i), acc(i + 1));
    } else {
      if (c < cols) p[0] = T(acc(i));
      if (c + 1 < cols) p[1] = T(acc(i + 1));
    }
  }
}

// Stores this thread's accumulators of one tile, row-major at its real size (row stride =
// cols) at `dst`: its packed slot. Full tiles at a 4-byte aligned slot take a path without
// bounds checks; the others store_tile_rows.
template <class T, int BM, int BN, class Acc, class Coord>
__device__ inline void store_tile(const Acc& acc, const Coord& coord, T* dst, int rows, int cols) {
  const bool words = ((reinterpret_cast<uintptr_t>(dst) & 3) == 0) && ((cols & 1) == 0);
  if (words && rows == BM && cols == BN) {  // full tile: no bounds checks
#pragma unroll
    for (int i = 0; i < int(cute::size(acc)); i += 2) {
      int r = cute::get<0>(coord(i)), c = cute::get<1>(coord(i));
      *reinterpret_cast<uint32_t*>(dst + r * BN + c) = pack2<T>(acc(i), acc(i + 1));
    }
    return;
  }
  store_tile_rows(acc, coord, dst, rows, cols, cols);
}

// Compile-time check that accumulators i and i+1 are adjacent columns of one row.
template <class Coord>
__device__ inline void assert_pairs(const Coord& coord) {
#pragma unroll
  for (int i = 0; i < int(cute::size(coord)); i += 2) {
    if (cute::get<0>(coord(i + 1)) != cute::get<0>(coord(i)) ||
        cute::get<1>(coord(i + 1)) != cute::get<1>(coord(i)) + 1)
      __trap();
  }
}

// One butterfly step of quad_transpose for the word pair (a, a + bit): the index of the word a
// lane sends, and replaces with the one its partner (lane ^ bit) sends. Host-callable, for the
// layout self-test.
__host__ __device__ inline int quad_send_index(int q, int a, int bit) { return (q & bit) ? a : a + bit; }

// 4x4 transpose of 32-bit words across the 4 lanes of a quad (lane q = lane % 4): before,
// x[k] of lane q is word q of chunk k (columns 8k + 2q, + 1 of one row); after, x[k] of lane q
// is word k of chunk q, so each lane holds 16 contiguous bytes. Two butterfly steps (lane bit 0
// against word bit 0, then bit 1), 4 shuffles in all. Every lane of the warp must call it.
__device__ inline void quad_transpose(uint32_t (&x)[4], int q) {
#pragma unroll
  for (int bit = 1; bit <= 2; bit <<= 1) {
    const bool high = (q & bit) != 0;  // quad_send_index, as selects: no run-time register index
#pragma unroll
    for (int a = 0; a < 4; ++a) {
      if (a & bit) continue;
      const uint32_t got = __shfl_xor_sync(0xffffffffu, high ? x[a] : x[a + bit], bit);
      if (high) x[a] = got; else x[a + bit] = got;
    }
  }
}

__device__ inline void store_vec16(void* dst, const uint32_t (&x)[4]) {
  *reinterpret_cast<uint4*>(dst) = make_uint4(x[0], x[1], x[2], x[3]);
}

// Full tile, 16-byte stores: each quad transposes its 4 words of 4 consecutive 8-column
// chunks, so that one warp store writes 8 rows x 64 contiguous bytes (16 full sectors) instead
// of 8 rows x 16 bytes. `word(m, h, j)` is the accumulator index of this thread's first value of
// row block m, row half h (rows +8), chunk j; `row_base[m]` the first row of this warp's
// 16-row block m. Needs 16-byte aligned dst (the caller checks) and BN % 32 == 0.
template <class T, int BN, int MmaM, class Acc, class Word>
__device__ inline void store_full_tile_vec16(const Acc& acc, const Word& word,
                                             const int (&row_base)[MmaM], int lane, T* dst) {
  static_assert(BN % 32 == 0, "16-byte stores take 4 chunks of 8 columns at a time");
  const int q = lane & 3;
#pragma unroll
  for (int m = 0; m < MmaM; ++m) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      T* row = dst + int64_t(row_base[m] + 8 * h + (lane >> 2)) * BN;
#pragma unroll
      for (int g = 0; g < BN / 32; ++g) {
        uint32_t x[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int i = word(m, h, 4 * g + k);
          x[k] = pack2<T>(acc(i), acc(i + 1));
        }
        quad_transpose(x, q);
        store_vec16(row + 8 * (4 * g + q), x);
      }
    }
  }
}

}  // namespace fo
