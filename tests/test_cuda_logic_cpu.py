"""The cuda backend's pure-Python decisions, on the CPU (no GPU, no nvcc): which plans a
cluster build can run (``kernels.cluster_fits``), which GEMM configurations are refused and why
(``GemmConfig.problems``), and which calls and plans the backend declines
(``unsupported_reasons``, ``plan_reasons``). The kernel architecture is forced through
``FLASHOVERLAP_CUDA_ARCH``, so nothing asks a device."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashoverlap_core as fo
from flashoverlap_backends.cuda import CudaBackend, build, kernels
from flashoverlap_backends.cuda.backend import ENV_ARCH
from flashoverlap_core.plan import block_rows_for, destination_group_sizes
from flashoverlap_core.tiles import RASTERS, Schedule, TileGrid

ARCHS = sorted(kernels.CONFIGS)


# ---- cluster_fits -----------------------------------------------------------------------------
def cluster_rule(items: torch.Tensor, cluster: tuple[int, int]) -> bool:
    """The rule written out item by item: in each complete round of cm*cn consecutive items,
    the CTA at (rm, rn) of the cluster computes the column tile of the one at (0, rn) and the
    rows (block, band) of the one at (rm, 0), so they can share what they load."""
    cm, cn = cluster
    size = cm * cn
    rows = [tuple(r) for r in items[:, :2].tolist()]
    cols = items[:, 2].tolist()
    for base in range(0, len(cols) - size + 1, size):
        for r in range(size):
            rm, rn = r % cm, r // cm
            if rows[base + r] != rows[base + rm] or cols[base + r] != cols[base + rn * cm]:
                return False
    return True


def table(*items) -> torch.Tensor:
    """An item table from (block, band, column tile) triples (packed offsets left at 0)."""
    return torch.tensor([list(i) + [0] for i in items], dtype=torch.int64).view(-1, 4)


def test_cluster_fits_hand_made_tables():
    down_a_column = table((0, 0, 0), (0, 1, 0), (0, 0, 1), (0, 1, 1))   # pairs share a column
    along_a_row = table((0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1))     # pairs share rows
    for items in (down_a_column, along_a_row):
        assert kernels.cluster_fits(items, (1, 1))
    assert kernels.cluster_fits(down_a_column, (2, 1))
    assert not kernels.cluster_fits(down_a_column, (1, 2))
    assert kernels.cluster_fits(along_a_row, (1, 2))
    assert not kernels.cluster_fits(along_a_row, (2, 1))
    # 2x2: ranks (0,0) (1,0) (0,1) (1,1): columns c, c, c', c' and rows r, r', r, r'
    square = table((0, 0, 0), (0, 1, 0), (0, 0, 1), (0, 1, 1))
    assert kernels.cluster_fits(square, (2, 2))
    assert not kernels.cluster_fits(table((0, 0, 0), (0, 1, 0), (0, 1, 1), (0, 0, 1)), (2, 2))
    # the same band of another destination block is other rows
    assert not kernels.cluster_fits(table((0, 0, 0), (1, 0, 1)), (1, 2))


@st.composite
def item_tables(draw):
    """Item tables of real plans (any raster, swizzle, blocks, ragged grid), sometimes with
    two items swapped."""
    raster = draw(st.sampled_from(RASTERS))
    schedule = Schedule(raster, draw(st.integers(1, 4)))
    world = draw(st.integers(1, 3))
    op = draw(st.sampled_from(["allreduce", "reduce_scatter"])) if world > 1 else "allreduce"
    m = world * draw(st.integers(1, 12)) if op == "reduce_scatter" else draw(st.integers(1, 40))
    n, tile = draw(st.integers(1, 40)), (draw(st.integers(1, 8)), draw(st.integers(1, 8)))
    total = TileGrid(block_rows_for(op, m, world, None), n, *tile, schedule).num_tiles
    plan = fo.Plan(m, n, 8, op, world, "bfloat16", tile, 4, (total,), schedule)
    items, _ = plan.item_table()
    if len(items) > 1 and draw(st.booleans()):
        i, j = draw(st.integers(0, len(items) - 1)), draw(st.integers(0, len(items) - 1))
        items[[i, j]] = items[[j, i]]
    return items


@settings(max_examples=200, deadline=None, database=None)
@given(items=item_tables(),
       cluster=st.sampled_from([(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 4)]))
def test_cluster_fits_agrees_with_the_rule_on_real_plans(items, cluster):
    assert kernels.cluster_fits(items, cluster) == cluster_rule(items, cluster)


# ---- GemmConfig.problems ----------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_every_configuration_a_plan_can_select_is_valid(arch):
    configs = kernels.all_configs([arch])
    assert configs and all(c.arch == arch and not c.problems() for c in configs)
    tiles = {c.tile for c in configs}  # what default plans pick, all of them kernels of the table
    assert kernels.default_tile(arch) in tiles and tiles <= kernels.supported_tiles(arch)


@pytest.mark.parametrize("fields, complaint", [
    (dict(arch=70), "arch must be one of"),
    (dict(dtype="float32"), "dtype must be one of"),
    (dict(schedule="multistage"), "schedule for sm90"),
    (dict(arch=80, tile_k=32, cluster_m=1, schedule="cooperative"), "schedule for sm80"),
    (dict(stages=1), "stages must be 0 (auto) or 2..12"),
    (dict(stages=13), "stages must be 0 (auto) or 2..12"),
    (dict(tile_m=64), "cooperative tile_m must be a multiple of 128"),
    (dict(tile_m=320, schedule="pingpong"), "pingpong tile_m must be a multiple of 64 up to 256"),
    (dict(tile_n=8), "tile_n must be a multiple of 16 in 16..256"),
    (dict(tile_n=272), "tile_n must be a multiple of 16 in 16..256"),
    (dict(tile_k=8), "tile_k must be a multiple of 16 in 16..128"),
    (dict(cluster_m=4, cluster_n=4), "product <= 8"),
    (dict(cluster_m=0), "need sizes >= 1"),
    (dict(arch=80, tile_m=96, tile_k=32, cluster_m=1, schedule="multistage"), "multiples of 64"),
    (dict(arch=80, tile_m=256, tile_k=32, cluster_m=1, schedule="multistage"), "at most 128x256"),
    (dict(arch=80, tile_k=16, cluster_m=1, schedule="multistage"), "sm80 tile_k must be 32 or 64"),
    (dict(arch=80, tile_k=32, schedule="multistage"), "sm80 has no clusters"),
])
def test_invalid_configurations_say_what_is_wrong(fields, complaint):
    with pytest.raises(ValueError, match="invalid GEMM config") as refused:
        build.GemmConfig(**fields)
    assert complaint in str(refused.value)


def test_each_problem_is_reported_not_just_the_first():
    with pytest.raises(ValueError) as refused:
        build.GemmConfig(dtype="float64", stages=1, tile_k=8)
    message = str(refused.value)
    assert all(p in message for p in ("dtype must be", "stages must be", "tile_k must be"))


# ---- unsupported_reasons and plan_reasons -----------------------------------------------------
@pytest.fixture(params=ARCHS)
def arch(request, monkeypatch) -> int:
    monkeypatch.setenv(ENV_ARCH, str(request.param))
    return request.param


@pytest.fixture
def backend(arch) -> CudaBackend:
    return CudaBackend()


def spec(**kw):
    args = dict(m=256, n=512, k=64, op="allreduce", world_size=1, dtype="bfloat16",
                device_type="cuda", b_layout="col", send_splits=None)
    args.update(kw)
    return fo.OverlapSpec(**args)


def test_calls_the_kernels_can_run_are_supported(backend):
    for dtype in kernels.DTYPES:
        for op in ("allreduce", "reduce_scatter", "custom"):
            assert backend.unsupported_reasons(spec(dtype=dtype, op=op, world_size=2)) == []
    # all_to_all: any rows and splits, each call's own (the automatic choice sees none)
    for send in ((128, 128), (100, 156), (0, 256), None):
        assert backend.unsupported_reasons(spec(op="all_to_all", world_size=2,
                                                send_splits=send)) == []


def test_calls_the_kernels_cannot_run_are_declined_with_a_way_out(backend):
    reasons = backend.unsupported_reasons(spec(dtype="float32"))
    assert len(reasons) == 1 and "takes ['bfloat16', 'float16'], not float32" in reasons[0]
    assert "backend='decomposition'" in reasons[0]


def test_all_to_all_beyond_the_native_limits_is_declined(backend):
    [reason] = backend.unsupported_reasons(spec(op="all_to_all", world_size=65))
    assert "up to 64" in reason


def one_group_plan(tile, op="allreduce", world=1, send=None, m=256):
    rows = block_rows_for(op, m, world, send)
    total = TileGrid(rows, 512, *tile, Schedule("n", 8)).num_tiles
    return fo.Plan(m, 512, 64, op, world, "bfloat16", tile, 4, (total,), Schedule("n", 8), send)


def test_plans_with_a_kernel_tile_are_accepted(backend, arch):
    for tile in kernels.supported_tiles(arch):
        assert backend.plan_reasons(one_group_plan(tile)) == []
        assert backend.plan_reasons(one_group_plan(tile, "reduce_scatter", 2)) == []
    # the default plan's tile, whatever the call and the wave size, has a kernel
    for m in (1, 127, 128, 1000, 4096, 8192):
        for op, world in (("allreduce", 1), ("reduce_scatter", 2)):
            for wave in (None, 2, 64, 128, 132):
                call = spec(m=m * world, op=op, world_size=world)
                assert kernels.default_tile(arch, call, wave) in kernels.supported_tiles(arch)


@pytest.mark.parametrize("tile", [(64, 64), (128, 64), (256, 128), (8, 8)])
def test_a_tile_without_a_kernel_names_the_tiles_there_are(backend, arch, tile):
    [reason] = backend.plan_reasons(one_group_plan(tile))
    assert f"tile {tile} has no CUDA kernel on sm_{arch}" in reason
    for available in kernels.supported_tiles(arch):
        assert str(available) in reason


def test_unequal_destination_blocks_need_the_destinations_grouping(backend, arch):
    tile = kernels.default_tile(arch)
    [reason] = backend.plan_reasons(one_group_plan(tile, "all_to_all", 2, (100, 156)))
    assert "'destinations' grouping" in reason
    assert backend.plan_reasons(one_group_plan(tile, "all_to_all", 2, (128, 128))) == []
    plan = fo.plan(256, 512, 64, op="all_to_all", world_size=2, send_splits=[100, 156],
                   tile=tile, backend="reference")
    assert plan.grouping == "destinations" and plan.layout == "rows"
    assert backend.plan_reasons(plan) == []  # the per-call layout writes whole rows
    plan = fo.plan(256, 512, 64, op="all_to_all", world_size=2, send_splits=[100, 156],
                   tile=tile, backend="reference", layout="tiles")
    assert plan.grouping == "destinations" and backend.plan_reasons(plan) == []
    grid = TileGrid((100, 156), 512, *tile, Schedule("n", 8))
    many = fo.Plan(256, 512, 64, "all_to_all", 2, "bfloat16", tile, 4,
                   destination_group_sizes(grid, 17), Schedule("n", 8), (100, 156),
                   grouping="destinations")
    assert any("at most 16 groups" in r for r in backend.plan_reasons(many))


def test_all_to_all_plans_take_rows_where_the_native_call_writes_them(backend, arch):
    """cuda runs all_to_all's "destinations" plans in both layouts, "rows" by default; a "rows"
    plan of explicit group sizes ("waves": the prepared call's rows path has no all_to_all)
    is declined, and raster "m" tile orders keep "tiles" (their strips are not whole rows)."""
    tile = kernels.default_tile(arch)
    spec = fo.OverlapSpec(256, 512, 64, "all_to_all", 2, "bfloat16", "cuda", "col", (100, 156))
    assert backend.layouts(spec) == ("rows", "tiles")
    plan = fo.plan(256, 512, 64, op="all_to_all", world_size=2, send_splits=[100, 156],
                   tile=tile, backend="reference")
    assert plan.layout == "rows" and plan.for_rows(300, [0, 300]).layout == "rows"
    waves = one_group_plan(tile, "all_to_all", 2, (128, 128))
    rows = fo.Plan(256, 512, 64, "all_to_all", 2, "bfloat16", tile, 4, waves.group_sizes,
                   Schedule("n", 8), (128, 128), layout="rows")
    assert any("grouping 'destinations'" in r for r in backend.plan_reasons(rows))
    assert backend.plan_reasons(waves) == []  # "tiles"
    column = fo.plan(256, 512, 64, op="all_to_all", world_size=2, send_splits=[100, 156],
                     tile=tile, backend="reference", schedule=Schedule("m", 2))
    assert column.layout == "tiles" and backend.plan_reasons(column) == []
    with pytest.raises(ValueError, match="needs a raster 'n' schedule"):
        fo.plan(256, 512, 64, op="all_to_all", world_size=2, send_splits=[100, 156],
                tile=tile, backend="reference", schedule=Schedule("m", 2), layout="rows")


def test_a_bad_forced_architecture_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(ENV_ARCH, "75")
    with pytest.raises(ValueError, match=f"{ENV_ARCH} must be 80 or 90, got '75'"):
        CudaBackend().plan_reasons(one_group_plan((128, 128)))


def test_tracing_an_allgather_call_is_a_clear_error():
    """The tile monitor belongs to the signalling GEMM: tracing allgather on cuda says so
    before any device work (the CPU tensors here would fail any device work)."""
    from flashoverlap_core.backend import OverlapCall

    plan = fo.plan(256, 128, 64, op="allgather", world_size=1, dtype=torch.bfloat16,
                   backend="reference")
    a, b = torch.zeros(256, 64, dtype=torch.bfloat16), torch.zeros(64, 128, dtype=torch.bfloat16)
    call = OverlapCall(a, b, plan, "allgather", None, 0, 1, torch.empty(256, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="cannot trace an allgather"):
        CudaBackend().trace(call)


CALL_KINDS = ("overlap_call", "all_to_all_call", "gather_call")


def test_the_call_kinds_sit_over_the_gemm_and_their_base_without_a_circle():
    """backends/cuda: device_state imports no other part; the GEMM (gemm) and the calls' base
    (call_base) import no call kind; each call kind imports them, never backend (not even for
    type hints) and no other call kind; backend imports them all."""
    import ast
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "backends" / "cuda"

    def imported(name):
        found = set()
        for node in ast.walk(ast.parse((folder / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                found.add(node.module or "")
                found.update(a.name for a in node.names if not node.module)
        return found

    parts = {"backend", "gemm", "call_base", *CALL_KINDS}
    assert not imported("device_state") & (parts | {"device_state"})
    assert not imported("gemm") & (parts - {"gemm"})
    assert not imported("call_base") & (parts - {"call_base"})
    for kind in CALL_KINDS:
        assert {"device_state", "call_base"} <= imported(kind), kind
        assert not imported(kind) & (parts - {"gemm", "call_base"}), kind
    assert {*CALL_KINDS, "gemm", "call_base", "device_state"} <= imported("backend")


def test_no_part_but_the_backend_knows_the_backend():
    """The call kinds and their helpers name neither CudaBackend nor its private helpers: the
    backend builds them and hands them what they use."""
    import re
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "backends" / "cuda"
    for path in folder.glob("*.py"):
        if path.name not in ("backend.py", "__init__.py"):  # __init__ re-exports it
            text = path.read_text()
            assert not re.search(r"CudaBackend|backend\._", text), path.name


# ---- fp8 (issue 23) ---------------------------------------------------------------------------
def fp8_spec(**kw):
    return spec(**{"dtype": "float8_e4m3fn", "out_dtype": "bfloat16", **kw})


def test_fp8_runs_natively_on_sm90_only(backend, arch):
    assert backend.native_fp8
    for op in ("allreduce", "reduce_scatter", "custom"):
        for out in kernels.DTYPES:
            reasons = backend.unsupported_reasons(fp8_spec(op=op, out_dtype=out, world_size=2))
            if arch == 90:
                assert reasons == []
            else:
                [reason] = reasons
                assert "sm_90a" in reason and f"{ENV_ARCH}=80" in reason and "sm_89" in reason


def test_fp8_b_must_be_column_major(backend):
    assert any("column-major" in r for r in backend.unsupported_reasons(fp8_spec(b_layout="row")))
    assert any("column-major" in r for r in backend.unsupported_reasons(
        fp8_spec(op="allgather", b_layout="row")))


def test_fp8_allgather_runs_natively_on_sm90_only(backend, arch, monkeypatch):
    """fp8 allgather (issue 32): the waiting GEMM with scales on sm_90 (the e4m3 rows and their
    scales gathered, never dequantized rows), every kind of scales at every world size; sm_80
    declines it as every fp8 call, saying why; FLASHOVERLAP_CUDA_FP8_BLOCK=0 declines block-wise
    allgather as every block-wise call."""
    monkeypatch.delenv("FLASHOVERLAP_CUDA_FP8_BLOCK", raising=False)
    for world in (1, 2, 8):
        for scaling in ("tensorwise", "rowwise", "blockwise"):
            for out in kernels.DTYPES:
                reasons = backend.unsupported_reasons(fp8_spec(
                    op="allgather", world_size=world, m=256 * world, scaling=scaling,
                    out_dtype=out))
                if arch == 90:
                    assert reasons == [], reasons
                else:
                    [reason] = reasons
                    assert "sm_90a" in reason and f"{ENV_ARCH}=80" in reason, reason
    monkeypatch.setenv("FLASHOVERLAP_CUDA_FP8_BLOCK", "0")
    reasons = backend.unsupported_reasons(fp8_spec(op="allgather", world_size=2,
                                                   scaling="blockwise"))
    assert any("turns the block-scaled" in r for r in reasons), reasons


def test_the_conformance_suites_fp8_allgather_cases_are_asked_of_cuda(backend, arch, monkeypatch):
    """The conformance suite (flashoverlap_core/testing/test_fp8.py) runs its fp8 allgather
    cases on cuda itself now (issue 32): on sm_90 none is declined; on sm_80 each says why."""
    from flashoverlap_core.testing import test_fp8 as suite

    monkeypatch.delenv("FLASHOVERLAP_CUDA_FP8_BLOCK", raising=False)
    cases = [c for c in suite.fp8_matrix([1, 2, 3, 4]) if c.op == "allgather"]
    assert {c.scaling for c in cases} == {"tensorwise", "rowwise", "blockwise"}
    for case in cases:
        reasons = suite.fp8_reasons(backend, case, 0, "cuda")
        assert (reasons == []) == (arch == 90), (case.id, reasons)


def test_fp8_all_to_all_runs_natively_on_sm90_only(backend, arch):
    """fp8 all_to_all (issue 32): the scaled GEMM over unequal destination blocks on sm_90, every
    kind of scales (block-wise once its build is verified, as for the other ops); sm_80 declines
    it as every fp8 call, saying why; world sizes past the native call's are declined as for
    16-bit all_to_all."""
    for world in (1, 2, 8):
        for scaling in ("tensorwise", "rowwise", None):
            reasons = backend.unsupported_reasons(fp8_spec(
                op="all_to_all", world_size=world, m=world, scaling=scaling,
                send_splits=(1,) * world if world > 1 else None))
            if arch == 90:
                assert reasons == [], reasons
            else:
                [reason] = reasons
                assert "sm_90a" in reason and f"{ENV_ARCH}=80" in reason, reason
    reasons = backend.unsupported_reasons(fp8_spec(op="all_to_all", world_size=65, m=65))
    assert any("world sizes up to 64" in r for r in reasons), reasons


def test_a_one_by_one_b_is_column_major(backend):
    """A 1x1 b is both layouts: it counts as weight.t() (every build takes it, fp8's too); the
    H200 run of 1x1x1 fp8 calls found it declined as row-major."""
    from flashoverlap_backends.cuda.device_state import b_col_major
    from flashoverlap_core.api import b_layout

    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        b = torch.zeros(1, 1, dtype=dtype)
        assert b_layout(b) == "col" and b_col_major(b)
        assert b_layout(b.t()) == "col" and b_col_major(b.t())
    w = torch.zeros(5, 1)  # [N, K] with K = 1: b = w.t() is [1, N], strides (1, 1)
    assert b_layout(w.t()) == "col" and b_col_major(w.t())
    row = torch.zeros(1, 5)  # a contiguous [K, N] with K = 1
    assert b_layout(row) == "row" and not b_col_major(row)
    one = fp8_spec(m=1, n=1, k=1, b_layout=b_layout(torch.zeros(1, 1)))
    assert not any("column-major" in r for r in backend.unsupported_reasons(one))


def test_fp8_plans_pick_the_fp8_builds(monkeypatch):
    monkeypatch.setenv(ENV_ARCH, "90")
    monkeypatch.delenv(kernels.ENV_EPILOGUE, raising=False)
    for tile, kernel in kernels.FP8_CONFIGS[90].items():
        for out in ("bfloat16", "float16"):
            cfg = kernels.gemm_config(90, tile, "float8_e4m3fn", True, kernel.cluster, out_dtype=out)
            assert (cfg.dtype, cfg.out_dtype, cfg.tile_k, cfg.fast_accum) == (
                "e4m3", build.DTYPE_ALIASES[out], 128, True)
            assert not cfg.problems()
    names = {build.config_name(c) for c in kernels.all_configs([90])
             if c.dtype == "e4m3" and not c.block_scaled and not c.gather and not c.stock}
    assert names == {"sm90_e4m3_bf16_bcol_128x256x128_c2x1_cooperative_scw_etma4",
                     "sm90_e4m3_bf16_bcol_128x256x128_c1x1_cooperative_scw_etma4",
                     "sm90_e4m3_bf16_bcol_128x128x128_c2x1_pingpong_etma",
                     "sm90_e4m3_bf16_bcol_128x128x128_c1x1_pingpong_etma",
                     "sm90_e4m3_fp16_bcol_128x256x128_c2x1_cooperative_scw_etma4",
                     "sm90_e4m3_fp16_bcol_128x256x128_c1x1_cooperative_scw_etma4",
                     "sm90_e4m3_fp16_bcol_128x128x128_c2x1_pingpong_etma",
                     "sm90_e4m3_fp16_bcol_128x128x128_c1x1_pingpong_etma",
                     # fp8 all_to_all's (issue 32): unequal destination blocks, 1x1
                     "sm90_e4m3_bf16_bcol_128x256x128_c1x1_cooperative_scw_etma4_blocks",
                     "sm90_e4m3_bf16_bcol_128x128x128_c1x1_pingpong_etma_blocks",
                     "sm90_e4m3_fp16_bcol_128x256x128_c1x1_cooperative_scw_etma4_blocks",
                     "sm90_e4m3_fp16_bcol_128x128x128_c1x1_pingpong_etma_blocks"}
    assert not [c for c in kernels.all_configs([80]) if c.dtype == "e4m3"]
    gather = {build.config_name(c) for c in kernels.all_configs([90])
              if c.gather and not c.stock}
    assert gather == {n + "_gather" for n in names if not n.endswith("_blocks")} | {
        f"sm90_e4m3_{o}_bcol_128x{n}x128_{c}_cooperative_block128{lock}_etma_gather"
        for o in ("bf16", "fp16") for c in ("c2x1", "c1x1")
        for n, lock in ((128, "_lock"), (256, ""))}  # fp8 allgather's (issue 32)
    blocks = {build.config_name(c) for c in kernels.all_configs([90])
              if c.block_scaled and not c.gather and not c.stock}
    # (the 128x128 block-scaled kernel runs its math warpgroups in step: _lock)
    assert blocks == {f"sm90_e4m3_{o}_bcol_128x{n}x128_{c}_cooperative_block128{lock}_etma"
                      for o in ("bf16", "fp16") for c in ("c2x1", "c1x1")
                      for n, lock in ((128, "_lock"), (256, ""))} | {
                      f"sm90_e4m3_{o}_bcol_128x{n}x128_c1x1_cooperative_block128{lock}_etma_blocks"
                      for o in ("bf16", "fp16") for n, lock in ((128, "_lock"), (256, ""))}


def test_fp8_stock_builds_and_where_they_run(monkeypatch):
    """The fp8 builds on CUTLASS's own kernel (STOCK_FP8_CONFIGS): prebuilt for both results
    and clusters, named _stock, built from gemm_sm90_stock.cu (allgather's tensor-/row-wise
    ones, _gather_stock, from gemm_sm90_stock_ex_scaled.cu); a plan runs one where stock_fits:
    "rows" layout, equal blocks of whole row tiles, not all_to_all nor block-wise allgather,
    block-wise scales in torch's layouts."""
    from flashoverlap_core.plan import Plan
    from flashoverlap_core.tiles import Schedule

    monkeypatch.setenv(ENV_ARCH, "90")
    stock = {build.config_name(c) for c in kernels.all_configs([90]) if c.stock}
    # (tensor-/row-wise also with the short-K epilogue tile: kernels.stock_epi_n)
    assert stock == {f"sm90_e4m3_{o}_bcol_128x128x128_{c}_{kind}_etma{wide}{gather}_stock"
                     for o in ("bf16", "fp16") for c in ("c2x1", "c1x1")
                     for kind, gather, wide in (("pingpong", "", ""), ("pingpong", "", "_en64"),
                                                ("cooperative_block128", "", ""),
                                                ("pingpong", "_gather", ""),
                                                ("pingpong", "_gather", "_en64"))}
    # which epilogue tile a plan's K gets: 64 columns below STOCK_WIDE_EPILOGUE_K, tensor- and
    # row-wise only
    for k, scaling, want in ((1024, None, 64), (1536, "rowwise", 64), (2047, None, 64),
                             (2048, None, 0), (8192, "rowwise", 0), (1024, "blockwise", 0),
                             (None, None, 0)):
        cfg = kernels.gemm_config(90, (128, 128), "float8_e4m3fn", True, (2, 1),
                                  out_dtype="bfloat16", scaling=scaling, stock=True, k=k)
        assert cfg.stock_epi_n == want == kernels.stock_epi_n(k, scaling == "blockwise"), k
    assert kernels.gemm_config(90, (128, 128), "float8_e4m3fn", True, (2, 1), k=1024,
                               out_dtype="bfloat16").stock_epi_n == 0  # gemm_sm90.cu's build
    for c in kernels.stock_configs(90):
        source = "gemm_sm90_stock_ex_scaled.cu" if c.gather else "gemm_sm90_stock.cu"
        assert build.gemm_source(c) == source and not c.problems()
        assert c.gather <= (not c.block_scaled)
    with pytest.raises(ValueError, match="stock"):
        build.GemmConfig(dtype="bf16", stock=True)
    with pytest.raises(ValueError, match="stock"):
        build.GemmConfig(tile_k=128, dtype="e4m3", epilogue="tma", stock=True, scale_warp=True)
    # the epilogue tile width of a stock build (bench/gemm.py's product-enN): its own name and
    # macro; refused on other builds and where it does not divide the tile
    base = kernels.stock_configs(90)[0]
    wide = replace(base, stock_epi_n=64)
    assert build.config_name(wide) == build.config_name(base).replace("_stock", "_en64_stock")
    # kernels.is_stock asks the configuration a library was loaded from, not its name
    from types import SimpleNamespace

    class FakeLibrary:
        def __init__(self, path):
            self.path = path

        def load_kernels(self):
            pass

    monkeypatch.setattr(kernels, "_loaded", {})
    fake_runtime = SimpleNamespace(GemmLibrary=FakeLibrary)
    monkeypatch.setattr(kernels, "runtime_library", lambda: fake_runtime)
    monkeypatch.setattr(build, "build_gemm", lambda c: f"/cache/cuda/{build.config_name(c)}.so")
    for c in kernels.all_configs([90]) + [wide]:
        lib = kernels.gemm_library(c)
        assert kernels.gemm_library(c) is lib and kernels.config_of(lib) == c
        assert kernels.is_stock(lib) == c.stock, build.config_name(c)
    with pytest.raises(ValueError, match="gemm_library"):
        kernels.is_stock(FakeLibrary("/elsewhere/sm90_e4m3_stock-0.so"))
    assert "-DFO_STOCK_EPI_N=64" in build._gemm_job(wide).flags
    assert not any("FO_STOCK_EPI_N" in f for f in build._gemm_job(base).flags)
    for bad in (dict(stock_epi_n=48), dict(stock_epi_n=24)):
        with pytest.raises(ValueError, match="stock_epi_n"):
            replace(base, **bad)
    for other in (dict(), dict(dtype="e4m3", tile_k=128, epilogue="tma")):
        with pytest.raises(ValueError, match="stock_epi_n"):
            build.GemmConfig(stock_epi_n=64, **other)

    def plan(op="allreduce", m=1024, world=1, layout="rows", scaling=None, tile=(128, 128)):
        blocks = world if op == "reduce_scatter" else 1
        tiles = blocks * -(-(m // blocks) // tile[0]) * -(-1000 // tile[1])
        return Plan(m=m, n=1000, k=1000, op=op, world_size=world, dtype="float8_e4m3fn",
                    tile=tile, wave_size=128, schedule=Schedule("n", 2), group_sizes=(tiles,),
                    out_dtype="bfloat16", scaling=scaling, layout=layout)

    def scales(sa_strides, sb_strides, m=1024):
        sa = torch.empty_strided((m, 8), sa_strides)
        sb = torch.empty_strided((8, 8), sb_strides)
        return sa, sb

    for scaling in (None, "blockwise"):
        assert kernels.stock_fits(plan(scaling=scaling))
        assert not kernels.stock_fits(plan(scaling=scaling, layout="tiles"))
        assert not kernels.stock_fits(plan(scaling=scaling, tile=(128, 256)))
        assert kernels.stock_fits(plan("reduce_scatter", m=1024, world=4, scaling=scaling))
        assert not kernels.stock_fits(plan("reduce_scatter", m=1200, world=4, scaling=scaling))
    assert kernels.stock_fits(plan(scaling="blockwise"), scales((1, 1024), (1, 8)))
    assert not kernels.stock_fits(plan(scaling="blockwise"), scales((8, 1), (1, 8)))  # row-major a
    assert not kernels.stock_fits(plan(scaling="blockwise"), scales((1, 1032), (1, 8)))  # spaced
    assert not kernels.stock_fits(plan(scaling="blockwise"), scales((1, 8), (8, 1)))  # b's N major
    assert not kernels.stock_fits(plan(scaling="blockwise", m=1022),
                                  scales((1, 1022), (1, 8), m=1022))  # a TMA row stride
    assert kernels.stock_fits(plan(m=1022))  # (row-wise: no scale by TMA)
    assert not kernels.stock_fits(plan(scaling="blockwise", m=124))  # box wider than M
    # a reduce_scatter of one group has its tiles at their own rows (plan.slabs)
    # of the result; of two groups, each group's region holds every block's rows (not in place)
    for groups, fits in ((1, True), (2, False)):
        tiles = 2 * (4096 // 2 // 128) * 8  # 2 blocks of 16 bands of 8 column tiles
        rs = Plan(m=4096, n=1024, k=1000, op="reduce_scatter", world_size=2,
                  dtype="float8_e4m3fn", tile=(128, 128), wave_size=128,
                  schedule=Schedule("n", 2), group_sizes=(tiles,) if groups == 1 else
                  (tiles // 2, tiles // 2), out_dtype="bfloat16", layout="rows")
        assert kernels.stock_fits(rs) == fits, groups
    assert not kernels.stock_op("all_to_all") and kernels.stock_op("allgather")
    assert not kernels.stock_op("allgather", "blockwise")
    assert kernels.stock_op("allreduce") and kernels.stock_op("reduce_scatter")
    # allgather: the gathered shards (source blocks) of whole row tiles, in place (its items'
    # offsets are their own rows: gather_call.gather_items), tensor- or row-wise scales
    for m, world, fits in ((1024, 1, True), (1000, 1, True), (2048, 2, True), (8192, 4, True),
                           (2000, 2, False)):
        tiles = world * -(-(m // world) // 128) * -(-1000 // 128)
        for scaling in (None, "rowwise", "blockwise"):
            ag = Plan(m=m, n=1000, k=1000, op="allgather", world_size=world,
                      dtype="float8_e4m3fn", tile=(128, 128), wave_size=128,
                      schedule=Schedule("n", 4), group_sizes=(tiles,), out_dtype="bfloat16",
                      layout="rows", scaling=scaling)
            assert kernels.stock_fits(ag) == (fits and scaling != "blockwise"), (m, world)
        assert kernels.stock_call(spec(m=m, n=1000, k=1000, op="allgather", world_size=world,
                                       dtype="float8_e4m3fn", out_dtype="bfloat16")) == fits
    assert not kernels.stock_call(spec(op="allgather", world_size=2, dtype="float8_e4m3fn",
                                       out_dtype="bfloat16", scaling="blockwise"))
    # reduce_scatter: the same rule as stock_fits for its destinations' shards, every scaling
    for m, world, fits in ((1000, 1, True), (2048, 2, True), (8192, 4, True), (2000, 2, False),
                           (1152, 3, True), (1000, 2, False)):
        for scaling in (None, "rowwise", "blockwise"):
            assert kernels.stock_call(spec(m=m, n=1024, k=1024, op="reduce_scatter",
                                           world_size=world, dtype="float8_e4m3fn",
                                           out_dtype="bfloat16", scaling=scaling)) == fits
            if fits:
                tiles = world * -(-(m // world) // 128) * 8
                rs = Plan(m=m, n=1024, k=1024, op="reduce_scatter", world_size=world,
                          dtype="float8_e4m3fn", tile=(128, 128), wave_size=128,
                          schedule=Schedule("n", 2), group_sizes=(tiles,),
                          out_dtype="bfloat16", layout="rows", scaling=scaling)
                assert kernels.stock_fits(rs), (m, world, scaling)


def test_stock_plans_take_chunks_of_four_bands(monkeypatch):
    """An fp8 plan of the stock builds' tile (128x128) whose op may run them visits its tiles in
    chunks of 4 bands (STOCK_BANDS); other tiles, dtypes and ops keep 8 (DEFAULT_BANDS), and the
    planner still halves either where the groups need more strips."""
    monkeypatch.setenv(ENV_ARCH, "90")
    backend = CudaBackend()
    fp8 = dict(dtype="float8_e4m3fn", out_dtype="bfloat16")
    assert backend.schedule(spec(**fp8), (128, 128)) == Schedule("n", kernels.STOCK_BANDS) \
        == Schedule("n", 4)
    assert backend.schedule(spec(**fp8, scaling="blockwise"), (128, 128)) == Schedule("n", 4)
    assert backend.schedule(spec(op="reduce_scatter", world_size=2, **fp8), (128, 128)) \
        == Schedule("n", 4)
    # allgather: tensor-/row-wise over shards of whole row tiles (kernels.stock_call)
    assert backend.schedule(spec(op="allgather", world_size=2, **fp8), (128, 128)) \
        == Schedule("n", 4)
    for other in (backend.schedule(spec(**fp8), (128, 256)), backend.schedule(spec(**fp8)),
                  backend.schedule(spec(), (128, 128)),
                  backend.schedule(spec(op="allgather", world_size=2, m=200, **fp8), (128, 128)),
                  backend.schedule(spec(op="allgather", world_size=2, scaling="blockwise", **fp8),
                                   (128, 128))):
        assert other == Schedule("n", kernels.DEFAULT_BANDS) == Schedule("n", 8)
    from flashoverlap_core.planning import make_plan

    def default_plan(m, **kw):
        return make_plan(backend, spec(m=m, n=8192, k=2048, **kw), (128, 128), wave_size=128)

    big = default_plan(16384, **fp8)
    assert big.schedule == Schedule("n", 4) and big.layout == "rows"
    assert default_plan(1024, **fp8).schedule == Schedule("n", 2)  # halved: the groups' strips
    assert default_plan(16384).schedule == Schedule("n", 8)


def test_blockwise_fp8_plans_pick_the_block_scaled_build(monkeypatch, backend):
    """A block-wise spec gets a block-scaled tile (128x256, or 128x128 where 128x256's
    ragged waves cost more: BLOCK_TILE_COST), its plans name their scaling, other tiles are
    refused for it, and its build defines FO_FP8_BLOCK; sm80 declines block-wise fp8 saying
    so."""
    monkeypatch.setenv(ENV_ARCH, "90")
    monkeypatch.delenv(kernels.ENV_EPILOGUE, raising=False)
    # gemm_sm90.cu's 128x128 (BLOCK_TILE_COST) where the call cannot take the stock build
    # (allgather's waiting GEMM)
    spec = fp8_spec(m=4096, n=4096, k=4096, scaling="blockwise", op="allgather")
    assert kernels.default_tile(90, spec, 128) == (128, 256)  # 4 whole waves of 128x256
    # 32 tiles of 128x256 are one wave that half the SMs run: 64 of 128x128 take as long, at
    # half the work each
    small = fp8_spec(m=256, n=4096, k=4096, scaling="blockwise", op="allgather")
    assert kernels.default_tile(90, small, 128) == (128, 128)
    # 5120x5120: 6.25 waves of 128x256 (7) against 12.5 of 128x128 (13 x 0.5 x 1.07 = 6.96)
    assert kernels.default_tile(90, fp8_spec(m=5120, n=5120, k=4096, scaling="blockwise",
                                             op="allgather"), 128) == (128, 128)
    # 6144x3584 at K = 2048: 5.25 waves of 128x256 (6) against 10.5 (11 x 0.5 x 1.11 = 6.1)
    assert kernels.default_tile(90, fp8_spec(m=6144, n=3584, k=2048, scaling="blockwise",
                                             op="allgather"), 128) == (128, 256)
    # the stock 128x128 build (STOCK_BLOCK_TILE_COST) where the call can take it: at K = 4096
    # 8 waves x 0.5 x 0.97 = 3.88 against 4 of 128x256; at K = 1024, 8 x 0.5 x 1.04 = 4.16
    assert kernels.default_tile(90, fp8_spec(m=4096, n=4096, k=4096, scaling="blockwise"),
                                128) == (128, 128)
    assert kernels.default_tile(90, fp8_spec(m=4096, n=4096, k=1024, scaling="blockwise"),
                                128) == (128, 256)
    # the 16-bit costs do not apply: 128x224 and 128x160 have no block-scaled build
    assert kernels.default_tile(90, fp8_spec(m=4096, n=7168, k=4096, scaling="blockwise"),
                                128) in kernels.FP8_BLOCK_CONFIGS[90]
    cfg = kernels.gemm_config(90, (128, 128), "float8_e4m3fn", True, (2, 1), out_dtype="bfloat16",
                              scaling="blockwise")
    assert (cfg.block_scaled, cfg.schedule, cfg.tile_k, cfg.epilogue) == (
        True, "cooperative", 128, "tma")
    assert "-DFO_FP8_BLOCK=1" in build.gemm_defines(cfg)
    assert not any(d.startswith("-DFO_FP8_BLOCK") for d in build.gemm_defines(
        kernels.gemm_config(90, (128, 128), "float8_e4m3fn", True, (2, 1))))
    assert kernels.supported_tiles(90, "blockwise") == {(128, 128), (128, 256)}
    assert kernels.default_block_tile(90) == (128, 256)  # 128x128 where its waves cost less
    wide = kernels.gemm_config(90, (128, 256), "float8_e4m3fn", True, (2, 1),
                               out_dtype="bfloat16", scaling="blockwise")
    assert (wide.block_scaled, wide.tile_n, wide.tile_k, wide.schedule) == (
        True, 256, 128, "cooperative")
    assert kernels.supported_tiles(80, "blockwise") == set()
    assert any(c.block_scaled for c in build.CHECK_CONFIGS)
    assert any(c.block_scaled for c in build.SELFTEST_CONFIGS)
    build.GemmConfig(tile_k=128, dtype="e4m3", block_scaled=True)  # 128x256: two column blocks
    for bad in (dict(tile_n=224), dict(tile_n=128, schedule="pingpong"), dict(tile_k=64),
                dict(tile_m=64, tile_n=128)):
        with pytest.raises(ValueError, match="block_scaled needs the cooperative schedule"):
            build.GemmConfig(**{"tile_k": 128, "dtype": "e4m3", "block_scaled": True, **bad})
    with pytest.raises(ValueError, match="block_scaled, scale_tma and scale_warp apply to e4m3 builds"):
        build.GemmConfig(tile_n=128, tile_k=128, block_scaled=True)
    # scale_a by the scale warp's cp.async only (FO_SCALE_TMA=0): a build of its own
    cpa = build.GemmConfig(tile_n=128, tile_k=128, dtype="e4m3", block_scaled=True,
                           epilogue="tma", scale_tma=False)
    assert build.config_name(cpa).endswith("_block128_cpa_etma"), build.config_name(cpa)
    assert "-DFO_SCALE_TMA=0" in build.gemm_defines(cpa)
    assert not any("FO_SCALE_TMA" in f for f in build.gemm_defines(replace_config(cpa, scale_tma=True)))
    with pytest.raises(ValueError, match="scale_tma=False applies to block_scaled builds"):
        build.GemmConfig(tile_k=128, dtype="e4m3", scale_tma=False)
    # run by default; FLASHOVERLAP_CUDA_FP8_BLOCK=0 declines it (block-wise calls then run
    # dequantized)
    monkeypatch.delenv("FLASHOVERLAP_CUDA_FP8_BLOCK", raising=False)
    assert not backend.unsupported_reasons(spec), backend.unsupported_reasons(spec)
    monkeypatch.setenv("FLASHOVERLAP_CUDA_FP8_BLOCK", "0")
    assert any("turns the block-scaled" in r for r in backend.unsupported_reasons(spec))
    monkeypatch.setenv("FLASHOVERLAP_CUDA_FP8_BLOCK", "1")
    assert not backend.unsupported_reasons(spec), backend.unsupported_reasons(spec)
    monkeypatch.setenv(ENV_ARCH, "80")
    reasons = backend.unsupported_reasons(spec)
    assert any("block-wise scales" in r and "sm_90a" in r for r in reasons), reasons


@pytest.mark.parametrize("fields, complaint", [
    (dict(dtype="e4m3", tile_k=128, arch=80, cluster_m=1, schedule="multistage"), "e4m3 needs sm90"),
    (dict(dtype="e4m3", tile_k=128, b_col_major=False), "e4m3 b must be column-major"),
    (dict(dtype="e4m3", tile_k=48), "multiple of 32"),
    (dict(dtype="e4m3", tile_k=128, out_dtype="e4m3"), "e4m3 out_dtype must be one of"),
    (dict(out_dtype="fp16"), "out_dtype is for e4m3 builds"),
    (dict(fast_accum=False), "fast_accum applies to e4m3 builds"),
])
def test_invalid_fp8_configurations_say_what_is_wrong(fields, complaint):
    with pytest.raises(ValueError, match="invalid GEMM config") as refused:
        build.GemmConfig(**fields)
    assert complaint in str(refused.value)


def test_fp8_config_names_and_defines():
    fast = build.GemmConfig(tile_k=128, dtype="float8_e4m3fn", out_dtype="float16")
    assert build.config_name(fast) == "sm90_e4m3_fp16_bcol_128x256x128_c2x1_cooperative"
    assert {"-DFO_DTYPE=2", "-DFO_OUT_DTYPE=1", "-DFO_FP8_FAST_ACCUM=1"} <= set(build.gemm_defines(fast))
    split = replace_config(fast, fast_accum=False, out_dtype="bf16")
    assert build.config_name(split) == "sm90_e4m3_bf16_bcol_128x256x128_c2x1_cooperative_splitacc"
    assert {"-DFO_OUT_DTYPE=0", "-DFO_FP8_FAST_ACCUM=0"} <= set(build.gemm_defines(split))
    # 16-bit builds keep their flags (and so their cached objects' names and digests)
    assert not any(d.startswith(("-DFO_OUT_DTYPE", "-DFO_FP8")) for d in build.gemm_defines(build.GemmConfig()))
    assert build.GemmConfig(dtype="fp16").out_dtype == "fp16"
    assert build.GemmConfig(tile_k=128, dtype="e4m3").out_dtype == "bf16"  # the API's default
    assert any(c.dtype == "e4m3" for c in build.CHECK_CONFIGS)
    assert any(c.dtype == "e4m3" for c in build.SELFTEST_CONFIGS)


def replace_config(cfg, **kw):
    from dataclasses import replace
    return replace(cfg, **kw)


def test_fp8_scales_as_the_kernel_reads_them(monkeypatch):
    from types import SimpleNamespace

    from flashoverlap_backends.cuda.device_state import gemm_scales, kernel_scale

    column = torch.rand(6, 3)[:, 1:2]  # [6, 1], stride 3: copied
    assert kernel_scale(column) is not column and kernel_scale(column).stride(0) == 1
    for t in (torch.rand(()), torch.rand(6, 1), torch.rand(1, 5), torch.rand(5, 2)[:1, :1]):
        assert kernel_scale(t) is t
    # the runtime's GemmScales(a, b, a_per_row, b_per_col) (tests/test_cuda_binding_cpu.py)
    fields = lambda a, b, a_per_row, b_per_col, a_stride, b_stride: SimpleNamespace(**locals())  # noqa: E731
    monkeypatch.setattr(kernels, "runtime_library", lambda: SimpleNamespace(GemmScales=fields))
    s = gemm_scales(torch.rand(6, 1), torch.rand(()))
    assert (s.a_per_row, s.b_per_col) == (1, 0) and s.a and s.b
    # block-wise: read in place through their strides (torch's outer-dim-major scale_a,
    # weight_scale.t()), mode FO_SCALE_BLOCKS (2) and the strides in elements
    sa, sb = torch.rand(3, 6).t(), torch.rand(2, 3).t()
    assert kernel_scale(sa, True) is sa and kernel_scale(sb, True) is sb
    s = gemm_scales(sa, sb, blockwise=True)
    assert (s.a_per_row, s.b_per_col, s.a_stride, s.b_stride) == (2, 2, (1, 6), (1, 3))


def test_ci_compile_check_configurations():
    """CI compiles five representative GEMM builds: an sm90 16-bit one, an sm90 e4m3 scaled
    one, an sm80 one with unequal destination blocks, fp8 all_to_all's block-scaled one and the
    stock fp8 pingpong one (each its own source; named by index into CHECK_CONFIGS)."""
    names = [build.config_name(c) for c in build.CI_CHECK_CONFIGS]
    assert names[0].startswith("sm90_fp16_brow_128x128") and "pingpong" in names[0], names
    assert names[1].startswith("sm90_e4m3_") and "cooperative_scw" in names[1], names
    assert names[2].startswith("sm80_fp16_brow") and names[2].endswith("_blocks"), names
    assert names[3].startswith("sm90_e4m3_") and "_block128_" in names[3], names
    assert names[3].endswith("_blocks"), names
    assert build.gemm_source(build.CI_CHECK_CONFIGS[3]) == "gemm_sm90_blocks_scaled.cu"
    assert names[4].endswith("_pingpong_etma_stock"), names
    assert build.gemm_source(build.CI_CHECK_CONFIGS[4]) == "gemm_sm90_stock.cu"


@pytest.mark.parametrize("variable, reader", [("FLASHOVERLAP_WATCHDOG", "watchdog_enabled"),
                                              ("FLASHOVERLAP_NCCL_CAPTURE_COMM", "capture_twin")])
def test_nccl_switches_are_checked(monkeypatch, variable, reader):
    """FlashOverlap's NCCL watchdog (a dead peer must not hang the survivors) and the capture
    twin of each communicator (graph replays and eager calls never share one: NCCL may then
    run a rank's work out of order): both on by default; 0 turns one off, an empty value is the
    default; anything but 0 or 1 is refused with the variable's name."""
    from flashoverlap_backends.cuda import nccl

    read = getattr(nccl, reader)
    monkeypatch.delenv(variable, raising=False)
    assert read()
    monkeypatch.setenv(variable, "")
    assert read()
    monkeypatch.setenv(variable, "0")
    assert not read()
    monkeypatch.setenv(variable, "1")
    assert read()
    monkeypatch.setenv(variable, "yes")
    with pytest.raises(ValueError, match=variable):
        read()


# ---- the SMs left to the collectives ---------------------------------------------------------

def test_reserved_sms_and_nccl_ctas_defaults(monkeypatch):
    """The persistent signaling GEMM leaves 4 SMs free at world size 1 and 24 above; the
    overlapped calls' NCCL kernels take at most that many CTAs at world size > 1 ("auto"), or
    NCCL's own choice ("0"), or a number; bad values name the variable."""
    from flashoverlap_backends.cuda import device_state as ds

    monkeypatch.delenv(ds.ENV_RESERVED_SMS, raising=False)
    monkeypatch.delenv(ds.ENV_NCCL_CTAS, raising=False)
    assert (ds.reserved_sms(1), ds.reserved_sms(2), ds.reserved_sms(8)) == (4, 24, 24)
    assert ds.overlap_nccl_ctas(2) == 24
    assert ds.overlap_nccl_ctas(1) is None  # a group of one: the plain path's communicator
    monkeypatch.setenv(ds.ENV_RESERVED_SMS, "16")
    assert (ds.reserved_sms(1), ds.reserved_sms(4), ds.overlap_nccl_ctas(4)) == (16, 16, 16)
    monkeypatch.setenv(ds.ENV_NCCL_CTAS, "0")
    assert ds.overlap_nccl_ctas(2) is None
    monkeypatch.setenv(ds.ENV_NCCL_CTAS, "12")
    assert ds.overlap_nccl_ctas(2) == 12
    for name, value in ((ds.ENV_NCCL_CTAS, "many"), (ds.ENV_RESERVED_SMS, "-1")):
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=name):
            ds.overlap_nccl_ctas(2)
        monkeypatch.delenv(name)


def test_stock_plans_take_the_epilogue_tile_of_their_k(monkeypatch):
    """gemm_for (what every call path launches) asks for the stock build with the epilogue
    tile of the plan's K (kernels.stock_epi_n): 64 columns below STOCK_WIDE_EPILOGUE_K
    (allgather's waiting build too), CUTLASS's own from there on and for block-wise plans."""
    from flashoverlap_backends.cuda.device_state import PlanTables
    from flashoverlap_backends.cuda.gemm import Gemms
    from flashoverlap_core.plan import Plan
    from flashoverlap_core.tiles import Schedule

    monkeypatch.setenv(ENV_ARCH, "90")
    monkeypatch.setattr(kernels, "gemm_library", lambda config: config)
    for k, scaling, gather, want in ((1024, None, False, 64), (1536, "rowwise", True, 64),
                                     (4096, "rowwise", False, 0), (1024, "blockwise", False, 0)):
        plan = Plan(m=1024, n=1024, k=k, op="allreduce", world_size=1, dtype="float8_e4m3fn",
                    tile=(128, 128), wave_size=128, schedule=Schedule("n", 4),
                    group_sizes=(64,), out_dtype="bfloat16", layout="rows", scaling=scaling)
        items, groups = plan.item_table()
        tables = PlanTables(items, items, groups, torch.zeros(1, dtype=torch.int32))
        b = torch.empty(1024, k, dtype=torch.float8_e4m3fn).t()
        config, col, gpu = Gemms.gemm_for(plan, tables, b, gather=gather)
        assert config.stock and col and gpu == 90, (k, scaling)
        assert config.stock_epi_n == want and config.gather == gather, (k, scaling)
