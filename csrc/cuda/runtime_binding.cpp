// The runtime's Python module (pybind11): everything Python may call, in one file.
//
// The runtime object (runtime.cu and the call kinds it links) is this extension module; the
// GEMM kernel libraries keep their C ABI (flashoverlap_cuda.h), are built once per
// configuration for any Python, and are dlopen'ed here (GemmLibrary). The descriptions of the
// prepared calls are the C structs of flashoverlap_cuda.h, filled field by field from Python:
// each field below names its member, so a field of the header that is not listed here cannot
// be set from Python (it stays zero), and one that is listed has its C type. Host arrays are
// vectors owned here and checked against their counts before a call is made.
//
// Per-call entry points (call_run, call_run_scaled, call_run_add_rmsnorm, a2a_run,
// a2a_run_scaled, gather_run, gather_run_scaled)
// take plain ints (pointers as integers) and the call's handle, and return the cudaError code:
// the caller raises (check) only when it is not 0. Every entry point lets other Python threads
// run while it is in native code, as ctypes did. Built by backends/cuda/build.py; needs no
// torch headers. Compiled by the host compiler (nvcc passes .cpp files to it).
#include <dlfcn.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "flashoverlap_cuda.h"

namespace py = pybind11;

namespace fo::binding {

// A device or host address from Python: an int, or None for null.
struct Ptr {
  uintptr_t value = 0;
  template <class T>
  T as() const {
    return reinterpret_cast<T>(value);
  }
};

}  // namespace fo::binding

namespace pybind11::detail {
template <>
struct type_caster<fo::binding::Ptr> {
  PYBIND11_TYPE_CASTER(fo::binding::Ptr, const_name("int | None"));
  bool load(handle src, bool) {
    if (src.is_none()) {
      value.value = 0;
      return true;
    }
    if (!PyLong_Check(src.ptr())) return false;
    const unsigned long long v = PyLong_AsUnsignedLongLong(src.ptr());
    if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
      PyErr_Clear();  // negative or wider than a pointer: not an address
      return false;
    }
    value.value = static_cast<uintptr_t>(v);
    return true;
  }
  static handle cast(fo::binding::Ptr p, return_value_policy, handle) {
    return PyLong_FromUnsignedLongLong(p.value);
  }
};
}  // namespace pybind11::detail

namespace fo::binding {

// ---- errors ------------------------------------------------------------------------------------

py::handle kernel_error_type = PyExc_RuntimeError;  // runtime.KernelError, given by _init
std::string module_path = "runtime";                // this module's file, given by _init

// "<what> failed (cudaError N): <detail> [<path>]", raised as KernelError.
[[noreturn]] void raise_error(int err, const std::string& what, const char* detail,
                              const std::string& path) {
  const std::string text = what + " failed (cudaError " + std::to_string(err) + "): " +
                           (detail && *detail ? detail : "no detail") + " [" + path + "]";
  PyErr_SetString(kernel_error_type.ptr(), text.c_str());
  throw py::error_already_set();
}

void check(int err, const std::string& what) {
  if (err) raise_error(err, what, fo_last_error(), module_path);
}

// Lets other Python threads run during a native call (what ctypes did around every call).
class Unlocked {
 public:
  Unlocked() : state_(PyEval_SaveThread()) {}
  ~Unlocked() { PyEval_RestoreThread(state_); }
  Unlocked(const Unlocked&) = delete;
  Unlocked& operator=(const Unlocked&) = delete;

 private:
  PyThreadState* state_;
};

template <class F>
auto unlocked(F&& f) {
  Unlocked u;
  return f();
}

// ---- a GEMM kernel library (its C ABI, dlopen'ed) -----------------------------------------------

class GemmLibrary {
 public:
  explicit GemmLibrary(std::string path) : path_(std::move(path)) {
    handle_ = dlopen(path_.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!handle_) {
      PyErr_SetString(PyExc_OSError, dlerror());
      throw py::error_already_set();
    }
    description_ = *symbol<decltype(&fo_gemm_describe)>("fo_gemm_describe")();
    if (description_.abi_version != FO_CUDA_ABI_VERSION) {
      const std::string text = path_ + " has ABI version " +
                               std::to_string(description_.abi_version) + ", expected " +
                               std::to_string(FO_CUDA_ABI_VERSION) +
                               ": rebuild it (flashoverlap build)";
      PyErr_SetString(kernel_error_type.ptr(), text.c_str());
      throw py::error_already_set();
    }
    last_error_ = symbol<decltype(&fo_last_error)>("fo_last_error");
    load_kernels_ = symbol<decltype(&fo_load_kernels)>("fo_load_kernels");
    max_ctas_ = symbol<decltype(&fo_gemm_max_ctas)>("fo_gemm_max_ctas");
    workspace_size_ = symbol<decltype(&fo_gemm_workspace_size)>("fo_gemm_workspace_size");
    run_ = symbol<decltype(&fo_gemm_run)>("fo_gemm_run");
    run_ex_ = symbol<decltype(&fo_gemm_run_ex)>("fo_gemm_run_ex");
    run_scaled_ = symbol<decltype(&fo_gemm_run_scaled)>("fo_gemm_run_scaled");
    launch_ = symbol<decltype(&fo_gemm_launch)>("fo_gemm_launch");
    set_node_params_ = symbol<decltype(&fo_gemm_set_node_params)>("fo_gemm_set_node_params");
    run_blocks_ = symbol<decltype(&fo_gemm_run_blocks)>("fo_gemm_run_blocks");
    // fp8 all_to_all's builds only (gemm_blocks_scaled.h): optional
    run_blocks_scaled_ = reinterpret_cast<decltype(&fo_gemm_run_blocks_scaled)>(
        dlsym(handle_, "fo_gemm_run_blocks_scaled"));
    // fp8 allgather's builds only (gemm_ex_scaled.h): optional
    run_ex_scaled_ = reinterpret_cast<decltype(&fo_gemm_run_ex_scaled)>(
        dlsym(handle_, "fo_gemm_run_ex_scaled"));
  }

