// What every prepared call kind of the runtime (overlap_call.cu, all_to_all_call.cu,
// gather_call.cu) shares: the GEMM library functions a descriptor hands it as pointers, and the
// two events with which a call forks onto its communication stream and joins back.
#pragma once
#include "flashoverlap_cuda.h"  // the runtime's API
#include <type_traits>

#include "common.cuh"

namespace fo::runtime {

// ---- the GEMM library's launch functions (flashoverlap_cuda.h), called through pointers ------

// fo_gemm_launch and fo_gemm_set_node_params: the overlapped call.
using GemmLaunch = cudaError_t (*)(const fo_gemm_params*, cudaStream_t);
using GemmSetNodeParams = cudaError_t (*)(cudaGraphExec_t, cudaGraphNode_t, const fo_gemm_params*);
// fo_gemm_run_ex: allgather's GEMM, whose items wait for their rows.
using GemmRunEx = cudaError_t (*)(const void*, const void*, void*, int, int, int, int, int64_t,
                                  int64_t, int64_t, const int64_t*, const int32_t*,
                                  const int32_t*, const uint32_t*, int, int, int32_t*, int,
                                  uint64_t*, void*, cudaStream_t);
// fo_gemm_run_blocks: all_to_all's GEMM over destination blocks of unequal rows.
using GemmRunBlocks = cudaError_t (*)(const void*, const void*, void*, int64_t, int, int, int,
                                      int64_t, int64_t, int64_t, const int32_t*, int,
                                      const int64_t*, const int32_t*, int, int32_t*, int,
                                      cudaStream_t);
// fo_gemm_run_blocks_scaled: fp8 all_to_all's (gemm_blocks_scaled.h).
using GemmRunBlocksScaled = cudaError_t (*)(const void*, const void*, const fo_gemm_scales*, void*,
                                            int64_t, int, int, int, int64_t, int64_t, int64_t,
                                            const int32_t*, int, const int64_t*, const int32_t*,
                                            int, int32_t*, int, cudaStream_t);
// fo_gemm_run_ex_scaled: fp8 allgather's (gemm_ex_scaled.h).
using GemmRunExScaled = cudaError_t (*)(const void*, const void*, const fo_gemm_scales*, void*, int,
                                        int, int, int, int64_t, int64_t, int64_t, const int64_t*,
                                        const int32_t*, const int32_t*, const uint32_t*, int, int,
                                        int32_t*, int, uint64_t*, void*, cudaStream_t);
static_assert(std::is_same_v<GemmLaunch, decltype(&fo_gemm_launch)>);
static_assert(std::is_same_v<GemmSetNodeParams, decltype(&fo_gemm_set_node_params)>);
static_assert(std::is_same_v<GemmRunEx, decltype(&fo_gemm_run_ex)>);
static_assert(std::is_same_v<GemmRunBlocks, decltype(&fo_gemm_run_blocks)>);
static_assert(std::is_same_v<GemmRunBlocksScaled, decltype(&fo_gemm_run_blocks_scaled)>);
static_assert(std::is_same_v<GemmRunExScaled, decltype(&fo_gemm_run_ex_scaled)>);

// A GEMM library's launch failed: its own fo_last_error has the details.
inline cudaError_t gemm_failed(cudaError_t err, const char* what) {
  return fail(err, "the %s GEMM could not be launched (cudaError %d)", what, int(err));
}

// ---- the fork onto the communication stream and the join back ------------------------------

struct CallEvents {
  cudaEvent_t inputs_ready = nullptr;  // compute stream -> communication stream
  cudaEvent_t comm_done = nullptr;     // communication stream -> compute stream

  // Both events, or the error of the one that could not be made (destroy() releases the other).
  cudaError_t create() {
    cudaError_t err = cudaEventCreateWithFlags(&inputs_ready, cudaEventDisableTiming);
    if (err == cudaSuccess) err = cudaEventCreateWithFlags(&comm_done, cudaEventDisableTiming);
    return err;
  }

  void destroy() {
    if (inputs_ready) cudaEventDestroy(inputs_ready);
    if (comm_done) cudaEventDestroy(comm_done);
  }

  // The communication stream's later work follows what `stream` holds so far.
  cudaError_t fork(cudaStream_t stream, cudaStream_t comm_stream) const {
    FO_CUDA_CHECK(cudaEventRecord(inputs_ready, stream));
    FO_CUDA_CHECK(cudaStreamWaitEvent(comm_stream, inputs_ready, 0));
    return cudaSuccess;
  }

  // The end of what `comm_stream` holds so far, for a later join().
  cudaError_t comm_finished(cudaStream_t comm_stream) const {
    FO_CUDA_CHECK(cudaEventRecord(comm_done, comm_stream));
    return cudaSuccess;
  }

  // `stream`'s later work follows the communication recorded by comm_finished().
  cudaError_t join(cudaStream_t stream) const {
    FO_CUDA_CHECK(cudaStreamWaitEvent(stream, comm_done, 0));
    return cudaSuccess;
  }
};

}  // namespace fo::runtime
