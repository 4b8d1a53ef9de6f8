// The post-communication reorder fused into the next op: residual add + RMSNorm
// (fo.overlap_add_rmsnorm): its kernel and fo_add_rmsnorm_tiles, one translation unit of the
// runtime object. The prepared call runs it as its last phase (overlap_call.cu, through
// add_rmsnorm.cuh); the C ABI is in flashoverlap_cuda.h.
//
// One CTA per output row. A row's N columns are spread over its band's column tiles in the
// received buffer (each tile row-major at its real size): the table `bands` gives, per band of
// tile_m rows, where each column tile starts (flashoverlap_core/reorder.py, band_offsets), so
// column c of row r is at bands[r / tile_m][j] + (r % tile_m) * cols_j + (c - j * tile_n), with
// j = c / tile_n and cols_j = min(tile_n, N - j * tile_n). The CTA reads the row from there and
// the residual row once (16-byte vectors), keeps residual + reduced in float32 registers, writes
// residual_out, sums the squares across the CTA, and writes normed: 2 reads and 2 writes of
// N elements per row, the bytes of two copies. Rows longer than the registers hold (N > 8192
// with 16-byte vectors) read the rest twice, before and after the sum.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "add_rmsnorm.cuh"
#include "runtime.cuh"

namespace fo::runtime {

// Vectors of its row each thread keeps in registers. Two (54 registers for bf16) let two CTAs
// of 512 threads share an SM; four took 85 registers, two CTAs of 256, and the kernel ran at
// about 2/3 of torch.compile's add + rms_norm on the H200 (23 against 15 us at 1024 x 8192).
constexpr int kNormKeep = 2;
constexpr int kNormMaxThreads = 512;  // per CTA: rows up to 512 * 2 vectors stay in registers

// VEC elements loaded or stored at once (16 bytes for VEC = 8 two-byte elements; 32-byte packs
// of float weights are two 16-byte loads).
template <class T, int VEC>
struct alignas(sizeof(T) * VEC < 16 ? sizeof(T) * VEC : 16) Pack {
  T v[VEC];
};

__device__ inline float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ inline float to_float(__half x) { return __half2float(x); }
__device__ inline float to_float(float x) { return x; }
template <class T> __device__ inline T from_float(float x);
template <> __device__ inline __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ inline __half from_float<__half>(float x) { return __float2half_rn(x); }

// The sum of `v` over the CTA (blockDim.x a multiple of 32), returned to every thread.
__device__ inline float block_sum(float v) {
  __shared__ float partial[32];
  __shared__ float total;
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < int(blockDim.x >> 5) ? partial[lane] : 0.f;
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) total = v;
  }
  __syncthreads();
  return total;
}