  const std::string& path() const { return path_; }
  const fo_gemm_config& description() const { return description_; }
  bool fp8() const { return description_.dtype == FO_DTYPE_E4M3; }
  // What the descriptions take: fo_call_desc.gemm_launch and gemm_set_node, fo_gather_desc
  // gemm_run_ex and gemm_run_ex_scaled (0: a library without it, any but fp8 allgather's e4m3
  // build), fo_a2a_desc gemm_run_blocks and gemm_run_blocks_scaled (0: a library without it, any
  // but an e4m3 build with unequal blocks).
  uintptr_t launch_address() const { return address(launch_); }
  uintptr_t set_node_address() const { return address(set_node_params_); }
  uintptr_t run_ex_address() const { return address(run_ex_); }
  uintptr_t run_blocks_address() const { return address(run_blocks_); }
  uintptr_t run_blocks_scaled_address() const { return address(run_blocks_scaled_); }
  uintptr_t run_ex_scaled_address() const { return address(run_ex_scaled_); }

  std::string last_error() const {
    const char* text = last_error_();
    return text ? text : "";
  }
  void check(int err, const std::string& what) const {
    if (err) raise_error(err, what, last_error_(), path_);
  }

  void load_kernels() const { check(unlocked([&] { return load_kernels_(); }), "fo_load_kernels"); }
  int max_ctas(int device) const {
    int out = 0;
    check(unlocked([&] { return max_ctas_(device, &out); }), "fo_gemm_max_ctas");
    return out;
  }
  size_t workspace_size(int blocks, int block_rows, int n, int k, int ctas) const {
    return workspace_size_(blocks, block_rows, n, k, ctas);
  }
  void run(Ptr a, Ptr b, Ptr packed, int blocks, int block_rows, int n, int k, int64_t lda,
           int64_t ldb, Ptr items, Ptr item_group, int num_items, Ptr counters, int ctas,
           Ptr monitor, Ptr workspace, Ptr stream) const {
    check(unlocked([&] {
            return run_(a.as<const void*>(), b.as<const void*>(), packed.as<void*>(), blocks,
                        block_rows, n, k, lda, ldb, items.as<const int64_t*>(),
                        item_group.as<const int32_t*>(), num_items, counters.as<int32_t*>(), ctas,
                        monitor.as<uint64_t*>(), workspace.as<void*>(),
                        stream.as<cudaStream_t>());
          }),
          "fo_gemm_run");
  }
  void run_scaled(Ptr a, Ptr b, const fo_gemm_scales& scales, Ptr packed, int blocks,
                  int block_rows, int n, int k, int64_t lda, int64_t ldb, Ptr items,
                  Ptr item_group, int num_items, Ptr counters, int ctas, Ptr monitor,
                  Ptr workspace, Ptr stream) const {
    check(unlocked([&] {
            return run_scaled_(a.as<const void*>(), b.as<const void*>(), &scales,
                               packed.as<void*>(), blocks, block_rows, n, k, lda, ldb,
                               items.as<const int64_t*>(), item_group.as<const int32_t*>(),
                               num_items, counters.as<int32_t*>(), ctas, monitor.as<uint64_t*>(),
                               workspace.as<void*>(), stream.as<cudaStream_t>());
          }),
          "fo_gemm_run_scaled");
  }
  void run_ex(Ptr a, Ptr b, Ptr out, int blocks, int block_rows, int n, int k, int64_t lda,
              int64_t ldb, int64_t ldo, Ptr items, Ptr item_group, Ptr item_wait, Ptr flags,
              int num_flags, int num_items, Ptr counters, int ctas, Ptr monitor, Ptr workspace,
              Ptr stream) const {
    check(unlocked([&] {
            return run_ex_(a.as<const void*>(), b.as<const void*>(), out.as<void*>(), blocks,
                           block_rows, n, k, lda, ldb, ldo, items.as<const int64_t*>(),
                           item_group.as<const int32_t*>(), item_wait.as<const int32_t*>(),
                           flags.as<const uint32_t*>(), num_flags, num_items,
                           counters.as<int32_t*>(), ctas, monitor.as<uint64_t*>(),
                           workspace.as<void*>(), stream.as<cudaStream_t>());
          }),
          "fo_gemm_run_ex");
  }
  // fo_gemm_run_ex with scales: fp8 allgather's builds only (an error without the symbol)
  void run_ex_scaled(Ptr a, Ptr b, const fo_gemm_scales& scales, Ptr out, int blocks,
                     int block_rows, int n, int k, int64_t lda, int64_t ldb, int64_t ldo,
                     Ptr items, Ptr item_group, Ptr item_wait, Ptr flags, int num_flags,
                     int num_items, Ptr counters, int ctas, Ptr monitor, Ptr workspace,
                     Ptr stream) const {
    if (!run_ex_scaled_) {
      const std::string text = path_ + " has no fo_gemm_run_ex_scaled (fp8 allgather's GEMM, "
                                       "in its e4m3 builds for allgather only)";
      PyErr_SetString(kernel_error_type.ptr(), text.c_str());
      throw py::error_already_set();
    }
    check(unlocked([&] {
            return run_ex_scaled_(a.as<const void*>(), b.as<const void*>(), &scales,
                                  out.as<void*>(), blocks, block_rows, n, k, lda, ldb, ldo,
                                  items.as<const int64_t*>(), item_group.as<const int32_t*>(),
                                  item_wait.as<const int32_t*>(), flags.as<const uint32_t*>(),
                                  num_flags, num_items, counters.as<int32_t*>(), ctas,
                                  monitor.as<uint64_t*>(), workspace.as<void*>(),
                                  stream.as<cudaStream_t>());
          }),
          "fo_gemm_run_ex_scaled");
  }
  void launch(const fo_gemm_params& params, Ptr stream) const {
    check(unlocked([&] { return launch_(&params, stream.as<cudaStream_t>()); }),
          "fo_gemm_launch");
  }

 private:
  template <class F>
  F symbol(const char* name) {
    void* p = dlsym(handle_, name);
    if (!p) {
      const std::string text = path_ + " has no " + name + ": rebuild it (flashoverlap build)";
      PyErr_SetString(kernel_error_type.ptr(), text.c_str());
      throw py::error_already_set();
    }
    return reinterpret_cast<F>(p);
  }
  template <class F>
  static uintptr_t address(F f) {
    return reinterpret_cast<uintptr_t>(reinterpret_cast<void*>(f));
  }

