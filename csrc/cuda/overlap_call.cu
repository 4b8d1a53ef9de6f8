// A prepared overlapped call (fo_call_* in flashoverlap_cuda.h): the whole call issued by one
// native function, so that a call costs microseconds of host time whatever its group count.
// Its last phase is the post-reorder, or the fused residual add + RMSNorm (add_rmsnorm.cu).
// One translation unit of the runtime object.
#include <algorithm>
#include <string>
#include <vector>

#include "add_rmsnorm.cuh"
#include "call_skeleton.cuh"
#include "nccl_loader.cuh"
#include "runtime.cuh"

// A call's captured graph (use_graph): the nodes a later call may have to re-point, and what
// they point at now. A call has two: one ending in the post-reorder, one in the fused residual
// add + RMSNorm (fo_call_run_add_rmsnorm).
struct fo_call_graph {
  cudaGraph_t graph = nullptr;  // kept: node handles belong to it
  cudaGraphExec_t exec = nullptr;
  cudaGraphNode_t gemm = nullptr;
  std::vector<cudaGraphNode_t> unpack;  // per block with tiles, in block order
  std::vector<int> unpack_block;
  cudaGraphNode_t norm = nullptr;  // the fused add + RMSNorm
  const void* a = nullptr;
  const void* b = nullptr;
  int64_t lda = 0, ldb = 0;
  void* out = nullptr;
  fo::runtime::NormLaunch norm_launch;
  fo_gemm_scales scales = {};  // fp8: what the GEMM node's scales point at
  void* gemm_out = nullptr;    // where the GEMM node writes
  int state = 0;  // 0 none yet, 1 replaying, -1 could not be made
};

// A "rows" call with a collective keeps the graphs of this many outs (its own and the spares).
constexpr size_t kRowsGraphs = 8;

struct fo_call {
  fo_call_desc d;
  std::vector<int32_t> group_sizes;
  std::vector<int64_t> steps;
  std::vector<int64_t> block_out_offset;
  std::vector<const int32_t*> block_tiles;
  std::vector<const int64_t*> block_offsets;
  std::vector<int32_t> block_num_tiles;
  fo::runtime::CallEvents events;
  cudaStream_t capture = nullptr;      // where the graph is captured (never runs work)
  fo_call_graph g;
  // A "rows" call with a collective: the graphs of other outs than g's, least recently used
  // first (RowsPhase::choose)
  std::vector<fo_call_graph> rows_spare;
  int64_t calls = 0;  // fo_call_run calls so far (a graph is used from the second)
  // The fused residual add + RMSNorm (fo_call_set_add_rmsnorm): the output block's rows.
  fo::runtime::NormRows norm_rows{};
  int norm_dtype = -1;  // -1: not set
  fo_call_graph norm_graph;
  int64_t norm_calls = 0;  // fo_call_run_add_rmsnorm calls so far
  fo_gemm_scales scales = {};          // fp8: this call's scales (fo_call_run_scaled)
};

