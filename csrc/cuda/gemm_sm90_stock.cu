// FlashOverlap signaling GEMM for Hopper (sm_90a), fp8: CUTLASS's own persistent kernel
// (GemmUniversal with its TMA warp-specialized cooperative or pingpong schedule) with two parts
// of ours plugged in through CUTLASS's extension points (issue 32):
//
// - ItemScheduler, the tile scheduler: CTA c takes items c, c + G, c + 2G, ... of the plan's
//   item table (G = the grid's CTAs), as every FlashOverlap kernel does (gemm_api.h, "Work
//   items"), instead of CUTLASS's raster; each warp loads its next item's table row one item
//   ahead. A cluster's filler item (past the table, in the last round) computes a tile past the
//   last row band: its loads are zero-filled and its stores clipped by TMA, so the cluster's
//   multicast of B still has every CTA's half.
// - SignalEpilogue, around CUTLASS's TMA epilogue (row- and column-wise scales through its
//   visitor tree, or block-wise scales already applied by CUTLASS's block-scaled main loop): the
//   math warp that stored a tile posts it in shared memory once its stores are written, and the
//   producer warpgroup's epilogue warp adds it to its group's counter (release), as the class's
//   comment says.
//
// Why: on the H200 CUTLASS's kernels run 0.956-1.04x torch's block-wise fp8 GEMM and
// 0.978-1.056x its row-wise one (bench/results/cutlass-ref-h200-20261206-*.json), gemm_sm90.cu's
// 128x128 builds about 10% slower (csrc/cuda/NOTES.md, "Where the 128x128 kernels lose to stock
// CUTLASS").
//
// What it takes (check_limits): e4m3 a and b (b [N, K]), bf16 or fp16 out written in place into
// a row-major [M, ldo] result (the "rows" layout: fo_gemm_run_ex / fo_gemm_launch with ldo > 0),
// one destination block, or equal blocks whose rows are a multiple of the tile's (a tile never
// straddles two), and no unequal blocks (all_to_all). Waits for rows (allgather's item_wait and
// arrive_flags) in the builds with FO_ITEM_WAITS=1 only (gemm_sm90_stock_ex_scaled.cu, which adds
// fo_gemm_run_ex_scaled): the main loop's producer warp waits for an item's flag before it loads
// anything of the item (ItemScheduler); the other builds have no such branch. Scales: tensor- or
// row-wise for a and b (FO_FP8_BLOCK 0: CUTLASS's column and row broadcasts with run-time
// strides), or block-wise (FO_FP8_BLOCK 1): scale_a [M, ceil(K/128)] with strides (1, M) and
// scale_b [ceil(K/128), ceil(N/128)] with strides (1, ceil(K/128)), torch's layouts for
// BlockWise1x128 and for the transpose of a checkpoint's [ceil(N/128), ceil(K/128)] weight scales.
//
// One configuration per compilation: FO_TILE_M/N (K tile 128), FO_CLUSTER_M/N, FO_SCHEDULE
// (0 cooperative, 1 pingpong), FO_FP8_BLOCK, FO_OUT_DTYPE (0 bf16, 1 fp16); FO_DTYPE must be 2.
#include <cuda.h>

#include <mutex>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/epilogue/thread/activation.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "cluster_launch.cuh"
#include "gemm_abi.cuh"

#ifndef FO_TILE_M
#define FO_TILE_M 128
#endif
#ifndef FO_TILE_N
#define FO_TILE_N 128
#endif
#ifndef FO_CLUSTER_M
#define FO_CLUSTER_M 2
#endif
#ifndef FO_CLUSTER_N
#define FO_CLUSTER_N 1
#endif
#ifndef FO_SCHEDULE
#define FO_SCHEDULE 1
#endif
#ifndef FO_FP8_BLOCK
#define FO_FP8_BLOCK 0
#endif
#ifndef FO_ITEM_WAITS  // 1: allgather's build (gemm_sm90_stock_ex_scaled.cu)
#define FO_ITEM_WAITS 0
#endif

static_assert(FO_DTYPE == FO_DTYPE_E4M3, "this source builds e4m3 GEMMs only (FO_DTYPE 2)");
static_assert(FO_B_COL_MAJOR, "fp8 wgmma reads both operands K-major: b must be [N, K]");
static_assert(!FO_BLOCKS, "unequal destination blocks (all_to_all) run gemm_sm90.cu's kernel");
static_assert(FO_SCHEDULE == 0 || FO_SCHEDULE == 1, "FO_SCHEDULE: 0 cooperative, 1 pingpong");
static_assert(FO_OUT_DTYPE == 0 || FO_OUT_DTYPE == 1, "FO_OUT_DTYPE: 0 bf16, 1 fp16");
static_assert(!FO_FP8_BLOCK || FO_TILE_M % FO_SCALE_BLOCK == 0 || FO_SCHEDULE == 1,
              "block-wise scales: the tile's rows are whole rows of a");
