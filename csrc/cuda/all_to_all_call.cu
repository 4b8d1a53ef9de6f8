// all_to_all for expert parallelism (fo_a2a_* in flashoverlap_cuda.h): each call's rows and
// splits are its own, so nothing of its layout is prepared. One native function per call
//   host:    the two sides of the layout (a2a_layout.cuh: what this rank sends each peer in each
//            group, what it receives from each), O(groups x world) closed forms;
//   compute: a table kernel that writes the GEMM's work items, the blocks' row starts and the
//            post-reorder's tiles (the same closed forms, one thread per tile); the signaling
//            GEMM over the unequal destination blocks (fo_gemm_run_blocks);
//   comm:    per group, a device-side wait for its tiles, then one NCCL group of a send to and
//            a receive from every peer with rows in that group;
//   compute: waits for the communication stream; the post-reorder of every received tile,
//            which also zeroes the counters.
// Layout "rows" (desc.rows): the GEMM writes each tile at its final row of the row-major
// product (the packed buffer as [M, N]; at world size 1 `out` itself, and the call ends
// there), the sends read the product's rows and the receives land in `out`'s final rows; the
// table kernel writes no post-reorder tiles, there is no staging buffer, and the last phase
// only zeroes the counters.
// fp8 (desc.scaled, fo_a2a_run_scaled): the GEMM is fo_gemm_run_blocks_scaled with each call's
// scales (a row's scale is that of its row of a, whatever block it goes to); everything after
// it moves the result (out dtype), as for 16-bit calls.
// No host synchronisation and no per-call allocation: the buffers belong to the caller, who
// grows them when a call reports that they are too small (fo_a2a_run's `needs`).
// One translation unit of the runtime object.
#include "a2a_layout.cuh"
#include "call_skeleton.cuh"
#include "nccl_loader.cuh"
#include "runtime.cuh"

