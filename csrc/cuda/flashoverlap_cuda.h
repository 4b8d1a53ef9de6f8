// C API of FlashOverlap's CUDA runtime: every function the runtime object exports is declared
// here, and every function of the GEMM libraries (one shared object per GEMM configuration) in
// gemm_api.h, which this includes (with the work items, clusters and alignment they take), but
// fp8 all_to_all's fo_gemm_run_blocks_scaled, in gemm_blocks_scaled.h, and fp8 allgather's
// fo_gemm_run_ex_scaled, in gemm_ex_scaled.h (both included too). The runtime is one object
// made of one translation unit per call kind (runtime.cu: wait, counter reset, post-reorder,
// fo_load_kernels and fo_last_error; nccl.cu; overlap_call.cu; add_rmsnorm.cu; gather_call.cu;
// all_to_all_call.cu). The GEMM libraries include gemm_api.h (and gemm_blocks_scaled.h or
// gemm_ex_scaled.h) only, so an edit here leaves their cached objects valid
// (backends/cuda/build.py hashes what each object includes).
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

#include "gemm_api.h"
#include "gemm_blocks_scaled.h"  // fo_gemm_run_blocks_scaled: fp8 all_to_all's GEMM libraries
#include "gemm_ex_scaled.h"      // fo_gemm_run_ex_scaled: fp8 allgather's GEMM libraries