static_assert(!FO_FP8_BLOCK || FO_TILE_N % FO_SCALE_BLOCK == 0,
              "block-wise scales: a tile holds whole 128-column blocks of b");

namespace fo::stock {
using namespace cute;

constexpr int kBM = FO_TILE_M, kBN = FO_TILE_N, kBK = 128;
constexpr int kClusterM = FO_CLUSTER_M, kClusterN = FO_CLUSTER_N;
constexpr int kClusterSize = kClusterM * kClusterN;
constexpr bool kPingpong = FO_SCHEDULE == 1;
constexpr bool kBlockScaled = FO_FP8_BLOCK != 0;
static_assert(kClusterSize <= 8, "portable cluster size is at most 8");

using TileShape = Shape<Int<kBM>, Int<kBN>, Int<kBK>>;
using ClusterShape = Shape<Int<kClusterM>, Int<kClusterN>, _1>;
using ElementAB = cutlass::float_e4m3_t;
using ElementD = cute::conditional_t<FO_OUT_DTYPE == 0, cutlass::bfloat16_t, cutlass::half_t>;
using LayoutD = cutlass::layout::RowMajor;
constexpr int kAlignD = 16 / int(sizeof(ElementD));
constexpr int kAlignAB = 16;

// ---- the plan's items, and what the epilogue needs to signal ------------------------------
struct ItemOrder {
  const int64_t* items = nullptr;      // [T, 4]: block, band in block, column tile, offset
  const int32_t* item_group = nullptr;  // [T]
  const int32_t* item_wait = nullptr;   // allgather: item i's arrival flag (-1: none; null: no waits)
  const uint32_t* arrive_flags = nullptr;
  int num_flags = 0;
  int32_t* counters = nullptr;          // null: no signal (measuring signaling's cost)
  uint64_t* monitor = nullptr;
  int num_items = 0;
  int block_rows = 0;  // rows per destination block (a multiple of kBM when L > 1)
  int m_tiles = 0;     // row tiles of the whole result (a filler item's row tile)
  int64_t ldo = 0;     // the result's row stride (elements)
};

// CTA c of the grid (cluster_m * clusters, cluster_n): items c, c + G, ...; within a cluster,
// rank r = rm + rn * cluster_m takes item (cluster's first) + r (gemm_api.h).
__device__ inline uint64_t cta_linear() {
  const uint64_t cluster = blockIdx.x / kClusterM;
  return cluster * kClusterSize + (blockIdx.x % kClusterM) + uint64_t(blockIdx.y) * kClusterM;
}
__device__ inline uint64_t grid_ctas() { return uint64_t(gridDim.x) * gridDim.y; }
// Whether item index j is a tile the kernel computes (an item, or a cluster's filler).
__device__ inline bool has_tile(uint64_t j, int num_items) {
  return j < uint64_t(num_items) || j - j % kClusterSize < uint64_t(num_items);
}

struct ItemSchedulerTag {};

class ItemScheduler : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90 {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;

 public:
  using WorkTileInfo = typename Base::WorkTileInfo;
  struct Arguments : Base::Arguments {
    ItemOrder order;
  };
  struct Params : Base::Params {
    ItemOrder order;
  };

  template <class ProblemShape, class Tile, class Cluster>
  static Params to_underlying_arguments(ProblemShape problem, Tile tile, Cluster cluster,
                                        cutlass::KernelHardwareInfo const& hw,
                                        Arguments const& args, void* workspace = nullptr,
                                        const uint32_t epilogue_subtile = 1,
                                        uint32_t ktile_start_alignment_count = 1u) {
    Params p;
    static_cast<Base::Params&>(p) = Base::to_underlying_arguments(
        problem, tile, cluster, hw, args, workspace, epilogue_subtile, ktile_start_alignment_count);
    p.order = args.order;
    return p;
  }

  CUTLASS_HOST_DEVICE ItemScheduler() {}
  CUTLASS_DEVICE explicit ItemScheduler(Params const& p) : Base(p), order_(p.order) {
    idx_ = cta_linear();
    stride_ = grid_ctas();
    cur_ = fetch(idx_);
    next_ = fetch(idx_ + stride_);
  }

