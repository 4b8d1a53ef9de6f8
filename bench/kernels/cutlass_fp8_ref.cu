// Stock CUTLASS 3 fp8 GEMMs, for comparison only (issue 32; bench/cutlass_ref.py).
//
// Row-wise: D[M, N] (bf16, row-major) = scale_a[m] * scale_b[n] * (A[M, K] . B[N, K]^T), e4m3
// A and B K-major, as torch._scaled_mm's row-wise case. Block-wise (REF_BLOCKWISE=1): scale_a
// [M, K/128] (M contiguous) per 1x128 group of A, scale_b [N/128, K/128] (K contiguous) per
// 128x128 block of B, applied in CUTLASS's sm90 FP8Blockwise main loop (its
// Sm90BlockwiseScaleConfig<1, 128, 128, MN, K>), D = bf16 of the accumulator, as torch's
// block-wise scaled_mm. Composed from CUTLASS's own parts only:
// CollectiveBuilder mainloop (TMA warp-specialized, FP8 fast accumulation), CollectiveBuilder
// epilogue with an epilogue visitor tree (column broadcast of scale_a, row broadcast of
// scale_b), GemmUniversal with the persistent tile scheduler. No FlashOverlap code: its point is
// to tell whether the gap between the signaling GEMM and torch's row-wise kernel is in what
// FlashOverlap adds around CUTLASS's main loop or in that main loop itself.
//
// One configuration per object, chosen by macros:
//   REF_TM, REF_TN   CTA tile (K tile 128)
//   REF_CM, REF_CN   cluster shape
//   REF_PINGPONG     1: pingpong kernel schedule, 0: cooperative
//   REF_BLOCKWISE    1: block-wise scales in the main loop (default 0: row-wise, epilogue)
//   REF_EPI_N        the epilogue tile's width (default 0: CUTLASS's EpilogueTileAuto; a
//                    pingpong epilogue tile is 64 rows, a cooperative one 128)
//   REF_SCALAR       1: scale_a[0] and scale_b[0] as scalars (Sm90ScalarBroadcast), the same
//                    main loop with a tensor-wise epilogue, to price the row-wise one
//   REF_NAME         suffix of the exported symbols
// C ABI (ctypes): fo_ref_<name>_prepare(...) -> handle (nullptr on failure, message in
// fo_ref_<name>_error()), fo_ref_<name>_run(handle, stream) -> cudaError_t,
// fo_ref_<name>_free(handle).
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/thread/activation.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

#ifndef REF_NAME
#error "REF_NAME, REF_TM, REF_TN, REF_CM, REF_CN and REF_PINGPONG select the configuration"
#endif

using namespace cute;

#ifndef REF_BLOCKWISE
#define REF_BLOCKWISE 0
#endif
#ifndef REF_EPI_N
#define REF_EPI_N 0
#endif
#ifndef REF_SCALAR
#define REF_SCALAR 0
#endif

namespace {

using TileShape = Shape<Int<REF_TM>, Int<REF_TN>, _128>;
using ClusterShape = Shape<Int<REF_CM>, Int<REF_CN>, _1>;
#if REF_PINGPONG && REF_BLOCKWISE
using KernelSchedule = cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8Blockwise;
#elif REF_PINGPONG
using KernelSchedule = cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8FastAccum;
#elif REF_BLOCKWISE
using KernelSchedule = cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8Blockwise;
#else
using KernelSchedule = cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8FastAccum;
#endif
#if REF_PINGPONG
using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecialized;
#else
using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;
#endif

using ElementAB = cutlass::float_e4m3_t;
using ElementD = cutlass::bfloat16_t;
using LayoutD = cutlass::layout::RowMajor;
constexpr int kAlignD = 8;
constexpr int kAlignAB = 16;

namespace fusion = cutlass::epilogue::fusion;
constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;
// scale_a: one value per row m (a column vector), scale_b: one per column n (a row vector)
#if REF_SCALAR
using ScaleA = fusion::Sm90ScalarBroadcast<float, Stride<_0, _0, int64_t>>;
using ScaleB = fusion::Sm90ScalarBroadcast<float, Stride<_0, _0, int64_t>>;
#else
using ScaleA = fusion::Sm90ColBroadcast<0, TileShape, float, float, Stride<_1, _0, int64_t>>;
using ScaleB = fusion::Sm90RowBroadcast<0, TileShape, float, float, Stride<_0, _1, int64_t>>;
#endif
using TimesB = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::multiplies, float, float, kRound>,
                               ScaleB, fusion::Sm90AccFetch>;
using TimesA = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::multiplies, ElementD, float, kRound>,
                               ScaleA, TimesB>;
// block-wise: the scales are in the accumulator already; D is its conversion
using Convert = fusion::Sm90EVT<
    fusion::Sm90Compute<cutlass::epilogue::thread::Identity, ElementD, float, kRound>,
    fusion::Sm90AccFetch>;
using Fusion = cute::conditional_t<REF_BLOCKWISE, Convert, TimesA>;
using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128, cute::GMMA::Major::MN,
                                                              cute::GMMA::Major::K>;
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
using LayoutA = cutlass::layout::RowMajor;
using LayoutB = cutlass::layout::ColumnMajor;
using MainA = cute::conditional_t<REF_BLOCKWISE, cute::tuple<LayoutA, LayoutSFA>, LayoutA>;
using MainB = cute::conditional_t<REF_BLOCKWISE, cute::tuple<LayoutB, LayoutSFB>, LayoutB>;

#if REF_EPI_N
using EpilogueTile = Shape<Int<REF_PINGPONG ? 64 : 128>, Int<REF_EPI_N>>;
#else
using EpilogueTile = cutlass::epilogue::collective::EpilogueTileAuto;
#endif
using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    EpilogueTile, float, float,
    void, LayoutD, kAlignD, ElementD, LayoutD, kAlignD, EpilogueSchedule, Fusion>::CollectiveOp;

using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
    ElementAB, MainA, kAlignAB,
    ElementAB, MainB, kAlignAB,
    float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<
        static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
    KernelSchedule>::CollectiveOp;

using GemmKernel = cutlass::gemm::kernel::GemmUniversal<
    Shape<int, int, int, int>, CollectiveMainloop, CollectiveEpilogue,
    cutlass::gemm::PersistentScheduler>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
using RasterOrder =
    typename cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Params::RasterOrderOptions;

char g_error[512];

struct Handle {
  Gemm gemm;
  void* workspace = nullptr;
};

void set_error(const char* what, int code) {
  std::snprintf(g_error, sizeof(g_error), "%s (%d)", what, code);
}

}  // namespace

