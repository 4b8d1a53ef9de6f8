// allgather's prepared call (fo_gather_* in flashoverlap_cuda.h): the gather that feeds a GEMM
// whose tiles wait for their rows. One translation unit of the runtime object.
//
// One call, rank r of W, a chunk g = rows chunk_rows[g] of every rank's shard:
//     compute: own rows a -> gathered (one device copy, the whole device: the GEMM has not
//              started; the own tiles then need no flag)
//   compute stream  --event-->  communication stream
//     compute: the GEMM on gathered, every other shard's item first waiting for its flag (s, g)
//     comm:    per chunk g: one NCCL group: send own rows of g to every peer, receive every
//              peer's rows of g; flags (p, g) := 1 for every peer p
//   communication stream  --event-->  compute stream: flags := 0 (ready for the next call)
// The loopback test (own_chunks = 1) copies the own rows chunk by chunk on the communication
// stream instead, each chunk setting flag (r, g), so that at world size 1 tiles really wait.
// (Measured on the H200: a device copy on the communication stream beside the waiting GEMM gets
// only the SMs the GEMM leaves free; the own rows' copy there made the call 2-3x the GEMM.)
// A flag write is cuStreamWriteValue32 with its default memory barrier: the stream's earlier
// writes (the copy, the NCCL receive) are visible before the flag is; the GEMM reads the flag
// with an acquire (and on sm90 a proxy fence before its TMA loads, gemm_sm90.cu).
//
// fp8 (scaled = 1, fo_gather_run_scaled; issue 32): the rows are e4m3 bytes, and rank s's rows
// take rank s's scale_a, so the scales are gathered too, into `gathered_scales` (a row per
// gathered row), before the rows:
//     compute: this rank's scale_a -> its rows of gathered_scales (a small kernel, any strides;
//              a 0-dim scale_a repeated on every own row), before anything else of the call
//   compute stream  --event-->  communication stream        (world > 1)
//     comm:    one NCCL group: own scales to every peer, every peer's into their rows;
//              then the event `scales_ready`
//     compute: own rows a -> gathered (as above, meanwhile), the fork of the chunks (as above)
//   communication stream  --scales_ready-->  compute stream: then the GEMM
// Every scale is in place before the GEMM starts, not only before a flag: the kernel reads an
// item's scales without waiting for the item's flag (row-wise ones are staged by the math
// threads before the item's main loop, block-wise ones by a producer warp other than the one
// that waits; gemm_ex_scaled.h), so a flag set after the scales' receive would not order them
// before those reads. The own scales' copy, on the compute stream before the GEMM, is ordered
// before it by the stream. The scales' exchange costs the GEMM's start one small NCCL group
// (world * block_rows * G floats), which the own rows' copy overlaps.
//
// Why this cannot deadlock. The GEMM's CTAs spin until their flags are set, and only the
// communication stream sets flags; so the GEMM ends if that stream's work does, and that work
// must never need what a spinning GEMM holds:
//  - it depends on the compute stream only through the event recorded before the GEMM (the
//    call's inputs), never on the GEMM; its flag writes are stream memory operations (no SM);
//  - its kernels (NCCL's send/receive kernels; the loopback test's copies, where the driver
//    copies with a kernel, and delay kernel) need SMs. The GEMM's
//    grid is capped at (SMs - reserve) CTAs (backends/cuda/gather_call.py), so at least `reserve`
//    SMs hold no GEMM CTA whatever the block scheduler does; NCCL's communicator for this call
//    is made with at most `reserve` CTAs and no CTA clusters (fo_nccl_comm_init_bounded), so
//    every CTA of an NCCL kernel is resident at once on those SMs, on every rank (none waits
//    behind a spinning GEMM CTA for a slot while its peer's CTA waits for it);
//  - a peer's NCCL kernels depend only on that peer's communication stream, likewise;
//  - two gather GEMMs in flight on one device could together take every SM: a device-wide
//    event makes each gather GEMM launched outside graph capture wait for the previous one
//    (gemm_turn); graphs replayed concurrently on two streams are not covered (docs/design.md);
//  - every kernel is loaded before a call overlaps: the first call (warm) runs the
//    communication side to its end, then the GEMM, with host syncs (under lazy loading a first
//    launch waits for an idle device, which a spinning GEMM would never leave);
//  - fp8: the GEMM also waits for the scales' exchange (scales_ready), which needs no GEMM of
//    this call: it depends on the compute stream only through the event recorded after the own
//    scales' copy (before this call's GEMM; earlier calls' GEMMs end by this same argument), and
//    its NCCL kernels are the bounded communicator's, which fit beside any waiting GEMM on every
//    rank like the chunks'. Until it ends no GEMM of this call runs; after it the chunks follow
//    on the communication stream as above, depending on nothing more.
// So every flag is set in finite time whatever the GEMM does, and then the GEMM finishes.

