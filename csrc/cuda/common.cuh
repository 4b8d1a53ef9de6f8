// Pieces shared by every FlashOverlap CUDA library: error reporting on the host, and on the
// device the work-item decoding and the signal (release add on a group counter).
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

#include <cstdarg>
#include <cstdlib>
#include <cstdio>
#include <string>

#include "gemm_api.h"

namespace fo {

// ---- host: errors ------------------------------------------------------------------------

inline std::string& last_error_text() {
  static thread_local std::string text;
  return text;
}

// Records a message for fo_last_error() and returns `code`.
inline cudaError_t fail(cudaError_t code, const char* fmt, ...) {
  char buf[1024];
  va_list args;
  va_start(args, fmt);
  vsnprintf(buf, sizeof(buf), fmt, args);
  va_end(args);
  last_error_text() = buf;
  return code;
}

#define FO_CUDA_CHECK(expr)                                                                \
  do {                                                                                     \
    cudaError_t fo_err_ = (expr);                                                          \
    if (fo_err_ != cudaSuccess)                                                            \
      return ::fo::fail(fo_err_, "%s (%s:%d): %s", #expr, __FILE__, __LINE__,             \
                        cudaGetErrorString(fo_err_));                                      \
  } while (0)

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// Common argument checks of fo_gemm_run; returns cudaSuccess or an explained error.
inline cudaError_t check_gemm_args(const void* a, const void* b, const void* packed, int L,
                                   int block_rows, int N, int K, int64_t lda, int64_t ldb,
                                   bool b_col_major, const void* items, const void* item_group,
                                   int num_items, int num_ctas,
                                   int cta_multiple, int elem_bytes = 2) {
  const int align = 16 / elem_bytes;  // elements in 16 bytes (TMA, cp.async vectors)
  if (L < 1 || block_rows < 1 || N < 1 || K < 1)
    return fail(cudaErrorInvalidValue, "fo_gemm_run: L=%d, block_rows=%d, N=%d, K=%d must all be >= 1",
                L, block_rows, N, K);
  if (int64_t(L) * block_rows > INT32_MAX)
    return fail(cudaErrorInvalidValue, "fo_gemm_run: M = L * block_rows = %lld exceeds 2^31-1",
                (long long)L * block_rows);
  if (!a || !b || !packed || !items || !item_group)
    return fail(cudaErrorInvalidValue,
                "fo_gemm_run: a, b, packed, items and item_group must be non-null");
  if (num_items < 0) return fail(cudaErrorInvalidValue, "fo_gemm_run: num_items=%d < 0", num_items);
  if (num_ctas < 1 || num_ctas % cta_multiple)
    return fail(cudaErrorInvalidValue,
                "fo_gemm_run: num_ctas=%d must be a positive multiple of the cluster size %d",
                num_ctas, cta_multiple);
  if (!aligned16(a) || !aligned16(b))
    return fail(cudaErrorInvalidValue,
                "fo_gemm_run: a and b must be 16-byte aligned (a=%p, b=%p); copy them to fresh "
                "tensors", a, b);
  const int64_t b_row = b_col_major ? K : N;  // elements in one stored row of b
  if (lda < K || lda % align)
    return fail(cudaErrorInvalidValue,
                "fo_gemm_run: lda=%lld must be >= K=%d and a multiple of %d elements (16 bytes); "
                "pad a's rows (K) to a multiple of %d", (long long)lda, K, align, align);
  if (ldb < b_row || ldb % align)
    return fail(cudaErrorInvalidValue,
                "fo_gemm_run: ldb=%lld must be >= %lld and a multiple of %d elements (16 bytes); "
                "pad b's rows to a multiple of %d", (long long)ldb, (long long)b_row, align, align);
  return cudaSuccess;
}

// Loads a kernel (so that no launch of it waits for module loading) and sets its dynamic
// shared-memory limit, once per device (both are per context).
template <class Kernel>
inline cudaError_t prepare_kernel_once(Kernel kernel, int smem_bytes) {
  static bool done[64] = {};
  int device = 0;
  FO_CUDA_CHECK(cudaGetDevice(&device));
  if (device < 64 && done[device]) return cudaSuccess;
  cudaFuncAttributes attr;
  FO_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  FO_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  if (device < 64) done[device] = true;
  return cudaSuccess;
}

// ---- device: work items ------------------------------------------------------------------

// One output tile of the plan (see flashoverlap_cuda.h, "Work items").
struct WorkTile {
  int64_t offset;  // element offset of the tile in the packed buffer (or in the row-major out)
  int row0, rows;  // rows of c (and a) that the tile covers
  int col0, cols;  // columns of c
  int n_blk;       // column tile index (col0 / BN)
  int block;       // destination block (allgather: source shard) l
  int group;       // wave group whose counter the tile bumps
  bool valid;      // false for a cluster's filler item past the end of the table
};

struct ItemTable {
  const int64_t* items;
  const int32_t* item_group;
  int num_items;
  int block_rows;  // rows per destination block; L blocks
  int L;
  int M, N;  // M = L * block_rows, or the last of block_starts
  int64_t packed_numel;
  int64_t ldo;  // 0: tiles packed (row stride = their width); else the row stride of a
                // row-major [M, ldo] output that the tiles are written into in place
  const int32_t* block_starts;  // null: L blocks of block_rows rows; else block l is rows
                                // [block_starts[l], block_starts[l + 1]) (unequal blocks:
                                // all_to_all with each call's own splits)
};

// A malformed table stops the kernel (a host build of the decoding, for its tests, aborts).
__host__ __device__ inline void trap_bad_item() {
#ifdef __CUDA_ARCH__
  __trap();
#else
  std::abort();
#endif
}

// Decodes item i. With Checked, traps on an item that lies outside the matrix or the packed
// buffer; without, the loads do not block until the fields are used (a kernel's math threads
// decode the next item before its mainloop and use it only in the epilogue). Blocks (builds
// with FO_BLOCKS=1, for all_to_all's unequal destination blocks): block l is rows
// [block_starts[l], block_starts[l + 1]) when the table has block_starts; other builds compile
// the decoding of L equal blocks alone (the branch costs the producer warps, which run on 40
// registers, spills). Host-callable for the tests (tests/native/decode_items_main.cu).
template <int BM, int BN, bool Checked = true, bool Blocks = false>
__host__ __device__ inline WorkTile decode_item(const ItemTable& t, int64_t i) {
  const int64_t* it = t.items + 4 * i;
  int64_t l = it[0], m_blk = it[1], n_blk = it[2], offset = it[3];
  WorkTile w;
  int block_start = 0, block_rows = t.block_rows;
  if constexpr (Blocks) {
    if (Checked && (l < 0 || l >= t.L)) trap_bad_item();  // before block_starts is read at l
    block_start = int(l) * t.block_rows;  // 32-bit rows: M < 2^31 (checked on the host)
    if (t.block_starts != nullptr)
      block_start = t.block_starts[l], block_rows = t.block_starts[l + 1] - block_start;
    w.row0 = block_start + int(m_blk) * BM;
  } else {
    w.row0 = int(l * t.block_rows + m_blk * BM);
  }
  w.rows = min(BM, int(block_rows - m_blk * BM));
  w.col0 = int(n_blk * BN);
  w.cols = min(BN, int(t.N - n_blk * BN));
  w.n_blk = int(n_blk);
  w.block = int(l);
  w.offset = offset;
  w.group = t.item_group[i];
  w.valid = true;
  if constexpr (Checked) {
    const int64_t end = t.ldo ? offset + int64_t(w.rows - 1) * t.ldo + w.cols
                              : offset + int64_t(w.rows) * w.cols;
    bool ok = l >= 0 && l < t.L && m_blk >= 0 && m_blk * BM < block_rows && n_blk >= 0 &&
              n_blk * BN < t.N && offset >= 0 && end <= t.packed_numel && w.group >= 0;
    if constexpr (Blocks) ok = ok && block_start >= 0 && block_start + block_rows <= t.M;
    if (!ok) trap_bad_item();
  }
  return w;
}

// ---- device: arrival waits (allgather: the GEMM consumes rows that a transfer brings) ------

// Spins until `*flag` != 0, with an acquire load at GPU scope, so that whatever the writer
// made visible before setting the flag (a stream write-value after a copy or an NCCL receive,
// which orders the stream's earlier writes before it) is visible to this thread's later
// generic-proxy loads. The backoff keeps the spinning threads off the memory system.
__device__ inline void wait_flag(const uint32_t* flag) {
  uint32_t v, sleep_ns = 32;
  while (true) {
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(flag) : "memory");
    if (v != 0) return;
    __nanosleep(sleep_ns);
    sleep_ns = sleep_ns < 1024 ? 2 * sleep_ns : 1024;
  }
}

