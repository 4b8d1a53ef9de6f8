// FlashOverlap signaling GEMM for Ampere and Ada (sm_80/86/89; runs on sm_90 too).
//
// A persistent loop over the plan's work items (CTA c takes items c, c+G, ...) around the CUTLASS
// 3.x sm80 multistage mainloop collective (cp.async into swizzled shared memory, ldmatrix,
// mma.sync), with the same epilogue contract as the sm90 kernel: each finished tile is stored at
// its packed slot, row-major at its real size, then the CTA's threads meet at a barrier and one
// thread bumps the tile's group counter with a release add.
//
// Epilogues (FO_EPILOGUE): 0 direct (32-bit stores straight from the accumulators); 1 staged
// (a full tile whose slot is 16-byte aligned goes through the mainloop's shared memory, free
// once the mainloop has drained, and leaves it as fully coalesced 16-byte stores of the slot,
// which is one contiguous chunk; other tiles take the direct path); 3 none (full tiles are not
// stored: an upper bound for measurements only, the output is wrong by design).
//
// allgather (fo_gemm_run_ex): with item_wait, thread 0 waits for each item's arrival flag
// (acquire) and a barrier orders every thread's cp.async after it; with ldo, the tiles are
// written in place into a row-major out (staged: 16-byte stores per row when ldo % 8 == 0).
//
// Configuration (-D macros, defaults in brackets): FO_TILE_M/N/K [128/128/32] (M, N multiples
// of 64: one warp per 64x64 of the tile; K 32 or 64), FO_STAGES [0 = 4], FO_DTYPE [0 = bf16,
// 1 = fp16], FO_B_COL_MAJOR [1], FO_EPILOGUE [0].
#include "epilogue.cuh"
#include "gemm_abi.cuh"

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/collective/collective_mma.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/numeric_types.h"

#ifndef FO_TILE_M
#define FO_TILE_M 128
#endif
#ifndef FO_TILE_N
#define FO_TILE_N 128
#endif
#ifndef FO_TILE_K
#define FO_TILE_K 32
#endif
#ifndef FO_EPILOGUE
#define FO_EPILOGUE 0
#endif

