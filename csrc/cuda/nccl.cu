// NCCL's C ABI (fo_nccl_* in flashoverlap_cuda.h), one translation unit of the runtime object:
// loading NCCL from the process (nccl_loader.cuh says how), making and destroying
// communicators, and the watchdog of the communicators FlashOverlap makes.
//
// The watchdog. A watched communicator (fo_nccl_watch) has a deadline (seconds) and a list of
// pending events: the guarded entry points (api() after load) record one on the stream after
// each piece of work they queue, and note the time the host entered NCCL (so an enqueue that
// blocks is timed too). One thread, started with the first watch, polls every watch every
// kPollMs: it drops the events that completed, and when the oldest pending one is older than
// the deadline, or ncclCommGetAsyncError reports an error, it fails the watch and every other
// watch of the same group id: marks them aborted (the guarded entry points then refuse them),
// waits for enqueues in flight to leave NCCL (at most kDrainMs) and calls ncclCommAbort, so
// that kernels stuck waiting for a peer return. What follows is the watch's `handling`: 0 the
// next call on it fails (Python raises); 1 the process is torn down (SIGABRT) after the abort;
// 2 it is torn down without aborting (torch's TORCH_NCCL_ASYNC_ERROR_HANDLING 1 and 3).
// Work captured into a graph (the caller's, or the call path's own) has no event to record: the
// capture gets two stream writes around each collective, to a slot of host memory of the watch
// (1 before, 2 after), and the thread times a slot it sees at 1 from when it first saw it. So a
// replay stuck in a collective is found too; one that completes between two looks is never seen.
// A graph of the call path's own takes no slots (OwnCapture): launch_graph follows it whole.
// Nothing here is ever freed: the thread may poll while the process exits.
//
// Captured and eager work on separate communicators (fo_nccl_set_capture_comm). A communicator
// may have a capture twin: a guarded entry point called on a stream being captured issues its
// work on the twin instead. So one communicator only ever runs eager work and the other only
// graph replays. NCCL 2.28 does not keep one rank's network work in order on a communicator used
// both ways: while graphs of it are alive, an eager call's proxy work is posted by a host
// callback behind the previous one's when that is still pending, and at once when none is
// alive; when NCCL reclaims the last destroyed graph (at a later group launch) between two
// eager calls, the second one's work is posted before the first's. The peers then pair one
// call's sends with another's receives ("message truncated"), or hang. On an eager-only
// communicator every call posts at once, in order; on a graph-only one every replay posts from
// its own host node, in stream order.
#include <cuda.h>  // driver types only: cuStreamWriteValue32 is reached through the runtime
#include <dlfcn.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <deque>
#include <mutex>
#include <shared_mutex>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "nccl_loader.cuh"

namespace fo::nccl {

// ncclConfig_t as of NCCL 2.17 (nccl.h). Later versions append fields; NCCL reads `size` bytes
// of the struct it is given and takes its defaults for the rest, so this prefix stays valid.
struct ConfigPrefix {
  size_t size;
  unsigned int magic;    // 0xcafebeef
  unsigned int version;  // NCCL_VERSION of the struct: 21700
  int blocking;
  int cgaClusterSize;
  int minCTAs;
  int maxCTAs;
  const char* netName;
};
constexpr int kConfigUndefined = INT_MIN;  // NCCL_CONFIG_UNDEF_INT

inline ConfigPrefix bounded_config(int max_ctas) {
  ConfigPrefix c;
  c.size = sizeof(ConfigPrefix), c.magic = 0xcafebeef, c.version = 21700;
  c.blocking = 1, c.cgaClusterSize = 1, c.minCTAs = kConfigUndefined, c.maxCTAs = max_ctas;
  c.netName = nullptr;
  return c;
}

Api guarded(const Api& a);  // NCCL's entry points with the watchdog's guard (below)

cudaError_t load(const char* path) {
  static std::mutex lock;
  std::lock_guard<std::mutex> guard(lock);
  if (loaded()) return cudaSuccess;
  void* lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_NOLOAD);
  if (!lib && path && *path) lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!lib)
    return fail(cudaErrorSharedObjectInitFailed,
                "NCCL is not loaded in this process and %s could not be opened: %s",
                path && *path ? path : "no path was given", dlerror());
  Api a = {};
  const char* missing = nullptr;
  auto sym = [&](auto& fn, const char* name) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
    if (!fn && !missing) missing = name;
  };
  sym(a.GetVersion, "ncclGetVersion");
  sym(a.GetUniqueId, "ncclGetUniqueId");
  sym(a.CommInitRank, "ncclCommInitRank");
  sym(a.CommDestroy, "ncclCommDestroy");
  sym(a.CommAbort, "ncclCommAbort");
  sym(a.CommGetAsyncError, "ncclCommGetAsyncError");
  sym(a.AllReduce, "ncclAllReduce");
  sym(a.ReduceScatter, "ncclReduceScatter");
  sym(a.AllGather, "ncclAllGather");
  sym(a.Send, "ncclSend");
  sym(a.Recv, "ncclRecv");
  sym(a.GroupStart, "ncclGroupStart");
  sym(a.GroupEnd, "ncclGroupEnd");
  sym(a.GetErrorString, "ncclGetErrorString");
  if (missing)
    return fail(cudaErrorSymbolNotFound, "the loaded NCCL has no %s (NCCL 2.7 or newer is needed)",
                missing);
  a.CommInitRankConfig = reinterpret_cast<decltype(a.CommInitRankConfig)>(
      dlsym(lib, "ncclCommInitRankConfig"));  // optional: only allgather's communicator needs it
  raw() = a;
  api() = guarded(a);
  return cudaSuccess;
}

