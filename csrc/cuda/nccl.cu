// NCCL's C ABI (fo_nccl_* in flashoverlap_cuda.h), one translation unit of the runtime object:
// loading NCCL from the process (nccl_loader.cuh says how) and making and destroying
// communicators.
#include <dlfcn.h>

#include <climits>
#include <cstring>
#include <mutex>
#include <type_traits>

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
  api() = a;
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

FO_API cudaError_t fo_nccl_comm_destroy(void* comm) {
  if (!comm || !fo::nccl::loaded()) return cudaSuccess;
  FO_NCCL_CHECK(fo::nccl::api().CommDestroy(static_cast<fo::nccl::Comm>(comm)));
  return cudaSuccess;
}

}  // extern "C"