namespace fo::runtime {

inline cudaError_t check_desc(const fo_call_desc& d) {
  if (d.abi_version != FO_CUDA_ABI_VERSION)
    return fail(cudaErrorInvalidValue, "fo_call_create: descriptor ABI %d, library ABI %d",
                d.abi_version, FO_CUDA_ABI_VERSION);
  // "rows": an allreduce's GEMM writes `out` (no packed buffer), and nothing is received into
  // staging but the fused norm's rows (set once it runs). A reduce_scatter without a packed
  // buffer is one of a group of one rank: its GEMM writes `out` too, and every step sends and
  // receives the same rows of it (NCCL's in-place form, which moves nothing at one rank).
  if (!d.gemm_launch || (!d.rows && !d.packed) || (!d.rows && !d.staging) || !d.counters ||
      (d.collective && !d.comm_stream))
    return fail(cudaErrorInvalidValue,
                "fo_call_create: gemm_launch, packed, staging, counters (and with a collective, "
                "comm_stream) are required");
  if (d.rows && d.collective == 3)
    return fail(cudaErrorInvalidValue, "fo_call_create: a \"rows\" call has no all_to_all path");
  if (d.num_groups < 1 || !d.group_sizes || d.per_step < 1 || (d.num_steps > 0 && !d.steps) ||
      (d.collective != 0 && d.num_steps < d.num_groups))
    return fail(cudaErrorInvalidValue,
                "fo_call_create: need num_groups >= 1 with sizes, num_steps >= num_groups, "
                "per_step >= 1 and the step table");
  if (d.collective < 0 || d.collective > 3 || (d.collective != 0 && !nccl::loaded()) ||
      (d.collective != 0 && !d.nccl_comm))
    return fail(cudaErrorInvalidValue,
                "fo_call_create: collective %d needs NCCL loaded (fo_nccl_load) and a communicator",
                d.collective);
  if (d.collective != 3 && d.per_step != 1)
    return fail(cudaErrorInvalidValue, "fo_call_create: only all_to_all has per_step > 1");
  if (d.use_graph && !d.gemm_set_node)
    return fail(cudaErrorInvalidValue, "fo_call_create: use_graph needs gemm_set_node");
  if (d.wait_mode != 0 && d.wait_mode != 1)
    return fail(cudaErrorInvalidValue, "fo_call_create: wait_mode %d is not 0 or 1", d.wait_mode);
  if (d.elem_size != 2 && d.elem_size != 4)
    return fail(cudaErrorInvalidValue, "fo_call_create: elem_size %d is not 2 or 4", d.elem_size);
  if (d.num_blocks < 0 || (d.num_blocks > 0 && (!d.block_out_offset || !d.block_tiles ||
                                                !d.block_offsets || !d.block_num_tiles)))
    return fail(cudaErrorInvalidValue, "fo_call_create: incomplete unpack block tables");
  if (d.rows && d.collective == 2 && !d.packed && d.steps) {
    for (int s = 0; s < d.num_steps; ++s) {
      const int64_t* e = d.steps + int64_t(s) * 4;
      if (e[0] != e[2] || e[1] != e[3])
        return fail(cudaErrorInvalidValue,
                    "fo_call_create: a \"rows\" reduce_scatter without a packed buffer must "
                    "send and receive the same rows (a group of one rank); step %d sends %lld "
                    "at %lld and receives %lld at %lld", s, (long long)e[1], (long long)e[0],
                    (long long)e[3], (long long)e[2]);
    }
  }
  return cudaSuccess;
}

// Where one call's GEMM writes and its collectives receive.
struct CallBuffers {
  void* gemm_out;
  void* recv;
};

// Step s's collective on `stream`: sends from b.gemm_out, receives into b.recv.
inline cudaError_t launch_step(const fo_call& c, int s, const CallBuffers& b, cudaStream_t stream) {
  const fo_call_desc& d = c.d;
  const int64_t* e = c.steps.data() + int64_t(s) * d.per_step * 4;
  char* packed = static_cast<char*>(b.gemm_out);
  char* staging = static_cast<char*>(b.recv);
  const int64_t es = d.elem_size;
  const nccl::Api& n = nccl::api();
  auto comm = static_cast<nccl::Comm>(d.nccl_comm);
  switch (d.collective) {
    case 1:
      if (e[1] > 0)
        FO_NCCL_CHECK(n.AllReduce(packed + e[0] * es, packed + e[0] * es, size_t(e[1]),
                                  d.nccl_dtype, nccl::kSum, comm, stream));
      return cudaSuccess;
    case 2:
      if (e[3] > 0)
        FO_NCCL_CHECK(n.ReduceScatter(packed + e[0] * es, staging + e[2] * es, size_t(e[3]),
                                      d.nccl_dtype, nccl::kSum, comm, stream));
      return cudaSuccess;
    case 3:  // every peer takes part (its entry may move nothing)
      return nccl::send_recv_step(d.per_step, d.nccl_dtype, comm, stream,
                                  [&](int peer, nccl::PeerTransfer* t) {
                                    const int64_t* p = e + 4 * peer;
                                    *t = {packed + p[0] * es, p[1], staging + p[2] * es, p[3]};
                                    return true;
                                  });
    default:
      return cudaSuccess;  // world size 1 without a communicator: the identity
  }
}

// The last node captured on `stream` (its capture's single dependency after a launch).
inline cudaError_t captured_node(cudaStream_t stream, cudaGraphNode_t* node) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaGraphNode_t* deps = nullptr;
  size_t count = 0;
#if CUDART_VERSION >= 13000
  FO_CUDA_CHECK(cudaStreamGetCaptureInfo(stream, &status, nullptr, nullptr, &deps, nullptr, &count));
#else
  FO_CUDA_CHECK(cudaStreamGetCaptureInfo_v2(stream, &status, nullptr, nullptr, &deps, &count));
#endif
  if (status != cudaStreamCaptureStatusActive || count != 1)
    return fail(cudaErrorStreamCaptureUnsupported,
                "capturing the call: expected one node after a launch, found %zu", count);
  *node = deps[0];
  return cudaSuccess;
}

