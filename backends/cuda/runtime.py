"""ctypes bindings of the kernel libraries (C ABI in csrc/cuda/flashoverlap_cuda.h).

The shared objects depend on neither torch's nor Python's ABI: they take raw device pointers
and ``cudaStream_t`` handles, so one build serves any torch on the same driver.
"""
from __future__ import annotations

import ctypes
from ctypes import POINTER, c_float, c_int, c_int32, c_int64, c_size_t, c_uint64, c_void_p

ABI_VERSION = 2
FP8_DTYPE_CODE = 2  # fo_gemm_config.dtype of an e4m3 build (FO_DTYPE_E4M3)
WAIT_MODES = {"stream_wait_value": 0, "spin_kernel": 1}


class GemmDescription(ctypes.Structure):
    _fields_ = [(name, c_int) for name in (
        "abi_version", "arch", "tile_m", "tile_n", "tile_k", "cluster_m", "cluster_n", "dtype",
        "b_col_major", "cta_multiple", "schedule", "stages", "out_dtype", "fast_accum")]


class CallDescription(ctypes.Structure):
    """fo_call_desc: a prepared overlapped call (see flashoverlap_cuda.h)."""

    _fields_ = [
        ("abi_version", c_int), ("gemm_launch", c_void_p), ("L", c_int), ("block_rows", c_int),
        ("N", c_int), ("K", c_int), ("items", c_void_p),
        ("item_group", c_void_p), ("num_items", c_int), ("num_ctas", c_int),
        ("workspace", c_void_p), ("packed", c_void_p), ("staging", c_void_p),
        ("counters", c_void_p), ("num_groups", c_int), ("group_sizes", POINTER(c_int32)),
        ("wait_mode", c_int), ("collective", c_int), ("nccl_comm", c_void_p),
        ("nccl_dtype", c_int), ("num_steps", c_int), ("per_step", c_int),
        ("steps", POINTER(c_int64)), ("num_blocks", c_int),
        ("block_out_offset", POINTER(c_int64)), ("block_tiles", POINTER(c_void_p)),
        ("block_offsets", POINTER(c_void_p)), ("block_num_tiles", POINTER(c_int32)),
        ("ldo", c_int64), ("elem_size", c_int), ("comm_stream", c_void_p),
        ("gemm_set_node", c_void_p), ("use_graph", c_int),
        # fp8 (0 for 16-bit calls)
        ("scaled", c_int), ("scale_a_per_row", c_int), ("scale_b_per_col", c_int),
        ("rows", c_int),  # a "rows" plan: no post-reorder
    ]


class GemmScales(ctypes.Structure):
    """fo_gemm_scales: the float32 scales of an e4m3 GEMM (see flashoverlap_cuda.h)."""

    _fields_ = [("a", c_void_p), ("b", c_void_p), ("a_per_row", c_int), ("b_per_col", c_int)]


class GemmParams(ctypes.Structure):
    """fo_gemm_params: one launch of a GEMM library (see flashoverlap_cuda.h)."""

    _fields_ = [
        ("a", c_void_p), ("lda", c_int64), ("b", c_void_p), ("ldb", c_int64),
        ("scales", POINTER(GemmScales)), ("out", c_void_p), ("ldo", c_int64), ("L", c_int),
        ("block_rows", c_int), ("N", c_int), ("K", c_int), ("items", c_void_p),
        ("item_group", c_void_p), ("num_items", c_int), ("counters", c_void_p),
        ("num_ctas", c_int), ("monitor", c_void_p),
    ]


class GatherDescription(ctypes.Structure):
    """fo_gather_desc: a prepared allgather call (see flashoverlap_cuda.h)."""

    _fields_ = [
        ("abi_version", c_int), ("gemm_run_ex", c_void_p), ("world", c_int), ("rank", c_int),
        ("block_rows", c_int), ("N", c_int), ("K", c_int), ("copy_cols", c_int),
        ("items", c_void_p), ("item_group", c_void_p), ("item_wait", c_void_p),
        ("num_items", c_int), ("num_ctas", c_int), ("workspace", c_void_p),
        ("gathered", c_void_p), ("ldg", c_int64), ("arrive_flags", c_void_p),
        ("wait_flags", c_void_p), ("num_chunks", c_int), ("chunk_rows", POINTER(c_int32)),
        ("elem_size", c_int), ("nccl_comm", c_void_p), ("nccl_dtype", c_int),
        ("delay_us", c_int), ("own_chunks", c_int), ("comm_stream", c_void_p),
    ]


