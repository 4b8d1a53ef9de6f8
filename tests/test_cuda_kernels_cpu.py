"""CPU tests of the cuda backend's kernel table and build rules (no GPU, no nvcc needed), and,
with FLASHOVERLAP_COMPILE_TESTS=1 and nvcc, the sm90 epilogue layout self-tests (host programs
built from csrc/cuda/gemm_sm90_selftest.cu: a minute or more each)."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from flashoverlap_backends.cuda import build, kernels
from flashoverlap_backends.cuda.build import GemmConfig

ROOT = Path(__file__).resolve().parents[1]


# ---- configurations ----------------------------------------------------------------------------

def test_epilogues_are_validated_per_architecture():
    GemmConfig(epilogue="tma")
    GemmConfig(epilogue="tma", epi_slots=4)
    build.default_config(80, epilogue="staged")
    with pytest.raises(ValueError, match="epilogue for sm90"):
        GemmConfig(epilogue="staged")
    with pytest.raises(ValueError, match="epilogue for sm80"):
        build.default_config(80, epilogue="tma")
    with pytest.raises(ValueError, match="epi_slots applies to the tma epilogues only"):
        GemmConfig(epi_slots=2)
    # tma_wg (the math threads store and signal): the tma epilogue's slots, 32-column blocks
    wg = GemmConfig(tile_n=128, schedule="pingpong", epilogue="tma_wg", epi_slots=4)
    assert wg.column_blocks == 4 and build.gemm_defines(wg).count("-DFO_EPILOGUE=4") == 1
    with pytest.raises(ValueError, match="epi_slots in"):
        GemmConfig(tile_n=128, schedule="pingpong", epilogue="tma_wg", epi_slots=5)
    with pytest.raises(ValueError, match="tile_n % 32"):
        GemmConfig(tile_n=80, epilogue="tma")
    with pytest.raises(ValueError, match="epi_slots in"):
        GemmConfig(tile_n=128, schedule="pingpong", epilogue="tma", epi_slots=3)
    # widths that are not multiples of 64 store 32-column blocks: 7 of them at 224
    assert [GemmConfig(tile_n=n, epilogue="tma").column_blocks for n in (256, 224, 160, 128)] == [
        4, 7, 5, 2]
    GemmConfig(tile_n=224, epilogue="tma", epi_slots=7)
    with pytest.raises(ValueError, match="epi_slots in"):
        GemmConfig(tile_n=224, epilogue="tma", epi_slots=8)


def test_config_names_and_defines_carry_the_epilogue():
    plain = GemmConfig()
    assert build.config_name(plain) == "sm90_bf16_bcol_128x256x64_c2x1_cooperative"
    assert "-DFO_EPILOGUE=0" in build.gemm_defines(plain)
    tma = GemmConfig(epilogue="tma", epi_slots=4)
    assert build.config_name(tma).endswith("_etma4")
    assert {"-DFO_EPILOGUE=1", "-DFO_EPI_SLOTS=4"} <= set(build.gemm_defines(tma))
    assert not any(d.startswith("-DFO_EPI_SLOTS") for d in build.gemm_defines(GemmConfig(epilogue="tma")))
    staged = build.default_config(80, epilogue="staged")
    assert build.config_name(staged).endswith("_estaged")
    names = {build.config_name(c) for c in (plain, tma, replace(tma, epi_slots=0), staged)}
    assert len(names) == 4  # distinct builds, distinct cache files
    blocks = replace(tma, cluster_m=1, blocks=True)
    assert build.config_name(blocks).endswith("_etma4_blocks")
    assert "-DFO_BLOCKS=1" in build.gemm_defines(blocks)
    assert not any("FO_BLOCKS" in d for d in build.gemm_defines(tma))


def test_all_to_all_has_its_own_builds_of_every_tile(monkeypatch):
    """Unequal destination blocks take builds of their own (the plain builds' producer warps
    keep their registers), prebuilt for every tile default_tile may pick, with 1x1 clusters."""
    monkeypatch.delenv(kernels.ENV_EPILOGUE, raising=False)
    for arch, tiles in ((90, set(kernels.CONFIGS[90])), (80, {kernels.DEFAULT_TILE[80]})):
        made = [c for c in kernels.all_configs([arch])
                if c.blocks and c.dtype not in build.FP8_DTYPES]  # (fp8's: the next test)
        assert {(c.tile, c.cluster_m, c.cluster_n) for c in made} == {(t, 1, 1) for t in tiles}
        assert len(made) == len(tiles) * len(kernels.DTYPES) * 2  # tiles x dtypes x layouts of b
        for tile in tiles:
            assert kernels.gemm_config(arch, tile, "bfloat16", True, blocks=True) in made


def test_fp8_all_to_all_has_its_own_builds_from_their_own_source(monkeypatch):
    """fp8 all_to_all (issue 32): e4m3 builds for unequal blocks (1x1 clusters, b column-major)
    of every fp8 tile and either result dtype, tensor-/row-wise and block-wise, prebuilt; they
    alone compile gemm_sm90_blocks_scaled.cu (gemm_sm90.cu plus fo_gemm_run_blocks_scaled), so
    every other build keeps its source, and its cached object."""
    monkeypatch.delenv(kernels.ENV_EPILOGUE, raising=False)
    made = [c for c in kernels.all_configs([90]) if c.blocks and c.dtype in build.FP8_DTYPES]
    tiles = set(kernels.FP8_CONFIGS[90])
    block_tiles = set(kernels.FP8_BLOCK_CONFIGS[90])  # every tile default_tile may pick
    assert {(c.tile, c.block_scaled, c.out_dtype, c.cluster_m, c.cluster_n, c.b_col_major)
            for c in made} == (
        {(t, False, out, 1, 1, True) for t in tiles for out in ("bf16", "fp16")}
        | {(t, True, out, 1, 1, True) for t in block_tiles for out in ("bf16", "fp16")})
    assert not [c for c in kernels.all_configs([80]) if c.dtype in build.FP8_DTYPES]
    for config in made:
        assert build.gemm_source(config) == "gemm_sm90_blocks_scaled.cu"
        job = build._gemm_job(config)
        assert job.sources == ("gemm_sm90_blocks_scaled.cu",)
        assert "-DFO_BLOCKS=1" in job.flags and "-DFO_DTYPE=2" in job.flags
        assert build.config_name(config).endswith("_blocks")
    names = {p.name for p in build._sources("gemm_sm90_blocks_scaled.cu")}
    assert {"gemm_sm90.cu", "gemm_blocks_scaled.h", "gemm_api.h"} <= names
    assert "flashoverlap_cuda.h" not in names  # the runtime's API: not the GEMM libraries'
    for config in [c for c in kernels.all_configs([90, 80])
                   if c not in made and not c.gather and not c.stock]:
        assert build.gemm_source(config) in ("gemm_sm90.cu", "gemm_sm80.cu"), config
    assert "gemm_blocks_scaled.h" not in {p.name for p in build._sources("gemm_sm90.cu")}
    block = kernels.gemm_config(90, (128, 128), "float8_e4m3fn", True, blocks=True,
                                scaling="blockwise")
    assert (block.block_scaled, block.schedule, block.tile_k) == (True, "cooperative", 128)


def test_fp8_allgather_has_its_own_builds_from_their_own_source(monkeypatch):
    """fp8 allgather (issue 32): e4m3 builds for allgather (gather=True) of every fp8 tile,
    either result dtype and both clusters (as a 16-bit allgather takes the plain builds),
    tensor-/row-wise and block-wise, prebuilt; they alone compile gemm_sm90_ex_scaled.cu
    (gemm_sm90.cu plus fo_gemm_run_ex_scaled) with the flags of the same build without gather,
    so no other build's name, flags, source or cached object changes."""
    monkeypatch.delenv(kernels.ENV_EPILOGUE, raising=False)
    made = [c for c in kernels.all_configs([90]) if c.gather and not c.stock]
    outs = ("bf16", "fp16")
    clusters = lambda tile: {kernels.preferred_cluster(90, tile), (1, 1)}  # noqa: E731
    assert {(c.tile, c.block_scaled, c.out_dtype, (c.cluster_m, c.cluster_n), c.b_col_major,
             c.blocks) for c in made} == (
        {(t, False, out, cl, True, False) for t in kernels.FP8_CONFIGS[90] for out in outs
         for cl in clusters(t)}
        | {(t, True, out, cl, True, False) for t in kernels.FP8_BLOCK_CONFIGS[90]
           for out in outs for cl in clusters(t)})
    assert len(made) == 16 and not [c for c in kernels.all_configs([80]) if c.gather]
    others = [c for c in kernels.all_configs([90, 80]) if not c.gather]
    for config in made:
        plain = replace(config, gather=False)
        assert plain in others  # the same build without fo_gemm_run_ex_scaled is made too
        job, plain_job = build._gemm_job(config), build._gemm_job(plain)
        assert job.sources == ("gemm_sm90_ex_scaled.cu",)
        assert job.flags == plain_job.flags and "-DFO_DTYPE=2" in job.flags
        assert job.name == plain_job.name + "_gather"
        assert build._digest(job) != build._digest(plain_job)
    names = {p.name for p in build._sources("gemm_sm90_ex_scaled.cu")}
    assert {"gemm_sm90.cu", "gemm_ex_scaled.h", "gemm_api.h"} <= names
    assert "flashoverlap_cuda.h" not in names and "gemm_blocks_scaled.h" not in names
    for source in ("gemm_sm90.cu", "gemm_sm80.cu", "gemm_sm90_blocks_scaled.cu"):
        assert "gemm_ex_scaled.h" not in {p.name for p in build._sources(source)}, source
    # on CUTLASS's kernel (tensor-/row-wise: kernels.stock_op): gemm_sm90_stock_ex_scaled.cu,
    # the stock build's flags, named _gather_stock
    stock = [c for c in kernels.all_configs([90]) if c.gather and c.stock]
    assert {(c.out_dtype, (c.cluster_m, c.cluster_n), c.schedule, c.block_scaled)
            for c in stock} == {(out, cl, "pingpong", False) for out in outs
                                for cl in ((2, 1), (1, 1))}
    for config in stock:
        plain = replace(config, gather=False)
        job, plain_job = build._gemm_job(config), build._gemm_job(plain)
        assert plain in others and job.sources == ("gemm_sm90_stock_ex_scaled.cu",)
        assert job.flags == plain_job.flags
        assert job.name == plain_job.name.replace("_stock", "_gather_stock")
    names = {p.name for p in build._sources("gemm_sm90_stock_ex_scaled.cu")}
    assert {"gemm_sm90_stock.cu", "gemm_ex_scaled.h", "gemm_api.h"} <= names
    assert "gemm_ex_scaled.h" not in {p.name for p in build._sources("gemm_sm90_stock.cu")}
    made += stock
    assert len({build.config_name(c) for c in others + made}) == len(others) + len(made)
    # gather=True is fp8's alone: a 16-bit allgather runs the plain build's fo_gemm_run_ex
    for dtype in kernels.DTYPES:
        assert kernels.gemm_config(90, (128, 256), dtype, True, (2, 1), gather=True) == \
            kernels.gemm_config(90, (128, 256), dtype, True, (2, 1))
    fp8 = kernels.gemm_config(90, (128, 128), "float8_e4m3fn", True, (2, 1), gather=True,
                              scaling="blockwise")
    assert (fp8.gather, fp8.block_scaled) == (True, True)
    with pytest.raises(ValueError, match="gather applies to e4m3 builds"):
        GemmConfig(gather=True)
    with pytest.raises(ValueError, match="not both"):
        GemmConfig(tile_k=128, cluster_m=1, dtype="e4m3", blocks=True, gather=True)


