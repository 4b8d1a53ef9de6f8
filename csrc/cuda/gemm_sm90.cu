// FlashOverlap signaling GEMM for Hopper (sm_90a).
//
// A warp-specialized persistent kernel built from CUTLASS 3.x parts: the TMA + wgmma mainloop
// collective of the collective builder (cooperative or pingpong schedule) does the math; this
// file supplies the kernel around it:
//   * a table-driven tile scheduler: persistent CTA c takes work items c, c+G, c+2G, ... of the
//     plan's item table (G = grid size), so the kernel's order is the plan's order;
//   * an epilogue that stores each finished tile at its slot of the packed buffer, row-major at
//     its real size, and a store/signal thread (lane 0 of the producer warpgroup's warp 1) that
//     bumps the tile's group counter with a release add at GPU scope once the tile's data is
//     globally visible. So a counter never becomes visible before its tiles' data.
// allgather (fo_gemm_run_ex): with item_wait, the producer waits for each item's arrival flag
// (acquire, then a proxy fence) before it issues the item's TMA loads. With ldo (allgather, and
// every "rows" plan: fo_gemm_launch), each tile is written at its item's offset with row stride
// ldo, so the tiles form whole rows of a row-major buffer (tma: a 2-D store map [R][N], R = the
// buffer's rows, whose bounds clip a tile at N and at the buffer's end; a tile of fewer rows
// than the tile height elsewhere takes the direct path, since the rows below it are another
// tile's).
// A tile may start at any row (A's TMA tensor is offset to the tile's first row): destination
// blocks need not be multiples of the tile height, and rows past a block's end are computed but
// never stored. K tails and M/N edges are zero-filled by TMA.
//
// Epilogues (FO_EPILOGUE):
//   0 direct  the math threads store their accumulators straight to global memory (32-bit
//             stores), then arrive on an mbarrier (release); the signal thread waits (acquire)
//             and does the release add. The math threads never wait for the stores to drain.
//   1 tma     the math threads write the tile, 64 columns at a time (32 where BN is not a
//             multiple of 64: 160, 224), into a ring of FO_EPI_SLOTS swizzled shared-memory
//             slots (stmatrix), fence the async proxy and arrive; the store thread issues one
//             TMA store per column block into the packed
//             slot (viewed as a [numel / BN, BN] tensor), frees each slot once the copy has read
//             it (cp.async.bulk.wait_group.read), and after the tile's last block waits for the
//             writes themselves (wait_group 0), fences the async proxy and does the release add.
//             The math threads go on to the next tile while the stores drain. A tile that is
//             partial or whose slot does not start on a row of that view (offset % BN != 0)
//             takes the direct path.
//   2 vec16   direct, with 16-byte stores for full tiles (quad shuffles, epilogue.cuh).
//   3 none    direct, but full tiles are not stored at all: an upper bound for measurements
//             only (the output is wrong by design).
//   4 tma_wg  as tma, in 32-column blocks, but the math threads store and signal themselves,
//             as CUTLASS's own sm90 epilogue stores: per block, the tile's math threads write a
//             slot (stmatrix), fence the async proxy and meet at a named barrier; one elected
//             math thread issues the block's TMA store. Before a slot is written again that
//             thread waits until its earlier copy has read it (and tells the others through
//             the next barrier); at the tile's end it waits for every read (pingpong: the
//             other warpgroup may then reuse the slots), and, once its turn has passed on, for
//             the writes themselves, then does the release add. No store thread, no handover.
//
// fp8 (FO_DTYPE 2, fo_gemm_run_scaled): a and b in float8 e4m3, both K-major; the math threads
// multiply each accumulator by its row's scale_a and its column's scale_b before any epilogue
// path sees it, so every epilogue stores scaled values in FO_OUT_DTYPE. Tensor-wise scales
// (both 1 float) are one product kept in a register; otherwise the tile's kBM row scales and
// kBN column scales (a tensor-wise one repeated) are copied into shared memory with cp.async
// before the tile's mainloop, which hides their latency, and read back in its epilogue.
// Block-wise scales (FO_FP8_BLOCK 1, fo_gemm_scales mode FO_SCALE_BLOCKS: 1x128 groups of a along
// K, 128x128 blocks of b) are applied in the main loop instead: each K tile (128 = one group)
// is multiplied into a fresh set of wgmma accumulators, which the math threads then add into
// their fp32 result times scale_a of the row and scale_b of the tile's 128 columns (a
// block-scaled accumulation, as CUTLASS's sm90 blockwise-scaled fp8 mainloop does it). The
// scales of each K tile ride the mainloop pipeline: warp 2 of the producer warpgroup loads
// them into the stage's slot (scale_a by one TMA load where its layout allows, else cp.async
// per row; scale_b by cp.async) and arrives on the stage's full barrier, so a stage is full
// when its A and B tiles and its scales are. Cooperative 128x128x128 or 128x256x128 (the
// second set of accumulators doubles their registers; a 256-column tile multiplies its two
// 128-column blocks of b one after the other).
//
// One configuration per compilation, chosen with -D macros (defaults in brackets):
//   FO_TILE_M/N/K [128/256/64], FO_CLUSTER_M/N [2/1], FO_DTYPE [0 = bf16, 1 = fp16, 2 = e4m3],
//   FO_OUT_DTYPE [bf16 for e4m3, else FO_DTYPE], FO_FP8_FAST_ACCUM [1] (e4m3: 1 accumulates in
//   the tensor cores' accumulators throughout, CUTLASS's FP8FastAccum schedules; 0 promotes them
//   into fp32 registers every 4 MMAs, which needs twice the accumulator registers),
//   FO_B_COL_MAJOR [1], FO_SCHEDULE [0 = cooperative, 1 = pingpong], FO_STAGES [0 = auto],
//   FO_EPILOGUE [0], FO_EPI_SLOTS [2] (tma: shared-memory slots, one column block each),
//   FO_SCALE_TMA [1] (block-wise: scale_a by TMA where its layout allows; 0: always cp.async),
//   FO_ITEM_PREFETCH [0] (1: the producer stages the next round's table rows in shared memory),
//   FO_WG_DEFER [0] (tma_wg: 1 signals each tile at its math group's next epilogue),
//   FO_BLOCK_LOCKSTEP [0] (block-wise: 1 runs both math warpgroups' K loops in step),
//   FO_BLOCK_PIPE [0] (block-wise, tile_n 128: 1 overlaps a K tile's promotion with the next's
//   wgmmas).
// -DFO_LAYOUT_SELFTEST builds a host program instead (main() at the end) that checks the
// accumulator layout and the shared-memory addressing of the tma and vec16 epilogues.
// Tiles whose width is not a multiple of 64 (128x160, 128x224) need wgmma shapes that CUTLASS
// declares only with this macro (m64n160k16, m64n224k16; without it the collective builder
// would take n32 instructions); other widths select the same instructions with it or without.
#if defined(FO_TILE_N) && FO_TILE_N % 64 != 0 && !defined(CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED)
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED 1
#endif
#include "cluster_launch.cuh"
#include "epilogue.cuh"
#include "gemm_abi.cuh"

#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/arch/reg_reconfig.h"
#include "cutlass/cuda_host_adapter.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/numeric_types.h"
#include "cutlass/pipeline/pipeline.hpp"

#include <mutex>

#ifndef FO_TILE_M
#define FO_TILE_M 128
#endif
#ifndef FO_TILE_N
#define FO_TILE_N 256
#endif
#ifndef FO_TILE_K
#define FO_TILE_K 64
#endif
#ifndef FO_CLUSTER_M
#define FO_CLUSTER_M 2
#endif
#ifndef FO_CLUSTER_N
#define FO_CLUSTER_N 1
#endif
#ifndef FO_SCHEDULE
#define FO_SCHEDULE 0
#endif
#ifndef FO_EPILOGUE
#define FO_EPILOGUE 0
#endif
#ifndef FO_EPI_SLOTS
#define FO_EPI_SLOTS 2
#endif
#ifndef FO_FP8_FAST_ACCUM
#define FO_FP8_FAST_ACCUM 1
#endif
#ifndef FO_FP8_BLOCK
#define FO_FP8_BLOCK 0  // 1: e4m3 with block-wise scales applied in the main loop (above)
#endif
#ifndef FO_SCALE_TMA
#define FO_SCALE_TMA 1  // block-wise: scale_a's K tiles by TMA where its layout allows (above)
#endif
#ifndef FO_WG_DEFER
#define FO_WG_DEFER 0  // tma_wg: 1 signals each tile at its math group's next epilogue (below)
#endif
#ifndef FO_BLOCK_PIPE
#define FO_BLOCK_PIPE 0  // block-wise, tile_n 128: 1 pipelines the K loop over two partials (below)
#endif
#ifndef FO_BLOCK_LOCKSTEP
#define FO_BLOCK_LOCKSTEP 0  // block-wise: 1 runs both math warpgroups' K loops in step (below)
#endif
#ifndef FO_ITEM_PREFETCH
#define FO_ITEM_PREFETCH 0  // 1: the producer stages the next round's table rows (below)
#endif
#ifndef FO_SCALE_WARP
#define FO_SCALE_WARP 0  // e4m3 tensor-/row-wise: 1: producer warp 2 stages each item's scales
#endif

