// FlashOverlap runtime kernels: the device-side wait on a group counter, the counter reset and
// the post-communication reorder (unpack of packed tiles into row-major rows). One translation
// unit of the runtime object, whose other units are the call kinds that launch these kernels
// (through runtime.cuh); C ABI in flashoverlap_cuda.h.
#include <cuda.h>  // driver types only: the driver is reached through cudaGetDriverEntryPoint

#include <mutex>

#include "common.cuh"
#include "runtime.cuh"

namespace fo::runtime {

// ---- device-side wait --------------------------------------------------------------------

__device__ inline int32_t load_relaxed(const int32_t* p) {
  int32_t v;
  asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// One thread spins until *counter >= value (cyclic comparison, as CU_STREAM_WAIT_VALUE_GEQ).
// The acquire fence on exit orders the stream's later work after the producer's release.
__global__ void spin_wait(const int32_t* counter, int32_t value) {
  while (int32_t(uint32_t(load_relaxed(counter)) - uint32_t(value)) < 0) __nanosleep(256);
  asm volatile("fence.acq_rel.gpu;" ::: "memory");
}

// spin_wait, then the counter back to 0 (wait_counter_and_reset).
__global__ void spin_wait_reset(int32_t* counter, int32_t value) {
  while (int32_t(uint32_t(load_relaxed(counter)) - uint32_t(value)) < 0) __nanosleep(256);
  asm volatile("fence.acq_rel.gpu;" ::: "memory");
  *counter = 0;
}

// cuStreamWaitValue32 and cuStreamWriteValue32 have the same signature.
using StreamValue32 = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

// A driver entry point of that signature, looked up once per `slot`.
template <int slot>
cudaError_t stream_value32(const char* name, StreamValue32* fn) {
  static StreamValue32 cached = nullptr;
  static cudaError_t status = cudaSuccess;
  static std::once_flag once;
  std::call_once(once, [name] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found;
    status = cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &found);
    if (status == cudaSuccess && found != cudaDriverEntryPointSuccess) status = cudaErrorSymbolNotFound;
    cached = reinterpret_cast<StreamValue32>(p);
  });
  if (status != cudaSuccess)
    return fail(status, "%s is not available from the driver: %s", name, cudaGetErrorString(status));
  *fn = cached;
  return cudaSuccess;
}

cudaError_t stream_wait_value32(StreamValue32* fn) {
  return stream_value32<0>("cuStreamWaitValue32", fn);
}

cudaError_t stream_write_value32(StreamValue32* fn) {
  return stream_value32<1>("cuStreamWriteValue32", fn);
}

cudaError_t write_value32(void* address, uint32_t value, cudaStream_t stream) {
  StreamValue32 write;
  cudaError_t err = stream_write_value32(&write);
  if (err != cudaSuccess) return err;
  CUresult r = write(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(address),
                     value, CU_STREAM_WRITE_VALUE_DEFAULT);
  if (r != CUDA_SUCCESS)
    return fail(cudaErrorUnknown, "cuStreamWriteValue32 failed with CUresult %d", int(r));
  return cudaSuccess;
}

cudaError_t load_stream_memops() {
  StreamValue32 fn;
  cudaError_t err = stream_wait_value32(&fn);
  return err == cudaSuccess ? stream_write_value32(&fn) : err;
}

// ---- counters ----------------------------------------------------------------------------

__global__ void reset_counters(int32_t* counters, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) counters[i] = 0;
}

// ---- post-communication reorder ----------------------------------------------------------

// One CTA per part of a tile (grid: tiles x kUnpackParts), each thread with one round of kUnroll
// 16-byte vectors of a 128x256 bf16 tile (two for float32, none for the empty parts of smaller
// tiles). Small units keep the end of the kernel short, and 40 registers let 6 CTAs of 256
// threads share an SM: 96 KiB of loads in flight per SM (74 registers and 3 CTAs before).
constexpr int kUnpackThreads = 256;
constexpr int kUnroll = 4;        // loads in flight per thread, issued before any store
constexpr int kUnpackParts = 4;   // CTAs per tile; a part copies every kUnpackParts-th round
constexpr int kUnpackCtasPerSm = 6;

// Copies rows x vpr vectors of type V from a contiguous tile to strided rows: the vectors of
// part `part` are i = part*T + tid + k*kUnpackParts*T, kUnroll of them loaded at a time; (row,
// col) advance incrementally, so there is no division per vector.
template <class V>
__device__ inline void copy_tile(const V* __restrict__ src, V* __restrict__ dst, int64_t ldd_v,
                                 int rows, int vpr, int part) {
  const int total = rows * vpr;  // < 2^31: checked by unpack_tiles
  constexpr int step = kUnpackParts * kUnpackThreads;
  const int step_r = step / vpr, step_c = step - step_r * vpr;
  int i = part * kUnpackThreads + threadIdx.x;
  if (i >= total) return;
  int r = i / vpr, c = i - r * vpr;
  for (; i < total; i += kUnroll * step) {
    V v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (i + u * step < total) v[u] = src[i + u * step];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (i + u * step < total) dst[r * ldd_v + c] = v[u];
      c += step_c, r += step_r;
      if (c >= vpr) c -= vpr, ++r;
    }
  }
}