#define FO_CAT2(a, b) a##b
#define FO_CAT(a, b) FO_CAT2(a, b)
#define FO_SYM(s) FO_CAT(FO_CAT(fo_ref_, REF_NAME), s)

extern "C" {

const char* FO_SYM(_error)() { return g_error; }

// Mainloop stages and shared memory of this build, for the JSON.
int FO_SYM(_stages)() { return CollectiveMainloop::DispatchPolicy::Stages; }
int FO_SYM(_smem_bytes)() { return static_cast<int>(GemmKernel::SharedStorageSize); }

// raster: 0 heuristic, 1 along M, 2 along N; swizzle: max_swizzle_size (1, 2, 4, 8)
void* FO_SYM(_prepare)(const void* a, const void* b, const float* scale_a, const float* scale_b,
                       void* d, int m, int n, int k, int swizzle, int raster, int sm_count,
                       cudaStream_t stream) {
  auto* h = new Handle;
  using StrideA = typename Gemm::GemmKernel::StrideA;
  using StrideB = typename Gemm::GemmKernel::StrideB;
  using StrideC = typename Gemm::GemmKernel::StrideC;
  using StrideD = typename Gemm::GemmKernel::StrideD;
  StrideA sa = cutlass::make_cute_packed_stride(StrideA{}, make_shape(m, k, 1));
  StrideB sb = cutlass::make_cute_packed_stride(StrideB{}, make_shape(n, k, 1));
  StrideC sc = cutlass::make_cute_packed_stride(StrideC{}, make_shape(m, n, 1));
  StrideD sd = cutlass::make_cute_packed_stride(StrideD{}, make_shape(m, n, 1));
#if REF_BLOCKWISE
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {m, n, k, 1},
      {static_cast<ElementAB const*>(a), sa, static_cast<ElementAB const*>(b), sb, scale_a,
       ScaleConfig::tile_atom_to_shape_SFA(make_shape(m, n, k, 1)), scale_b,
       ScaleConfig::tile_atom_to_shape_SFB(make_shape(m, n, k, 1))},
      {{}, nullptr, sc, static_cast<ElementD*>(d), sd}};
  args.epilogue.thread = {{}, {}};  // Convert's: {acc's, identity's}
#else
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {m, n, k, 1},
      {static_cast<ElementAB const*>(a), sa, static_cast<ElementAB const*>(b), sb},
      {{}, nullptr, sc, static_cast<ElementD*>(d), sd}};
  // TimesA's arguments: {scale_a's, TimesB's, multiply's}; TimesB's: {scale_b's, acc's, multiply's}
#if REF_SCALAR
  // the scalars' pointers: {scalars, scalar_ptrs, strides}
  args.epilogue.thread = {{{0.f}, {scale_a}, {}}, {{{0.f}, {scale_b}, {}}, {}, {}}, {}};
#else
  args.epilogue.thread = {{scale_a, 0.f, {}}, {{scale_b, 0.f, {}}, {}, {}}, {}};
#endif
#endif
  args.hw_info.device_id = 0;
  args.hw_info.sm_count = sm_count;
  args.scheduler.max_swizzle_size = swizzle;
  args.scheduler.raster_order = raster == 1   ? RasterOrder::AlongM
                                : raster == 2 ? RasterOrder::AlongN
                                              : RasterOrder::Heuristic;
  cutlass::Status st = h->gemm.can_implement(args);
  if (st != cutlass::Status::kSuccess) {
    set_error("can_implement refused the problem", static_cast<int>(st));
    delete h;
    return nullptr;
  }
  size_t bytes = Gemm::get_workspace_size(args);
  if (bytes) {
    cudaError_t e = cudaMalloc(&h->workspace, bytes);
    if (e != cudaSuccess) {
      set_error(cudaGetErrorString(e), static_cast<int>(e));
      delete h;
      return nullptr;
    }
  }
  st = h->gemm.initialize(args, h->workspace, stream);
  if (st != cutlass::Status::kSuccess) {
    set_error("initialize failed", static_cast<int>(st));
    cudaFree(h->workspace);
    delete h;
    return nullptr;
  }
  return h;
}

int FO_SYM(_run)(void* handle, cudaStream_t stream) {
  auto* h = static_cast<Handle*>(handle);
  cutlass::Status st = h->gemm.run(stream);
  if (st != cutlass::Status::kSuccess) {
    set_error("run failed", static_cast<int>(st));
    return -1;
  }
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) set_error(cudaGetErrorString(e), static_cast<int>(e));
  return static_cast<int>(e);
}

void FO_SYM(_free)(void* handle) {
  auto* h = static_cast<Handle*>(handle);
  if (!h) return;
  cudaFree(h->workspace);
  delete h;
}

}  // extern "C"
