// The C ABI of a GEMM library (flashoverlap_cuda.h), written once for every kernel. Each GEMM
// source (one translation unit = one shared object) includes this file and defines the hooks
// declared in namespace fo::gemm below.
#pragma once
#include "common.cuh"

// Configuration macros shared by every GEMM source (the tile shapes are per source).
#ifndef FO_DTYPE
#define FO_DTYPE 0  // 0: bf16, 1: fp16 (a, b and the packed output; fp32 accumulation)
#endif
#ifndef FO_B_COL_MAJOR
#define FO_B_COL_MAJOR 1  // 1: b is [N, K] row-major (weight.t()); 0: [K, N] row-major
#endif
#ifndef FO_STAGES
#define FO_STAGES 0  // mainloop pipeline stages; 0: the kernel's default
#endif

namespace fo::gemm {

struct Args {
  const void* a;
  const void* b;
  void* packed;
  int L, block_rows, N, K;
  int64_t lda, ldb;
  const int64_t* items;
  const int32_t* item_group;
  int num_items;
  int32_t* counters;
  int num_ctas;
  uint64_t* monitor;

  ItemTable table() const {
    const int M = L * block_rows;
    return ItemTable{items, item_group, num_items, block_rows, L, M, N, int64_t(M) * N};
  }
};

// Hooks, defined by the kernel's source file.
const fo_gemm_config& config();
cudaError_t load_kernel();                         // cudaFuncGetAttributes + shared-memory limit
cudaError_t resident_ctas(int device, int* ctas);  // CTAs resident at once (current device)
cudaError_t check_limits(const Args& args);        // limits beyond check_gemm_args
cudaError_t launch(const Args& args, cudaStream_t stream);

}  // namespace fo::gemm

extern "C" {

FO_API const fo_gemm_config* fo_gemm_describe(void) { return &fo::gemm::config(); }

FO_API cudaError_t fo_load_kernels(void) { return fo::gemm::load_kernel(); }

FO_API cudaError_t fo_gemm_max_ctas(int device, int* max_ctas) {
  if (!max_ctas) return fo::fail(cudaErrorInvalidValue, "fo_gemm_max_ctas: max_ctas is null");
  int previous = 0;
  FO_CUDA_CHECK(cudaGetDevice(&previous));
  FO_CUDA_CHECK(cudaSetDevice(device));
  cudaError_t err = fo::gemm::load_kernel();
  if (err == cudaSuccess) err = fo::gemm::resident_ctas(device, max_ctas);
  FO_CUDA_CHECK(cudaSetDevice(previous));
  return err;
}

FO_API size_t fo_gemm_workspace_size(int, int, int, int, int) { return 0; }

FO_API cudaError_t fo_gemm_run(const void* a, const void* b, void* packed, int L, int block_rows,
                               int N, int K, int64_t lda, int64_t ldb, const int64_t* items,
                               const int32_t* item_group, int num_items, int32_t* counters,
                               int num_ctas, uint64_t* monitor, void* workspace,
                               cudaStream_t stream) {
  (void)workspace;
  const fo_gemm_config& c = fo::gemm::config();
  cudaError_t err = fo::check_gemm_args(a, b, packed, L, block_rows, N, K, lda, ldb, c.b_col_major,
                                        items, item_group, num_items, num_ctas,
                                        c.cta_multiple);
  const fo::gemm::Args args{a, b, packed, L, block_rows, N, K, lda, ldb,
                            items, item_group, num_items, counters, num_ctas, monitor};
  if (err == cudaSuccess) err = fo::gemm::check_limits(args);
  if (err != cudaSuccess || num_items == 0) return err;
  err = fo::gemm::load_kernel();
  return err == cudaSuccess ? fo::gemm::launch(args, stream) : err;
}

FO_API const char* fo_last_error(void) { return fo::last_error_text().c_str(); }

}  // extern "C"