namespace fo::sm90 {
using namespace cute;

constexpr int kBM = FO_TILE_M, kBN = FO_TILE_N, kBK = FO_TILE_K;
constexpr int kClusterM = FO_CLUSTER_M, kClusterN = FO_CLUSTER_N;
constexpr int kClusterSize = kClusterM * kClusterN;
constexpr bool kPingpong = FO_SCHEDULE == 1;
static_assert(FO_SCHEDULE == 0 || FO_SCHEDULE == 1, "FO_SCHEDULE: 0 cooperative, 1 pingpong");
static_assert(kClusterSize <= 8, "portable cluster size is at most 8");

enum Epilogue { kDirect = 0, kTma = 1, kVec16 = 2, kNone = 3, kTmaWg = 4 };
constexpr int kEpilogue = FO_EPILOGUE;
static_assert(kEpilogue >= 0 && kEpilogue <= 4, "FO_EPILOGUE: 0 direct, 1 tma, 2 vec16, 3 none, 4 tma_wg");
// tma_wg: the tma epilogue's slots and maps, but the math threads issue the TMA stores and the
// signal themselves (one elected thread per tile), with no store thread between
constexpr bool kWgStore = kEpilogue == kTmaWg;
constexpr bool kTmaStore = kEpilogue == kTma || kWgStore;
// FO_WG_DEFER=1 (tma_wg): the elected thread does not wait for a tile's writes after its
// epilogue; it signals the tile before its math group's next epilogue (and the last one after
// the loop), when the writes are long done, so that the write latency never holds the group's
// next main loop; each signal comes one main loop of that group later.
constexpr bool kWgDefer = kWgStore && FO_WG_DEFER;
static_assert(FO_WG_DEFER == 0 || kWgStore, "FO_WG_DEFER is for the tma_wg epilogue");
static_assert(FO_BLOCK_LOCKSTEP == 0 || FO_FP8_BLOCK, "FO_BLOCK_LOCKSTEP is for block-wise builds");
static_assert(!kTmaStore || kBN % 32 == 0, "the tma epilogue stores 64- or 32-column blocks");
static_assert(kEpilogue != kVec16 || kBN % 32 == 0, "the vec16 epilogue stores 32-column groups");
// tma: the columns of one block (one shared-memory slot, one TMA store): 64 (128-byte rows,
// the 128-byte swizzle), or 32 (64-byte rows, the 64-byte swizzle) where BN is not a multiple
// of 64.
constexpr int kColW = kBN % 64 == 0 && !kWgStore ? 64 : 32;  // tma_wg: 32-column blocks
constexpr int kColBlocks = kBN / kColW;
constexpr int kSlots = kTmaStore ? (FO_EPI_SLOTS < kColBlocks ? FO_EPI_SLOTS : kColBlocks) : 0;
static_assert(!kTmaStore || FO_EPI_SLOTS >= 1, "FO_EPI_SLOTS must be >= 1");
constexpr int kSlotRowBytes = kColW * 2;         // one row of a block: kColW 16-bit values
constexpr int kSlotBytes = kBM * kSlotRowBytes;  // kBM rows

constexpr bool kFp8 = FO_DTYPE == FO_DTYPE_E4M3;
static_assert(FO_DTYPE >= 0 && FO_DTYPE <= 2, "FO_DTYPE: 0 bf16, 1 fp16, 2 e4m3");
static_assert(FO_OUT_DTYPE == 0 || FO_OUT_DTYPE == 1, "FO_OUT_DTYPE: 0 bf16, 1 fp16");
static_assert(kFp8 || FO_OUT_DTYPE == FO_DTYPE, "16-bit builds write their input dtype");
static_assert(!kFp8 || FO_B_COL_MAJOR, "fp8 wgmma reads both operands K-major: b must be [N, K]");
// Element: the packed output (and, for 16-bit builds, a and b); ElementIn: a and b.
using Element = cute::conditional_t<FO_OUT_DTYPE == 0, cutlass::bfloat16_t, cutlass::half_t>;
using ElementIn = cute::conditional_t<kFp8, cutlass::float_e4m3_t, Element>;
constexpr int kAlignIn = 16 / int(sizeof(ElementIn));  // elements per 16 bytes (TMA)
using TileShape = Shape<Int<kBM>, Int<kBN>, Int<kBK>>;
using ClusterShape = Shape<Int<kClusterM>, Int<kClusterN>, _1>;
// e4m3 with fast accumulation: CUTLASS's FP8FastAccum schedules (the plain mainloop); without,
// the plain schedule names make the collective builder take its FP8 mainloop, which promotes.
constexpr bool kFastAccum = kFp8 && FO_FP8_FAST_ACCUM;
// Block-wise scales: the plain TMA mainloop collective loads A and B (its FP8FastAccum
// schedule); the math threads run their own K loop (block_scaled_mainloop).
constexpr bool kBlockScaled = kFp8 && FO_FP8_BLOCK;
static_assert(!FO_FP8_BLOCK || kFp8, "FO_FP8_BLOCK is for e4m3 builds");
static_assert(!kBlockScaled || (FO_SCHEDULE == 0 && kBM == 128 && kBK == FO_SCALE_BLOCK &&
                                (kBN == FO_SCALE_BLOCK || kBN == 2 * FO_SCALE_BLOCK) &&
                                FO_FP8_FAST_ACCUM),
              "block-wise scales: the cooperative schedule, 128 rows, one 128 group per K tile "
              "(tile_k = 128), one or two 128-column blocks of b per tile (tile_n = 128 or 256), "
              "FO_FP8_FAST_ACCUM 1");
// Block-wise: the 128-column blocks of b in one tile (each has its own scale_b per K tile); the
// main loop multiplies a K tile one column block at a time (block_scaled_mainloop).
constexpr int kScaleCols = kBlockScaled ? kBN / FO_SCALE_BLOCK : 1;
// Block-wise: whether scale_a may come by TMA (kernel_params decides per call from its layout).
// Never in all_to_all (FO_BLOCKS) builds: a destination block starts at any row, so a tile's
// box would start at an address that is not 16-byte aligned, and such a load faulted (illegal
// instruction) where the cp.async copies are right (csrc/cuda/NOTES.md).
constexpr bool kScaleTma = kBlockScaled && FO_SCALE_TMA && !gemm::kBlocks;
static_assert(FO_SCALE_TMA == 0 || FO_SCALE_TMA == 1, "FO_SCALE_TMA: 0 or 1");
using KernelSchedule = cute::conditional_t<
    kPingpong,
    cute::conditional_t<kFastAccum, cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8FastAccum,
                        cutlass::gemm::KernelTmaWarpSpecializedPingpong>,
    cute::conditional_t<kFastAccum, cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8FastAccum,
                        cutlass::gemm::KernelTmaWarpSpecializedCooperative>>;
using LayoutA = cutlass::layout::RowMajor;
using LayoutB = cute::conditional_t<FO_B_COL_MAJOR, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;

// Pingpong: the two math warpgroups take turns, mainloop then epilogue (depth 2, 2 groups).
using MathOrderBarrier = cutlass::OrderedSequenceBarrier<2, 2>;
// Math threads -> store/signal thread. tma: one step per column block, a slot each (the
// ring); otherwise one step per tile, 4 tiles may wait, so the math threads practically never
// block. Each math thread arrives after its own stores (release).
constexpr int kEpiSteps = kTmaStore ? kColBlocks : 1;
using EpiPipeline = cutlass::PipelineAsync<kTmaStore ? kSlots : 4>;

// Shared-memory slots of the tma epilogue, after the mainloop's buffers (whose size is a
// multiple of 1024 bytes, so the slots start 1024-byte aligned as the 128-byte swizzle wants).
struct alignas(1024) EpiSlots {
  uint8_t bytes[kSlots > 0 ? kSlots * kSlotBytes : 1];
};
struct EpiNone {};
using EpiStorage = cute::conditional_t<kTmaStore, EpiSlots, EpiNone>;

// fp8: the scales of one tile (rows past the tile's end, columns past N: zero), staged for its
// epilogue; two per math group, by the parity of the group's tile count (see stage_scales).
constexpr int kMathGroups = kPingpong ? 2 : 1;  // groups of math threads that share a tile
struct TileScales {
  float rows[kBM];
  float cols[kBN];
};
static_assert(sizeof(TileScales) == (kBM + kBN) * sizeof(float), "rows then columns, unpadded");
// FO_SCALE_WARP=1 (kScaleWarp): producer warp kScaleLoaderWarp copies each item's row and
// column scales into slot n % kScaleSlots of a ring (n: the item's ordinal in the CTA), tracked
// by the full barrier of the item's first stage, so the math threads neither load the item
// nor issue copies before a tile's main loop (the cooperative builds otherwise wait there for
// the item table's L2 round trip on every tile). A slot is written again kScaleSlots items
// later, after that item's first stage is acquired: as for the item slots (kItemSlots, below),
// the producer has then begun at most item n + 1 + stages while item n's math threads read
// their slot (static_assert below).
constexpr bool kScaleWarp = FO_SCALE_WARP && kFp8 && !kBlockScaled;
// FO_ITEM_PREFETCH=1: the producer warp copies the table rows of the CTA's next cluster round
// into shared memory (cp.async) while it loads the current round's tiles, and decodes each item
// from there, so that decoding, otherwise a dependent L2 or DRAM round trip before every tile's
// first TMA load (the table is read once per CTA and round, long after the host wrote it), no
// longer delays the next tile's first stage (the pingpong builds' math warps waited most for a
// tile's first stage); the pingpong math warpgroups, which decode their own items before their
// turn, prefetch their next item's rows into L2. (Not into L1: every signal's fences invalidate
// it.)
constexpr bool kItemPrefetch = FO_ITEM_PREFETCH != 0;
constexpr int kScaleSlots = kScaleWarp ? (kPingpong || kBK < 128 ? 8 : 6) : 1;
struct alignas(16) ScaleStorage {
  TileScales tile[kScaleWarp ? kScaleSlots : kMathGroups * 2];
};

// Entry i of a tile's TileScales (rows, then columns, as one array): what stage_scales copies
// there. A tensor-wise scale is repeated; rows past the tile's end, columns past N and a
// cluster's filler item get zeros (copy = false: nothing is read).
struct ScaleCopy {
  int64_t src;  // element of scale_a (i < kBM) or scale_b
  bool copy;
};
__host__ __device__ inline ScaleCopy scale_copy(const fo_gemm_scales& sc, const WorkTile& w, int i) {
  const bool row = i < kBM;
  const int at = row ? i : i - kBM;
  const bool in = w.valid && at < (row ? w.rows : w.cols);
  const bool per = row ? sc.a_per_row : sc.b_per_col;
  return ScaleCopy{in && per ? int64_t(row ? w.row0 : w.col0) + at : 0, in};
}
// Block-wise scales: the scales of one K tile of one tile, per mainloop stage (filled by the
// producer warpgroup's warp 2, read by the math threads after the stage's full barrier).
constexpr int kScaleStages = 8;  // at least the mainloop's stages (static_assert below)
struct alignas(128) BlockScaleStage {  // (128: a TMA load's destination)
  float a[kBM];  // scale_a of the tile's rows for this group of 128 k (rows past M: 0; cp.async
                 // copies: rows past the tile's end 0 too)
  float b[4];    // b[c], c < kScaleCols: scale_b of this group and the tile's column block c
};               // (a block past N: 0)
static_assert(kScaleCols <= 4, "scale_b slots of a stage");
struct alignas(128) BlockScaleStorage {
  BlockScaleStage stage[kScaleStages];
};
using Fp8ScaleStorage = cute::conditional_t<kBlockScaled, BlockScaleStorage, ScaleStorage>;

// The epilogue's shared memory: the tma slots, and for fp8 the scales (a specialisation, so
// that 16-bit builds keep their layout and size).
template <bool Scales>
struct EpiShared {
  EpiStorage slots;
};
template <>
struct EpiShared<true> {
  EpiStorage slots;
  Fp8ScaleStorage scales;
};

// The items the math threads take, decoded by the producer: it writes item n's WorkTile into
// slot n % kItemSlots before it loads the item's first K tile, and the math threads read it
// after the tile's main loop, which waited for that stage (the stage's full barrier orders the
// write before their reads). So the math threads never wait for the item table's L2 round trip
// before a tile's first wgmma, nor keep its fields in registers through the main loop. (fp8
// row-wise scales are staged before the main loop from the table item, as before: from the
// slot they would first wait for the stage, which cost one-wave shapes up to 4%.)
// A slot is written again kItemSlots items later, when the producer acquires that item's first
// stage: while the math threads of item n are still in its main loop or just past it, the
// stages released are at most those of items n and n + 1 (pingpong: the other warpgroup's),
// so the producer, at most `stages` K tiles ahead, has begun at most item n + 1 + stages
// (kItemSlots >= stages + 2: static_assert below).
// Cooperative builds only: pingpong's math warpgroups wait for each other's turn before a
// tile's main loop anyway, and the pingpong and block-scaled builds spilled with the slots
// (ptxas, nvcc 13.0), so they decode their items from the table as before.
constexpr int kItemSlots = 10;
constexpr bool kItemFromSlot = !kPingpong && !kBlockScaled;
// kItemPrefetch: the producer warp's copy of one cluster round's table rows and groups, two
// rounds (stage_round): the next round's land while the current one's tiles are loaded.
struct alignas(16) StagedRound {
  int64_t rows[kClusterSize][4];
  int32_t group[kClusterSize];
};
template <bool Staged>
struct alignas(16) ItemArea {
  WorkTile tile[kItemSlots];
};
template <>
struct alignas(16) ItemArea<true> {
  WorkTile tile[kItemSlots];
  StagedRound round[2];
};
using ItemSlots = ItemArea<kItemPrefetch>;

constexpr int kCarveout = int(sizeof(ItemSlots)) + 16 +
                          int(sizeof(typename MathOrderBarrier::SharedStorage) +
                              sizeof(typename EpiPipeline::SharedStorage)) + 32 +
                          (kTmaStore ? int(sizeof(EpiSlots)) + 1024 : 0) +
                          (kFp8 ? int(sizeof(Fp8ScaleStorage) + alignof(Fp8ScaleStorage)) : 0);

using Stages = cute::conditional_t<FO_STAGES == 0,
                                   cutlass::gemm::collective::StageCountAutoCarveout<kCarveout>,
                                   cutlass::gemm::collective::StageCount<FO_STAGES>>;

using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementIn, LayoutA, kAlignIn, ElementIn,
    LayoutB, kAlignIn, float, TileShape, ClusterShape, Stages, KernelSchedule>::CollectiveOp;
using TiledMma = typename Mainloop::TiledMma;
// Block-wise scales: the wgmmas of one 128-column block of the tile (the TiledMma of a
// 128 x 128 x 128 tile, the cooperative schedule's two warpgroups along M). A 128x256 tile's
// K tile is two batches of them, each into the same 64 partial accumulators per thread, so the
// math threads hold 128 + 64 accumulators (two full m64n256 fragments would be 256 and spill).
// (A template, so that other builds never instantiate it.)
template <bool Block, class = void>
struct ColBlockMma {
  using type = TiledMma;
};
template <class V>
struct ColBlockMma<true, V> {
  using type = decltype(make_tiled_mma(
      GMMA::ss_op_selector<ElementIn, ElementIn, float, Shape<Int<kBM>, Int<FO_SCALE_BLOCK>, Int<kBK>>,
                           GMMA::Major::K, GMMA::Major::K>(),
      Layout<Shape<_2, _1, _1>>{}));
};
using ColMma = typename ColBlockMma<kBlockScaled>::type;
static_assert(!kBlockScaled || int(Mainloop::DispatchPolicy::Stages) <= kScaleStages,
              "block-wise scales: more mainloop stages than scale slots (raise kScaleStages)");
// Producer arrivals on a stage's full barrier: the TMA leader's, and for block-wise scales
// one per lane of the warp that copies the stage's scales (cp.async ... arrive.noinc).
constexpr int kScaleLoaderWarp = 2;  // of the producer warpgroup (0: TMA loads, 1: store/signal)
// (scale_a by TMA: the scale warp's lane 0 alone, after its scale_b copies have landed; the
// TMA's bytes count in the stage's transaction bytes.)
constexpr int kScaleWarpArrivals = kBlockScaled || kScaleWarp ? 32 : 0;
// row_scales: a kScaleWarp build with row- or column-wise scales (the scale warp runs).
__host__ __device__ constexpr int stage_producers(bool scale_tma, bool row_scales = false) {
  return int(Mainloop::NumProducerThreadEvents) +
         (kBlockScaled ? (scale_tma ? 1 : kScaleWarpArrivals) : row_scales ? kScaleWarpArrivals : 0);
}
static_assert(!kScaleWarp || int(Mainloop::DispatchPolicy::Stages) + 2 <= kScaleSlots,
              "more mainloop stages than scale slots allow (raise kScaleSlots)");
static_assert(int(Mainloop::DispatchPolicy::Stages) + 2 <= kItemSlots,
              "more mainloop stages than item slots allow (raise kItemSlots)");
using MainloopPipeline = typename Mainloop::MainloopPipeline;
using PipelineState = typename Mainloop::PipelineState;

constexpr int kThreads = 384;  // one producer warpgroup, two math warpgroups
constexpr int kTileThreads = kPingpong ? 128 : 256;  // math threads that share one tile
static_assert(int(size(TiledMma{})) == kTileThreads, "unexpected TiledMma size");
constexpr int kAccRegs = kBM * kBN / kTileThreads;
constexpr int kLoadRegs = kAccRegs >= 208 ? 24 : 40;
constexpr int kMathRegs = kAccRegs >= 208 ? 240 : 232;

// ---- accumulator fragment --------------------------------------------------------------------
// The wgmma accumulators of one thread: kMmaM row blocks (each warp covers 16 rows of a block;
// the math warps of a tile stack their blocks), each with 2 row halves (rows +0 and +8) and
// kBN / 8 chunks of 8 columns, 2 values per chunk (columns 2 * (lane % 4) and + 1).
// word(m, h, j) is the index of the first of those 2 values. FO_LAYOUT_SELFTEST checks this
// against CUTLASS's partition of the tile for every thread.
constexpr int kMmaM = kBM / (kTileThreads / 2);
static_assert(kMmaM * (kTileThreads / 2) == kBM, "row blocks x rows per block = tile rows");
struct FragWord {
  __host__ __device__ constexpr int operator()(int m, int h, int j) const {
    return 2 * h + 4 * j + m * (kBN / 2);
  }
  // The tile row and column of value v (0, 1) of word(m, h, j) of lane `lane`, given the first
  // row of the lane's warp in row block m: what the self-test checks and the fp8 scaling uses.
  __host__ __device__ static constexpr int row(int row_base, int h, int lane) {
    return row_base + 8 * h + lane / 4;
  }
  __host__ __device__ static constexpr int col(int j, int v, int lane) { return 8 * j + 2 * (lane % 4) + v; }
};

// Byte offset, within a slot, of 16-bit column `col` (0..kColW-1) of `row`, given the slot's
// shared address: rows of kSlotRowBytes whose 16-byte chunks are permuted by the TMA's swizzle
// of that span (128 bytes: chunk ^= address bits 7..9; 64 bytes: chunk ^= bits 7..8). Taking
// the bits from the address itself keeps the layout the one the TMA reads whatever the slot's
// alignment.
__host__ __device__ constexpr uint32_t slot_offset(uint32_t slot_addr, int row, int col) {
  constexpr uint32_t chunks = uint32_t(kSlotRowBytes) / 16u - 1u;  // 7 or 3
  const uint32_t row_addr = uint32_t(row) * uint32_t(kSlotRowBytes);
  return row_addr + ((((uint32_t(col) >> 3) ^ (((slot_addr + row_addr) >> 7) & chunks)) << 4) |
                     ((uint32_t(col) & 7u) << 1));
}

// stmatrix .x4 of row block m, chunk pair p (0 .. kColW / 16 - 1) of column block cb: matrices
// k = 0..3 are (row half k & 1, chunk (kColW / 8) cb + 2 p + (k >> 1)); lane l supplies the
// address of row l % 8 of matrix l / 8 and the data word of its own quad position in each
// matrix.
struct StsmStep {
  int row, col;  // tile row and slot column (0..kColW-1) whose address this lane supplies
};
__host__ __device__ constexpr StsmStep stsm_address(int row_base, int p, int lane) {
  const int k = lane >> 3;
  return StsmStep{row_base + 8 * (k & 1) + (lane & 7), 8 * (2 * p + (k >> 1))};
}

struct Params {
  typename Mainloop::Params mainloop;
  ItemTable table;
  Element* packed;
  int32_t* counters;
  uint64_t* monitor;
  int K;
  int tma_store;  // kTmaOff, kTmaPacked or kTmaRows: which tiles the TMA stores, and how
  cute::TmaDescriptor store_map;  // kTmaPacked: the packed buffer as [numel / kBN, kBN], box
                                  // kColW x kBM; kTmaRows: the buffer as [R][N] (row stride
                                  // ldo), box kColW x kBM
  const int32_t* item_wait;       // allgather: the arrival flag of each item (null: no waits)
  const uint32_t* arrive_flags;
  int num_flags;
  fo_gemm_scales scales;          // fp8 builds: scale_a and scale_b (flashoverlap_cuda.h)
  int scale_tma;                  // block-wise: scale_a's K tiles by TMA (scale_map)
  cute::TmaDescriptor scale_map;  // scale_a as [groups][M] (M contiguous), box kBM x 1
};

struct SharedStorage {
  struct alignas(kTmaStore ? 1024 : 128) Tensors {
    typename Mainloop::TensorStorage mainloop;
    EpiShared<kFp8> epi;
  } tensors;
  ItemSlots items;
  struct alignas(16) Pipelines {
    alignas(16) typename Mainloop::PipelineStorage mainloop;
    alignas(16) typename MathOrderBarrier::SharedStorage math_order;
    alignas(16) typename EpiPipeline::SharedStorage epi;
  } pipelines;
};
constexpr int kSmemBytes = int(sizeof(SharedStorage));
static_assert(kSmemBytes <= 232448, "shared memory: lower FO_STAGES or FO_EPI_SLOTS");

// TMA store modes. kTmaPacked: full tiles whose packed slot starts on a row of the
// [numel / kBN, kBN] view. kTmaRows (tiles written as rows, row stride ldo): at (column, row
// offset / ldo) of the [R][N] view, whose bounds clip a tile's columns at N and its rows at R;
// a tile of fewer than kBM rows only where it ends the buffer.
enum TmaMode { kTmaOff = 0, kTmaPacked = 1, kTmaRows = 2 };

// Whether a tile goes through the TMA store: the math threads and the store thread decide
// alike from the same item.
__host__ __device__ inline bool tma_tile(const WorkTile& w, int tma_store, const ItemTable& t) {
  if (!kTmaStore || !w.valid) return false;
  if (tma_store == kTmaRows)
    return w.rows == kBM || w.offset / t.ldo + w.rows == t.packed_numel / t.ldo;
  return tma_store == kTmaPacked && w.rows == kBM && w.cols == kBN && w.offset % kBN == 0;
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL) && !defined(FO_LAYOUT_SELFTEST)
#define FO_SM90_DEVICE 1
#endif

#ifdef FO_SM90_DEVICE
__device__ inline void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.x4.m8n8.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// Writes column block cb of this thread's accumulators into the slot at shared address `slot`.
template <int CB, class Acc>
__device__ inline void stage_column_block(const Acc& acc, uint32_t slot, const int (&row_base)[kMmaM],
                                          int lane) {
  constexpr FragWord word{};
#pragma unroll
  for (int m = 0; m < kMmaM; ++m) {
#pragma unroll
    for (int p = 0; p < kColW / 16; ++p) {
      uint32_t r[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int i = word(m, k & 1, (kColW / 8) * CB + 2 * p + (k >> 1));
        r[k] = pack2<Element>(acc(i), acc(i + 1));
      }
      const StsmStep s = stsm_address(row_base[m], p, lane);
      stmatrix_x4(slot + slot_offset(slot, s.row, s.col), r[0], r[1], r[2], r[3]);
    }
  }
}

// Math threads, tma epilogue: every column block through the slot ring (nothing is written for
// a tile that takes the direct path or is a cluster's filler, but the steps are the same, so
// both sides of the ring always agree on its position).
template <int CB = 0, class Acc>
__device__ inline void stage_tile(const Acc& acc, bool tma, EpiPipeline& epi,
                                  typename EpiPipeline::PipelineState& state, uint32_t slots,
                                  const int (&row_base)[kMmaM], int lane) {
  if constexpr (CB < kColBlocks) {
    epi.producer_acquire(state);
    if (tma) {
      stage_column_block<CB>(acc, slots + state.index() * kSlotBytes, row_base, lane);
      cutlass::arch::fence_view_async_shared();  // make the writes visible to the TMA's reads
    }
    epi.producer_commit(state);
    ++state;
    stage_tile<CB + 1>(acc, tma, epi, state, slots, row_base, lane);
  }
}

// Math threads, tma epilogues: a valid tile the TMA does not take is stored directly (rows of
// ldo in place, else packed). Returns whether the TMA takes it (tma_tile).
template <class Acc, class Coord>
__device__ inline bool store_unless_tma(const Params& p, const WorkTile& w, const Acc& acc,
                                        const Coord& coord) {
  const bool tma = tma_tile(w, p.tma_store, p.table);
  if (w.valid && !tma) {
    Element* dst = p.packed + w.offset;
    if (p.table.ldo) store_tile_rows(acc, coord, dst, w.rows, w.cols, p.table.ldo);
    else store_tile<Element, kBM, kBN>(acc, coord, dst, w.rows, w.cols);
  }
  return tma;
}

// Math threads, every epilogue: the tile's direct stores (all of them, or those the TMA does not
// take), then the handover to the store/signal thread.
template <class Acc, class Coord>
__device__ inline void epilogue(const Params& p, const WorkTile& w, const Acc& acc, const Coord& coord,
                                EpiPipeline& epi, typename EpiPipeline::PipelineState& state,
                                uint32_t slots, const int (&row_base)[kMmaM], int lane) {
  Element* dst = p.packed + w.offset;
  const bool full = w.valid && w.rows == kBM && w.cols == kBN;
  const int64_t ldo = p.table.ldo;  // != 0: in place into a row-major out (allgather)
  if constexpr (kTmaStore) {
    const bool tma = store_unless_tma(p, w, acc, coord);
    stage_tile(acc, tma, epi, state, slots, row_base, lane);
  } else {
    epi.producer_acquire(state);
    if (ldo) {
      if (w.valid) store_tile_rows(acc, coord, dst, w.rows, w.cols, ldo);
    } else if (kEpilogue == kVec16 && full && (w.offset & 7) == 0 && (reinterpret_cast<uintptr_t>(p.packed) & 15) == 0) {
      store_full_tile_vec16<Element, kBN, kMmaM>(acc, FragWord{}, row_base, lane, dst);
    } else if (w.valid && !(kEpilogue == kNone && full)) {
      store_tile<Element, kBM, kBN>(acc, coord, dst, w.rows, w.cols);
    }
    // Each thread's stores come before its arrive (release, CTA scope); the signal thread's
    // wait (acquire) then its release add at GPU scope publish them all.
    asm volatile("" ::: "memory");
    epi.producer_commit(state);
    ++state;
  }
}

// ---- fp8: scales ------------------------------------------------------------------------------
__device__ inline void cp_async_f32(uint32_t smem, const float* src, bool copy) {
  // src-size 0: nothing is read, the 4 bytes are zero-filled
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem), "l"(src),
               "r"(copy ? 4 : 0)
               : "memory");
}