  // The main loop's producer (warp 0 of the producer warpgroup, as CUTLASS's warp-specialized
  // kernels assign it) gets each tile here: initial_work_tile_info, then advance_to_next_work
  // and this. With waits (allgather) it waits here until the item's rows of A have arrived;
  // the acquire orders the arrival before its generic-proxy operations and the proxy fence
  // before the TMA loads it issues next, so they read the arrived rows. No other warp waits:
  // the math warps consume what that warp loaded, and the scales were complete before launch.
  CUTLASS_DEVICE WorkTileInfo get_current_work() const {
#if FO_ITEM_WAITS
    if (order_.item_wait != nullptr && cur_.kind == 0 && cutlass::canonical_warp_idx_sync() == 0) {
      wait_item_rows(order_.item_wait, order_.arrive_flags, order_.num_flags, int64_t(idx_));
      asm volatile("fence.proxy.async.global;" ::: "memory");
    }
#endif
    return tile_of(cur_);
  }
  template <class Cluster>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(Cluster) {
    return get_current_work();
  }
  // The next item's table row was loaded one item ahead (fetch: the loads are waited for only
  // where the row is used), so no warp waits for the table between two tiles.
  CUTLASS_DEVICE void advance_to_next_work(uint32_t count = 1) {
    idx_ += stride_ * count;
    cur_ = count == next_count_ ? next_ : fetch(idx_);
    next_count_ = count;
    next_ = fetch(idx_ + stride_ * count);
  }
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo) {
    advance_to_next_work();
    return cute::make_tuple(get_current_work(), true);
  }
  template <class Pipeline, class State>
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo w, Pipeline&, State) {
    return fetch_next_work(w);
  }
  CUTLASS_DEVICE bool is_last_tile(WorkTileInfo&, uint32_t count = 1) const {
    return !tile_of(fetch(idx_ + stride_ * count)).is_valid();
  }

 private:
  // Item i's table row as loaded (int32: rows and tiles fit), or a cluster's filler item past
  // the table (its column tile: rank (0, rn)'s), or nothing.
  struct Row {
    int32_t l, m_blk, n_blk, kind;  // kind 0: an item, 1: a filler, 2: none
  };
  CUTLASS_DEVICE Row fetch(uint64_t i) const {
    const uint64_t n = uint64_t(order_.num_items);
    if (i < n) {
      const int64_t* it = order_.items + 4 * i;
      return {int32_t(__ldg(it)), int32_t(__ldg(it + 1)), int32_t(__ldg(it + 2)), 0};
    }
    const uint64_t r = i % kClusterSize, first = i - r;
    if (first >= n) return {0, 0, 0, 2};
    const uint64_t col_item = first + (r / kClusterM) * kClusterM;
    return {0, 0, col_item < n ? int32_t(__ldg(order_.items + 4 * col_item + 2)) : 0, 1};
  }
  // Its tile: (row tile of the whole result, column tile, 0); a filler computes the row tile
  // past the last one.
  CUTLASS_DEVICE WorkTileInfo tile_of(const Row& r) const {
    if (r.kind == 2) return WorkTileInfo::invalid_work_tile();
    if (r.kind == 1) return {order_.m_tiles, r.n_blk, 0, true};
    const int64_t row0 = int64_t(r.l) * order_.block_rows + int64_t(r.m_blk) * kBM;
    return {int32_t(row0 / kBM), r.n_blk, 0, true};
  }

  ItemOrder order_;
  uint64_t idx_ = 0, stride_ = 1;
  Row cur_{}, next_{};
  uint32_t next_count_ = 1;
};

}  // namespace fo::stock

namespace cutlass::gemm::kernel::detail {
template <class ArchTag, class TileShape, class ClusterShape, uint32_t Stages, class Problem>
struct TileSchedulerSelector<fo::stock::ItemSchedulerTag, ArchTag, TileShape, ClusterShape,
                             Stages, Problem> {
  using Scheduler = fo::stock::ItemScheduler;
};
}  // namespace cutlass::gemm::kernel::detail

namespace fo::stock {

// ---- the epilogue: CUTLASS's, then the signal --------------------------------------------
// The math warp that issued a tile's TMA stores waits for them to be written when it stores its
// next tile (its main loop has run meanwhile, so the wait costs nothing; waiting right after
// the stores cost the pingpong kernel 8-14% at K = 1024-2048 on an H100), fences the async proxy
// and posts the tile done in shared memory (a release at CTA scope). The release add on the
// group's counter, whose fence stalls the warp that issues it (per tile in a math warp: 2-7% on
// the same shapes), is issued by the producer warpgroup's epilogue warp (warp 1), which CUTLASS
// runs through load() once per tile, in the CTA's item order, when the epilogue says it loads
// (is_producer_load_needed): it waits for the tile's post, checks the item, adds 1 to its
// group's counter (release, GPU scope: cumulative over the math warp's writes it acquired) and
// records the monitor. CUTLASS's own epilogue never waits on its load pipeline here (its fusion
// loads nothing: no C), and load() and load_tail() leave that pipeline alone.
// Except each math warpgroup's last tile: its issuing warp signals that one itself, right after
// the stores are written, when the warpgroup has nothing left to do. The kernel ends with that
// release, so a hand-over through warp 1 (its poll, then the release fence of one warpgroup's
// last tile after the other's) lengthened every launch by a fixed ~1.3 µs on the H100: 3-3.7% of
// 4096x4096x1024 (csrc/cuda/NOTES.md, "The signal's cost at the kernel's end").
template <class Base>
class SignalEpilogue : public Base {
 public:
  struct Arguments : Base::Arguments {
    ItemOrder order;
  };
  struct Params : Base::Params {
    ItemOrder order;
  };
  // CUTLASS's shared memory, and per math warpgroup the count of its tiles written (posted)
  struct TensorStorage {
    typename Base::TensorStorage base;
    alignas(16) uint32_t done[2];
  };
  using PipelineStorage = typename Base::PipelineStorage;
  struct SharedStorage {
    TensorStorage tensors;
    PipelineStorage pipeline;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem, Arguments const& args,
                                        void* workspace) {
    Params p;
    static_cast<typename Base::Params&>(p) = Base::to_underlying_arguments(problem, args, workspace);
    p.order = args.order;
    return p;
  }