// Block (t, part): part `part` of tile t, with the widest vector that divides the tile's source
// and destination addresses, its row length and the destination stride.
__global__ void __launch_bounds__(kUnpackThreads, kUnpackCtasPerSm)
unpack_tiles(const char* __restrict__ src, char* __restrict__ dst, int64_t ldd,
             const int32_t* __restrict__ tiles, const int64_t* __restrict__ src_offsets,
             int elem_size, int32_t* reset, int num_reset) {
  const int t = blockIdx.x, part = blockIdx.y;
  // A prepared call zeroes its group counters here: every wait on them has passed (the stream
  // waited for the communication stream), and it saves a launch per call.
  if (t == 0 && part == 0)
    for (int i = threadIdx.x; i < num_reset; i += kUnpackThreads) reset[i] = 0;
  const int row0 = __ldg(tiles + 4 * t), rows = __ldg(tiles + 4 * t + 1);
  const int col0 = __ldg(tiles + 4 * t + 2), cols = __ldg(tiles + 4 * t + 3);
  const char* s = src + __ldg(src_offsets + t) * elem_size;
  char* d = dst + (int64_t(row0) * ldd + col0) * elem_size;
  const int64_t row_bytes = int64_t(cols) * elem_size, ldd_bytes = ldd * elem_size;
  if (rows * row_bytes >= (int64_t(1) << 31)) __trap();  // no plan has a tile of 2 GiB
  const uint64_t bits = reinterpret_cast<uintptr_t>(s) | reinterpret_cast<uintptr_t>(d) |
                        uint64_t(row_bytes) | uint64_t(ldd_bytes);
  if ((bits & 15) == 0)
    copy_tile(reinterpret_cast<const uint4*>(s), reinterpret_cast<uint4*>(d), ldd_bytes / 16, rows, int(row_bytes / 16), part);
  else if ((bits & 7) == 0)
    copy_tile(reinterpret_cast<const uint2*>(s), reinterpret_cast<uint2*>(d), ldd_bytes / 8, rows, int(row_bytes / 8), part);
  else if ((bits & 3) == 0)
    copy_tile(reinterpret_cast<const uint32_t*>(s), reinterpret_cast<uint32_t*>(d), ldd_bytes / 4, rows, int(row_bytes / 4), part);
  else
    copy_tile(reinterpret_cast<const uint16_t*>(s), reinterpret_cast<uint16_t*>(d), ldd_bytes / 2, rows, int(row_bytes / 2), part);
}

UnpackLaunch::UnpackLaunch(const void* src_, void* dst_, int64_t ldd_, const int32_t* tiles_,
                           const int64_t* src_offsets_, int num_tiles, int elem_size_,
                           int32_t* reset_, int num_reset_)
    : grid(num_tiles, kUnpackParts), src(static_cast<const char*>(src_)),
      dst(static_cast<char*>(dst_)), ldd(ldd_), tiles(tiles_), src_offsets(src_offsets_),
      elem_size(elem_size_), reset(reset_), num_reset(num_reset_) {}

cudaKernelNodeParams UnpackLaunch::node(void** args) {
  args[0] = &src, args[1] = &dst, args[2] = &ldd, args[3] = &tiles, args[4] = &src_offsets;
  args[5] = &elem_size, args[6] = &reset, args[7] = &num_reset;
  cudaKernelNodeParams p = {};
  p.func = reinterpret_cast<void*>(unpack_tiles);
  p.gridDim = grid, p.blockDim = dim3(kUnpackThreads), p.sharedMemBytes = 0;
  p.kernelParams = args;
  return p;
}

cudaError_t launch_unpack(const UnpackLaunch& u, cudaStream_t stream) {
  unpack_tiles<<<u.grid, kUnpackThreads, 0, stream>>>(u.src, u.dst, u.ldd, u.tiles, u.src_offsets,
                                                      u.elem_size, u.reset, u.num_reset);
  FO_CUDA_CHECK(cudaGetLastError());
  return cudaSuccess;
}