// ---- the watchdog ------------------------------------------------------------------------------

namespace {

constexpr int kPollMs = 100;          // how often the thread looks at every watch
constexpr int kDrainMs = 2000;        // how long an abort waits for enqueues to leave NCCL
constexpr size_t kMaxPending = 4096;  // events per watch; past it the host mark times the work
constexpr int kSlots = 4096;          // captured collectives followed per watch

using StreamWriteValue32 = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

StreamWriteValue32 write_value() {  // null when the driver has none
  static StreamWriteValue32 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuStreamWriteValue32", &p, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return StreamWriteValue32(nullptr);
    }
    return reinterpret_cast<StreamWriteValue32>(p);
  }();
  return fn;
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// What a guarded entry point queued, by kind (fo_nccl_watch_status's `kind`).
enum Kind { kNone = 0, kAllReduce, kReduceScatter, kAllGather, kSendRecv, kGraph };

struct Pending {
  cudaEvent_t event;
  int64_t since_ns;  // when the host queued the work
  int kind;
};

}  // namespace

struct Watch {
  Comm comm = nullptr;
  int device = 0;
  int64_t group = 0;  // the watches of one group id fail together
  int handling = 0;
  std::atomic<int64_t> timeout_ns{0};
  std::atomic<bool> aborted{false};
  std::atomic<int> state{FO_WATCH_OK};
  // since when the host has been inside NCCL with no event recorded after it (0: not)
  std::atomic<int64_t> host_since{0};
  std::atomic<int> host_kind{kNone};
  std::mutex m;  // pending, free_events, and the report below
  std::deque<Pending> pending;
  std::vector<cudaEvent_t> free_events;
  int nccl_error = 0, kind = kNone;
  double waited_s = 0;
  char reason[512] = {0};
  // captured collectives: slot i of the host memory `slots` (device address `slots_dev`) is 1
  // while a replay is inside collective i; `first_seen` is the thread's own
  uint32_t* slots = nullptr;
  CUdeviceptr slots_dev = 0;
  std::atomic<int> slots_used{0};
  std::vector<int64_t> first_seen;

  // A slot for a collective being captured on `stream`, its "inside" write queued (-1: none).
  int enter_capture(cudaStream_t stream) {
    StreamWriteValue32 write = write_value();
    if (!slots || !write) return -1;
    const int slot = slots_used.fetch_add(1);
    if (slot >= kSlots) return -1;
    if (write(reinterpret_cast<CUstream>(stream), slots_dev + 4 * CUdeviceptr(slot), 1, 0) != 0)
      return -1;
    return slot;
  }

  // The "done" write of `slot` on `stream`, after the collective.
  void leave_capture(cudaStream_t stream, int slot) {
    if (slot >= 0)
      write_value()(reinterpret_cast<CUstream>(stream), slots_dev + 4 * CUdeviceptr(slot), 2, 0);
  }

  // The host enters NCCL for work of `k` (nothing to do when it already is).
  void mark(int k) {
    int64_t zero = 0;
    if (host_since.compare_exchange_strong(zero, now_ns())) host_kind.store(k);
  }

  // The host left NCCL without queuing anything (an error): nothing to time.
  void unmark() { host_since.store(0); }

  // Drops the completed events at the front (under `m`); the first error other than "not
  // ready" is returned (the caller decides), or cudaSuccess.
  cudaError_t drop_completed() {
    while (!pending.empty()) {
      const cudaError_t query = cudaEventQuery(pending.front().event);
      if (query == cudaErrorNotReady) return cudaSuccess;
      if (query != cudaSuccess) return query;
      free_events.push_back(pending.front().event);
      pending.pop_front();
    }
    return cudaSuccess;
  }