// Thread t of kStride threads: copies its entries (t, t + kStride, ...) of a tile's row scales
// (scale_a) and column scales (scale_b) into `s` with cp.async (scale_copy). Used by the math
// threads (stage_scales) and by the scale warp's lanes (load_row_scales).
template <int kStride>
__device__ inline void copy_tile_scales(const fo_gemm_scales& sc, const WorkTile& w, TileScales& s, int t) {
  constexpr int kPerThread = (kBM + kBN + kStride - 1) / kStride;
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    const int i = t + k * kStride;
    if (i >= kBM + kBN) break;
    const ScaleCopy c = scale_copy(sc, w, i);
    cp_async_f32(cute::cast_smem_ptr_to_uint(reinterpret_cast<float*>(&s) + i),
                 (i < kBM ? sc.a : sc.b) + c.src, c.copy);
  }
}
// Math thread t of a tile's kTileThreads, before the tile's mainloop: its copies, which the
// mainloop hides.
__device__ inline void stage_scales(const fo_gemm_scales& sc, const WorkTile& w, TileScales& s, int t) {
  copy_tile_scales<kTileThreads>(sc, w, s, t);
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// After the tile's mainloop: this thread's copies have landed, then every math thread of the
// tile has passed here (named barrier `group`), so each sees every copy. Two buffers per group
// alternate by tile: a thread that stages tile t + 2 has passed tile t + 1's barrier, which
// every thread reaches only after reading tile t's scales.
__device__ inline void await_scales(int group) {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
  cutlass::arch::NamedBarrier::sync(kTileThreads, group);
}

// Multiplies each accumulator by the scales of its row and column (FragWord's layout).
template <class Acc>
__device__ inline void apply_scales(Acc& acc, const TileScales& s, const int (&row_base)[kMmaM], int lane) {
  constexpr FragWord word{};
#pragma unroll
  for (int m = 0; m < kMmaM; ++m) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float ra = s.rows[FragWord::row(row_base[m], h, lane)];
#pragma unroll
      for (int j = 0; j < kBN / 8; ++j) {
        const float2 cb = *reinterpret_cast<const float2*>(&s.cols[FragWord::col(j, 0, lane)]);
        const int i = word(m, h, j);
        acc(i) = acc(i) * cb.x * ra;
        acc(i + 1) = acc(i + 1) * cb.y * ra;
      }
    }
  }
}

