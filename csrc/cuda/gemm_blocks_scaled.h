// The scaled GEMM over destination blocks of unequal rows: fp8 all_to_all's (issue 32). One more
// C function of the GEMM libraries, exported only by the e4m3 builds with FO_BLOCKS=1, which are
// compiled from gemm_sm90_blocks_scaled.cu (gemm_sm90.cu plus this function). It is declared
// here, apart from gemm_api.h, so that the other GEMM objects, whose sources include gemm_api.h
// and not this, keep their cached builds (backends/cuda/build.py hashes what each object
// includes). The runtime reaches it through flashoverlap_cuda.h, which includes this; a library
// without it (every other build) has no such symbol, and GemmLibrary reports its address as 0.
#pragma once
#include "gemm_api.h"

#ifdef __cplusplus
extern "C" {
#endif

// fo_gemm_run_blocks with the scales of an e4m3 build (fo_gemm_run_scaled's): block l is rows
// [block_starts[l], block_starts[l + 1]) of a's M rows, each item's band counted from its
// block's first row, the output packed (ldo = 0) or as rows of a row-major buffer (ldo != 0),
// as fo_gemm_run_blocks takes them. The scales are indexed by the row of a (its global row, not
// the row within its block) and the column of the result, as fo_gemm_scales says: row-wise
// scale_a[r], block-wise scale_a[r * a_stride[0] + g * a_stride[1]]. Nothing is launched when
// num_items is 0 (a rank with no rows: a and the scales may then be empty).
FO_API cudaError_t fo_gemm_run_blocks_scaled(const void* a, const void* b,
                                             const fo_gemm_scales* scales, void* packed,
                                             int64_t packed_numel, int M, int N, int K,
                                             int64_t lda, int64_t ldb, int64_t ldo,
                                             const int32_t* block_starts, int L,
                                             const int64_t* items, const int32_t* item_group,
                                             int num_items, int32_t* counters, int num_ctas,
                                             cudaStream_t stream);

#ifdef __cplusplus
}
#endif
