// fp8 all_to_all's GEMM library (issue 32): the Hopper kernel of gemm_sm90.cu, built for e4m3
// with FO_BLOCKS=1 (destination blocks of unequal rows), and one more C function,
// fo_gemm_run_blocks_scaled (gemm_blocks_scaled.h): fo_gemm_run_blocks with the scales of
// fo_gemm_run_scaled. The kernel takes both already: its parameters carry the block starts
// (ItemTable) and the scales, and every scale load indexes the tile's global row of a
// (WorkTile::row0, which the blocks build decodes as block_starts[l] + band * kBM): stage_scales
// (row-wise, scale_copy) and load_block_scales (block-wise) alike, so a row's scale is its own
// whatever block it is sent to.
// A translation unit of its own, so that only these builds export the function (build.py
// compiles this file for e4m3 builds with blocks=True only: _gemm_job); its checks and launch are
// fo_gemm_run_blocks's (fo::gemm::run_blocks, gemm_abi.cuh).
#include "gemm_sm90.cu"

#include "gemm_blocks_scaled.h"

extern "C" {

FO_API cudaError_t fo_gemm_run_blocks_scaled(const void* a, const void* b,
                                             const fo_gemm_scales* scales, void* packed,
                                             int64_t packed_numel, int M, int N, int K,
                                             int64_t lda, int64_t ldb, int64_t ldo,
                                             const int32_t* block_starts, int L,
                                             const int64_t* items, const int32_t* item_group,
                                             int num_items, int32_t* counters, int num_ctas,
                                             cudaStream_t stream) {
  return fo::gemm::run_blocks("fo_gemm_run_blocks_scaled", true, a, b, scales, packed,
                              packed_numel, M, N, K, lda, ldb, ldo, block_starts, L, items,
                              item_group, num_items, counters, num_ctas, stream);
}

}  // extern "C"