def test_every_table_entry_makes_valid_configs(monkeypatch):
    monkeypatch.delenv(kernels.ENV_EPILOGUE, raising=False)
    for arch, entries in kernels.CONFIGS.items():
        assert kernels.DEFAULT_TILE[arch] in entries
        for tile, kernel in entries.items():
            for dtype in kernels.DTYPES:
                for col in (True, False):
                    for cluster in {kernel.cluster, (1, 1)}:
                        cfg = kernels.gemm_config(arch, tile, dtype, col, cluster)
                        assert cfg.tile == tile and cfg.epilogue == kernel.epilogue
                        assert cfg.epi_slots == (kernel.tma_slots if cfg.epilogue == "tma" else 0)
    assert kernels.all_configs([90, 80])


def test_default_epilogues_are_the_measured_ones(monkeypatch):
    monkeypatch.delenv(kernels.ENV_EPILOGUE, raising=False)
    coop = kernels.gemm_config(90, (128, 256), "bfloat16", True, (2, 1))
    assert (coop.epilogue, coop.epi_slots) == ("tma", 4)
    assert kernels.gemm_config(90, (128, 128), "float16", False).epilogue == "tma"
    assert kernels.gemm_config(80, (128, 128), "bfloat16", True).epilogue == "staged"
    monkeypatch.setenv(kernels.ENV_EPILOGUE, "direct")  # the original stays selectable
    assert kernels.gemm_config(90, (128, 256), "bfloat16", True).epi_slots == 0
    assert {kernels.gemm_config(a, t, "bfloat16", True).epilogue
            for a, t in ((90, (128, 256)), (80, (128, 128)))} == {"direct"}