// This math group's scale buffer for its tile of the given parity (a template, so that 16-bit
// builds, whose shared memory has none, and block-wise ones, whose scales are per stage, never
// name it).
template <class Epi>
__device__ inline TileScales* scale_buffer(Epi& epi, int group, int parity) {
  if constexpr (kFp8 && !kBlockScaled) return &epi.scales.tile[group * 2 + parity];
  else return nullptr;
}
// kScaleWarp: the slot of the CTA's item `ordinal`.
template <class Epi>
__device__ inline TileScales* scale_slot(Epi& epi, int ordinal) {
  if constexpr (kScaleWarp) return &epi.scales.tile[ordinal % kScaleSlots];
  else return nullptr;
}

template <class Acc>
__device__ inline void apply_scale(Acc& acc, float scale) {
#pragma unroll
  for (int i = 0; i < int(size(acc)); ++i) acc(i) *= scale;
}

__device__ inline void tma_store_2d(const void* map, uint32_t smem, int col, int row) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"(
                   reinterpret_cast<uint64_t>(map)), "r"(smem), "r"(col), "r"(row)
               : "memory");
}
// Whether column block cb of tile w lies wholly past N (kTmaRows only: a packed tile is whole);
// such blocks are a suffix of the tile's.
__device__ inline bool block_past_n(const Params& p, const WorkTile& w, int cb) {
  return p.tma_store == kTmaRows && w.col0 + cb * kColW >= p.table.N;
}
// Column block cb of tile w from the slot at `smem`, in the map's mode; false when there is
// nothing to store (block_past_n).
__device__ inline bool tma_store_block(const Params& p, const WorkTile& w, int cb, uint32_t smem) {
  if (block_past_n(p, w, cb)) return false;
  if (p.tma_store == kTmaRows) {
    tma_store_2d(&p.store_map, smem, w.col0 + cb * kColW, int(w.offset / p.table.ldo));
    return true;
  }
  tma_store_2d(&p.store_map, smem, cb * kColW, int(w.offset / kBN));
  return true;
}

// allgather: the producer waits until item i's rows of A have arrived, before it loads
// anything of the item. The acquire (wait_item_rows) orders the arrival before this thread's
// generic-proxy operations; the proxy fence then orders it before the TMA loads (async proxy)
// that this thread issues next, so they read the arrived rows, not what was there before.
__device__ inline void wait_for_rows(const Params& p, int64_t i) {
  wait_item_rows(p.item_wait, p.arrive_flags, p.num_flags, i);
  asm volatile("fence.proxy.async.global;" ::: "memory");
}
__device__ inline void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
template <int N>
__device__ inline void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
// Waits until the bulk stores have been performed (not just read their source), then orders
// them before this thread's later generic-proxy operations (the release add).
__device__ inline void bulk_wait_written() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// ---- tma_wg epilogue: the math threads store their own tiles ----------------------------------
// The named barrier of math group g's tile threads (CUTLASS user ids; 0-3 are the row-wise
// scales' and the block-scaled loop's).
[[maybe_unused]] constexpr int kWgEpiBarrier = 4;  // 4 and 5
template <int CB = 0, class Acc>
__device__ inline void wg_store_blocks(const Params& p, const WorkTile& w, bool tma, const Acc& acc,
                                       uint32_t slots, const int (&row_base)[kMmaM], int lane,
                                       bool leader, uint32_t barrier) {
  if constexpr (CB < kColBlocks) {
    // (uniform; the stored blocks are a prefix, so the elected thread's bulk groups count blocks)
    if (!tma || block_past_n(p, w, CB)) return;
    const uint32_t slot = slots + (CB % kSlots) * kSlotBytes;
    if constexpr (CB >= kSlots) {  // the slot's earlier block must have been read
      if (leader) bulk_wait_read<kSlots - 1>();
      cutlass::arch::NamedBarrier::sync(kTileThreads, barrier);
    }
    stage_column_block<CB>(acc, slot, row_base, lane);
    cutlass::arch::fence_view_async_shared();  // the writes, visible to the TMA's reads
    cutlass::arch::NamedBarrier::sync(kTileThreads, barrier);
    if (leader) {
      tma_store_block(p, w, CB, slot);
      bulk_commit();
    }
    wg_store_blocks<CB + 1>(p, w, tma, acc, slots, row_base, lane, leader, barrier);
  }
}
// Math threads, tma_wg: the tile's direct stores (a tile the TMA does not take), then its TMA
// blocks; returns with every slot read (the elected thread waited, then the barrier), so the
// slots are free for the next tile, whichever math group takes it.
template <class Acc, class Coord>
__device__ inline void wg_epilogue(const Params& p, const WorkTile& w, const Acc& acc, const Coord& coord,
                                   uint32_t slots, const int (&row_base)[kMmaM], int lane,
                                   bool leader, uint32_t barrier) {
  const bool tma = store_unless_tma(p, w, acc, coord);
  wg_store_blocks(p, w, tma, acc, slots, row_base, lane, leader, barrier);
  if (leader && tma) bulk_wait_read<0>();
  // every thread's direct stores, and the elected thread's reads, before any signal or reuse
  cutlass::arch::NamedBarrier::sync(kTileThreads, barrier);
}
// The elected math thread, after wg_epilogue (pingpong: after passing the turn on): waits until
// the tile's TMA writes are performed, then publishes the tile (release add at GPU scope, after
// a GPU-scope fence that orders the other math threads' direct stores, which the barrier
// ordered before this thread's, ahead of it).
__device__ inline void wg_signal(const Params& p, int group, int64_t item, int cta) {
  if (item < 0 || item >= p.table.num_items) return;
  bulk_wait_written();
  __threadfence();
  if (p.counters) signal_counter(p.counters + group);
  record_monitor(p.monitor, item, cta);
}
#endif  // FO_SM90_DEVICE

