// NCCL reached at run time: the runtime library declares the handful of NCCL entry points it
// calls and resolves them with dlopen/dlsym from the libnccl.so.2 that the process already has
// (the one torch loaded) or from a path the caller gives. So the library builds without NCCL's
// headers and uses the very NCCL build of the installed torch. Enum values are NCCL's public ABI.
#pragma once
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <stddef.h>

#include <climits>
#include <cstring>
#include <mutex>
#include <type_traits>

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

inline Api& api() {
  static Api a = {};
  return a;
}

inline bool loaded() { return api().GroupEnd != nullptr; }

// Resolves every entry point from `path` (nullptr or "": the libnccl.so.2 already loaded in
// the process). Idempotent; the first successful load wins.
inline cudaError_t load(const char* path) {
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
  api() = a;
  return cudaSuccess;
}

}  // namespace fo::nccl

// Returns from the enclosing function with a recorded message when an NCCL call fails.
#define FO_NCCL_CHECK(expr)                                                                \
  do {                                                                                     \
    ::fo::nccl::Result fo_res_ = (expr);                                                   \
    if (fo_res_ != 0)                                                                      \
      return ::fo::fail(cudaErrorUnknown, "%s failed: NCCL error %d (%s)", #expr, fo_res_,  \
                        ::fo::nccl::api().GetErrorString(fo_res_));                        \
  } while (0)