// Where the GEMM's operands of one call are.
struct GemmOperands {
  const void* a;
  int64_t lda;
  const void* b;
  int64_t ldb;
};

// The last phase of a call, once the compute stream has joined the communication stream: what
// reads the received tiles from staging, zeroing the group counters for the next call on the
// way. Each phase says where the call's GEMM writes and its collectives receive, issues its
// kernels (recording their nodes while a graph is captured), says which of the call's graphs is
// its own (`choose` may first put another in its place), and re-points that graph's nodes at a
// call's operands (`rebuild`: capture afresh).

inline void drop_graph(fo_call_graph& g) {
  if (g.exec) cudaGraphExecDestroy(g.exec);
  if (g.graph) cudaGraphDestroy(g.graph);
  g = fo_call_graph();
}

// The post-reorder of every block into `out`.
struct UnpackPhase {
  void* out;
  static constexpr bool kWaitersReset = false;  // its kernel zeroes the counters

  static fo_call_graph& graph(fo_call& c) { return c.g; }
  static int64_t& calls(fo_call& c) { return c.calls; }

  CallBuffers buffers(const fo_call& c) const { return {c.d.packed, c.d.staging}; }

  cudaError_t issue(const fo_call& c, cudaStream_t stream, fo_call_graph* g) const {
    const fo_call_desc& d = c.d;
    bool reset = false;
    for (int k = 0; k < d.num_blocks; ++k) {
      if (c.block_num_tiles[k] == 0) continue;
      cudaError_t err = launch_unpack(d.staging, static_cast<char*>(out) + c.block_out_offset[k],
                                      d.ldo, c.block_tiles[k], c.block_offsets[k],
                                      c.block_num_tiles[k], d.elem_size,
                                      reset ? nullptr : d.counters, reset ? 0 : d.num_groups, stream);
      if (err != cudaSuccess) return err;
      if (g) {
        g->unpack.emplace_back();
        g->unpack_block.push_back(k);
        err = captured_node(stream, &g->unpack.back());
        if (err != cudaSuccess) return err;
      }
      reset = true;
    }
    if (!reset)  // nothing to unpack (a rank that receives no rows): reset on its own
      return launch_reset(d.counters, d.num_groups, stream);
    return cudaSuccess;
  }

  void remember(fo_call_graph& g) const { g.out = out; }

  void choose(fo_call&) const {}  // the collectives work on the call's own buffers

  cudaError_t update(const fo_call& c, fo_call_graph& g, bool*) const {
    const fo_call_desc& d = c.d;
    if (out == g.out) return cudaSuccess;
    for (size_t i = 0; i < g.unpack.size(); ++i) {
      const int k = g.unpack_block[i];
      UnpackLaunch u(d.staging, static_cast<char*>(out) + c.block_out_offset[k], d.ldo,
                     c.block_tiles[k], c.block_offsets[k], c.block_num_tiles[k], d.elem_size,
                     i == 0 ? d.counters : nullptr, i == 0 ? d.num_groups : 0);
      void* args[UnpackLaunch::kArgs];
      const cudaKernelNodeParams p = u.node(args);
      FO_CUDA_CHECK(cudaGraphExecKernelNodeSetParams(g.exec, g.unpack[i], &p));
    }
    g.out = out;
    return cudaSuccess;
  }
};

