// FlashOverlap signaling GEMM for Hopper (sm_90a).
//
// A warp-specialized persistent kernel built from CUTLASS 3.x parts: the TMA + wgmma mainloop
// collective of the collective builder (cooperative or pingpong schedule) does the math; this
// file supplies the kernel around it:
//   * a table-driven tile scheduler: persistent CTA c takes work items c, c+G, c+2G, ... of the
//     plan's item table (G = grid size), so the kernel's order is the plan's order;
//   * an epilogue that stores each finished tile at its slot of the packed buffer, row-major at
//     its real size, straight from the accumulators; each math thread then arrives on an
//     mbarrier (release), and a signal thread of the producer warpgroup, once all have arrived
//     (acquire), bumps the tile's group counter with a release add at GPU scope. So a counter
//     never becomes visible before its tiles' data, and the math warps never wait for the
//     stores to drain: they go on to the next tile at once.
// A tile may start at any row (A's TMA tensor is offset to the tile's first row): destination
// blocks need not be multiples of the tile height, and rows past a block's end are computed but
// never stored. K tails and M/N edges are zero-filled by TMA.
//
// One configuration per compilation, chosen with -D macros (defaults in brackets):
//   FO_TILE_M/N/K [128/256/64], FO_CLUSTER_M/N [2/1], FO_DTYPE [0 = bf16, 1 = fp16],
//   FO_B_COL_MAJOR [1], FO_SCHEDULE [0 = cooperative, 1 = pingpong], FO_STAGES [0 = auto].
#include "epilogue.cuh"
#include "gemm_abi.cuh"

#include "cute/tensor.hpp"
#include "cutlass/arch/reg_reconfig.h"
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