namespace fo::runtime {

struct A2aTablesArgs {
  a2a::Geometry geo;
  int world;
  int send_rows[a2a::kMaxRanks];
  int recv_rows[a2a::kMaxRanks];
  int send_tiles, recv_tiles;
  int64_t* items;         // [send_tiles][4]: block, band, column tile, packed offset
  int32_t* item_group;    // [send_tiles]
  int32_t* block_starts;  // [world + 1]
  int32_t* unpack_tiles;  // [recv_tiles][4]: row0 (of out), rows, col0, cols
  int64_t* unpack_offsets;  // [recv_tiles]: staging offset
};

constexpr int kTableThreads = 256;

// One side of the layout in shared memory, made by the whole CTA: block starts and chunk
// bounds (one thread), the parts' sizes (one thread per (group, block)), their scan (one).
__device__ inline void build_side(const a2a::Geometry& g, const int* rows, int world, a2a::Side& s) {
  if (threadIdx.x == 0) {
    s.world = world;
    for (int d = 0; d < world; ++d) s.rows[d] = rows[d];
    a2a::side_starts(g, s);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < g.groups * world; i += blockDim.x) a2a::part_size(g, s, i / world, i % world);
  __syncthreads();
  if (threadIdx.x == 0) a2a::side_scan(g, s);
  __syncthreads();
}

// The same side of a "rows" call, with no loop of one thread over the blocks or groups (such
// loops, the CTA waiting at a barrier behind them, were most of the kernel's time): a thread per
// (group, block) for the chunk bounds, one warp's scan of the blocks' starts (world <= 64: two
// per lane), a thread per (group, block) for the parts (their rows' first element: no scan) and
// per group for its first item (the chunk starts of group 0 are 0, so the sum of group g's).
__device__ inline void build_rows_side(const a2a::Geometry& g, const int* rows, int world,
                                       a2a::Side& s) {
  static_assert(a2a::kMaxRanks <= 64, "the scan below takes two blocks per lane of one warp");
  for (int i = threadIdx.x; i < (g.groups + 1) * world; i += blockDim.x) {
    const int gr = i / world, d = i % world;
    const a2a::Block b = a2a::block_of(g, rows[d]);
    s.lo[gr][d] = a2a::chunk_start(g, b, gr);
    if (gr == 0) s.rows[d] = b.rows, s.tile_start[d + 1] = b.tiles, s.row_start[d + 1] = b.rows;
  }
  if (threadIdx.x == 0) s.world = world, s.tile_start[0] = 0, s.row_start[0] = 0;
  __syncthreads();
  if (threadIdx.x < 32) {  // counts to starts: an inclusive scan over the blocks
    const int lane = threadIdx.x, first = 2 * lane + 1;
    const int t0 = first < world + 1 ? s.tile_start[first] : 0;
    const int t1 = first + 1 < world + 1 ? s.tile_start[first + 1] : 0;
    const int r0 = first < world + 1 ? s.row_start[first] : 0;
    const int r1 = first + 1 < world + 1 ? s.row_start[first + 1] : 0;
    int tiles = t0 + t1, rows_sum = r0 + r1;
    for (int o = 1; o < 32; o <<= 1) {
      const int t = __shfl_up_sync(0xffffffffu, tiles, o), r = __shfl_up_sync(0xffffffffu, rows_sum, o);
      if (lane >= o) tiles += t, rows_sum += r;
    }
    if (first < world + 1) s.tile_start[first] = tiles - t1, s.row_start[first] = rows_sum - r1;
    if (first + 1 < world + 1) s.tile_start[first + 1] = tiles, s.row_start[first + 1] = rows_sum;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < g.groups * world; i += blockDim.x) {
    const int gr = i / world, d = i % world;
    const a2a::Block b = a2a::block_of(g, s.rows[d]);
    s.part[gr][d] = int64_t(s.row_start[d] + a2a::band_row(g, b, s.lo[gr][d])) * g.n;
  }
  for (int gr = threadIdx.x; gr <= g.groups; gr += blockDim.x) {
    int items = 0;
    for (int d = 0; d < world; ++d) items += s.lo[gr][d];
    s.item_start[gr] = items;
  }
  __syncthreads();
}

__global__ void __launch_bounds__(kTableThreads) a2a_tables(const __grid_constant__ A2aTablesArgs p) {
  __shared__ a2a::Side send, recv;
  if (p.geo.rows)
    build_rows_side(p.geo, p.send_rows, p.world, send);
  else
    build_side(p.geo, p.send_rows, p.world, send);
  if (p.recv_tiles > 0) build_side(p.geo, p.recv_rows, p.world, recv);  // "rows": none
  if (blockIdx.x == 0)
    for (int d = threadIdx.x; d <= p.world; d += blockDim.x) p.block_starts[d] = send.row_start[d];
  const int total = p.send_tiles + p.recv_tiles;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
    if (i < p.send_tiles)
      a2a::write_item(p.geo, send, i, p.items, p.item_group);
    else
      a2a::write_unpack(p.geo, recv, i - p.send_tiles, p.unpack_tiles, p.unpack_offsets);
  }
}

cudaError_t load_a2a_kernels() {
  cudaFuncAttributes attr;
  FO_CUDA_CHECK(cudaFuncGetAttributes(&attr, a2a_tables));
  return cudaSuccess;
}

}  // namespace fo::runtime

// fo_a2a_create fills every field of the layout from the descriptor (the layout flag included).
static_assert(sizeof(fo::a2a::Geometry) == 7 * sizeof(int), "a new layout field: set it in fo_a2a_create");

struct fo_a2a {
  fo_a2a_desc d;
  fo::a2a::Geometry geo;
  fo_a2a_buffers buf = {};
  fo::runtime::CallEvents events;
  fo::a2a::Side send, recv;  // this call's layout (host scratch)
};

