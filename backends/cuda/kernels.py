"""Which compiled kernel serves a plan, built on first use and loaded once per process.

The kernel configurations per architecture live here (tile, cluster, schedule); build.py turns
a configuration into a shared object (JIT, cached) and runtime.py binds it.
"""
from __future__ import annotations

import importlib.util
import threading

from . import build
from .runtime import WAIT_MODES, GemmLibrary, RuntimeLibrary

DTYPES = {"bfloat16": "bf16", "float16": "fp16"}

# (tile_m, tile_n) -> (tile_k, cluster_m, cluster_n, schedule), per architecture.
CONFIGS = {
    90: {(128, 256): (64, 2, 1, "cooperative"), (128, 128): (64, 1, 1, "cooperative")},
    80: {(128, 128): (32, 1, 1, "multistage"), (128, 256): (32, 1, 1, "multistage")},
}
DEFAULT_TILE = {90: (128, 256), 80: (128, 128)}

_lock = threading.Lock()
_loaded: dict = {}

__all__ = ["WAIT_MODES", "DTYPES", "gemm_library", "runtime_library", "toolchain_problem"]


def supported_tiles(arch: int) -> set[tuple[int, int]]:
    return set(CONFIGS[arch])


def default_tile(arch: int) -> tuple[int, int]:
    return DEFAULT_TILE[arch]


def cta_multiple(arch: int, tile: tuple[int, int]) -> int:
    _, cm, cn, _ = CONFIGS[arch][tuple(tile)]
    return cm * cn


def gemm_config(arch: int, tile: tuple[int, int], dtype: str, b_col_major: bool) -> build.GemmConfig:
    tk, cm, cn, schedule = CONFIGS[arch][tuple(tile)]
    return build.GemmConfig(arch=arch, tile_m=tile[0], tile_n=tile[1], tile_k=tk, cluster_m=cm,
                            cluster_n=cn, dtype=DTYPES[dtype], b_col_major=b_col_major,
                            schedule=schedule)


def _load(key, make):
    with _lock:
        lib = _loaded.get(key)
        if lib is None:
            lib = make()
            lib.load_kernels()  # force-load now: no lazy first launch inside an overlapped call
            _loaded[key] = lib
        return lib


def gemm_library(arch: int, tile, dtype: str, b_col_major: bool) -> GemmLibrary:
    config = gemm_config(arch, tile, dtype, b_col_major)
    return _load(config, lambda: GemmLibrary(str(build.build_gemm(config))))


def runtime_library() -> RuntimeLibrary:
    return _load("runtime", lambda: RuntimeLibrary(str(build.build_runtime())))


def toolchain_problem() -> str | None:
    """Why kernels can be neither built nor found prebuilt (None when they can)."""
    if build.prebuilt_available():
        return None
    missing = []
    if build.find_nvcc() is None:
        missing.append("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    if importlib.util.find_spec("cutlass_library") is None:
        missing.append("CUTLASS headers not found (pip install nvidia-cutlass)")
    return "; ".join(missing) or None


def toolchain_versions() -> dict[str, str]:
    nvcc = build.find_nvcc()
    out = {"nvcc": build.nvcc_version(nvcc) if nvcc else "not found"}
    spec = importlib.util.find_spec("cutlass_library")
    out["cutlass headers"] = spec.origin.rsplit("/", 2)[0] if spec and spec.origin else "not found"
    return out