def _spec(m, n, k, op="allreduce", world_size=1, send_splits=None):
    from flashoverlap_core.backend import OverlapSpec

    return OverlapSpec(m, n, k, op, world_size, "bfloat16", "cuda", "col", send_splits)


def test_narrower_tile_where_the_last_wave_is_ragged():
    # The ragged shapes of bench/gemm.py: 128x256 tiles leave a last wave a quarter full (800
    # and 672 tiles on 128 CTAs); 128x160 (5120 = 32 x 160) and 128x224 (3584 = 16 x 224,
    # 7168 = 32 x 224) fill whole waves there.
    assert kernels.default_tile(90, _spec(5120, 5120, 4096), 128) == (128, 160)
    for m, n, k in ((3072, 7168, 4096), (6144, 3584, 2048)):
        assert kernels.default_tile(90, _spec(m, n, k), 128) == (128, 224)
    for m, n, k in ((4096, 4096, 4096), (16384, 8192, 1024), (2560, 6400, 4096), (12288, 4096, 1536),
                    (8192, 8192, 256), (2048, 4096, 4096)):
        assert kernels.default_tile(90, _spec(m, n, k), 128) == (128, 256)
    # pingpong's 128x128 where its half-size tiles fill the waves best: 5120 x 6144 x 4096 is
    # 1920 tiles of 128x128 (15 waves of half the work), 960 of 128x256 (7.5 -> 8 waves), 1120
    # of 128x224 (8.75 -> 9 of 7/8 the work), 1560 of 128x160 (12.2 -> 13 of 5/8)
    assert kernels.default_tile(90, _spec(5120, 6144, 4096), 128) == (128, 128)
    # a single partial wave: the smallest tile, for its parallelism
    assert kernels.default_tile(90, _spec(64, 8192, 4096), 128) == (128, 128)
    # fp8 takes its own kernels' tiles only (no 128x224 / 128x160 builds)
    fp8 = replace(_spec(6144, 3584, 2048), dtype="float8_e4m3fn", out_dtype="bfloat16")
    assert kernels.default_tile(90, fp8, 128) == (128, 128)
    assert (128, 224) not in kernels.supported_tiles(90, None, "float8_e4m3fn")
    # Waves count per destination block: 8 blocks of 640 rows at N=5120 -> 800 tiles again.
    assert kernels.default_tile(90, _spec(5120, 5120, 4096, "reduce_scatter", 8), 128) == (128, 160)
    assert kernels.default_tile(90, _spec(8192, 8192, 4096, "reduce_scatter", 8), 128) == (128, 256)
    assert kernels.default_tile(90) == kernels.DEFAULT_TILE[90]  # no call: the default
    # all_to_all: without a hint of the rows (they change every call) the default tile; with
    # the key's expected rows per rank, cut evenly over the destinations, the same rule
    for m in (1, 4096, 5120):
        assert kernels.default_tile(90, _spec(m, 5120, 4096, "all_to_all", 1), 128) == (128, 256)
    def a2a(rows, n, k, world):
        spec = replace(_spec(world, n, k, "all_to_all", world), rows_hint=rows)
        return kernels.default_tile(90, spec, 128)
    # 1024 rows at N = 5120: 160 tiles of 128x256 (2 waves, the second a quarter full), 256 of
    # 128x160 (2 whole waves of 5/8 the work), 320 of 128x128 (3 waves of half)
    assert a2a(1024, 5120, 3456, 1) == (128, 160)
    assert a2a(5120, 5120, 4096, 1) == (128, 160)
    assert a2a(4096, 4096, 4096, 1) == (128, 256)
    assert a2a(16384, 8192, 1024, 1) == (128, 256)
    # 8 destinations of 640 rows (5 bands each) at N=5120: 800 tiles of 128x256 -> 7 waves
    assert a2a(5120, 5120, 4096, 8) == (128, 160)
    assert a2a(0, 5120, 4096, 8) == (128, 256)  # no rows: nothing to weigh
    assert kernels.default_tile(80, _spec(5120, 5120, 4096), 128) == kernels.DEFAULT_TILE[80]
    assert kernels.pingpong_cost(100) == kernels.PINGPONG_COST[0][1]
    assert kernels.pingpong_cost(3000) == dict(kernels.PINGPONG_COST)[2048]