// The item this CTA (cluster rank `rank`) computes in the cluster round that starts at `base`,
// for the producer: checked, including the cluster rule (header). Past the end of the table a
// CTA still joins its cluster's multicast loads with a filler item (valid = false) whose rows
// and columns match its cluster peers.
// (decode(j): item base + j, checked; cluster_item reads the table, the kItemPrefetch
// producer its staged copy of the round.)
template <class Decode>
__device__ inline WorkTile cluster_item_with(const ItemTable& t, int64_t base, int rank, Decode decode) {
  const int rm = rank % kClusterM, rn = rank / kClusterM;
  if (base + rank < t.num_items) {
    WorkTile w = decode(rank);
    if constexpr (kClusterSize > 1) {
      // Multicast: A is shared along the cluster's N mode, B along its M mode.
      if (rn > 0 && decode(rm).row0 != w.row0) __trap();
      if (rm > 0 && decode(rn * kClusterM).n_blk != w.n_blk) __trap();
    }
    return w;
  }
  WorkTile w{};
  w.valid = false;
  if (base + rm < t.num_items) w.row0 = decode(rm).row0;
  if (base + rn * kClusterM < t.num_items) w.n_blk = decode(rn * kClusterM).n_blk;
  return w;
}
__device__ inline WorkTile cluster_item(const ItemTable& t, int64_t base, int rank) {
  return cluster_item_with(t, base, rank, [&](int j) {
    return decode_item<kBM, kBN, true, gemm::kBlocks>(t, base + j);
  });
}

#ifdef FO_SM90_DEVICE
// kItemPrefetch, producer warp: lanes 0 .. kClusterSize - 1 copy the table rows and groups of
// the round at `base` into `r` (cp.async, 8 and 4 bytes; entries past the table zero-filled,
// nothing read), then every lane commits a group (empty for the other lanes).
__device__ inline void stage_round(const ItemTable& t, int64_t base, StagedRound& r, int lane) {
  if (lane < kClusterSize) {
    const int64_t i = base + lane;
    const bool in = i < t.num_items;
    const int64_t* row = t.items + 4 * (in ? i : 0);
#pragma unroll
    for (int k = 0; k < 4; ++k)
      asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(
                       cute::cast_smem_ptr_to_uint(&r.rows[lane][k])),
                   "l"(row + k), "r"(in ? 8 : 0)
                   : "memory");
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(
                     cute::cast_smem_ptr_to_uint(&r.group[lane])),
                 "l"(t.item_group + (in ? i : 0)), "r"(in ? 4 : 0)
                 : "memory");
  }
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// The producer's item of the round at `base` (its ordinal-th), kItemPrefetch: stages the next
// round's rows first (at the first round, this round's before them), then waits for this
// round's and decodes from them. The warp barrier before the copies orders every lane's reads
// of that buffer two rounds ago before it is written again.
template <class Slots>
__device__ inline WorkTile producer_item(const ItemTable& t, int64_t base, int64_t round_stride,
                                         int rank, int ordinal, Slots& items, int lane) {
  if constexpr (kItemPrefetch) {
    if (ordinal == 0) stage_round(t, base, items.round[0], lane);
    __syncwarp();
    stage_round(t, base + round_stride, items.round[(ordinal + 1) & 1], lane);
    asm volatile("cp.async.wait_group 1;\n" ::: "memory");
    __syncwarp();
    // the table with the round's rows in place of its own: its row j is item base + j's
    // (decode_item reads row i and group i, and takes nothing else from i)
    ItemTable round = t;
    round.items = &items.round[ordinal & 1].rows[0][0];
    round.item_group = items.round[ordinal & 1].group;
    return cluster_item_with(t, base, rank, [&](int j) {
      return decode_item<kBM, kBN, true, gemm::kBlocks>(round, j);
    });
  } else {
    return cluster_item(t, base, rank);
  }
}
// kItemPrefetch, a pingpong math warpgroup: its next item's table row and group into L2.
__device__ inline void prefetch_item_l2(const ItemTable& t, int64_t i) {
  if constexpr (kItemPrefetch) {
    if (i >= t.num_items) return;
    asm volatile("prefetch.L2 [%0];" ::"l"(t.items + 4 * i));
    asm volatile("prefetch.L2 [%0];" ::"l"(t.item_group + i));
  }
}
#endif  // FO_SM90_DEVICE

// The same item for the threads that only store or signal it: unchecked (the producer checked
// it before loading its operands), so the loads overlap the mainloop.
__device__ inline WorkTile stored_item(const ItemTable& t, int64_t base, int rank) {
  if (base + rank < t.num_items) return decode_item<kBM, kBN, false, gemm::kBlocks>(t, base + rank);
  WorkTile w{};
  w.valid = false;
  return w;
}

#ifdef FO_SM90_DEVICE
// ---- fp8 block-wise scales: the main loop ------------------------------------------------------
// The block-scale storage of the epilogue's shared memory (a template, so that builds without
// it never name it).
template <class Epi>
__device__ inline BlockScaleStage* block_scale_stages(Epi& epi) {
  if constexpr (kBlockScaled) return epi.scales.stage;
  else return nullptr;
}

// Producer warp kScaleLoaderWarp, lane `lane`: for every K tile of every item of this CTA, in
// the order the TMA warp loads them, waits for the stage to be free, loads the tile's scale_a
// of group kt (kBM rows) and scale_b of group kt and the tile's column blocks into the stage's
// slot, and arrives on the stage's full barrier once its copies have landed (so the stage fills
// only when the scales are there). scale_a:
// - p.scale_tma (scale_a M-contiguous, its groups 16 bytes apart): lane 0 alone adds the box's
//   bytes to the stage's transaction count and loads the kBM rows from row0 with one TMA load
//   (rows past M zero-filled; never in all_to_all builds, whose tiles start at any row: see
//   kScaleTma), then copies scale_b and arrives (cp.async ... noinc);
// - otherwise each lane copies every 32nd row with 4-byte cp.async (rows past the tile's end
//   and a filler item's zero-filled, nothing read) and arrives.
// A column block past N gets scale_b 0 and reads nothing.
__device__ inline void load_block_scales(const Params& p, MainloopPipeline& pipeline,
                                         BlockScaleStage* stages, int64_t first_base,
                                         int64_t round_stride, int rank, int k_tiles, int lane) {
  const fo_gemm_scales& sc = p.scales;
  const bool tma = kScaleTma && p.scale_tma;
  if (tma && lane != 0) return;
  PipelineState write_state = cutlass::make_producer_start_state<MainloopPipeline>();
  for (int64_t base = first_base; base < p.table.num_items; base += round_stride) {
    const WorkTile w = stored_item(p.table, base, rank);
    const float* a_rows = sc.a + (w.valid ? int64_t(w.row0) * sc.a_stride[0] : 0);
    const float* b_col = sc.b + (w.valid ? int64_t(w.n_blk) * kScaleCols * sc.b_stride[1] : 0);
#pragma unroll 1
    for (int kt = 0; kt < k_tiles; ++kt) {
      pipeline.producer_acquire(write_state);
      BlockScaleStage& st = stages[write_state.index()];
      if (tma) {
        if constexpr (kScaleTma) {
          uint64_t* full = pipeline.producer_get_barrier(write_state);
          cutlass::arch::ClusterTransactionBarrier::expect_transaction(full, uint32_t(sizeof(st.a)));
          cute::SM90_TMA_LOAD_2D::copy(&p.scale_map, full,
                                       uint64_t(cute::TMA::CacheHintSm90::EVICT_LAST), st.a,
                                       w.row0, kt);
        }
      } else {
#pragma unroll
        for (int i = lane; i < kBM; i += 32) {
          const bool copy = w.valid && i < w.rows;
          cp_async_f32(cute::cast_smem_ptr_to_uint(&st.a[i]),
                       copy ? a_rows + int64_t(i) * sc.a_stride[0] + int64_t(kt) * sc.a_stride[1] : sc.a,
                       copy);
        }
      }
      // column block c of the tile, by lane c (TMA: lane 0 copies every block)
#pragma unroll
      for (int c = tma ? 0 : lane; c < kScaleCols; c += tma ? 1 : 32) {
        const bool copy = w.valid && c * FO_SCALE_BLOCK < w.cols;
        cp_async_f32(cute::cast_smem_ptr_to_uint(&st.b[c]),
                     copy ? b_col + int64_t(c) * sc.b_stride[1] + int64_t(kt) * sc.b_stride[0] : sc.b,
                     copy);
      }
      pipeline.producer_commit(write_state, cutlass::arch::cpasync_barrier_arrive_noinc);
      ++write_state;
    }
  }
}

// Producer warp kScaleLoaderWarp of a kScaleWarp build with row- or column-wise scales, lane
// `lane`: for every item of this CTA, in the order the TMA warp loads them, and every K tile of
// it, waits for the stage to be free and arrives on its full barrier once this lane's copies
// have landed (cp.async ... noinc); at the item's first K tile it first copies the item's
// scales (scale_copy: a tensor-wise one repeated, rows past the tile's end, columns past N and
// a filler item's zero-filled) into the item's slot. So the math threads, which wait for every
// stage of the item, see the scales after its main loop.
template <class Epi>
__device__ inline void load_row_scales(const Params& p, MainloopPipeline& pipeline, Epi& epi,
                                       int64_t first_base, int64_t round_stride, int rank,
                                       int k_tiles, int lane) {
  PipelineState write_state = cutlass::make_producer_start_state<MainloopPipeline>();
  int ordinal = 0;
  for (int64_t base = first_base; base < p.table.num_items; base += round_stride, ++ordinal) {
    const WorkTile w = stored_item(p.table, base, rank);
#pragma unroll 1
    for (int kt = 0; kt < k_tiles; ++kt) {
      pipeline.producer_acquire(write_state);
      if (kt == 0) copy_tile_scales<32>(p.scales, w, *scale_slot(epi, ordinal), lane);
      pipeline.producer_commit(write_state, cutlass::arch::cpasync_barrier_arrive_noinc);
      ++write_state;
    }
  }
}

// FO_BLOCK_PIPE: the block-scaled K loop with two partial fragments (block_scaled_mainloop)
constexpr bool kBlockPipe = kBlockScaled && FO_BLOCK_PIPE;
static_assert(FO_BLOCK_PIPE == 0 || (kBlockScaled && kScaleCols == 1),
              "FO_BLOCK_PIPE is for block-wise builds with one column block (tile_n = 128)");
// Named barriers (CUTLASS user ids, tile parity added) with which the second math warpgroup of
// a block-scaled build starts each tile's K loop once the first has finished its first K tile.
[[maybe_unused]] constexpr int kBlockOffsetBarrier = 2;  // 2 and 3 (0 and 1: the row-wise scales' groups)

