"""The cuda backend's fused residual add + RMSNorm, what of it runs without a GPU: the band table
a prepared call hands its native call (from the call's own post-reorder layout), and each call's
residual and weight as the kernel takes them. The kernel is checked on the GPU
(tests/gpu/test_fused_norm.py); the band table's addressing against the tile-by-tile
post-reorder in tests/test_add_rmsnorm_fused.py."""
from __future__ import annotations

import pytest
import torch

import flashoverlap_core as fo
from flashoverlap_backends.cuda.add_rmsnorm import band_table, residual_operand, weight_operand
from flashoverlap_core.backend import OverlapCall
from flashoverlap_core.collectives import RegionExchange
from flashoverlap_core.reorder import row_index, unpack_tiles


def _exchange(m, n, op, dtype="bfloat16", group_sizes=None, layout=None):
    torch_dtype = getattr(torch, dtype)
    plan = fo.plan(m, n, 64, op=op, dtype=torch_dtype, backend="reference", tile=(128, 256),
                   group_sizes=group_sizes, layout=layout)
    out = torch.empty(m, n, dtype=torch_dtype)
    call = OverlapCall(torch.empty(m, 64, dtype=torch_dtype), torch.empty(64, n, dtype=torch_dtype),
                       plan, op if op != "custom" else (lambda region, g: None), None, 0, 1, out)
    return RegionExchange(call, torch.randn(plan.packed_numel).to(torch_dtype)), plan


@pytest.mark.parametrize("m, n", [(1, 4096), (300, 1000), (1025, 5120), (7, 13)])
@pytest.mark.parametrize("op", ["allreduce", "reduce_scatter"])
def test_band_table_reads_the_post_reordered_rows(m, n, op):
    exchange, plan = _exchange(m, n, op, group_sizes=None, layout="tiles")
    table, rows, tile = band_table(exchange, torch.device("cpu"))
    assert rows == m and table.dtype == torch.int64 and tile == plan.tile
    assert tuple(table.shape) == (-(-m // 128), -(-n // 256))
    (view, tiles, offsets), = exchange.block_layouts()
    want = unpack_tiles(exchange.staging, offsets, tiles, torch.empty(m, n, dtype=torch.bfloat16))
    got = exchange.staging[row_index(table.tolist(), m, n, plan.tile)]
    assert torch.equal(got, want)


@pytest.mark.parametrize("m, n", [(1, 4096), (300, 1000), (7, 13)])
def test_band_table_of_a_rows_plan_reads_rows_in_place(m, n):
    exchange, plan = _exchange(m, n, "allreduce", group_sizes=None)
    assert plan.layout == "rows"
    table, rows, tile = band_table(exchange, torch.device("cpu"))
    assert tile == (plan.tile[0], n) and tuple(table.shape) == (-(-m // 128), 1)
    src = torch.randn(m * n)
    assert torch.equal(src[row_index(table.tolist(), m, n, tile)], src.view(m, n))


@pytest.mark.parametrize("op, dtype", [("custom", "bfloat16"), ("allreduce", "float32")])
def test_no_band_table_where_the_kernel_does_not_serve(op, dtype):
    exchange, _ = _exchange(40, 64, op, dtype)
    assert band_table(exchange, torch.device("cpu")) is None


def test_residual_rows_are_taken_in_place_when_the_kernel_can():
    wide = torch.randn(6, 24)
    for residual, copied, ld in ((wide[:, :16], False, 24), (torch.randn(6, 16), False, 16),
                                 (wide[:1, :16], False, 24), (wide[:, :16].t().contiguous().t(), True, 16),
                                 (torch.randn(1, 16).expand(6, 16), True, 16)):
        got, got_ld = residual_operand(residual, 16)
        assert torch.equal(got, residual) and got_ld == ld
        assert (got.data_ptr() != residual.data_ptr()) == copied
        assert got.stride(1) == 1 and (got.shape[0] == 1 or got.stride(0) >= 16)


@pytest.mark.parametrize("dtype, code, kept", [(torch.bfloat16, 0, True), (torch.float32, 1, True),
                                               (torch.float16, 1, False), (torch.float64, 1, False)])
def test_weight_in_the_activations_dtype_or_float32(dtype, code, kept):
    weight = torch.randn(32).to(dtype)
    got, got_code = weight_operand(weight, torch.bfloat16)
    assert got_code == code and got.dtype == (torch.bfloat16 if code == 0 else torch.float32)
    assert torch.equal(got.double(), weight.double()) and (got is weight) == kept
    strided, _ = weight_operand(torch.randn(64)[::2], torch.float32)
    assert strided.stride(0) == 1