class A2aDescription(ctypes.Structure):
    """fo_a2a_desc: all_to_all with each call's own rows and splits (see flashoverlap_cuda.h)."""

    _fields_ = [
        ("abi_version", c_int), ("gemm_run_blocks", c_void_p), ("tile_m", c_int),
        ("tile_n", c_int), ("N", c_int), ("raster_m", c_int), ("swizzle", c_int),
        ("groups", c_int), ("world", c_int), ("rank", c_int), ("K", c_int), ("num_ctas", c_int),
        ("wait_mode", c_int), ("nccl_comm", c_void_p), ("nccl_dtype", c_int),
        ("elem_size", c_int), ("comm_stream", c_void_p),
    ]


class A2aBuffers(ctypes.Structure):
    """fo_a2a_buffers: the device buffers of an all_to_all call and their capacities."""

    _fields_ = [
        ("items", c_void_p), ("item_group", c_void_p), ("block_starts", c_void_p),
        ("unpack_tiles", c_void_p), ("unpack_offsets", c_void_p), ("tile_capacity", c_int),
        ("unpack_capacity", c_int), ("packed", c_void_p), ("staging", c_void_p),
        ("packed_numel", c_int64), ("staging_numel", c_int64), ("counters", c_void_p),
    ]


class KernelError(RuntimeError):
    """A CUDA call inside a kernel library failed."""


class _Library:
    def __init__(self, path: str):
        self.path = path
        self.lib = ctypes.CDLL(path)
        self.lib.fo_last_error.restype = ctypes.c_char_p
        self.lib.fo_load_kernels.restype = c_int

    def check(self, err: int, what: str) -> None:
        if err:
            detail = self.lib.fo_last_error()
            raise KernelError(f"{what} failed (cudaError {err}): "
                              f"{detail.decode() if detail else 'no detail'} [{self.path}]")

    def load_kernels(self) -> None:
        self.check(self.lib.fo_load_kernels(), "fo_load_kernels")


class GemmLibrary(_Library):
    """One compiled signaling-GEMM configuration."""

    def __init__(self, path: str):
        super().__init__(path)
        lib = self.lib
        lib.fo_gemm_describe.restype = POINTER(GemmDescription)
        lib.fo_gemm_max_ctas.argtypes = [c_int, POINTER(c_int)]
        lib.fo_gemm_max_ctas.restype = c_int
        lib.fo_gemm_workspace_size.argtypes = [c_int, c_int, c_int, c_int, c_int]
        lib.fo_gemm_workspace_size.restype = c_size_t
        lib.fo_gemm_run.argtypes = [
            c_void_p, c_void_p, c_void_p, c_int, c_int, c_int, c_int, c_int64, c_int64,
            c_void_p, c_void_p, c_int, c_void_p, c_int, c_void_p, c_void_p, c_void_p]
        lib.fo_gemm_run.restype = c_int
        lib.fo_gemm_run_ex.argtypes = [
            c_void_p, c_void_p, c_void_p, c_int, c_int, c_int, c_int, c_int64, c_int64, c_int64,
            c_void_p, c_void_p, c_void_p, c_void_p, c_int, c_int, c_void_p, c_int, c_void_p,
            c_void_p, c_void_p]
        lib.fo_gemm_run_ex.restype = c_int
        self.run_ex_address = ctypes.cast(lib.fo_gemm_run_ex, c_void_p).value  # fo_gather_desc
        self.run_blocks_address = ctypes.cast(lib.fo_gemm_run_blocks, c_void_p).value  # fo_a2a_desc
        self.description = lib.fo_gemm_describe().contents
        lib.fo_gemm_launch.argtypes = [POINTER(GemmParams), c_void_p]
        lib.fo_gemm_launch.restype = c_int
        self.launch_address = ctypes.cast(lib.fo_gemm_launch, c_void_p).value  # fo_call_desc
        self.set_node_address = ctypes.cast(lib.fo_gemm_set_node_params, c_void_p).value
        # fp8 (e4m3 builds): the same calls with the scales
        lib.fo_gemm_run_scaled.argtypes = [
            c_void_p, c_void_p, POINTER(GemmScales), c_void_p, c_int, c_int, c_int, c_int, c_int64,
            c_int64, c_void_p, c_void_p, c_int, c_void_p, c_int, c_void_p, c_void_p, c_void_p]
        lib.fo_gemm_run_scaled.restype = c_int
        self.fp8 = self.description.dtype == FP8_DTYPE_CODE
        if self.description.abi_version != ABI_VERSION:
            raise KernelError(f"{path} has ABI version {self.description.abi_version}, "
                              f"expected {ABI_VERSION}: rebuild it (flashoverlap build)")

    def max_ctas(self, device: int) -> int:
        out = c_int(0)
        self.check(self.lib.fo_gemm_max_ctas(device, ctypes.byref(out)), "fo_gemm_max_ctas")
        return out.value

    def workspace_size(self, blocks: int, block_rows: int, n: int, k: int, ctas: int) -> int:
        return self.lib.fo_gemm_workspace_size(blocks, block_rows, n, k, ctas)

    def run(self, a, b, packed, blocks, block_rows, n, k, lda, ldb, items, item_group,
            num_items, counters, ctas, monitor, workspace, stream) -> None:
        self.check(self.lib.fo_gemm_run(
            a, b, packed, blocks, block_rows, n, k, lda, ldb, items, item_group, num_items,
            counters, ctas, monitor, workspace, stream), "fo_gemm_run")

    def run_scaled(self, a, b, scales: GemmScales, packed, blocks, block_rows, n, k, lda, ldb,
                   items, item_group, num_items, counters, ctas, monitor, workspace, stream) -> None:
        """fo_gemm_run_scaled: an e4m3 build's run, with its scales."""
        self.check(self.lib.fo_gemm_run_scaled(
            a, b, ctypes.byref(scales), packed, blocks, block_rows, n, k, lda, ldb, items,
            item_group, num_items, counters, ctas, monitor, workspace, stream),
            "fo_gemm_run_scaled")

    def launch(self, params: GemmParams, stream) -> None:
        """fo_gemm_launch: one launch of any build, in either layout (``params.ldo``)."""
        self.check(self.lib.fo_gemm_launch(ctypes.byref(params), stream), "fo_gemm_launch")

    def run_ex(self, a, b, out, blocks, block_rows, n, k, lda, ldb, ldo, items, item_group,
               item_wait, flags, num_flags, num_items, counters, ctas, monitor, workspace,
               stream) -> None:
        """fo_gemm_run_ex: ``ldo`` != 0 writes the tiles in place into a row-major out;
        ``item_wait`` and ``flags`` make each item wait for its rows (allgather)."""
        self.check(self.lib.fo_gemm_run_ex(
            a, b, out, blocks, block_rows, n, k, lda, ldb, ldo, items, item_group, item_wait,
            flags, num_flags, num_items, counters, ctas, monitor, workspace, stream),
            "fo_gemm_run_ex")