  // Every thread constructs one before the kernel's cluster-wide barrier (after it, the
  // consumers and, in the cooperative kernel, warp 1 construct their own): thread 0, in the
  // mainloop producer warp, which makes no other, zeroes the posts there.
  CUTLASS_HOST_DEVICE SignalEpilogue(Params const& params, TensorStorage& storage)
      : Base(params, storage.base), order_(params.order), done_(storage.done) {
#if defined(__CUDA_ARCH__)
    if (threadIdx.x == 0) {
      done_[0] = done_[1] = 0;
      __threadfence_block();
    }
    // The math threads: the cooperative kernel's take the CTA's items in turn; pingpong's math
    // warpgroup w (threads 128 (w + 1) ..) every other one, starting at the w-th.
    group_ = kPingpong && threadIdx.x >= cutlass::NumThreadsPerWarpGroup
                 ? int(threadIdx.x / cutlass::NumThreadsPerWarpGroup) - 1
                 : 0;
    next_ = cta_linear();
    step_ = grid_ctas();
    wg_step_ = kPingpong ? 2 * step_ : step_;
    next_mine_ = next_ + uint64_t(group_) * step_;
#endif
  }

  // The last tile's post and signal: when the math threads are done (the pingpong kernel calls
  // store_tail after every tile, the cooperative one once, so neither marks the last tile).
  CUTLASS_HOST_DEVICE ~SignalEpilogue() {
#if defined(__CUDA_ARCH__)
    post(true);
#endif
  }

  CUTLASS_DEVICE bool is_producer_load_needed() const { return true; }  // warp 1: the signals

  // Warp 1, once per tile of the CTA in item order: the signal of the tile.
  template <class LoadPipeline, class LoadState, class ProblemShape, class TileShapeMNK,
            class TileCoord, class TiledMma, class... Rest>
  CUTLASS_DEVICE LoadState load(LoadPipeline, LoadState load_state, ProblemShape, TileShapeMNK,
                                TileCoord tile_coord, TiledMma, int thread_idx, TensorStorage&,
                                Rest&&...) {
    const int64_t i = int64_t(next_);
    next_ += step_;
    const uint32_t t = seen_++;  // the tile's place among the CTA's
    if (thread_idx == 0) signal(i, t, int(get<0>(tile_coord)), int(get<1>(tile_coord)));
    __syncwarp();
    return load_state;
  }
  template <class LoadPipeline, class LoadState>
  CUTLASS_DEVICE LoadState load_tail(LoadPipeline, LoadState load_state) {
    return load_state;
  }

  // The previous tile's post, then CUTLASS's store of this one. `thread_idx` is the index the
  // kernel gives the epilogue; warp 0 of those threads issues the TMA stores (CUTLASS's
  // issue_tma_store), so it posts.
  template <class LoadPipeline, class LoadState, class StorePipeline, class StoreState,
            class ProblemShape, class TileShapeMNK, class TileCoord, class Acc, class TiledMma,
            class... Rest>
  CUTLASS_DEVICE auto store(LoadPipeline load_pipeline, LoadState load_state,
                            StorePipeline store_pipeline, StoreState store_state,
                            ProblemShape problem, TileShapeMNK tile_shape, TileCoord tile_coord,
                            Acc&& accumulators, TiledMma tiled_mma, int thread_idx,
                            TensorStorage& shared, Rest&&... rest) {
    issuer_ = thread_idx / cutlass::NumThreadsPerWarp == 0;
    post();
    mine_ = next_mine_;
    next_mine_ += wg_step_;
    auto out = Base::store(load_pipeline, load_state, store_pipeline, store_state, problem,
                           tile_shape, tile_coord, static_cast<Acc&&>(accumulators), tiled_mma,
                           thread_idx, shared.base, static_cast<Rest&&>(rest)...);
    pending_ = issuer_;
    return out;
  }