// Math threads (cooperative: both warpgroups share the tile): the tile's K loop with block-wise
// scales. Per K tile (one group of 128 k): wait for the stage (A, B and the scales); then per
// 128-column block c of the tile (kScaleCols: 1 or 2), run its wgmmas into `part` from zero,
// read this thread's row scales and the block's column scale from the stage while they run,
// wait for them (after the last block: free the stage), and add part times scale_a(row) *
// scale_b(c) into the block's columns of `acc` (fp32). The two warpgroups run half a batch
// apart: warpgroup 1 issues its first wgmmas of the tile when warpgroup 0's first batch has
// finished (a named barrier per tile, the id by the tile's parity `parity`, so that warpgroup 0
// cannot arrive twice on one id before warpgroup 1 has waited on it: its epilogue of tile t + 1
// needs warpgroup 1's of tile t), so each warpgroup promotes while the other's wgmmas keep the
// tensor cores busy. FO_BLOCK_LOCKSTEP drops the offset (both in step, as CUTLASS's loop runs):
// the 128x128 build measured 12-15% faster that way and 128x256 the same (csrc/cuda/NOTES.md).
// Leaves read_state past the tile's K tiles; frees every stage it used (no mma_tail).
// `part` is ColMma's fragment of one column block: its value i is acc's value i + c * 64 (the
// block's columns in the full fragment: FragWord with kMmaM = 1; the layout self-test checks it).
template <class Acc>
__device__ inline void block_scaled_mainloop(MainloopPipeline& pipeline, PipelineState& read_state,
                                             Acc& acc, int k_tiles, int math_thread,
                                             typename Mainloop::TensorStorage& storage,
                                             const BlockScaleStage* stages,
                                             const int (&row_base)[kMmaM], int lane, int parity) {
  static_assert(kMmaM == 1, "block-wise: one row block per math thread (128-row tiles)");
  constexpr int kPart = FO_SCALE_BLOCK / 2;  // ColMma's accumulators per thread
  ColMma col_mma;
  Tensor sA = make_tensor(make_smem_ptr(storage.smem_A.data()), typename Mainloop::SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(storage.smem_B.data()), typename Mainloop::SmemLayoutB{});
  // A and B fragments are the same for every thread of a warpgroup: slice by its first thread
  const int warp_group = __shfl_sync(0xffffffff, math_thread / 128, 0);
  auto wg_mma = col_mma.get_slice(warp_group * 128);
  Tensor tCrA = wg_mma.make_fragment_A(wg_mma.partition_A(sA));  // (MMA, 1, MMA_K, PIPE)
  Tensor tCrB = wg_mma.make_fragment_B(wg_mma.partition_B(sB));  // (MMA, kScaleCols, MMA_K, PIPE)
  static_assert(int(decltype(size<1>(tCrA))::value) == 1 &&
                int(decltype(size<1>(tCrB))::value) == kScaleCols, "column blocks");
  auto part = partition_fragment_C(col_mma, Shape<Int<kBM>, Int<FO_SCALE_BLOCK>>{});
  static_assert(int(decltype(size(part))::value) == kPart &&
                int(decltype(size(acc))::value) == kPart * kScaleCols, "accumulators");
#pragma unroll
  for (int i = 0; i < int(size(acc)); ++i) acc(i) = 0.0f;
  // FO_BLOCK_LOCKSTEP: no offset (both warpgroups issue and promote together, as CUTLASS's
  // block-scaled main loop does)
  constexpr bool kOffset = !FO_BLOCK_LOCKSTEP;
  const uint32_t offset_barrier = kBlockOffsetBarrier + parity;
  if (kOffset && warp_group == 1) cutlass::arch::NamedBarrier::sync(kTileThreads, offset_barrier);
  else if (kOffset && k_tiles < 1) cutlass::arch::NamedBarrier::arrive(kTileThreads, offset_barrier);
  // column block c's wgmmas of the K tile in `stage`, into `dst` from zero, as one batch
  auto issue = [&](auto& dst, int c, int stage) {
    warpgroup_fence_operand(dst);
    warpgroup_arrive();
    col_mma.accumulate_ = GMMA::ScaleOut::Zero;
#pragma unroll
    for (int k = 0; k < int(size<2>(tCrA)); ++k) {
      cute::gemm(col_mma, tCrA(_, 0, k, stage), tCrB(_, c, k, stage), dst(_, 0, 0));
      col_mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
  };
  // add `src` (column block c's partial products) times scale[h] of its rows into acc
  auto promote = [&](const auto& src, const float (&scale)[2], int c) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int j = 0; j < FO_SCALE_BLOCK / 8; ++j) {
        const int i = 2 * h + 4 * j;  // FragWord of a 128-column fragment
        acc(i + c * kPart) += src(i) * scale[h];
        acc(i + 1 + c * kPart) += src(i + 1) * scale[h];
      }
    }
  };
  if constexpr (kBlockPipe) {
    // FO_BLOCK_PIPE (one column block): two partial fragments, so that K tile kt + 1's wgmmas
    // run while K tile kt's are promoted (warpgroup_wait<1>): the tensor cores need not wait
    // for this warpgroup's promotion, nor for the other warpgroup to fill the gap.
    auto part1 = partition_fragment_C(col_mma, Shape<Int<kBM>, Int<FO_SCALE_BLOCK>>{});
    PipelineState release_state = read_state;  // the K tile being promoted
    // K tile kt (in `cur`, issued): issue kt + 1 into `next`, wait for kt, free its stage and
    // promote it
    auto step = [&](auto& cur, auto& next, int kt) {
      const BlockScaleStage& st = stages[release_state.index()];
      float scale[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) scale[h] = st.a[FragWord::row(row_base[0], h, lane)] * st.b[0];
      if (kt + 1 < k_tiles) {
        ++read_state;
        pipeline.consumer_wait(read_state);
        issue(next, 0, read_state.index());
        warpgroup_wait<1>();
      } else {
        warpgroup_wait<0>();
      }
      warpgroup_fence_operand(cur);
      pipeline.consumer_release(release_state);
      ++release_state;
      if (kOffset && kt == 0 && warp_group == 0)
        cutlass::arch::NamedBarrier::arrive(kTileThreads, offset_barrier);
      promote(cur, scale, 0);
    };
    if (k_tiles > 0) {
      pipeline.consumer_wait(read_state);
      issue(part, 0, read_state.index());
    }
#pragma unroll 1
    for (int kt = 0; kt < k_tiles; kt += 2) {
      step(part, part1, kt);
      if (kt + 1 < k_tiles) step(part1, part, kt + 1);
    }
    read_state = release_state;  // past the tile's K tiles
    warpgroup_fence_operand(acc);
    return;
  }
  // The next stage's full barrier is tested as soon as this one is freed, before the
  // promotion (CUTLASS's block-scaled loop does the same): the wait at the top of the next K
  // tile then finds its answer and returns without a second test where the stage is there.
  auto token = pipeline.consumer_try_wait(read_state);
#pragma unroll 1
  for (int kt = 0; kt < k_tiles; ++kt) {
    pipeline.consumer_wait(read_state, token);
    const int stage = read_state.index();
    const BlockScaleStage& st = stages[stage];
    float row_scale[2];
#pragma unroll
    for (int c = 0; c < kScaleCols; ++c) {
      issue(part, c, stage);
      if (c == 0) {
#pragma unroll
        for (int h = 0; h < 2; ++h) row_scale[h] = st.a[FragWord::row(row_base[0], h, lane)];
      }
      const float sb = st.b[c];
      const float scale[2] = {row_scale[0] * sb, row_scale[1] * sb};
      warpgroup_wait<0>();
      warpgroup_fence_operand(part);
      if (c == kScaleCols - 1) {
        pipeline.consumer_release(read_state);
        ++read_state;
        if (kt + 1 < k_tiles) token = pipeline.consumer_try_wait(read_state);
      }
      // warpgroup 0's first batch is done: warpgroup 1 issues its own while this one promotes
      if (kOffset && kt == 0 && c == 0 && warp_group == 0)
        cutlass::arch::NamedBarrier::arrive(kTileThreads, offset_barrier);
      promote(part, scale, c);
    }
  }
  warpgroup_fence_operand(acc);
}
#endif  // FO_SM90_DEVICE