  // An event after the work just queued on `stream` (not capturing), timed from the mark.
  void record(cudaStream_t stream) {
    std::lock_guard<std::mutex> hold(m);
    const int64_t since = host_since.load();
    if (pending.size() >= kMaxPending) {
      // cudaEventQuery: relaxed, so that another thread's capture in global mode is not broken
      cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
      cudaThreadExchangeStreamCaptureMode(&mode);
      if (drop_completed() != cudaSuccess) cudaGetLastError();
      cudaThreadExchangeStreamCaptureMode(&mode);
    }
    if (pending.size() >= kMaxPending) {  // the device is far behind: the older events time it
      host_since.store(0);
      return;
    }
    cudaEvent_t e = nullptr;
    if (!free_events.empty()) {
      e = free_events.back();
      free_events.pop_back();
    } else if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess) {
      cudaGetLastError();
      host_since.store(0);
      return;
    }
    if (cudaEventRecord(e, stream) != cudaSuccess) {
      cudaGetLastError();
      free_events.push_back(e);
      host_since.store(0);
      return;
    }
    pending.push_back({e, since ? since : now_ns(), host_kind.load()});
    host_since.store(0);
  }
};

namespace {

// Set at process exit (std::atexit, registered after the CUDA runtime's, so it runs first): the
// thread stops looking, so that nothing is aborted, nor the process torn down, while it ends.
std::atomic<bool> exiting{false};

struct Registry {
  // Shared by every guarded entry point while it is inside NCCL; an abort takes it exclusively
  // (briefly) so that no enqueue on the communicator is in flight when NCCL frees it. The list
  // of watches changes only under it, exclusively.
  std::shared_timed_mutex guard;
  std::vector<Watch*> watches;
  std::once_flag thread_started;
  // (communicator, its capture twin): fo_nccl_set_capture_comm; changes under `guard` only
  std::vector<std::pair<Comm, Comm>> twins;
  std::atomic<bool> any_twin{false};
};

Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: the thread outlives static destructors
  return *r;
}

Watch* find(Comm comm) {  // under registry().guard
  for (Watch* w : registry().watches)
    if (w->comm == comm) return w;
  return nullptr;
}

bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    cudaGetLastError();
    return true;  // not known: record nothing into it
  }
  return status != cudaStreamCaptureStatusNone;
}

// The entry points of a group (ncclGroupStart .. ncclGroupEnd) on this thread: the guard is held
// across it (NCCL queues the work at ncclGroupEnd), and the events are recorded after it.
struct ThreadGroup {
  int depth = 0;
  std::vector<std::pair<Watch*, cudaStream_t>> touched;
  std::vector<std::tuple<Watch*, cudaStream_t, int>> captured;  // slots to leave at its end
};
thread_local ThreadGroup tls_group;
thread_local int tls_own_capture = 0;  // OwnCapture objects alive on this thread

// The capture twin of `comm` (nullptr: none; under registry().guard).
Comm twin_of(Comm comm) {
  const Registry& reg = registry();
  if (!reg.any_twin.load(std::memory_order_relaxed)) return nullptr;
  for (const auto& [eager, twin] : reg.twins)
    if (eager == comm) return twin;
  return nullptr;
}

// One guarded entry point: `call(comm)` is NCCL's, on `comm` and `stream`; work on a stream
// being captured goes to the capture twin of `comm` where it has one.
template <class Call>
Result guarded_call(Comm comm, cudaStream_t stream, int kind, Call&& call) {
  Registry& reg = registry();
  const bool outer = tls_group.depth == 0;
  if (outer) reg.guard.lock_shared();
  // the stream's capture status, asked once and only when a twin or a watch needs it
  const Comm twin = twin_of(comm);
  const bool stream_captured = (twin || find(comm)) && capturing(stream);
  if (twin && stream_captured) comm = twin;
  Watch* w = find(comm);
  Result r;
  if (w && w->aborted.load()) {
    r = kInvalidUsage;  // refused: NCCL freed, or is freeing, this communicator
  } else {
    const bool in_capture = w && stream_captured;
    const bool watched = w && !in_capture;
    int slot = -1;
    if (in_capture) {
      bool entered = false;  // in a group, the first collective on (w, stream) enters
      for (const auto& t : tls_group.captured)
        entered = entered || (std::get<0>(t) == w && std::get<1>(t) == stream);
      if (!entered && tls_own_capture == 0) slot = w->enter_capture(stream);
      if (!outer && slot >= 0) tls_group.captured.emplace_back(w, stream, slot);
    }
    if (watched) w->mark(kind);
    r = call(comm);
    if (outer && slot >= 0) w->leave_capture(stream, slot);
    if (watched && r != 0) w->unmark();
    if (watched && r == 0) {
      if (outer) {
        w->record(stream);
      } else {
        const std::pair<Watch*, cudaStream_t> touched(w, stream);
        bool seen = false;
        for (const auto& t : tls_group.touched) seen = seen || t == touched;
        if (!seen) tls_group.touched.push_back(touched);
      }
    }
  }
  if (outer) reg.guard.unlock_shared();
  return r;
}