 private:
  // The issuing warp: once its stores of the pending tile are written (and the async proxy
  // fenced), lane 0 posts one more of its warpgroup's tiles done. The warpgroup's last tile
  // (`final`: no tile of the warpgroup follows, so warp 1 does not add it) lane 0 also adds to
  // its group's counter (release, GPU scope: the warp's writes, ordered before it by the wait,
  // the fence and __syncwarp) and records in the monitor; a filler is not counted.
  CUTLASS_DEVICE void post(bool final = false) {
    if (!issuer_ || !pending_) return;
    pending_ = false;
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    asm volatile("fence.proxy.async.global;" ::: "memory");
    __syncwarp();
    if (final && mine_ < uint64_t(order_.num_items) &&
        threadIdx.x % cutlass::NumThreadsPerWarp == 0) {
      if (order_.counters) signal_counter(order_.counters + __ldg(order_.item_group + mine_));
      record_monitor(order_.monitor, int64_t(mine_), int(cta_linear()));
    }
    if (threadIdx.x % cutlass::NumThreadsPerWarp == 0) {
      ++posted_;
      asm volatile("st.release.cta.shared::cta.u32 [%0], %1;" ::"r"(smem_addr(done_ + group_)),
                   "r"(posted_) : "memory");
    }
  }

  // Warp 1's lane 0, tile t of the CTA (item i, computed as tile (m, n)): waits until the math
  // warpgroup that ran it (pingpong: t % 2) has posted it, checks the item (the tile the kernel
  // computed, the in-place offset, a cluster round that can share B: a violation traps, as
  // gemm_sm90.cu's checks) and adds it to its group's counter. A cluster's filler item (past the
  // table) is waited for and not counted; a warpgroup's last item is checked only (post counts
  // it).
  CUTLASS_DEVICE void signal(int64_t i, uint32_t t, int tile_m, int tile_n) {
    const uint32_t* done = done_ + (kPingpong ? t % 2 : 0);
    const uint32_t need = (kPingpong ? t / 2 : t) + 1;
    int64_t l = 0, m_blk = 0, n_blk = 0, offset = 0, peer_n = 0;
    int32_t group = 0;
    const bool item = i < order_.num_items;
    if (item) {  // (loaded while the tile may still be running)
      const int64_t* it = order_.items + 4 * i;
      l = __ldg(it), m_blk = __ldg(it + 1), n_blk = __ldg(it + 2), offset = __ldg(it + 3);
      group = __ldg(order_.item_group + i);
      peer_n = n_blk;
      if constexpr (kClusterSize > 1) {
        const int64_t r = i % kClusterSize, col_item = i - r + (r / kClusterM) * kClusterM;
        if (col_item < order_.num_items) peer_n = __ldg(order_.items + 4 * col_item + 2);
      }
    }
    // (a warpgroup's last tile: its math warp signals it, see post)
    const bool by_math = item && !has_tile(uint64_t(i) + wg_step_, order_.num_items);
    uint32_t seen;
    for (; !by_math;) {
      asm volatile("ld.acquire.cta.shared::cta.u32 %0, [%1];" : "=r"(seen) : "r"(smem_addr(done))
                   : "memory");
      if (seen >= need) break;
      __nanosleep(256);  // (a tile takes microseconds: poll without taking the math warps' issue slots)
    }
    if (!item) return;
    // (A cluster shares A along N: rank (rm, rn)'s rows are rank (rm, 0)'s by construction of
    // the tile; B along M: the column tiles are checked.)
    const int64_t row0 = l * order_.block_rows + m_blk * kBM;
    const bool ok = row0 == int64_t(tile_m) * kBM && n_blk == tile_n && peer_n == n_blk &&
                    offset == row0 * order_.ldo + n_blk * kBN;
    if (!ok) __trap();  // the table is not the order this kernel ran, or a cluster cannot share B
    if (by_math) return;
    if (order_.counters) signal_counter(order_.counters + group);
    record_monitor(order_.monitor, i, int(cta_linear()));
  }

  CUTLASS_DEVICE static uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
  }

  ItemOrder order_;
  uint32_t* done_;
  int group_ = 0;  // the math warpgroup (pingpong: 0 or 1)
  bool issuer_ = false, pending_ = false;
  uint32_t posted_ = 0;          // the issuing warp's lane 0: its warpgroup's tiles posted
  uint64_t next_ = 0, step_ = 0;  // warp 1: the next tile's item, and the grid's CTAs
  uint32_t seen_ = 0;             // warp 1: tiles signalled
  uint64_t wg_step_ = 0;          // items between two tiles of one math warpgroup
  uint64_t mine_ = 0, next_mine_ = 0;  // math threads: the item of their last store, of the next
};

// ---- the kernel ----------------------------------------------------------------------------
namespace fusion = cutlass::epilogue::fusion;
constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;
// Tensor- or row-wise: scale_a one value per row or one for all (run-time stride 1 or 0), scale_b
// the same per column.
using ScaleA = fusion::Sm90ColBroadcast<0, TileShape, float, float, Stride<bool, _0, int64_t>>;
using ScaleB = fusion::Sm90RowBroadcast<0, TileShape, float, float, Stride<_0, bool, int64_t>>;
using TimesB = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::multiplies, float, float, kRound>,
                               ScaleB, fusion::Sm90AccFetch>;
using TimesA = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::multiplies, ElementD, float, kRound>,
                               ScaleA, TimesB>;
