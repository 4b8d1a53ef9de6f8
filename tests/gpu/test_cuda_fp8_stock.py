"""GPU tests of the fp8 builds on CUTLASS's own kernel (issue 32: build.GemmConfig.stock,
csrc/cuda/gemm_sm90_stock.cu): the plan's item order, the signal and the monitor, through the
backend's launch outside a call (its counters and monitor are visible there), against float64 of
the dequantized inputs; where they run and where gemm_sm90.cu's builds run instead
(kernels.stock_fits). Fresh random inputs (the seed is in each failure's message), NaN-poisoned
outputs, ragged shapes: partial row and column tiles, an odd number of row tiles (a 2x1
cluster's filler item in the last round), K tails, one row; both clusters (a plan whose order
does not fit 2x1 runs 1x1); equal destination blocks of whole row tiles (reduce_scatter's).
The calls through fo.overlap (which take these builds wherever they fit) are
test_cuda_fp8.py's. Skips without a Hopper GPU (fails under FLASHOVERLAP_REQUIRE_HW=1).
"""
from __future__ import annotations

import os
import random

import pytest
import torch

import flashoverlap_core as fo
from flashoverlap_core.tiles import Schedule

import test_cuda_fp8 as fp8_tests

pytestmark = pytest.mark.timeout(600)

REASON = fp8_tests.REASON
if REASON and os.environ.get("FLASHOVERLAP_REQUIRE_HW") == "1":
    raise RuntimeError(f"FLASHOVERLAP_REQUIRE_HW=1 but {REASON}")
pytestmark = [pytestmark, pytest.mark.skipif(REASON is not None, reason=REASON or "")]

F8 = fp8_tests.F8
OUT = fp8_tests.OUT
SCALINGS = ("tensorwise", "rowwise", "mixed", "blockwise")
# (M, N, K, runs the stock build): whole tiles; 9 row tiles (a 2x1 cluster's last round has a
# filler) with partial last row and column tiles and K not a multiple of 16 (nor of a group);
# K below one group; one row (block-wise: gemm_sm90.cu's, whose scale_a is not by TMA there); N
# not a multiple of 8 (gemm_sm90.cu's: the result's TMA row stride)
SHAPES = [(1024, 1024, 1024, True), (1100, 1000, 1000, True), (520, 136, 72, True),
          (1, 200, 128, None), (100, 300, 256, False)]


def _gemms():
    from flashoverlap_backends.cuda.gemm import Gemms

    return Gemms()


def _inputs(m, n, k, scaling, seed, scale_layout="torch"):
    if scaling == "blockwise":
        return fp8_tests._block_inputs(m, n, k, seed, scale_layout)
    return fp8_tests._inputs(m, n, k, scaling, seed)


def _run(plan, scaling, out_name, seed, scale_layout="torch"):
    """Launch ``plan``'s GEMM once into a poisoned result with fresh counters and monitor;
    check the result, the counters (each group's tiles) and the monitor (each item once, by
    its CTA); return the library that ran."""
    from flashoverlap_backends.cuda.device_state import kernel_scale

    m, n, k = plan.m, plan.n, plan.k
    a, b, sa, sb = _inputs(m, n, k, scaling, seed, scale_layout)
    out_dtype = OUT[out_name]
    gemms = _gemms()
    packed = torch.full((plan.packed_numel,), float("nan"), device="cuda", dtype=out_dtype)
    counters = torch.zeros(plan.num_groups, dtype=torch.int32, device="cuda")
    monitor = torch.zeros(plan.num_tiles, 2, dtype=torch.int64, device="cuda")
    blockwise = scaling == "blockwise"
    tables = gemms.launch_gemm(plan, a, b, packed, counters=counters, monitor=monitor,
                               scales=(sa, sb))
    torch.cuda.synchronize()
    kernel_scales = tuple(kernel_scale(t, blockwise) for t in (sa, sb))
    lib = gemms.gemm_for(plan, tables, b, scales=kernel_scales)[0]
    from flashoverlap_backends.cuda import kernels

    assert kernels.is_stock(lib) == kernels.stock_fits(plan, kernel_scales)
    what = f"{m}x{n}x{k} {scaling} {out_name} {plan.layout} {lib.path}, seed {seed}"
    got = torch.empty(m, n, device="cuda", dtype=out_dtype)
    for t, _, off in plan.packed_tiles:
        got[t.row0:t.row0 + t.rows, t.col0:t.col0 + t.cols] = plan.packed_view(packed, t, off)
    (fp8_tests._block_check if blockwise else fp8_tests._check)(got, a, b, sa, sb, out_dtype, what)
    assert counters.tolist() == list(plan.group_sizes), f"{what}: counters {counters.tolist()}"
    stamps = monitor[:, 0]
    assert bool((stamps != 0).all()), f"{what}: items never signalled: {(stamps == 0).nonzero()}"
    ctas = monitor[:, 1] & 0xFFFFFFFF
    expect = torch.arange(plan.num_tiles, device="cuda") % plan.wave_size
    assert bool((ctas == expect).all()), f"{what}: items signalled by other CTAs than theirs"
    return lib