// A "rows" call: the rows are in place in `out` once the collectives are done, and there is no
// last phase: each group's waiter zeroes its counter on the communication stream; the last
// group's counter is not waited on (issue_call), and without a collective, or with one group,
// the GEMM signals nothing. An allreduce reduces `out` itself; a reduce_scatter receives into it (at one rank,
// in place).
struct RowsPhase {
  void* out;
  static constexpr bool kWaitersReset = true;

  static fo_call_graph& graph(fo_call& c) { return c.g; }
  static int64_t& calls(fo_call& c) { return c.calls; }

  // A reduce_scatter sends from its packed buffer, except at one rank (no packed buffer, or
  // only the fused norm's: packed == staging), where it works on `out` in place.
  CallBuffers buffers(const fo_call& c) const {
    const bool packed = c.d.collective == 2 && c.d.packed && c.d.packed != c.d.staging;
    return {packed ? c.d.packed : out, out};
  }

  cudaError_t issue(const fo_call&, cudaStream_t, fo_call_graph*) const { return cudaSuccess; }

  void remember(fo_call_graph& g) const { g.out = out; }

  // The collectives' nodes hold `out` and cannot be re-pointed, and a collective must be
  // launched alike on every rank: from a graph on all of them or on none (NCCL's rule; it
  // chooses buffers and protocols differently for a captured collective). Where `out` lies is
  // each rank's own, so no rank may fall back to launches for an out its graph does not hold:
  // every out gets a graph of its own. The call keeps those of its last kRowsGraphs outs; an
  // out none holds is captured afresh (host work only, on this rank alone; the ranks' graphs
  // launch the same collectives). Without a collective only the GEMM node holds `out`
  // (update_graph re-points it).
  void choose(fo_call& c) const {
    if (c.d.collective == 0 || c.g.state != 1 || c.g.out == out) return;
    std::vector<fo_call_graph>& spare = c.rows_spare;
    fo_call_graph current = c.g;
    auto held = std::find_if(spare.begin(), spare.end(),
                             [&](const fo_call_graph& s) { return s.out == out; });
    if (held != spare.end()) {
      c.g = *held;
      spare.erase(held);
    } else {
      c.g = fo_call_graph();  // state 0: run_call captures it for this out
      if (spare.size() + 1 >= kRowsGraphs) {
        drop_graph(spare.front());
        spare.erase(spare.begin());
      }
    }
    spare.push_back(current);
  }

  // With a collective, choose has already given the call this out's graph (g.out == out).
  cudaError_t update(const fo_call&, fo_call_graph& g, bool*) const {
    g.out = out;
    return cudaSuccess;
  }
};

// The post-reorder fused into residual add + RMSNorm: one kernel (add_rmsnorm.cuh).
struct NormPhase {
  NormLaunch launch;
  static constexpr bool kWaitersReset = false;  // its kernel zeroes the counters

  static fo_call_graph& graph(fo_call& c) { return c.norm_graph; }
  static int64_t& calls(fo_call& c) { return c.norm_calls; }

  CallBuffers buffers(const fo_call& c) const { return {c.d.packed, c.d.staging}; }

  cudaError_t issue(const fo_call&, cudaStream_t stream, fo_call_graph* g) const {
    NormLaunch l = launch;
    cudaError_t err = l.launch(stream);
    if (err == cudaSuccess && g) err = captured_node(stream, &g->norm);
    return err;
  }

  void remember(fo_call_graph& g) const { g.norm_launch = launch; }

  void choose(fo_call&) const {}  // the collectives work on the call's own buffers

  // Another kernel or CTA size (the operands' alignment changed): the graph is captured afresh.
  cudaError_t update(const fo_call&, fo_call_graph& g, bool* rebuild) const {
    if (launch.same(g.norm_launch)) return cudaSuccess;
    if (launch.kernel != g.norm_launch.kernel || launch.block.x != g.norm_launch.block.x) {
      *rebuild = true;
      return cudaSuccess;
    }
    NormLaunch l = launch;
    void* args[4];
    const cudaKernelNodeParams p = l.node(args);
    FO_CUDA_CHECK(cudaGraphExecKernelNodeSetParams(g.exec, g.norm, &p));
    g.norm_launch = launch;
    return cudaSuccess;
  }
};