namespace fo::runtime {

inline cudaError_t check_a2a_desc(const fo_a2a_desc& d) {
  if (d.abi_version != FO_CUDA_ABI_VERSION)
    return fail(cudaErrorInvalidValue, "fo_a2a_create: descriptor ABI %d, library ABI %d",
                d.abi_version, FO_CUDA_ABI_VERSION);
  if (!(d.scaled ? d.gemm_run_blocks_scaled : d.gemm_run_blocks) || d.world < 1 ||
      d.world > a2a::kMaxRanks || d.rank < 0 ||
      d.rank >= d.world || d.tile_m < 1 || d.tile_n < 1 || d.N < 1 || d.swizzle < 1 ||
      (d.raster_m != 0 && d.raster_m != 1) || d.groups < 1 || d.groups > a2a::kMaxGroups ||
      d.K < 1 || d.num_ctas < 1 || (d.rows != 0 && d.rows != 1))
    return fail(cudaErrorInvalidValue,
                "fo_a2a_create: need the GEMM (gemm_run_blocks, or with scaled = 1 "
                "gemm_run_blocks_scaled), 1 <= world <= %d, a rank in it, a tile, N, K, "
                "swizzle and CTAs >= 1, raster 0 or 1, 1 <= groups <= %d and rows 0 or 1 (got "
                "world %d, rank %d, tile %dx%d, N %d, K %d, swizzle %d, raster %d, groups %d, "
                "CTAs %d, rows %d)",
                a2a::kMaxRanks, a2a::kMaxGroups, d.world, d.rank, d.tile_m, d.tile_n, d.N, d.K,
                d.swizzle, d.raster_m, d.groups, d.num_ctas, d.rows);
  if (d.rows && d.raster_m)
    return fail(cudaErrorInvalidValue,
                "fo_a2a_create: the 'rows' layout needs raster \"n\" (its groups are whole strips "
                "of bands only in that tile order)");
  if (d.nccl_comm && (!nccl::loaded() || !d.comm_stream))
    return fail(cudaErrorInvalidValue,
                "fo_a2a_create: a communicator needs NCCL loaded (fo_nccl_load) and a "
                "communication stream");
  if (!d.nccl_comm && d.world != 1)
    return fail(cudaErrorInvalidValue, "fo_a2a_create: world size %d needs a communicator", d.world);
  if (d.wait_mode != 0 && d.wait_mode != 1)
    return fail(cudaErrorInvalidValue, "fo_a2a_create: wait_mode %d is not 0 or 1", d.wait_mode);
  if (d.elem_size != 2 && d.elem_size != 4)
    return fail(cudaErrorInvalidValue, "fo_a2a_create: elem_size %d is not 2 or 4", d.elem_size);
  const bool block_wise = d.scale_a_per_row == FO_SCALE_BLOCKS || d.scale_b_per_col == FO_SCALE_BLOCKS;
  if ((d.scaled != 0 && d.scaled != 1) ||
      (d.scaled && (block_wise ? d.scale_a_per_row != d.scale_b_per_col
                               : (d.scale_a_per_row != 0 && d.scale_a_per_row != 1) ||
                                     (d.scale_b_per_col != 0 && d.scale_b_per_col != 1))))
    return fail(cudaErrorInvalidValue,
                "fo_a2a_create: scaled must be 0 or 1, and a scaled call's scale_a_per_row and "
                "scale_b_per_col each 0 or 1, or both FO_SCALE_BLOCKS (%d) (got scaled %d, "
                "modes %d and %d)", FO_SCALE_BLOCKS, d.scaled, d.scale_a_per_row,
                d.scale_b_per_col);
  return cudaSuccess;
}

// Group g's sends and receives on the communication stream: one NCCL group, nothing when this
// rank has no rows to move in it (each peer then has none to move with it either: both count
// by the same rule from the same rows). The parts are offsets into the packed buffer and the
// staging buffer ("tiles"), or into the row-major product and `out` ("rows").
inline cudaError_t a2a_step(const fo_a2a& c, int g, void* out) {
  const fo_a2a_desc& d = c.d;
  const a2a::Geometry& geo = c.geo;
  const int64_t es = d.elem_size;
  char* packed = static_cast<char*>(c.buf.packed);
  char* staging = static_cast<char*>(geo.rows ? out : c.buf.staging);
  return nccl::send_recv_step(d.world, d.nccl_dtype, static_cast<nccl::Comm>(d.nccl_comm),
                              d.comm_stream, [&](int peer, nccl::PeerTransfer* t) {
                                const int64_t sent = a2a::part_numel(geo, c.send, g, peer);
                                const int64_t got = a2a::part_numel(geo, c.recv, g, peer);
                                *t = {packed + c.send.part[g][peer] * es, sent,
                                      staging + c.recv.part[g][peer] * es, got};
                                return sent != 0 || got != 0;
                              });
}

// One call; `scales`: an fp8 call's (the descriptor's modes, this call's pointers and strides),
// null for a 16-bit one.
inline cudaError_t run_a2a(fo_a2a& c, const void* a, int64_t lda, const void* b, int64_t ldb,
                           const fo_gemm_scales* scales, void* out, int M,
                           const int32_t* send_rows, const int32_t* recv_rows,
                           cudaStream_t stream, bool warm, int64_t* needs) {
  const fo_a2a_desc& d = c.d;
  const a2a::Geometry& geo = c.geo;
  const bool communicate = d.nccl_comm != nullptr;
  int64_t sent = 0;
  for (int r = 0; r < d.world; ++r) {
    if (send_rows[r] < 0 || recv_rows[r] < 0)
      return fail(cudaErrorInvalidValue, "fo_a2a_run: negative rows for rank %d (send %d, receive %d)",
                  r, send_rows[r], recv_rows[r]);
    sent += send_rows[r];
  }
  if (M < 0 || sent != M || (!communicate && recv_rows[0] != M))
    return fail(cudaErrorInvalidValue, "fo_a2a_run: send rows sum to %lld, a has M=%d rows%s",
                (long long)sent, M, communicate ? "" : " (world size 1: and receives them all)");
  a2a::make_side(geo, send_rows, d.world, c.send);
  a2a::make_side(geo, recv_rows, d.world, c.recv);
  // "rows": no post-reorder, so no received tiles and no staging; at world size 1 the GEMM
  // writes `out` (which receives all M rows), so no product buffer either
  const bool rows = geo.rows != 0;
  const int send_tiles = c.send.tile_start[d.world];
  const int recv_tiles = rows ? 0 : c.recv.tile_start[d.world];
  const int64_t received = int64_t(c.recv.row_start[d.world]) * geo.n;
  const int64_t packed_numel = rows && !communicate ? 0 : int64_t(M) * geo.n;
  const int64_t staging_numel = communicate && !rows ? received : 0;
  needs[0] = send_tiles, needs[1] = recv_tiles, needs[2] = packed_numel, needs[3] = staging_numel;
  const fo_a2a_buffers& buf = c.buf;
  if (send_tiles > buf.tile_capacity || recv_tiles > buf.unpack_capacity ||
      packed_numel > buf.packed_numel || staging_numel > buf.staging_numel)
    return fail(cudaErrorMemoryAllocation,
                "fo_a2a_run: the call needs %d work items, %d received tiles, %lld packed and "
                "%lld staging elements; the buffers hold %d, %d, %lld and %lld (fo_a2a_set_buffers)",
                send_tiles, recv_tiles, (long long)packed_numel, (long long)staging_numel,
                buf.tile_capacity, buf.unpack_capacity, (long long)buf.packed_numel,
                (long long)buf.staging_numel);
  if ((send_tiles > 0 && (!a || !b || (scales && (!scales->a || !scales->b)))) ||
      (received > 0 && !out))
    return fail(cudaErrorInvalidValue, "fo_a2a_run: a, b%s (rows to send) and out (rows to "
                "receive) must be non-null", scales ? ", scale_a, scale_b" : "");
  // The communication stream follows what the caller queued before this call (the inputs, the
  // previous call's post-reorder, which read the staging buffer, and, "rows", whatever used
  // `out` before the receives overwrite it).
  cudaError_t err = communicate ? c.events.fork(stream, d.comm_stream) : cudaSuccess;
  if (err != cudaSuccess) return err;
  if (send_tiles + recv_tiles > 0) {
    A2aTablesArgs args;
    args.geo = geo;
    args.world = d.world;
    for (int r = 0; r < d.world; ++r) args.send_rows[r] = send_rows[r], args.recv_rows[r] = recv_rows[r];
    args.send_tiles = send_tiles, args.recv_tiles = recv_tiles;
    args.items = buf.items, args.item_group = buf.item_group, args.block_starts = buf.block_starts;
    args.unpack_tiles = buf.unpack_tiles, args.unpack_offsets = buf.unpack_offsets;
    const int blocks = (send_tiles + recv_tiles + kTableThreads - 1) / kTableThreads;
    a2a_tables<<<blocks < 512 ? blocks : 512, kTableThreads, 0, stream>>>(args);
    FO_CUDA_CHECK(cudaGetLastError());
  }
  // The GEMM before any wait: a waiter queued before its producer could deadlock. "rows": each
  // tile at its final row (ldo = N) of the product, or at world size 1 of `out` (M rows).
  int32_t* counters = communicate ? buf.counters : nullptr;
  const bool into_out = rows && !communicate;
  void* product = into_out ? out : buf.packed;
  const int64_t product_numel = into_out ? int64_t(M) * geo.n : buf.packed_numel;
  err = scales ? reinterpret_cast<GemmRunBlocksScaled>(d.gemm_run_blocks_scaled)(
                     a, b, scales, product, product_numel, M, geo.n, d.K, lda, ldb,
                     rows ? geo.n : 0, buf.block_starts, d.world, buf.items, buf.item_group,
                     send_tiles, counters, d.num_ctas, stream)
               : reinterpret_cast<GemmRunBlocks>(d.gemm_run_blocks)(
                     a, b, product, product_numel, M, geo.n, d.K, lda, ldb, rows ? geo.n : 0,
                     buf.block_starts, d.world, buf.items, buf.item_group, send_tiles, counters,
                     d.num_ctas, stream);
  if (err != cudaSuccess) return gemm_failed(err, "signaling");
  if (warm) FO_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (communicate) {
    for (int g = 0; g < geo.groups; ++g) {
      const int tiles = a2a::group_tiles(c.send, g);
      if (tiles > 0) {
        err = wait_counter(counters + g, tiles, d.wait_mode, d.comm_stream);
        if (err != cudaSuccess) return err;
      }
      err = a2a_step(c, g, out);
      if (err != cudaSuccess) return err;
    }
    if (warm) FO_CUDA_CHECK(cudaStreamSynchronize(d.comm_stream));
    err = c.events.comm_finished(d.comm_stream);
    if (err == cudaSuccess) err = c.events.join(stream);
    if (err != cudaSuccess) return err;
  }
  if (recv_tiles > 0) {
    err = launch_unpack(communicate ? buf.staging : buf.packed, out, geo.n, buf.unpack_tiles,
                        buf.unpack_offsets, recv_tiles, d.elem_size, counters,
                        communicate ? geo.groups : 0, stream);
    if (err != cudaSuccess) return err;
  } else if (communicate) {  // nothing to unpack ("rows", or no rows): zero the counters
    err = launch_reset(counters, geo.groups, stream);
    if (err != cudaSuccess) return err;
  }
  if (warm) FO_CUDA_CHECK(cudaStreamSynchronize(stream));
  return cudaSuccess;
}

}  // namespace fo::runtime