__global__ void __launch_bounds__(kThreads, 1) signaling_gemm(const __grid_constant__ Params p) {
#ifdef FO_SM90_DEVICE
  extern __shared__ __align__(128) char smem[];
  SharedStorage& ss = *reinterpret_cast<SharedStorage*>(smem);

  const int thread_idx = threadIdx.x;
  const int warp_group = cutlass::canonical_warp_group_idx();
  const int warp_in_group = cutlass::canonical_warp_idx_sync() % 4;
  const int thread_in_group = thread_idx % 128;
  const int rank = int(cute::block_rank_in_cluster());
  const int cluster_id = int(blockIdx.x) / kClusterM;
  const int num_clusters = int(gridDim.x) / kClusterM;
  const int cta = cluster_id * kClusterSize + rank;  // this CTA's persistent index
  const int64_t first_base = int64_t(cluster_id) * kClusterSize;
  const int64_t round_stride = int64_t(num_clusters) * kClusterSize;  // = grid size G
  const int k_tiles = (p.K + kBK - 1) / kBK;

  if (thread_idx == 0) {
    Mainloop::prefetch_tma_descriptors(p.mainloop);
    if (kTmaStore && p.tma_store) cute::prefetch_tma_descriptor(&p.store_map);
    if (kScaleTma && p.scale_tma) cute::prefetch_tma_descriptor(&p.scale_map);
  }

  typename MainloopPipeline::Params pp;
  if (warp_group == 0 && warp_in_group == 0) pp.role = MainloopPipeline::ThreadCategory::Producer;
  // fp8 tensor-/row-wise: whether any scale is per row or column (else one product of two
  // tensor-wise scales); in kScaleWarp builds the scale warp's work
  [[maybe_unused]] const bool per_element =
      kFp8 && !kBlockScaled && (p.scales.a_per_row || p.scales.b_per_col);
  const bool row_scales = kScaleWarp && per_element;
  if ((kBlockScaled || row_scales) && warp_group == 0 && warp_in_group == kScaleLoaderWarp)
    pp.role = MainloopPipeline::ThreadCategory::Producer;
  if (warp_group > 0) pp.role = MainloopPipeline::ThreadCategory::Consumer;
  pp.is_leader = thread_in_group == 0;
  pp.num_consumers = kTileThreads;
  pp.num_producers = stage_producers(kScaleTma && p.scale_tma, row_scales);
  pp.transaction_bytes = p.mainloop.tma_transaction_bytes;
  MainloopPipeline pipeline(ss.pipelines.mainloop, pp, ClusterShape{});

  typename MathOrderBarrier::Params op;
  op.group_id = warp_group - 1;
  op.group_size = 128;
  MathOrderBarrier math_order(ss.pipelines.math_order, op);

  typename EpiPipeline::Params ep;
  if (warp_group == 0 && warp_in_group == 1) ep.role = EpiPipeline::ThreadCategory::Consumer;
  if (warp_group > 0) ep.role = EpiPipeline::ThreadCategory::Producer;
  ep.producer_arv_count = kTileThreads;
  ep.consumer_arv_count = 1;
  ep.dst_blockid = rank;
  EpiPipeline epi(ss.pipelines.epi, ep);
  uint32_t slots = 0;  // shared address of the tma epilogue's first slot
  if constexpr (kTmaStore) slots = cute::cast_smem_ptr_to_uint(&ss.tensors.epi.slots);

  // Barrier initialisation must be visible to every CTA of the cluster before use.
  if constexpr (kClusterSize > 1) {
    cute::cluster_arrive_relaxed();
    cute::cluster_wait();
  } else {
    __syncthreads();
  }

  Mainloop mainloop;
  if (warp_group == 0) {
    // Producer warpgroup: warp 0 issues the TMA loads of every item, in the CTA's order.
    cutlass::arch::warpgroup_reg_dealloc<kLoadRegs>();
    if (warp_in_group == 0) {
      auto mA = p.mainloop.tma_load_a.get_tma_tensor(make_shape(p.table.M, p.K, 1));
      auto mB = p.mainloop.tma_load_b.get_tma_tensor(make_shape(p.table.N, p.K, 1));
      auto gB = local_tile(mB, TileShape{}, make_coord(_, _, _), Step<X, _1, _1>{});
      PipelineState write_state = cutlass::make_producer_start_state<MainloopPipeline>();
      int ordinal = 0;  // of this CTA's items
      for (int64_t base = first_base; base < p.table.num_items; base += round_stride, ++ordinal) {
        WorkTile w = producer_item(p.table, base, round_stride, rank, ordinal, ss.items,
                                   thread_in_group % 32);
        // for the math threads (kItemSlots): before the item's first stage is acquired and
        // filled; the warp barrier orders lane 0's write before whichever lane the load elects
        if constexpr (kItemFromSlot) {  // (the other builds decode their items themselves)
          if (thread_in_group == 0) ss.items.tile[ordinal % kItemSlots] = w;
          __syncwarp();
        }
        // One uniform branch per tile, outside the K loop; a filler item loads rows it never
        // stores, so it waits for nothing.
        if (p.item_wait != nullptr && w.valid) wait_for_rows(p, base + rank);
        auto gA = local_tile(domain_offset(make_coord(w.row0, 0, 0), mA), TileShape{},
                             make_coord(_, _, _), Step<_1, X, _1>{});
        auto k_iter = make_coord_iterator(shape<3>(gA));
        mainloop.load(p.mainloop, pipeline, write_state, cute::make_tuple(gA, gB),
                      make_coord(0, w.n_blk, _, 0), k_iter, k_tiles, thread_in_group, rank,
                      ss.tensors.mainloop);
        write_state.advance(k_tiles);
      }
      mainloop.load_tail(pipeline, write_state);
    } else if (kBlockScaled && warp_in_group == kScaleLoaderWarp) {
      if constexpr (kBlockScaled)
        load_block_scales(p, pipeline, block_scale_stages(ss.tensors.epi), first_base,
                          round_stride, rank, k_tiles, thread_in_group % 32);
    } else if (row_scales && warp_in_group == kScaleLoaderWarp) {
      if constexpr (kScaleWarp)
        load_row_scales(p, pipeline, ss.tensors.epi, first_base, round_stride, rank, k_tiles,
                        thread_in_group % 32);
    } else if (!kWgStore && warp_in_group == 1 && thread_in_group == 32) {
      // Store/signal thread: takes each tile from the math threads (in the CTA's order); tma:
      // stores its column blocks from the slots, frees each slot once read, waits for the
      // writes; then publishes the tile with a release add on its group's counter.
      typename EpiPipeline::PipelineState read_state;
      for (int64_t base = first_base; base < p.table.num_items; base += round_stride) {
        const int64_t item = base + rank;
        const WorkTile w = stored_item(p.table, base, rank);
        if constexpr (kTmaStore) {
          const bool tma = tma_tile(w, p.tma_store, p.table);
          typename EpiPipeline::PipelineState previous = read_state;
#pragma unroll 1
          for (int cb = 0; cb < kColBlocks; ++cb) {
            epi.consumer_wait(read_state);
            const bool stored = tma && tma_store_block(p, w, cb, slots + read_state.index() * kSlotBytes);
            if (stored) bulk_commit();
            if constexpr (kSlots > 1) {  // free the previous block's slot once its copy read it
              if (cb > 0) {
                // The newest group is this block's only if it stored one (kTmaRows skips
                // blocks past N); otherwise the previous block's copy must be read too.
                if (stored) bulk_wait_read<1>();
                else if (tma) bulk_wait_read<0>();
                epi.consumer_release(previous);
              }
              previous = read_state;
            } else {  // one slot: the math threads wait for it, so free it at once
              if (tma) bulk_wait_read<0>();
              epi.consumer_release(read_state);
            }
            ++read_state;
          }
          if constexpr (kSlots > 1) {
            if (tma) bulk_wait_read<0>();
            epi.consumer_release(previous);
          }
          if (tma) bulk_wait_written();
        } else {
          epi.consumer_wait(read_state);
          epi.consumer_release(read_state);
          ++read_state;
        }
        if (item < p.table.num_items) {
          if (p.counters) signal_counter(p.counters + w.group);
          record_monitor(p.monitor, item, cta);
        }
      }
    }
  } else {
    // Math warpgroups. Cooperative: both share every tile. Pingpong: they alternate tiles.
    cutlass::arch::warpgroup_reg_alloc<kMathRegs>();
    const int math_thread = kPingpong ? thread_in_group : thread_idx - 128;
    const int math_group = warp_group - 1;
    const int lane = thread_idx % 32;
    TiledMma tiled_mma;
    auto thr_mma = tiled_mma.get_slice(math_thread);
    auto coord = thr_mma.partition_C(make_identity_tensor(make_shape(Int<kBM>{}, Int<kBN>{})));
    assert_pairs(coord);
    static_assert(int(decltype(size(coord))::value) == kMmaM * kBN / 2, "accumulator count");
    int row_base[kMmaM];  // first row of this warp's 16 rows in each row block
#pragma unroll
    for (int m = 0; m < kMmaM; ++m) row_base[m] = get<0>(coord(FragWord{}(m, 0, 0))) - (lane >> 2);

    // fp8: tensor-wise scales (both one float) are one product; otherwise per tile in shared
    // memory, buffer tile_count % 2 of this group's pair (a uniform branch per tile).
    [[maybe_unused]] const int scale_group = kPingpong ? math_group : 0;
    [[maybe_unused]] float tensor_scale = 1.0f;
    if constexpr (kFp8 && !kBlockScaled) {
      if (!per_element) tensor_scale = p.scales.a[0] * p.scales.b[0];
    }
    [[maybe_unused]] int tile_count = 0;
    [[maybe_unused]] int block_tiles = 0;  // block-scaled builds: tiles so far (offset barrier)

    PipelineState read_state;
    auto epi_state = cutlass::make_producer_start_state<EpiPipeline>();
    int64_t base = first_base, step = round_stride;
    if constexpr (kPingpong) {
      step = 2 * round_stride;
      if (math_group == 1) {
        base += round_stride;
        read_state.advance(k_tiles);
        epi_state.advance(kEpiSteps);
      }
    }
    int ordinal = kPingpong ? math_group : 0;  // of the CTA's items: the item slot
    // kWgDefer: the elected thread's tile whose signal is pending (-1: none) and its group
    [[maybe_unused]] int64_t pending_item = -1;
    [[maybe_unused]] int pending_group = 0;
    for (; base < p.table.num_items; base += step, ordinal += kPingpong ? 2 : 1) {
      const WorkTile& slot = ss.items.tile[ordinal % kItemSlots];
      // the other builds decode their item from the table, before the main loop (kItemFromSlot)
      [[maybe_unused]] WorkTile table_item;
      if constexpr (!kItemFromSlot) {
        table_item = stored_item(p.table, base, rank);
        prefetch_item_l2(p.table, base + step + rank);  // (kItemPrefetch) this group's next item
      }
      TileScales* scales = nullptr;
      if constexpr (kScaleWarp) {
        scales = scale_slot(ss.tensors.epi, ordinal);  // filled by the scale warp
      } else if constexpr (kFp8 && !kBlockScaled) {
        scales = scale_buffer(ss.tensors.epi, scale_group, tile_count++ & 1);
        // The item's row-wise scales, staged before its main loop from the table item, in the
        // slot builds too: reading the slot first needs a wait for the item's first stage,
        // which cost one-wave shapes up to 4% (and in pingpong builds, before their turn, that
        // stage can be more than one phase ahead of the producer, where a parity wait returns
        // at once).
        if (per_element)
          stage_scales(p.scales, kItemFromSlot ? stored_item(p.table, base, rank) : table_item,
                       *scales, math_thread);
      }
      auto acc = partition_fragment_C(tiled_mma, take<0, 2>(TileShape{}));
      if constexpr (kBlockScaled) {  // the scales are applied per K tile, in the main loop
        block_scaled_mainloop(pipeline, read_state, acc, k_tiles, math_thread, ss.tensors.mainloop,
                              block_scale_stages(ss.tensors.epi), row_base, lane,
                              block_tiles++ & 1);
      } else {
        if constexpr (kPingpong) math_order.wait();
        mainloop.mma(pipeline, read_state, acc, k_tiles, math_thread, ss.tensors.mainloop, p.mainloop);
        if constexpr (kPingpong) math_order.arrive();
        mainloop.mma_tail(pipeline, read_state, k_tiles);
        read_state.advance(kPingpong ? 2 * k_tiles : k_tiles);
      }
      // the main loop waited for the item's first stage: its slot holds the tile
      const WorkTile w = kItemFromSlot ? slot : table_item;
      if constexpr (kFp8 && !kBlockScaled) {
        if (per_element) {
          if constexpr (!kScaleWarp) await_scales(scale_group);  // (else: the first stage's barrier)
          apply_scales(acc, *scales, row_base, lane);
        } else {
          apply_scale(acc, tensor_scale);
        }
      }

      if constexpr (kWgDefer) {  // the previous tile's writes are done by now
        if (math_thread == 0) wg_signal(p, pending_group, pending_item, cta);
      }
      if constexpr (kPingpong) math_order.wait();
      if constexpr (kWgStore) {
        const bool leader = math_thread == 0;
        wg_epilogue(p, w, acc, coord, slots, row_base, lane, leader, kWgEpiBarrier + scale_group);
        if constexpr (kPingpong) math_order.arrive();
        if constexpr (kWgDefer) {
          pending_item = base + rank;
          pending_group = w.group;
        } else if (leader) {
          wg_signal(p, w.group, base + rank, cta);
        }
      } else {
        epilogue(p, w, acc, coord, epi, epi_state, slots, row_base, lane);
        if constexpr (kPingpong) {
          epi_state.advance(kEpiSteps);  // the other warpgroup's tile
          math_order.arrive();
        }
      }
    }
    if constexpr (kWgDefer) {  // the group's last tile
      if (math_thread == 0) wg_signal(p, pending_group, pending_item, cta);
    }
  }
#elif !defined(FO_LAYOUT_SELFTEST)
  // Compiled for another architecture: this library needs sm_90a.
  __trap();
#endif
}

// ---- host: parameters ------------------------------------------------------------------------

// Host-side parameters (TMA descriptors) are rebuilt only when the operands change.
struct ParamsCache {
  std::mutex mutex;
  bool valid = false;
  const void *a = nullptr, *b = nullptr;
  int M = 0, N = 0, K = 0;
  int64_t lda = 0, ldb = 0;
  typename Mainloop::Params mainloop;
};

inline typename Mainloop::Params mainloop_params(const void* a, const void* b, int M, int N, int K,
                                                 int64_t lda, int64_t ldb) {
  static ParamsCache cache;
  std::lock_guard<std::mutex> lock(cache.mutex);
  if (cache.valid && cache.a == a && cache.b == b && cache.M == M && cache.N == N && cache.K == K &&
      cache.lda == lda && cache.ldb == ldb)
    return cache.mainloop;
  using StrideA = typename Mainloop::StrideA;
  using StrideB = typename Mainloop::StrideB;
  StrideA dA = make_stride(lda, Int<1>{}, int64_t(M) * lda);
#if FO_B_COL_MAJOR
  StrideB dB = make_stride(ldb, Int<1>{}, int64_t(N) * ldb);  // b: [N, K], K contiguous
#else
  StrideB dB = make_stride(Int<1>{}, ldb, int64_t(K) * ldb);  // b: [K, N], N contiguous
#endif
  typename Mainloop::Arguments args{static_cast<const ElementIn*>(a), dA,
                                    static_cast<const ElementIn*>(b), dB};
  cache.mainloop = Mainloop::to_underlying_arguments(make_shape(M, N, K, 1), args, nullptr);
  cache.a = a, cache.b = b, cache.M = M, cache.N = N, cache.K = K, cache.lda = lda, cache.ldb = ldb;
  cache.valid = true;
  return cache.mainloop;
}