Result g_all_reduce(const void* s, void* r, size_t n, int t, int op, Comm c, cudaStream_t st) {
  return guarded_call(c, st, kAllReduce,
                      [&](Comm to) { return raw().AllReduce(s, r, n, t, op, to, st); });
}
Result g_reduce_scatter(const void* s, void* r, size_t n, int t, int op, Comm c, cudaStream_t st) {
  return guarded_call(c, st, kReduceScatter,
                      [&](Comm to) { return raw().ReduceScatter(s, r, n, t, op, to, st); });
}
Result g_all_gather(const void* s, void* r, size_t n, int t, Comm c, cudaStream_t st) {
  return guarded_call(c, st, kAllGather,
                      [&](Comm to) { return raw().AllGather(s, r, n, t, to, st); });
}
Result g_send(const void* s, size_t n, int t, int peer, Comm c, cudaStream_t st) {
  return guarded_call(c, st, kSendRecv,
                      [&](Comm to) { return raw().Send(s, n, t, peer, to, st); });
}
Result g_recv(void* r, size_t n, int t, int peer, Comm c, cudaStream_t st) {
  return guarded_call(c, st, kSendRecv,
                      [&](Comm to) { return raw().Recv(r, n, t, peer, to, st); });
}
Result g_group_start() {
  if (tls_group.depth++ == 0) registry().guard.lock_shared();
  const Result r = raw().GroupStart();
  return r;
}
Result g_group_end() {
  const Result r = raw().GroupEnd();
  if (tls_group.depth > 0 && --tls_group.depth == 0) {
    for (auto& [w, stream] : tls_group.touched) {
      if (r == 0) w->record(stream);
      else w->unmark();
    }
    tls_group.touched.clear();
    for (auto& [w, stream, slot] : tls_group.captured) w->leave_capture(stream, slot);
    tls_group.captured.clear();
    registry().guard.unlock_shared();
  }
  return r;
}

const char* kind_name(int kind) {
  switch (kind) {
    case kAllReduce: return "ncclAllReduce";
    case kReduceScatter: return "ncclReduceScatter";
    case kAllGather: return "ncclAllGather";
    case kSendRecv: return "ncclSend/ncclRecv";
    case kGraph: return "a collective of a replayed graph";
    default: return "collective work";
  }
}

void torn_down(const Watch& w) {
  std::fprintf(stderr,
               "[flashoverlap] the watchdog tears this process down "
               "(TORCH_NCCL_ASYNC_ERROR_HANDLING=%d): %s\n",
               w.handling == 1 ? 1 : 3, w.reason);
  std::fflush(stderr);
  std::abort();
}

// Fails `w` (its first failure wins) with `state` and a reason, and aborts its communicator.
void fail_watch(Watch* w, int state, int nccl_error, int kind, double waited_s, const char* fmt, ...) {
  int expected = FO_WATCH_OK;
  if (!w->state.compare_exchange_strong(expected, state)) return;
  {
    std::lock_guard<std::mutex> hold(w->m);
    w->nccl_error = nccl_error, w->kind = kind, w->waited_s = waited_s;
    va_list args;
    va_start(args, fmt);
    std::vsnprintf(w->reason, sizeof(w->reason), fmt, args);
    va_end(args);
  }
  w->aborted.store(true);
  if (w->handling == 2) torn_down(*w);  // torch's 3: no abort (it may hang), tear down
  // No enqueue on the communicator may be inside NCCL when it is freed: wait for those in
  // flight (every new one sees `aborted`). One that cannot leave (NCCL's queue is full behind
  // the stuck kernel) is released by the abort itself, which sets NCCL's abort flag first.
  Registry& reg = registry();
  if (reg.guard.try_lock_for(std::chrono::milliseconds(kDrainMs))) reg.guard.unlock();
  cudaSetDevice(w->device);
  raw().CommAbort(w->comm);
  cudaGetLastError();
  if (w->handling == 1) torn_down(*w);
}

