"""What every part of the ``cuda`` backend shares: the settings read from the environment, the
per-plan device tables, and the small helpers of the hot path. The GEMM (:mod:`.gemm`), the
calls' common base (:mod:`.call_base`), the call kinds (:mod:`.overlap_call`,
:mod:`.all_to_all_call`, :mod:`.gather_call`) and the backend (:mod:`.backend`) build on it; it
imports none of them.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

import torch

from . import kernels

ENV_RESERVED_SMS = "FLASHOVERLAP_CUDA_RESERVED_SMS"
ENV_WAIT = "FLASHOVERLAP_CUDA_WAIT"
ENV_ARCH = "FLASHOVERLAP_CUDA_ARCH"
ENV_GRAPH = "FLASHOVERLAP_CUDA_GRAPH"
ENV_FP8_BLOCK = "FLASHOVERLAP_CUDA_FP8_BLOCK"  # 0: decline block-wise fp8 (it runs dequantized)
# The CTAs of the overlapped calls' NCCL kernels (a communicator of their own): "auto" = the SMs
# the signaling GEMM leaves free (the default), "0" = NCCL's own choice
ENV_NCCL_CTAS = "FLASHOVERLAP_CUDA_NCCL_CTAS"
DEFAULT_NCCL_CTAS = "auto"
DEFAULT_RESERVED_SMS = 4  # 128 CTAs: measured faster than 132 for the cluster-2 kernels (csrc/cuda/NOTES.md)
# At world size > 1 the collectives run beside the persistent signaling GEMM on the SMs it leaves
# free: 24 measured best of 4-32 on two H200s over NVLink (docs/results.md, "Two GPUs")
DEFAULT_RESERVED_SMS_MULTI = 24
DEFAULT_WAIT = "stream_wait_value"
ALIGN_BYTES = 16  # TMA: global strides and base addresses 16-byte aligned


def reserved_sms(world_size: int = 1) -> int:
    """The SMs the signaling GEMM leaves free: ``$FLASHOVERLAP_CUDA_RESERVED_SMS``, else 4 at
    world size 1 (nothing runs beside it) and 24 above (its collectives' kernels run there)."""
    value = os.environ.get(ENV_RESERVED_SMS, "").strip()
    if value == "":
        return DEFAULT_RESERVED_SMS if world_size <= 1 else DEFAULT_RESERVED_SMS_MULTI
    if not value.isdigit():
        raise ValueError(f"{ENV_RESERVED_SMS} must be a non-negative int, got {value!r}")
    return int(value)


def overlap_nccl_ctas(world_size: int) -> int | None:
    """The most CTAs an overlapped call's collective kernels take (None: NCCL's own choice).
    The signaling GEMM is persistent: its CTAs hold their SMs until it ends, so a collective
    kernel launched beside it runs only on the SMs it leaves free (:func:`reserved_sms`); with
    more CTAs than that, the rest start only when the GEMM ends, and their channels' data with
    them. "auto" bounds them only at world size > 1: a group of one moves nothing, and its
    overlapped calls share the plain path's communicator."""
    value = os.environ.get(ENV_NCCL_CTAS, DEFAULT_NCCL_CTAS).strip().lower()
    if value == "auto":
        return max(1, reserved_sms(world_size)) if world_size > 1 else None
    if not value.isdigit():
        raise ValueError(f"{ENV_NCCL_CTAS} must be 'auto' or a non-negative int, got {value!r}")
    return int(value) or None


def replay_graphs() -> bool:
    """Whether prepared calls replay a captured graph of the whole call (the default; 0 turns
    it off: every call then launches each kernel, wait and collective itself)."""
    value = os.environ.get(ENV_GRAPH, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV_GRAPH} must be 0 or 1, got {value!r}")
    return value == "1"


def outside_graph_pools(fn, stream: torch.cuda.Stream):
    """``fn()`` run in a short-lived thread whose current stream is ``stream``.

    What a prepared call keeps between calls (tables, counters, buffers, communication streams)
    must come from the ordinary caching allocator. torch.compile's CUDA graphs (cudagraph trees)
    send every allocation *of the calling thread* to their private pool while they warm up and
    record a graph, and then refuse a pool holding tensors that are not the graph's outputs.
    Another thread's allocations stay in the ordinary pool.
    """
    result: dict = {}

    def target():
        try:
            with torch.cuda.device(stream.device), torch.cuda.stream(stream):
                result["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            result["error"] = e

    worker = threading.Thread(target=target, name="flashoverlap-prepare")
    worker.start()
    worker.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def wait_mode() -> str:
    mode = os.environ.get(ENV_WAIT, DEFAULT_WAIT)
    if mode not in kernels.WAIT_MODES:
        raise ValueError(f"{ENV_WAIT} must be one of {sorted(kernels.WAIT_MODES)}, got {mode!r}")
    return mode


def aligned_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (row-major rows) with a 16-byte aligned row stride and base; copies if needed."""
    step = ALIGN_BYTES // t.element_size()
    if t.stride(1) == 1 and t.stride(0) % step == 0 and t.data_ptr() % ALIGN_BYTES == 0:
        return t
    rows, cols = t.shape
    buf = torch.empty((rows, -(-cols // step) * step), dtype=t.dtype, device=t.device)
    buf[:, :cols].copy_(t)
    return buf[:, :cols]


@dataclass
class PlanTables:
    """Device-resident, read-only tables of one plan on one device, shared by every stream."""

    items_host: torch.Tensor
    items: torch.Tensor
    item_group: torch.Tensor
    counters: torch.Tensor  # for launch_gemm outside a call (benchmarks), not for calls
    cluster_fits: dict = field(default_factory=dict)  # cluster shape -> bool


# ncclDataType_t of what a call moves; e4m3 (allgather's fp8 rows) as its bytes (ncclUint8),
# which every NCCL has (ncclFloat8e4m3 only 2.24 and later) and which moves them unchanged
NCCL_DTYPES = {"bfloat16": 9, "float16": 6, "float32": 7, "float8_e4m3fn": 1}


def _current_stream_getter():
    """The fastest way to read the current stream's raw handle (a per-call read)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw
    return lambda index: torch.cuda.current_stream(index).cuda_stream


_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


SCALE_BLOCKS = 2  # fo_gemm_scales' mode of block-wise scales (FO_SCALE_BLOCKS)


def kernel_scale(t: torch.Tensor, blockwise: bool = False) -> torch.Tensor:
    """An fp8 scale as the kernel reads it: one float, or consecutive floats (a [M, 1] or
    [1, N] view with another stride is copied); a block-wise one as it is (the kernel reads it
    through its strides), unless a stride is negative."""
    if blockwise:
        return t if min(t.stride()) >= 0 else t.contiguous()
    if t.dim() == 0 or t.numel() == 1 or t.stride(0 if t.shape[1] == 1 else 1) == 1:
        return t
    return t.contiguous()


def scale_modes(scale_a: torch.Tensor, scale_b: torch.Tensor, blockwise: bool = False):
    """(a_per_row, b_per_col, a_stride, b_stride) of fo_gemm_scales for kernel_scale'd scales:
    row-wise [M, 1] and column-wise [1, N] (1), tensor-wise (0), or block-wise (SCALE_BLOCKS,
    with their element strides)."""
    if blockwise:
        return SCALE_BLOCKS, SCALE_BLOCKS, tuple(scale_a.stride()), tuple(scale_b.stride())
    return int(scale_a.dim() == 2), int(scale_b.dim() == 2), (0, 0), (0, 0)


def gemm_scales(scale_a: torch.Tensor, scale_b: torch.Tensor, blockwise: bool = False):
    """fo_gemm_scales (the runtime's GemmScales) of kernel_scale'd scales (row-wise: [M, 1];
    column-wise: [1, N]; block-wise: [M, ceil(K/128)] and [ceil(K/128), ceil(N/128)])."""
    a_mode, b_mode, a_stride, b_stride = scale_modes(scale_a, scale_b, blockwise)
    return kernels.runtime_library().GemmScales(scale_a.data_ptr(), scale_b.data_ptr(), a_mode,
                                                b_mode, a_stride, b_stride)


def b_col_major(b: torch.Tensor) -> bool:
    """True when b is the transpose of a row-major [N, K] (``weight.t()``); a 1x1 b is both
    (api.b_layout: 'col')."""
    return b.stride(0) == 1 and (b.stride(1) != 1 or b.shape[0] <= 1)