def test_prebuild_covers_every_tile_a_default_plan_picks(monkeypatch):
    monkeypatch.delenv(kernels.ENV_EPILOGUE, raising=False)
    tiles = {(c.arch, c.tile) for c in kernels.all_configs([90, 80])}
    assert tiles == {(90, t) for t in kernels.CONFIGS[90]} | {(80, kernels.DEFAULT_TILE[80])}
    assert {(90, (128, 224)), (90, (128, 160))} <= tiles
    fp8 = {c.tile for c in kernels.all_configs([90]) if c.dtype in build.FP8_DTYPES}
    assert fp8 == set(kernels.FP8_CONFIGS[90]) | set(kernels.FP8_BLOCK_CONFIGS[90])


def test_environment_selects_the_epilogue(monkeypatch):
    monkeypatch.setenv(kernels.ENV_EPILOGUE, "tma,staged")
    coop = kernels.gemm_config(90, (128, 256), "bfloat16", True, (2, 1))
    assert (coop.epilogue, coop.epi_slots) == ("tma", kernels.CONFIGS[90][(128, 256)].tma_slots)
    assert kernels.gemm_config(80, (128, 128), "float16", False).epilogue == "staged"
    monkeypatch.setenv(kernels.ENV_EPILOGUE, "vec16")
    vec = kernels.gemm_config(90, (128, 256), "bfloat16", True)
    assert (vec.epilogue, vec.epi_slots) == ("vec16", 0)  # slots belong to the tma epilogue
    assert kernels.gemm_config(80, (128, 128), "bfloat16", True).epilogue == kernels.CONFIGS[80][(128, 128)].epilogue
    for bad in ("tmaa", "none"):  # "none" writes no full tile: for measurements only
        monkeypatch.setenv(kernels.ENV_EPILOGUE, bad)
        with pytest.raises(ValueError, match="unknown epilogue"):
            kernels.gemm_config(90, (128, 256), "bfloat16", True)


