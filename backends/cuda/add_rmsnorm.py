"""The post-reorder fused into residual add + RMSNorm on the ``cuda`` backend
(``fo.overlap_add_rmsnorm``; the kernel: csrc/cuda/add_rmsnorm.cu).

A prepared call whose result is one block of rows (allreduce, reduce_scatter) hands its native
call the block's band table once (``fo_call_set_add_rmsnorm``); each fused call then passes the
residual and the weight as the kernel takes them: rows with unit column stride, a contiguous
weight of the activations' dtype or float32.
"""
from __future__ import annotations

import torch

from flashoverlap_core.collectives import RegionExchange
from flashoverlap_core.ops import REDUCE_OPS
from flashoverlap_core.reorder import band_offsets

DTYPE_CODES = {"bfloat16": 0, "float16": 1}  # the kernel's activation types (flashoverlap_cuda.h)
FUSED_OPS = REDUCE_OPS  # ops whose result is one block of rows


def band_table(exchange: RegionExchange, device: torch.device
               ) -> tuple[torch.Tensor, int, tuple[int, int]] | None:
    """(the band table of the call's output block in its staging buffer, on ``device``; the
    block's rows; the tile the table counts in), or None for ops the fused kernel does not
    serve. A "rows" plan's rows are in place: each band is one tile of all N columns."""
    plan = exchange.plan
    if exchange.kind not in FUSED_OPS or plan.dtype not in DTYPE_CODES:
        return None
    rows, n = exchange.call.out.shape
    if plan.layout == "rows":
        bands = torch.arange(0, rows, plan.tile[0], dtype=torch.int64) * n
        return bands.view(-1, 1).to(device), rows, (plan.tile[0], n)
    (rows_view, tiles, offsets), = exchange.block_layouts()
    table = torch.tensor(band_offsets(tiles, offsets, rows, n, plan.tile), dtype=torch.int64)
    if n % 8 == 0 and plan.tile[1] % 8 == 0 and bool((table % 8).any()):
        # the kernel's 16-byte path relies on it (true of tiles stored back to back)
        raise ValueError(f"the staging offsets of {plan.describe_grid()} are not multiples of 8")
    return table.to(device), rows, plan.tile


def residual_operand(residual: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    """(residual as rows with unit column stride, its row stride): itself when it is such rows."""
    row_stride, col_stride = residual.stride()
    if col_stride == 1 and (row_stride >= n or residual.shape[0] == 1):
        return residual, max(row_stride, n)
    return residual.contiguous(), n


def weight_operand(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """(weight as the kernel takes it, its code): 0 in the activations' dtype, 1 float32
    (any other floating dtype is converted to float32); contiguous."""
    code = 0 if weight.dtype == dtype else 1
    if code and weight.dtype != torch.float32:
        weight = weight.float()
    return (weight if weight.stride(0) == 1 else weight.contiguous()), code


ROW_BAND = 128  # rows per band of a plain result's table (any height works: each row is whole)
_row_tables: dict = {}


def add_rmsnorm_rows(runtime, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The plain path's residual add + RMSNorm (``Backend.add_rmsnorm_rows``): the fused
    kernel over the rows of a finished row-major result, read as a "rows" plan's output is
    (bands of whole rows: tile ``(ROW_BAND, N)``); None where the kernel does not serve
    (another dtype, a result that is not contiguous rows)."""
    code = DTYPE_CODES.get(str(x.dtype).removeprefix("torch."))
    if code is None or x.dim() != 2 or not x.is_contiguous():
        return None
    rows, n = x.shape
    if rows == 0 or residual.shape != x.shape:
        return None
    key = (rows, n, x.device)
    table = _row_tables.get(key)
    if table is None:
        table = (torch.arange(0, rows, ROW_BAND, dtype=torch.int64) * n).to(x.device)
        if len(_row_tables) > 64:
            _row_tables.clear()
        _row_tables[key] = table
    res, ld_residual = residual_operand(residual, n)
    w, weight_code = weight_operand(weight, x.dtype)
    normed, resid_out = torch.empty_like(x), torch.empty_like(x)
    runtime.add_rmsnorm_tiles(
        x.data_ptr(), table.data_ptr(), rows, n, (ROW_BAND, n),
        code, res.data_ptr(), ld_residual, w.data_ptr(),
        weight_code, eps, normed.data_ptr(), resid_out.data_ptr(), n,
        torch.cuda.current_stream(x.device).cuda_stream)
    return normed, resid_out