// How a TMA map cuts its tensor: the element type, the box (innermost first) and the swizzle;
// `what` names the tensor in errors.
struct MapBoxes {
  CUtensorMapDataType dtype;
  cuuint32_t box[2];
  CUtensorMapSwizzle swizzle;
  const char* what;
};
// The tma epilogue's: kColW columns x kBM rows of the output, the slots' swizzle (128 or 64
// bytes); block-wise scale_a's: kBM float32 rows of one group, no swizzle.
constexpr MapBoxes kStoreBoxes = {
    FO_OUT_DTYPE == 0 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
    {cuuint32_t(kColW), cuuint32_t(kBM)},
    kSlotRowBytes == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B, "output"};
constexpr MapBoxes kScaleABoxes = {CU_TENSOR_MAP_DATA_TYPE_FLOAT32, {cuuint32_t(kBM), 1},
                                   CU_TENSOR_MAP_SWIZZLE_NONE, "scale_a"};

// One TMA map of one kind of boxes, encoded again only when what it describes changes (a
// prepared call's output and scales are usually the same buffers from call to call).
struct MapCache {
  explicit MapCache(const MapBoxes& b) : boxes(b) {}
  const MapBoxes boxes;
  std::mutex mutex;
  bool valid = false, usable = false;
  void* base = nullptr;
  int rank = 0;
  cuuint64_t dims[3] = {}, strides[2] = {};
  cute::TmaDescriptor map;
};

// The map of `base` as a `rank`-D tensor (dims innermost first; strides in bytes of dims 1 ..),
// cut as the cache's boxes say (x 1 in a third dim). `usable` = false records that the buffer
// cannot be described (then every tile takes the direct path, or the scales their cp.async
// copies).
inline cudaError_t cached_map(MapCache& cache, void* base, int rank, const cuuint64_t* dims,
                              const cuuint64_t* strides, bool usable, cute::TmaDescriptor* map,
                              bool* usable_out) {
  std::lock_guard<std::mutex> lock(cache.mutex);
  bool same = cache.valid && cache.base == base && cache.rank == rank && cache.usable == usable;
  for (int i = 0; same && i < rank; ++i)
    same = cache.dims[i] == dims[i] && (i == rank - 1 || cache.strides[i] == strides[i]);
  if (!same) {
    cache.valid = false;
    if (usable) {
      const MapBoxes& b = cache.boxes;
      const cuuint32_t box[3] = {b.box[0], b.box[1], 1};
      const cuuint32_t element_strides[3] = {1, 1, 1};
      CUresult r = cutlass::call_cuTensorMapEncodeTiled(
          &cache.map, b.dtype, rank, base, dims, strides, box, element_strides,
          CU_TENSOR_MAP_INTERLEAVE_NONE, b.swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
          CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
      if (r != CUDA_SUCCESS)
        return fail(cudaErrorInvalidValue,
                    "fo_gemm_run: cuTensorMapEncodeTiled failed (CUresult %d) for the %d-D %s "
                    "at %p (%llu x %llu elements)", int(r), rank, b.what, base,
                    (unsigned long long)dims[0], (unsigned long long)dims[1]);
    }
    cache.usable = usable, cache.base = base, cache.rank = rank;
    for (int i = 0; i < rank; ++i) cache.dims[i] = dims[i];
    for (int i = 0; i + 1 < rank; ++i) cache.strides[i] = strides[i];
    cache.valid = true;
  }
  *map = cache.map;
  *usable_out = cache.usable;
  return cudaSuccess;
}

// The TMA store map of the packed buffer: a [numel / kBN, kBN] row-major tensor (a full tile at
// an offset that is a multiple of kBN is its rows offset / kBN ..). Not usable (no TMA store)
// when the buffer cannot be described: not 16-byte aligned, or smaller than one tile.
inline cudaError_t store_map(void* packed, int64_t numel, cute::TmaDescriptor* map, bool* usable) {
  static MapCache cache(kStoreBoxes);
  const int64_t rows = numel / kBN;
  const cuuint64_t dims[2] = {cuuint64_t(kBN), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(kBN) * sizeof(Element)};
  const bool fits = aligned16(packed) && rows >= kBM && rows < (int64_t(1) << 32);
  return cached_map(cache, packed, 2, dims, strides, fits, map, usable);
}

// The TMA store map of tiles written as rows (ldo != 0): the buffer as a 2-D tensor [rows][N]
// (row stride ldo), whose bounds clip a tile at N and at the last row. Not usable when the
// buffer cannot be described: not 16-byte aligned, a row stride that is not a multiple of 16
// bytes, fewer than kBM rows or fewer than kColW columns (a map's box may not be larger than
// its tensor: such a map is malformed, and a load or store through it may fault).
inline cudaError_t rows_store_map(void* out, int64_t rows, int N, int64_t ldo,
                                  cute::TmaDescriptor* map, bool* usable) {
  static MapCache cache(kStoreBoxes);
  const int64_t row_bytes = ldo * int64_t(sizeof(Element));
  const cuuint64_t dims[2] = {cuuint64_t(N), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(row_bytes)};
  const bool fits = aligned16(out) && row_bytes % 16 == 0 && rows >= kBM && N >= int(kColW) &&
                    rows < (int64_t(1) << 32);
  return cached_map(cache, out, 2, dims, strides, fits, map, usable);
}

// Block-wise scale_a [M, groups] as TMA loads it: a 2-D tensor [groups][M], M contiguous (torch's
// outer-dim-major layout, strides (1, >= M)), boxes of kBM rows of one group, rows past M
// zero-filled. Not usable (cp.async copies instead) where TMA cannot describe it: rows not
// contiguous, a base not 16-byte aligned, groups not a multiple of 16 bytes apart (with more
// than one group), fewer rows than the box (kBM: a map whose box is larger than its tensor is
// malformed; loads through it faulted with an illegal instruction on the H200, M = 4 and 21),
// or too many rows.
inline cudaError_t scale_a_map(const fo_gemm_scales& sc, int64_t M, int K,
                               cute::TmaDescriptor* map, bool* usable) {
  static MapCache cache(kScaleABoxes);
  const int64_t groups = (int64_t(K) + FO_SCALE_BLOCK - 1) / FO_SCALE_BLOCK;
  const int64_t group_bytes = groups > 1 ? sc.a_stride[1] * int64_t(sizeof(float))
                                         : (M * int64_t(sizeof(float)) + 15) / 16 * 16;
  const cuuint64_t dims[2] = {cuuint64_t(M), cuuint64_t(groups)};
  const cuuint64_t strides[1] = {cuuint64_t(group_bytes)};
  const bool fits = sc.a_stride[0] == 1 && aligned16(sc.a) && group_bytes % 16 == 0 &&
                    group_bytes >= M * int64_t(sizeof(float)) && M >= kBM &&
                    M < (int64_t(1) << 31) && groups < (int64_t(1) << 31);
  return cached_map(cache, const_cast<float*>(sc.a), 2, dims, strides, fits, map, usable);
}

}  // namespace fo::sm90

namespace fo::gemm {
using namespace fo::sm90;

const fo_gemm_config& config() {
  static const fo_gemm_config c = {
      FO_CUDA_ABI_VERSION, 90, kBM, kBN, kBK, kClusterM, kClusterN, FO_DTYPE, FO_B_COL_MAJOR,
      kClusterSize, FO_SCHEDULE, int(Mainloop::DispatchPolicy::Stages), FO_OUT_DTYPE,
      kFastAccum && !kBlockScaled ? 1 : 0};  // block-wise: promoted every 128 k, by its scales
  return c;
}

cudaError_t load_kernel() { return prepare_kernel_once(signaling_gemm, kSmemBytes); }

// TMA handles every edge; the scale modes a build takes (check_scales has checked that an e4m3
// build has scales): block-wise (FO_SCALE_BLOCKS for both) in a block-scaled build only.
cudaError_t check_limits(const Args& args) {
  if constexpr (kFp8) {
    const fo_gemm_scales& s = *args.scales;
    const bool blocks = s.a_per_row == FO_SCALE_BLOCKS && s.b_per_col == FO_SCALE_BLOCKS;
    if (kBlockScaled && !blocks)
      return fail(cudaErrorInvalidValue,
                  "this GEMM library applies block-wise scales (1x%d groups of a, %dx%d blocks of "
                  "b) in its main loop: a_per_row and b_per_col must both be FO_SCALE_BLOCKS (%d), "
                  "got %d and %d", FO_SCALE_BLOCK, FO_SCALE_BLOCK, FO_SCALE_BLOCK, FO_SCALE_BLOCKS,
                  s.a_per_row, s.b_per_col);
    if (!kBlockScaled && (s.a_per_row == FO_SCALE_BLOCKS || s.b_per_col == FO_SCALE_BLOCKS))
      return fail(cudaErrorInvalidValue,
                  "block-wise scales (FO_SCALE_BLOCKS) need a block-scaled GEMM library "
                  "(FO_FP8_BLOCK=1); this one takes tensor-wise and row-wise scales");
  }
  return cudaSuccess;
}

static const ClusterLaunch<kClusterM, kClusterN, Params> kLaunch{signaling_gemm, kThreads,
                                                                  kSmemBytes};

cudaError_t resident_ctas(int, int* ctas) { return kLaunch.resident_ctas(ctas); }

static cudaError_t kernel_params(const Args& args, Params* params) {
  *params = Params{};
  params->mainloop = mainloop_params(args.a, args.b, args.M(), args.N, args.K,
                                     args.lda, args.ldb);
  params->table = args.table();
  params->packed = static_cast<Element*>(args.packed);
  params->counters = args.counters;
  params->monitor = args.monitor;
  params->K = args.K;
  params->item_wait = args.item_wait;
  params->arrive_flags = args.arrive_flags;
  params->num_flags = args.num_flags;
  if (args.scales) params->scales = *args.scales;
  if constexpr (kScaleTma) {  // (check_limits has checked that the call has block-wise scales)
    bool usable = false;
    cudaError_t err = args.scales ? scale_a_map(*args.scales, args.M(), args.K,
                                                &params->scale_map, &usable)
                                  : cudaSuccess;
    if (err != cudaSuccess) return err;
    params->scale_tma = usable ? 1 : 0;
  }
  if constexpr (kTmaStore) {
    bool usable = false;
    cudaError_t err = args.ldo
        ? rows_store_map(args.packed, params->table.packed_numel / args.ldo, args.N, args.ldo,
                         &params->store_map, &usable)
        : store_map(args.packed, params->table.packed_numel, &params->store_map, &usable);
    if (err != cudaSuccess) return err;
    params->tma_store = !usable ? kTmaOff : args.ldo ? kTmaRows : kTmaPacked;
  }
  return cudaSuccess;
}

cudaError_t launch(const Args& args, cudaStream_t stream) {
  Params params;
  cudaError_t err = kernel_params(args, &params);
  return err == cudaSuccess ? kLaunch.launch(params, args.num_ctas, stream) : err;
}

cudaError_t set_node(const Args& args, cudaGraphExec_t exec, cudaGraphNode_t node) {
  Params params;
  cudaError_t err = kernel_params(args, &params);
  return err == cudaSuccess ? kLaunch.set_node(params, args.num_ctas, exec, node) : err;
}

}  // namespace fo::gemm

