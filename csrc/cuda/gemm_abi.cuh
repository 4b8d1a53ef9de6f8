// The C ABI of a GEMM library (flashoverlap_cuda.h), written once for every kernel. Each GEMM
// source (one translation unit = one shared object) includes this file and defines the hooks
// declared in namespace fo::gemm below.
#pragma once
#include "common.cuh"

// Configuration macros shared by every GEMM source (the tile shapes are per source).
#ifndef FO_DTYPE
#define FO_DTYPE 0  // 0: bf16, 1: fp16 (a, b and the packed output; fp32 accumulation),
                    // 2: float8 e4m3 a and b (FO_DTYPE_E4M3; sm90 only), output FO_OUT_DTYPE
#endif
#ifndef FO_OUT_DTYPE
#define FO_OUT_DTYPE (FO_DTYPE == FO_DTYPE_E4M3 ? 0 : FO_DTYPE)  // the packed output: 0 bf16, 1 fp16
#endif
#ifndef FO_B_COL_MAJOR
#define FO_B_COL_MAJOR 1  // 1: b is [N, K] row-major (weight.t()); 0: [K, N] row-major
#endif
#ifndef FO_STAGES
#define FO_STAGES 0  // mainloop pipeline stages; 0: the kernel's default
#endif
#ifndef FO_BLOCKS
#define FO_BLOCKS 0  // 1: destination blocks of unequal rows (fo_gemm_run_blocks) too
#endif

namespace fo::gemm {

constexpr bool kBlocks = FO_BLOCKS != 0;

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
  // fo_gemm_run_ex only (zero / null from fo_gemm_run):
  int64_t ldo;                   // 0: packed output; else out is row-major [M, ldo]
  const int32_t* item_wait;      // per item: the arrival flag its A rows need (-1: none)
  const uint32_t* arrive_flags;  // set (!= 0) by the transfer once the rows have landed
  int num_flags;
  // fo_gemm_run_blocks only: block l is rows [block_starts[l], block_starts[l + 1]) of the
  // `rows` rows of a, and the packed buffer holds `packed_numel` elements.
  const int32_t* block_starts = nullptr;
  int rows = 0;
  int64_t packed_numel = 0;
  // fo_gemm_run_scaled and fo_gemm_set_node_scaled only (e4m3 builds): null = not scaled.
  const fo_gemm_scales* scales = nullptr;

  int M() const { return block_starts ? rows : L * block_rows; }

  ItemTable table() const {
    const int m = M();
    const int64_t numel = packed_numel ? packed_numel : ldo ? int64_t(m) * ldo : int64_t(m) * N;
    return ItemTable{items, item_group, num_items, block_rows, L, m, N, numel, ldo, block_starts};
  }
};

// Hooks, defined by the kernel's source file.
const fo_gemm_config& config();
cudaError_t load_kernel();                         // cudaFuncGetAttributes + shared-memory limit
cudaError_t resident_ctas(int device, int* ctas);  // CTAs resident at once (current device)
cudaError_t check_limits(const Args& args);        // limits beyond check_gemm_args
cudaError_t launch(const Args& args, cudaStream_t stream);
// Points a captured launch of this kernel (a kernel node of an instantiated graph) at new
// arguments: the same launch as `launch`, written into the node instead of a stream.
cudaError_t set_node(const Args& args, cudaGraphExec_t exec, cudaGraphNode_t node);

// Bytes of one element of a and b (the alignment checks count elements).
inline int input_bytes() { return config().dtype == FO_DTYPE_E4M3 ? 1 : 2; }

// An e4m3 build runs only with scales, a 16-bit build only without.
inline cudaError_t check_scales(const Args& args) {
  const bool e4m3 = config().dtype == FO_DTYPE_E4M3;
  if (e4m3 && !args.scales)
    return fail(cudaErrorInvalidValue,
                "this GEMM library is built for float8 e4m3 a and b: call fo_gemm_run_scaled "
                "(or fo_gemm_set_node_scaled) with scale_a and scale_b");
  if (!e4m3 && args.scales)
    return fail(cudaErrorInvalidValue,
                "scales apply to float8 e4m3 builds; this GEMM library takes 16-bit a and b "
                "(fo_gemm_run)");
  if (e4m3 && (!args.scales->a || !args.scales->b ||
               (reinterpret_cast<uintptr_t>(args.scales->a) & 3) ||
               (reinterpret_cast<uintptr_t>(args.scales->b) & 3)))
    return fail(cudaErrorInvalidValue,
                "fo_gemm_run_scaled: scale_a=%p and scale_b=%p must be non-null, 4-byte aligned "
                "float32 pointers", args.scales->a, args.scales->b);
  return cudaSuccess;
}