// Whether a call ending in `Phase` has the GEMM signal its group counters: not without a
// collective (nothing waits on them), nor in a "rows" call of one group, whose only collective
// follows the GEMM in stream order (nothing waits on them either, and none needs zeroing). The
// other phases' kernels zero the counters, and the fused norm's reads them.
template <class Phase>
inline bool signals(const fo_call& c) {
  return c.d.collective != 0 && !(Phase::kWaitersReset && c.d.num_groups == 1);
}

// The GEMM's launch parameters for one call, writing `out` (signaling: see `signals`).
inline fo_gemm_params gemm_params(const fo_call& c, const GemmOperands& op, void* out,
                                  bool signal) {
  const fo_call_desc& d = c.d;
  return fo_gemm_params{op.a, op.lda, op.b, op.ldb, d.scaled ? &c.scales : nullptr, out,
                        d.rows ? int64_t(d.N) : 0, d.L, d.block_rows, d.N, d.K, d.items,
                        d.item_group, d.num_items, signal ? d.counters : nullptr,
                        d.num_ctas, nullptr};
}

// Issues the whole call on `stream` (see fo_call_desc), ending in `phase`. `warm`: a host sync
// after each phase. `g` (capture only): records the GEMM's and the last phase's nodes.
template <class Phase>
inline cudaError_t issue_call(fo_call& c, const GemmOperands& op, const Phase& phase,
                              cudaStream_t stream, bool warm, fo_call_graph* g) {
  const fo_call_desc& d = c.d;
  // Without a collective (world size 1, no communicator) there is nothing to overlap: the
  // GEMM and the post-reorder run on the caller's stream, which orders them.
  const bool communicate = d.collective != 0;
  // The last group's steps (and any step past the groups) run on `stream` itself, after the
  // GEMM: stream order already has every tile done, so no counter is waited for and no join of
  // the communication stream lies between the GEMM's end and the last collective, the critical
  // path (NCCL orders a communicator's collectives across streams). The earlier groups'
  // collectives run on the communication stream, which `stream` joins before the last.
  const int tail = communicate ? d.num_groups - 1 : 0;  // the first step on `stream`
  const bool forked = communicate && tail > 0;
  // The communication stream's work must follow whatever the caller queued before this call
  // (the inputs, and the previous call's reads of the packed buffer).
  cudaError_t err = forked ? c.events.fork(stream, d.comm_stream) : cudaSuccess;
  if (err != cudaSuccess) return err;
  // The GEMM first: a waiter queued before its producer could deadlock (docs/design.md).
  const CallBuffers buffers = phase.buffers(c);
  const fo_gemm_params params = gemm_params(c, op, buffers.gemm_out, signals<Phase>(c));
  err = reinterpret_cast<GemmLaunch>(d.gemm_launch)(&params, stream);
  if (err != cudaSuccess) return gemm_failed(err, "signaling");
  if (g) {
    err = captured_node(stream, &g->gemm);
    if (err != cudaSuccess) return err;
  }
  if (warm) FO_CUDA_CHECK(cudaStreamSynchronize(stream));
  for (int s = 0; s < tail; ++s) {  // (s < num_groups: tail <= num_groups - 1)
    err = Phase::kWaitersReset
              ? wait_counter_and_reset(d.counters + s, c.group_sizes[s], d.wait_mode, d.comm_stream)
              : wait_counter(d.counters + s, c.group_sizes[s], d.wait_mode, d.comm_stream);
    if (err != cudaSuccess) return err;
    err = launch_step(c, s, buffers, d.comm_stream);
    if (err != cudaSuccess) return err;
  }
  if (forked) {
    // A "rows" call's last counter is neither waited on nor zeroed: only the last group's
    // collective reads those rows, and it follows the GEMM in stream order. Its tiles still add
    // to it (the kernel signals every group), so it only grows, wrapping, and nothing reads it;
    // the other phases' kernels zero every counter. So the join has nothing of the GEMM's end
    // to wait for: it holds only the earlier groups' collectives (a waiter of the last counter
    // before the join cost about 1 us per call on the H200, a reset after the GEMM about 3).
    if (warm) FO_CUDA_CHECK(cudaStreamSynchronize(d.comm_stream));
    err = c.events.comm_finished(d.comm_stream);
    if (err == cudaSuccess) err = c.events.join(stream);
    if (err != cudaSuccess) return err;
  }
  if (communicate) {
    for (int s = tail; s < d.num_steps; ++s) {
      err = launch_step(c, s, buffers, stream);
      if (err != cudaSuccess) return err;
    }
  }
  err = phase.issue(c, stream, g);
  if (err != cudaSuccess) return err;
  if (warm) FO_CUDA_CHECK(cudaStreamSynchronize(stream));
  return cudaSuccess;
}

