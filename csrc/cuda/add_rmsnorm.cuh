// The post-communication reorder fused into residual add + RMSNorm (add_rmsnorm.cu): what a
// launch of its kernel takes, for fo_add_rmsnorm_tiles and for the prepared call's last phase
// (overlap_call.cu, fo_call_*_add_rmsnorm). The C ABI is in flashoverlap_cuda.h.
#pragma once
#include "flashoverlap_cuda.h"  // the runtime's API
#include "common.cuh"

namespace fo::runtime {

// Where the rows of the result are: the received tiles and the table of bands.
struct NormRows {
  const void* src;        // the received tiles (the staging buffer of a call)
  const int64_t* bands;   // [ceil(rows / tile_m)][col_tiles] element offsets of tiles in src
  int rows, n, tile_m, tile_n, col_tiles;
};

// What one call reads and writes besides the tiles.
struct NormIo {
  const void* residual;  // [rows, n], row stride ld_residual
  int64_t ld_residual;
  const void* weight;    // [n], contiguous
  void* normed;          // [rows, n], row stride ld_out
  void* residual_out;    // [rows, n], row stride ld_out
  int64_t ld_out;
  float eps;
};

using NormKernel = void (*)(NormRows, NormIo, int32_t*, int);

// The rows' table and shape, checked once (fo_call_set_add_rmsnorm, fo_add_rmsnorm_tiles).
cudaError_t check_norm_rows(const NormRows& r, int dtype);

// The launch of the kernel for one call: its kernel, grid and argument values (kept together
// so that a replayed graph's node can be re-pointed with the same launch).
struct NormLaunch {
  NormKernel kernel = nullptr;
  dim3 grid, block;
  NormRows rows{};
  NormIo io{};
  int32_t* reset = nullptr;
  int num_reset = 0;

  // The kernel for these operands: 16-byte vectors where every access allows them. Its first
  // CTA zeroes `num_reset` counters at `reset` (a call's group counters).
  static cudaError_t make(const NormRows& rows, int dtype, const NormIo& io, int weight_dtype,
                          int32_t* reset, int num_reset, NormLaunch* out);

  // Node parameters pointing at this object's fields (valid while it lives).
  cudaKernelNodeParams node(void** args) {
    args[0] = &rows, args[1] = &io, args[2] = &reset, args[3] = &num_reset;
    cudaKernelNodeParams p = {};
    p.func = reinterpret_cast<void*>(kernel);
    p.gridDim = grid, p.blockDim = block, p.sharedMemBytes = 0;
    p.kernelParams = args;
    return p;
  }

  cudaError_t launch(cudaStream_t stream) {
    void* args[4];
    const cudaKernelNodeParams p = node(args);
    FO_CUDA_CHECK(cudaLaunchKernel(p.func, p.gridDim, p.blockDim, p.kernelParams, 0, stream));
    return cudaSuccess;
  }

  // Whether a graph node launched as `other` reads and writes what this launch does.
  bool same(const NormLaunch& other) const {
    return kernel == other.kernel && grid.x == other.grid.x && block.x == other.block.x &&
           io.residual == other.io.residual && io.ld_residual == other.io.ld_residual &&
           io.weight == other.io.weight && io.normed == other.io.normed &&
           io.residual_out == other.io.residual_out && io.ld_out == other.io.ld_out &&
           io.eps == other.io.eps;
  }
};

}  // namespace fo::runtime