// The checks every launch shares beyond check_gemm_args, then the launch.
inline cudaError_t checked_launch(const Args& args, cudaError_t err, cudaStream_t stream) {
  if (err == cudaSuccess) err = check_scales(args);
  if (err == cudaSuccess) err = check_limits(args);
  if (err != cudaSuccess || args.num_items == 0) return err;
  err = load_kernel();
  return err == cudaSuccess ? launch(args, stream) : err;
}

// The checks run_ex and run_blocks share: check_gemm_args of a [L * block_rows, K] a, then
// (scaled) the scales, then the output's row stride ldo (0: packed). `name` opens the messages.
inline cudaError_t check_run_args(const char* name, bool scaled, const void* a, const void* b,
                                  const fo_gemm_scales* scales, const void* out, int L,
                                  int block_rows, int N, int K, int64_t lda, int64_t ldb,
                                  int64_t ldo, const int64_t* items, const int32_t* item_group,
                                  int num_items, int num_ctas) {
  const fo_gemm_config& c = config();
  cudaError_t err = check_gemm_args(a, b, out, L, block_rows, N, K, lda, ldb, c.b_col_major,
                                    items, item_group, num_items, num_ctas, c.cta_multiple,
                                    input_bytes());
  if (err == cudaSuccess && scaled && !scales)
    err = fail(cudaErrorInvalidValue, "%s: scales is null", name);
  if (err == cudaSuccess && ldo != 0 && ldo < N)
    err = fail(cudaErrorInvalidValue, "%s: ldo=%lld must be 0 (packed) or >= N=%d", name,
               (long long)ldo, N);
  return err;
}

// fo_gemm_run_ex (scaled false), fo_gemm_run_scaled and fp8 allgather's fo_gemm_run_ex_scaled
// (gemm_sm90_ex_scaled.cu; scaled true, `scales` required): the checks, then the launch.
// `name` opens the messages.
inline cudaError_t run_ex(const char* name, bool scaled, const void* a, const void* b,
                          const fo_gemm_scales* scales, void* out, int L, int block_rows, int N,
                          int K, int64_t lda, int64_t ldb, int64_t ldo, const int64_t* items,
                          const int32_t* item_group, const int32_t* item_wait,
                          const uint32_t* arrive_flags, int num_flags, int num_items,
                          int32_t* counters, int num_ctas, uint64_t* monitor,
                          cudaStream_t stream) {
  cudaError_t err = check_run_args(name, scaled, a, b, scales, out, L, block_rows, N, K, lda,
                                   ldb, ldo, items, item_group, num_items, num_ctas);
  if (err == cudaSuccess && (!item_wait != !arrive_flags || (item_wait && num_flags < 1)))
    err = fail(cudaErrorInvalidValue,
               "%s: item_wait and arrive_flags go together, with num_flags >= 1 (got "
               "item_wait=%p, arrive_flags=%p, num_flags=%d)", name, item_wait, arrive_flags,
               num_flags);
  Args args{a, b, out, L, block_rows, N, K, lda, ldb, items, item_group, num_items, counters,
            num_ctas, monitor, ldo, item_wait, arrive_flags, num_flags};
  args.scales = scales;
  return checked_launch(args, err, stream);
}