// Captures the call once (on a private stream, thread-local mode: other threads' captures and
// launches are not disturbed) and instantiates it into `Phase::graph(c)`. Nothing runs here.
template <class Phase>
inline cudaError_t build_graph(fo_call& c, const GemmOperands& op, const Phase& phase) {
  if (!c.capture) FO_CUDA_CHECK(cudaStreamCreateWithFlags(&c.capture, cudaStreamNonBlocking));
  fo_call_graph g;
  FO_CUDA_CHECK(cudaStreamBeginCapture(c.capture, cudaStreamCaptureModeThreadLocal));
  cudaError_t err;
  {
    const nccl::OwnCapture own;  // launch_graph follows the graph: no slots for its collectives
    err = issue_call(c, op, phase, c.capture, false, &g);
  }
  const cudaError_t ended = cudaStreamEndCapture(c.capture, &g.graph);
  if (err == cudaSuccess && ended != cudaSuccess)
    err = fail(ended, "capturing the call: cudaStreamEndCapture: %s", cudaGetErrorString(ended));
  if (err == cudaSuccess) {
    // Per-node priorities: the communication branch keeps its stream's high priority.
    const cudaError_t made =
        cudaGraphInstantiateWithFlags(&g.exec, g.graph, cudaGraphInstantiateFlagUseNodePriority);
    if (made != cudaSuccess)
      err = fail(made, "instantiating the call's graph: %s", cudaGetErrorString(made));
  }
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the (non-sticky) error a failed capture leaves behind
    if (g.graph) cudaGraphDestroy(g.graph);
    return err;
  }
  g.a = op.a, g.b = op.b, g.lda = op.lda, g.ldb = op.ldb, g.scales = c.scales, g.state = 1;
  g.gemm_out = phase.buffers(c).gemm_out;
  phase.remember(g);
  Phase::graph(c) = std::move(g);
  return cudaSuccess;
}

// Re-points the graph's last-phase and GEMM nodes at this call's operands where they moved;
// `rebuild`: the graph must be captured afresh.
template <class Phase>
inline cudaError_t update_graph(fo_call& c, fo_call_graph& g, const GemmOperands& op,
                                const Phase& phase, bool* rebuild) {
  cudaError_t err = phase.update(c, g, rebuild);
  if (err != cudaSuccess || *rebuild) return err;
  const bool scales_moved = c.scales.a != g.scales.a || c.scales.b != g.scales.b;
  void* gemm_out = phase.buffers(c).gemm_out;
  if (op.a != g.a || op.b != g.b || op.lda != g.lda || op.ldb != g.ldb || scales_moved ||
      gemm_out != g.gemm_out) {
    const fo_gemm_params params = gemm_params(c, op, gemm_out, signals<Phase>(c));
    err = reinterpret_cast<GemmSetNodeParams>(c.d.gemm_set_node)(g.exec, g.gemm, &params);
    if (err != cudaSuccess)
      return fail(err, "re-pointing the graph's GEMM at new operands (cudaError %d)", int(err));
    g.a = op.a, g.b = op.b, g.lda = op.lda, g.ldb = op.ldb, g.scales = c.scales;
    g.gemm_out = gemm_out;
  }
  return cudaSuccess;
}