  std::string path_;
  void* handle_ = nullptr;  // never closed: descriptions and graphs keep its functions' addresses
  fo_gemm_config description_{};
  decltype(&fo_last_error) last_error_ = nullptr;
  decltype(&fo_load_kernels) load_kernels_ = nullptr;
  decltype(&fo_gemm_max_ctas) max_ctas_ = nullptr;
  decltype(&fo_gemm_workspace_size) workspace_size_ = nullptr;
  decltype(&fo_gemm_run) run_ = nullptr;
  decltype(&fo_gemm_run_ex) run_ex_ = nullptr;
  decltype(&fo_gemm_run_scaled) run_scaled_ = nullptr;
  decltype(&fo_gemm_launch) launch_ = nullptr;
  decltype(&fo_gemm_set_node_params) set_node_params_ = nullptr;
  decltype(&fo_gemm_run_blocks) run_blocks_ = nullptr;
  decltype(&fo_gemm_run_blocks_scaled) run_blocks_scaled_ = nullptr;  // optional
  decltype(&fo_gemm_run_ex_scaled) run_ex_scaled_ = nullptr;          // optional
};

// The runtime's check, with the GEMM library's own last error in `what` when it has one.
void check_call(int err, const std::string& what, const GemmLibrary* gemm) {
  if (!err) return;
  const std::string detail = gemm ? gemm->last_error() : "";
  check(err, detail.empty() ? what : what + " (GEMM library: " + detail + ")");
}

// ---- descriptions: the C structs, and the host arrays they point at -----------------------------

// A C struct of flashoverlap_cuda.h as Python fills it (pointer fields take ints or None).
template <class C>
struct Described {
  C c{};
  Described() {
    if constexpr (std::is_same_v<C, fo_call_desc> || std::is_same_v<C, fo_gather_desc> ||
                  std::is_same_v<C, fo_a2a_desc>)
      c.abi_version = FO_CUDA_ABI_VERSION;
  }
};

struct CallDescription : Described<fo_call_desc> {
  std::vector<int32_t> group_sizes;      // num_groups
  std::vector<int64_t> steps;            // num_steps * per_step * 4
  std::vector<int64_t> block_out_offset;  // num_blocks, bytes
  std::vector<uintptr_t> block_tiles;    // num_blocks device pointers
  std::vector<uintptr_t> block_offsets;  // num_blocks device pointers
  std::vector<int32_t> block_num_tiles;  // num_blocks
};

struct GatherDescription : Described<fo_gather_desc> {
  std::vector<int32_t> chunk_rows;  // 2 * num_chunks
};

struct GemmParams : Described<fo_gemm_params> {
  std::optional<fo_gemm_scales> scales;  // e4m3 builds
};

using GemmScales = Described<fo_gemm_scales>;
using A2aDescription = Described<fo_a2a_desc>;
using A2aBuffers = Described<fo_a2a_buffers>;

template <class T>
const T* data_or_null(const std::vector<T>& v) {
  return v.empty() ? nullptr : v.data();
}

void need(size_t have, int64_t count, const char* what, const char* of) {
  if (count > 0 && static_cast<int64_t>(have) < count)
    throw py::value_error(std::string(what) + " has " + std::to_string(have) + " entries, " + of +
                          " needs " + std::to_string(count));
}

// Binds member `m` of the C struct as the property `name` (pointers as ints).
template <class W, class C, class T>
void field(py::class_<W>& cls, const char* name, T C::*m) {
  if constexpr (std::is_pointer_v<T>) {
    cls.def_property(
        name, [m](const W& w) { return Ptr{reinterpret_cast<uintptr_t>(w.c.*m)}; },
        [m](W& w, Ptr p) { w.c.*m = p.as<T>(); });
  } else {
    cls.def_property(
        name, [m](const W& w) { return w.c.*m; }, [m](W& w, T v) { w.c.*m = v; });
  }
}

// Binds fields one after the other: Fields<W, C>{cls} FO_FIELD(name) FO_FIELD(name) ...;
// (with `using S = C;` in scope, FO_FIELD(name) names member S::name once).
template <class W, class C>
struct Fields {
  py::class_<W>& cls;
  template <class T>
  Fields& operator()(const char* name, T C::*m) {
    field(cls, name, m);
    return *this;
  }
};
#define FO_FIELD(name) (#name, &S::name)

// `Class(field=value, ...)`: every keyword sets its field (unknown names and wrong types raise).
template <class W>
void keyword_init(py::class_<W>& cls) {
  cls.def(py::init([](const py::kwargs& kwargs) {
    W w;
    py::object view = py::cast(&w, py::return_value_policy::reference);
    for (auto item : kwargs) py::setattr(view, item.first, item.second);
    return w;
  }));
}

// ---- prepared calls: opaque handles that destroy their native call ------------------------------

struct Call {
  fo_call* p = nullptr;
  ~Call() { destroy(); }
  void destroy() {
    if (p) unlocked([&] { fo_call_destroy(std::exchange(p, nullptr)); return 0; });
  }
};

struct Gather {
  fo_gather* p = nullptr;
  ~Gather() { destroy(); }
  void destroy() {
    if (p) unlocked([&] { fo_gather_destroy(std::exchange(p, nullptr)); return 0; });
  }
};

// all_to_all's call, with its per-call host arrays: this call's rows (send, then receive) and
// what it needs (fo_a2a_run's `needs`).
struct A2a {
  fo_a2a* p = nullptr;
  int world = 0;
  std::vector<int32_t> rows;
  std::array<int64_t, 4> needs{};
  ~A2a() { destroy(); }
  void destroy() {
    if (p) unlocked([&] { fo_a2a_destroy(std::exchange(p, nullptr)); return 0; });
  }
};

// Copies `world` ints of a tuple or list (or any sequence) into `out`.
void read_rows(py::handle seq, int world, int32_t* out, const char* what) {
  PyObject* o = seq.ptr();
  py::object fast;
  if (!PyTuple_Check(o) && !PyList_Check(o)) {
    fast = py::reinterpret_steal<py::object>(PySequence_Fast(o, "rows must be a sequence"));
    if (!fast) throw py::error_already_set();
    o = fast.ptr();
  }
  if (PySequence_Fast_GET_SIZE(o) != world)
    throw py::value_error(std::string(what) + " has " +
                          std::to_string(PySequence_Fast_GET_SIZE(o)) + " entries, world is " +
                          std::to_string(world));
  PyObject** items = PySequence_Fast_ITEMS(o);
  for (int r = 0; r < world; ++r) {
    const long v = PyLong_AsLong(items[r]);
    if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
    if (v < INT32_MIN || v > INT32_MAX) throw py::value_error(std::string(what) + ": out of range");
    out[r] = static_cast<int32_t>(v);
  }
}

std::unique_ptr<Call> call_create(const CallDescription& d) {
  fo_call_desc c = d.c;
  need(d.group_sizes.size(), c.num_groups, "group_sizes", "num_groups");
  need(d.steps.size(), int64_t(c.num_steps) * c.per_step * 4, "steps", "num_steps * per_step * 4");
  for (size_t size : {d.block_out_offset.size(), d.block_tiles.size(), d.block_offsets.size(),
                      d.block_num_tiles.size()})
    need(size, c.num_blocks, "a block_* array", "num_blocks");
  std::vector<const int32_t*> tiles;
  std::vector<const int64_t*> offsets;
  for (uintptr_t t : d.block_tiles) tiles.push_back(reinterpret_cast<const int32_t*>(t));
  for (uintptr_t t : d.block_offsets) offsets.push_back(reinterpret_cast<const int64_t*>(t));
  c.group_sizes = data_or_null(d.group_sizes);
  c.steps = data_or_null(d.steps);
  c.block_out_offset = data_or_null(d.block_out_offset);
  c.block_tiles = data_or_null(tiles);
  c.block_offsets = data_or_null(offsets);
  c.block_num_tiles = data_or_null(d.block_num_tiles);
  auto call = std::make_unique<Call>();
  check(unlocked([&] { return fo_call_create(&c, &call->p); }), "fo_call_create");
  return call;
}

std::unique_ptr<Gather> gather_create(const GatherDescription& d) {
  fo_gather_desc c = d.c;
  need(d.chunk_rows.size(), int64_t(c.num_chunks) * 2, "chunk_rows", "2 * num_chunks");
  c.chunk_rows = data_or_null(d.chunk_rows);
  auto gather = std::make_unique<Gather>();
  check(unlocked([&] { return fo_gather_create(&c, &gather->p); }), "fo_gather_create");
  return gather;
}

std::unique_ptr<A2a> a2a_create(const A2aDescription& d) {
  auto call = std::make_unique<A2a>();
  check(unlocked([&] { return fo_a2a_create(&d.c, &call->p); }), "fo_a2a_create");
  call->world = d.c.world;
  call->rows.assign(2 * size_t(d.c.world > 0 ? d.c.world : 0), 0);
  return call;
}

// ---- NCCL ---------------------------------------------------------------------------------------

constexpr size_t kUniqueIdBytes = 128;

uintptr_t nccl_comm_init(int nranks, const py::bytes& unique_id, int rank, int device,
                         std::optional<int> max_ctas) {
  std::string id = unique_id;
  if (id.size() != kUniqueIdBytes)
    throw py::value_error("an NCCL unique id is 128 bytes, got " + std::to_string(id.size()));
  void* comm = nullptr;
  const int err = unlocked([&] {
    return max_ctas ? fo_nccl_comm_init_bounded(&comm, nranks, id.data(), rank, device, *max_ctas)
                    : fo_nccl_comm_init(&comm, nranks, id.data(), rank, device);
  });
  check(err, max_ctas ? "ncclCommInitRankConfig" : "ncclCommInitRank");
  return reinterpret_cast<uintptr_t>(comm);
}

}  // namespace fo::binding