namespace fo::sm80 {
using namespace cute;

constexpr int kBM = FO_TILE_M, kBN = FO_TILE_N, kBK = FO_TILE_K;
constexpr int kStages = FO_STAGES == 0 ? 4 : FO_STAGES;
static_assert(kBM % 64 == 0 && kBN % 64 == 0, "sm80 tiles: M and N multiples of 64");
static_assert(kBK == 32 || kBK == 64, "sm80 tiles: K is 32 or 64");
constexpr int kWarpsM = kBM / 64, kWarpsN = kBN / 64;
constexpr int kThreads = 32 * kWarpsM * kWarpsN;

using Element = cute::conditional_t<FO_DTYPE == 0, cutlass::bfloat16_t, cutlass::half_t>;
static_assert(FO_DTYPE == 0 || FO_DTYPE == 1, "sm80 builds take bf16 or fp16 (no fp8 tensor cores)");
using MmaOp = cute::conditional_t<FO_DTYPE == 0, SM80_16x8x16_F32BF16BF16F32_TN, SM80_16x8x16_F32F16F16F32_TN>;
using TileShape = Shape<Int<kBM>, Int<kBN>, Int<kBK>>;
using TiledMma = TiledMMA<MMA_Atom<MmaOp>, Layout<Shape<Int<kWarpsM>, Int<kWarpsN>, _1>>,
                          Tile<Int<16 * kWarpsM>, Int<16 * kWarpsN>, _16>>;
using CpAsync16 = Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL<cute::uint128_t>, Element>;

// Operand whose K is contiguous (A always; B when column-major): 8-element vectors along K.
constexpr int kKVecs = kBK / 8;
using KMajorSmemAtom = decltype(composition(
    Swizzle<kBK == 64 ? 3 : 2, 3, 3>{}, Layout<Shape<_8, Int<kBK>>, Stride<Int<kBK>, _1>>{}));
using KMajorSmemCopy = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
using KMajorGmemCopy = decltype(make_tiled_copy(
    CpAsync16{}, Layout<Shape<Int<kThreads / kKVecs>, Int<kKVecs>>, Stride<Int<kKVecs>, _1>>{},
    Layout<Shape<_1, _8>>{}));

// Operand whose N is contiguous (B row-major): 8-element vectors along N, transposed ldmatrix.
constexpr int kNVecs = kBN / 8 < kThreads ? kBN / 8 : kThreads;
using NMajorSmemAtom = decltype(composition(Swizzle<3, 3, 3>{}, Layout<Shape<_64, _8>, Stride<_1, _64>>{}));
using NMajorSmemCopy = Copy_Atom<SM75_U16x8_LDSM_T, Element>;
using NMajorGmemCopy = decltype(make_tiled_copy(
    CpAsync16{}, Layout<Shape<Int<kNVecs>, Int<kThreads / kNVecs>>, Stride<_1, Int<kNVecs>>>{},
    Layout<Shape<_8, _1>>{}));

using StrideA = Stride<int64_t, _1, int64_t>;
#if FO_B_COL_MAJOR
using StrideB = Stride<int64_t, _1, int64_t>;
using BSmemAtom = KMajorSmemAtom;
using BSmemCopy = KMajorSmemCopy;
using BGmemCopy = KMajorGmemCopy;
#else
using StrideB = Stride<_1, int64_t, int64_t>;
using BSmemAtom = NMajorSmemAtom;
using BSmemCopy = NMajorSmemCopy;
using BGmemCopy = NMajorGmemCopy;
#endif

using Mainloop = cutlass::gemm::collective::CollectiveMma<
    cutlass::gemm::MainloopSm80CpAsync<kStages>, TileShape, Element, StrideA, Element, StrideB,
    TiledMma, KMajorGmemCopy, KMajorSmemAtom, KMajorSmemCopy, cute::identity, BGmemCopy, BSmemAtom,
    BSmemCopy, cute::identity>;
constexpr int kMainloopSmem = int(sizeof(typename Mainloop::SharedStorage));

// Staged epilogue: the tile in shared memory, rows padded by 16 bytes so that the quads' 32-bit
// writes (8 rows x 4 words per warp store) fall in 32 different banks.
constexpr int kEpilogue = FO_EPILOGUE;
static_assert(kEpilogue == 0 || kEpilogue == 1 || kEpilogue == 3, "FO_EPILOGUE: 0 direct, 1 staged, 3 none");
constexpr int kStageRow = kBN + 8;  // elements
constexpr int kStageSmem = kEpilogue == 1 ? kBM * kStageRow * 2 : 0;
constexpr int kSmemBytes = kMainloopSmem > kStageSmem ? kMainloopSmem : kStageSmem;

struct Params {
  const Element* a;
  const Element* b;
  int64_t lda, ldb;
  int K;
  ItemTable table;
  Element* packed;
  int32_t* counters;
  uint64_t* monitor;
  const int32_t* item_wait;  // allgather: the arrival flag of each item (null: no waits)
  const uint32_t* arrive_flags;
  int num_flags;
};

// Staged store of a full tile: accumulators -> shared memory (the mainloop ended with every
// cp.async drained and a barrier, so its buffers are free), then each thread copies 16-byte
// vectors of the tile, which is one contiguous chunk of the packed buffer: consecutive threads
// write consecutive 16 bytes. kRows: the tile's rows go to rows of stride `ld` (a multiple of 8
// elements) of a row-major output instead (allgather's in-place output).
template <bool kRows = false, class Acc, class Coord>
__device__ inline void store_full_tile_staged(const Acc& acc, const Coord& coord, Element* stage,
                                              Element* dst, int64_t ld = kBN) {
#pragma unroll
  for (int i = 0; i < int(size(acc)); i += 2) {
    const int r = get<0>(coord(i)), c = get<1>(coord(i));
    *reinterpret_cast<uint32_t*>(stage + r * kStageRow + c) = pack2<Element>(acc(i), acc(i + 1));
  }
  __syncthreads();
  constexpr int kRowVecs = kBN / 8;  // 16-byte vectors per row
  constexpr int kVecs = kBM * kRowVecs;
  static_assert(kVecs % kThreads == 0, "whole vectors per thread");
#pragma unroll 2
  for (int v = threadIdx.x; v < kVecs; v += kThreads) {
    const int r = v / kRowVecs, c = v % kRowVecs;
    uint4* to = kRows ? reinterpret_cast<uint4*>(dst + r * ld + 8 * c) : reinterpret_cast<uint4*>(dst) + v;
    *to = *reinterpret_cast<const uint4*>(stage + r * kStageRow + 8 * c);
  }
}

__global__ void __launch_bounds__(kThreads) signaling_gemm(const __grid_constant__ Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  extern __shared__ __align__(128) char smem[];
  Mainloop mainloop;
  TiledMma tiled_mma;
  auto coord = tiled_mma.get_slice(threadIdx.x)
                   .partition_C(make_identity_tensor(make_shape(Int<kBM>{}, Int<kBN>{})));
  assert_pairs(coord);
  const auto blk_mk = make_shape(Int<kBM>{}, Int<kBK>{});
  const auto blk_nk = make_shape(Int<kBN>{}, Int<kBK>{});

  for (int64_t i = blockIdx.x; i < p.table.num_items; i += gridDim.x) {
    const WorkTile w = decode_item<kBM, kBN, true, gemm::kBlocks>(p.table, i);
    if (p.item_wait != nullptr) {
      // allgather: this item's rows of A must have arrived before any thread loads them. One
      // thread waits (acquire); the barrier orders every thread's cp.async after it. The
      // previous item ended with a barrier too, so nothing of it is still in flight.
      if (threadIdx.x == 0) wait_item_rows(p.item_wait, p.arrive_flags, p.num_flags, i);
      __syncthreads();
    }
    // This tile's rows of A and columns of B as (rows, K) / (cols, K) views, cut into K tiles.
    Tensor mA = make_tensor(make_gmem_ptr(p.a + w.row0 * p.lda), make_shape(w.rows, p.K),
                            make_stride(p.lda, _1{}));
#if FO_B_COL_MAJOR
    Tensor mB = make_tensor(make_gmem_ptr(p.b + w.col0 * p.ldb), make_shape(w.cols, p.K),
                            make_stride(p.ldb, _1{}));
#else
    Tensor mB = make_tensor(make_gmem_ptr(p.b + w.col0), make_shape(w.cols, p.K),
                            make_stride(_1{}, p.ldb));
#endif
    Tensor gA = local_tile(mA, blk_mk, make_coord(0, _));  // (BM, BK, k)
    Tensor gB = local_tile(mB, blk_nk, make_coord(0, _));  // (BN, BK, k)
    const int k_tiles = int(size<2>(gA));
    auto residue = make_tuple(w.rows, w.cols, p.K - k_tiles * kBK);  // K residue <= 0

    auto acc = partition_fragment_C(tiled_mma, take<0, 2>(TileShape{}));
    clear(acc);
    mainloop(acc, gA, gB, acc, make_coord_iterator(shape<2>(gA)), k_tiles, residue,
             int(threadIdx.x), smem);

    Element* dst = p.packed + w.offset;
    const bool full = w.rows == kBM && w.cols == kBN;
    const int64_t ldo = p.table.ldo;  // != 0: in place into a row-major out (allgather)
    const bool aligned = (reinterpret_cast<uintptr_t>(dst) & 15) == 0;
    if (ldo) {
      if (kEpilogue == 1 && full && aligned && ldo % 8 == 0)
        store_full_tile_staged<true>(acc, coord, reinterpret_cast<Element*>(smem), dst, ldo);
      else
        store_tile_rows(acc, coord, dst, w.rows, w.cols, ldo);
    } else if (kEpilogue == 1 && full && aligned) {
      store_full_tile_staged(acc, coord, reinterpret_cast<Element*>(smem), dst);
    } else if (!(kEpilogue == 3 && full)) {
      store_tile<Element, kBM, kBN>(acc, coord, dst, w.rows, w.cols);
    }
    // Every store of the tile happens before the release below, and (staged) every read of the
    // shared tile before the next mainloop refills shared memory.
    __syncthreads();
    if (threadIdx.x == 0) {
      if (p.counters) signal_counter(p.counters + w.group);
      record_monitor(p.monitor, i, int(blockIdx.x));
    }
  }
#else
  __trap();
#endif
}

}  // namespace fo::sm80