def _plan(m, n, k, scaling, out_name, **kw):
    return fo.plan(m, n, k, op=kw.pop("op", "custom"), dtype=F8, tile=(128, 128),
                   backend="cuda", out_dtype=OUT[out_name],
                   scaling="blockwise" if scaling == "blockwise" else None, **kw)


@pytest.mark.parametrize("out_name", sorted(OUT))
@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:3])))
def test_stock_build_signals_every_item_in_the_plans_order(shape, scaling, out_name):
    """Both clusters: the backend's schedule (2x1 where it fits), and raster "n" one band at a
    time (consecutive items in other columns: 1x1); where the stock build does not fit, the
    other build, as checked."""
    m, n, k, stock = shape
    if stock is None:
        stock = scaling != "blockwise"
    for schedule in (None, Schedule("n", 1)):
        plan = _plan(m, n, k, scaling, out_name, layout="rows", schedule=schedule)
        lib = _run(plan, scaling, out_name, random.randrange(2**31))
        assert ("_stock" in lib.path) == stock, f"{shape} {scaling} {schedule}: ran {lib.path}"


@pytest.mark.parametrize("scaling", ["rowwise", "blockwise"])
def test_stock_build_takes_equal_blocks_of_whole_row_tiles(scaling):
    """reduce_scatter's destination blocks (items round-robin over them) in one group: 2 and 4
    blocks of whole row tiles run the stock build, whose tiles then lie at their own rows;
    blocks of 300 rows (a tile would straddle two), or two groups (each group's region holds
    every block's rows: not the result's rows), run gemm_sm90.cu's."""
    for m, world, groups, stock in ((1024, 2, 1, True), (2048, 4, 1, True), (1200, 4, 1, False),
                                    (4096, 2, 2, False)):
        tiles = -(-1000 // 128) * world * -(-(m // world) // 128)
        sizes = (tiles,) if groups == 1 else (tiles // 2, tiles - tiles // 2)
        plan = _plan(m, 1000, 512, scaling, "bfloat16", op="reduce_scatter", world_size=world,
                     layout="rows", group_sizes=sizes)
        lib = _run(plan, scaling, "bfloat16", random.randrange(2**31))
        assert ("_stock" in lib.path) == stock, f"M={m}, W={world}, {groups} groups: ran {lib.path}"


@pytest.mark.parametrize("scale_layout", ["rows", "shifted", "spaced"])
def test_blockwise_scales_in_other_layouts_run_the_other_build(scale_layout):
    """The stock build reads torch's scale layouts only; the others (row-major scale_a, a
    shifted base, a spaced one) run gemm_sm90.cu's block-scaled build, correctly."""
    plan = _plan(1000, 1000, 1000, "blockwise", "bfloat16", layout="rows")
    lib = _run(plan, "blockwise", "bfloat16", random.randrange(2**31), scale_layout)
    assert "_stock" not in lib.path, lib.path


def test_tiles_layout_runs_the_other_build():
    """A plan of packed tiles ("tiles" layout) runs gemm_sm90.cu's build (the stock build writes
    tiles in place only)."""
    for scaling in ("rowwise", "blockwise"):
        plan = _plan(1000, 1000, 1000, scaling, "bfloat16", layout="tiles")
        lib = _run(plan, scaling, "bfloat16", random.randrange(2**31))
        assert "_stock" not in lib.path, lib.path


def test_stock_build_realigns_an_unaligned_result_and_scale_a():
    """A prepared call on the stock build (TMA maps of its result and block-wise scale_a)
    given a result or scale_a that is not 16-byte aligned: the same results, from aligned
    copies."""
    m, n, k = 1024, 1024, 1024
    for scaling in ("rowwise", "blockwise"):
        for shift_out, shift_scale in ((True, False), (False, True), (False, False)):
            seed = random.randrange(2**31)
            a, b, sa, sb = _inputs(m, n, k, scaling, seed)
            if shift_scale and scaling == "blockwise":
                store = torch.empty(sa.numel() + 1, device="cuda")
                sa = store.as_strided(sa.shape, sa.stride(), 1).copy_(sa)
            store = torch.full((m * n + 1,), float("nan"), device="cuda", dtype=torch.bfloat16)
            out = store[1:].view(m, n) if shift_out else store[:-1].view(m, n)
            got = fo.overlap(a, b, "allreduce", scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                             out=out, backend="cuda")
            torch.cuda.synchronize()
            assert got is out
            what = f"{scaling} shifted out {shift_out}, scale_a {shift_scale}, seed {seed}"
            check = fp8_tests._block_check if scaling == "blockwise" else fp8_tests._check
            check(got, a, b, sa, sb, torch.bfloat16, what)


def test_stock_build_replays_in_a_graph_with_moving_operands():
    """fo.overlap's captured graph re-points the stock kernel's node (set_node) when a, b and
    the scales move: every call's result is its own."""
    for scaling in ("rowwise", "blockwise"):
        for _ in range(3):
            fp8_tests._call(1024, 1024, 1024, scaling, "bfloat16")
        call = fo.prepared_calls()[-1]
        assert (call["backend"], call["runner"]) == ("cuda", "CudaCall"), call
