// The GEMM epilogue shared by the sm90 and sm80 kernels: store a finished tile from the math
// threads' accumulators at its packed slot.
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

// Stores this thread's accumulators of one tile, row-major at its real size (row stride =
// cols) at `dst`. `coord` maps each accumulator to its (row, col) in the tile. Accumulators come
// in pairs of adjacent columns (true of the sm80 mma and sm90 wgmma layouts; checked below at
// compile time by constant folding), stored as one 32-bit word when the address allows.
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
#pragma unroll
  for (int i = 0; i < int(cute::size(acc)); i += 2) {
    int r = cute::get<0>(coord(i)), c = cute::get<1>(coord(i));
    if (r >= rows) continue;
    T* p = dst + r * cols + c;
    if (words && c + 1 < cols) {
      *reinterpret_cast<uint32_t*>(p) = pack2<T>(acc(i), acc(i + 1));
    } else {
      if (c < cols) p[0] = T(acc(i));
      if (c + 1 < cols) p[1] = T(acc(i + 1));
    }
  }
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

}  // namespace fo