template <class Phase>
inline cudaError_t run_call(fo_call& c, const GemmOperands& op, const Phase& phase,
                            cudaStream_t stream, bool warm) {
  // The first call runs launch by launch (a warm one loads every kernel, with host syncs).
  // Later calls replay a graph, except inside the caller's own capture, where the launches are
  // what it records. Whether a call replays depends on nothing else, and so is the same on
  // every rank: NCCL requires a collective to be launched from a graph on all ranks or on none
  // (whether a call is warm is not: it is the first of its kernels in the process).
  const bool first = Phase::calls(c)++ == 0;
  if (c.d.use_graph && !warm && !first && Phase::graph(c).state >= 0) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    FO_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
    if (status == cudaStreamCaptureStatusNone) {
      phase.choose(c);
      fo_call_graph& g = Phase::graph(c);
      if (g.state == 1) {
        bool rebuild = false;
        cudaError_t err = update_graph(c, g, op, phase, &rebuild);
        if (err != cudaSuccess) return err;  // an update failed: the arguments are bad
        if (rebuild) drop_graph(g);
      }
      if (g.state == 0) {
        const cudaError_t built = build_graph(c, op, phase);
        if (built != cudaSuccess && c.d.collective != 0) {
          // The other ranks replay theirs: launching this one's collectives instead could
          // mismatch them. Fail the call (it can be retried: the next call captures again).
          const std::string why = last_error_text();
          return fail(built,
                      "the call's graph could not be captured, and the call is not run launch by "
                      "launch instead (every rank must launch its collectives alike: "
                      "FLASHOVERLAP_CUDA_GRAPH=0 on every rank turns the graphs off): %s",
                      why.c_str());
        }
        if (built != cudaSuccess) g.state = -1;  // no collective: launch by launch from now on
      }
      if (g.state == 1) {
        // refused once the watchdog aborted the communicator; else followed by it
        return nccl::launch_graph(g.exec, stream,
                                  c.d.collective ? static_cast<nccl::Comm>(c.d.nccl_comm) : nullptr);
      }
    }
  }
  return issue_call(c, op, phase, stream, warm, nullptr);
}

}  // namespace fo::runtime