// fo_gemm_run_blocks (scaled false) and fp8 all_to_all's fo_gemm_run_blocks_scaled
// (gemm_sm90_blocks_scaled.cu: scaled true, `scales` required): destination blocks of unequal
// rows, written packed or, with ldo, as rows of a row-major buffer. `name` opens the messages.
inline cudaError_t run_blocks(const char* name, bool scaled, const void* a, const void* b,
                              const fo_gemm_scales* scales, void* packed, int64_t packed_numel,
                              int M, int N, int K, int64_t lda, int64_t ldb, int64_t ldo,
                              const int32_t* block_starts, int L, const int64_t* items,
                              const int32_t* item_group, int num_items, int32_t* counters,
                              int num_ctas, cudaStream_t stream) {
  if (num_items < 0 || M < 0 || L < 1 || !block_starts)
    return fail(cudaErrorInvalidValue,
                "%s: need num_items >= 0, M >= 0, L >= 1 blocks and their block_starts (got "
                "num_items=%d, M=%d, L=%d, block_starts=%p)", name, num_items, M, L,
                block_starts);
  if (num_items == 0) return cudaSuccess;
  if (!kBlocks)
    return fail(cudaErrorInvalidValue,
                "%s: this library was built for equal destination blocks only; unequal ones "
                "need a build with FO_BLOCKS=1", name);
  cudaError_t err = check_run_args(name, scaled, a, b, scales, packed, 1, M, N, K, lda, ldb,
                                   ldo, items, item_group, num_items, num_ctas);
  const int64_t row = ldo ? ldo : N;  // elements per row of the output
  if (err == cudaSuccess && packed_numel < int64_t(M) * row)
    err = fail(cudaErrorInvalidValue, "%s: packed_numel=%lld < M * %s = %lld", name,
               (long long)packed_numel, ldo ? "ldo" : "N", (long long)M * row);
  Args args{a, b, packed, L, 0, N, K, lda, ldb, items, item_group, num_items, counters,
            num_ctas, nullptr, ldo, nullptr, nullptr, 0};
  args.block_starts = block_starts, args.rows = M, args.packed_numel = packed_numel;
  args.scales = scales;
  return checked_launch(args, err, stream);
}

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

FO_API cudaError_t fo_gemm_run_ex(const void* a, const void* b, void* out, int L, int block_rows,
                                  int N, int K, int64_t lda, int64_t ldb, int64_t ldo,
                                  const int64_t* items, const int32_t* item_group,
                                  const int32_t* item_wait, const uint32_t* arrive_flags,
                                  int num_flags, int num_items, int32_t* counters, int num_ctas,
                                  uint64_t* monitor, void* workspace, cudaStream_t stream) {
  (void)workspace;
  return fo::gemm::run_ex("fo_gemm_run_ex", false, a, b, nullptr, out, L, block_rows, N, K, lda,
                          ldb, ldo, items, item_group, item_wait, arrive_flags, num_flags,
                          num_items, counters, num_ctas, monitor, stream);
}

FO_API cudaError_t fo_gemm_run(const void* a, const void* b, void* packed, int L, int block_rows,
                               int N, int K, int64_t lda, int64_t ldb, const int64_t* items,
                               const int32_t* item_group, int num_items, int32_t* counters,
                               int num_ctas, uint64_t* monitor, void* workspace,
                               cudaStream_t stream) {
  return fo_gemm_run_ex(a, b, packed, L, block_rows, N, K, lda, ldb, 0, items, item_group,
                        nullptr, nullptr, 0, num_items, counters, num_ctas, monitor, workspace,
                        stream);
}

FO_API cudaError_t fo_gemm_run_scaled(const void* a, const void* b, const fo_gemm_scales* scales,
                                      void* packed, int L, int block_rows, int N, int K,
                                      int64_t lda, int64_t ldb, const int64_t* items,
                                      const int32_t* item_group, int num_items, int32_t* counters,
                                      int num_ctas, uint64_t* monitor, void* workspace,
                                      cudaStream_t stream) {
  (void)workspace;
  return fo::gemm::run_ex("fo_gemm_run_scaled", true, a, b, scales, packed, L, block_rows, N, K,
                          lda, ldb, 0, items, item_group, nullptr, nullptr, 0, num_items,
                          counters, num_ctas, monitor, stream);
}

// Destination blocks of unequal rows (all_to_all's; flashoverlap_cuda.h), written packed or, with
// ldo, as rows of a row-major buffer.
FO_API cudaError_t fo_gemm_run_blocks(const void* a, const void* b, void* packed,
                                      int64_t packed_numel, int M, int N, int K, int64_t lda,
                                      int64_t ldb, int64_t ldo, const int32_t* block_starts, int L,
                                      const int64_t* items, const int32_t* item_group,
                                      int num_items, int32_t* counters, int num_ctas,
                                      cudaStream_t stream) {
  return fo::gemm::run_blocks("fo_gemm_run_blocks", false, a, b, nullptr, packed, packed_numel, M,
                              N, K, lda, ldb, ldo, block_starts, L, items, item_group, num_items,
                              counters, num_ctas, stream);
}

