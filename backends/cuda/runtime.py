"""The Python face of the native runtime: loading its extension module, its errors and constants.

The runtime is a pybind11 module built from ``csrc/cuda`` by :mod:`.build` for the Python that
runs it; ``csrc/cuda/runtime_binding.cpp`` lists everything it exports: the descriptions of the
prepared calls (the C structs of ``flashoverlap_cuda.h``, filled field by field), the prepared
calls and their per-call entry points, the device-side waits, counter resets and post-reorders,
NCCL, and ``GemmLibrary``, which loads one GEMM kernel library (a shared object with a C ABI,
built once per configuration for any Python). Pointers travel as ints; a call that fails raises
:class:`KernelError`, except the per-call entry points, which return the cudaError code for
their caller to raise with ``check``.

This module imports no torch and builds nothing: :func:`.kernels.runtime_library` builds the
module on first use and loads it here.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import threading
from pathlib import Path
from types import ModuleType

ABI_VERSION = 2  # FO_CUDA_ABI_VERSION of csrc/cuda/gemm_api.h
FP8_DTYPE_CODE = 2  # fo_gemm_config.dtype of an e4m3 build (FO_DTYPE_E4M3)
WAIT_MODES = {"stream_wait_value": 0, "spin_kernel": 1}  # fo_wait_counter's modes
MODULE_NAME = "fo_runtime"  # PYBIND11_MODULE of csrc/cuda/runtime_binding.cpp


class KernelError(RuntimeError):
    """A CUDA call inside the runtime or a kernel library failed:
    ``<what> failed (cudaError N): <detail> [<library path>]``."""


_lock = threading.Lock()
_modules: dict[str, ModuleType] = {}


def load(path: str | Path) -> ModuleType:
    """The runtime extension module built at ``path``, imported once per process."""
    path = str(path)
    with _lock:
        module = _modules.get(path)
        if module is None:
            loader = importlib.machinery.ExtensionFileLoader(MODULE_NAME, path)
            spec = importlib.util.spec_from_file_location(MODULE_NAME, path, loader=loader)
            module = importlib.util.module_from_spec(spec)
            loader.exec_module(module)
            module._init(KernelError, path)
            if module.ABI_VERSION != ABI_VERSION:
                raise KernelError(f"{path} has ABI version {module.ABI_VERSION}, expected "
                                  f"{ABI_VERSION}: rebuild it (flashoverlap build)")
            _modules[path] = module
        return module


__all__ = ["ABI_VERSION", "FP8_DTYPE_CODE", "KernelError", "WAIT_MODES", "load"]
