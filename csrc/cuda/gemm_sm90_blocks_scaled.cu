// fp8 all_to_all's GEMM library (issue 32): the Hopper kernel of gemm_sm90.cu, built for e4m3
// with FO_BLOCKS=1 (destination blocks of unequal rows), and one more C function,
// fo_gemm_run_blocks_scaled (gemm_blocks_scaled.h): fo_gemm_run_blocks with the scales of
// fo_gemm_run_scaled. The kernel takes both already: its parameters carry the block starts
// (ItemTable) and the scales, and every scale load indexes the tile's global row of a
// (WorkTile::row0, which the blocks build decodes as block_starts[l] + band * kBM): stage_scales
// (row-wise, scale_copy) and load_block_scales (block-wise) alike, so a row's scale is its own
// whatever block it is sent to.
// A translation unit of its own, so that gemm_sm90.cu and gemm_abi.cuh, and with them the cached
// objects of every other configuration, stay as they are (build.py compiles this file for e4m3
// builds with blocks=True only: _gemm_job).
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
  if (num_items < 0 || M < 0 || L < 1 || !block_starts)
    return fo::fail(cudaErrorInvalidValue,
                    "fo_gemm_run_blocks_scaled: need num_items >= 0, M >= 0, L >= 1 blocks and "
                    "their block_starts (got num_items=%d, M=%d, L=%d, block_starts=%p)",
                    num_items, M, L, block_starts);
  if (num_items == 0) return cudaSuccess;
  if (!fo::gemm::kBlocks)
    return fo::fail(cudaErrorInvalidValue,
                    "fo_gemm_run_blocks_scaled: this library was built for equal destination "
                    "blocks only; unequal ones need a build with FO_BLOCKS=1");
  const fo_gemm_config& c = fo::gemm::config();
  cudaError_t err = fo::check_gemm_args(a, b, packed, 1, M, N, K, lda, ldb, c.b_col_major, items,
                                        item_group, num_items, num_ctas, c.cta_multiple,
                                        fo::gemm::input_bytes());
  if (err == cudaSuccess && !scales)
    err = fo::fail(cudaErrorInvalidValue, "fo_gemm_run_blocks_scaled: scales is null");
  if (err == cudaSuccess && ldo != 0 && ldo < N)
    err = fo::fail(cudaErrorInvalidValue,
                   "fo_gemm_run_blocks_scaled: ldo=%lld must be 0 (packed) or >= N=%d",
                   (long long)ldo, N);
  const int64_t row = ldo ? ldo : N;  // elements per row of the output
  if (err == cudaSuccess && packed_numel < int64_t(M) * row)
    err = fo::fail(cudaErrorInvalidValue,
                   "fo_gemm_run_blocks_scaled: packed_numel=%lld < M * %s = %lld",
                   (long long)packed_numel, ldo ? "ldo" : "N", (long long)M * row);
  fo::gemm::Args args{a, b, packed, L, 0, N, K, lda, ldb, items, item_group, num_items, counters,
                      num_ctas, nullptr, ldo, nullptr, nullptr, 0};
  args.block_starts = block_starts, args.rows = M, args.packed_numel = packed_numel;
  args.scales = scales;
  return fo::gemm::checked_launch(args, err, stream);
}

}  // extern "C"