extern "C" {

FO_API cudaError_t fo_a2a_create(const fo_a2a_desc* desc, fo_a2a** out) {
  if (!desc || !out) return fo::fail(cudaErrorInvalidValue, "fo_a2a_create: null argument");
  cudaError_t err = fo::runtime::check_a2a_desc(*desc);
  if (err != cudaSuccess) return err;
  auto* c = new fo_a2a();
  c->d = *desc;
  // every field of the layout, the layout itself included (a call laid out "tiles" for a
  // "rows" GEMM writes items the kernel refuses)
  c->geo = fo::a2a::Geometry{desc->tile_m, desc->tile_n, desc->N, desc->raster_m, desc->swizzle,
                             desc->groups, desc->rows};
  err = c->events.create();
  if (err != cudaSuccess) {
    fo_a2a_destroy(c);
    return fo::fail(err, "fo_a2a_create: cudaEventCreate: %s", cudaGetErrorString(err));
  }
  *out = c;
  return cudaSuccess;
}

FO_API cudaError_t fo_a2a_set_buffers(fo_a2a* call, const fo_a2a_buffers* buffers) {
  if (!call || !buffers) return fo::fail(cudaErrorInvalidValue, "fo_a2a_set_buffers: null argument");
  const fo_a2a_buffers& b = *buffers;
  if (b.tile_capacity < 0 || b.unpack_capacity < 0 || b.packed_numel < 0 || b.staging_numel < 0 ||
      !b.block_starts || (call->d.nccl_comm && !b.counters) ||
      (b.tile_capacity > 0 && (!b.items || !b.item_group)) ||
      (b.unpack_capacity > 0 && (!b.unpack_tiles || !b.unpack_offsets)) ||
      (b.packed_numel > 0 && !b.packed) || (b.staging_numel > 0 && !b.staging))
    return fo::fail(cudaErrorInvalidValue,
                    "fo_a2a_set_buffers: every buffer with a capacity needs an address, and "
                    "block_starts (world + 1) and, with a communicator, the counters (groups) are "
                    "required");
  call->buf = b;
  return cudaSuccess;
}

FO_API cudaError_t fo_a2a_run(fo_a2a* call, const void* a, int64_t lda, const void* b, int64_t ldb,
                              void* out, int M, const int32_t* send_rows, const int32_t* recv_rows,
                              cudaStream_t stream, int warm, int64_t* needs) {
  if (!call || !send_rows || !recv_rows || !needs)
    return fo::fail(cudaErrorInvalidValue, "fo_a2a_run: call, send_rows, recv_rows and needs must be non-null");
  if (call->d.scaled)
    return fo::fail(cudaErrorInvalidValue,
                    "fo_a2a_run: this call is fp8 (scaled = 1): fo_a2a_run_scaled takes its scales");
  return fo::runtime::run_a2a(*call, a, lda, b, ldb, nullptr, out, M, send_rows, recv_rows, stream,
                              warm != 0, needs);
}

FO_API cudaError_t fo_a2a_run_scaled(fo_a2a* call, const void* a, int64_t lda, const void* b,
                                     int64_t ldb, const float* scale_a, const float* scale_b,
                                     const int64_t* scale_strides, void* out, int M,
                                     const int32_t* send_rows, const int32_t* recv_rows,
                                     cudaStream_t stream, int warm, int64_t* needs) {
  if (!call || !send_rows || !recv_rows || !needs)
    return fo::fail(cudaErrorInvalidValue,
                    "fo_a2a_run_scaled: call, send_rows, recv_rows and needs must be non-null");
  const fo_a2a_desc& d = call->d;
  const bool block_wise = d.scale_a_per_row == FO_SCALE_BLOCKS;
  if (!d.scaled || (block_wise && !scale_strides))
    return fo::fail(cudaErrorInvalidValue,
                    "fo_a2a_run_scaled: needs a call made with scaled = 1 (got %d), and for "
                    "block-wise scales their strides (got scale_strides=%p)", d.scaled,
                    static_cast<const void*>(scale_strides));
  fo_gemm_scales scales = {scale_a, scale_b, d.scale_a_per_row, d.scale_b_per_col, {0, 0}, {0, 0}};
  if (block_wise) {
    scales.a_stride[0] = scale_strides[0], scales.a_stride[1] = scale_strides[1];
    scales.b_stride[0] = scale_strides[2], scales.b_stride[1] = scale_strides[3];
  }
  return fo::runtime::run_a2a(*call, a, lda, b, ldb, &scales, out, M, send_rows, recv_rows,
                              stream, warm != 0, needs);
}

FO_API void fo_a2a_destroy(fo_a2a* call) {
  if (!call) return;
  call->events.destroy();
  delete call;
}

}  // extern "C"