// Block-wise: the accumulators are scaled already; D is their conversion.
using Convert = fusion::Sm90EVT<
    fusion::Sm90Compute<cutlass::epilogue::thread::Identity, ElementD, float, kRound>,
    fusion::Sm90AccFetch>;
using Fusion = cute::conditional_t<kBlockScaled, Convert, TimesA>;

using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, FO_SCALE_BLOCK, FO_SCALE_BLOCK,
                                                              cute::GMMA::Major::MN,
                                                              cute::GMMA::Major::K>;
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
using LayoutA = cutlass::layout::RowMajor;
using LayoutB = cutlass::layout::ColumnMajor;
using MainA = cute::conditional_t<kBlockScaled, cute::tuple<LayoutA, LayoutSFA>, LayoutA>;
using MainB = cute::conditional_t<kBlockScaled, cute::tuple<LayoutB, LayoutSFB>, LayoutB>;

#if FO_FP8_BLOCK
using KernelSchedule = cute::conditional_t<kPingpong,
                                           cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8Blockwise,
                                           cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8Blockwise>;
#else
using KernelSchedule = cute::conditional_t<kPingpong,
                                           cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8FastAccum,
                                           cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8FastAccum>;
#endif
using EpilogueSchedule = cute::conditional_t<kPingpong, cutlass::epilogue::TmaWarpSpecialized,
                                             cutlass::epilogue::TmaWarpSpecializedCooperative>;

// The epilogue's tile: CUTLASS's choice (64x32 pingpong, 128x32 cooperative for 16-bit D), or
// FO_STOCK_EPI_N columns wide (GemmConfig.stock_epi_n): fewer, larger TMA stores per tile.
#ifdef FO_STOCK_EPI_N
using EpilogueTile = Shape<Int<kPingpong ? 64 : 128>, Int<FO_STOCK_EPI_N>>;
#else
using EpilogueTile = cutlass::epilogue::collective::EpilogueTileAuto;
#endif
using StockEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    EpilogueTile, float, float, void, LayoutD, kAlignD,
    ElementD, LayoutD, kAlignD, EpilogueSchedule, Fusion>::CollectiveOp;
using Epilogue = SignalEpilogue<StockEpilogue>;

using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB, MainA, kAlignAB, ElementAB,
    MainB, kAlignAB, float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<
        static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
    KernelSchedule>::CollectiveOp;

using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue,
                                                    ItemSchedulerTag>;
using KernelParams = typename Kernel::Params;
constexpr int kSmemBytes = int(Kernel::SharedStorageSize);
constexpr int kThreads = int(Kernel::MaxThreadsPerBlock);
static_assert(std::is_same_v<typename Kernel::TileScheduler, ItemScheduler>,
              "the kernel must take the plan's items");

__global__ void __launch_bounds__(kThreads, 1) signaling_gemm(CUTLASS_GRID_CONSTANT const KernelParams params) {
  extern __shared__ char smem[];
  Kernel op;
  op(params, smem);
}

// ---- host ----------------------------------------------------------------------------------
// The kernel's parameters of one call: TMA maps of a, b, the result (and block-wise scale_a),
// encoded by CUTLASS. Kept for the last few calls (a prepared call's operands rarely move).
struct ParamsKey {
  const void *a, *b, *out;
  const float *sa, *sb;
  int a_mode, b_mode, L, block_rows, N, K, num_items, num_ctas;
  int64_t lda, ldb, ldo;
  const int64_t* items;
  const int32_t* item_group;
  int32_t* counters;
  uint64_t* monitor;
  const int32_t* item_wait;
  const uint32_t* arrive_flags;
  int num_flags;
  int device;
  bool operator==(const ParamsKey& o) const { return std::memcmp(this, &o, sizeof(*this)) == 0; }
};

struct ParamsCache {
  static constexpr int kEntries = 8;
  std::mutex mutex;
  ParamsKey keys[kEntries];
  KernelParams params[kEntries];
  bool valid[kEntries] = {};
  int next = 0;
};

inline ParamsKey key_of(const fo::gemm::Args& args, int device) {
  ParamsKey k;
  std::memset(&k, 0, sizeof(k));  // padding too: the key is compared bytewise
  const fo_gemm_scales& s = *args.scales;
  k.a = args.a, k.b = args.b, k.out = args.packed, k.sa = s.a, k.sb = s.b;
  k.a_mode = s.a_per_row, k.b_mode = s.b_per_col, k.L = args.L, k.block_rows = args.block_rows;
  k.N = args.N, k.K = args.K, k.num_items = args.num_items, k.num_ctas = args.num_ctas;
  k.lda = args.lda, k.ldb = args.ldb, k.ldo = args.ldo, k.items = args.items;
  k.item_group = args.item_group, k.counters = args.counters, k.monitor = args.monitor;
  k.item_wait = args.item_wait, k.arrive_flags = args.arrive_flags, k.num_flags = args.num_flags;
  k.device = device;
  return k;
}