PYBIND11_MODULE(fo_runtime, m) {
  using namespace fo::binding;
  m.doc() = "FlashOverlap's CUDA runtime (csrc/cuda/runtime_binding.cpp)";
  m.attr("ABI_VERSION") = FO_CUDA_ABI_VERSION;
  m.attr("FP8_DTYPE") = FO_DTYPE_E4M3;

  m.def(
      "_init",
      [](py::handle error_type, std::string path) {
        kernel_error_type = error_type.inc_ref();  // kept for the process's lifetime
        module_path = std::move(path);
      },
      "Set the exception type of failures (runtime.KernelError) and this module's path.");
  m.def("check", [](int err, const std::string& what, const GemmLibrary* gemm) {
    check_call(err, what, gemm);
  }, py::arg("err"), py::arg("what"), py::arg("gemm") = nullptr,
        "Raise KernelError when err != 0: '<what> failed (cudaError N): <detail> [<path>]'; "
        "with `gemm`, its library's last error goes into <what>.");
  m.def("last_error", [] { return std::string(fo_last_error()); });
  m.def("load_kernels",
        [] { check(unlocked([] { return fo_load_kernels(); }), "fo_load_kernels"); });

  // ---- descriptions ----
  py::class_<fo_gemm_config>(m, "GemmDescription", py::module_local())
      .def_readonly("abi_version", &fo_gemm_config::abi_version)
      .def_readonly("arch", &fo_gemm_config::arch)
      .def_readonly("tile_m", &fo_gemm_config::tile_m)
      .def_readonly("tile_n", &fo_gemm_config::tile_n)
      .def_readonly("tile_k", &fo_gemm_config::tile_k)
      .def_readonly("cluster_m", &fo_gemm_config::cluster_m)
      .def_readonly("cluster_n", &fo_gemm_config::cluster_n)
      .def_readonly("dtype", &fo_gemm_config::dtype)
      .def_readonly("b_col_major", &fo_gemm_config::b_col_major)
      .def_readonly("cta_multiple", &fo_gemm_config::cta_multiple)
      .def_readonly("schedule", &fo_gemm_config::schedule)
      .def_readonly("stages", &fo_gemm_config::stages)
      .def_readonly("out_dtype", &fo_gemm_config::out_dtype)
      .def_readonly("fast_accum", &fo_gemm_config::fast_accum);

  py::class_<GemmScales> scales(m, "GemmScales", py::module_local());
  scales.def(py::init([](Ptr a, Ptr b, int a_per_row, int b_per_col,
                          std::array<int64_t, 2> a_stride, std::array<int64_t, 2> b_stride) {
                GemmScales s;
                s.c = fo_gemm_scales{a.as<const float*>(), b.as<const float*>(), a_per_row,
                                     b_per_col, {a_stride[0], a_stride[1]},
                                     {b_stride[0], b_stride[1]}};
                return s;
              }),
              py::arg("a") = Ptr{}, py::arg("b") = Ptr{}, py::arg("a_per_row") = 0,
              py::arg("b_per_col") = 0, py::arg("a_stride") = std::array<int64_t, 2>{0, 0},
              py::arg("b_stride") = std::array<int64_t, 2>{0, 0});
  {
    using S = fo_gemm_scales;
    Fields<GemmScales, S>{scales} FO_FIELD(a) FO_FIELD(b) FO_FIELD(a_per_row) FO_FIELD(b_per_col);
  }
  // block-wise scales' element strides (FO_SCALE_BLOCKS), as pairs
  scales.def_property_readonly("a_stride", [](const GemmScales& s) {
    return std::array<int64_t, 2>{s.c.a_stride[0], s.c.a_stride[1]};
  });
  scales.def_property_readonly("b_stride", [](const GemmScales& s) {
    return std::array<int64_t, 2>{s.c.b_stride[0], s.c.b_stride[1]};
  });

  py::class_<GemmParams> params(m, "GemmParams", py::module_local());
  keyword_init(params);
  {
    using S = fo_gemm_params;
    Fields<GemmParams, S>{params} FO_FIELD(a) FO_FIELD(lda) FO_FIELD(b) FO_FIELD(ldb) FO_FIELD(out)
        FO_FIELD(ldo) FO_FIELD(L) FO_FIELD(block_rows) FO_FIELD(N) FO_FIELD(K) FO_FIELD(items)
        FO_FIELD(item_group) FO_FIELD(num_items) FO_FIELD(counters) FO_FIELD(num_ctas)
        FO_FIELD(monitor);
  }
  params.def_property(
      "scales",
      [](const GemmParams& p) -> std::optional<GemmScales> {
        if (!p.scales) return std::nullopt;
        GemmScales s;
        s.c = *p.scales;
        return s;
      },
      [](GemmParams& p, std::optional<GemmScales> s) {
        p.scales = s ? std::optional<fo_gemm_scales>(s->c) : std::nullopt;
      });

  py::class_<CallDescription> call(m, "CallDescription", py::module_local());
  keyword_init(call);
  {
    using S = fo_call_desc;
    Fields<CallDescription, S>{call} FO_FIELD(abi_version) FO_FIELD(gemm_launch) FO_FIELD(L)
        FO_FIELD(block_rows) FO_FIELD(N) FO_FIELD(K) FO_FIELD(items) FO_FIELD(item_group)
        FO_FIELD(num_items) FO_FIELD(num_ctas) FO_FIELD(workspace) FO_FIELD(packed)
        FO_FIELD(staging) FO_FIELD(counters) FO_FIELD(num_groups) FO_FIELD(wait_mode)
        FO_FIELD(collective) FO_FIELD(nccl_comm) FO_FIELD(nccl_dtype) FO_FIELD(num_steps)
        FO_FIELD(per_step) FO_FIELD(num_blocks) FO_FIELD(ldo) FO_FIELD(elem_size)
        FO_FIELD(comm_stream) FO_FIELD(gemm_set_node) FO_FIELD(use_graph) FO_FIELD(scaled)
        FO_FIELD(scale_a_per_row) FO_FIELD(scale_b_per_col) FO_FIELD(rows);
  }
  // block-wise scales' element strides (fo_call_desc, FO_SCALE_BLOCKS), as pairs
  using StridePair = int64_t (fo_call_desc::*)[2];
  for (const std::pair<const char*, StridePair>& field :
       {std::pair<const char*, StridePair>{"scale_a_stride", &fo_call_desc::scale_a_stride},
        std::pair<const char*, StridePair>{"scale_b_stride", &fo_call_desc::scale_b_stride}}) {
    const StridePair member = field.second;
    call.def_property(
        field.first,
        [member](const CallDescription& d) {
          return std::array<int64_t, 2>{(d.c.*member)[0], (d.c.*member)[1]};
        },
        [member](CallDescription& d, std::array<int64_t, 2> v) {
          (d.c.*member)[0] = v[0], (d.c.*member)[1] = v[1];
        });
  }
  call.def_readwrite("group_sizes", &CallDescription::group_sizes)
      .def_readwrite("steps", &CallDescription::steps)
      .def_readwrite("block_out_offset", &CallDescription::block_out_offset)
      .def_readwrite("block_tiles", &CallDescription::block_tiles)
      .def_readwrite("block_offsets", &CallDescription::block_offsets)
      .def_readwrite("block_num_tiles", &CallDescription::block_num_tiles);

  py::class_<GatherDescription> gather(m, "GatherDescription", py::module_local());
  keyword_init(gather);
  {
    using S = fo_gather_desc;
    Fields<GatherDescription, S>{gather} FO_FIELD(abi_version) FO_FIELD(gemm_run_ex)
        FO_FIELD(world) FO_FIELD(rank) FO_FIELD(block_rows) FO_FIELD(N) FO_FIELD(K)
        FO_FIELD(copy_cols) FO_FIELD(items) FO_FIELD(item_group) FO_FIELD(item_wait)
        FO_FIELD(num_items) FO_FIELD(num_ctas) FO_FIELD(workspace) FO_FIELD(gathered) FO_FIELD(ldg)
        FO_FIELD(arrive_flags) FO_FIELD(wait_flags) FO_FIELD(num_chunks) FO_FIELD(elem_size)
        FO_FIELD(nccl_comm) FO_FIELD(nccl_dtype) FO_FIELD(delay_us) FO_FIELD(own_chunks)
        FO_FIELD(comm_stream) FO_FIELD(gemm_run_ex_scaled) FO_FIELD(scaled)
        FO_FIELD(scale_a_per_row) FO_FIELD(scale_b_per_col) FO_FIELD(gathered_scales);
  }
  gather.def_readwrite("chunk_rows", &GatherDescription::chunk_rows);

  py::class_<A2aDescription> a2a(m, "A2aDescription", py::module_local());
  keyword_init(a2a);
  {
    using S = fo_a2a_desc;
    Fields<A2aDescription, S>{a2a} FO_FIELD(abi_version) FO_FIELD(gemm_run_blocks) FO_FIELD(tile_m)
        FO_FIELD(tile_n) FO_FIELD(N) FO_FIELD(raster_m) FO_FIELD(swizzle) FO_FIELD(groups)
        FO_FIELD(world) FO_FIELD(rank) FO_FIELD(K) FO_FIELD(num_ctas) FO_FIELD(wait_mode)
        FO_FIELD(nccl_comm) FO_FIELD(nccl_dtype) FO_FIELD(elem_size) FO_FIELD(comm_stream)
        FO_FIELD(rows) FO_FIELD(gemm_run_blocks_scaled) FO_FIELD(scaled) FO_FIELD(scale_a_per_row)
        FO_FIELD(scale_b_per_col);
  }

  py::class_<A2aBuffers> buffers(m, "A2aBuffers", py::module_local());
  keyword_init(buffers);
  {
    using S = fo_a2a_buffers;
    Fields<A2aBuffers, S>{buffers} FO_FIELD(items) FO_FIELD(item_group) FO_FIELD(block_starts)
        FO_FIELD(unpack_tiles) FO_FIELD(unpack_offsets) FO_FIELD(tile_capacity)
        FO_FIELD(unpack_capacity) FO_FIELD(packed) FO_FIELD(staging) FO_FIELD(packed_numel)
        FO_FIELD(staging_numel) FO_FIELD(counters);
  }

  // ---- GEMM libraries ----
  py::class_<GemmLibrary>(m, "GemmLibrary", py::module_local())
      .def(py::init<std::string>(), py::arg("path"))
      .def_property_readonly("path", &GemmLibrary::path)
      .def_property_readonly("description", &GemmLibrary::description)
      .def_property_readonly("fp8", &GemmLibrary::fp8)
      .def_property_readonly("launch_address", &GemmLibrary::launch_address)
      .def_property_readonly("set_node_address", &GemmLibrary::set_node_address)
      .def_property_readonly("run_ex_address", &GemmLibrary::run_ex_address)
      .def_property_readonly("run_blocks_address", &GemmLibrary::run_blocks_address)
      .def_property_readonly("run_blocks_scaled_address", &GemmLibrary::run_blocks_scaled_address)
      .def_property_readonly("run_ex_scaled_address", &GemmLibrary::run_ex_scaled_address)
      .def("last_error", &GemmLibrary::last_error)
      .def("check", &GemmLibrary::check)
      .def("load_kernels", &GemmLibrary::load_kernels)
      .def("max_ctas", &GemmLibrary::max_ctas)
      .def("workspace_size", &GemmLibrary::workspace_size)
      .def("run", &GemmLibrary::run)
      .def("run_scaled", [](const GemmLibrary& g, Ptr a, Ptr b, const GemmScales& s, Ptr packed,
                            int blocks, int block_rows, int n, int k, int64_t lda, int64_t ldb,
                            Ptr items, Ptr item_group, int num_items, Ptr counters, int ctas,
                            Ptr monitor, Ptr workspace, Ptr stream) {
        g.run_scaled(a, b, s.c, packed, blocks, block_rows, n, k, lda, ldb, items, item_group,
                     num_items, counters, ctas, monitor, workspace, stream);
      })
      .def("run_ex", &GemmLibrary::run_ex)
      .def("run_ex_scaled",
           [](const GemmLibrary& g, Ptr a, Ptr b, const GemmScales& s, Ptr out, int blocks,
              int block_rows, int n, int k, int64_t lda, int64_t ldb, int64_t ldo, Ptr items,
              Ptr item_group, Ptr item_wait, Ptr flags, int num_flags, int num_items,
              Ptr counters, int ctas, Ptr monitor, Ptr workspace, Ptr stream) {
             g.run_ex_scaled(a, b, s.c, out, blocks, block_rows, n, k, lda, ldb, ldo, items,
                             item_group, item_wait, flags, num_flags, num_items, counters, ctas,
                             monitor, workspace, stream);
           })
      .def("launch", [](const GemmLibrary& g, const GemmParams& p, Ptr stream) {
        fo_gemm_params c = p.c;
        c.scales = p.scales ? &*p.scales : nullptr;
        g.launch(c, stream);
      });

  // ---- waits, counters, post-reorder ----
  m.def("wait_counter", [](Ptr counter, int32_t value, int mode, Ptr stream) {
    check(unlocked([&] {
            return fo_wait_counter(counter.as<const int32_t*>(), value, mode,
                                   stream.as<cudaStream_t>());
          }),
          "fo_wait_counter");
  });
  m.def("reset_counters", [](Ptr counters, int n, Ptr stream) {
    check(unlocked([&] {
            return fo_reset_counters(counters.as<int32_t*>(), n, stream.as<cudaStream_t>());
          }),
          "fo_reset_counters");
  });
  m.def("unpack_tiles", [](Ptr src, Ptr dst, int64_t ldd, Ptr tiles, Ptr offsets, int count,
                           int elem_size, Ptr stream) {
    check(unlocked([&] {
            return fo_unpack_tiles(src.as<const void*>(), dst.as<void*>(), ldd,
                                   tiles.as<const int32_t*>(), offsets.as<const int64_t*>(), count,
                                   elem_size, stream.as<cudaStream_t>());
          }),
          "fo_unpack_tiles");
  });
  m.def("add_rmsnorm_tiles", [](Ptr src, Ptr band_offsets, int rows, int n,
                                std::pair<int, int> tile, int dtype, Ptr residual,
                                int64_t ld_residual, Ptr weight, int weight_dtype, float eps,
                                Ptr normed, Ptr residual_out, int64_t ld_out, Ptr stream) {
    check(unlocked([&] {
            return fo_add_rmsnorm_tiles(src.as<const void*>(), band_offsets.as<const int64_t*>(),
                                        rows, n, tile.first, tile.second, dtype,
                                        residual.as<const void*>(), ld_residual,
                                        weight.as<const void*>(), weight_dtype, eps,
                                        normed.as<void*>(), residual_out.as<void*>(), ld_out,
                                        stream.as<cudaStream_t>());
          }),
          "fo_add_rmsnorm_tiles");
  });

  // ---- NCCL ----
  m.def("nccl_load", [](std::optional<std::string> path) {
    const std::string p = path.value_or("");
    check(unlocked([&] { return fo_nccl_load(p.c_str()); }), "loading NCCL");
  });
  m.def("nccl_version", [] {
    int version = 0;
    check(unlocked([&] { return fo_nccl_version(&version); }), "ncclGetVersion");
    return version;
  });
  m.def("nccl_unique_id", [] {
    std::string id(kUniqueIdBytes, '\0');
    check(unlocked([&] { return fo_nccl_unique_id(id.data()); }), "ncclGetUniqueId");
    return py::bytes(id);
  });
  m.def("nccl_comm_init", &nccl_comm_init, py::arg("nranks"), py::arg("unique_id"),
        py::arg("rank"), py::arg("device"), py::arg("max_ctas") = std::nullopt,
        "A communicator (ncclComm_t as an int); with max_ctas, one whose kernels use at most "
        "that many CTAs and no CTA clusters (NCCL >= 2.17).");
  // per call of the plain path: one whole collective (fo_nccl_collective)
  m.def("nccl_collective", [](Ptr comm, int kind, Ptr send, Ptr recv, int64_t count, int dtype,
                              Ptr stream) {
    check(unlocked([&] {
            return fo_nccl_collective(comm.as<void*>(), kind, send.as<const void*>(),
                                      recv.as<void*>(), count, dtype, stream.as<cudaStream_t>());
          }),
          "fo_nccl_collective");
  });
  // per call of the plain path's all_to_all: one NCCL group of send/receive pairs
  m.def("nccl_all_to_all", [](Ptr comm, Ptr send, const std::vector<int64_t>& send_counts,
                              Ptr recv, const std::vector<int64_t>& recv_counts, int dtype,
                              int elem_bytes, Ptr stream) {
    if (send_counts.size() != recv_counts.size())
      throw py::value_error("nccl_all_to_all: send_counts and recv_counts differ in length");
    check(unlocked([&] {
            return fo_nccl_all_to_all(comm.as<void*>(), send.as<const void*>(),
                                      send_counts.data(), recv.as<void*>(), recv_counts.data(),
                                      static_cast<int>(send_counts.size()), dtype, elem_bytes,
                                      stream.as<cudaStream_t>());
          }),
          "fo_nccl_all_to_all");
  });
  m.def("nccl_set_capture_comm", [](Ptr comm, Ptr capture) {
    check(fo_nccl_set_capture_comm(comm.as<void*>(), capture.as<void*>()),
          "fo_nccl_set_capture_comm");
  }, py::arg("comm"), py::arg("capture"),
        "Work queued on comm from a stream being captured goes to capture (0: no twin).");
  m.def("nccl_comm_destroy", [](Ptr comm) {
    check(unlocked([&] { return fo_nccl_comm_destroy(comm.as<void*>()); }), "ncclCommDestroy");
  });
  // the watchdog (fo_nccl_watch_*): a watch is an int handle, never freed
  m.def("nccl_watch", [](Ptr comm, int device, int64_t group, double timeout_s, int handling) {
    fo_nccl_watch_t* w = nullptr;
    check(unlocked([&] {
            return fo_nccl_watch(comm.as<void*>(), device, group, timeout_s, handling, &w);
          }),
          "fo_nccl_watch");
    return reinterpret_cast<uintptr_t>(w);
  }, py::arg("comm"), py::arg("device"), py::arg("group"), py::arg("timeout_s"),
        py::arg("handling"));
  m.def("nccl_watch_set_timeout", [](Ptr watch, double timeout_s) {
    check(fo_nccl_watch_set_timeout(watch.as<fo_nccl_watch_t*>(), timeout_s),
          "fo_nccl_watch_set_timeout");
  });
  m.def("nccl_watch_status", [](Ptr watch) {
    int state = 0, nccl_error = 0;
    double waited_s = 0;
    std::array<char, 640> reason{};
    check(fo_nccl_watch_status(watch.as<fo_nccl_watch_t*>(), &state, &nccl_error, &waited_s,
                               reason.data(), reason.size()),
          "fo_nccl_watch_status");
    return py::make_tuple(state, nccl_error, waited_s, std::string(reason.data()));
  }, "(state FO_WATCH_*, NCCL error, seconds the oldest work waited, why) of a watch.");
  m.def("nccl_watch_pending", [](Ptr watch) {
    int pending = 0;
    check(fo_nccl_watch_pending(watch.as<fo_nccl_watch_t*>(), &pending), "fo_nccl_watch_pending");
    return pending;
  });
  m.def("nccl_watch_abort", [](Ptr watch, const std::string& why) {
    check(unlocked([&] { return fo_nccl_watch_abort(watch.as<fo_nccl_watch_t*>(), why.c_str()); }),
          "fo_nccl_watch_abort");
  });

  // ---- the overlapped call (fo_call_*) ----
  py::class_<Call>(m, "Call", py::module_local());
  m.def("call_create", &call_create);
  m.def("call_destroy", [](Call& c) { c.destroy(); });
  m.def("call_graph_state", [](const Call& c) { return fo_call_graph_state(c.p); },
        "0: the call launches kernel by kernel; 1: it replays its graph; -1: its graph could "
        "not be made (fo_call_graph_state).");
  m.def("call_graphs_held", [](const Call& c) { return fo_call_graphs_held(c.p); },
        "How many graphs of its main phase the call holds (fo_call_graphs_held).");
  m.def("call_add_rmsnorm_graph_state",
        [](const Call& c) { return fo_call_add_rmsnorm_graph_state(c.p); });
  m.def("call_set_add_rmsnorm", [](Call& c, Ptr band_offsets, int rows, std::pair<int, int> tile,
                                   int dtype) {
    check(unlocked([&] {
            return fo_call_set_add_rmsnorm(c.p, band_offsets.as<const int64_t*>(), rows,
                                           tile.first, tile.second, dtype);
          }),
          "fo_call_set_add_rmsnorm");
  });
  // per call: the cudaError code
  m.def("call_run", [](Call& c, Ptr a, int64_t lda, Ptr b, int64_t ldb, Ptr out, Ptr stream,
                       int warm) {
    return int(unlocked([&] {
      return fo_call_run(c.p, a.as<const void*>(), lda, b.as<const void*>(), ldb, out.as<void*>(),
                         stream.as<cudaStream_t>(), warm);
    }));
  });
  m.def("call_run_scaled", [](Call& c, Ptr a, int64_t lda, Ptr b, int64_t ldb, Ptr scale_a,
                              Ptr scale_b, Ptr out, Ptr stream, int warm) {
    return int(unlocked([&] {
      return fo_call_run_scaled(c.p, a.as<const void*>(), lda, b.as<const void*>(), ldb,
                                scale_a.as<const float*>(), scale_b.as<const float*>(),
                                out.as<void*>(), stream.as<cudaStream_t>(), warm);
    }));
  });
  m.def("call_run_add_rmsnorm", [](Call& c, Ptr a, int64_t lda, Ptr b, int64_t ldb, Ptr residual,
                                   int64_t ld_residual, Ptr weight, int weight_dtype, float eps,
                                   Ptr normed, Ptr residual_out, int64_t ld_out, Ptr stream,
                                   int warm) {
    return int(unlocked([&] {
      return fo_call_run_add_rmsnorm(c.p, a.as<const void*>(), lda, b.as<const void*>(), ldb,
                                     residual.as<const void*>(), ld_residual,
                                     weight.as<const void*>(), weight_dtype, eps,
                                     normed.as<void*>(), residual_out.as<void*>(), ld_out,
                                     stream.as<cudaStream_t>(), warm);
    }));
  });

  // ---- all_to_all with each call's rows and splits (fo_a2a_*) ----
  py::class_<A2a>(m, "A2a", py::module_local())
      .def_property_readonly(
          "needs",
          [](const A2a& c) {
            return py::make_tuple(c.needs[0], c.needs[1], c.needs[2], c.needs[3]);
          },
          "What the last call needed: (work items, received tiles, packed and staging elements; "
          "a 'rows' call: no received tiles or staging, packed = its row-major product).");
  m.def("a2a_create", &a2a_create);
  m.def("a2a_destroy", [](A2a& c) { c.destroy(); });
  m.def("a2a_set_buffers", [](A2a& c, const A2aBuffers& b) {
    check(unlocked([&] { return fo_a2a_set_buffers(c.p, &b.c); }), "fo_a2a_set_buffers");
  });
  // per call: send and recv are `world` ints each; the cudaError code (2: grow the buffers to
  // `needs` and call again)
  m.def("a2a_run", [](A2a& c, Ptr a, int64_t lda, Ptr b, int64_t ldb, Ptr out, int M,
                      py::handle send, py::handle recv, Ptr stream, int warm) {
    read_rows(send, c.world, c.rows.data(), "send");
    read_rows(recv, c.world, c.rows.data() + c.world, "recv");
    return int(unlocked([&] {
      return fo_a2a_run(c.p, a.as<const void*>(), lda, b.as<const void*>(), ldb, out.as<void*>(),
                        M, c.rows.data(), c.rows.data() + c.world, stream.as<cudaStream_t>(), warm,
                        c.needs.data());
    }));
  });
  // an fp8 call: its scales, and (block-wise) their element strides, (a0, a1, b0, b1)
  m.def("a2a_run_scaled", [](A2a& c, Ptr a, int64_t lda, Ptr b, int64_t ldb, Ptr scale_a,
                             Ptr scale_b, std::optional<std::array<int64_t, 4>> strides, Ptr out,
                             int M, py::handle send, py::handle recv, Ptr stream, int warm) {
    read_rows(send, c.world, c.rows.data(), "send");
    read_rows(recv, c.world, c.rows.data() + c.world, "recv");
    return int(unlocked([&] {
      return fo_a2a_run_scaled(c.p, a.as<const void*>(), lda, b.as<const void*>(), ldb,
                               scale_a.as<const float*>(), scale_b.as<const float*>(),
                               strides ? strides->data() : nullptr, out.as<void*>(), M,
                               c.rows.data(), c.rows.data() + c.world, stream.as<cudaStream_t>(),
                               warm, c.needs.data());
    }));
  });

  // ---- allgather (fo_gather_*) ----
  py::class_<Gather>(m, "Gather", py::module_local());
  m.def("gather_create", &gather_create);
  m.def("gather_destroy", [](Gather& g) { g.destroy(); });
  m.def("gather_load_kernels", [] {
    check(unlocked([] { return fo_gather_load_kernels(); }), "fo_gather_load_kernels");
  });
  m.def("gather_run", [](Gather& g, Ptr a, int64_t lda, Ptr b, int64_t ldb, Ptr out, int64_t ldo,
                         Ptr stream, int warm) {
    return int(unlocked([&] {
      return fo_gather_run(g.p, a.as<const void*>(), lda, b.as<const void*>(), ldb,
                           out.as<void*>(), ldo, stream.as<cudaStream_t>(), warm);
    }));
  });
  // an fp8 call: its scales, and their element strides (a0, a1, b0, b1): scale_a's always (a
  // 0-dim one (0, 0)), scale_b's where block-wise
  m.def("gather_run_scaled", [](Gather& g, Ptr a, int64_t lda, Ptr b, int64_t ldb, Ptr scale_a,
                                Ptr scale_b, std::array<int64_t, 4> strides, Ptr out,
                                int64_t ldo, Ptr stream, int warm) {
    return int(unlocked([&] {
      return fo_gather_run_scaled(g.p, a.as<const void*>(), lda, b.as<const void*>(), ldb,
                                  scale_a.as<const float*>(), scale_b.as<const float*>(),
                                  strides.data(), out.as<void*>(), ldo,
                                  stream.as<cudaStream_t>(), warm);
    }));
  });
}
