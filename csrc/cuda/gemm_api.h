// C ABI of FlashOverlap's GEMM libraries: the fo_gemm_* functions, fo_load_kernels and
// fo_last_error, which one shared object per GEMM configuration exports (defined in
// gemm_abi.cuh). The runtime object's own functions are declared in flashoverlap_cuda.h, which
// includes this; the GEMM sources include this alone, so that an edit of the runtime's API
// leaves their cached objects valid.
//
// Each kernel library (one shared object per GEMM configuration, built by the JIT in
// backends/cuda/build.py) exports these symbols with C linkage, and the runtime (a Python
// extension module: these units and runtime_binding.cpp) loads it with dlopen: no dependency on
// the ABI of a particular torch or Python build, and the same object runs under any torch that
// shares the CUDA driver. Every function returns a cudaError_t
// (0 = success) and never synchronizes the device; fo_last_error() describes the last failure.
//
// Work items. A persistent GEMM of G CTAs processes work items i = cta, cta + G, ... in the
// plan's execution order. Item i is described by the host-built table `items` (int64, 4 per
// item): {block l, band m_blk (within block l), column tile n_blk, packed element offset}, and
// `item_group` (int32, 1 per item): its wave group. The tile covers rows
// [l * block_rows + m_blk * BM, + min(BM, block_rows - m_blk * BM)) of A (and of c = A @ B)
// and columns [n_blk * BN, + min(BN, N - n_blk * BN)); it is stored row-major at its real size
// (row stride = its real column count) at `packed + offset`. After the tile's stores are
// complete and visible device-wide (release), the kernel adds 1 to counters[item_group[i]].
// A counter never becomes visible before its tiles' data.
//
// Clusters (sm90 configurations with cluster_m * cluster_n > 1): the CTAs of one cluster share
// operand tiles through TMA multicast, so the items a cluster takes together (items
// c*S .. c*S + S-1 of each round, S = cluster size, CTA rank r = rm + rn * cluster_m) must agree:
// every item of a cluster round has the column tile of the item at rank (0, rn) and the rows of
// the item at rank (rm, 0). With cluster 2x1 that is "items 2p and 2p+1 have the same n_blk".
// The kernel checks this and traps on a violation (a malformed table would otherwise give wrong
// data silently); it also traps on an item outside the matrix or the packed buffer.
//
// Alignment (answered by cudaErrorInvalidValue and a message naming the fix): a and b 16-byte
// aligned, lda and ldb multiples of 8 elements. sm80 configurations also need K % 8 == 0, and
// N % 8 == 0 when b is row-major (their cp.async vectors are 8 elements wide); pad to meet it.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

#if defined(__GNUC__)
#define FO_API __attribute__((visibility("default")))
#else
#define FO_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

// Static description of the GEMM configuration compiled into this library.
typedef struct {
  int abi_version;   // FO_CUDA_ABI_VERSION
  int arch;          // 90 for sm_90a, 80 for sm_80 (runs on sm80/86/89/90)
  int tile_m, tile_n, tile_k;
  int cluster_m, cluster_n;
  int dtype;         // 0 = bf16, 1 = fp16 (A, B, packed output); accumulation is fp32
  int b_col_major;   // 1: B is [N, K] row-major (weight.t() of an nn.Linear); 0: [K, N] row-major
  int cta_multiple;  // the grid size must be a multiple of this (cluster size)
  int schedule;      // 0 = sm90 cooperative, 1 = sm90 pingpong, 2 = sm80 multistage
  int stages;        // shared-memory pipeline stages of the mainloop
  // Appended (issue 23): dtype 2 = float8 e4m3 A and B (FO_DTYPE_E4M3), scaled by
  // fo_gemm_run_scaled; out_dtype is the packed output's (0 = bf16, 1 = fp16; the input dtype
  // for 16-bit builds); fast_accum: e4m3 builds that accumulate in the tensor cores' own
  // accumulators throughout (1) or promote them into fp32 registers every 4 MMAs (0).
  int out_dtype;
  int fast_accum;
} fo_gemm_config;

#define FO_DTYPE_E4M3 2

#define FO_CUDA_ABI_VERSION 2

FO_API const fo_gemm_config* fo_gemm_describe(void);

// Maximum CTAs resident at once for this configuration on `device` (the wave size cap).
FO_API cudaError_t fo_gemm_max_ctas(int device, int* max_ctas);

// Force-load every kernel of this library (cudaFuncGetAttributes on each), so that no first
// launch waits for an idle device under CUDA's lazy module loading.
FO_API cudaError_t fo_load_kernels(void);

