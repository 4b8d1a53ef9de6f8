"""Which compiled kernel serves a plan, built on first use and loaded once per process.

The kernel configurations per architecture live here (tile, cluster, schedule); build.py turns
a configuration into a shared object (JIT, cached), and the runtime (an extension module that
build.py also builds, loaded by runtime.py) loads it as a ``GemmLibrary``.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, replace
from functools import lru_cache
from types import ModuleType

from flashoverlap_core.grouping import equal_splits
from flashoverlap_core.ops import of

from . import build, runtime
from .runtime import WAIT_MODES

DTYPES = ("bfloat16", "float16")  # what the kernels take (build.GemmConfig accepts these names)
FP8_DTYPES = ("float8_e4m3fn",)  # scaled kernels (sm90), bf16 or fp16 out (FP8_CONFIGS)
ENV_EPILOGUE = "FLASHOVERLAP_CUDA_EPILOGUE"


@dataclass(frozen=True)
class Kernel:
    """How a tile shape is computed on one architecture (see build.GemmConfig)."""

    tile_k: int
    cluster: tuple[int, int]  # preferred; a plan whose order does not fit it runs 1x1
    schedule: str
    epilogue: str = "direct"
    tma_slots: int = 0  # shared-memory slots whenever the epilogue is "tma" (0: the kernel's 2)
    scale_warp: bool = False  # e4m3 tensor-/row-wise: a producer warp stages each item's scales
    block_lockstep: bool = False  # block-wise: both math warpgroups' K loops in step


# (tile_m, tile_n) -> Kernel, per architecture. A plan whose tile order does not fit the cluster
# (see cluster_fits) runs the 1x1-cluster build. Epilogues (csrc/cuda/NOTES.md, issue 11): sm90
# "tma" (measured correct and 0.90-1.06x cuBLAS on the H200, "direct" 0.71-0.95x), sm80 "staged"
# (correct on the H200; its speed there says nothing about Ampere/Ada). 4 slots for 128x256 (a
# whole tile, 3 mainloop stages) measured 1-3% faster than 2 (4 stages).
# FLASHOVERLAP_CUDA_EPILOGUE=direct selects the original epilogue.
# sm90's 128x224 and 128x160 (cooperative, 32-column tma blocks: gemm_sm90.cu) are for shapes
# whose 128x256 tiles leave a ragged last wave that these widths fill (default_tile): 3584 and
# 7168 columns are 16 and 32 tiles of 224, 5120 columns 32 of 160.
CONFIGS = {
    90: {(128, 256): Kernel(64, (2, 1), "cooperative", "tma", tma_slots=4),
         (128, 128): Kernel(64, (2, 1), "pingpong", "tma"),
         (128, 224): Kernel(64, (2, 1), "cooperative", "tma", tma_slots=4),
         (128, 160): Kernel(64, (2, 1), "cooperative", "tma", tma_slots=4)},
    80: {(128, 128): Kernel(32, (1, 1), "multistage", "staged"),
         (128, 256): Kernel(32, (1, 1), "multistage", "staged")},
}
# fp8 (e4m3 a and b, sm90 only): K tiles of 128 (128 bytes: one 128-byte swizzle row), the
# same tiles, clusters, schedules and epilogues as the 16-bit kernels, so a plan picks its tile
# the same way; fast accumulation (CUTLASS's FP8FastAccum, what vLLM and TransformerEngine's
# forward GEMMs use); measured in docs/results.md "fp8".
# The cooperative build stages each item's row- and column-wise scales from a producer warp
# (scale_warp): its math threads otherwise waited for the item table's L2 round trip before
# every tile's first wgmma (1.5-5% row-wise at K <= 4096 on an H100, docs/results.md "fp8");
# the pingpong build's math warpgroups wait for their turn there anyway (no gain measured).
FP8_CONFIGS = {
    90: {(128, 256): Kernel(128, (2, 1), "cooperative", "tma", tma_slots=4, scale_warp=True),
         (128, 128): Kernel(128, (2, 1), "pingpong", "tma")},
}
# fp8 with block-wise scales (1x128 groups of a along K, 128x128 blocks of b; sm90 only): the
# scales are applied in the main loop, per K tile of 128 (one group) and 128-column block of b,
# into a second set of accumulators: cooperative 128x256x128 (two blocks of b per tile,
# multiplied one after the other into the same 64 partial accumulators per thread: 3 mainloop
# stages; the default, the first entry) and 128x128x128 (one block; 5 stages), the 2x1 cluster,
# the tma epilogue with 2 slots. default_tile picks 128x128 where 128x256's ragged last wave
# costs more than 128x128's slower waves (BLOCK_TILE_COST). 128x128 runs its two math
# warpgroups' K loops in step (block_lockstep; 0.849 / 0.897x torch's block-wise kernel, min /
# median, against 0.728 / 0.770 half a K tile apart, on an H100: csrc/cuda/NOTES.md); 128x256
# measured the same either way and keeps the offset.
FP8_BLOCK_CONFIGS = {
    90: {(128, 256): Kernel(128, (2, 1), "cooperative", "tma"),
         (128, 128): Kernel(128, (2, 1), "cooperative", "tma", block_lockstep=True)},
}
# fp8 on CUTLASS's own persistent kernel (build.GemmConfig.stock, gemm_sm90_stock.cu: its
# TMA warp-specialized schedules with FlashOverlap's item scheduler and signaling epilogue):
# what an fp8 plan of that tile runs wherever the call lets it (stock_fits: a "rows" plan of one
# destination block or blocks of whole tiles, no all_to_all, allgather only with tensor- or
# row-wise scales; block-wise scales in torch's layouts). Tensor- and row-wise: pingpong 128x128 (CUTLASS's column and row broadcasts
# in its epilogue); block-wise: cooperative 128x128 (CUTLASS's block-scaled main loop). On the
# H200 these run 0.978-1.056x torch's row-wise and 0.956-1.038x its block-wise kernels without
# FlashOverlap's parts (bench/results/cutlass-ref-h200-20261206-040754.json, -040726.json);
# gemm_sm90.cu's builds of the same tiles about 10% slower (csrc/cuda/NOTES.md).
STOCK_FP8_CONFIGS = {
    90: {None: {(128, 128): Kernel(128, (2, 1), "pingpong", "tma")},
         "blockwise": {(128, 128): Kernel(128, (2, 1), "cooperative", "tma")}},
}
# The stock tensor-/row-wise (pingpong) builds' epilogue tile where K is short: 64 columns wide
# (GemmConfig.stock_epi_n) below STOCK_WIDE_EPILOGUE_K, CUTLASS's own 64x32 from there on. At
# K = 1024 a tile's main loop takes about as long as its epilogue, which the other warpgroup's
# main loop then no longer hides; the wider tile halves the epilogue's rounds (stmatrix, named
# barrier, TMA store). One H100, the full default `bench/gemm.py --fp8 --variants
# product-en64` (bench/results/gemm-fp8-variants-h100-20261206-165441.json): row-wise 0.951 -> 0.981,
# 0.958 -> 0.987, 0.979 -> 1.002 at K = 1024 and 0.994 -> 1.027 at K = 1536, tensor-wise 1.5-3.5%
# faster there; at K >= 2048 from 0.9% slower to 0.4% faster (median of those rows lower).
# Block-wise (cooperative) moved by at most 0.01 either way at K <= 1536 and keeps CUTLASS's
# tile (csrc/cuda/NOTES.md, "The stock build's epilogue tile").
STOCK_WIDE_EPILOGUE = 64
STOCK_WIDE_EPILOGUE_K = 2048
DEFAULT_TILE = {90: (128, 256), 80: (128, 128)}
DEFAULT_BANDS = 8  # row bands per chunk of a plan's order (schedule_bands)
# The stock builds' plans (fp8 128x128): 4 bands. The full row-wise set on an H100
# (gemm-fp8-variants-h100-20261206-081559.json; 4 bands forced everywhere, against the
# default's 8 where the planner keeps them): min 0.959 against 0.936, median 0.986 against
# 0.977; 16384x8192x2048 0.979 against 0.944. 2 bands: 0.940 / 0.983; 16 bands: 0.887 / 0.966
STOCK_BANDS = 4
CTA_MULTIPLE = 2  # grids stay even so that a plan's wave size fits either cluster build

_lock = threading.Lock()
_loaded: dict = {}  # GemmConfig -> its GemmLibrary, "runtime" -> the runtime module

__all__ = ["WAIT_MODES", "DTYPES", "gemm_library", "runtime_library", "toolchain_problem"]


def epilogue_override(arch: int) -> str | None:
    """The epilogue FLASHOVERLAP_CUDA_EPILOGUE asks for on ``arch`` (a comma-separated list of
    names, each applying to the architectures that have it, e.g. ``tma,staged``), or None."""
    return _parse_epilogues(os.environ.get(ENV_EPILOGUE, "")).get(arch)


@lru_cache(maxsize=8)
def _parse_epilogues(value: str) -> dict[int, str]:
    names = [v.strip() for v in value.split(",") if v.strip()]
    known = set().union(*build.EPILOGUES.values()) - {"none"}  # "none" is for measurements
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"{ENV_EPILOGUE}={value!r}: unknown epilogue(s) {unknown}; known: "
                         + "; ".join(f"sm{a}: {sorted(set(e) & known)}"
                                     for a, e in sorted(build.EPILOGUES.items())))
    return {arch: name for name in names for arch, known_here in build.EPILOGUES.items()
            if name in known_here}


def supported_tiles(arch: int, scaling: str | None = None,
                    dtype: str | None = None) -> set[tuple[int, int]]:
    """The tiles of ``arch``'s kernels for a and b in ``dtype`` (None: the 16-bit ones; an fp8
    dtype: the fp8 kernels', ``scaling`` "blockwise": its block-scaled kernels', none on
    sm80)."""
    if scaling == "blockwise":
        return set(FP8_BLOCK_CONFIGS.get(arch, {}))
    if dtype in FP8_DTYPES:
        return set(FP8_CONFIGS.get(arch, {}))
    return set(CONFIGS[arch])


# Per-shape tile on sm90. A plan's GEMM takes W waves of its tile (the tiles over the plan's
# wave size, rounded up): W x (the tile's area / 128x256's) x TILE_COST(tile, K) in units of one
# wave of the cooperative 128x256 kernel, whose cost is 1. TILE_COST is each kernel's time per
# unit of work against that one, measured on shapes where both fill whole waves (H200, bf16
# and fp16 alike). Pingpong 128x128 at 8192x8192 (issue 11 run 2: it measured 0.95-1.00x
# cuBLAS on the three ragged shapes that picked it, against 0.90-0.95x for 128x256, and lost on
# every shape that does not, where 2 W_coop = W_pp). Cooperative 128x224 at 4096x7168 and
# 128x160 at 4096x5120, K = 256 .. 4096 (`bench/gemm.py --sets tiles`,
# bench/results/gemm-tiles-h200-20261204-213024.json: 0.80-0.97x of 128x256's speed, rounded
# up here to the worse dtype); there the ragged shapes that pick them measured 0.97-1.04x
# cuBLAS (pingpong 0.94-0.99x). A ragged last wave of 128x256 tiles wastes up to a whole wave
# of work; a narrower tile wastes less (or none, where its width divides N).
PINGPONG_COST = ((256, 1.25), (512, 1.06), (1024, 1.08), (2048, 1.05), (4096, 1.03), (8192, 1.01))
TILE_COST = {
    (128, 128): PINGPONG_COST,
    (128, 224): ((256, 1.29), (1024, 1.12), (2048, 1.08), (4096, 1.045)),
    (128, 160): ((256, 1.33), (1024, 1.10), (2048, 1.07), (4096, 1.045)),
}


# The block-scaled fp8 kernels' cost per unit of work against their 128x256 tile's, as
# TILE_COST: the lockstep 128x128 build's speed against 128x256's on the shapes that fill whole
# waves of both, rounded up (H100, bench/results/gemm-fp8-variants-h100-20261206-000152.json,
# blk128-tma-lock against the product: 0.865-0.885x at K = 1024, 0.90 at 2048, 0.935-0.94 at
# 4096, 0.91-0.95 at 8192).
BLOCK_TILE_COST = {
    (128, 128): ((1024, 1.15), (2048, 1.11), (4096, 1.07), (8192, 1.1)),
}
# The same for the stock builds (STOCK_FP8_CONFIGS) that fp8 plans of 128x128 run, against the
# 128x256 build of gemm_sm90.cu, from the H200 runs that STOCK_FP8_CONFIGS cites (each shape's
# two ratios to torch's kernel, rounded up): block-wise 1.04 at K = 1024, 1.02 at 1536, 1.0 at
# 2048, 0.97 at 3584-4096, 0.96 at 8192; tensor- and row-wise (measured row-wise) 0.91 at
# K = 1024, 0.88 at 2048, 0.94 at 4096, 0.98 at 8192.
STOCK_BLOCK_TILE_COST = {
    (128, 128): ((1024, 1.04), (1536, 1.02), (2048, 1.0), (3584, 0.97), (8192, 0.96)),
}
STOCK_FP8_TILE_COST = {
    (128, 128): ((1024, 0.91), (2048, 0.88), (4096, 0.94), (8192, 0.98)),
}


def tile_cost(tile, k: int, costs: dict | None = None) -> float:
    """``costs``' (TILE_COST's) entry for ``tile`` at the largest measured K <= k (the smallest
    K's below the first); 1 for the reference tile, 128x256 (and any tile without
    measurements)."""
    table = (TILE_COST if costs is None else costs).get(tuple(tile), ())
    cost = table[0][1] if table else 1.0
    for at, value in table:
        if k >= at:
            cost = value
    return cost


def pingpong_cost(k: int) -> float:
    """PINGPONG_COST at the largest measured K <= k (the smallest K's below 256)."""
    return tile_cost((128, 128), k)


def default_tile(arch: int, spec=None, wave_size: int | None = None) -> tuple[int, int]:
    """The tile of a default plan: DEFAULT_TILE, or on sm90, given the call (an OverlapSpec:
    m, n, k, op, world_size, send_splits, dtype) and the plan's wave size, the tile of the
    call's dtype whose waves cost least (TILE_COST; DEFAULT_TILE on a tie): pingpong's 128x128
    or a narrower cooperative tile where the waves' raggedness makes up for its cost; block-wise
    fp8 the same way among its kernels (BLOCK_TILE_COST, default_block_tile first). all_to_all
    weighs the waves of its expected rows (``spec.rows_hint``), and takes DEFAULT_TILE without
    them."""
    block = spec is not None and spec.scaling == "blockwise" and arch in FP8_BLOCK_CONFIGS
    tile = default_block_tile(arch) if block else DEFAULT_TILE[arch]
    costs = BLOCK_TILE_COST if block else TILE_COST
    if arch != 90 or spec is None or not wave_size:
        return tile
    if stock_call(spec):
        costs = STOCK_BLOCK_TILE_COST if block else STOCK_FP8_TILE_COST
    blocks = [spec.m]  # rows per destination (allgather: source) block, as the plan cuts them
    if of(spec.op).splits:
        # all_to_all: each call's rows are its own; the key's expected rows per rank (the
        # ranks' mean at its first call, spec.rows_hint), cut evenly over the destinations
        if not spec.rows_hint:
            return tile
        rows, world = spec.rows_hint, spec.world_size
        blocks = equal_splits(rows, world)
    elif of(spec.op).blocks == "ranks" and spec.world_size > 1:
        blocks = [spec.m // spec.world_size] * spec.world_size

    def cost(t) -> float:
        tiles = sum(-(-rows // t[0]) for rows in blocks) * -(-spec.n // t[1])
        waves = max(1, -(-tiles // wave_size))
        return waves * t[0] * t[1] / (tile[0] * tile[1]) * tile_cost(t, spec.k, costs)

    # min keeps the first of equal costs: DEFAULT_TILE, listed first
    return min([tile] + sorted(supported_tiles(arch, spec.scaling, spec.dtype) - {tile}), key=cost)


def default_block_tile(arch: int) -> tuple[int, int]:
    """The tile of block-wise fp8 plans that name none: FP8_BLOCK_CONFIGS' first."""
    return next(iter(FP8_BLOCK_CONFIGS[arch]))


def schedule_bands(spec, tile) -> int:
    """Row bands per chunk of a plan's order (raster "n": chunks of bands, column by column):
    STOCK_BANDS for an fp8 plan of the stock builds' tile whose op may run them, else
    DEFAULT_BANDS (the planner halves either where the groups need more strips)."""
    tiles = STOCK_FP8_CONFIGS[90]["blockwise" if spec.scaling == "blockwise" else None]
    stock = tile is not None and tuple(tile) in tiles and stock_call(spec)
    return STOCK_BANDS if stock else DEFAULT_BANDS


def stock_call(spec) -> bool:
    """Whether a call (an OverlapSpec) may run the stock fp8 builds, as stock_fits expects of
    it before its plan and scales: fp8 a and b, an op that takes them (stock_op); where the
    result's blocks are the ranks' (reduce_scatter's destinations, allgather's sources) and
    there are several, equal shards of whole row tiles of the stock builds (128 rows)."""
    if not (spec.dtype in FP8_DTYPES and stock_op(spec.op, spec.scaling)):
        return False
    if of(spec.op).blocks != "ranks" or spec.world_size == 1:
        return True
    tiles = STOCK_FP8_CONFIGS[90]["blockwise" if spec.scaling == "blockwise" else None]
    shard, rest = divmod(spec.m, spec.world_size)
    return not rest and not any(shard % tile[0] for tile in tiles)


def stock_op(op: str, scaling: str | None = None) -> bool:
    """Whether calls of ``op`` with ``scaling`` may run the stock fp8 builds: not all_to_all
    (unequal destination blocks, packed tiles), nor a block-wise allgather (its gathered scale_a
    is row-major, each rank's part contiguous for NCCL; the stock kernel reads scale_a's groups
    column by column)."""
    kind = of(op)
    return not kind.splits and not (kind.gathers and scaling == "blockwise")


def stock_fits(plan, scales=None) -> bool:
    """Whether an fp8 ``plan`` runs the stock build of its tile (STOCK_FP8_CONFIGS) with these
    ``scales`` (the call's (scale_a, scale_b) as the kernel reads them, or None: any of
    tensor-/row-wise, or block-wise in torch's layouts): a "rows" plan whose parts lie at their
    own rows of the [M, N] result (``plan.slabs``: one destination block, or a reduce_scatter of
    one group, or allgather's source blocks; equal blocks of whole row tiles), N a multiple of 8
    (the result's TMA row stride) and at least the tile's; an op that stock_op allows; block-wise also M >= 128 and a
    multiple of 4 (scale_a's TMA map, whose row stride is encoded even for one group) with
    scale_a [M, groups] of strides (1, M) and scale_b [groups, ceil(N/128)] of strides
    (1, groups)."""
    table = STOCK_FP8_CONFIGS.get(90, {}).get(plan.scaling)
    if (plan.dtype not in FP8_DTYPES or table is None or tuple(plan.tile) not in table
            or plan.layout != "rows" or not stock_op(plan.op, plan.scaling)
            or plan.n % 8 or plan.n < plan.tile[1]):
        return False
    rows = plan.block_rows
    if len(rows) > 1 and (len(set(rows)) > 1 or rows[0] % plan.tile[0]):
        return False
    # (allgather's items are the tiles of the gathered rows, each at its own place in the result:
    # gather_call.gather_items)
    if not of(plan.op).gathers and any(offset != row0 * plan.n for parts in plan.slabs
                                       for row0, _, offset in parts):
        return False
    if plan.scaling != "blockwise":
        return True
    m, groups, cols = plan.m, -(-plan.k // 128), -(-plan.n // 128)
    if m < 128 or m % 4:  # (scale_a's TMA map: its box, and its row stride even for 1 group)
        return False
    if scales is None:
        return True
    scale_a, scale_b = scales
    a_ok = (scale_a.stride(0) == 1 or m == 1) and (scale_a.stride(1) == m or groups == 1)
    b_ok = ((scale_b.stride(0) == 1 or groups == 1) and (scale_b.stride(1) == groups or cols == 1))
    return a_ok and b_ok


def config_of(gemm) -> build.GemmConfig:
    """The configuration a GemmLibrary was loaded from (by gemm_library: its key in _loaded)."""
    with _lock:
        config = next((key for key, lib in _loaded.items() if lib is gemm), None)
    if not isinstance(config, build.GemmConfig):
        raise ValueError(f"{gemm!r} was not loaded by kernels.gemm_library")
    return config


def is_stock(gemm) -> bool:
    """Whether a loaded GemmLibrary is a stock build (GemmConfig.stock)."""
    return config_of(gemm).stock


def cluster_fits(items, cluster: tuple[int, int]) -> bool:
    """Whether the CTAs of each cluster get items that can share operand tiles: in every round
    of S = cm * cn consecutive items, rank (rm, rn) has the column tile of rank (0, rn) and the
    rows (block, band) of rank (rm, 0). ``items`` is the plan's int64 [T, 4] item table."""
    cm, cn = cluster
    size = cm * cn
    if size == 1:
        return True
    total = items.shape[0] // size * size
    rounds = items[:total].view(-1, cn, cm, 4)  # [round, rn, rm, field]
    same_col = (rounds[..., 2] == rounds[:, :, :1, 2]).all()
    same_rows = (rounds[..., :2] == rounds[:, :1, :, :2]).all()
    return bool(same_col and same_rows)


def gemm_config(arch: int, tile, dtype: str, b_col_major: bool, cluster=(1, 1),
                blocks: bool = False, out_dtype: str | None = None,
                scaling: str | None = None, gather: bool = False,
                stock: bool = False, k: int | None = None) -> build.GemmConfig:
    """The build of ``tile`` on ``arch`` for a and b in ``dtype``; fp8 (FP8_DTYPES) with the
    result in ``out_dtype``, block-scaled for ``scaling`` "blockwise". ``blocks``: one that
    also takes destination blocks of unequal rows (all_to_all's per-call layout; other calls
    keep the plain build, whose producer warps do not pay for that branch). ``gather``:
    allgather's; fp8 then has a build of its own (fo_gemm_run_ex_scaled: the waiting GEMM with
    scales), 16-bit dtypes the plain one (fo_gemm_run_ex). ``stock``: CUTLASS's kernel, with
    the epilogue tile stock_epi_n gives for the plan's ``k`` (None: CUTLASS's own)."""
    block_scaled = dtype in FP8_DTYPES and scaling == "blockwise"
    if stock:  # CUTLASS's kernel (STOCK_FP8_CONFIGS): its own epilogue and stages
        kernel = STOCK_FP8_CONFIGS[arch]["blockwise" if block_scaled else None][tuple(tile)]
        return build.GemmConfig(arch=arch, tile_m=tile[0], tile_n=tile[1], tile_k=kernel.tile_k,
                                cluster_m=cluster[0], cluster_n=cluster[1], dtype=dtype,
                                b_col_major=b_col_major, schedule=kernel.schedule,
                                epilogue="tma", out_dtype=out_dtype or "",
                                block_scaled=block_scaled, gather=gather, stock=True,
                                stock_epi_n=stock_epi_n(k, block_scaled))
    table = FP8_BLOCK_CONFIGS if block_scaled else FP8_CONFIGS if dtype in FP8_DTYPES else CONFIGS
    kernel = table[arch][tuple(tile)]
    epilogue = epilogue_override(arch) or kernel.epilogue
    slots = kernel.tma_slots if epilogue in build.TMA_EPILOGUES else 0
    return build.GemmConfig(arch=arch, tile_m=tile[0], tile_n=tile[1], tile_k=kernel.tile_k,
                            cluster_m=cluster[0], cluster_n=cluster[1], dtype=dtype,
                            b_col_major=b_col_major, schedule=kernel.schedule,
                            epilogue=epilogue, epi_slots=slots, blocks=blocks,
                            out_dtype=out_dtype or "", block_scaled=block_scaled,
                            gather=gather and dtype in FP8_DTYPES,
                            scale_warp=kernel.scale_warp,
                            block_lockstep=kernel.block_lockstep and block_scaled)


def stock_epi_n(k: int | None, block_scaled: bool = False) -> int:
    """The epilogue tile width of the stock build for a plan of ``k`` (GemmConfig.stock_epi_n):
    STOCK_WIDE_EPILOGUE for tensor-/row-wise K below STOCK_WIDE_EPILOGUE_K, else 0 (CUTLASS's)."""
    if block_scaled or k is None or k >= STOCK_WIDE_EPILOGUE_K:
        return 0
    return STOCK_WIDE_EPILOGUE


def all_configs(archs) -> list[build.GemmConfig]:
    """Every configuration a default plan can select on ``archs``: the tiles default_tile picks
    (sm90: both), both dtypes, both layouts of b, the preferred and the 1x1 cluster;
    all_to_all's (either tile, 1x1, unequal blocks); on sm90 also fp8 (b column-major)
    with either output dtype, tensor-/row-wise and block-wise scales, all_to_all's and
    allgather's too (allgather's: both clusters, as its 16-bit calls take the plain builds)."""
    out = []
    for arch in archs:
        for tile in dict.fromkeys([DEFAULT_TILE[arch]] + (sorted(CONFIGS[arch]) if arch == 90 else [])):
            clusters = dict.fromkeys([preferred_cluster(arch, tile), (1, 1)])
            for dtype in DTYPES:
                for col in (True, False):
                    out += [gemm_config(arch, tile, dtype, col, c) for c in clusters]
                    # all_to_all's (1x1): every tile default_tile may pick for it
                    out.append(gemm_config(arch, tile, dtype, col, blocks=True))
            for dtype in FP8_DTYPES if tile in FP8_CONFIGS.get(arch, {}) else ():
                for result in DTYPES:
                    out += [gemm_config(arch, tile, dtype, True, c, out_dtype=result)
                            for c in clusters]
                    # fp8 all_to_all's (1x1, unequal blocks, fo_gemm_run_blocks_scaled)
                    out.append(gemm_config(arch, tile, dtype, True, blocks=True, out_dtype=result))
                    # fp8 allgather's (fo_gemm_run_ex_scaled)
                    out += [gemm_config(arch, tile, dtype, True, c, out_dtype=result, gather=True)
                            for c in clusters]
        for tile in FP8_BLOCK_CONFIGS.get(arch, {}):  # block-wise fp8: every tile default_tile picks
            out += block_scaled_configs(arch, tile)
        out += stock_configs(arch)
    return out


def stock_configs(arch: int) -> list[build.GemmConfig]:
    """The stock fp8 builds (STOCK_FP8_CONFIGS): either result dtype, each scaling's tiles, the
    preferred and the 1x1 cluster; tensor- and row-wise also allgather's (stock_op), and each
    of those with the short-K epilogue tile too (stock_epi_n)."""
    out = []
    for scaling, tiles in STOCK_FP8_CONFIGS.get(arch, {}).items():
        for tile, kernel in tiles.items():
            for dtype in FP8_DTYPES:
                for result in DTYPES:
                    for gather in (False, True) if stock_op("allgather", scaling) else (False,):
                        for c in dict.fromkeys([kernel.cluster, (1, 1)]):
                            base = gemm_config(arch, tile, dtype, True, c, out_dtype=result,
                                               scaling=scaling, gather=gather, stock=True)
                            wide = stock_epi_n(1, base.block_scaled)  # (the shortest K's tile)
                            out += [base] + ([replace(base, stock_epi_n=wide)] if wide else [])
    return out


def block_scaled_configs(arch: int, tile) -> list[build.GemmConfig]:
    """The block-scaled fp8 builds of ``tile`` (FP8_BLOCK_CONFIGS): either result dtype, the
    preferred and the 1x1 cluster, all_to_all's (1x1, unequal blocks) and allgather's."""
    out = []
    clusters = dict.fromkeys([preferred_cluster(arch, tile), (1, 1)])
    for dtype in FP8_DTYPES:
        for result in DTYPES:
            out += [gemm_config(arch, tile, dtype, True, c, out_dtype=result, scaling="blockwise")
                    for c in clusters]
            out.append(gemm_config(arch, tile, dtype, True, blocks=True, out_dtype=result,
                                   scaling="blockwise"))  # all_to_all's
            out += [gemm_config(arch, tile, dtype, True, c, out_dtype=result,
                                scaling="blockwise", gather=True)
                    for c in clusters]  # allgather's
    return out


def preferred_cluster(arch: int, tile) -> tuple[int, int]:
    return CONFIGS[arch][tuple(tile)].cluster


def _load(key, make):
    with _lock:
        lib = _loaded.get(key)
        if lib is None:
            lib = make()
            lib.load_kernels()  # force-load now: no lazy first launch inside an overlapped call
            _loaded[key] = lib
        return lib


def gemm_library(config: build.GemmConfig):
    """The runtime's ``GemmLibrary`` of ``config`` (csrc/cuda/runtime_binding.cpp)."""
    native = runtime_library()
    return _load(config, lambda: native.GemmLibrary(str(build.build_gemm(config))))


def runtime_library() -> ModuleType:
    """The runtime extension module (csrc/cuda/runtime_binding.cpp lists what it exports)."""
    return _load("runtime", lambda: runtime.load(build.build_runtime()))


def toolchain_problem() -> str | None:
    """Why kernels can be neither built nor found prebuilt (None when they can)."""
    if not build.jit_allowed():
        return None  # prebuilt objects only: a missing one is reported when first needed
    missing = []
    for check in (build.nvcc_path, build.cutlass_include_dirs, build.python_include_dirs):
        try:
            check()
        except build.BuildError as e:
            missing.append(str(e))
    return "; ".join(missing) or None


def toolchain_versions() -> dict[str, str]:
    out = {}
    try:
        out["nvcc"] = build.nvcc_version(build.nvcc_path())
    except build.BuildError as e:
        out["nvcc"] = f"not found ({e})"
    try:
        include = build.cutlass_include_dirs()[0]
        out["cutlass headers"] = f"{build.cutlass_version(include)} ({include})"
    except build.BuildError:
        out["cutlass headers"] = "not found (pip install nvidia-cutlass)"
    return out
