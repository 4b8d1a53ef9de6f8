// fp8 allgather's GEMM library on CUTLASS's own kernel (issue 32): gemm_sm90_stock.cu built for
// e4m3 with GemmConfig(stock=True, gather=True), and fo_gemm_run_ex_scaled (gemm_ex_scaled.h):
// fo_gemm_run_ex's waits for rows with fo_gemm_run_scaled's scales. The kernel's item scheduler
// makes the main loop's producer warp wait for each item's arrival flag before it loads the
// item (ItemScheduler::get_current_work); the scales are read without waiting (row-wise ones by
// the epilogue's broadcasts, at the gathered row's index: its rank's scale), so the caller has
// them in place before the launch, as for gemm_sm90_ex_scaled.cu's builds.
// A translation unit of its own, so that gemm_sm90_stock.cu's other builds export no such
// function and gemm_sm90_ex_scaled.cu's objects keep their cached builds (build.py hashes what
// each object includes).
#define FO_ITEM_WAITS 1  // the item scheduler's waits for rows (gemm_sm90_stock.cu)
#include "gemm_sm90_stock.cu"

#include "gemm_ex_scaled.h"

extern "C" FO_API cudaError_t fo_gemm_run_ex_scaled(
    const void* a, const void* b, const fo_gemm_scales* scales, void* out, int L, int block_rows,
    int N, int K, int64_t lda, int64_t ldb, int64_t ldo, const int64_t* items,
    const int32_t* item_group, const int32_t* item_wait, const uint32_t* arrive_flags,
    int num_flags, int num_items, int32_t* counters, int num_ctas, uint64_t* monitor,
    void* /*workspace: none*/, cudaStream_t stream) {
  return fo::gemm::run_ex("fo_gemm_run_ex_scaled", true, a, b, scales, out, L, block_rows, N, K,
                          lda, ldb, ldo, items, item_group, item_wait, arrive_flags, num_flags,
                          num_items, counters, num_ctas, monitor, stream);
}
