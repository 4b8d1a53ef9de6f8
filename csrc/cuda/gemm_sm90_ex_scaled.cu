// fp8 allgather's GEMM library (issue 32): the Hopper kernel of gemm_sm90.cu, built for e4m3
// (GemmConfig.gather), and one more C function, fo_gemm_run_ex_scaled (gemm_ex_scaled.h):
// fo_gemm_run_ex (ldo, item_wait, arrive_flags) with the scales of fo_gemm_run_scaled. The
// kernel takes both already: its parameters carry the waits and the scales, and every scale load
// indexes the tile's row of a (WorkTile::row0 = block * block_rows + band * kBM: the row of the
// gathered a, whose M is L * block_rows), stage_scales (row-wise, scale_copy) and
// load_block_scales (block-wise) alike, so a gathered row takes the scale at its own row of the
// gathered scale_a, which holds its rank's scales (gather_call.cu).
// The waits guard the rows of a only: an item's scales are read before (row-wise: the math
// threads' cp.async before the item's main loop; block-wise: producer warp kScaleLoaderWarp,
// which does not wait) or without (tensor-wise: at the kernel's start) its flag, so the caller
// has them in place before the launch.
// A translation unit of its own, so that only these builds export the function (build.py
// compiles this file for e4m3 builds with gather=True only: gemm_source); its checks and
// launch are fo_gemm_run_ex's (fo::gemm::run_ex, gemm_abi.cuh).
#include "gemm_sm90.cu"

#include "gemm_ex_scaled.h"

extern "C" {

FO_API cudaError_t fo_gemm_run_ex_scaled(const void* a, const void* b,
                                         const fo_gemm_scales* scales, void* out, int L,
                                         int block_rows, int N, int K, int64_t lda, int64_t ldb,
                                         int64_t ldo, const int64_t* items,
                                         const int32_t* item_group, const int32_t* item_wait,
                                         const uint32_t* arrive_flags, int num_flags,
                                         int num_items, int32_t* counters, int num_ctas,
                                         uint64_t* monitor, void* workspace, cudaStream_t stream) {
  (void)workspace;
  return fo::gemm::run_ex("fo_gemm_run_ex_scaled", true, a, b, scales, out, L, block_rows, N, K,
                          lda, ldb, ldo, items, item_group, item_wait, arrive_flags, num_flags,
                          num_items, counters, num_ctas, monitor, stream);
}

}  // extern "C"
