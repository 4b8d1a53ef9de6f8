"""The ``cuda`` backend: CUTLASS signaling GEMM (sm_90a, sm_80), device-side waits on group
counters, collectives through torch.distributed (NCCL), and a post-reorder kernel.

Importing this package is cheap: it creates no CUDA context and compiles nothing; kernels are
built (or found prebuilt) on first use.
"""
from .backend import CudaBackend

__all__ = ["CudaBackend"]