// One look at `w`: completed events dropped; a timeout or an asynchronous error fails it.
// Returns the state.
int poll(Watch* w) {
  if (w->state.load() != FO_WATCH_OK || exiting.load()) return w->state.load();
  cudaSetDevice(w->device);
  const int64_t now = now_ns();
  int64_t oldest = 0;
  int kind = kNone;
  bool device_error = false;
  cudaError_t query = cudaSuccess;
  {
    std::lock_guard<std::mutex> hold(w->m);
    query = w->drop_completed();
    if (query == cudaErrorCudartUnloading || exiting.load()) return w->state.load();
    if (query != cudaSuccess) {
      cudaGetLastError();
      device_error = true;
    }
    if (!w->pending.empty()) oldest = w->pending.front().since_ns, kind = w->pending.front().kind;
  }
  const int64_t host = w->host_since.load();
  if (host && (!oldest || host < oldest)) oldest = host, kind = w->host_kind.load();
  const int used = std::min(w->slots_used.load(), kSlots);
  for (int i = 0; i < used; ++i) {  // captured collectives being replayed
    const uint32_t v = __atomic_load_n(w->slots + i, __ATOMIC_ACQUIRE);
    int64_t& seen = w->first_seen[i];
    seen = v == 1 ? (seen ? seen : now) : 0;
    if (seen && (!oldest || seen < oldest)) oldest = seen, kind = kGraph;
  }
  const double waited = oldest ? double(now - oldest) * 1e-9 : 0.0;
  const double timeout = double(w->timeout_ns.load()) * 1e-9;
  if (device_error) {
    fail_watch(w, FO_WATCH_DEVICE_ERROR, 0, kind, waited,
         "the device reported %s while FlashOverlap's watchdog followed the communicator's work",
         cudaGetErrorString(query));
  } else if (oldest && timeout > 0 && waited > timeout) {
    fail_watch(w, FO_WATCH_TIMED_OUT, 0, kind, waited,
         "%s queued %.1f s ago has not completed, past the timeout of %.1f s: a peer rank "
         "stalled or died; FlashOverlap's watchdog aborted the communicator",
         kind_name(kind), waited, timeout);
  } else {
    Result async = 0;
    if (raw().CommGetAsyncError(w->comm, &async) == 0 && async != 0 && async != kInProgress)
      fail_watch(w, FO_WATCH_NCCL_ERROR, async, kind, waited,
           "NCCL reported an asynchronous error on the communicator: %s (ncclResult %d); a "
           "peer rank likely died; FlashOverlap's watchdog aborted the communicator",
           raw().GetErrorString(async), async);
  }
  return w->state.load();
}

// Fails every other watch of `failed`'s group (the group's peers are gone for them too).
void fail_group(Watch* failed, const std::vector<Watch*>& watches) {
  for (Watch* w : watches)
    if (w != failed && w->group == failed->group && w->state.load() == FO_WATCH_OK)
      fail_watch(w, FO_WATCH_GROUP_FAILED, 0, kNone, 0.0,
           "another communicator of the same process group failed (%s); FlashOverlap's "
           "watchdog aborted this one too",
           failed->reason);
}

void watchdog_loop() {
  // This thread's queries must not break a capture of another thread's in global mode (as the
  // caching allocator's would): relaxed.
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&mode);
  for (;;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(kPollMs));
    std::vector<Watch*> watches;
    {
      std::shared_lock<std::shared_timed_mutex> hold(registry().guard);
      watches = registry().watches;
    }
    for (Watch* w : watches) {
      if (exiting.load()) return;
      const bool was_ok = w->state.load() == FO_WATCH_OK;
      if (poll(w) != FO_WATCH_OK && was_ok) fail_group(w, watches);
    }
  }
}

}  // namespace

OwnCapture::OwnCapture() { ++tls_own_capture; }
OwnCapture::~OwnCapture() { --tls_own_capture; }

Api guarded(const Api& a) {
  Api g = a;
  g.AllReduce = g_all_reduce;
  g.ReduceScatter = g_reduce_scatter;
  g.AllGather = g_all_gather;
  g.Send = g_send;
  g.Recv = g_recv;
  g.GroupStart = g_group_start;
  g.GroupEnd = g_group_end;
  return g;
}