inline cudaError_t make_params(const fo::gemm::Args& args, KernelParams* out) {
  const int M = args.M(), N = args.N, K = args.K;
  using StrideA = typename Kernel::StrideA;
  using StrideB = typename Kernel::StrideB;
  using StrideC = typename Kernel::StrideC;
  using StrideD = typename Kernel::StrideD;
  StrideA sa = make_stride(args.lda, Int<1>{}, int64_t(M) * args.lda);
  StrideB sb = make_stride(args.ldb, Int<1>{}, int64_t(N) * args.ldb);
  StrideC sc{};
  StrideD sd = make_stride(args.ldo, Int<1>{}, int64_t(M) * args.ldo);
  ItemOrder order;
  order.items = args.items, order.item_group = args.item_group, order.counters = args.counters;
  order.monitor = args.monitor, order.num_items = args.num_items;
  order.item_wait = args.item_wait, order.arrive_flags = args.arrive_flags;
  order.num_flags = args.num_flags;
  order.block_rows = args.block_rows, order.m_tiles = (M + kBM - 1) / kBM, order.ldo = args.ldo;
  const fo_gemm_scales& s = *args.scales;
  typename Kernel::Arguments kargs;
  kargs.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  kargs.problem_shape = {M, N, K, 1};
#if FO_FP8_BLOCK
  kargs.mainloop = {static_cast<const ElementAB*>(args.a), sa, static_cast<const ElementAB*>(args.b),
                    sb, s.a, ScaleConfig::tile_atom_to_shape_SFA(make_shape(M, N, K, 1)), s.b,
                    ScaleConfig::tile_atom_to_shape_SFB(make_shape(M, N, K, 1))};
  typename StockEpilogue::Arguments base{{}, nullptr, sc, static_cast<ElementD*>(args.packed), sd};
  base.thread = {{}, {}};  // Convert's: {the accumulator's, the conversion's}
#else
  kargs.mainloop = {static_cast<const ElementAB*>(args.a), sa, static_cast<const ElementAB*>(args.b),
                    sb};
  typename StockEpilogue::Arguments base{{}, nullptr, sc, static_cast<ElementD*>(args.packed), sd};
  // TimesA's: {scale_a's, TimesB's, multiply's}; TimesB's: {scale_b's, acc's, multiply's}. A
  // broadcast's stride is true for one value per row (column), false for one in all.
  base.thread = {{s.a, 0.f, {bool(s.a_per_row), _0{}, int64_t(0)}},
                 {{s.b, 0.f, {_0{}, bool(s.b_per_col), int64_t(0)}}, {}, {}},
                 {}};
#endif
  kargs.epilogue = typename Epilogue::Arguments{base, order};
  kargs.hw_info.device_id = 0;
  cudaError_t err = cudaGetDevice(&kargs.hw_info.device_id);
  if (err != cudaSuccess) return fail(err, "cudaGetDevice: %s", cudaGetErrorString(err));
  kargs.hw_info.sm_count = args.num_ctas;
  kargs.scheduler.order = order;
  // (Not Kernel::can_implement: it asks K and N to be multiples of 16 bytes, which TMA does not
  // need: the row strides are, check_limits has checked them, and TMA clips K and N.)
  if (Kernel::get_workspace_size(kargs) != 0)
    return fail(cudaErrorNotSupported, "this GEMM build needs a workspace, which it has not");
  *out = Kernel::to_underlying_arguments(kargs, nullptr);
  return cudaSuccess;
}

inline cudaError_t kernel_params(const fo::gemm::Args& args, KernelParams* out) {
  static ParamsCache cache;
  int device = 0;
  FO_CUDA_CHECK(cudaGetDevice(&device));
  const ParamsKey key = key_of(args, device);
  std::lock_guard<std::mutex> lock(cache.mutex);
  for (int e = 0; e < ParamsCache::kEntries; ++e) {
    if (cache.valid[e] && cache.keys[e] == key) {
      *out = cache.params[e];
      return cudaSuccess;
    }
  }
  cudaError_t err = make_params(args, out);
  if (err != cudaSuccess) return err;
  const int e = cache.next;
  cache.next = (e + 1) % ParamsCache::kEntries;
  cache.keys[e] = key, cache.params[e] = *out, cache.valid[e] = true;
  return cudaSuccess;
}

inline const ClusterLaunch<kClusterM, kClusterN, KernelParams> kLaunch{signaling_gemm, kThreads,
                                                                        kSmemBytes};

}  // namespace fo::stock