#ifdef __cplusplus
extern "C" {
#endif

// Device-side wait: `stream` waits until *counter >= value.
//   mode 0: cuStreamWaitValue32 (GEQ), through the driver entry point
//   mode 1: a one-thread spin kernel (relaxed load + nanosleep), acquire fence on exit
// Both compare cyclically, like CU_STREAM_WAIT_VALUE_GEQ: (int32_t)(*counter - value) >= 0.
FO_API cudaError_t fo_wait_counter(const int32_t* counter, int32_t value, int mode, cudaStream_t stream);

// Zero `n` counters on `stream` (orders the reset after that stream's earlier work).
FO_API cudaError_t fo_reset_counters(int32_t* counters, int n, cudaStream_t stream);

// Post-communication reorder of one block: `src` holds the block's tiles back to back (in the
// order of `tiles`, each row-major at its real size); write them row-major into dst
// (row stride ldd elements). tiles: int32, 4 per tile {row0, rows, col0, cols} relative to the
// block; src_offsets: int64 element offset of each tile in src. elem_size: 2 (bf16/fp16) or 4.
FO_API cudaError_t fo_unpack_tiles(const void* src, void* dst, int64_t ldd, const int32_t* tiles,
                            const int64_t* src_offsets, int num_tiles, int elem_size,
                            cudaStream_t stream);

// ---- NCCL, reached at run time (runtime object, nccl.cu) ---------------------------------
// fo_nccl_load resolves NCCL from the libnccl.so.2 already loaded in the process (torch's), else
// from `path`. Communicators are plain ncclComm_t handles (void* here); a unique id is 128 bytes.
FO_API cudaError_t fo_nccl_load(const char* path);
FO_API cudaError_t fo_nccl_version(int* version);
FO_API cudaError_t fo_nccl_unique_id(void* id128);
FO_API cudaError_t fo_nccl_comm_init(void** comm, int nranks, const void* id128, int rank, int device);
// ncclCommInitRankConfig with at most `max_ctas` CTAs per NCCL kernel and no CTA clusters
// (NCCL >= 2.17): allgather's communicator, whose kernels must fit beside the waiting GEMM.
FO_API cudaError_t fo_nccl_comm_init_bounded(void** comm, int nranks, const void* id128, int rank,
                                             int device, int max_ctas);
FO_API cudaError_t fo_nccl_comm_destroy(void* comm);
// Work the runtime queues on `comm` from a stream being captured goes to `capture` instead (a
// communicator of the same ranks), so that neither one runs both graph replays and eager work:
// NCCL does not keep a rank's network work in order across the two (nccl.cu). capture == null:
// no twin any more.
FO_API cudaError_t fo_nccl_set_capture_comm(void* comm, void* capture);
// One whole collective on `stream` (the plain path's, on FlashOverlap's own communicator):
// kind 1 all-reduce (sum; send may equal recv), 2 reduce-scatter (sum), 3 all-gather. count:
// 1: the elements of send (= recv); 2: the elements each rank receives; 3: the elements each
// rank sends. dtype: ncclDataType_t's value. A count of 0 issues nothing.
FO_API cudaError_t fo_nccl_collective(void* comm, int kind, const void* send, void* recv,
                                      int64_t count, int dtype, cudaStream_t stream);
// The plain path's all-to-all on `stream`, one NCCL group of send/receive pairs: this rank sends
// send_counts[p] elements to rank p and receives recv_counts[p] from it (p < world), each
// rank's block contiguous in rank order in `send` and in `recv` (as all_to_all_single takes
// them). elem_bytes: the size of one element of `dtype` (ncclDataType_t's value). Peers with
// nothing either way take no part; all counts 0 issue nothing.
FO_API cudaError_t fo_nccl_all_to_all(void* comm, const void* send, const int64_t* send_counts,
                                      void* recv, const int64_t* recv_counts, int world,
                                      int dtype, int elem_bytes, cudaStream_t stream);

// The watchdog of a communicator (nccl.cu says how it works): every collective, send/receive or
// call graph queued on `comm` through the runtime is followed until it completes; past
// `timeout_s` (0: never), or on an asynchronous NCCL error, the communicator and every other one
// watched with the same `group` id are aborted (ncclCommAbort), and the runtime refuses them
// from then on (an error, never a hang). `handling`: 0 report (the caller raises at its next
// call), 1 abort then tear the process down, 2 tear it down without aborting.
typedef struct fo_nccl_watch fo_nccl_watch_t;
enum {
  FO_WATCH_OK = 0,
  FO_WATCH_TIMED_OUT = 1,      // work did not complete within the timeout
  FO_WATCH_NCCL_ERROR = 2,     // ncclCommGetAsyncError reported an error
  FO_WATCH_GROUP_FAILED = 3,   // another communicator of the same group failed
  FO_WATCH_ABORTED = 4,        // fo_nccl_watch_abort
  FO_WATCH_DEVICE_ERROR = 5,   // an event of the work reported a CUDA error
};
FO_API cudaError_t fo_nccl_watch(void* comm, int device, int64_t group, double timeout_s,
                                 int handling, fo_nccl_watch_t** out);
FO_API cudaError_t fo_nccl_watch_set_timeout(fo_nccl_watch_t* watch, double timeout_s);
// The state (FO_WATCH_*); once failed, the NCCL error (FO_WATCH_NCCL_ERROR), how long the oldest
// work had waited and why, as text.
FO_API cudaError_t fo_nccl_watch_status(fo_nccl_watch_t* watch, int* state, int* nccl_error,
                                        double* waited_s, char* reason, size_t reason_len);
// Work queued and not known to be complete (events, plus 1 while the host is inside NCCL).
FO_API cudaError_t fo_nccl_watch_pending(fo_nccl_watch_t* watch, int* pending);
// Fails the watch now (FO_WATCH_ABORTED, `why`), aborting its communicator.
FO_API cudaError_t fo_nccl_watch_abort(fo_nccl_watch_t* watch, const char* why);

// ---- a prepared overlapped call (runtime object, overlap_call.cu) -------------------------
// Everything one call of a fixed shape needs, built once (fo_call_create copies the host
// arrays); fo_call_run then issues the whole call with no host synchronisation:
//   compute: [wait for prior work of `comm_stream`'s previous call is implied by stream order]
//            the signaling GEMM (through `gemm_run`, the fo_gemm_run of its library)
//   comm:    waits for the compute stream's work before the call (event), then per collective
//            step s: a device-side wait until counters[s] >= group_sizes[s] (s < num_groups),
//            then the step's NCCL collective on its region of `packed` (into `staging`)
//   compute: waits for the communication stream (event), then the post-reorder of every block
//            from `staging` into `out`, which also zeroes the counters for the next call.
// Collective kinds: 0 none (world size 1 without a communicator: no waits, no communication
// stream; the post-reorder reads `packed`, which must then be `staging`),
// 1 allreduce (in place), 2 reduce_scatter, 3 all_to_all (grouped send/recv per peer).
// `steps`: int64, `per_step` entries of {send offset, send count, recv offset, recv count} per
// step (elements; per_step = world size for all_to_all, else 1); a step may move nothing (an
// all_to_all rank with fewer groups than a peer still takes part in the peer's step).
// A "rows" call (rows = 1; allreduce, reduce_scatter or no collective) has no post-reorder: the
// GEMM writes whole rows (row stride N); an allreduce's GEMM writes `out` and reduces it in
// place, a reduce_scatter's writes `packed` and receives into `out`; the last phase only zeroes
// the counters (fo_call_run_add_rmsnorm reads `staging` instead, which an allreduce's GEMM then
// writes and reduces in place: packed == staging).
// Unpack blocks: per block its byte offset in `out`, and device tables {row0, rows, col0, cols}
// (int32) and source offsets in `staging` (int64) of its tiles, as fo_unpack_tiles takes them.
typedef struct fo_call fo_call;
typedef struct {
  int abi_version;  // FO_CUDA_ABI_VERSION
  // the GEMM: its library's fo_gemm_launch, and the arguments that do not change between calls
  void* gemm_launch;
  int L, block_rows, N, K;
  const int64_t* items;
  const int32_t* item_group;
  int num_items, num_ctas;
  void* workspace;
  // buffers and groups
  void* packed;
  void* staging;
  int32_t* counters;
  int num_groups;
  const int32_t* group_sizes;  // host
  int wait_mode;               // as fo_wait_counter
  // the collective
  int collective;
  void* nccl_comm;
  int nccl_dtype;
  int num_steps, per_step;
  const int64_t* steps;  // host
  // post-reorder
  int num_blocks;
  const int64_t* block_out_offset;     // host, bytes
  const int32_t* const* block_tiles;   // host array of device pointers
  const int64_t* const* block_offsets; // host array of device pointers
  const int32_t* block_num_tiles;      // host
  int64_t ldo;                         // out row stride, elements
  int elem_size;
  cudaStream_t comm_stream;
  // Replay (optional): gemm_set_node is the GEMM library's fo_gemm_set_node_params. With
  // use_graph != 0 the second call captures the whole call (GEMM, waits, collectives, joins,
  // post-reorder) into a graph once, and every later call outside stream capture replays it: one
  // graph launch, plus a node update when a, b or out moved, instead of a launch per kernel, wait
  // and collective. A "rows" call whose collective works on `out` keeps a graph per out (of
  // its last 8 outs), and captures one for an out none holds: a collective is never launched
  // from a graph on one rank and launch by launch on another (NCCL's rule).
  void* gemm_set_node;
  int use_graph;
  // fp8 (issue 23): scaled = 1 for an e4m3 GEMM library, whose calls then go through
  // fo_call_run_scaled with their scale_a and scale_b, laid out as below (a graph's GEMM node
  // is re-pointed when they move, like a and b).
  int scaled;
  int scale_a_per_row, scale_b_per_col;
  int rows;  // a "rows" plan (see above)
  // Appended (issue 32): block-wise scales' element strides (fo_gemm_scales), fixed per call
  int64_t scale_a_stride[2], scale_b_stride[2];
} fo_call_desc;

FO_API cudaError_t fo_call_create(const fo_call_desc* desc, fo_call** call);
// One call. `warm` != 0: synchronise after each phase (a call's first run: every kernel it
// launches, NCCL's too, is loaded while the device is idle; see GPU-FACTS on lazy loading).
// a and b as fo_gemm_run takes them (lda, ldb: elements between their stored rows).
FO_API cudaError_t fo_call_run(fo_call* call, const void* a, int64_t lda, const void* b,
                               int64_t ldb, void* out, cudaStream_t stream, int warm);
// fo_call_run of a call whose descriptor has gemm_run_scaled (fp8): scale_a and scale_b are
// float32 device pointers laid out as the descriptor says.
FO_API cudaError_t fo_call_run_scaled(fo_call* call, const void* a, int64_t lda, const void* b,
                                      int64_t ldb, const float* scale_a, const float* scale_b,
                                      void* out, cudaStream_t stream, int warm);
FO_API void fo_call_destroy(fo_call* call);
// How the call runs now: 0 launch by launch, 1 replaying its graph, -1 its graph could not be
// made (a call without a collective then runs launch by launch; fo_last_error said why when it
// failed). A call with a collective whose graph cannot be captured fails instead, and captures
// again at its next call.
FO_API int fo_call_graph_state(const fo_call* call);
// How many graphs of the call's main phase it holds (a "rows" call with a collective: one per
// out of its last 8; else at most 1).
FO_API int fo_call_graphs_held(const fo_call* call);

// ---- the post-reorder fused into residual add + RMSNorm (runtime object, add_rmsnorm.cu) ----
// fo.overlap_add_rmsnorm: residual_out = residual + result, normed = residual_out *
// rsqrt(mean(residual_out^2) + eps) * weight (float32 math on the unrounded sum), written in one
// pass that reads the received tiles and the residual once (one CTA per row).
// The result's rows come from `src` through a table of bands: band_offsets[b * col_tiles + j]
// (int64, device, col_tiles = ceil(N / tile_n)) is the element offset in src of the tile of rows
// [b * tile_m, ...) and columns [j * tile_n, ...), stored row-major at its real size
// (flashoverlap_core/reorder.py, band_offsets). With N and tile_n multiples of 8 every offset
// must be a multiple of 8 too (true of tiles stored back to back).
// dtype: 0 bf16, 1 fp16 (src, residual, normed, residual_out); weight_dtype: 0 the same,
// 1 float32. Strides in elements. 16-byte accesses where N, tile_n and the strides are multiples
// of 8 and the pointers 16-byte aligned; element accesses otherwise.
FO_API cudaError_t fo_add_rmsnorm_tiles(const void* src, const int64_t* band_offsets, int rows,
                                        int N, int tile_m, int tile_n, int dtype,
                                        const void* residual, int64_t ld_residual,
                                        const void* weight, int weight_dtype, float eps,
                                        void* normed, void* residual_out, int64_t ld_out,
                                        cudaStream_t stream);
// A prepared call's fused form (overlap_call.cu: the call's last phase). fo_call_set_add_rmsnorm
// gives a call that writes one block of rows (allreduce, reduce_scatter) the band table of that
// block in its staging buffer (the call keeps the device pointer); fo_call_run_add_rmsnorm is
// fo_call_run with the fused kernel in place of the post-reorder (it zeroes the counters
// likewise). With use_graph it replays a graph of its own, captured on its first call outside
// stream capture (or its second, when the first is `warm`), re-pointed when a, b, residual,
// weight, the outputs or eps change.
FO_API cudaError_t fo_call_set_add_rmsnorm(fo_call* call, const int64_t* band_offsets, int rows,
                                           int tile_m, int tile_n, int dtype);
FO_API cudaError_t fo_call_run_add_rmsnorm(fo_call* call, const void* a, int64_t lda,
                                           const void* b, int64_t ldb, const void* residual,
                                           int64_t ld_residual, const void* weight,
                                           int weight_dtype, float eps, void* normed,
                                           void* residual_out, int64_t ld_out,
                                           cudaStream_t stream, int warm);
// As fo_call_graph_state, for the calls of fo_call_run_add_rmsnorm.
FO_API int fo_call_add_rmsnorm_graph_state(const fo_call* call);

// ---- allgather: a gather that feeds a waiting GEMM (runtime object, gather_call.cu) ----------
// A prepared allgather call of rank `rank` of `world`: every rank's a is [block_rows, copy_cols];
// `gathered` is [world * block_rows, ldg] row-major (rows s * block_rows .. of rank s, so a row of
// gathered is the same row of out). fo_gather_run issues, with no host synchronisation:
//   compute: copies this rank's rows from a into gathered (one 2-D device copy)
//   comm:    waits for that (event); per chunk g (rows chunk_rows[2g] .. chunk_rows[2g+1] of
//            every shard), one NCCL group of a send of this rank's rows of g to every peer and a
//            receive of every peer's, then flags (p, g) of the peers
//   compute: the GEMM (fo_gemm_run_ex of `gemm_run_ex`) on gathered, writing out in place, each
//            item waiting for its flag (item_wait, read from `wait_flags`); then a wait for the
//            communication stream and the flags' reset to zero (so graph replays and
//            back-to-back calls start from zero).
// own_chunks = 1 (the loopback test) copies the own rows chunk by chunk on the communication
// stream instead, each chunk then setting flag (rank, g).
// Flag (s, g) is arrive_flags[s * num_chunks + g]. `wait_flags` is arrive_flags, except in the
// negative-control test (flags read as already set). `delay_us` > 0 (tests, with own_chunks)
// spins that long on the communication stream before each own-chunk copy. With
// nccl_comm == nullptr, world must be 1 (a loopback of the own rows, no NCCL).
// fp8 (issue 32): scaled = 1 for e4m3 a and b, whose rows move as their bytes (elem_size 1,
// nccl_dtype a byte type), whose GEMM is `gemm_run_ex_scaled` (the fo_gemm_run_ex_scaled of an
// e4m3 library built for allgather; gemm_ex_scaled.h) and whose calls go through
// fo_gather_run_scaled with their scales. Rank s's scale_a scales rank s's rows, so it travels
// with them: `gathered_scales` is float32 [world * block_rows, G] row-major (row r: the scale_a
// of gathered row r; G = 1, or ceil(copy_cols / 128) block-wise), into which each call copies
// this rank's scale_a on the compute stream (a 0-dim one repeated on each of its rows: tensor-wise
// scales run as row-wise ones, so every kind moves alike) and, at world > 1, receives every
// peer's in one NCCL group on the communication stream before the chunks, which the GEMM waits
// for: the kernel reads an item's scales without waiting for its flag (gemm_ex_scaled.h).
// scale_a_per_row: the GEMM's mode of the gathered scale_a, 1 (per row) or FO_SCALE_BLOCKS
// (block-wise); scale_b_per_col: scale_b's (0 one float, 1 per column of the result, or
// FO_SCALE_BLOCKS with a block-wise scale_a), as fo_gemm_scales takes them.
typedef struct fo_gather fo_gather;
typedef struct {
  int abi_version;  // FO_CUDA_ABI_VERSION
  void* gemm_run_ex;
  int world, rank, block_rows, N, K;  // K as the kernel takes it (>= copy_cols)
  int copy_cols;
  const int64_t* items;
  const int32_t* item_group;
  const int32_t* item_wait;
  int num_items, num_ctas;
  void* workspace;
  void* gathered;
  int64_t ldg;
  uint32_t* arrive_flags;
  const uint32_t* wait_flags;
  int num_chunks;
  const int32_t* chunk_rows;  // host, 2 per chunk
  int elem_size;
  void* nccl_comm;
  int nccl_dtype;
  int delay_us;
  int own_chunks;
  cudaStream_t comm_stream;
  // Appended (issue 32): fp8 (see above); gemm_run_ex may then be null
  void* gemm_run_ex_scaled;
  int scaled;
  int scale_a_per_row, scale_b_per_col;
  float* gathered_scales;
} fo_gather_desc;

FO_API cudaError_t fo_gather_create(const fo_gather_desc* desc, fo_gather** gather);
// One call; `warm` != 0: the communication side first, to the end, then the GEMM, with a
// synchronisation after each (the first call: every kernel it uses is loaded on an idle device).
FO_API cudaError_t fo_gather_run(fo_gather* gather, const void* a, int64_t lda, const void* b,
                                 int64_t ldb, void* out, int64_t ldo, cudaStream_t stream, int warm);
// fo_gather_run of a call made with scaled = 1 (fp8): scale_a and scale_b are this call's float32
// device pointers. scale_a is this rank's, read through its element strides scale_strides[0]
// (rows) and scale_strides[1] (groups of 128 k, block-wise): a 0-dim one {0, 0}, row-wise
// [block_rows, 1], block-wise [block_rows, ceil(K/128)] in any layout (torch's outer-dim-major
// too); scale_b is the same on every rank, laid out as scale_b_per_col says (block-wise
// [ceil(K/128), ceil(N/128)] through scale_strides[2] and [3]).
FO_API cudaError_t fo_gather_run_scaled(fo_gather* gather, const void* a, int64_t lda,
                                        const void* b, int64_t ldb, const float* scale_a,
                                        const float* scale_b, const int64_t* scale_strides,
                                        void* out, int64_t ldo, cudaStream_t stream, int warm);
FO_API void fo_gather_destroy(fo_gather* gather);
// Force-loads the kernels only fo_gather_run launches (the tests' delay kernel, and
// fo_gather_run_scaled's copy of this rank's scales).
FO_API cudaError_t fo_gather_load_kernels(void);

// ---- all_to_all with each call's rows and splits (runtime object, all_to_all_call.cu) --------
// Expert parallelism: every call has its own rows M and splits, on every rank. Created once per
// shared layout (tile, tile order, N, K, groups, world, layout); fo_a2a_run then lays out and
// issues one call: on `stream` a table kernel (work items, block starts, post-reorder tiles,
// from the splits), the signaling GEMM over the unequal destination blocks (`gemm_run_blocks`,
// the fo_gemm_run_blocks of a GEMM library built with FO_BLOCKS=1 and 1x1 clusters: the items
// of a round need not share operands); on `comm_stream` per group a device-side wait for its
// tiles and one NCCL group of sends and receives (the plan's "destinations" grouping: group g
// takes chunk g of every destination block, so both sides count each part from the rows
// alone); back on `stream` the post-reorder into `out`, which zeroes the counters. Without a
// communicator (world size 1) there are no waits, no counters and no staging: the
// post-reorder reads packed.
// rows = 1 (layout "rows", raster "n"; a2a_layout.cuh): chunks are whole strips of bands, the
// GEMM writes each tile at its final row of the row-major product (`packed`, [M, N]; at world
// size 1 `out` itself), the sends read the product's rows and the receives land in `out`'s
// final rows: no staging buffer, no post-reorder tables and no post-reorder (the last phase
// only zeroes the counters).
// fp8 (issue 32): scaled = 1 for e4m3 a and b, whose GEMM is `gemm_run_blocks_scaled` (the
// fo_gemm_run_blocks_scaled of an e4m3 library built with FO_BLOCKS=1; gemm_blocks_scaled.h)
// and whose calls go through fo_a2a_run_scaled with their scales, laid out as
// scale_a_per_row and scale_b_per_col say (fo_gemm_scales' modes: 0 one float, 1 per row of a /
// column of the result, both FO_SCALE_BLOCKS block-wise, with each call's strides). What the
// buffers hold and NCCL moves is the result (nccl_dtype and elem_size are the out dtype's).
typedef struct {
  int abi_version;  // FO_CUDA_ABI_VERSION
  void* gemm_run_blocks;
  int tile_m, tile_n, N;
  int raster_m;     // tile order inside a block: 0 raster "n", 1 raster "m"
  int swizzle;
  int groups;       // <= 16
  int world, rank;  // world <= 64
  int K, num_ctas;
  int wait_mode;    // as fo_wait_counter
  void* nccl_comm;  // null only at world size 1
  int nccl_dtype, elem_size;
  cudaStream_t comm_stream;
  int rows;         // 1: layout "rows" (see above), 0: "tiles"
  // Appended (issue 32): fp8 (see above); gemm_run_blocks may then be null
  void* gemm_run_blocks_scaled;
  int scaled;
  int scale_a_per_row, scale_b_per_col;
} fo_a2a_desc;

// The caller's device buffers, and what they hold (set again when the caller grows them).
typedef struct {
  int64_t* items;          // tile_capacity x 4
  int32_t* item_group;     // tile_capacity
  int32_t* block_starts;   // world + 1
  int32_t* unpack_tiles;   // unpack_capacity x 4
  int64_t* unpack_offsets; // unpack_capacity
  int tile_capacity, unpack_capacity;
  void* packed;            // packed_numel elements ("rows": the row-major product, only
                           // with a communicator)
  void* staging;           // staging_numel elements (with a communicator; "tiles" only)
  int64_t packed_numel, staging_numel;
  int32_t* counters;       // groups (with a communicator); zero before the first call
} fo_a2a_buffers;

typedef struct fo_a2a fo_a2a;
FO_API cudaError_t fo_a2a_create(const fo_a2a_desc* desc, fo_a2a** call);
FO_API cudaError_t fo_a2a_set_buffers(fo_a2a* call, const fo_a2a_buffers* buffers);
// One call: a is [M, K] (lda), this rank sends send_rows[r] rows of a @ b to rank r and receives
// recv_rows[r] from it into out ([sum recv_rows, N] row-major). needs (4 int64) gets the call's
// work items, received tiles, packed and staging elements (a "rows" call: no received tiles and
// no staging; packed only with a communicator); when the buffers hold less, nothing is
// issued and the error is cudaErrorMemoryAllocation: grow them (fo_a2a_set_buffers) and call
// again. `warm` != 0: a host sync after each phase (the first call loads every kernel).
FO_API cudaError_t fo_a2a_run(fo_a2a* call, const void* a, int64_t lda, const void* b, int64_t ldb,
                              void* out, int M, const int32_t* send_rows, const int32_t* recv_rows,
                              cudaStream_t stream, int warm, int64_t* needs);
// fo_a2a_run of a call made with scaled = 1 (fp8): scale_a and scale_b are this call's float32
// device pointers, laid out as the descriptor's modes say (row-wise scale_a: one per row of this
// call's a; block-wise: [M, ceil(K/128)] and [ceil(K/128), ceil(N/128)]); scale_strides: their
// element strides {scale_a's 2, scale_b's 2} (block-wise only, which then needs them: scale_a's
// change with each call's rows in torch's outer-dim-major layout; null otherwise). With no rows
// to send (M = 0), a and the scales may be null.
FO_API cudaError_t fo_a2a_run_scaled(fo_a2a* call, const void* a, int64_t lda, const void* b,
                                     int64_t ldb, const float* scale_a, const float* scale_b,
                                     const int64_t* scale_strides, void* out, int M,
                                     const int32_t* send_rows, const int32_t* recv_rows,
                                     cudaStream_t stream, int warm, int64_t* needs);
FO_API void fo_a2a_destroy(fo_a2a* call);

#ifdef __cplusplus
}
#endif