// Row blockIdx.x (see the file comment). T: the activations' type; W: the weight's (T or float);
// VEC: elements per access (8: 16-byte vectors, needs N, tile_n, strides and offsets multiples of
// 8 and 16-byte aligned pointers; 1: any layout). CTA 0 also zeroes the call's group counters
// (`reset`): every wait on them has passed, and it saves a launch per call.
template <class T, class W, int VEC>
__global__ void __launch_bounds__(kNormMaxThreads)
add_rmsnorm_rows(NormRows rows, NormIo io, int32_t* reset, int num_reset) {
  using P = Pack<T, VEC>;
  using PW = Pack<W, VEC>;
  const int row = blockIdx.x;
  if (row == 0)
    for (int i = threadIdx.x; i < num_reset; i += blockDim.x) reset[i] = 0;
  const int band = row / rows.tile_m, in_band = row - band * rows.tile_m;
  const int64_t* __restrict__ tile_at = rows.bands + int64_t(band) * rows.col_tiles;
  const T* __restrict__ src = static_cast<const T*>(rows.src);
  const T* __restrict__ res = static_cast<const T*>(io.residual) + row * io.ld_residual;
  const W* __restrict__ weight = static_cast<const W*>(io.weight);
  T* __restrict__ out_res = static_cast<T*>(io.residual_out) + row * io.ld_out;
  T* __restrict__ out_norm = static_cast<T*>(io.normed) + row * io.ld_out;
  const int vecs = rows.n / VEC;
  // Vector v of the row in src: its column tile j, at row in_band of that tile.
  auto src_vec = [&](int v) {
    const int c = v * VEC, j = c / rows.tile_n, c0 = j * rows.tile_n;
    const int cols = min(rows.tile_n, rows.n - c0);
    return *reinterpret_cast<const P*>(src + __ldg(tile_at + j) + int64_t(in_band) * cols + (c - c0));
  };
  auto res_vec = [&](int v) { return *reinterpret_cast<const P*>(res + v * VEC); };
  auto weight_vec = [&](int v) { return *reinterpret_cast<const PW*>(weight + v * VEC); };
  auto add_store = [&](const P& s, const P& r, int v, float (&x)[VEC]) {
    P o;
    float sq = 0.f;
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      x[e] = to_float(s.v[e]) + to_float(r.v[e]);
      sq += x[e] * x[e];
      o.v[e] = from_float<T>(x[e]);
    }
    *reinterpret_cast<P*>(out_res + v * VEC) = o;
    return sq;
  };
  auto norm_store = [&](const float (&x)[VEC], const PW& w, float rstd, int v) {
    P o;
#pragma unroll
    for (int e = 0; e < VEC; ++e) o.v[e] = from_float<T>(x[e] * rstd * to_float(w.v[e]));
    *reinterpret_cast<P*>(out_norm + v * VEC) = o;
  };

  // Every load of the kept vectors first, so that they are all in flight at once; then the
  // sums and the residual_out stores.
  P s[kNormKeep], r[kNormKeep];
#pragma unroll
  for (int k = 0; k < kNormKeep; ++k) {
    const int v = threadIdx.x + k * blockDim.x;
    if (v < vecs) s[k] = src_vec(v), r[k] = res_vec(v);
  }
  float x[kNormKeep][VEC];
  float sq = 0.f;
#pragma unroll
  for (int k = 0; k < kNormKeep; ++k) {
    const int v = threadIdx.x + k * blockDim.x;
    if (v < vecs) sq += add_store(s[k], r[k], v, x[k]);
  }
  const int kept = kNormKeep * blockDim.x;
  for (int v = threadIdx.x + kept; v < vecs; v += blockDim.x) {  // first pass over the rest
    float y[VEC];
    sq += add_store(src_vec(v), res_vec(v), v, y);
  }
  // The weight (read by every row: in L2) is loaded while the CTA sums.
  PW w[kNormKeep];
#pragma unroll
  for (int k = 0; k < kNormKeep; ++k) {
    const int v = threadIdx.x + k * blockDim.x;
    if (v < vecs) w[k] = weight_vec(v);
  }
  const float rstd = rsqrtf(block_sum(sq) / float(rows.n) + io.eps);
#pragma unroll
  for (int k = 0; k < kNormKeep; ++k) {
    const int v = threadIdx.x + k * blockDim.x;
    if (v < vecs) norm_store(x[k], w[k], rstd, v);
  }
  for (int v = threadIdx.x + kept; v < vecs; v += blockDim.x) {  // second pass over the rest
    const P sv = src_vec(v), rv = res_vec(v);
    float y[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) y[e] = to_float(sv.v[e]) + to_float(rv.v[e]);
    norm_store(y, weight_vec(v), rstd, v);
  }
}

// dtype: 0 bf16, 1 fp16; weight: 0 the activations' type, 1 float32; vec: 0 one element per
// access, 1 16-byte vectors.
inline NormKernel norm_kernel(int dtype, int weight, int vec) {
  using B = __nv_bfloat16;
  using H = __half;
  static const NormKernel kernels[2][2][2] = {
      {{add_rmsnorm_rows<B, B, 1>, add_rmsnorm_rows<B, B, 8>},
       {add_rmsnorm_rows<B, float, 1>, add_rmsnorm_rows<B, float, 8>}},
      {{add_rmsnorm_rows<H, H, 1>, add_rmsnorm_rows<H, H, 8>},
       {add_rmsnorm_rows<H, float, 1>, add_rmsnorm_rows<H, float, 8>}}};
  return kernels[dtype][weight][vec];
}