// Item i's arrival wait: item_wait[i] is the index of the flag its A rows need (-1: none).
// Traps on an index outside the flag array.
__device__ inline void wait_item_rows(const int32_t* item_wait, const uint32_t* flags,
                                      int num_flags, int64_t i) {
  const int32_t f = item_wait[i];
  if (f < 0) return;
  if (f >= num_flags) __trap();
  wait_flag(flags + f);
}

// ---- device: signal and monitor ----------------------------------------------------------

// Adds 1 to a group counter with release semantics at GPU scope. Called by one thread after it
// synchronized (barrier, or mbarrier arrive/wait) with all the threads that stored the tile, so
// (cumulativity) every one of those stores is visible to whoever observes the new counter value
// with acquire.
__device__ inline void signal_counter(int32_t* counter) {
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(counter) : "memory");
}

__device__ inline uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ inline uint32_t sm_id() {
  uint32_t s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return s;
}

// Monitor record of item i: {%globaltimer at the signal, (smid << 32) | cta}.
__device__ inline void record_monitor(uint64_t* monitor, int64_t i, int cta) {
  if (monitor == nullptr) return;
  monitor[2 * i] = global_timer_ns();
  monitor[2 * i + 1] = (uint64_t(sm_id()) << 32) | uint32_t(cta);
}

}  // namespace fo
