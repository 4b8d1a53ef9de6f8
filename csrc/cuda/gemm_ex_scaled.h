// The scaled GEMM whose items wait for their rows: fp8 allgather's (issue 32). One more C
// function of the GEMM libraries, exported only by the e4m3 builds for allgather
// (GemmConfig.gather), which are compiled from gemm_sm90_ex_scaled.cu (gemm_sm90.cu plus this
// function). It is declared here, apart from gemm_api.h, so that the other GEMM objects, whose
// sources include gemm_api.h and not this, keep their cached builds (backends/cuda/build.py
// hashes what each object includes). The runtime reaches it through flashoverlap_cuda.h, which
// includes this; a library without it (every other build) has no such symbol, and GemmLibrary
// reports its address as 0.
#pragma once
#include "gemm_api.h"

#ifdef __cplusplus
extern "C" {
#endif

// fo_gemm_run_ex with the scales of an e4m3 build (fo_gemm_run_scaled's): ldo, item_wait,
// arrive_flags and num_flags as fo_gemm_run_ex takes them (allgather: the tiles written in place
// into a row-major out, each item of another rank's rows waiting for its flag). The scales are
// indexed by the row of a (L * block_rows rows: allgather's gathered rows, rank s's at
// s * block_rows ..) and the column of the result, as fo_gemm_scales says: row-wise
// scale_a[r], block-wise scale_a[r * a_stride[0] + g * a_stride[1]].
// The kernel reads an item's scales without waiting for its flag: row-wise ones are staged by
// the math threads before the item's main loop, block-wise ones by a producer warp other than
// the one that waits, and a tensor-wise scale_a at the kernel's start. So the scales must be in
// place before the launch (as they are in gather_call.cu), unlike the rows of a that a flag
// brings.
FO_API cudaError_t fo_gemm_run_ex_scaled(const void* a, const void* b,
                                         const fo_gemm_scales* scales, void* out, int L,
                                         int block_rows, int N, int K, int64_t lda, int64_t ldb,
                                         int64_t ldo, const int64_t* items,
                                         const int32_t* item_group, const int32_t* item_wait,
                                         const uint32_t* arrive_flags, int num_flags,
                                         int num_items, int32_t* counters, int num_ctas,
                                         uint64_t* monitor, void* workspace, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