# ---- sources and digests -------------------------------------------------------------------------

def _copy_sources(tmp_path, monkeypatch) -> Path:
    src = tmp_path / "cuda"
    shutil.copytree(build.source_dir(), src)
    monkeypatch.setattr(build, "source_dir", lambda: src)
    return src


def test_a_job_hashes_its_source_and_the_headers_it_includes(tmp_path, monkeypatch):
    src = _copy_sources(tmp_path, monkeypatch)
    names = {p.name for p in build._sources("gemm_sm90.cu")}
    assert {"gemm_sm90.cu", "epilogue.cuh", "gemm_abi.cuh", "common.cuh", "gemm_api.h"} <= names
    assert "runtime.cu" not in names and "gemm_sm80.cu" not in names
    assert "flashoverlap_cuda.h" not in names  # the runtime's API: not the GEMM libraries'
    gemm_job, runtime_job = build._gemm_job(GemmConfig()), build.RUNTIME_JOB
    before = build._digest(gemm_job), build._digest(runtime_job)
    for runtime_file in ("runtime.cu", "flashoverlap_cuda.h"):
        (src / runtime_file).write_text((src / runtime_file).read_text() + "\n// edit\n")
        assert build._digest(gemm_job) == before[0]  # the runtime's edit leaves GEMM objects valid
        assert build._digest(runtime_job) != before[1]
        before = before[0], build._digest(runtime_job)
    (src / "gemm_api.h").write_text((src / "gemm_api.h").read_text() + "\n// edit\n")
    assert build._digest(gemm_job) != before[0] and build._digest(runtime_job) != before[1]
    before = build._digest(gemm_job), build._digest(runtime_job)
    (src / "epilogue.cuh").write_text((src / "epilogue.cuh").read_text() + "\n// edit\n")
    assert build._digest(gemm_job) != before[0]  # an included header counts
    assert build._digest(build._gemm_job(GemmConfig(epilogue="tma"))) != build._digest(gemm_job)


def test_cutlass_version_is_read_from_the_headers(tmp_path):
    (tmp_path / "cutlass").mkdir()
    (tmp_path / "cutlass" / "version.h").write_text(
        "#define CUTLASS_MAJOR 4\n#define CUTLASS_MINOR 2\n#define CUTLASS_PATCH 1 \n")
    assert build.cutlass_version(tmp_path) == "4.2.1"
    assert build.cutlass_version(tmp_path / "missing") == "unknown"


# ---- the benchmark's variant names ---------------------------------------------------------------