#include <mutex>
#include <vector>

#include "call_skeleton.cuh"
#include "nccl_loader.cuh"
#include "runtime.cuh"

struct fo_gather {
  fo_gather_desc d;
  std::vector<int32_t> chunk_rows;
  fo::runtime::CallEvents events;
  cudaEvent_t scales_ready = nullptr;  // fp8 at world > 1: every peer's scales have landed
  int scale_groups = 1;                // fp8: columns of gathered_scales (G)
};

namespace fo::gather {

using runtime::GemmRunEx;
using runtime::GemmRunExScaled;

// The tests' slow transfer: one thread spins `us` microseconds on the global timer.
__global__ void delay_kernel(uint32_t us) {
  uint64_t start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < uint64_t(us) * 1000);
}

// This rank's scale_a, read through its strides (a 0-dim one: both 0), into its rows of
// gathered_scales (row-major [rows, groups]).
__global__ void own_scales_kernel(const float* scale_a, int64_t row_stride, int64_t group_stride,
                                  int rows, int groups, float* out) {
  const int64_t n = int64_t(rows) * groups;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / groups;
    out[i] = scale_a[r * row_stride + (i - r * groups) * group_stride];
  }
}

// fp8: the GEMM's modes of the gathered scale_a and of scale_b (fo_gemm_scales): per row with
// tensor-wise or per-column scale_b, or block-wise both.
inline bool scale_modes_valid(const fo_gather_desc& d) {
  return (d.scale_a_per_row == 1 && (d.scale_b_per_col == 0 || d.scale_b_per_col == 1)) ||
         (d.scale_a_per_row == FO_SCALE_BLOCKS && d.scale_b_per_col == FO_SCALE_BLOCKS);
}

inline cudaError_t check_desc(const fo_gather_desc& d) {
  if (d.abi_version != FO_CUDA_ABI_VERSION)
    return fail(cudaErrorInvalidValue, "fo_gather_create: descriptor ABI %d, library ABI %d",
                d.abi_version, FO_CUDA_ABI_VERSION);
  if (d.scaled != 0 && d.scaled != 1)
    return fail(cudaErrorInvalidValue, "fo_gather_create: scaled must be 0 or 1, got %d", d.scaled);
  if (!(d.scaled ? d.gemm_run_ex_scaled : d.gemm_run_ex) || !d.items || !d.item_group ||
      !d.item_wait || !d.gathered || !d.arrive_flags || !d.wait_flags || !d.chunk_rows ||
      !d.comm_stream)
    return fail(cudaErrorInvalidValue,
                "fo_gather_create: gemm_run_ex (with scaled = 1 gemm_run_ex_scaled), items, "
                "item_group, item_wait, gathered, arrive_flags, wait_flags, chunk_rows and "
                "comm_stream are required");
  if (d.scaled && (!d.gathered_scales || !scale_modes_valid(d)))
    return fail(cudaErrorInvalidValue,
                "fo_gather_create: an fp8 call (scaled = 1) needs gathered_scales and the scales' "
                "modes 1 and 0 or 1 (per row of a; one float or per column of b), or both "
                "FO_SCALE_BLOCKS (%d) (got gathered_scales %p, modes %d and %d)", FO_SCALE_BLOCKS,
                static_cast<void*>(d.gathered_scales), d.scale_a_per_row, d.scale_b_per_col);
  if (d.world < 1 || d.rank < 0 || d.rank >= d.world || d.block_rows < 1 || d.N < 1 ||
      d.copy_cols < 1 || d.K < d.copy_cols || d.ldg < d.K || d.num_chunks < 1 ||
      d.num_items < 1 || d.num_ctas < 1 || d.delay_us < 0 || (d.delay_us > 0 && !d.own_chunks) ||
      (d.scaled ? d.elem_size != 1 : d.elem_size != 2 && d.elem_size != 4))
    return fail(cudaErrorInvalidValue,
                "fo_gather_create: bad sizes (world %d, rank %d, block_rows %d, N %d, K %d, "
                "copy_cols %d, ldg %lld, chunks %d, items %d, ctas %d, delay %d, elem_size %d)",
                d.world, d.rank, d.block_rows, d.N, d.K, d.copy_cols, (long long)d.ldg,
                d.num_chunks, d.num_items, d.num_ctas, d.delay_us, d.elem_size);
  if (d.world > 1 && (!d.nccl_comm || !nccl::loaded()))
    return fail(cudaErrorInvalidValue,
                "fo_gather_create: world size %d needs NCCL loaded and a communicator", d.world);
  int previous = 0;
  for (int g = 0; g < d.num_chunks; ++g) {
    const int start = d.chunk_rows[2 * g], end = d.chunk_rows[2 * g + 1];
    if (start != previous || end <= start || end > d.block_rows)
      return fail(cudaErrorInvalidValue,
                  "fo_gather_create: chunk %d is rows [%d, %d); chunks must be consecutive, "
                  "non-empty and within the %d rows of a shard", g, start, end, d.block_rows);
    previous = end;
  }
  if (previous != d.block_rows)
    return fail(cudaErrorInvalidValue, "fo_gather_create: the chunks cover %d of %d rows",
                previous, d.block_rows);
  return cudaSuccess;
}