class RuntimeLibrary(_Library):
    """Device-side waits, counter resets and the post-communication reorder."""

    def __init__(self, path: str):
        super().__init__(path)
        lib = self.lib
        lib.fo_wait_counter.argtypes = [c_void_p, c_int32, c_int, c_void_p]
        lib.fo_wait_counter.restype = c_int
        lib.fo_reset_counters.argtypes = [c_void_p, c_int, c_void_p]
        lib.fo_reset_counters.restype = c_int
        lib.fo_unpack_tiles.argtypes = [c_void_p, c_void_p, c_int64, c_void_p, c_void_p, c_int,
                                        c_int, c_void_p]
        lib.fo_unpack_tiles.restype = c_int

        lib.fo_nccl_load.argtypes = [ctypes.c_char_p]
        lib.fo_nccl_load.restype = c_int
        lib.fo_nccl_version.argtypes = [POINTER(c_int)]
        lib.fo_nccl_version.restype = c_int
        lib.fo_nccl_unique_id.argtypes = [c_void_p]
        lib.fo_nccl_unique_id.restype = c_int
        lib.fo_nccl_comm_init.argtypes = [POINTER(c_void_p), c_int, c_void_p, c_int, c_int]
        lib.fo_nccl_comm_init.restype = c_int
        lib.fo_nccl_comm_init_bounded.argtypes = [POINTER(c_void_p), c_int, c_void_p, c_int, c_int,
                                                  c_int]
        lib.fo_nccl_comm_init_bounded.restype = c_int
        lib.fo_gather_create.argtypes = [POINTER(GatherDescription), POINTER(c_void_p)]
        lib.fo_gather_create.restype = c_int
        lib.fo_gather_run.argtypes = [c_void_p, c_void_p, c_int64, c_void_p, c_int64, c_void_p,
                                      c_int64, c_void_p, c_int]
        lib.fo_gather_run.restype = c_int
        lib.fo_gather_destroy.argtypes = [c_void_p]
        lib.fo_gather_destroy.restype = None
        lib.fo_gather_load_kernels.restype = c_int
        lib.fo_nccl_comm_destroy.argtypes = [c_void_p]
        lib.fo_nccl_comm_destroy.restype = c_int
        lib.fo_call_create.argtypes = [POINTER(CallDescription), POINTER(c_void_p)]
        lib.fo_call_create.restype = c_int
        lib.fo_call_run.argtypes = [c_void_p, c_void_p, c_int64, c_void_p, c_int64, c_void_p,
                                    c_void_p, c_int]
        lib.fo_call_run.restype = c_int
        lib.fo_call_destroy.argtypes = [c_void_p]
        lib.fo_call_destroy.restype = None
        lib.fo_call_graph_state.argtypes = [c_void_p]
        lib.fo_call_graph_state.restype = c_int
        self.call_run = lib.fo_call_run  # the per-call entry point, bound once
        lib.fo_call_run_scaled.argtypes = [c_void_p, c_void_p, c_int64, c_void_p, c_int64, c_void_p,
                                           c_void_p, c_void_p, c_void_p, c_int]
        lib.fo_call_run_scaled.restype = c_int
        self.call_run_scaled = lib.fo_call_run_scaled  # fp8 calls'
        lib.fo_a2a_create.argtypes = [POINTER(A2aDescription), POINTER(c_void_p)]
        lib.fo_a2a_create.restype = c_int
        lib.fo_a2a_set_buffers.argtypes = [c_void_p, POINTER(A2aBuffers)]
        lib.fo_a2a_set_buffers.restype = c_int
        lib.fo_a2a_run.argtypes = [c_void_p, c_void_p, c_int64, c_void_p, c_int64, c_void_p,
                                   c_int, c_void_p, c_void_p, c_void_p, c_int, c_void_p]
        lib.fo_a2a_run.restype = c_int
        lib.fo_a2a_destroy.argtypes = [c_void_p]
        lib.fo_a2a_destroy.restype = None
        self.a2a_run = lib.fo_a2a_run  # the per-call entry point of all_to_all, bound once
        self._bind_add_rmsnorm()

    # ---- the post-reorder fused into residual add + RMSNorm (add_rmsnorm.cuh) ----------------
    def _bind_add_rmsnorm(self) -> None:
        lib = self.lib
        lib.fo_add_rmsnorm_tiles.argtypes = [
            c_void_p, c_void_p, c_int, c_int, c_int, c_int, c_int, c_void_p, c_int64, c_void_p,
            c_int, c_float, c_void_p, c_void_p, c_int64, c_void_p]
        lib.fo_add_rmsnorm_tiles.restype = c_int
        lib.fo_call_set_add_rmsnorm.argtypes = [c_void_p, c_void_p, c_int, c_int, c_int, c_int]
        lib.fo_call_set_add_rmsnorm.restype = c_int
        lib.fo_call_run_add_rmsnorm.argtypes = [
            c_void_p, c_void_p, c_int64, c_void_p, c_int64, c_void_p, c_int64, c_void_p, c_int,
            c_float, c_void_p, c_void_p, c_int64, c_void_p, c_int]
        lib.fo_call_run_add_rmsnorm.restype = c_int
        lib.fo_call_add_rmsnorm_graph_state.argtypes = [c_void_p]
        lib.fo_call_add_rmsnorm_graph_state.restype = c_int
        # the per-call entry point: (call, a, lda, b, ldb, residual, ld_residual, weight,
        # weight_dtype, eps, normed, residual_out, ld_out, stream, warm) -> cudaError
        self.call_run_add_rmsnorm = lib.fo_call_run_add_rmsnorm

    def add_rmsnorm_tiles(self, src: int, band_offsets: int, rows: int, n: int,
                          tile: tuple[int, int], dtype: int, residual: int, ld_residual: int,
                          weight: int, weight_dtype: int, eps: float, normed: int,
                          residual_out: int, ld_out: int, stream: int) -> None:
        """fo_add_rmsnorm_tiles: rows of ``src`` through the band table, + residual, RMSNorm
        (dtype and weight_dtype codes as flashoverlap_cuda.h has them)."""
        self.check(self.lib.fo_add_rmsnorm_tiles(
            src, band_offsets, rows, n, tile[0], tile[1], dtype, residual, ld_residual, weight,
            weight_dtype, eps, normed, residual_out, ld_out, stream), "fo_add_rmsnorm_tiles")

    def call_set_add_rmsnorm(self, handle: int, band_offsets: int, rows: int,
                             tile: tuple[int, int], dtype: int) -> None:
        self.check(self.lib.fo_call_set_add_rmsnorm(handle, band_offsets, rows, tile[0], tile[1],
                                                    dtype), "fo_call_set_add_rmsnorm")

    def call_add_rmsnorm_graph_state(self, handle: int) -> int:
        """As :meth:`call_graph_state`, for the fused calls (fo_call_add_rmsnorm_graph_state)."""
        return self.lib.fo_call_add_rmsnorm_graph_state(handle)

    # ---- NCCL, through the runtime object ----------------------------------------------------
    def nccl_load(self, path: str | None) -> None:
        self.check(self.lib.fo_nccl_load((path or "").encode()), "loading NCCL")

    def nccl_version(self) -> int:
        out = c_int(0)
        self.check(self.lib.fo_nccl_version(ctypes.byref(out)), "ncclGetVersion")
        return out.value

    def nccl_unique_id(self) -> bytes:
        buf = ctypes.create_string_buffer(128)
        self.check(self.lib.fo_nccl_unique_id(buf), "ncclGetUniqueId")
        return buf.raw

    def nccl_comm_init(self, nranks: int, unique_id: bytes, rank: int, device: int,
                       max_ctas: int | None = None) -> int:
        """A communicator; with ``max_ctas``, one whose kernels use at most that many CTAs and
        no CTA clusters (fo_nccl_comm_init_bounded, NCCL >= 2.17)."""
        comm = c_void_p(0)
        buf = ctypes.create_string_buffer(unique_id, 128)
        if max_ctas is None:
            err = self.lib.fo_nccl_comm_init(ctypes.byref(comm), nranks, buf, rank, device)
        else:
            err = self.lib.fo_nccl_comm_init_bounded(ctypes.byref(comm), nranks, buf, rank,
                                                     device, max_ctas)
        self.check(err, "ncclCommInitRank" + ("Config" if max_ctas is not None else ""))
        return comm.value

    def nccl_comm_destroy(self, comm: int) -> None:
        self.check(self.lib.fo_nccl_comm_destroy(comm), "ncclCommDestroy")

    # ---- prepared calls ----------------------------------------------------------------------
    def call_create(self, desc: CallDescription) -> int:
        handle = c_void_p(0)
        self.check(self.lib.fo_call_create(ctypes.byref(desc), ctypes.byref(handle)),
                   "fo_call_create")
        return handle.value

    def call_destroy(self, handle: int) -> None:
        self.lib.fo_call_destroy(handle)

    def call_graph_state(self, handle: int) -> int:
        """0: the call launches kernel by kernel; 1: it replays its graph; -1: its graph
        could not be made (fo_call_graph_state)."""
        return self.lib.fo_call_graph_state(handle)

    # ---- all_to_all with each call's rows and splits (all_to_all_call.cuh) --------------------
    def a2a_create(self, desc: A2aDescription) -> int:
        handle = c_void_p(0)
        self.check(self.lib.fo_a2a_create(ctypes.byref(desc), ctypes.byref(handle)), "fo_a2a_create")
        return handle.value

    def a2a_set_buffers(self, handle: int, buffers: A2aBuffers) -> None:
        self.check(self.lib.fo_a2a_set_buffers(handle, ctypes.byref(buffers)), "fo_a2a_set_buffers")

    def a2a_destroy(self, handle: int) -> None:
        self.lib.fo_a2a_destroy(handle)

    # ---- prepared allgather calls (gather_call.cuh) ------------------------------------------
    def gather_create(self, desc: GatherDescription) -> int:
        handle = c_void_p(0)
        self.check(self.lib.fo_gather_create(ctypes.byref(desc), ctypes.byref(handle)),
                   "fo_gather_create")
        return handle.value

    def gather_destroy(self, handle: int) -> None:
        self.lib.fo_gather_destroy(handle)

    def gather_load_kernels(self) -> None:
        self.check(self.lib.fo_gather_load_kernels(), "fo_gather_load_kernels")

    def wait_counter(self, counter_ptr: int, value: int, mode: str, stream: int) -> None:
        self.check(self.lib.fo_wait_counter(counter_ptr, value, WAIT_MODES[mode], stream),
                   "fo_wait_counter")

    def reset_counters(self, ptr: int, n: int, stream: int) -> None:
        self.check(self.lib.fo_reset_counters(ptr, n, stream), "fo_reset_counters")

    def unpack_tiles(self, src: int, dst: int, ldd: int, tiles: int, offsets: int, count: int,
                     elem_size: int, stream: int) -> None:
        self.check(self.lib.fo_unpack_tiles(src, dst, ldd, tiles, offsets, count, elem_size,
                                            stream), "fo_unpack_tiles")


__all__ = ["A2aBuffers", "A2aDescription", "CallDescription", "GatherDescription", "GemmLibrary", "GemmScales", "RuntimeLibrary", "KernelError", "WAIT_MODES",
           "c_uint64"]
