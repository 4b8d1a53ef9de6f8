"""The signaling GEMM as every call kind of the ``cuda`` backend runs it: which kernel build
(architecture, b's layout, cluster) runs a plan, the operands as the kernels take them, the
per-plan device tables and a launch outside a call (traces, benchmarks).

The operand rules live here and nowhere else: the kernels read rows with a unit column stride,
a 16-byte aligned row stride and base (TMA, and sm80's vector loads); sm80 loads 8-element
vectors along K, so it takes K padded with zeros to a multiple of 8, and along N of a
row-major b, so such a b with N % 8 != 0 runs as the column-major kernel on a transposed copy.
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict

import torch

from . import kernels
from .device_state import (ALIGN_BYTES, ENV_ARCH, PlanTables, aligned_rows, b_col_major,
                           gemm_scales, kernel_scale)

SM80_K_STEP = 8  # elements: sm80's vector loads along K (and along N of a row-major b)
MAX_PLANS = 64  # device tables kept for this many recent (plan, device) pairs


def arch() -> int:
    """90 (sm_90a kernels) on Hopper, else 80; FLASHOVERLAP_CUDA_ARCH=80 forces the
    Ampere/Ada kernels (they run on Hopper too, which is how they are tested here)."""
    forced = os.environ.get(ENV_ARCH)
    if forced:
        if forced not in ("80", "90"):
            raise ValueError(f"{ENV_ARCH} must be 80 or 90, got {forced!r}")
        return int(forced)
    major, _ = torch.cuda.get_device_capability()
    return 90 if major == 9 else 80


def padded_k(arch: int, k: int) -> int:
    """The K the kernels of ``arch`` run: sm80's is padded to a multiple of 8."""
    return -(-k // SM80_K_STEP) * SM80_K_STEP if arch == 80 else k


def takes_col_major(arch: int, b: torch.Tensor) -> bool:
    """Whether b runs as the column-major kernel: a ``weight.t()``, or on sm80 a row-major b
    whose N is not a multiple of 8 (taken as a transposed copy)."""
    return b_col_major(b) or (arch == 80 and b.shape[1] % SM80_K_STEP != 0)


def rows_aligned(t: torch.Tensor) -> bool:
    """Whether the strides of ``t`` (rows) let the kernel read it in place: unit column
    stride, 16-byte aligned row stride (the base address is a per-call check)."""
    return t.stride(1) == 1 and t.stride(0) % (ALIGN_BYTES // t.element_size()) == 0


def bases_aligned(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether both base addresses are 16-byte aligned."""
    return (a.data_ptr() | b.data_ptr()) & (ALIGN_BYTES - 1) == 0


def stock_aligned(out: torch.Tensor, scale_a: torch.Tensor | None, blockwise: bool) -> bool:
    """Whether a stock build's TMA maps take ``out`` and, block-wise, ``scale_a`` in place:
    16-byte aligned bases (kernels.stock_fits checks the rest)."""
    return out.data_ptr() % ALIGN_BYTES == 0 and (
        not blockwise or scale_a is None or scale_a.data_ptr() % ALIGN_BYTES == 0)


def into_aligned(out: torch.Tensor, run):
    """``run(target)`` into a 16-byte aligned target, as a stock build's TMA map of the result
    needs: ``out`` itself where its base is aligned, else a fresh tensor copied into ``out``
    after. Returns ``out``."""
    if out.data_ptr() % ALIGN_BYTES == 0:
        run(out)
        return out
    result = torch.empty(out.shape, dtype=out.dtype, device=out.device)
    run(result)
    return out.copy_(result)


def a_operand(a: torch.Tensor, k: int) -> torch.Tensor:
    """a as the kernel reads it: rows of ``k`` elements, zero-padded beyond a's K (zeros add
    nothing to the products), 16-byte aligned (a copy when needed)."""
    if k != a.shape[1]:
        pad = a.new_zeros(a.shape[0], k)
        pad[:, :a.shape[1]] = a
        return pad
    return aligned_rows(a)


def b_operand(b: torch.Tensor, col: bool, k: int) -> torch.Tensor:
    """b as the kernel reads it: rows of K (``col``: b.t(), [N, K]) or of N ([K, N]), K
    zero-padded to ``k``, 16-byte aligned (a copy when needed)."""
    rows = b.t() if col else b
    if k != b.shape[0]:
        if col:
            pad = b.new_zeros(b.shape[1], k)
            pad[:, :b.shape[0]] = rows
        else:
            pad = b.new_zeros(k, b.shape[1])
            pad[:b.shape[0]] = rows
        return pad
    return aligned_rows(rows)


class Operands:
    """The operands of one key's calls: what the key's strides allow is decided once; per
    call the kernel reads a and b in place when they allow it, else copies that it can read."""

    def __init__(self, arch: int, a: torch.Tensor, b: torch.Tensor, col: bool):
        self.col, self.k = col, padded_k(arch, a.shape[1])
        b_rows = b.t() if col else b
        self.lda, self.ldb = a.stride(0), b_rows.stride(0)
        self.b_direct = rows_aligned(b_rows) and self.k == a.shape[1]
        self.direct = self.b_direct and rows_aligned(a)  # where the key fixes a's strides too

    def copies(self, a: torch.Tensor, b: torch.Tensor):
        """(a, lda, b, ldb, copies): the operands as copies the kernel reads. The caller keeps
        ``copies`` alive until the launch is queued, and no longer: kept on the call, they
        would sit in a CUDA-graph pool as tensors no graph output owns (torch.compile's
        cudagraph trees refuse that)."""
        a_op, b_op = a_operand(a, self.k), b_operand(b, self.col, self.k)
        return a_op.data_ptr(), a_op.stride(0), b_op.data_ptr(), b_op.stride(0), (a_op, b_op)

    def of_key(self, a: torch.Tensor, b: torch.Tensor):
        """(a, lda, b, ldb, copies) of a call whose strides are the key's: in place when they
        allow it and both bases are aligned."""
        if self.direct and bases_aligned(a, b):
            ldb = b.stride(1) if self.col else b.stride(0)
            return a.data_ptr(), a.stride(0), b.data_ptr(), ldb, None
        return self.copies(a, b)

    def of_rows(self, a: torch.Tensor, b: torch.Tensor):
        """(a, lda, b, ldb, copies) of a call with its own rows (all_to_all: a's strides are
        checked per call); no rows: nothing to compute, nothing copied."""
        if (self.b_direct and rows_aligned(a) and bases_aligned(a, b)
                and a.shape[1] == self.k):
            return a.data_ptr(), a.stride(0), b.data_ptr(), self.ldb, None
        if a.shape[0] == 0:  # nothing to compute: the GEMM is not launched
            return a.data_ptr(), self.k, b.data_ptr(), self.ldb, None
        return self.copies(a, b)


def workspace(gemm, plan, k: int, device) -> torch.Tensor | None:
    """The GEMM library's device scratch for ``plan`` (None when it needs none)."""
    size = gemm.workspace_size(len(plan.block_rows), plan.block_rows[0], plan.n, k,
                               plan.wave_size)
    return torch.empty(size, dtype=torch.uint8, device=device) if size else None


class Gemms:
    """The signaling GEMMs of one backend: the device tables of its recent plans (shared by
    every call and stream of a plan on a device) and the kernel library that runs a plan."""

    def __init__(self, max_plans: int = MAX_PLANS):
        self.max_plans = max_plans
        self._tables: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def plan_tables(self, plan, device) -> PlanTables:
        key = (plan, device)
        with self._lock:
            tables = self._tables.get(key)
            if tables is None:
                items, groups = plan.item_table()
                tables = PlanTables(items, items.to(device), groups.to(device),
                                    torch.zeros(plan.num_groups, dtype=torch.int32, device=device))
                self._tables[key] = tables
                while len(self._tables) > self.max_plans:
                    self._tables.popitem(last=False)
            self._tables.move_to_end(key)
            return tables

    @staticmethod
    def gemm_for(plan, tables: PlanTables, b: torch.Tensor, gather: bool = False, scales=None,
                 aligned: bool = True):
        """(kernel library, b taken column-major?, arch) that runs ``plan`` with this b;
        ``gather``: allgather's (an fp8 plan's has fo_gemm_run_ex_scaled: kernels.gemm_config).
        An fp8 plan runs CUTLASS's own kernel where the plan and ``scales`` (the call's
        (scale_a, scale_b) as the kernel reads them: kernel_scale) let it
        (kernels.stock_fits) and the call's result and block-wise scale_a are 16-byte aligned
        (``aligned``: its TMA maps; a prepared call realigns them per call), else
        gemm_sm90.cu's."""
        gpu = arch()
        col = takes_col_major(gpu, b)
        cluster = kernels.preferred_cluster(gpu, plan.tile)
        fits = tables.cluster_fits.get(cluster)
        if fits is None:
            fits = tables.cluster_fits[cluster] = kernels.cluster_fits(tables.items_host, cluster)
        if not fits:
            cluster = (1, 1)
        stock = gpu == 90 and col and aligned and kernels.stock_fits(plan, scales)
        config = kernels.gemm_config(gpu, plan.tile, plan.dtype, col, cluster,
                                     out_dtype=plan.out_dtype, scaling=plan.scaling,
                                     gather=gather, stock=stock, k=plan.k)
        return kernels.gemm_library(config), col, gpu

    def launch_gemm(self, plan, a: torch.Tensor, b: torch.Tensor, packed: torch.Tensor, *,
                    signal: bool = True, monitor: torch.Tensor | None = None,
                    stream: torch.cuda.Stream | None = None,
                    counters: torch.Tensor | None = None, scales=None) -> PlanTables:
        """Launch the signaling GEMM of ``plan`` writing ``packed`` (no waits, no collective;
        a "rows" plan writes whole rows, row stride N).

        ``signal=False`` runs the same kernel with no counters (for measuring what signaling
        costs); ``counters`` default to the plan's benchmark counters (``tables.counters``);
        ``monitor`` (uint64 [T, 2]) records each tile's completion; ``scales``: an fp8 plan's
        (scale_a, scale_b), float32, 0-dim or [M, 1] and 0-dim or [1, N], or (a block-wise
        plan's) [M, ceil(K/128)] and [ceil(K/128), ceil(N/128)], any strides.
        """
        tables = self.plan_tables(plan, a.device)
        blockwise = plan.scaling == "blockwise"
        kernel_scales = (tuple(kernel_scale(t, blockwise) for t in scales)
                         if scales is not None and scales[0] is not None else None)
        aligned = stock_aligned(packed, kernel_scales and kernel_scales[0], blockwise)
        gemm, col, gpu = self.gemm_for(plan, tables, b, scales=kernel_scales, aligned=aligned)
        k = padded_k(gpu, a.shape[1])
        a_op, b_op = a_operand(a, k), b_operand(b, col, k)
        blocks, rows = len(plan.block_rows), plan.block_rows[0]
        stream = stream or torch.cuda.current_stream(a.device)
        counters = counters if counters is not None else tables.counters
        params = kernels.runtime_library().GemmParams(
            a=a_op.data_ptr(), lda=a_op.stride(0), b=b_op.data_ptr(), ldb=b_op.stride(0),
            out=packed.data_ptr(), ldo=plan.n if plan.layout == "rows" else 0, L=blocks,
            block_rows=rows, N=plan.n, K=k, items=tables.items.data_ptr(),
            item_group=tables.item_group.data_ptr(), num_items=plan.num_tiles,
            counters=counters.data_ptr() if signal else None, num_ctas=plan.wave_size,
            monitor=monitor.data_ptr() if monitor is not None else None)
        if gemm.fp8:
            params.scales = gemm_scales(*kernel_scales, blockwise)
        gemm.launch(params, stream.cuda_stream)
        return tables