// Force-loads every instantiation (see fo_load_kernels).
cudaError_t load_norm_kernels() {
  cudaFuncAttributes attr;
  for (int d = 0; d < 2; ++d)
    for (int w = 0; w < 2; ++w)
      for (int v = 0; v < 2; ++v) FO_CUDA_CHECK(cudaFuncGetAttributes(&attr, norm_kernel(d, w, v)));
  return cudaSuccess;
}

cudaError_t check_norm_rows(const NormRows& r, int dtype) {
  if (dtype != 0 && dtype != 1)
    return fail(cudaErrorInvalidValue, "add_rmsnorm: dtype %d is not 0 (bf16) or 1 (fp16)", dtype);
  if (!r.src || !r.bands || r.rows < 1 || r.n < 1 || r.tile_m < 1 || r.tile_n < 1 ||
      r.col_tiles != (r.n + r.tile_n - 1) / r.tile_n)
    return fail(cudaErrorInvalidValue,
                "add_rmsnorm: need src and a band table of ceil(N / tile_n) column tiles, rows, N, "
                "tile_m, tile_n >= 1 (rows %d, N %d, tiles %dx%d, %d column tiles)",
                r.rows, r.n, r.tile_m, r.tile_n, r.col_tiles);
  return cudaSuccess;
}

cudaError_t NormLaunch::make(const NormRows& rows, int dtype, const NormIo& io, int weight_dtype,
                             int32_t* reset, int num_reset, NormLaunch* out) {
  if (weight_dtype != 0 && weight_dtype != 1)
    return fail(cudaErrorInvalidValue,
                "add_rmsnorm: weight_dtype %d is not 0 (the activations') or 1 (float32)",
                weight_dtype);
  if (!io.residual || !io.weight || !io.normed || !io.residual_out || io.ld_residual < rows.n ||
      io.ld_out < rows.n || !(io.eps >= 0.f))
    return fail(cudaErrorInvalidValue,
                "add_rmsnorm: residual, weight, normed and residual_out must be non-null, their "
                "row strides >= N=%d (got %lld, %lld) and eps >= 0", rows.n,
                (long long)io.ld_residual, (long long)io.ld_out);
  // Offsets of tiles stored back to back are sums of rows * cols: multiples of 8 when N and
  // tile_n are (the caller's tables are such layouts: band_offsets).
  const bool vec = rows.n % 8 == 0 && rows.tile_n % 8 == 0 && io.ld_residual % 8 == 0 &&
                   io.ld_out % 8 == 0 && aligned16(rows.src) && aligned16(io.residual) &&
                   aligned16(io.weight) && aligned16(io.normed) && aligned16(io.residual_out);
  const int vecs = vec ? rows.n / 8 : rows.n;
  int threads = ((vecs + kNormKeep - 1) / kNormKeep + 31) / 32 * 32;
  threads = threads < 32 ? 32 : threads > kNormMaxThreads ? kNormMaxThreads : threads;
  out->kernel = norm_kernel(dtype, weight_dtype, vec);
  out->grid = dim3(rows.rows), out->block = dim3(threads);
  out->rows = rows, out->io = io, out->reset = reset, out->num_reset = num_reset;
  return cudaSuccess;
}

}  // namespace fo::runtime

extern "C" {

FO_API cudaError_t fo_add_rmsnorm_tiles(const void* src, const int64_t* band_offsets, int rows,
                                        int N, int tile_m, int tile_n, int dtype,
                                        const void* residual, int64_t ld_residual,
                                        const void* weight, int weight_dtype, float eps,
                                        void* normed, void* residual_out, int64_t ld_out,
                                        cudaStream_t stream) {
  using namespace fo::runtime;
  const NormRows r{src, band_offsets, rows, N, tile_m, tile_n, tile_n > 0 ? (N + tile_n - 1) / tile_n : 0};
  cudaError_t err = check_norm_rows(r, dtype);
  if (err != cudaSuccess) return err;
  NormLaunch launch;
  err = NormLaunch::make(r, dtype, NormIo{residual, ld_residual, weight, normed, residual_out, ld_out, eps},
                         weight_dtype, nullptr, 0, &launch);
  return err != cudaSuccess ? err : launch.launch(stream);
}

}  // extern "C"
