"""Signaling GEMM vs cuBLAS (torch.matmul): device time, measured fairly (issue 11).

    python bench/gemm.py                          # bf16 + fp16, every shape set, JSON result
    python bench/gemm.py --quick                  # 4 shapes, bf16, fewer repetitions
    python bench/gemm.py --variants coop-tma,pp-tma,coop-vec16,coop-none  # epilogue study
    python bench/gemm.py --build-only --variants ...                      # prebuild, no GPU
    python bench/gemm.py --fp8                    # e4m3 with scales vs torch._scaled_mm
    python bench/gemm.py --fp8 --fp8-split        # also without fast accumulation

Method. Every kernel is captured in a CUDA graph, and one repetition times one replay between
two events: device time, no Python, no counter reset (the kernel only adds to its counters).
Warm L2: the graph holds --inner back-to-back launches (as a model's layers), time divided by
--inner. Cold L2: a single-launch graph, after a 256 MiB buffer is written outside the events
(the H200's L2 is 50 MB). Within a repetition the kernels alternate, in an order rotated every
repetition; --reps repetitions (100), median with p10/p90. cuBLAS runs on every SM ("cublas")
and on the SMs our grid uses ("cublas_sm": cuBLASLt with the other SMs carved out,
torch._C._set_sm_carveout_experimental, which torch applies on that path only); the profiler
names the kernel and grid each ran, and the summary compares with cublas_sm only where that grid
fits our CTAs.

Kernels: "product" is what the cuda backend launches for a default plan (the kernel table in
backends/cuda/kernels.py; FLASHOVERLAP_CUDA_EPILOGUE changes its epilogue), "plain" the same
with null counters (signaling's cost). --variants adds builds: {coop|pp|sm80}-{epilogue}[slots],
e.g. coop-tma (cooperative 128x256), coop-tma4 (4 shared-memory slots), pp-tma (pingpong
128x128), pp-tmawg / pp-tmawg4 (the tma_wg epilogue: the math threads store and signal, 2 or 4
slots of 32 columns), coop128-tma (cooperative 128x128), coop224-tma4 and coop160-tma4 (cooperative
128x224, 128x160), coop-vec16, coop-none (no full-tile stores: an upper bound, wrong output), sm80-staged
(the Ampere kernel, run here); "-plain" after any name drops its counters; "-cMxN" builds it
with an M x N cluster (e.g. pp-tma-c4x1: four CTAs share each tile of b), "-sN" with N
mainloop stages instead of as many as fit (GemmConfig.stages), "-scw" (fp8) has a producer
warp stage each item's scales (GemmConfig.scale_warp), "-ipf" has the producer stage each next
round's table rows in shared memory (GemmConfig.item_prefetch), "-dsig" (tma_wg) signals each
tile at its math group's next epilogue (GemmConfig.signal_defer), "-lock" (blk) runs both
math warpgroups' K loops in step (GemmConfig.block_lockstep), "-pipe" (blk128) overlaps each
K tile's promotion with the next one's wgmmas (GemmConfig.block_pipe), "-swN" plans it with
raster "n", N bands at a time (e.g. pp-tma-c2x2-sw2: a 2x2 cluster needs pairs of bands),
"-tMxN" (product variants) plans every shape with an M x N tile instead of default_tile's pick
and runs the backend's build of it (fp8: the stock kernel where it fits; e.g. product-t128x128
against product-t128x256 measures the tile costs kernels.default_tile weighs), "-enN" (fp8
product variants) builds the stock kernel with an epilogue tile N columns wide instead of
CUTLASS's pick (GemmConfig.stock_epi_n; e.g. product-en64); a
plan whose order does not fit the cluster runs 1x1, as the backend does (each row's "configs"
names the build that ran).

fp8 (--fp8, its own run and JSON, gemm-fp8-<device>-<date>.json): the same shapes with float8
e4m3 a and w (b = w.t()), tensor-wise (0-dim), row-wise ([M, 1] and [1, N]) and block-wise
([M, ceil(K/128)] and [ceil(K/128), ceil(N/128)]: the block-scaled kernel, product and plain
only) float32 scales, bf16 out, by the same method against torch._scaled_mm with the same
scales (block-wise: torch.nn.functional.scaled_mm with BlockWise1x128 / BlockWise128x128, its
scales laid out for it once, outside the timing; where this torch or device lacks it, the
tensor-wise _scaled_mm on the same a and w, and each row's "scaled_mm_baseline" says which), out dtype and
accumulation (use_fast_accum=True, as the product accumulates); "plain" is the product without
counters; --variants adds builds as above (fast accumulation; tensor- and row-wise rows), and
blk128-EPILOGUE / blk256-EPILOGUE (e.g. blk256-tma: the block-scaled kernel's 128x128 or
128x256 tile; block-wise rows only; a -cpa suffix, e.g. blk128-tma-cpa, copies scale_a with
cp.async instead of TMA; a -kNN suffix, e.g. coop-tma4-k64, takes K tiles of NN); --fp8-split adds the kernel that promotes its accumulators into fp32 registers
("splitacc", cooperative 128x128: 128x256 spills) against _scaled_mm(use_fast_accum=False).
Correctness: sampled tiles against float64 of the dequantized inputs. summary.fp8 has
min_vs_scaled_mm and median_vs_scaled_mm (warm, product) over every row, and per scaling.

Shape sets: facts (docs/gpu-facts.md), llm (tokens x hidden x K), ragged (tile counts that are not
multiples of the grid), ksweep (8192 x 8192, K = 256 .. 8192: the fitted intercept is the
fixed cost per wave, mostly the epilogue); not in the default run: tiles (4096 x 7168 and
4096 x 5120, K = 256 .. 4096, whole waves of 128x256 and of 128x224 / 128x160 tiles: run with
--variants coop-tma4,coop224-tma4,coop160-tma4 for kernels.TILE_COST). --comm (under torchrun, 2+ GPUs): an NCCL
all-reduce runs on a side stream during every timed replay, limited to the reserved SMs
(NCCL_MAX_CTAS). Writes gemm-<device>-<date>.json (device, date, commit, command, rows, summary) to
$FO_RESULTS_DIR or bench/results/.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (FLUSH_BYTES, device_tag, stats, table, time_alternating, trace_events,  # noqa: E402
                    write_result)

FACTS_SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (16384, 8192, 1024), (8192, 8192, 2048),
                (4096, 8192, 8192), (2048, 8192, 4096)]
LLM_SHAPES = [(2048, 4096, 4096), (4096, 4096, 1024), (8192, 8192, 1024), (16384, 4096, 4096),
              (16384, 8192, 2048), (8192, 4096, 8192), (2048, 8192, 8192), (4096, 8192, 3584)]
RAGGED_SHAPES = [(5120, 5120, 4096), (3072, 7168, 4096), (6144, 3584, 2048), (2560, 6400, 4096),
                 (12288, 4096, 1536)]
KSWEEP = [(8192, 8192, k) for k in (256, 512, 1024, 2048, 4096, 8192)]
QUICK_SHAPES = [(4096, 4096, 4096), (8192, 8192, 2048), (16384, 8192, 1024), (4096, 8192, 8192)]
# tiles: pairs of shapes whose tiles fill whole waves of 128 CTAs with 128x256 and with 128x224
# (N = 7168) or 128x160 (N = 5120): the same work, so the time ratios are the narrower kernels'
# cost per unit of work (kernels.TILE_COST); not in the default run
TILE_SHAPES = [(4096, n, k) for n in (7168, 5120) for k in (256, 1024, 2048, 4096)]
SETS = {"facts": FACTS_SHAPES, "llm": LLM_SHAPES, "ragged": RAGGED_SHAPES, "ksweep": KSWEEP,
        "tiles": TILE_SHAPES}
TILES = {"coop": (90, (128, 256)), "pp": (90, (128, 128)), "sm80": (80, (128, 128)),
         "coop128": (90, (128, 128)), "coop224": (90, (128, 224)), "coop160": (90, (128, 160)),
         "blk128": (90, (128, 128)), "blk256": (90, (128, 256))}  # blk: block-scaled fp8 only
SCHEDULES = {"coop128": "cooperative"}  # a kind whose schedule is not the kernel table's
BLOCK_KIND = "blk"  # kinds of TILES for block-wise fp8 rows (kernels.FP8_BLOCK_CONFIGS' tiles)


# ---- kernels -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Variant:
    """A GEMM build to time: arch and tile pick the kernel table's entry (tile None: the tile a
    default plan gets, per shape); epilogue and slots override it (None: the table's, i.e. the
    product)."""

    name: str
    arch: int
    tile: tuple[int, int] | None
    epilogue: str | None = None
    slots: int = 0
    signal: bool = True
    schedule: str | None = None  # None: the table's
    fast_accum: bool = True  # fp8 only
    scale_tma: bool = True  # block-scaled fp8 only: False (a "-cpa" name) copies scale_a with
    # the scale warp's cp.async, never TMA (GemmConfig.scale_tma)
    tile_k: int = 0  # 0: the table's; a "-kNN" name: K tiles of NN (e.g. fp8 coop-tma4-k64)
    cluster: tuple[int, int] | None = None  # None: the table's; a "-cMxN" name: an M x N cluster
    stages: int = 0  # 0: as many as fit; a "-sN" name: N mainloop stages (e.g. pp-tma-s6)
    swizzle: int = 0  # 0: the backend's schedule; a "-swN" name: raster "n", N bands at a time
    scale_warp: bool = False  # fp8: a "-scw" name: a producer warp stages the scales
    item_prefetch: bool = False  # a "-ipf" name: the producer stages the next round's table rows
    signal_defer: bool = False  # a "-dsig" name (tma_wg): each tile signalled at the next epilogue
    lockstep: bool = False  # a "-lock" name (block-scaled): both warpgroups' K loops in step
    pipe: bool = False  # a "-pipe" name (blk128): the K loop over two partial fragments
    plan_tile: tuple[int, int] | None = None  # product only: a "-tMxN" name plans every shape
    # with that tile (the backend's build of it: stock where it fits), not default_tile's pick
    stock_epi_n: int = 0  # fp8 product only: an "-enN" name builds the stock kernel with an
    # epilogue tile N columns wide (GemmConfig.stock_epi_n)

    @property
    def planned_tile(self):
        """The tile the variant's plans take (None: the backend's choice per shape)."""
        return self.tile or self.plan_tile


def _dims(text: str) -> tuple[int, int] | None:
    """"MxN" (a suffix's cluster or tile) as (M, N); None if it is not one."""
    m, x, n = text.partition("x")
    return (int(m), int(n)) if x and m.isdigit() and n.isdigit() else None


def parse_variant(name: str, product_arch: int) -> Variant:
    base, signal = (name[:-6], False) if name.endswith("-plain") else (name, True)
    base, scale_tma = (base[:-4], False) if base.endswith("-cpa") else (base, True)
    tile_k, cluster, swizzle, stages, scale_warp, prefetch, defer = 0, None, 0, 0, False, False, False
    lockstep = pipe = False
    plan_tile, epi_n = None, 0
    while True:  # suffixes, in any order: -k64 (the K tile), -c4x1 (cluster), -sw2 (swizzle),
        head, _, last = base.rpartition("-")  # -s6 (mainloop stages)
        if not head:
            break
        if last[:1] == "k" and last[1:].isdigit():
            base, tile_k = head, int(last[1:])
        elif last[:1] == "s" and last[1:].isdigit():
            base, stages = head, int(last[1:])
        elif last == "scw":
            base, scale_warp = head, True
        elif last == "ipf":
            base, prefetch = head, True
        elif last == "dsig":
            base, defer = head, True
        elif last == "lock":
            base, lockstep = head, True
        elif last == "pipe":
            base, pipe = head, True
        elif last[:2] == "en" and last[2:].isdigit():
            base, epi_n = head, int(last[2:])
        elif last[:2] == "sw" and last[2:].isdigit() and int(last[2:]) >= 1:
            base, swizzle = head, int(last[2:])
        elif last[:1] == "c" and _dims(last[1:]):
            base, cluster = head, _dims(last[1:])
        elif last[:1] == "t" and _dims(last[1:]):
            base, plan_tile = head, _dims(last[1:])
        else:
            break
    if not scale_tma and not base.startswith(BLOCK_KIND):
        raise ValueError(f"variant {name!r}: -cpa (scale_a by cp.async) is for the block-scaled "
                         f"kinds ({BLOCK_KIND}128, {BLOCK_KIND}256)")
    if base == "product":
        return Variant(name, product_arch, None, signal=signal, cluster=cluster, swizzle=swizzle,
                       stages=stages, scale_warp=scale_warp, item_prefetch=prefetch,
                       signal_defer=defer, plan_tile=plan_tile, stock_epi_n=epi_n)
    if plan_tile is not None or epi_n:
        raise ValueError(f"variant {name!r}: -tMxN (the plans' tile) and -enN (the stock "
                         "epilogue tile) are for product variants; the other kinds name their "
                         "tile and epilogue")
    kind, _, epi = base.partition("-")
    if kind not in TILES or not epi:
        raise ValueError(f"variant {name!r}: expected product[-plain] or "
                         f"{{{'|'.join(TILES)}}}-EPILOGUE[SLOTS][-kTILE_K][-cpa][-plain], e.g. "
                         "coop-tma4")
    slots = 0
    # tma4, tmawg4: the tma / tma_wg epilogue with 4 slots (tmawg: tma_wg with its default)
    for prefix, epilogue in (("tmawg", "tma_wg"), ("tma", "tma")):
        if epi.startswith(prefix) and (epi == prefix or epi[len(prefix):].isdigit()):
            epi, slots = epilogue, int(epi[len(prefix):] or 0)
            break
    arch, tile = TILES[kind]
    return Variant(name, arch, tile, epi, slots, signal, SCHEDULES.get(kind), scale_tma=scale_tma,
                   tile_k=tile_k, cluster=cluster, swizzle=swizzle, stages=stages,
                   scale_warp=scale_warp, item_prefetch=prefetch, signal_defer=defer,
                   lockstep=lockstep, pipe=pipe)


def product_build(v: Variant) -> bool:
    """Whether ``v`` builds what the backend runs (the product or its -plain, -swN, -cMxN)."""
    return (v.tile is None and v.epilogue is None and v.schedule is None and v.fast_accum
            and v.scale_tma and not (v.tile_k or v.stages or v.scale_warp or v.item_prefetch
                                     or v.signal_defer or v.lockstep or v.pipe))


def variant_config(kernels, v: Variant, dtype: str, cluster, tile=None, scaling=None, plan=None,
                   scales=None, k=None):
    """The build of variant ``v``; an fp8 product's is CUTLASS's kernel (GemmConfig.stock)
    where the backend would run it (kernels.stock_fits of ``plan`` and the kernel's
    ``scales``; without a plan, wherever its tile has a stock build)."""
    fp8 = dtype in kernels.FP8_DTYPES
    if fp8 and product_build(v):
        t = tuple(tile or v.tile)
        fits = (kernels.stock_fits(plan, scales) if plan is not None
                else t in kernels.STOCK_FP8_CONFIGS.get(v.arch, {}).get(scaling, {}))
        if fits:  # (the backend's epilogue tile for the plan's K, or the variant's -enN)
            cfg = kernels.gemm_config(v.arch, t, dtype, True, cluster, out_dtype=FP8_OUT,
                                      scaling=scaling, stock=True,
                                      k=plan.k if plan is not None else k)
            return replace(cfg, stock_epi_n=v.stock_epi_n) if v.stock_epi_n else cfg
    cfg = kernels.gemm_config(v.arch, tile or v.tile, dtype, True, cluster,
                              out_dtype=FP8_OUT if fp8 else None, scaling=scaling)
    if v.epilogue is not None:
        cfg = replace(cfg, epilogue=v.epilogue, epi_slots=v.slots)
    if v.schedule is not None:
        cfg = replace(cfg, schedule=v.schedule)
    if cfg.block_scaled:
        cfg = replace(cfg, scale_tma=v.scale_tma)
    if v.tile_k:
        cfg = replace(cfg, tile_k=v.tile_k)  # (GemmConfig checks it)
    if v.stages:
        cfg = replace(cfg, stages=v.stages)  # (GemmConfig checks it)
    if v.scale_warp:
        cfg = replace(cfg, scale_warp=True)  # (GemmConfig checks it)
    if v.item_prefetch:
        cfg = replace(cfg, item_prefetch=True)
    if v.signal_defer:
        cfg = replace(cfg, signal_defer=True)  # (GemmConfig checks the epilogue)
    if v.lockstep:
        cfg = replace(cfg, block_lockstep=True)  # (GemmConfig checks the build)
    if v.pipe:
        cfg = replace(cfg, block_pipe=True)  # (GemmConfig checks the build)
    return replace(cfg, fast_accum=v.fast_accum) if fp8 else cfg


def plan_for(m, n, k, dtype, tile, scaling=None, swizzle=0):
    """The cuda backend's plan (tile None: the backend's choice for this shape); fp8 with the
    result in FP8_OUT (``scaling`` "blockwise": the block-scaled kernel's); ``swizzle`` > 0:
    raster "n" with that many bands at a time instead of the backend's schedule."""
    import flashoverlap_core as fo
    from flashoverlap_core.tiles import Schedule

    out = getattr(torch, FP8_OUT) if dtype.startswith("float8") else None
    return fo.plan(m, n, k, op="custom", dtype=getattr(torch, dtype), tile=tile, backend="cuda",
                   out_dtype=out, scaling=scaling,
                   schedule=Schedule("n", swizzle) if swizzle else None)


def cluster_for(kernels, v: Variant, plan, items=None):
    """The variant's cluster (its -cMxN, else the table's) if the plan's order fits it, else 1x1
    (as the backend)."""
    cluster = v.cluster or kernels.preferred_cluster(v.arch, plan.tile)
    items = plan.item_table()[0] if items is None else items
    return cluster if kernels.cluster_fits(items, cluster) else (1, 1)


def needed_configs(kernels, variants, dtypes, shapes, scaling=None):
    """Every build the run launches (plans made here; without a GPU, both clusters and, for
    the product, every tile a default plan may get); ``scaling`` "blockwise": the block-scaled
    fp8 builds."""
    out = []
    for v in variants:
        for dtype in dtypes:
            if torch.cuda.is_available():
                plans = [plan_for(*shape, dtype, v.planned_tile, scaling, v.swizzle)
                         for shape in shapes]
                out += [variant_config(kernels, v, dtype, cluster_for(kernels, v, p), p.tile,
                                       scaling, plan=p) for p in plans]
                continue
            tiles = ([v.planned_tile] if v.planned_tile
                     else sorted(kernels.supported_tiles(v.arch, scaling, dtype)))
            picks = {(t, c) for t in tiles
                     for c in (v.cluster or kernels.preferred_cluster(v.arch, t), (1, 1))}
            out += [variant_config(kernels, v, dtype, c, t, scaling, k=k)
                    for t, c in sorted(picks) for k in sorted({shape[2] for shape in shapes})]
    return list(dict.fromkeys(out))


class Gemm:
    """One variant bound to a plan and operands: call it to launch on the current stream."""

    def __init__(self, kernels, v: Variant, a, w, dtype_name, scales=None, scaling=None):
        m, k = a.shape
        blockwise = scaling == "blockwise"
        self.plan = plan_for(m, w.shape[0], k, dtype_name, v.planned_tile,
                             "blockwise" if blockwise else None, v.swizzle)
        items, groups = self.plan.item_table()
        kernel_scales = None
        if scales is not None:  # fp8: (scale_a, scale_b) as the kernel reads them
            from flashoverlap_backends.cuda.device_state import kernel_scale
            kernel_scales = tuple(kernel_scale(t, blockwise) for t in scales)
        self.config = variant_config(kernels, v, dtype_name, cluster_for(kernels, v, self.plan, items),
                                     self.plan.tile, self.plan.scaling, self.plan, kernel_scales)
        self.lib = kernels.gemm_library(self.config)
        self.items, self.groups = items.cuda(), groups.cuda()
        self.counters = (torch.zeros(self.plan.num_groups, dtype=torch.int32, device="cuda")
                         if v.signal else None)
        self.packed = torch.empty(self.plan.packed_numel, dtype=self.plan.result_dtype,
                                  device="cuda")
        self.a, self.w = a, w
        self.variant = v
        p = self.plan
        # As the call path launches it (backends/cuda/gemm.py, launch_gemm): a "rows" plan
        # writes whole rows of the [M, N] result (ldo = N), a "tiles" plan packed tiles.
        self.params = kernels.runtime_library().GemmParams(
            a=a.data_ptr(), lda=a.stride(0), b=w.data_ptr(), ldb=w.stride(0),
            out=self.packed.data_ptr(), ldo=p.n if p.layout == "rows" else 0,
            L=len(p.block_rows), block_rows=p.block_rows[0], N=p.n, K=p.k,
            items=self.items.data_ptr(), item_group=self.groups.data_ptr(),
            num_items=p.num_tiles,
            counters=self.counters.data_ptr() if self.counters is not None else None,
            num_ctas=p.wave_size, monitor=None)
        if kernel_scales is not None:
            from flashoverlap_backends.cuda.device_state import gemm_scales
            self.params.scales = gemm_scales(*kernel_scales, blockwise=blockwise)

    def __call__(self):
        self.lib.launch(self.params, torch.cuda.current_stream().cuda_stream)

    def rel_err(self, ref, samples: int = 24) -> float:
        """Worst relative error (norm) over `samples` tiles spread over the packed buffer."""
        self()
        torch.cuda.synchronize()
        tiles = self.plan.packed_tiles
        worst = 0.0
        for i in sorted({round(j * (len(tiles) - 1) / max(1, samples - 1)) for j in range(samples)}):
            t, _, off = tiles[i]
            got = self.plan.packed_view(self.packed, t, off).double()  # either layout
            want = ref[t.row0:t.row0 + t.rows, t.col0:t.col0 + t.cols]
            worst = max(worst, ((got - want).norm() / want.norm().clamp(min=1e-30)).item())
        return worst


def cublas(a, w, carveout: int | None):
    """torch.matmul into a preallocated output (cuBLAS, torch's default library). With
    `carveout` SMs left out: torch applies its carve-out only on the cuBLASLt path, so that row
    runs cuBLASLt (each call sets both global settings: they are read when the matmul is
    launched or captured, and restored after)."""
    out = torch.empty(a.shape[0], w.shape[0], dtype=a.dtype, device="cuda")

    def run():
        if carveout is None:
            torch.matmul(a, w.t(), out=out)
            return
        library = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library("cublaslt")
        torch._C._set_sm_carveout_experimental(carveout)
        try:
            torch.matmul(a, w.t(), out=out)
        finally:
            torch._C._set_sm_carveout_experimental(None)
            torch.backends.cuda.preferred_blas_library(library)
    return run


# ---- timing (graph replays: common.time_alternating) -----------------------------------------

def kernel_names(fn) -> list[dict]:
    """Name and grid of every kernel fn launches, from a profiler trace."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [{"name": e["name"][:120], "grid": e.get("args", {}).get("grid")}
            for e in trace_events(prof)]


# ---- one shape -----------------------------------------------------------------------------------

def measure(kernels, shape, dtype, variants, args, flush, comm) -> dict:
    m, n, k = shape
    dt = getattr(torch, dtype)
    gen = torch.Generator(device="cuda").manual_seed(hash(shape) % 2**31)
    a = torch.randn(m, k, device="cuda", generator=gen).to(dt)
    w = torch.randn(n, k, device="cuda", generator=gen).to(dt)  # nn.Linear weight: b = w.t()
    gemms = {v.name: Gemm(kernels, v, a, w, dtype) for v in variants}
    ctas = gemms["product"].plan.wave_size
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    fns = {"cublas": cublas(a, w, None), "cublas_sm": cublas(a, w, sms - ctas), **gemms}
    row = {"M": m, "N": n, "K": k, "dtype": dtype, "ctas": ctas,
           "tile": list(gemms["product"].plan.tile), "tiles": gemms["product"].plan.num_tiles,
           "configs": {name: kernels_name(g.config) for name, g in gemms.items()},
           "waves": {name: -(-g.plan.num_tiles // g.plan.wave_size) for name, g in gemms.items()}}
    check_and_time(row, a.double() @ w.double().t(), fns, gemms, {name: "cublas" for name in gemms},
                   args, flush, comm)
    for mode in ("warm", "cold") if args.cold else ("warm",):
        row[f"{mode}_cublas_sm_vs_cublas"] = round(row[f"{mode}_cublas_ms"] / row[f"{mode}_cublas_sm_ms"], 3)
    if args.names:
        row["cublas_kernels"] = {name: kernel_names(fns[name]) for name in ("cublas", "cublas_sm")}
        row["cublas_sm_ctas"] = sum(math.prod(k["grid"] or [0]) for k in row["cublas_kernels"]["cublas_sm"])
    if "plain" in gemms:
        row["signal_overhead"] = round(row["warm_product_ms"] / row["warm_plain_ms"] - 1, 4)
    return row


def check_and_time(row, ref, fns, gemms, baselines, args, flush, comm) -> None:
    """Fills ``row``: each GEMM's sampled tiles' relative error against ``ref`` (float64), then
    every function's warm (and cold) time, TFLOP/s, and each GEMM's ratio to its baseline
    (``baselines``: GEMM name -> the name of the function it is compared with)."""
    row["rel_err"] = {name: round(g.rel_err(ref), 6) for name, g in gemms.items()
                      if g.variant.epilogue != "none"}
    del ref
    flops = 2.0 * row["M"] * row["N"] * row["K"]
    for mode, inner, buf in (("warm", args.inner, None), ("cold", 1, flush)):
        if mode == "cold" and not args.cold:
            continue
        times = time_alternating(fns, args.reps, inner, buf, comm)
        for name, samples in times.items():
            st = stats(samples)
            row[f"{mode}_{name}_ms"] = round(st["median"], 5)
            row[f"{mode}_{name}_spread"] = [round(st["p10"], 5), round(st["p90"], 5)]
            row[f"{mode}_{name}_tflops"] = round(flops / st["median"] / 1e9, 1)
        for name, base in baselines.items():
            row[f"{mode}_{name}_vs_{base}"] = round(row[f"{mode}_{base}_ms"] / row[f"{mode}_{name}_ms"], 3)


# ---- fp8 -------------------------------------------------------------------------------------------

FP8_OUT = "bfloat16"  # the result dtype of the fp8 set (torch's row-wise _scaled_mm takes bf16 only)
SCALINGS = ("tensorwise", "rowwise", "blockwise")


def fp8_inputs(shape, scaling: str):
    """e4m3 a [M, K] and w [N, K] (b = w.t()) with float32 scales, 0-dim or [M, 1] and [1, N];
    block-wise scale_a [M, ceil(K/128)] outer-dim-major (as torch keeps it) and scale_b
    [ceil(K/128), ceil(N/128)] as weight_scale.t() of a checkpoint's [ceil(N/128), ceil(K/128)]."""
    m, n, k = shape
    gen = torch.Generator(device="cuda").manual_seed(hash((shape, scaling)) % 2**31)
    f8 = torch.float8_e4m3fn
    a = (torch.randn(m, k, device="cuda", generator=gen) * 4).to(f8)
    w = (torch.randn(n, k, device="cuda", generator=gen) * 4).to(f8)
    if scaling == "blockwise":
        kb, nb = -(-k // 128), -(-n // 128)
        sa = (torch.rand(kb, m, device="cuda", generator=gen) / 8 + 1 / 16).t()
        sb = (torch.rand(nb, kb, device="cuda", generator=gen) / 8 + 1 / 16).t()
        return a, w, sa, sb
    sizes = ((), ()) if scaling == "tensorwise" else ((m, 1), (1, n))
    sa, sb = (torch.rand(size, device="cuda", generator=gen) / 8 + 1 / 16 for size in sizes)
    return a, w, sa, sb


def blockwise_scaled_mm(a, w, sa, sb):
    """(torch's block-wise GEMM of the same inputs, what it is): torch.nn.functional.scaled_mm
    with BlockWise1x128 / BlockWise128x128 (its scales laid out for it here, once), else, where
    this torch or device lacks it or refuses the shape, torch._scaled_mm tensor-wise on the same
    a and w (the fallback the row records)."""
    from flashoverlap_core import fp8

    out = getattr(torch, FP8_OUT)
    why = "this torch has no torch.nn.functional.scaled_mm block-wise"
    if fp8.blockwise_available(a.device):
        import torch.nn.functional as F

        tsa, tsb = fp8.torch_blockwise_scales(sa, sb, a.shape[1])
        kinds = F.ScalingType
        fn = lambda: F.scaled_mm(a, w.t(), tsa, kinds.BlockWise1x128, tsb,  # noqa: E731
                                 kinds.BlockWise128x128, output_dtype=out)
        try:
            fn()
            return fn, "torch.nn.functional.scaled_mm block-wise (BlockWise1x128, BlockWise128x128)"
        except (RuntimeError, NotImplementedError, ValueError) as e:
            why = f"torch.nn.functional.scaled_mm refused it ({str(e).splitlines()[0][:160]})"
    one = torch.ones((), device=a.device)
    return (lambda: torch._scaled_mm(a, w.t(), scale_a=one, scale_b=one, out_dtype=out,
                                     use_fast_accum=True)), f"torch._scaled_mm tensor-wise ({why})"


def fp8_reference(a, w, sa, sb, scaling):
    """float64 of the dequantized inputs' product."""
    if scaling != "blockwise":
        return (a.double() * sa.double()) @ (w.double() * sb.double().t()).t()
    from flashoverlap_core import fp8

    a32, b32 = fp8.dequantized(a, w.t(), sa, sb)
    return a32.double() @ b32.double()


def scaled_mm(a, w, sa, sb, fast_accum: bool):
    """torch._scaled_mm (cuBLASLt, or torch's own row-wise kernel) with the same scales."""
    out = getattr(torch, FP8_OUT)
    return lambda: torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=sb, out_dtype=out,
                                    use_fast_accum=fast_accum)


def for_scaling(variants, scaling):
    """The variants that run ``scaling``'s rows: every scaling takes the product's builds
    (product, plain, product-swN, -cMxN: product_build); block-wise also the block-scaled
    kernels' (blk...) variants, tensor- and row-wise every other one."""
    blockwise = scaling == "blockwise"
    return [v for v in variants if product_build(v) or v.name.startswith(BLOCK_KIND) == blockwise]


def measure_fp8(kernels, shape, scaling, variants, args, flush, comm) -> dict:
    """One fp8 row: the variants (product, plain, splitacc) against torch._scaled_mm with the
    same accumulation (fast for the product, not for splitacc); block-wise: product and plain
    against torch's block-wise scaled_mm (blockwise_scaled_mm says what runs where it lacks it)."""
    a, w, sa, sb = fp8_inputs(shape, scaling)
    dtype = str(a.dtype).removeprefix("torch.")
    variants = for_scaling(variants, scaling)
    gemms = {v.name: Gemm(kernels, v, a, w, dtype, (sa, sb), scaling) for v in variants}
    if scaling == "blockwise":
        fn, baseline = blockwise_scaled_mm(a, w, sa, sb)
        fns = {"scaled_mm": fn, **gemms}
    else:
        fns, baseline = {"scaled_mm": scaled_mm(a, w, sa, sb, True), **gemms}, "torch._scaled_mm"
    baselines = {v.name: "scaled_mm" if v.fast_accum else "scaled_mm_split" for v in variants}
    if "scaled_mm_split" in baselines.values():
        fns["scaled_mm_split"] = scaled_mm(a, w, sa, sb, False)
    product = gemms["product"].plan
    row = {"M": shape[0], "N": shape[1], "K": shape[2], "dtype": dtype, "out_dtype": FP8_OUT,
           "scaling": scaling, "scaled_mm_baseline": baseline, "ctas": product.wave_size,
           "tile": list(product.tile), "tiles": product.num_tiles,
           "configs": {name: kernels_name(g.config) for name, g in gemms.items()}}
    ref = fp8_reference(a, w, sa, sb, scaling)
    check_and_time(row, ref, fns, gemms, baselines, args, flush, comm)
    if args.names:
        row["scaled_mm_kernels"] = {name: kernel_names(fns[name]) for name in set(baselines.values())}
    if "plain" in gemms:
        row["signal_overhead"] = round(row["warm_product_ms"] / row["warm_plain_ms"] - 1, 4)
    return row


def fp8_summary(rows, variants) -> dict:
    """summary.fp8: the product's warm ratio to torch._scaled_mm, min and median over every row
    and per scaling (the targets: min >= 0.95, median >= 1.0); the other variants' against
    their baselines; signaling's cost; the sampled tiles' worst relative error."""
    out = {"measure": "warm L2, graph replays, median; vs torch._scaled_mm with the same scales, "
                      "out dtype and accumulation"}
    for v in variants:
        base = "scaled_mm" if v.fast_accum else "scaled_mm_split"
        prefix = "" if v.name == "product" else f"{v.name}_"
        for scaling in (None,) + SCALINGS:
            ratios = sorted(r[f"warm_{v.name}_vs_{base}"] for r in rows
                            if (scaling is None or r["scaling"] == scaling)
                            and f"warm_{v.name}_vs_{base}" in r)
            if ratios:
                tail = f"_{scaling}" if scaling else ""
                out[f"{prefix}min_vs_{base}{tail}"] = ratios[0]
                out[f"{prefix}median_vs_{base}{tail}"] = statistics.median(ratios)
    cold = sorted(r["cold_product_vs_scaled_mm"] for r in rows if "cold_product_vs_scaled_mm" in r)
    if cold:
        out["cold_min_vs_scaled_mm"], out["cold_median_vs_scaled_mm"] = cold[0], statistics.median(cold)
    overheads = [r["signal_overhead"] for r in rows if "signal_overhead" in r]
    if overheads:
        out["max_signal_overhead"] = max(overheads)
        out["median_signal_overhead"] = statistics.median(overheads)
    out["max_rel_err"] = {}
    for r in rows:
        for name, err in r.get("rel_err", {}).items():
            out["max_rel_err"][name] = max(out["max_rel_err"].get(name, 0.0), err)
    out["rows"] = len(rows)
    return out


def kernels_name(config) -> str:
    from flashoverlap_backends.cuda import build
    return build.config_name(config)


def fixed_costs(rows, names) -> dict:
    """K sweep: least-squares time = t0 + slope * K per kernel; t0 (us) is the fixed cost of the
    whole GEMM, mostly per-wave epilogue and tail (per wave: of that kernel's tiles; cuBLAS
    counted with the product's)."""
    out = {}
    for name in names:
        pts = [(r["K"], r[f"warm_{name}_ms"] * 1e3) for r in rows if f"warm_{name}_ms" in r]
        if len(pts) < 3:
            continue
        mk = statistics.mean(x for x, _ in pts)
        mt = statistics.mean(t for _, t in pts)
        slope = sum((x - mk) * (t - mt) for x, t in pts) / sum((x - mk) ** 2 for x, _ in pts)
        waves = rows[0]["waves"].get(name, rows[0]["waves"]["product"])
        out[name] = {"fixed_us": round(mt - slope * mk, 2), "fixed_us_per_wave": round((mt - slope * mk) / waves, 2),
                     "us_per_k": round(slope, 5)}
    return out


def summary(rows, variants) -> dict:
    """Ratios to cuBLAS (warm, medians) over the rows outside the K sweep: product (the
    targets: min >= 0.95, median >= 1.0) and every variant; signaling's cost; the K sweep fit."""
    out = {"measure": "warm L2, graph replays, median"}
    main = [r for r in rows if r.get("set") != "ksweep"]
    if main:
        for v in variants:
            ratios = sorted(r[f"warm_{v.name}_vs_cublas"] for r in main)
            prefix = "" if v.name == "product" else f"{v.name}_"
            out[f"{prefix}min_vs_cublas"], out[f"{prefix}median_vs_cublas"] = ratios[0], statistics.median(ratios)
        cold = sorted(r["cold_product_vs_cublas"] for r in main if "cold_product_vs_cublas" in r)
        if cold:
            out["cold_min_vs_cublas"], out["cold_median_vs_cublas"] = cold[0], statistics.median(cold)
        # cuBLASLt on the SMs our grid uses: only where the profiler saw the carve-out applied
        # (a grid of at most our CTAs); the rows say which kernel ran.
        same = [r["warm_cublas_sm_ms"] / r["warm_product_ms"] for r in main
                if 0 < r.get("cublas_sm_ctas", 0) <= r["ctas"]]
        out["same_sms_rows"] = len(same)
        if same:
            out["median_vs_cublas_same_sms"] = statistics.median(same)
        overheads = [r["signal_overhead"] for r in main if "signal_overhead" in r]
        if overheads:
            out["max_signal_overhead"] = max(overheads)
            out["median_signal_overhead"] = statistics.median(overheads)
        out["rows"] = len(main)
    errs = {}  # the sampled tiles' worst relative error per kernel (none: not checked)
    for r in rows:
        for name, err in r.get("rel_err", {}).items():
            errs[name] = max(errs.get(name, 0.0), err)
    out["max_rel_err"] = errs
    sweep = [r for r in rows if r.get("set") == "ksweep"]
    if sweep:
        out["ksweep"] = fixed_costs(sweep, ["cublas", "cublas_sm"] + [v.name for v in variants])
    return out


# ---- main ----------------------------------------------------------------------------------------

def comm_traffic(args):
    """Under torchrun (WORLD_SIZE >= 2): a closure that enqueues one NCCL all-reduce of 64 MiB on
    a side stream, limited to the SMs the GEMM leaves free; None otherwise."""
    if not args.comm:
        return None
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        raise SystemExit("--comm needs torchrun with 2+ processes (real NCCL traffic)")
    import torch.distributed as dist

    os.environ.setdefault("NCCL_MAX_CTAS", str(args.reserved_sms))
    dist.init_process_group("nccl")
    buf = torch.ones(32 << 20, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream(priority=-1)

    def launch():
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            dist.all_reduce(buf)
    return launch


def prepare_run(args, kernels, build, variants, dtypes, blockwise=()):
    """(shapes, NCCL traffic, L2 flush buffer) of a run, its kernels built first (and the
    block-scaled fp8 builds of the ``blockwise`` variants); None with --build-only."""
    shapes = [("quick", s) for s in QUICK_SHAPES] if args.quick else [
        (name, s) for name in args.sets.split(",") for s in SETS[name]]
    configs = needed_configs(kernels, variants, dtypes, [s for _, s in shapes])
    if blockwise:
        configs += needed_configs(kernels, blockwise, dtypes, [s for _, s in shapes], "blockwise")
    print(f"building {len(configs)} kernel configurations", flush=True)
    build.prebuild(configs, jobs=os.cpu_count())
    if args.build_only:
        return None
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda") if args.cold else None
    return shapes, comm_traffic(args), flush


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="bfloat16,float16")
    p.add_argument("--sets", default=None,
                   help=f"comma-separated shape sets: {', '.join(SETS)} (default: all but tiles; "
                        "with --fp8 also not ksweep)")
    p.add_argument("--quick", action="store_true", help="4 shapes, bf16, 30 repetitions, no cold")
    p.add_argument("--variants", default="", help="extra builds to time (see above)")
    p.add_argument("--reps", type=int, default=100)
    p.add_argument("--inner", type=int, default=10, help="launches per warm replay")
    p.add_argument("--no-cold", dest="cold", action="store_false", help="skip the cold-L2 timing")
    p.add_argument("--no-names", dest="names", action="store_false", help="skip the profiler")
    p.add_argument("--comm", action="store_true", help="NCCL traffic during timing (torchrun)")
    p.add_argument("--reserved-sms", type=int, default=4)
    p.add_argument("--build-only", action="store_true", help="build every variant and exit")
    p.add_argument("--no-json", action="store_true")
    p.add_argument("--fp8", action="store_true",
                   help="the fp8 set instead (default shapes: facts,llm,ragged): e4m3 with "
                        "scales vs torch._scaled_mm")
    p.add_argument("--fp8-split", action="store_true",
                   help="with --fp8: also the kernel without fast accumulation")
    p.add_argument("--scalings", default=",".join(SCALINGS),
                   help="with --fp8: the kinds of scales to run (default: all; fewer is a subset)")
    args = p.parse_args(argv)
    scalings = [x for x in args.scalings.split(",") if x]
    if not scalings or set(scalings) - set(SCALINGS):
        p.error(f"--scalings: a comma-separated list of {', '.join(SCALINGS)}, got {args.scalings!r}")
    args.scalings = [x for x in SCALINGS if x in scalings]
    if args.quick:
        args.dtypes, args.reps, args.cold, args.names = "bfloat16", min(args.reps, 30), False, False
        args.inner = min(args.inner, 5)

    from flashoverlap_backends.cuda import build, kernels

    if args.fp8:
        args.sets = args.sets or "facts,llm,ragged"
        return main_fp8(args, kernels, build)
    args.sets = args.sets or "facts,llm,ragged,ksweep"

    if args.comm:  # before anything creates a context on device 0
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))))
    product_arch = 90 if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] == 9 else 80
    names = ["product", "plain"] + [v for v in args.variants.split(",") if v]
    variants = [parse_variant(n if n != "plain" else "product-plain", product_arch)
                for n in dict.fromkeys(names)]
    variants = [replace(v, name="plain") if v.name == "product-plain" else v for v in variants]
    if any(v.name.startswith(BLOCK_KIND) for v in variants):
        p.error(f"{BLOCK_KIND}... variants are block-scaled fp8 kernels: use them with --fp8")
    dtypes = args.dtypes.split(",")
    prepared = prepare_run(args, kernels, build, variants, dtypes)
    if prepared is None:
        return
    shapes, comm, flush = prepared
    rows = []
    for dtype in dtypes:
        for set_name, shape in shapes:
            if set_name == "ksweep" and dtype != "bfloat16":
                continue
            row = {"set": set_name, **measure(kernels, shape, dtype, variants, args, flush, comm)}
            rows.append(row)
            print(f"{set_name} {row['M']}x{row['N']}x{row['K']} {dtype}: cuBLAS "
                  f"{row['warm_cublas_tflops']} TFLOP/s; vs cuBLAS: " + ", ".join(
                      f"{v.name} {row[f'warm_{v.name}_vs_cublas']}" for v in variants), flush=True)
    result = summary(rows, variants)
    fits = result.get("ksweep")
    cols = ["set", "M", "N", "K", "dtype", "warm_cublas_tflops", "warm_product_tflops",
            "warm_product_vs_cublas", "cold_product_vs_cublas", "warm_cublas_sm_vs_cublas",
            "signal_overhead"] + [f"warm_{v.name}_vs_cublas" for v in variants[2:]]
    print(table(rows, cols))
    for name, fit in result.pop("ksweep", {}).items():
        print(f"K sweep fit {name:>16}: fixed {fit['fixed_us']:8.1f} us = {fit['fixed_us_per_wave']:6.1f} "
              f"us/wave, {fit['us_per_k']:.4f} us per unit of K")
    print("summary:", json.dumps(result))
    wrong = {name: err for name, err in result.get("max_rel_err", {}).items() if not err < 1e-2}
    if wrong:
        print(f"WARNING: wrong results (sampled tiles' relative error >= 1e-2): {wrong}")
    if not args.no_json and int(os.environ.get("RANK", "0")) == 0:
        if fits:
            result["ksweep"] = fits
        device = device_tag()
        write_result(f"gemm-{device}", rows, {"summary": result, "variants": [v.name for v in variants],
                                    "method": "CUDA-graph replays between events, kernels alternated, "
                                              f"{args.reps} reps, warm x{args.inner}, cold after a "
                                              f"{FLUSH_BYTES >> 20} MiB write"})