// A graph's captured launch re-pointed (flashoverlap_cuda.h): a prepared call replays its
// captured graph and only updates this node when a or b moved (overlap_call.cu).
FO_API cudaError_t fo_gemm_set_node_scaled(cudaGraphExec_t exec, cudaGraphNode_t node,
                                           const void* a, const void* b,
                                           const fo_gemm_scales* scales, void* packed, int L,
                                           int block_rows, int N, int K, int64_t lda, int64_t ldb,
                                           const int64_t* items, const int32_t* item_group,
                                           int num_items, int32_t* counters, int num_ctas) {
  const fo_gemm_config& c = fo::gemm::config();
  if (!exec || !node) return fo::fail(cudaErrorInvalidValue, "fo_gemm_set_node: null graph or node");
  cudaError_t err = fo::check_gemm_args(a, b, packed, L, block_rows, N, K, lda, ldb, c.b_col_major,
                                        items, item_group, num_items, num_ctas,
                                        c.cta_multiple, fo::gemm::input_bytes());
  fo::gemm::Args args{a, b, packed, L, block_rows, N, K, lda, ldb,
                      items, item_group, num_items, counters, num_ctas, nullptr,
                      0, nullptr, nullptr, 0};
  args.scales = scales;
  if (err == cudaSuccess) err = fo::gemm::check_scales(args);
  if (err == cudaSuccess) err = fo::gemm::check_limits(args);
  return err == cudaSuccess ? fo::gemm::set_node(args, exec, node) : err;
}

FO_API cudaError_t fo_gemm_set_node(cudaGraphExec_t exec, cudaGraphNode_t node, const void* a,
                                    const void* b, void* packed, int L, int block_rows, int N,
                                    int K, int64_t lda, int64_t ldb, const int64_t* items,
                                    const int32_t* item_group, int num_items, int32_t* counters,
                                    int num_ctas) {
  return fo_gemm_set_node_scaled(exec, node, a, b, nullptr, packed, L, block_rows, N, K, lda, ldb,
                                 items, item_group, num_items, counters, num_ctas);
}

// fo_gemm_launch and fo_gemm_set_node_params: the checked Args of a parameter block.
static cudaError_t params_args(const fo_gemm_params* p, fo::gemm::Args* args) {
  if (!p) return fo::fail(cudaErrorInvalidValue, "fo_gemm_launch: params is null");
  const fo_gemm_config& c = fo::gemm::config();
  cudaError_t err = fo::check_gemm_args(p->a, p->b, p->out, p->L, p->block_rows, p->N, p->K,
                                        p->lda, p->ldb, c.b_col_major, p->items, p->item_group,
                                        p->num_items, p->num_ctas, c.cta_multiple,
                                        fo::gemm::input_bytes());
  if (err == cudaSuccess && p->ldo != 0 && p->ldo < p->N)
    err = fo::fail(cudaErrorInvalidValue, "fo_gemm_launch: ldo=%lld must be 0 (packed) or >= N=%d",
                   (long long)p->ldo, p->N);
  *args = fo::gemm::Args{p->a, p->b, p->out, p->L, p->block_rows, p->N, p->K, p->lda, p->ldb,
                         p->items, p->item_group, p->num_items, p->counters, p->num_ctas,
                         p->monitor, p->ldo, nullptr, nullptr, 0};
  args->scales = p->scales;
  return err;
}

FO_API cudaError_t fo_gemm_launch(const fo_gemm_params* params, cudaStream_t stream) {
  fo::gemm::Args args;
  const cudaError_t err = params_args(params, &args);
  return fo::gemm::checked_launch(args, err, stream);
}

FO_API cudaError_t fo_gemm_set_node_params(cudaGraphExec_t exec, cudaGraphNode_t node,
                                           const fo_gemm_params* params) {
  if (!exec || !node) return fo::fail(cudaErrorInvalidValue, "fo_gemm_set_node: null graph or node");
  fo::gemm::Args args;
  cudaError_t err = params_args(params, &args);
  if (err == cudaSuccess) err = fo::gemm::check_scales(args);
  if (err == cudaSuccess) err = fo::gemm::check_limits(args);
  return err == cudaSuccess ? fo::gemm::set_node(args, exec, node) : err;
}

FO_API const char* fo_last_error(void) { return fo::last_error_text().c_str(); }

}  // extern "C"