cudaError_t launch_unpack(const void* src, void* dst, int64_t ldd, const int32_t* tiles,
                          const int64_t* src_offsets, int num_tiles, int elem_size,
                          int32_t* reset, int num_reset, cudaStream_t stream) {
  return launch_unpack(UnpackLaunch(src, dst, ldd, tiles, src_offsets, num_tiles, elem_size, reset,
                                    num_reset), stream);
}

cudaError_t launch_reset(int32_t* counters, int n, cudaStream_t stream) {
  reset_counters<<<1, 256, 0, stream>>>(counters, n);
  FO_CUDA_CHECK(cudaGetLastError());
  return cudaSuccess;
}

cudaError_t wait_counter(const int32_t* counter, int32_t value, int mode, cudaStream_t stream) {
  if (mode == 0) {
    StreamValue32 fn;
    cudaError_t err = stream_wait_value32(&fn);
    if (err != cudaSuccess) return err;
    CUresult r = fn(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(counter),
                    cuuint32_t(value), CU_STREAM_WAIT_VALUE_GEQ);
    if (r != CUDA_SUCCESS)
      return fo::fail(cudaErrorUnknown, "cuStreamWaitValue32 failed with CUresult %d", int(r));
    return cudaSuccess;
  }
  if (mode == 1) {
    spin_wait<<<1, 1, 0, stream>>>(counter, value);
    FO_CUDA_CHECK(cudaGetLastError());
    return cudaSuccess;
  }
  return fo::fail(cudaErrorInvalidValue, "wait mode %d is not 0 (stream wait) or 1 (spin kernel)", mode);
}

cudaError_t wait_counter_and_reset(int32_t* counter, int32_t value, int mode, cudaStream_t stream) {
  if (mode == 1) {
    spin_wait_reset<<<1, 1, 0, stream>>>(counter, value);
    FO_CUDA_CHECK(cudaGetLastError());
    return cudaSuccess;
  }
  cudaError_t err = wait_counter(counter, value, mode, stream);
  return err == cudaSuccess ? write_value32(counter, 0, stream) : err;
}

}  // namespace fo::runtime

using namespace fo::runtime;

extern "C" {

FO_API cudaError_t fo_load_kernels(void) {
  cudaFuncAttributes attr;
  FO_CUDA_CHECK(cudaFuncGetAttributes(&attr, spin_wait));
  FO_CUDA_CHECK(cudaFuncGetAttributes(&attr, spin_wait_reset));
  FO_CUDA_CHECK(cudaFuncGetAttributes(&attr, reset_counters));
  FO_CUDA_CHECK(cudaFuncGetAttributes(&attr, unpack_tiles));
  cudaError_t err = load_a2a_kernels();
  if (err == cudaSuccess) err = load_norm_kernels();
  if (err != cudaSuccess) return err;
  return load_stream_memops();
}

FO_API cudaError_t fo_wait_counter(const int32_t* counter, int32_t value, int mode, cudaStream_t stream) {
  if (!counter) return fo::fail(cudaErrorInvalidValue, "fo_wait_counter: counter is null");
  return wait_counter(counter, value, mode, stream);
}

FO_API cudaError_t fo_reset_counters(int32_t* counters, int n, cudaStream_t stream) {
  if (n < 0 || (n > 0 && !counters))
    return fo::fail(cudaErrorInvalidValue, "fo_reset_counters: need n >= 0 counters at a non-null address");
  if (n == 0) return cudaSuccess;
  reset_counters<<<(n + 255) / 256 < 64 ? (n + 255) / 256 : 64, 256, 0, stream>>>(counters, n);
  FO_CUDA_CHECK(cudaGetLastError());
  return cudaSuccess;
}

FO_API cudaError_t fo_unpack_tiles(const void* src, void* dst, int64_t ldd, const int32_t* tiles,
                                   const int64_t* src_offsets, int num_tiles, int elem_size,
                                   cudaStream_t stream) {
  if (num_tiles < 0 || (elem_size != 2 && elem_size != 4))
    return fo::fail(cudaErrorInvalidValue, "fo_unpack_tiles: num_tiles=%d must be >= 0 and elem_size=%d 2 or 4",
                    num_tiles, elem_size);
  if (num_tiles == 0) return cudaSuccess;
  if (!src || !dst || !tiles || !src_offsets || ldd < 1)
    return fo::fail(cudaErrorInvalidValue, "fo_unpack_tiles: src, dst, tiles and src_offsets must be non-null, ldd >= 1");
  if (num_tiles > 0x7fffffff / 2)
    return fo::fail(cudaErrorInvalidValue, "fo_unpack_tiles: too many tiles (%d)", num_tiles);
  return launch_unpack(src, dst, ldd, tiles, src_offsets, num_tiles, elem_size, nullptr, 0, stream);
}

FO_API const char* fo_last_error(void) { return fo::last_error_text().c_str(); }

}  // extern "C"