def main_fp8(args, kernels, build):
    """--fp8: every shape of the sets (ksweep only if named) x the scalings (--scalings)."""
    # the block-scaled kernel is measured even while the backend does not pick it by default
    # (FLASHOVERLAP_CUDA_FP8_BLOCK: see backends/cuda); the JSON's summary says so
    os.environ.setdefault("FLASHOVERLAP_CUDA_FP8_BLOCK", "1")
    variants = [Variant("product", 90, None), Variant("plain", 90, None, signal=False)]
    if args.fp8_split:  # 128x256 spills without fast accumulation (twice the accumulators)
        variants.append(Variant("splitacc", 90, (128, 128), schedule="cooperative",
                                fast_accum=False))
    variants += [parse_variant(n, 90) for n in args.variants.split(",") if n]  # e.g. coop-tma
    scaled = [x for x in args.scalings if x != "blockwise"]  # the scaled (not block) kernels'
    prepared = prepare_run(args, kernels, build, for_scaling(variants, "rowwise") if scaled else [],
                           [kernels.FP8_DTYPES[0]],
                           for_scaling(variants, "blockwise") if "blockwise" in args.scalings else ())
    if prepared is None:
        return
    shapes, comm, flush = prepared
    rows = []
    for set_name, shape in shapes:
        for scaling in args.scalings:
            row = {"set": set_name, **measure_fp8(kernels, shape, scaling, variants, args, flush, comm)}
            rows.append(row)
            print(f"{set_name} {shape[0]}x{shape[1]}x{shape[2]} fp8 {scaling}: "
                  f"{row['scaled_mm_baseline']} {row['warm_scaled_mm_tflops']} TFLOP/s; " + ", ".join(
                      f"{name} {row[key]}" for name in (v.name for v in variants)
                      for key in row if key.startswith(f"warm_{name}_vs_")), flush=True)
    result = {"fp8": fp8_summary(rows, variants)}
    cols = ["set", "M", "N", "K", "scaling", "warm_scaled_mm_tflops", "warm_product_tflops",
            "warm_product_vs_scaled_mm", "cold_product_vs_scaled_mm", "signal_overhead"] + (
        ["warm_splitacc_vs_scaled_mm_split"] if args.fp8_split else [])
    print(table(rows, cols))
    print("summary:", json.dumps(result))
    wrong = {name: err for name, err in result["fp8"]["max_rel_err"].items() if not err < 1e-2}
    if wrong:
        print(f"WARNING: wrong results (sampled tiles' relative error >= 1e-2): {wrong}")
    if not args.no_json and int(os.environ.get("RANK", "0")) == 0:
        device = device_tag()
        write_result(f"gemm-fp8-{device}", rows, {
            "summary": result, "variants": [v.name for v in variants],
            "method": "CUDA-graph replays between events, kernels alternated, "
                      f"{args.reps} reps, warm x{args.inner}, cold after a {FLUSH_BYTES >> 20} "
                      "MiB write; e4m3 inputs, bf16 out, vs torch._scaled_mm (block-wise: each "
                      "row's scaled_mm_baseline)"})


if __name__ == "__main__":
    main()