// Run the signaling GEMM.
//   a: [L * block_rows, K] row-major, lda elements between rows (>= K)
//   b: b_col_major ? [N, K] with ldb between rows : [K, N] with ldb between rows
//   packed: M * N elements (M = L * block_rows), written in the packed layout above
//   num_ctas: persistent grid size (<= fo_gemm_max_ctas, a multiple of cta_multiple; leaves the
//             other SMs to the collective)
//   counters: one int32 per group; each gets += 1 per finished tile (the kernel only adds:
//             reset them with fo_reset_counters, or wait for cumulative targets);
//             nullptr: no signaling (the same kernel without it, for measuring its cost)
//   monitor: nullptr, or 2 uint64 per item: {%globaltimer at the tile's signal, (smid << 32) | cta}
//   workspace: device scratch of fo_gemm_workspace_size bytes (may be nullptr when that is 0)
FO_API cudaError_t fo_gemm_run(const void* a, const void* b, void* packed,
                        int L, int block_rows, int N, int K, int64_t lda, int64_t ldb,
                        const int64_t* items, const int32_t* item_group, int num_items,
                        int32_t* counters, int num_ctas, uint64_t* monitor,
                        void* workspace, cudaStream_t stream);
FO_API size_t fo_gemm_workspace_size(int L, int block_rows, int N, int K, int num_ctas);

// fo_gemm_run with two additions (fo_gemm_run is this with ldo = 0 and no waits):
//   ldo: 0, the tiles go to their packed slots as above; else `out` is a row-major [M, ldo]
//        matrix and item i's offset is the element offset of its first element there
//        (row0 * ldo + col0): the tiles are written in place (allgather's output)
//   item_wait, arrive_flags, num_flags (all given or item_wait == arrive_flags == nullptr):
//        before loading anything of item i with item_wait[i] >= 0, the kernel waits until
//        arrive_flags[item_wait[i]] != 0 (acquire at GPU scope, then on sm90 a proxy fence for
//        the TMA loads): the consumer side of allgather, whose rows of A arrive during the GEMM.
//        Whatever sets a flag must make the rows visible first (a stream write-value after the
//        copy does), and must not need the SMs that this GEMM's CTAs occupy (gather_call.cu).
FO_API cudaError_t fo_gemm_run_ex(const void* a, const void* b, void* out, int L, int block_rows,
                                  int N, int K, int64_t lda, int64_t ldb, int64_t ldo,
                                  const int64_t* items, const int32_t* item_group,
                                  const int32_t* item_wait, const uint32_t* arrive_flags,
                                  int num_flags, int num_items, int32_t* counters, int num_ctas,
                                  uint64_t* monitor, void* workspace, cudaStream_t stream);

// The signaling GEMM over destination blocks of unequal rows (all_to_all, whose rows and splits
// are each call's own): block l is rows [block_starts[l], block_starts[l + 1]) of a's M rows
// (block_starts: L + 1 int32 in device memory, non-decreasing from 0 to M; a block may be
// empty). The items are fo_gemm_run's, their band counted from their block's first row; ldo as
// fo_gemm_run_ex takes it: 0, `packed` holds packed_numel >= M * N elements in the packed
// layout; else it is a row-major [packed_numel / ldo, ldo] buffer of at least M rows and each
// item's offset is where its first element goes (a "rows" all_to_all: the tiles written at
// their final rows). Nothing is launched when num_items is 0 (a rank with no rows: a may then
// be empty). Needs a build with FO_BLOCKS=1.
FO_API cudaError_t fo_gemm_run_blocks(const void* a, const void* b, void* packed,
                                      int64_t packed_numel, int M, int N, int K, int64_t lda,
                                      int64_t ldb, int64_t ldo, const int32_t* block_starts, int L,
                                      const int64_t* items, const int32_t* item_group,
                                      int num_items, int32_t* counters, int num_ctas,
                                      cudaStream_t stream);

// A graph's captured launch of this GEMM (fo_gemm_run inside stream capture) re-pointed at new
// operands and tables, checked as fo_gemm_run checks them.
FO_API cudaError_t fo_gemm_set_node(cudaGraphExec_t exec, cudaGraphNode_t node, const void* a,
                                    const void* b, void* packed, int L, int block_rows, int N,
                                    int K, int64_t lda, int64_t ldb, const int64_t* items,
                                    const int32_t* item_group, int num_items, int32_t* counters,
                                    int num_ctas);