namespace fo::sm90 {
using namespace cute;

constexpr int kBM = FO_TILE_M, kBN = FO_TILE_N, kBK = FO_TILE_K;
constexpr int kClusterM = FO_CLUSTER_M, kClusterN = FO_CLUSTER_N;
constexpr int kClusterSize = kClusterM * kClusterN;
constexpr bool kPingpong = FO_SCHEDULE == 1;
static_assert(FO_SCHEDULE == 0 || FO_SCHEDULE == 1, "FO_SCHEDULE: 0 cooperative, 1 pingpong");
static_assert(kClusterSize <= 8, "portable cluster size is at most 8");

using Element = cute::conditional_t<FO_DTYPE == 0, cutlass::bfloat16_t, cutlass::half_t>;
using TileShape = Shape<Int<kBM>, Int<kBN>, Int<kBK>>;
using ClusterShape = Shape<Int<kClusterM>, Int<kClusterN>, _1>;
using KernelSchedule = cute::conditional_t<kPingpong, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                                           cutlass::gemm::KernelTmaWarpSpecializedCooperative>;
using LayoutA = cutlass::layout::RowMajor;
using LayoutB = cute::conditional_t<FO_B_COL_MAJOR, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;

// Pingpong: the two math warpgroups take turns, mainloop then epilogue (depth 2, 2 groups).
using MathOrderBarrier = cutlass::OrderedSequenceBarrier<2, 2>;
// Stored tiles, from the math threads (each arrives after its own stores) to the signal warp,
// which publishes them; 4 tiles may wait, so the math threads practically never block.
using SignalPipeline = cutlass::PipelineAsync<4>;
constexpr int kCarveout = int(sizeof(typename MathOrderBarrier::SharedStorage) +
                              sizeof(typename SignalPipeline::SharedStorage)) + 32;

using Stages = cute::conditional_t<FO_STAGES == 0,
                                   cutlass::gemm::collective::StageCountAutoCarveout<kCarveout>,
                                   cutlass::gemm::collective::StageCount<FO_STAGES>>;

using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, 8, Element, LayoutB, 8,
    float, TileShape, ClusterShape, Stages, KernelSchedule>::CollectiveOp;
using TiledMma = typename Mainloop::TiledMma;
using MainloopPipeline = typename Mainloop::MainloopPipeline;
using PipelineState = typename Mainloop::PipelineState;

constexpr int kThreads = 384;  // one producer warpgroup, two math warpgroups
constexpr int kTileThreads = kPingpong ? 128 : 256;  // math threads that share one tile
static_assert(int(size(TiledMma{})) == kTileThreads, "unexpected TiledMma size");
constexpr int kAccRegs = kBM * kBN / kTileThreads;
constexpr int kLoadRegs = kAccRegs >= 208 ? 24 : 40;
constexpr int kMathRegs = kAccRegs >= 208 ? 240 : 232;

struct SharedStorage {
  struct alignas(128) Tensors {
    typename Mainloop::TensorStorage mainloop;
  } tensors;
  struct alignas(16) Pipelines {
    alignas(16) typename Mainloop::PipelineStorage mainloop;
    alignas(16) typename MathOrderBarrier::SharedStorage math_order;
    alignas(16) typename SignalPipeline::SharedStorage signal;
  } pipelines;
};
constexpr int kSmemBytes = int(sizeof(SharedStorage));

struct Params {
  typename Mainloop::Params mainloop;
  ItemTable table;
  Element* packed;
  int32_t* counters;
  uint64_t* monitor;
  int K;
};

// The item this CTA (cluster rank `rank`) computes in the cluster round that starts at `base`,
// for the producer: checked, including the cluster rule (header). Past the end of the table a
// CTA still joins its cluster's multicast loads with a filler item (valid = false) whose rows
// and columns match its cluster peers.
__device__ inline WorkTile cluster_item(const ItemTable& t, int64_t base, int rank) {
  const int rm = rank % kClusterM, rn = rank / kClusterM;
  if (base + rank < t.num_items) {
    WorkTile w = decode_item<kBM, kBN>(t, base + rank);
    if constexpr (kClusterSize > 1) {
      // Multicast: A is shared along the cluster's N mode, B along its M mode.
      if (rn > 0 && decode_item<kBM, kBN>(t, base + rm).row0 != w.row0) __trap();
      if (rm > 0 && decode_item<kBM, kBN>(t, base + rn * kClusterM).n_blk != w.n_blk) __trap();
    }
    return w;
  }
  WorkTile w{};
  w.valid = false;
  if (base + rm < t.num_items) w.row0 = decode_item<kBM, kBN>(t, base + rm).row0;
  if (base + rn * kClusterM < t.num_items) w.n_blk = decode_item<kBM, kBN>(t, base + rn * kClusterM).n_blk;
  return w;
}

// The same item for the math threads, which only store it: unchecked (the producer checked it
// before loading its operands), so the loads overlap the mainloop.
__device__ inline WorkTile stored_item(const ItemTable& t, int64_t base, int rank) {
  if (base + rank < t.num_items) return decode_item<kBM, kBN, false>(t, base + rank);
  WorkTile w{};
  w.valid = false;
  return w;
}

__global__ void __launch_bounds__(kThreads, 1) signaling_gemm(const __grid_constant__ Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
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

  if (thread_idx == 0) Mainloop::prefetch_tma_descriptors(p.mainloop);

  typename MainloopPipeline::Params pp;
  if (warp_group == 0 && warp_in_group == 0) pp.role = MainloopPipeline::ThreadCategory::Producer;
  if (warp_group > 0) pp.role = MainloopPipeline::ThreadCategory::Consumer;
  pp.is_leader = thread_in_group == 0;
  pp.num_consumers = kTileThreads;
  pp.num_producers = Mainloop::NumProducerThreadEvents;
  pp.transaction_bytes = p.mainloop.tma_transaction_bytes;
  MainloopPipeline pipeline(ss.pipelines.mainloop, pp, ClusterShape{});

  typename MathOrderBarrier::Params op;
  op.group_id = warp_group - 1;
  op.group_size = 128;
  MathOrderBarrier math_order(ss.pipelines.math_order, op);

  typename SignalPipeline::Params sp;
  if (warp_group == 0 && warp_in_group == 1) sp.role = SignalPipeline::ThreadCategory::Consumer;
  if (warp_group > 0) sp.role = SignalPipeline::ThreadCategory::Producer;
  sp.producer_arv_count = kTileThreads;
  sp.consumer_arv_count = 1;
  sp.dst_blockid = rank;
  SignalPipeline signal_pipe(ss.pipelines.signal, sp);

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
      for (int64_t base = first_base; base < p.table.num_items; base += round_stride) {
        WorkTile w = cluster_item(p.table, base, rank);
        auto gA = local_tile(domain_offset(make_coord(w.row0, 0, 0), mA), TileShape{},
                             make_coord(_, _, _), Step<_1, X, _1>{});
        auto k_iter = make_coord_iterator(shape<3>(gA));
        mainloop.load(p.mainloop, pipeline, write_state, cute::make_tuple(gA, gB),
                      make_coord(0, w.n_blk, _, 0), k_iter, k_tiles, thread_in_group, rank,
                      ss.tensors.mainloop);
        write_state.advance(k_tiles);
      }
      mainloop.load_tail(pipeline, write_state);
    } else if (warp_in_group == 1 && thread_in_group == 32) {
      // Signal thread: as each stored tile arrives, publish it with a release add on its group's
      // counter (off the math warps, which go on to the next tile at once).
      typename SignalPipeline::PipelineState read_state;
      for (int64_t base = first_base; base < p.table.num_items; base += round_stride) {
        signal_pipe.consumer_wait(read_state);
        const int64_t item = base + rank;
        if (item < p.table.num_items) {
          if (p.counters) signal_counter(p.counters + p.table.item_group[item]);
          record_monitor(p.monitor, item, cta);
        }
        signal_pipe.consumer_release(read_state);
        ++read_state;
      }
    }
  } else {
    // Math warpgroups. Cooperative: both share every tile. Pingpong: they alternate tiles.
    cutlass::arch::warpgroup_reg_alloc<kMathRegs>();
    const int math_thread = kPingpong ? thread_in_group : thread_idx - 128;
    const int math_group = warp_group - 1;
    TiledMma tiled_mma;
    auto thr_mma = tiled_mma.get_slice(math_thread);
    auto coord = thr_mma.partition_C(make_identity_tensor(make_shape(Int<kBM>{}, Int<kBN>{})));
    assert_pairs(coord);

    PipelineState read_state;
    auto signal_state = cutlass::make_producer_start_state<SignalPipeline>();
    int64_t base = first_base, step = round_stride;
    if constexpr (kPingpong) {
      step = 2 * round_stride;
      if (math_group == 1) {
        base += round_stride;
        read_state.advance(k_tiles);
        ++signal_state;
      }
    }
    for (; base < p.table.num_items; base += step) {
      const WorkTile w = stored_item(p.table, base, rank);
      auto acc = partition_fragment_C(tiled_mma, take<0, 2>(TileShape{}));
      if constexpr (kPingpong) math_order.wait();
      mainloop.mma(pipeline, read_state, acc, k_tiles, math_thread, ss.tensors.mainloop, p.mainloop);
      if constexpr (kPingpong) math_order.arrive();
      mainloop.mma_tail(pipeline, read_state, k_tiles);
      read_state.advance(kPingpong ? 2 * k_tiles : k_tiles);

      if constexpr (kPingpong) math_order.wait();
      signal_pipe.producer_acquire(signal_state);
      if (w.valid) store_tile<Element, kBM, kBN>(acc, coord, p.packed + w.offset, w.rows, w.cols);
      // Each thread's stores come before its arrive (release, CTA scope); the signal thread's
      // wait (acquire) then its release add at GPU scope publish them all.
      asm volatile("" ::: "memory");
      signal_pipe.producer_commit(signal_state);
      signal_state.advance(kPingpong ? 2 : 1);
      if constexpr (kPingpong) math_order.arrive();
    }
  }