namespace fo::gemm {
using namespace fo::sm80;

const fo_gemm_config& config() {
  static const fo_gemm_config c = {
      FO_CUDA_ABI_VERSION, 80, kBM, kBN, kBK, 1, 1, FO_DTYPE, FO_B_COL_MAJOR, 1, 2, kStages,
      FO_DTYPE, 0};
  return c;
}

cudaError_t load_kernel() { return prepare_kernel_once(signaling_gemm, kSmemBytes); }

cudaError_t check_limits(const Args& args) {
  if (args.K % 8 || (!FO_B_COL_MAJOR && args.N % 8))
    return fail(cudaErrorInvalidValue,
                "fo_gemm_run (sm80): K=%d%s must be a multiple of 8 (cp.async moves 8 elements "
                "at a time); pad with zeros", args.K, FO_B_COL_MAJOR ? "" : " and N");
  return cudaSuccess;
}

cudaError_t resident_ctas(int device, int* ctas) {
  int per_sm = 0, sms = 0;
  FO_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, signaling_gemm, kThreads, kSmemBytes));
  FO_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  *ctas = per_sm * sms;
  return cudaSuccess;
}

static Params kernel_params(const Args& args) {
  return Params{static_cast<const Element*>(args.a), static_cast<const Element*>(args.b), args.lda,
                args.ldb, args.K, args.table(), static_cast<Element*>(args.packed), args.counters,
                args.monitor, args.item_wait, args.arrive_flags, args.num_flags};
}

cudaError_t launch(const Args& args, cudaStream_t stream) {
  signaling_gemm<<<args.num_ctas, kThreads, kSmemBytes, stream>>>(kernel_params(args));
  FO_CUDA_CHECK(cudaGetLastError());
  return cudaSuccess;
}

cudaError_t set_node(const Args& args, cudaGraphExec_t exec, cudaGraphNode_t node) {
  Params params = kernel_params(args);
  void* arg[] = {&params};
  cudaKernelNodeParams p = {};
  p.func = reinterpret_cast<void*>(signaling_gemm);
  p.gridDim = dim3(args.num_ctas), p.blockDim = dim3(kThreads), p.sharedMemBytes = kSmemBytes;
  p.kernelParams = arg;
  FO_CUDA_CHECK(cudaGraphExecKernelNodeSetParams(exec, node, &p));
  return cudaSuccess;
}

}  // namespace fo::gemm