inline char* shard_rows(const fo_gather& c, int shard, int row) {
  const fo_gather_desc& d = c.d;
  return static_cast<char*>(d.gathered) +
         (int64_t(shard) * d.block_rows + row) * d.ldg * d.elem_size;
}

inline cudaError_t set_flag(const fo_gather& c, int shard, int g) {
  const fo_gather_desc& d = c.d;
  return runtime::write_value32(d.arrive_flags + shard * d.num_chunks + g, 1, d.comm_stream);
}

// This rank's rows, a -> gathered: in one copy on `stream` (own_chunks = 0), or (the loopback
// test) chunk by chunk on the communication stream, each chunk's flag set once it has landed.
inline cudaError_t copy_own_rows(const fo_gather& c, const void* a, int64_t lda,
                                 cudaStream_t stream) {
  const fo_gather_desc& d = c.d;
  const size_t es = size_t(d.elem_size);
  if (!d.own_chunks) {
    FO_CUDA_CHECK(cudaMemcpy2DAsync(shard_rows(c, d.rank, 0), size_t(d.ldg) * es, a,
                                    size_t(lda) * es, size_t(d.copy_cols) * es,
                                    size_t(d.block_rows), cudaMemcpyDeviceToDevice, stream));
    return cudaSuccess;
  }
  for (int g = 0; g < d.num_chunks; ++g) {
    const int start = c.chunk_rows[2 * g], rows = c.chunk_rows[2 * g + 1] - start;
    if (d.delay_us > 0) {
      delay_kernel<<<1, 1, 0, d.comm_stream>>>(uint32_t(d.delay_us));
      FO_CUDA_CHECK(cudaGetLastError());
    }
    FO_CUDA_CHECK(cudaMemcpy2DAsync(shard_rows(c, d.rank, start), size_t(d.ldg) * es,
                                    static_cast<const char*>(a) + int64_t(start) * lda * es,
                                    size_t(lda) * es, size_t(d.copy_cols) * es, size_t(rows),
                                    cudaMemcpyDeviceToDevice, d.comm_stream));
    cudaError_t err = set_flag(c, d.rank, g);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

// fp8: this rank's scale_a (strides: rows, groups) -> its rows of gathered_scales, on `stream`.
inline cudaError_t copy_own_scales(const fo_gather& c, const float* scale_a,
                                   const int64_t* strides, cudaStream_t stream) {
  const fo_gather_desc& d = c.d;
  const int64_t n = int64_t(d.block_rows) * c.scale_groups;
  const int threads = 256;
  const int blocks = int(n / threads + 1 < 1024 ? n / threads + 1 : 1024);
  own_scales_kernel<<<blocks, threads, 0, stream>>>(scale_a, strides[0], strides[1], d.block_rows,
                                                    c.scale_groups, d.gathered_scales +
                                                    int64_t(d.rank) * n);
  FO_CUDA_CHECK(cudaGetLastError());
  return cudaSuccess;
}

// fp8 at world > 1: one NCCL group on the communication stream, this rank's rows of
// gathered_scales to every peer and every peer's into theirs (float32), then scales_ready.
inline cudaError_t exchange_scales(const fo_gather& c) {
  const fo_gather_desc& d = c.d;
  const int64_t count = int64_t(d.block_rows) * c.scale_groups;
  float* own = d.gathered_scales + int64_t(d.rank) * count;
  cudaError_t err = nccl::send_recv_step(d.world, nccl::kFloat32,
                                         static_cast<nccl::Comm>(d.nccl_comm), d.comm_stream,
                                         [&](int peer, nccl::PeerTransfer* t) {
                                           *t = {own, count, d.gathered_scales + peer * count,
                                                 count};
                                           return peer != d.rank;
                                         });
  if (err != cudaSuccess) return err;
  FO_CUDA_CHECK(cudaEventRecord(c.scales_ready, d.comm_stream));
  return cudaSuccess;
}

// Per chunk, one NCCL group: this rank's rows of the chunk (whole rows of gathered, padding
// included, so each shard's chunk is one contiguous run) to every peer, every peer's into its
// shard; then the peers' flags.
inline cudaError_t exchange_chunks(const fo_gather& c) {
  const fo_gather_desc& d = c.d;
  auto comm = static_cast<nccl::Comm>(d.nccl_comm);
  for (int g = 0; g < d.num_chunks && d.world > 1; ++g) {
    const int start = c.chunk_rows[2 * g];
    const int64_t count = int64_t(c.chunk_rows[2 * g + 1] - start) * d.ldg;  // > 0
    cudaError_t err = nccl::send_recv_step(d.world, d.nccl_dtype, comm, d.comm_stream,
                                           [&](int peer, nccl::PeerTransfer* t) {
                                             *t = {shard_rows(c, d.rank, start), count,
                                                   shard_rows(c, peer, start), count};
                                             return peer != d.rank;
                                           });
    if (err != cudaSuccess) return err;
    for (int peer = 0; peer < d.world; ++peer) {
      if (peer == d.rank) continue;
      err = set_flag(c, peer, g);
      if (err != cudaSuccess) return err;
    }
  }
  return cudaSuccess;
}

// One gather GEMM at a time per device (see the header): each waits for the previous one's
// end through this event. Not inside stream capture, where an event of another capture or of
// none cannot be waited on.
inline cudaError_t gemm_turn(cudaStream_t stream, bool before) {
  static std::mutex lock;
  static cudaEvent_t events[64] = {};
  cudaStreamCaptureStatus capture;
  FO_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  int device = 0;
  FO_CUDA_CHECK(cudaGetDevice(&device));
  if (capture != cudaStreamCaptureStatusNone || device >= 64) return cudaSuccess;
  std::lock_guard<std::mutex> guard(lock);
  if (!events[device]) FO_CUDA_CHECK(cudaEventCreateWithFlags(&events[device], cudaEventDisableTiming));
  if (before) FO_CUDA_CHECK(cudaStreamWaitEvent(stream, events[device], 0));
  else FO_CUDA_CHECK(cudaEventRecord(events[device], stream));
  return cudaSuccess;
}

// fp8 (scaled = 1): the GEMM's scales, the gathered scale_a per row (or block-wise) and this
// call's scale_b.
struct CallScales {
  fo_gemm_scales gemm{};
  const float* scale_a = nullptr;  // this rank's, read through a_strides
  int64_t a_strides[2] = {0, 0};
};

inline cudaError_t launch_gemm(const fo_gather& c, const void* b, int64_t ldb,
                               const CallScales* scales, void* out, int64_t ldo,
                               cudaStream_t stream) {
  const fo_gather_desc& d = c.d;
  cudaError_t err = gemm_turn(stream, true);
  if (err != cudaSuccess) return err;
  if (scales)
    err = reinterpret_cast<GemmRunExScaled>(d.gemm_run_ex_scaled)(
        d.gathered, b, &scales->gemm, out, d.world, d.block_rows, d.N, d.K, d.ldg, ldb, ldo,
        d.items, d.item_group, d.item_wait, d.wait_flags, d.world * d.num_chunks, d.num_items,
        nullptr, d.num_ctas, nullptr, d.workspace, stream);
  else
    err = reinterpret_cast<GemmRunEx>(d.gemm_run_ex)(
        d.gathered, b, out, d.world, d.block_rows, d.N, d.K, d.ldg, ldb, ldo, d.items,
        d.item_group, d.item_wait, d.wait_flags, d.world * d.num_chunks, d.num_items, nullptr,
        d.num_ctas, nullptr, d.workspace, stream);
  if (err != cudaSuccess) return runtime::gemm_failed(err, "allgather");
  return gemm_turn(stream, false);
}

inline cudaError_t run(fo_gather& c, const void* a, int64_t lda, const void* b, int64_t ldb,
                       const CallScales* scales, void* out, int64_t ldo, cudaStream_t stream,
                       bool warm) {
  const fo_gather_desc& d = c.d;
  const bool peer_scales = scales && d.world > 1;
  cudaError_t err = cudaSuccess;
  if (scales) {  // fp8: the scales first (see the header), then the rows as for 16-bit a
    err = copy_own_scales(c, scales->scale_a, scales->a_strides, stream);
    if (err == cudaSuccess && peer_scales) err = c.events.fork(stream, d.comm_stream);
    if (err == cudaSuccess && peer_scales) err = exchange_scales(c);
    if (err != cudaSuccess) return err;
  }
  err = d.own_chunks ? cudaSuccess : copy_own_rows(c, a, lda, stream);
  if (err != cudaSuccess) return err;
  // After the own rows' copy: the sends read them from gathered. (fp8: the communication
  // stream's second wait on inputs_ready, which a wait takes at its latest record.)
  err = c.events.fork(stream, d.comm_stream);
  if (err == cudaSuccess && d.own_chunks) err = copy_own_rows(c, a, lda, d.comm_stream);
  if (err == cudaSuccess && peer_scales) {  // every tile's scales are in place before the GEMM
    FO_CUDA_CHECK(cudaStreamWaitEvent(stream, c.scales_ready, 0));
  }
  if (err == cudaSuccess && !warm) err = launch_gemm(c, b, ldb, scales, out, ldo, stream);
  if (err == cudaSuccess) err = exchange_chunks(c);
  if (err == cudaSuccess) err = c.events.comm_finished(d.comm_stream);
  if (err != cudaSuccess) return err;
  if (warm) {  // the communication side to its end, then the GEMM (its waits all pass)
    FO_CUDA_CHECK(cudaStreamSynchronize(d.comm_stream));
    err = launch_gemm(c, b, ldb, scales, out, ldo, stream);
    if (err != cudaSuccess) return err;
    FO_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  err = c.events.join(stream);
  if (err != cudaSuccess) return err;
  FO_CUDA_CHECK(cudaMemsetAsync(d.arrive_flags, 0, sizeof(uint32_t) * d.world * d.num_chunks, stream));
  if (warm) FO_CUDA_CHECK(cudaStreamSynchronize(stream));
  return cudaSuccess;
}

}  // namespace fo::gather

extern "C" {

FO_API cudaError_t fo_gather_load_kernels(void) {
  cudaFuncAttributes attr;
  FO_CUDA_CHECK(cudaFuncGetAttributes(&attr, fo::gather::delay_kernel));
  FO_CUDA_CHECK(cudaFuncGetAttributes(&attr, fo::gather::own_scales_kernel));
  return fo::runtime::load_stream_memops();
}

FO_API void fo_gather_destroy(fo_gather* gather) {
  if (!gather) return;
  gather->events.destroy();
  if (gather->scales_ready) cudaEventDestroy(gather->scales_ready);
  delete gather;
}

FO_API cudaError_t fo_gather_create(const fo_gather_desc* desc, fo_gather** out) {
  if (!desc || !out) return fo::fail(cudaErrorInvalidValue, "fo_gather_create: null argument");
  cudaError_t err = fo::gather::check_desc(*desc);
  if (err != cudaSuccess) return err;
  auto* c = new fo_gather();
  c->d = *desc;
  c->chunk_rows.assign(desc->chunk_rows, desc->chunk_rows + 2 * desc->num_chunks);
  c->d.chunk_rows = c->chunk_rows.data();  // the caller's host array is the caller's
  if (desc->scaled && desc->scale_a_per_row == FO_SCALE_BLOCKS)
    c->scale_groups = (desc->copy_cols + FO_SCALE_BLOCK - 1) / FO_SCALE_BLOCK;
  err = fo::runtime::load_stream_memops();
  if (err == cudaSuccess) err = c->events.create();
  if (err == cudaSuccess && desc->scaled && desc->world > 1)
    err = cudaEventCreateWithFlags(&c->scales_ready, cudaEventDisableTiming);
  if (err != cudaSuccess) {
    fo_gather_destroy(c);
    return fo::fail(err, "fo_gather_create: %s", fo::last_error_text().empty()
                                                     ? cudaGetErrorString(err)
                                                     : fo::last_error_text().c_str());
  }
  *out = c;
  return cudaSuccess;
}

FO_API cudaError_t fo_gather_run(fo_gather* gather, const void* a, int64_t lda, const void* b,
                                 int64_t ldb, void* out, int64_t ldo, cudaStream_t stream,
                                 int warm) {
  if (!gather || !a || !b || !out || lda < gather->d.copy_cols || ldo < gather->d.N)
    return fo::fail(cudaErrorInvalidValue,
                    "fo_gather_run: gather, a, b and out must be non-null, lda >= %d, ldo >= %d",
                    gather ? gather->d.copy_cols : 0, gather ? gather->d.N : 0);
  if (gather->d.scaled)
    return fo::fail(cudaErrorInvalidValue,
                    "fo_gather_run: this call was made for fp8 (scaled = 1): call "
                    "fo_gather_run_scaled with its scales");
  return fo::gather::run(*gather, a, lda, b, ldb, nullptr, out, ldo, stream, warm != 0);
}

FO_API cudaError_t fo_gather_run_scaled(fo_gather* gather, const void* a, int64_t lda,
                                        const void* b, int64_t ldb, const float* scale_a,
                                        const float* scale_b, const int64_t* scale_strides,
                                        void* out, int64_t ldo, cudaStream_t stream, int warm) {
  if (!gather || !a || !b || !out || lda < gather->d.copy_cols || ldo < gather->d.N)
    return fo::fail(cudaErrorInvalidValue,
                    "fo_gather_run_scaled: gather, a, b and out must be non-null, lda >= %d, "
                    "ldo >= %d", gather ? gather->d.copy_cols : 0, gather ? gather->d.N : 0);
  const fo_gather_desc& d = gather->d;
  if (!d.scaled || !scale_a || !scale_b || !scale_strides)
    return fo::fail(cudaErrorInvalidValue,
                    "fo_gather_run_scaled: needs a call made with scaled = 1 (got %d) and "
                    "scale_a, scale_b and scale_strides (got %p, %p, %p)", d.scaled,
                    static_cast<const void*>(scale_a), static_cast<const void*>(scale_b),
                    static_cast<const void*>(scale_strides));
  fo::gather::CallScales scales;
  scales.scale_a = scale_a;
  scales.a_strides[0] = scale_strides[0], scales.a_strides[1] = scale_strides[1];
  // the GEMM reads the gathered scale_a: row-major [world * block_rows, G]
  scales.gemm.a = d.gathered_scales, scales.gemm.b = scale_b;
  scales.gemm.a_per_row = d.scale_a_per_row, scales.gemm.b_per_col = d.scale_b_per_col;
  if (d.scale_a_per_row == FO_SCALE_BLOCKS) {
    scales.gemm.a_stride[0] = gather->scale_groups, scales.gemm.a_stride[1] = 1;
    scales.gemm.b_stride[0] = scale_strides[2], scales.gemm.b_stride[1] = scale_strides[3];
  }
  return fo::gather::run(*gather, a, lda, b, ldb, &scales, out, ldo, stream, warm != 0);
}

}  // extern "C"