// ---- fp8 (e4m3) builds: the scaled signaling GEMM -----------------------------------------
// A library with dtype FO_DTYPE_E4M3 takes a and b in float8 e4m3 (both K-major: b is [N, K]
// row-major, b_col_major = 1), accumulates in fp32 and writes out_dtype:
//   packed tile element (r, c) = (sum_k a[r, k] b[c, k]) * scale_a[a_per_row ? r : 0]
//                                                         * scale_b[b_per_col ? c : 0]
// (r: the row of a, c: the column of the result; the scales are float32 in device memory, read
// by the kernel, so they may change between launches and graph replays). Rows of a need a row
// stride (lda) that is a multiple of 16 elements (16 bytes), like ldb. Such a library answers
// fo_gemm_run, fo_gemm_run_ex and fo_gemm_run_blocks with cudaErrorInvalidValue (they carry no
// scales), and a 16-bit library answers the _scaled functions so.
// Block-wise (issue 32), a_per_row = b_per_col = FO_SCALE_BLOCKS, the only modes a block-scaled
// library (FO_FP8_BLOCK = 1) takes and that no other library takes: the scales are applied in
// the main loop, per 128-long group of k (FO_SCALE_BLOCK), not in the epilogue:
//   packed tile element (r, c) = sum_g (sum_{k in group g} a[r, k] b[c, k])
//                                      * scale_a[r * a_stride[0] + g * a_stride[1]]
//                                      * scale_b[g * b_stride[0] + (c / 128) * b_stride[1]]
// (g = k / 128; the last group may be shorter than 128 when K is not a multiple of it; element
// strides, any values, e.g. torch's outer-dim-major scale_a, strides (1, M)).
#define FO_SCALE_BLOCKS 2
#define FO_SCALE_BLOCK 128
typedef struct {
  const float* a;  // scale_a: 1 float, or one per row of a (a_per_row = 1)
  const float* b;  // scale_b: 1 float, or one per column of the result (b_per_col = 1)
  int a_per_row;
  int b_per_col;
  // Appended (issue 32): FO_SCALE_BLOCKS only, the element strides of scale_a [M, groups]
  // and scale_b [groups, ceil(N / 128)]; ignored otherwise (zero-initialised by older callers)
  int64_t a_stride[2];
  int64_t b_stride[2];
} fo_gemm_scales;

// fo_gemm_run with the scales of an e4m3 build.
FO_API cudaError_t fo_gemm_run_scaled(const void* a, const void* b, const fo_gemm_scales* scales,
                                      void* packed, int L, int block_rows, int N, int K,
                                      int64_t lda, int64_t ldb, const int64_t* items,
                                      const int32_t* item_group, int num_items, int32_t* counters,
                                      int num_ctas, uint64_t* monitor, void* workspace,
                                      cudaStream_t stream);
// fo_gemm_set_node for a captured fo_gemm_run_scaled (new operands or scales).
FO_API cudaError_t fo_gemm_set_node_scaled(cudaGraphExec_t exec, cudaGraphNode_t node,
                                           const void* a, const void* b,
                                           const fo_gemm_scales* scales, void* packed, int L,
                                           int block_rows, int N, int K, int64_t lda, int64_t ldb,
                                           const int64_t* items, const int32_t* item_group,
                                           int num_items, int32_t* counters, int num_ctas);

// ---- one launch for every build and layout (what a prepared call uses) --------------------
// Everything a launch of this library's GEMM takes: fo_gemm_run's arguments with `scales` (e4m3
// builds: required; 16-bit builds: null) and `ldo` as fo_gemm_run_ex takes it (0: tiles at
// their packed slots; else each item's offset is where its first element goes in a row-major
// buffer of row stride ldo: a "rows" plan, whose tiles are written as whole rows).
typedef struct {
  const void* a;
  int64_t lda;
  const void* b;
  int64_t ldb;
  const fo_gemm_scales* scales;
  void* out;
  int64_t ldo;
  int L, block_rows, N, K;
  const int64_t* items;
  const int32_t* item_group;
  int num_items;
  int32_t* counters;
  int num_ctas;
  uint64_t* monitor;
} fo_gemm_params;

FO_API cudaError_t fo_gemm_launch(const fo_gemm_params* params, cudaStream_t stream);
// A graph's captured fo_gemm_launch re-pointed at new parameters (checked as fo_gemm_launch
// checks them; the monitor is not re-pointed).
FO_API cudaError_t fo_gemm_set_node_params(cudaGraphExec_t exec, cudaGraphNode_t node,
                                           const fo_gemm_params* params);

// What the last failing call of this object (GEMM library or runtime) was about.
FO_API const char* fo_last_error(void);

#ifdef __cplusplus
}
#endif