#else
  // Compiled for another architecture: this library needs sm_90a.
  __trap();
#endif
}

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
  typename Mainloop::Arguments args{static_cast<const Element*>(a), dA,
                                    static_cast<const Element*>(b), dB};
  cache.mainloop = Mainloop::to_underlying_arguments(make_shape(M, N, K, 1), args, nullptr);
  cache.a = a, cache.b = b, cache.M = M, cache.N = N, cache.K = K, cache.lda = lda, cache.ldb = ldb;
  cache.valid = true;
  return cache.mainloop;
}

}  // namespace fo::sm90

namespace fo::gemm {
using namespace fo::sm90;

const fo_gemm_config& config() {
  static const fo_gemm_config c = {
      FO_CUDA_ABI_VERSION, 90, kBM, kBN, kBK, kClusterM, kClusterN, FO_DTYPE, FO_B_COL_MAJOR,
      kClusterSize, FO_SCHEDULE, int(Mainloop::DispatchPolicy::Stages)};
  return c;
}

cudaError_t load_kernel() { return prepare_kernel_once(signaling_gemm, kSmemBytes); }

cudaError_t check_limits(const Args&) { return cudaSuccess; }  // TMA handles every edge

// Launch configuration: grid (cluster_m * clusters, cluster_n), clusters of cluster_m x cluster_n.
static cudaLaunchConfig_t launch_config(int num_ctas, cudaLaunchAttribute* attr) {
  attr->id = cudaLaunchAttributeClusterDimension;
  attr->val.clusterDim.x = kClusterM, attr->val.clusterDim.y = kClusterN, attr->val.clusterDim.z = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(kClusterM * (num_ctas / kClusterSize), kClusterN, 1);
  config.blockDim = dim3(kThreads, 1, 1);
  config.dynamicSmemBytes = kSmemBytes;
  config.attrs = attr;
  config.numAttrs = 1;
  return config;
}

cudaError_t resident_ctas(int, int* ctas) {
  cudaLaunchAttribute attr;
  cudaLaunchConfig_t config = launch_config(kClusterSize, &attr);
  int clusters = 0;
  FO_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, signaling_gemm, &config));
  *ctas = clusters * kClusterSize;
  return cudaSuccess;
}

cudaError_t launch(const Args& args, cudaStream_t stream) {
  Params params;
  params.mainloop = mainloop_params(args.a, args.b, args.L * args.block_rows, args.N, args.K,
                                    args.lda, args.ldb);
  params.table = args.table();
  params.packed = static_cast<Element*>(args.packed);
  params.counters = args.counters;
  params.monitor = args.monitor;
  params.K = args.K;
  cudaLaunchAttribute attr;
  cudaLaunchConfig_t config = launch_config(args.num_ctas, &attr);
  config.stream = stream;
  FO_CUDA_CHECK(cudaLaunchKernelEx(&config, signaling_gemm, params));
  return cudaSuccess;
}

}  // namespace fo::gemm
