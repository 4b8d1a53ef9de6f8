// NCCL reached at run time: the runtime library declares the handful of NCCL entry points it
// calls and resolves them with dlopen/dlsym from the libnccl.so.2 that the process already has
// (the one torch loaded) or from a path the caller gives. So the library builds without NCCL's
// headers and uses the very NCCL build of the installed torch. Enum values are NCCL's public ABI.
// The loading and the fo_nccl_* C functions are nccl.cu's; the call kinds use the entry points
// through api() and send_recv_step.
//
// The watchdog (nccl.cu, fo_nccl_watch_*): once NCCL is loaded, api()'s collective, send/recv and
// group entry points are nccl.cu's guarded versions of NCCL's own (raw() keeps those). A guarded
// entry point refuses a communicator the watchdog aborted (ncclInvalidUsage, without calling
// NCCL) and, on a watched communicator and a stream that is not being captured, records an
// event after the work it queued, which the watchdog thread follows against the deadline. So
// every call kind is watched without knowing it; a graph of the call path's own is launched
// through launch_graph, which does the same for the whole graph.
#pragma once
#include "flashoverlap_cuda.h"  // the runtime's API
#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "common.cuh"

namespace fo::nccl {

typedef struct ncclComm* Comm;
typedef struct {
  char internal[128];
} UniqueId;
typedef int Result;  // ncclResult_t: 0 = ncclSuccess
enum DataType { kFloat16 = 6, kFloat32 = 7, kBfloat16 = 9 };
enum RedOp { kSum = 0 };

struct Api {
  Result (*GetVersion)(int*);
  Result (*GetUniqueId)(UniqueId*);
  Result (*CommInitRank)(Comm*, int, UniqueId, int);
  Result (*CommDestroy)(Comm);
  Result (*CommAbort)(Comm);
  Result (*CommGetAsyncError)(Comm, Result*);
  Result (*AllReduce)(const void*, void*, size_t, int, int, Comm, cudaStream_t);
  Result (*ReduceScatter)(const void*, void*, size_t, int, int, Comm, cudaStream_t);
  Result (*AllGather)(const void*, void*, size_t, int, Comm, cudaStream_t);
  Result (*Send)(const void*, size_t, int, int, Comm, cudaStream_t);
  Result (*Recv)(void*, size_t, int, int, Comm, cudaStream_t);
  Result (*GroupStart)();
  Result (*GroupEnd)();
  const char* (*GetErrorString)(Result);
  Result (*CommInitRankConfig)(Comm*, int, UniqueId, int, void*);  // NCCL >= 2.14; may be null
};

inline Api& api() {
  static Api a = {};
  return a;
}

inline bool loaded() { return api().GroupEnd != nullptr; }

// NCCL's own entry points (api() holds the guarded ones once loaded).
inline Api& raw() {
  static Api a = {};
  return a;
}

// ncclResult_t codes the watchdog reads.
constexpr Result kInvalidUsage = 5;
constexpr Result kInProgress = 7;

// cudaGraphLaunch(exec, stream) of a graph holding `comm`'s collectives (nullptr: none; captured
// on its capture twin where it has one, fo_nccl_set_capture_comm): an error without launching
// when the watchdog aborted it; on a watched communicator, the launch is followed against the
// deadline like any queued collective.
cudaError_t launch_graph(cudaGraphExec_t exec, cudaStream_t stream, Comm comm);

// Alive on a thread while it captures a graph of the call path's own (launched through
// launch_graph, which follows the whole graph): the collectives captured meanwhile take none of
// the watch's slots that follow a caller's captured collectives (nccl.cu), which a call capturing
// a graph per out would otherwise use up.
struct OwnCapture {
  OwnCapture();
  ~OwnCapture();
  OwnCapture(const OwnCapture&) = delete;
  OwnCapture& operator=(const OwnCapture&) = delete;
};

// Resolves every entry point from `path` (nullptr or "": the libnccl.so.2 already loaded in
// the process). Idempotent; the first successful load wins.
cudaError_t load(const char* path);

}  // namespace fo::nccl

// Returns from the enclosing function with a recorded message when an NCCL call fails.
#define FO_NCCL_CHECK(expr)                                                                \
  do {                                                                                     \
    ::fo::nccl::Result fo_res_ = (expr);                                                   \
    if (fo_res_ != 0)                                                                      \
      return ::fo::fail(cudaErrorUnknown, "%s failed: NCCL error %d (%s)", #expr, fo_res_,  \
                        ::fo::nccl::api().GetErrorString(fo_res_));                        \
  } while (0)

namespace fo::nccl {

// What moves between this rank and one peer in one step, in elements (a count <= 0: nothing).
struct PeerTransfer {
  const void* send;
  int64_t send_count;
  void* recv;
  int64_t recv_count;
};

// One step of point-to-point transfers on `stream`, as one NCCL group: for each peer p in
// [0, peers), `transfer(p, &t)` says whether p takes part and fills t; a peer that takes part
// gets its send, then its receive. The group opens at the first peer that takes part, so a step
// in which none does issues no NCCL call at all.
template <class Transfer>
inline cudaError_t send_recv_step(int peers, int dtype, Comm comm, cudaStream_t stream,
                                  Transfer&& transfer) {
  const Api& n = api();
  bool grouped = false;
  for (int peer = 0; peer < peers; ++peer) {
    PeerTransfer t;
    if (!transfer(peer, &t)) continue;
    if (!grouped) FO_NCCL_CHECK(n.GroupStart());
    grouped = true;
    Result r = 0;
    if (t.send_count > 0) r = n.Send(t.send, size_t(t.send_count), dtype, peer, comm, stream);
    if (r == 0 && t.recv_count > 0)
      r = n.Recv(t.recv, size_t(t.recv_count), dtype, peer, comm, stream);
    if (r != 0) { n.GroupEnd(); FO_NCCL_CHECK(r); }
  }
  if (grouped) FO_NCCL_CHECK(n.GroupEnd());
  return cudaSuccess;
}

}  // namespace fo::nccl