cudaError_t launch_graph(cudaGraphExec_t exec, cudaStream_t stream, Comm comm) {
  if (!comm || !loaded()) {
    FO_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    return cudaSuccess;
  }
  std::shared_lock<std::shared_timed_mutex> hold(registry().guard);
  const Comm twin = twin_of(comm);  // the graph was captured on it
  Watch* w = find(twin ? twin : comm);
  if (w && w->aborted.load())
    return fo::fail(cudaErrorLaunchFailure,
                "the call's communicator was aborted by FlashOverlap's watchdog: %s", w->reason);
  if (w) w->mark(kGraph);
  const cudaError_t err = cudaGraphLaunch(exec, stream);
  if (err != cudaSuccess) {
    if (w) w->unmark();
    cudaGetLastError();
    return fo::fail(err, "cudaGraphLaunch: %s", cudaGetErrorString(err));
  }
  if (w) w->record(stream);
  return cudaSuccess;
}

}  // namespace fo::nccl

extern "C" {

FO_API cudaError_t fo_nccl_load(const char* path) { return fo::nccl::load(path); }

FO_API cudaError_t fo_nccl_version(int* version) {
  if (!fo::nccl::loaded()) return fo::fail(cudaErrorInvalidValue, "NCCL is not loaded (fo_nccl_load)");
  FO_NCCL_CHECK(fo::nccl::api().GetVersion(version));
  return cudaSuccess;
}

FO_API cudaError_t fo_nccl_unique_id(void* id128) {
  if (!fo::nccl::loaded()) return fo::fail(cudaErrorInvalidValue, "NCCL is not loaded (fo_nccl_load)");
  FO_NCCL_CHECK(fo::nccl::api().GetUniqueId(static_cast<fo::nccl::UniqueId*>(id128)));
  return cudaSuccess;
}

FO_API cudaError_t fo_nccl_comm_init(void** comm, int nranks, const void* id128, int rank, int device) {
  if (!fo::nccl::loaded()) return fo::fail(cudaErrorInvalidValue, "NCCL is not loaded (fo_nccl_load)");
  if (!comm || !id128 || nranks < 1 || rank < 0 || rank >= nranks)
    return fo::fail(cudaErrorInvalidValue, "fo_nccl_comm_init: bad arguments (nranks %d, rank %d)",
                    nranks, rank);
  FO_CUDA_CHECK(cudaSetDevice(device));
  fo::nccl::UniqueId id;
  memcpy(&id, id128, sizeof(id));
  FO_NCCL_CHECK(fo::nccl::api().CommInitRank(reinterpret_cast<fo::nccl::Comm*>(comm), nranks, id, rank));
  return cudaSuccess;
}

FO_API cudaError_t fo_nccl_comm_init_bounded(void** comm, int nranks, const void* id128, int rank,
                                             int device, int max_ctas) {
  if (!fo::nccl::loaded()) return fo::fail(cudaErrorInvalidValue, "NCCL is not loaded (fo_nccl_load)");
  if (!fo::nccl::api().CommInitRankConfig)
    return fo::fail(cudaErrorSymbolNotFound,
                    "the loaded NCCL has no ncclCommInitRankConfig (NCCL 2.17 or newer is needed "
                    "to bound its CTAs beside allgather's waiting GEMM)");
  int version = 0;
  FO_NCCL_CHECK(fo::nccl::api().GetVersion(&version));
  if (version < 21700)  // older NCCL takes maxCTAs from its defaults, silently
    return fo::fail(cudaErrorNotSupported,
                    "NCCL %d cannot bound its CTAs per communicator (2.17 or newer is needed)",
                    version);
  if (!comm || !id128 || nranks < 1 || rank < 0 || rank >= nranks || max_ctas < 1)
    return fo::fail(cudaErrorInvalidValue,
                    "fo_nccl_comm_init_bounded: bad arguments (nranks %d, rank %d, max_ctas %d)",
                    nranks, rank, max_ctas);
  FO_CUDA_CHECK(cudaSetDevice(device));
  fo::nccl::UniqueId id;
  memcpy(&id, id128, sizeof(id));
  fo::nccl::ConfigPrefix config = fo::nccl::bounded_config(max_ctas);
  FO_NCCL_CHECK(fo::nccl::api().CommInitRankConfig(reinterpret_cast<fo::nccl::Comm*>(comm), nranks,
                                                   id, rank, &config));
  return cudaSuccess;
}

FO_API cudaError_t fo_nccl_collective(void* comm, int kind, const void* send, void* recv,
                                      int64_t count, int dtype, cudaStream_t stream) {
  if (!fo::nccl::loaded()) return fo::fail(cudaErrorInvalidValue, "NCCL is not loaded (fo_nccl_load)");
  if (!comm || count < 0 || (count > 0 && (!send || !recv)))
    return fo::fail(cudaErrorInvalidValue,
                    "fo_nccl_collective: bad arguments (comm %p, send %p, recv %p, count %lld)",
                    comm, send, recv, (long long)count);
  if (count == 0) return cudaSuccess;
  const fo::nccl::Api& n = fo::nccl::api();
  auto c = static_cast<fo::nccl::Comm>(comm);
  switch (kind) {
    case 1:
      FO_NCCL_CHECK(n.AllReduce(send, recv, size_t(count), dtype, fo::nccl::kSum, c, stream));
      return cudaSuccess;
    case 2:
      FO_NCCL_CHECK(n.ReduceScatter(send, recv, size_t(count), dtype, fo::nccl::kSum, c, stream));
      return cudaSuccess;
    case 3:
      FO_NCCL_CHECK(n.AllGather(send, recv, size_t(count), dtype, c, stream));
      return cudaSuccess;
    default:
      return fo::fail(cudaErrorInvalidValue, "fo_nccl_collective: unknown kind %d (1-3)", kind);
  }
}

FO_API cudaError_t fo_nccl_all_to_all(void* comm, const void* send, const int64_t* send_counts,
                                      void* recv, const int64_t* recv_counts, int world,
                                      int dtype, int elem_bytes, cudaStream_t stream) {
  if (!fo::nccl::loaded()) return fo::fail(cudaErrorInvalidValue, "NCCL is not loaded (fo_nccl_load)");
  if (!comm || world < 1 || elem_bytes < 1 || !send_counts || !recv_counts)
    return fo::fail(cudaErrorInvalidValue,
                    "fo_nccl_all_to_all: bad arguments (comm %p, world %d, elem_bytes %d)", comm,
                    world, elem_bytes);
  std::vector<int64_t> send_at(world), recv_at(world);
  int64_t sent = 0, received = 0;
  for (int p = 0; p < world; ++p) {
    if (send_counts[p] < 0 || recv_counts[p] < 0)
      return fo::fail(cudaErrorInvalidValue,
                      "fo_nccl_all_to_all: negative count for rank %d (send %lld, recv %lld)", p,
                      (long long)send_counts[p], (long long)recv_counts[p]);
    send_at[p] = sent;
    recv_at[p] = received;
    sent += send_counts[p];
    received += recv_counts[p];
  }
  if ((sent > 0 && !send) || (received > 0 && !recv))
    return fo::fail(cudaErrorInvalidValue, "fo_nccl_all_to_all: null buffer (send %p, recv %p)",
                    send, recv);
  const char* from = static_cast<const char*>(send);
  char* into = static_cast<char*>(recv);
  return fo::nccl::send_recv_step(
      world, dtype, static_cast<fo::nccl::Comm>(comm), stream,
      [&](int peer, fo::nccl::PeerTransfer* t) {
        if (send_counts[peer] == 0 && recv_counts[peer] == 0) return false;
        t->send = from + send_at[peer] * elem_bytes;
        t->send_count = send_counts[peer];
        t->recv = into + recv_at[peer] * elem_bytes;
        t->recv_count = recv_counts[peer];
        return true;
      });
}

FO_API cudaError_t fo_nccl_set_capture_comm(void* comm, void* capture) {
  using namespace fo::nccl;
  if (!comm || comm == capture)
    return fo::fail(cudaErrorInvalidValue,
                    "fo_nccl_set_capture_comm: needs a communicator and another one as its twin");
  Registry& reg = registry();
  std::unique_lock<std::shared_timed_mutex> hold(reg.guard);
  auto& twins = reg.twins;
  // entries naming either communicator are stale (their addresses were an aborted pair's)
  const auto names = [](const std::pair<Comm, Comm>& t, void* c) {
    return c && (t.first == c || t.second == c);
  };
  const auto stale = [&](const std::pair<Comm, Comm>& t) {
    return names(t, comm) || names(t, capture);
  };
  twins.erase(std::remove_if(twins.begin(), twins.end(), stale), twins.end());
  if (capture) twins.emplace_back(static_cast<Comm>(comm), static_cast<Comm>(capture));
  reg.any_twin.store(!twins.empty());
  return cudaSuccess;
}

FO_API cudaError_t fo_nccl_comm_destroy(void* comm) {
  if (!comm || !fo::nccl::loaded()) return cudaSuccess;
  FO_NCCL_CHECK(fo::nccl::api().CommDestroy(static_cast<fo::nccl::Comm>(comm)));
  return cudaSuccess;
}

FO_API cudaError_t fo_nccl_watch(void* comm, int device, int64_t group, double timeout_s,
                                 int handling, fo_nccl_watch_t** out) {
  using namespace fo::nccl;
  if (!loaded()) return fo::fail(cudaErrorInvalidValue, "NCCL is not loaded (fo_nccl_load)");
  if (!comm || !out || handling < 0 || handling > 2 || !(timeout_s >= 0))
    return fo::fail(cudaErrorInvalidValue,
                    "fo_nccl_watch: bad arguments (handling %d, timeout %g s)", handling,
                    timeout_s);
  auto* w = new Watch();
  w->comm = static_cast<Comm>(comm), w->device = device, w->group = group;
  w->handling = handling;
  w->timeout_ns.store(int64_t(timeout_s * 1e9));
  // the slots of captured collectives (none when pinned memory cannot be had: not followed)
  void* host = nullptr;
  if (cudaHostAlloc(&host, kSlots * sizeof(uint32_t), cudaHostAllocMapped | cudaHostAllocPortable) ==
      cudaSuccess) {
    std::memset(host, 0, kSlots * sizeof(uint32_t));
    void* dev = nullptr;
    if (cudaHostGetDevicePointer(&dev, host, 0) == cudaSuccess) {
      w->slots = static_cast<uint32_t*>(host);
      w->slots_dev = reinterpret_cast<CUdeviceptr>(dev);
      w->first_seen.assign(kSlots, 0);
    }
  }
  cudaGetLastError();
  write_value();  // resolved now, not first inside a capture
  Registry& reg = registry();
  {
    std::unique_lock<std::shared_timed_mutex> hold(reg.guard);
    // A failed watch of an aborted communicator whose address NCCL has given to this new one
    // (a recovery in the same process) is dropped from the list, so that find() sees the new
    // watch. Not freed: the thread may still hold it from its last look.
    auto& list = reg.watches;
    list.erase(std::remove_if(list.begin(), list.end(),
                              [&](Watch* old) { return old->comm == w->comm && old->aborted.load(); }),
               list.end());
    if (find(w->comm)) {
      delete w;
      return fo::fail(cudaErrorInvalidValue, "fo_nccl_watch: the communicator is watched already");
    }
    reg.watches.push_back(w);
  }
  std::call_once(reg.thread_started, [] {
    std::atexit([] { exiting.store(true); });
    std::thread(watchdog_loop).detach();
  });
  *out = reinterpret_cast<fo_nccl_watch_t*>(w);
  return cudaSuccess;
}

FO_API cudaError_t fo_nccl_watch_set_timeout(fo_nccl_watch_t* watch, double timeout_s) {
  if (!watch || !(timeout_s >= 0))
    return fo::fail(cudaErrorInvalidValue, "fo_nccl_watch_set_timeout: bad arguments");
  reinterpret_cast<fo::nccl::Watch*>(watch)->timeout_ns.store(int64_t(timeout_s * 1e9));
  return cudaSuccess;
}

FO_API cudaError_t fo_nccl_watch_status(fo_nccl_watch_t* watch, int* state, int* nccl_error,
                                        double* waited_s, char* reason, size_t reason_len) {
  if (!watch || !state) return fo::fail(cudaErrorInvalidValue, "fo_nccl_watch_status: null argument");
  auto* w = reinterpret_cast<fo::nccl::Watch*>(watch);
  *state = w->state.load();
  if (*state == FO_WATCH_OK) return cudaSuccess;
  std::lock_guard<std::mutex> hold(w->m);
  if (nccl_error) *nccl_error = w->nccl_error;
  if (waited_s) *waited_s = w->waited_s;
  if (reason && reason_len) std::snprintf(reason, reason_len, "%s", w->reason);
  return cudaSuccess;
}

FO_API cudaError_t fo_nccl_watch_pending(fo_nccl_watch_t* watch, int* pending) {
  if (!watch || !pending) return fo::fail(cudaErrorInvalidValue, "fo_nccl_watch_pending: null argument");
  auto* w = reinterpret_cast<fo::nccl::Watch*>(watch);
  std::lock_guard<std::mutex> hold(w->m);
  *pending = int(w->pending.size()) + (w->host_since.load() ? 1 : 0);
  return cudaSuccess;
}

FO_API cudaError_t fo_nccl_watch_abort(fo_nccl_watch_t* watch, const char* why) {
  if (!watch) return fo::fail(cudaErrorInvalidValue, "fo_nccl_watch_abort: null argument");
  auto* w = reinterpret_cast<fo::nccl::Watch*>(watch);
  fo::nccl::fail_watch(w, FO_WATCH_ABORTED, 0, 0, 0.0, "%s", why && *why ? why : "aborted on request");
  return cudaSuccess;
}

}  // extern "C"