namespace fo::gemm {
using namespace fo::stock;

const fo_gemm_config& config() {
  static const fo_gemm_config c = {
      FO_CUDA_ABI_VERSION, 90, kBM, kBN, kBK, kClusterM, kClusterN, FO_DTYPE, 1, kClusterSize,
      FO_SCHEDULE, int(Mainloop::DispatchPolicy::Stages), FO_OUT_DTYPE,
      kBlockScaled ? 0 : 1};  // block-wise: promoted every 128 k, by its scales
  return c;
}

cudaError_t load_kernel() { return prepare_kernel_once(signaling_gemm, kSmemBytes); }

cudaError_t check_limits(const Args& args) {
  const fo_gemm_scales& s = *args.scales;  // (check_scales: an e4m3 build has scales)
  if (args.ldo == 0)
    return fail(cudaErrorInvalidValue,
                "this GEMM build (CUTLASS's fp8 kernel) writes its tiles in place into a row-major "
                "result: ldo must be >= N (a plan with layout 'rows'), got 0 (packed tiles)");
  if (args.block_starts)
    return fail(cudaErrorInvalidValue,
                "this GEMM build takes no unequal blocks (all_to_all): fo_gemm_run_blocks runs "
                "gemm_sm90.cu's kernel");
  if (args.item_wait && !FO_ITEM_WAITS)
    return fail(cudaErrorInvalidValue,
                "this GEMM build does not wait for rows: allgather's is its _gather build "
                "(gemm_sm90_stock_ex_scaled.cu)");
  if (args.L > 1 && args.block_rows % kBM)
    return fail(cudaErrorInvalidValue,
                "this GEMM build needs destination blocks of a multiple of %d rows (a tile may not "
                "straddle two), got L=%d blocks of %d", kBM, args.L, args.block_rows);
  if (!aligned16(args.packed) || args.ldo % kAlignD)
    return fail(cudaErrorInvalidValue,
                "this GEMM build stores by TMA: the result must be 16-byte aligned with ldo a "
                "multiple of %d elements (got %p, ldo=%lld)", kAlignD, args.packed,
                (long long)args.ldo);
  // (TMA boxes no wider than their tensors: the result's, and block-wise scale_a's rows)
  if (args.N < kBN || (kBlockScaled && args.M() < kBM))
    return fail(cudaErrorInvalidValue,
                "this GEMM build needs N >= %d%s, got M=%d, N=%d", kBN,
                kBlockScaled ? " and M >= 128 (block-wise scale_a's TMA box)" : "", args.M(),
                args.N);
  const bool blocks = s.a_per_row == FO_SCALE_BLOCKS && s.b_per_col == FO_SCALE_BLOCKS;
  if (kBlockScaled) {
    const int64_t M = args.M(), groups = (args.K + FO_SCALE_BLOCK - 1) / FO_SCALE_BLOCK;
    const int64_t cols = (args.N + FO_SCALE_BLOCK - 1) / FO_SCALE_BLOCK;
    if (!blocks)
      return fail(cudaErrorInvalidValue,
                  "this GEMM library applies block-wise scales in its main loop: a_per_row and "
                  "b_per_col must both be FO_SCALE_BLOCKS (%d), got %d and %d", FO_SCALE_BLOCKS,
                  s.a_per_row, s.b_per_col);
    // (M % 4: the row stride of scale_a's TMA map, encoded even where there is one group)
    const bool a_ok = (s.a_stride[0] == 1 || M == 1) && (s.a_stride[1] == M || groups == 1) &&
                      M % 4 == 0;
    const bool b_ok = (s.b_stride[0] == 1 || groups == 1) && (s.b_stride[1] == groups || cols == 1);
    if (!a_ok || !b_ok || !aligned16(s.a))
      return fail(cudaErrorInvalidValue,
                  "this GEMM build reads scale_a [M, groups] with strides (1, M), M a multiple of "
                  "4 and 16-byte aligned (its TMA map), and scale_b [groups, ceil(N/128)] with "
                  "strides (1, groups); got (%lld, %lld) "
                  "at %p and (%lld, %lld)", (long long)s.a_stride[0], (long long)s.a_stride[1],
                  static_cast<const void*>(s.a), (long long)s.b_stride[0],
                  (long long)s.b_stride[1]);
  } else if (s.a_per_row == FO_SCALE_BLOCKS || s.b_per_col == FO_SCALE_BLOCKS) {
    return fail(cudaErrorInvalidValue,
                "block-wise scales (FO_SCALE_BLOCKS) need a block-scaled GEMM library; this one "
                "takes tensor-wise and row-wise scales");
  }
  return cudaSuccess;
}

cudaError_t resident_ctas(int, int* ctas) { return kLaunch.resident_ctas(ctas); }

cudaError_t launch(const Args& args, cudaStream_t stream) {
  KernelParams params;
  cudaError_t err = kernel_params(args, &params);
  return err == cudaSuccess ? kLaunch.launch(params, args.num_ctas, stream) : err;
}

cudaError_t set_node(const Args& args, cudaGraphExec_t exec, cudaGraphNode_t node) {
  KernelParams params;
  cudaError_t err = kernel_params(args, &params);
  return err == cudaSuccess ? kLaunch.set_node(params, args.num_ctas, exec, node) : err;
}

}  // namespace fo::gemm