extern "C" {

FO_API cudaError_t fo_call_create(const fo_call_desc* desc, fo_call** out) {
  if (!desc || !out) return fo::fail(cudaErrorInvalidValue, "fo_call_create: null argument");
  cudaError_t err = fo::runtime::check_desc(*desc);
  if (err != cudaSuccess) return err;
  auto* c = new fo_call();
  c->d = *desc;
  c->group_sizes.assign(desc->group_sizes, desc->group_sizes + desc->num_groups);
  c->steps.assign(desc->steps, desc->steps + int64_t(desc->num_steps) * desc->per_step * 4);
  c->block_out_offset.assign(desc->block_out_offset, desc->block_out_offset + desc->num_blocks);
  c->block_tiles.assign(desc->block_tiles, desc->block_tiles + desc->num_blocks);
  c->block_offsets.assign(desc->block_offsets, desc->block_offsets + desc->num_blocks);
  c->block_num_tiles.assign(desc->block_num_tiles, desc->block_num_tiles + desc->num_blocks);
  // The descriptor's host arrays belong to the caller: point at our copies.
  c->d.group_sizes = c->group_sizes.data();
  c->d.steps = c->steps.data();
  c->d.block_out_offset = c->block_out_offset.data();
  c->d.block_tiles = c->block_tiles.data();
  c->d.block_offsets = c->block_offsets.data();
  c->d.block_num_tiles = c->block_num_tiles.data();
  err = c->events.create();
  if (err != cudaSuccess) {
    fo_call_destroy(c);
    return fo::fail(err, "fo_call_create: cudaEventCreate: %s", cudaGetErrorString(err));
  }
  *out = c;
  return cudaSuccess;
}

FO_API cudaError_t fo_call_run(fo_call* call, const void* a, int64_t lda, const void* b,
                               int64_t ldb, void* out, cudaStream_t stream, int warm) {
  if (!call || !a || !b || !out)
    return fo::fail(cudaErrorInvalidValue, "fo_call_run: call, a, b and out must be non-null");
  const fo::runtime::GemmOperands op{a, lda, b, ldb};
  if (call->d.rows)
    return fo::runtime::run_call(*call, op, fo::runtime::RowsPhase{out}, stream, warm != 0);
  return fo::runtime::run_call(*call, op, fo::runtime::UnpackPhase{out}, stream, warm != 0);
}

FO_API cudaError_t fo_call_run_scaled(fo_call* call, const void* a, int64_t lda, const void* b,
                                      int64_t ldb, const float* scale_a, const float* scale_b,
                                      void* out, cudaStream_t stream, int warm) {
  if (!call || !call->d.scaled || !scale_a || !scale_b)
    return fo::fail(cudaErrorInvalidValue,
                    "fo_call_run_scaled: needs a call made with scaled = 1, and scale_a and "
                    "scale_b (got call=%p, scale_a=%p, scale_b=%p)", call, scale_a, scale_b);
  call->scales = fo_gemm_scales{scale_a, scale_b, call->d.scale_a_per_row, call->d.scale_b_per_col,
                                {call->d.scale_a_stride[0], call->d.scale_a_stride[1]},
                                {call->d.scale_b_stride[0], call->d.scale_b_stride[1]}};
  return fo_call_run(call, a, lda, b, ldb, out, stream, warm);
}

FO_API int fo_call_graph_state(const fo_call* call) { return call ? call->g.state : 0; }

FO_API int fo_call_graphs_held(const fo_call* call) {
  if (!call) return 0;
  int held = call->g.state == 1;
  for (const fo_call_graph& g : call->rows_spare) held += g.state == 1;
  return held;
}

FO_API cudaError_t fo_call_set_add_rmsnorm(fo_call* call, const int64_t* band_offsets, int rows,
                                           int tile_m, int tile_n, int dtype) {
  using namespace fo::runtime;
  if (!call) return fo::fail(cudaErrorInvalidValue, "fo_call_set_add_rmsnorm: call is null");
  const fo_call_desc& d = call->d;
  if (d.collective == 3 || !d.staging ||
      (!d.rows && (d.num_blocks != 1 || call->block_out_offset[0] != 0)))
    return fo::fail(cudaErrorInvalidValue,
                    "fo_call_set_add_rmsnorm: the call must write one block of rows (allreduce, "
                    "reduce_scatter), not %d blocks with collective %d", d.num_blocks, d.collective);
  const NormRows r{d.staging, band_offsets, rows, d.N, tile_m, tile_n,
                   tile_n > 0 ? (d.N + tile_n - 1) / tile_n : 0};
  cudaError_t err = check_norm_rows(r, dtype);
  if (err != cudaSuccess) return err;
  call->norm_rows = r, call->norm_dtype = dtype;
  return cudaSuccess;
}

FO_API cudaError_t fo_call_run_add_rmsnorm(fo_call* call, const void* a, int64_t lda,
                                           const void* b, int64_t ldb, const void* residual,
                                           int64_t ld_residual, const void* weight,
                                           int weight_dtype, float eps, void* normed,
                                           void* residual_out, int64_t ld_out,
                                           cudaStream_t stream, int warm) {
  using namespace fo::runtime;
  if (!call || !a || !b)
    return fo::fail(cudaErrorInvalidValue, "fo_call_run_add_rmsnorm: call, a and b must be non-null");
  if (call->norm_dtype < 0)
    return fo::fail(cudaErrorInvalidValue,
                    "fo_call_run_add_rmsnorm: the call has no band table (fo_call_set_add_rmsnorm)");
  if (call->d.scaled)
    return fo::fail(cudaErrorInvalidValue,
                    "fo_call_run_add_rmsnorm: an fp8 call (scaled) has no fused norm");
  NormPhase phase;
  const NormIo io{residual, ld_residual, weight, normed, residual_out, ld_out, eps};
  cudaError_t err = NormLaunch::make(call->norm_rows, call->norm_dtype, io, weight_dtype,
                                     call->d.counters, call->d.num_groups, &phase.launch);
  if (err != cudaSuccess) return err;
  return run_call(*call, GemmOperands{a, lda, b, ldb}, phase, stream, warm != 0);
}

FO_API int fo_call_add_rmsnorm_graph_state(const fo_call* call) {
  return call ? call->norm_graph.state : 0;
}

FO_API void fo_call_destroy(fo_call* call) {
  if (!call) return;
  fo::runtime::drop_graph(call->g);
  for (fo_call_graph& g : call->rows_spare) fo::runtime::drop_graph(g);
  fo::runtime::drop_graph(call->norm_graph);
  if (call->capture) cudaStreamDestroy(call->capture);
  call->events.destroy();
  delete call;
}

}  // extern "C"
