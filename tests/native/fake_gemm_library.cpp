// A GEMM kernel library with no kernels (host compiler, no GPU): the C ABI of
// gemm_api.h, so that tests/test_cuda_binding_cpu.py can load it through the runtime's
// GemmLibrary. Its description is FAKE_ABI's, its max_ctas 132, its workspace L * N bytes; a
// run fails with a message naming its arguments; a launch succeeds only with scales. With
// FAKE_EX_SCALED it also exports fp8 allgather's fo_gemm_run_ex_scaled (gemm_ex_scaled.h), which
// fails naming its scales' modes and strides.
#include <cstdio>
#include <string>

#include "gemm_api.h"
#ifdef FAKE_EX_SCALED
#include "gemm_ex_scaled.h"
#endif

#ifndef FAKE_ABI
#define FAKE_ABI FO_CUDA_ABI_VERSION
#endif

namespace {
std::string last;

cudaError_t fail(const std::string& text) {
  last = text;
  return cudaErrorInvalidValue;
}
}  // namespace

extern "C" {

FO_API const fo_gemm_config* fo_gemm_describe(void) {
  static const fo_gemm_config config = {FAKE_ABI, 90, 128, 256, 64, 2, 1, FO_DTYPE_E4M3, 1, 2, 0, 4,
                                        0, 1};
  return &config;
}

FO_API const char* fo_last_error(void) { return last.c_str(); }

FO_API cudaError_t fo_load_kernels(void) { return cudaSuccess; }

FO_API cudaError_t fo_gemm_max_ctas(int, int* max_ctas) {
  *max_ctas = 132;
  return cudaSuccess;
}

FO_API size_t fo_gemm_workspace_size(int L, int, int N, int, int) { return size_t(L) * N; }

FO_API cudaError_t fo_gemm_run(const void*, const void*, void*, int L, int block_rows, int N, int K,
                               int64_t lda, int64_t ldb, const int64_t*, const int32_t*,
                               int num_items, int32_t*, int num_ctas, uint64_t* monitor, void*,
                               cudaStream_t) {
  char text[256];
  snprintf(text, sizeof(text), "fake run L=%d rows=%d N=%d K=%d lda=%lld ldb=%lld items=%d ctas=%d "
           "monitor=%p", L, block_rows, N, K, (long long)lda, (long long)ldb, num_items, num_ctas,
           static_cast<void*>(monitor));
  return fail(text);
}

FO_API cudaError_t fo_gemm_run_ex(const void*, const void*, void*, int, int, int, int, int64_t,
                                  int64_t, int64_t ldo, const int64_t*, const int32_t*,
                                  const int32_t*, const uint32_t*, int num_flags, int, int32_t*,
                                  int, uint64_t*, void*, cudaStream_t) {
  return fail("fake run_ex ldo=" + std::to_string(ldo) + " flags=" + std::to_string(num_flags));
}

FO_API cudaError_t fo_gemm_run_scaled(const void*, const void*, const fo_gemm_scales* scales,
                                      void*, int, int, int, int, int64_t, int64_t, const int64_t*,
                                      const int32_t*, int, int32_t*, int, uint64_t*, void*,
                                      cudaStream_t) {
  return fail("fake run_scaled a_per_row=" + std::to_string(scales->a_per_row) +
              " b_per_col=" + std::to_string(scales->b_per_col));
}

#ifdef FAKE_EX_SCALED
FO_API cudaError_t fo_gemm_run_ex_scaled(const void*, const void*, const fo_gemm_scales* scales,
                                         void*, int, int, int, int, int64_t, int64_t,
                                         int64_t ldo, const int64_t*, const int32_t*,
                                         const int32_t*, const uint32_t*, int num_flags, int,
                                         int32_t*, int, uint64_t*, void*, cudaStream_t) {
  return fail("fake run_ex_scaled ldo=" + std::to_string(ldo) + " flags=" +
              std::to_string(num_flags) + " a_per_row=" + std::to_string(scales->a_per_row) +
              " b_per_col=" + std::to_string(scales->b_per_col) + " a_stride=" +
              std::to_string(scales->a_stride[0]) + "," + std::to_string(scales->a_stride[1]));
}
#endif

FO_API cudaError_t fo_gemm_run_blocks(const void*, const void*, void*, int64_t, int, int, int,
                                      int64_t, int64_t, int64_t, const int32_t*, int,
                                      const int64_t*, const int32_t*, int, int32_t*, int,
                                      cudaStream_t) {
  return fail("not called");
}

FO_API cudaError_t fo_gemm_launch(const fo_gemm_params* params, cudaStream_t) {
  if (!params->scales) return fail("fake launch without scales, N=" + std::to_string(params->N));
  return cudaSuccess;
}

FO_API cudaError_t fo_gemm_set_node_params(cudaGraphExec_t, cudaGraphNode_t, const fo_gemm_params*) {
  return fail("not called");
}

}  // extern "C"