def _bench_gemm():
    spec = importlib.util.spec_from_file_location("bench_gemm", ROOT / "bench" / "gemm.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return module


def test_bench_variants_map_to_builds():
    gemm = _bench_gemm()
    v = gemm.parse_variant("coop-tma4-plain", 90)
    assert (v.tile, v.epilogue, v.slots, v.signal) == ((128, 256), "tma", 4, False)
    cfg = gemm.variant_config(kernels, v, "bfloat16", (2, 1))
    assert build.config_name(cfg) == "sm90_bf16_bcol_128x256x64_c2x1_cooperative_etma4"
    pp = gemm.variant_config(kernels, gemm.parse_variant("pp-vec16", 90), "float16", (1, 1))
    assert (pp.schedule, pp.tile, pp.epilogue) == ("pingpong", (128, 128), "vec16")
    product = gemm.parse_variant("product", 90)
    assert product.tile is None  # the tile a default plan gets, per shape
    assert gemm.variant_config(kernels, product, "bfloat16", (2, 1), (128, 256)) == kernels.gemm_config(
        90, (128, 256), "bfloat16", True, (2, 1))
    with pytest.raises(ValueError, match="variant"):
        gemm.parse_variant("wide-tma", 90)
    wg = gemm.parse_variant("pp-tmawg4", 90)
    assert (wg.tile, wg.epilogue, wg.slots) == ((128, 128), "tma_wg", 4)
    assert gemm.parse_variant("pp-tmawg", 90).epilogue == "tma_wg"
    cfg = gemm.variant_config(kernels, wg, "float8_e4m3fn", (2, 1), scaling="rowwise")
    assert build.config_name(cfg) == "sm90_e4m3_bf16_bcol_128x128x128_c2x1_pingpong_etma_wg4"
    pf = gemm.variant_config(kernels, gemm.parse_variant("pp-tmawg-ipf", 90), "float8_e4m3fn",
                             (1, 1), scaling="rowwise")
    assert build.config_name(pf) == "sm90_e4m3_bf16_bcol_128x128x128_c1x1_pingpong_ipf_etma_wg"
    assert "-DFO_ITEM_PREFETCH=1" in build.gemm_defines(pf)
    ds = gemm.variant_config(kernels, gemm.parse_variant("pp-tmawg-ipf-dsig", 90), "float8_e4m3fn",
                             (2, 1), scaling="rowwise")
    assert build.config_name(ds) == "sm90_e4m3_bf16_bcol_128x128x128_c2x1_pingpong_ipf_dsig_etma_wg"
    assert "-DFO_WG_DEFER=1" in build.gemm_defines(ds)
    with pytest.raises(ValueError, match="signal_defer applies to the tma_wg epilogue"):
        gemm.variant_config(kernels, gemm.parse_variant("pp-tma-dsig", 90), "float8_e4m3fn", (2, 1))


def test_bench_fp8_variants_and_summary():
    gemm = _bench_gemm()
    product = gemm.Variant("product", 90, None)
    cfg = gemm.variant_config(kernels, product, "float8_e4m3fn", (2, 1), (128, 256))
    assert build.config_name(cfg) == "sm90_e4m3_bf16_bcol_128x256x128_c2x1_cooperative_scw_etma4"  # the scale warp (FP8_CONFIGS)
    split = gemm.Variant("splitacc", 90, (128, 128), schedule="cooperative", fast_accum=False)
    cfg = gemm.variant_config(kernels, split, "float8_e4m3fn", (2, 1))
    assert build.config_name(cfg) == "sm90_e4m3_bf16_bcol_128x128x128_c2x1_cooperative_splitacc_etma"
    assert gemm.variant_config(kernels, product, "bfloat16", (2, 1), (128, 256)) == kernels.gemm_config(
        90, (128, 256), "bfloat16", True, (2, 1))  # 16-bit rows unchanged
    # without a GPU (--build-only) the product's builds are every tile of the dtype's kernels:
    # fp8's own, never the 16-bit-only 128x224 / 128x160
    if not torch.cuda.is_available():
        fp8 = gemm.needed_configs(kernels, [product], ["float8_e4m3fn"], [(5120, 5120, 4096)])
        assert {c.tile for c in fp8} == set(kernels.FP8_CONFIGS[90])
        wide = gemm.needed_configs(kernels, [product], ["bfloat16"], [(5120, 5120, 4096)])
        assert {c.tile for c in wide} == set(kernels.CONFIGS[90])
    rows = [{"scaling": sc, "warm_product_vs_scaled_mm": r, "warm_splitacc_vs_scaled_mm_split": r / 2,
             "signal_overhead": 0.01, "rel_err": {"product": 3e-3}}
            for sc, r in (("tensorwise", 0.9), ("tensorwise", 1.1), ("rowwise", 1.0), ("rowwise", 1.2))]
    out = gemm.fp8_summary(rows, [product, split])
    assert (out["min_vs_scaled_mm"], out["median_vs_scaled_mm"]) == (0.9, 1.05)
    assert (out["min_vs_scaled_mm_rowwise"], out["median_vs_scaled_mm_tensorwise"]) == (1.0, 1.0)
    assert out["splitacc_min_vs_scaled_mm_split"] == 0.45
    assert out["max_rel_err"] == {"product": 3e-3} and out["rows"] == 4


def test_bench_block_scaled_variants_run_block_wise_rows_only():
    """blk128-/blk256- variants are the block-scaled kernels' tiles: they run the block-wise
    rows (with product, plain and the product's own variants, e.g. product-sw8), never the
    tensor- or row-wise ones, which run every other variant."""
    gemm = _bench_gemm()
    product, plain = gemm.Variant("product", 90, None), gemm.Variant("plain", 90, None, signal=False)
    wide, coop = gemm.parse_variant("blk256-tma1", 90), gemm.parse_variant("coop-tma", 90)
    order = gemm.parse_variant("product-sw8", 90)  # the product's own: every scaling
    variants = [product, plain, wide, coop, order]
    assert gemm.for_scaling(variants, "blockwise") == [product, plain, wide, order]
    assert gemm.for_scaling(variants, "rowwise") == gemm.for_scaling(variants, "tensorwise") == [
        product, plain, coop, order]
    cfg = gemm.variant_config(kernels, wide, "float8_e4m3fn", (2, 1), scaling="blockwise")
    assert build.config_name(cfg) == "sm90_e4m3_bf16_bcol_128x256x128_c2x1_cooperative_block128_etma1"
    narrow = gemm.variant_config(kernels, gemm.parse_variant("blk128-tma", 90), "float8_e4m3fn",
                                 (1, 1), scaling="blockwise")
    # the 128x128 block-scaled kernel runs its warpgroups in step (kernels.FP8_BLOCK_CONFIGS)
    assert (narrow.tile, narrow.block_scaled, narrow.block_lockstep) == ((128, 128), True, True)
    cpa = gemm.parse_variant("blk128-tma-cpa", 90)
    assert (cpa.tile, cpa.scale_tma, cpa.signal) == ((128, 128), False, True)
    assert gemm.for_scaling([cpa, coop], "blockwise") == [cpa]
    cfg = gemm.variant_config(kernels, cpa, "float8_e4m3fn", (2, 1), scaling="blockwise")
    assert build.config_name(cfg).endswith("_block128_cpa_lock_etma"), build.config_name(cfg)
    # -lock asks for it on 128x256 (measured equal there: its default keeps the offset)
    wide_lock = gemm.variant_config(kernels, gemm.parse_variant("blk256-tma-lock", 90),
                                    "float8_e4m3fn", (2, 1), scaling="blockwise")
    assert (wide.tile, wide_lock.block_lockstep) == ((128, 256), True)
    assert not cfg.block_pipe and gemm.variant_config(
        kernels, gemm.parse_variant("blk128-tma-pipe", 90), "float8_e4m3fn", (1, 1),
        scaling="blockwise").block_pipe
    with pytest.raises(ValueError, match="block_pipe"):
        replace(wide_lock, block_pipe=True)  # two partials only fit one column block
    with pytest.raises(ValueError, match="block_lockstep"):
        replace(gemm.variant_config(kernels, gemm.parse_variant("coop-tma4", 90), "float8_e4m3fn",
                                    (1, 1)), block_lockstep=True)
    assert not gemm.parse_variant("blk128-tma-cpa-plain", 90).signal
    with pytest.raises(ValueError, match="-cpa"):
        gemm.parse_variant("coop-tma-cpa", 90)
    k64 = gemm.parse_variant("coop-tma4-k64", 90)
    assert (k64.tile, k64.epilogue, k64.slots, k64.tile_k) == ((128, 256), "tma", 4, 64)
    cfg = gemm.variant_config(kernels, k64, "float8_e4m3fn", (2, 1))
    assert build.config_name(cfg) == "sm90_e4m3_bf16_bcol_128x256x64_c2x1_cooperative_scw_etma4"
    assert gemm.parse_variant("coop-tma4", 90).tile_k == 0
    with pytest.raises(ValueError, match="tile_k"):  # a K tile the kernel cannot take
        gemm.variant_config(kernels, gemm.parse_variant("coop-tma4-k48", 90), "float8_e4m3fn",
                            (2, 1))


def test_bench_variant_suffixes_cluster_swizzle_stages_scale_warp():
    """bench/gemm.py's suffixes, in any order: -cMxN (cluster), -swN (the plan's swizzle), -sN
    (mainloop stages), -scw (fp8: the scale warp); each reaches the build's name."""
    gemm = _bench_gemm()
    v = gemm.parse_variant("pp-tma1-c2x2-sw2-s6-scw", 90)
    assert (v.tile, v.slots, v.cluster, v.swizzle, v.stages, v.scale_warp) == (
        (128, 128), 1, (2, 2), 2, 6, True)
    assert gemm.parse_variant("pp-tma-scw-sw4-c4x1", 90).cluster == (4, 1)
    product = gemm.parse_variant("product-scw-plain", 90)
    assert (product.tile, product.scale_warp, product.signal) == (None, True, False)
    assert product.planned_tile is None  # default_tile's pick, per shape
    # -tMxN: the product's plans take that tile, and it stays the product's build
    forced = gemm.parse_variant("product-t128x128-sw4", 90)
    assert (forced.tile, forced.planned_tile, forced.swizzle) == (None, (128, 128), 4)
    assert gemm.product_build(forced)
    cfg = gemm.variant_config(kernels, forced, "float8_e4m3fn", (2, 1), forced.planned_tile)
    assert cfg.stock and (cfg.tile_m, cfg.tile_n) == (128, 128), build.config_name(cfg)
    wide = gemm.variant_config(kernels, gemm.parse_variant("product-t128x256", 90),
                               "float8_e4m3fn", (2, 1), (128, 256))
    assert not wide.stock and (wide.tile_m, wide.tile_n) == (128, 256), build.config_name(wide)
    with pytest.raises(ValueError, match="product variants"):
        gemm.parse_variant("pp-tma-t128x256", 90)
    cfg = gemm.variant_config(kernels, v, "float8_e4m3fn", v.cluster)
    assert build.config_name(cfg) == (
        "sm90_e4m3_bf16_bcol_128x128x128_c2x2_pingpong_s6_scw_etma1"), build.config_name(cfg)
    assert "-DFO_SCALE_WARP=1" in build.gemm_defines(cfg)
    assert "-DFO_SCALE_WARP=1" not in build.gemm_defines(
        gemm.variant_config(kernels, gemm.parse_variant("pp-tma", 90), "float8_e4m3fn", (2, 1)))
    with pytest.raises(ValueError, match="scale_warp"):  # 16-bit builds have no scales
        gemm.variant_config(kernels, gemm.parse_variant("coop-tma-scw", 90), "bfloat16", (2, 1))


def test_overhead_bench_gathers_block_scales_in_torchs_layout():
    """bench/overhead.py's plain fp8 allgather: every rank's block-wise scale_a ([m, kb],
    outer-dim-major), gathered as [kb, m] parts, becomes the [W m, kb] scale_a of all the rows,
    rank by rank, in the same layout."""
    spec = importlib.util.spec_from_file_location("bench_overhead", ROOT / "bench" / "overhead.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "bench"))
    m, kb, world = 5, 3, 3
    ranks = [torch.rand(kb, m).t() for _ in range(world)]  # [m, kb], strides (1, m)
    parts = torch.cat([r.t().contiguous() for r in ranks])  # what all_gather_into_tensor makes
    got = module.rows_of_ranks(parts, world)
    assert torch.equal(got, torch.cat(ranks)) and got.stride() == (1, world * m)
    assert set(module.FP8_OPS) == {"allreduce", "reduce_scatter", "all_to_all", "allgather"}


def test_bench_fixed_cost_fit_recovers_the_intercept():
    gemm = _bench_gemm()
    rows = [{"K": k, "waves": {"product": 8}, "warm_x_ms": (50 + 0.25 * k) / 1e3} for k in (256, 1024, 4096)]
    fit = gemm.fixed_costs(rows, ["x"])["x"]
    assert fit["fixed_us"] == pytest.approx(50) and fit["us_per_k"] == pytest.approx(0.25)
    assert fit["fixed_us_per_wave"] == pytest.approx(50 / 8)


# ---- layout self-tests (slow: nvcc builds host programs) ------------------------------------------

@pytest.mark.skipif(os.environ.get("FLASHOVERLAP_COMPILE_TESTS") != "1",
                    reason="set FLASHOVERLAP_COMPILE_TESTS=1 to build the sm90 layout self-tests (slow)")
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("cfg", build.SELFTEST_CONFIGS, ids=build.config_name)
def test_sm90_epilogue_layout_selftest(cfg, tmp_path):
    if build.find_nvcc() is None:
        pytest.skip("nvcc not found")
    job = build.selftest_job(cfg)
    exe = tmp_path / "selftest"
    done = subprocess.run(build.command(job, exe), capture_output=True, text=True)
    assert done.returncode == 0, (done.stderr or done.stdout)[-4000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.startswith("ok"), run.stdout[-4000:]
