"""GPU tests of the signaling GEMM's epilogues, through the kernel libraries' C ABI.

Every configuration of CONFIGS (sm90 cooperative and pingpong with the direct and the tma
epilogue, the cooperative 128x224 and 128x160 tiles (32-column tma blocks), bf16 and fp16, b column- and row-major, clusters 2x1 / 1x2 / 1x1; fp8: e4m3 a and b
with tensor-wise and row/column-wise scales, bf16 and fp16 out, fast and promoted accumulation,
through fo_gemm_run_scaled; sm80 direct and staged, run on the GPU at hand; and all_to_all's
builds for unequal blocks, on equal ones here) against a float64 reference (of the dequantized
inputs for fp8), on item tables built here rather
than by the plan: tiles placed at chosen packed offsets with poisoned gaps, so that every path is
taken on purpose (full tiles at offsets that are multiples of BN, of 8 but not BN, and odd;
partial tiles; several destination blocks whose rows are not multiples of BM; a K tail with NaN
in a's padding) and a write outside a tile's slot shows. Then the counters' release semantics: a
consumer stream that copies a group's region the moment its counter reaches the group's size sees
the final data. Skips without a GPU (fails under FLASHOVERLAP_REQUIRE_HW=1).

The libraries are built on first use (JIT, all at once in parallel): run with
FLASHOVERLAP_CACHE_DIR pointing at a cache that has them to skip the build.
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass, replace

import pytest
import torch

from flashoverlap_backends.cuda import build, kernels
from flashoverlap_backends.cuda.build import GemmConfig
from flashoverlap_backends.cuda.device_state import gemm_scales

pytestmark = pytest.mark.timeout(900)


def _reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    if torch.cuda.get_device_capability()[0] < 8:
        return "the kernels need compute capability 8.0 or newer"
    return kernels.toolchain_problem()


REASON = _reason()
if REASON and os.environ.get("FLASHOVERLAP_REQUIRE_HW") == "1":
    raise RuntimeError(f"FLASHOVERLAP_REQUIRE_HW=1 but {REASON}")
pytestmark = [pytestmark, pytest.mark.skipif(REASON is not None, reason=REASON or "")]

COOP, PP = dict(), dict(tile_n=128, schedule="pingpong")
SM90 = [
    GemmConfig(epilogue="tma", **COOP),
    GemmConfig(epilogue="tma", cluster_m=1, dtype="fp16", b_col_major=False, **COOP),
    GemmConfig(epilogue="tma", epi_slots=4, **COOP),
    GemmConfig(epilogue="tma", **PP),
    GemmConfig(epilogue="tma", epi_slots=1, cluster_m=1, cluster_n=2, dtype="fp16",
               b_col_major=False, **PP),
    GemmConfig(epilogue="direct", **COOP),
    GemmConfig(epilogue="direct", **PP),
    GemmConfig(epilogue="vec16", **COOP),
    GemmConfig(epilogue="tma", epi_slots=4, cluster_m=1, blocks=True, **COOP),  # all_to_all's
    # 128x224 and 128x160: the tma epilogue in 32-column blocks (64-byte swizzle)
    GemmConfig(epilogue="tma", epi_slots=4, tile_n=224),
    GemmConfig(epilogue="tma", epi_slots=4, tile_n=160, cluster_m=1, dtype="fp16",
               b_col_major=False),
    # fp8 (issue 23): the product's builds, the direct path everywhere, promoted accumulation
    GemmConfig(tile_k=128, dtype="e4m3", epilogue="tma", epi_slots=4, **COOP),
    GemmConfig(tile_k=128, dtype="e4m3", out_dtype="fp16", epilogue="tma", **PP),
    GemmConfig(tile_k=128, dtype="e4m3", out_dtype="fp16", epilogue="direct", cluster_m=1, **COOP),
    GemmConfig(tile_n=128, tile_k=128, dtype="e4m3", epilogue="tma", fast_accum=False),
]
SM80 = [
    build.default_config(80, epilogue="staged"),
    replace(build.default_config(80, epilogue="staged"), blocks=True),
    build.default_config(80, dtype="fp16", b_col_major=False, epilogue="staged"),
    build.default_config(80),
]
CONFIGS = (SM90 if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
           else []) + SM80
# FO_GEMM_TEST_CONFIGS=sm90,estaged: only the configurations whose name contains one of these
# (and only those are built); an entry -NAME leaves out those whose name contains NAME
# (FO_GEMM_TEST_CONFIGS=-e4m3: the 16-bit ones).
_SELECTION = [w for w in os.environ.get("FO_GEMM_TEST_CONFIGS", "").split(",") if w]
_WANTED = [w for w in _SELECTION if not w.startswith("-")]
_UNWANTED = [w[1:] for w in _SELECTION if w.startswith("-")]
CONFIGS = [c for c in CONFIGS if (not _WANTED or any(w in build.config_name(c) for w in _WANTED))
           and not any(w in build.config_name(c) for w in _UNWANTED)]
DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "e4m3": torch.float8_e4m3fn}


@pytest.fixture(scope="module")
def libraries():
    """Every configuration's library, built in parallel up front (a build takes a minute)."""
    build.prebuild(CONFIGS, jobs=os.cpu_count())
    return {c: kernels.gemm_library(c) for c in CONFIGS}


@pytest.fixture(scope="module")
def runtime():
    return kernels.runtime_library()


def _name(c: GemmConfig) -> str:
    return build.config_name(c)


_LOST: list[str] = []  # the first test after which the CUDA context was unusable


@pytest.fixture(autouse=True)
def _context_guard(request):
    """A kernel fault poisons the process's CUDA context: the tests after it then skip, naming
    the test (and error) that lost it, instead of failing with the same sticky error."""
    if _LOST:
        pytest.skip(f"CUDA context lost in {_LOST[0]}")
    yield
    try:
        torch.cuda.synchronize()
    except RuntimeError as e:
        _LOST.append(f"{request.node.name}: {str(e).splitlines()[0]}")


# ---- item tables -------------------------------------------------------------------------------

class Layout:
    """Tiles of c = a @ b ([L * block_rows, N]) in an execution order that suits the cluster,
    each placed at a packed offset after a chosen gap; groups of consecutive items. The packed
    buffer has M * N elements (the ABI's size, which the kernel checks every item against), so
    to make room for the gaps the last items are left out (whole cluster rounds): the table need
    not cover the matrix, and the space of the tiles left out must stay untouched."""

    GAPS = (0, 8, 1, 3 * 8, 0, 5)  # elements before each tile, cycled: aligned, 16 B, odd

    def __init__(self, cfg, L, block_rows, n, gaps=GAPS, groups=3):
        bm, bn = cfg.tile_m, cfg.tile_n
        bands, cols = -(-block_rows // bm), -(-n // bn)
        cells = [(l, mb, nb) for l in range(L) for mb in range(bands) for nb in range(cols)]
        cm, cn = cfg.cluster_m, cfg.cluster_n
        if cm > 1:    # pairs of items share their column tile: columns outermost
            cells.sort(key=lambda c: (c[2], c[0], c[1]))
        self.numel = L * block_rows * n
        keep = len(cells)
        while True:
            self.tiles = self._place(cells[:keep], gaps, bm, bn, block_rows, n)
            if self.tiles[-1][3] + self.tiles[-1][4] * self.tiles[-1][5] <= self.numel:
                break
            keep -= cm * cn if keep % (cm * cn) == 0 else keep % (cm * cn)
        self.items = torch.tensor([t[:4] for t in self.tiles], dtype=torch.int64)
        per = -(-len(self.tiles) // groups)
        self.group = torch.tensor([i // per for i in range(len(self.tiles))], dtype=torch.int32)
        self.sizes = torch.bincount(self.group.long(), minlength=int(self.group.max()) + 1).tolist()
        self.block_rows, self.L, self.n = block_rows, L, n
        self.fits = kernels.cluster_fits(self.items, (cm, cn))

    @staticmethod
    def _place(cells, gaps, bm, bn, block_rows, n):
        tiles, offset = [], 0  # (l, m_blk, n_blk, offset, rows, cols)
        for i, (l, mb, nb) in enumerate(cells):
            offset += gaps[i % len(gaps)] if gaps else 0
            rows, width = min(bm, block_rows - mb * bm), min(bn, n - nb * bn)
            if rows == bm and width == bn and i % 4 == 0:
                offset = -(-offset // bn) * bn  # some full tiles on a row of the [*, BN] view
            tiles.append((l, mb, nb, offset, rows, width))
            offset += rows * width
        return tiles


@dataclass
class Operands:
    a: torch.Tensor
    lda: int
    b: torch.Tensor
    ldb: int
    ref: torch.Tensor  # float64 (of the dequantized inputs for fp8)
    scales: tuple | None = None  # fp8: (scale_a, scale_b), float32


def _operands(cfg, m, n, k, gen, rowwise: bool = True):
    """a [m, k] with a NaN-poisoned row padding (lda > k where k % 16 bytes), b in the config's
    layout, and the float64 reference; fp8: e4m3 with row-wise (or tensor-wise) scales."""
    dt = DTYPE[cfg.dtype]
    align = 16 // torch.empty((), dtype=dt).element_size()
    lda = -(-k // align) * align + (align if k % align == 0 and k > align else 0)
    a = torch.full((m, lda), float("nan"), dtype=dt, device="cuda")
    a[:, :k] = torch.randn(m, k, device="cuda", generator=gen).to(dt)
    if cfg.b_col_major:
        ldb = -(-k // align) * align
        b = torch.full((n, ldb), float("nan"), dtype=dt, device="cuda")
        b[:, :k] = torch.randn(n, k, device="cuda", generator=gen).to(dt)
        b_mat = b[:, :k].t()
    else:
        ldb = -(-n // align) * align
        b = torch.full((k, ldb), float("nan"), dtype=dt, device="cuda")
        b[:, :n] = torch.randn(k, n, device="cuda", generator=gen).to(dt)
        b_mat = b[:, :n]
    if cfg.dtype not in build.FP8_DTYPES:
        return Operands(a, lda, b, ldb, a[:, :k].double() @ b_mat.double())
    sizes = ((m, 1), (1, n)) if rowwise else ((), ())
    sa, sb = (torch.rand(size, device="cuda", generator=gen) + 0.25 for size in sizes)
    ref = (a[:, :k].double() * sa.double()) @ (b_mat.double() * sb.double())
    return Operands(a, lda, b, ldb, ref, (sa, sb))


def _run(lib, cfg, layout, ops: Operands, k, packed, counters, ctas, stream=None):
    items = layout.items.cuda()
    group = layout.group.cuda()
    args = (packed.data_ptr(), layout.L, layout.block_rows, layout.n, k, ops.lda, ops.ldb,
            items.data_ptr(), group.data_ptr(), len(layout.tiles),
            counters.data_ptr() if counters is not None else None, ctas, None, None,
            (stream or torch.cuda.current_stream()).cuda_stream)
    if ops.scales is not None:
        lib.run_scaled(ops.a.data_ptr(), ops.b.data_ptr(), gemm_scales(*ops.scales), *args)
    else:
        lib.run(ops.a.data_ptr(), ops.b.data_ptr(), *args)
    return items, group  # kept alive until the caller synchronizes


def _check_packed(cfg, layout, packed, ref):
    """Every tile equals the reference within the dtype's tolerance; every gap is still NaN."""
    tol = 2e-2 if cfg.out_dtype == "bf16" else 4e-3
    written = torch.zeros(layout.numel, dtype=torch.bool, device="cuda")
    worst = 0.0
    for l, mb, nb, off, rows, cols in layout.tiles:
        r0 = l * layout.block_rows + mb * cfg.tile_m
        c0 = nb * cfg.tile_n
        got = packed[off:off + rows * cols].view(rows, cols).double()
        want = ref[r0:r0 + rows, c0:c0 + cols]
        scale = want.abs().max().clamp(min=1.0)
        err = ((got - want).abs().max() / scale).item()
        assert err < tol, f"{_name(cfg)}: tile {(l, mb, nb)} at offset {off}: max rel err {err:.3g}"
        worst = max(worst, err)
        written[off:off + rows * cols] = True
    assert torch.isnan(packed[~written].double()).all(), f"{_name(cfg)}: a write outside every tile's slot"
    return worst


def _cases(cfg):
    """(L, block_rows, N, K) shapes: partial tiles on both edges, K tails, several blocks whose
    rows are not multiples of BM, a single tile, a multi-wave square."""
    cases = [(1, 512, 1024, 256), (1, 777, 1234, 999), (1, 1000, 1234, 999), (4, 300, 520, 72),
             (1, 1, 1, 1), (1, 2048, 2048, 1024), (2, 256, 3 * cfg.tile_n, 64)]
    if cfg.arch == 80:  # 8-element vectors along K, and N for a row-major b
        cases = [(L, r, n, k) for L, r, n, k in cases if k % 8 == 0 and (cfg.b_col_major or n % 8 == 0)]
    return cases


@pytest.mark.parametrize("cfg", CONFIGS, ids=_name)
def test_every_path_against_float64(cfg, libraries):
    lib = libraries[cfg]
    ctas = lib.max_ctas(torch.cuda.current_device()) // cfg.cta_multiple * cfg.cta_multiple
    gen = torch.Generator(device="cuda").manual_seed(random.randrange(2**31))
    ran = 0
    half = max(cfg.cta_multiple, ctas // 2 // cfg.cta_multiple * cfg.cta_multiple)
    for case_index, (L, block_rows, n, k) in enumerate(_cases(cfg)):
        layout = Layout(cfg, L, block_rows, n)
        if not layout.fits:
            continue  # the backend runs the 1x1 build for such an order
        ops = _operands(cfg, L * block_rows, n, k, gen, rowwise=case_index % 2 == 0)
        for counters_on, grid in ((True, ctas), (False, half)):
            case = (f"{_name(cfg)}: {L} block(s) x {block_rows} rows, N={n}, K={k}, "
                    f"{len(layout.tiles)} tiles, grid {grid}, counters {'on' if counters_on else 'off'}")
            packed = torch.full((layout.numel,), float("nan"), dtype=DTYPE[cfg.out_dtype], device="cuda")
            counters = torch.zeros(len(layout.sizes), dtype=torch.int32, device="cuda") if counters_on else None
            try:
                keep = _run(lib, cfg, layout, ops, k, packed, counters, grid)
                torch.cuda.synchronize()
                del keep
                _check_packed(cfg, layout, packed, ops.ref)
            except (AssertionError, RuntimeError) as e:
                raise AssertionError(f"{case}: {e}") from e
            if counters is not None:
                assert counters.tolist() == layout.sizes, f"{case}: counters {counters.tolist()} != {layout.sizes}"
            ran += 1
    assert ran >= 4, f"{_name(cfg)}: only {ran} cases suited the cluster"


@pytest.mark.parametrize("cfg", [c for c in CONFIGS if c.epilogue in ("tma", "staged")], ids=_name)
def test_unaligned_packed_buffer_takes_the_checked_path(cfg, libraries):
    """A packed pointer that is not 16-byte aligned: no TMA map, no 16-byte stores, still exact."""
    lib = libraries[cfg]
    ctas = lib.max_ctas(torch.cuda.current_device()) // cfg.cta_multiple * cfg.cta_multiple
    gen = torch.Generator(device="cuda").manual_seed(random.randrange(2**31))
    layout = Layout(cfg, 1, 512, 1024, gaps=())
    ops = _operands(cfg, 512, 1024, 256, gen)
    store = torch.full((layout.numel + 1,), float("nan"), dtype=DTYPE[cfg.out_dtype], device="cuda")
    packed = store[1:]  # 2 bytes past an aligned allocation
    counters = torch.zeros(len(layout.sizes), dtype=torch.int32, device="cuda")
    keep = _run(lib, cfg, layout, ops, 256, packed, counters, ctas)
    torch.cuda.synchronize()
    del keep
    _check_packed(cfg, layout, packed, ops.ref)
    assert counters.tolist() == layout.sizes


@pytest.mark.parametrize("mode", sorted(kernels.WAIT_MODES))
@pytest.mark.parametrize("cfg", CONFIGS, ids=_name)
def test_counter_release_orders_the_data(cfg, mode, libraries, runtime):
    """The moment a group's counter reaches its size, a consumer stream copies the group's
    slots: the copy must equal the final output, every run (no counter before its data)."""
    lib = libraries[cfg]
    ctas = lib.max_ctas(torch.cuda.current_device()) // cfg.cta_multiple * cfg.cta_multiple
    gen = torch.Generator(device="cuda").manual_seed(random.randrange(2**31))
    m = n = 4096
    k = 2048
    layout = Layout(cfg, 1, m, n, gaps=(0,), groups=8)
    ops = _operands(cfg, m, n, k, gen)
    dt = DTYPE[cfg.out_dtype]
    packed = torch.empty(layout.numel, dtype=dt, device="cuda")
    snap = torch.empty_like(packed)
    counters = torch.zeros(len(layout.sizes), dtype=torch.int32, device="cuda")
    spans = []
    for g in range(len(layout.sizes)):
        offs = [t[3] for t, gg in zip(layout.tiles, layout.group.tolist()) if gg == g]
        ends = [t[3] + t[4] * t[5] for t, gg in zip(layout.tiles, layout.group.tolist()) if gg == g]
        spans.append((min(offs), max(ends)))
    # the tiles' own elements: where BN does not divide N (128x160, 128x224), a full tile
    # aligned to BN after a partial one leaves a gap (NaN in packed, never copied where it
    # lies between two groups' spans)
    in_tile = torch.zeros(layout.numel, dtype=torch.bool, device="cuda")
    for t in layout.tiles:
        in_tile[t[3]:t[3] + t[4] * t[5]] = True
    comm = torch.cuda.Stream(priority=-1)
    # Load every kernel first: a lazy first launch would wait for an idle device.
    snap.copy_(packed)
    packed.fill_(float("nan"))
    runtime.reset_counters(counters.data_ptr(), len(layout.sizes), torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    bad, runs = 0, 10
    for _ in range(runs):
        packed.fill_(float("nan"))
        snap.fill_(0)
        runtime.reset_counters(counters.data_ptr(), len(layout.sizes), torch.cuda.current_stream().cuda_stream)
        comm.wait_stream(torch.cuda.current_stream())
        keep = _run(lib, cfg, layout, ops, k, packed, counters, ctas)  # before the waits
        with torch.cuda.stream(comm):
            for g, (lo, hi) in enumerate(spans):
                runtime.wait_counter(counters.data_ptr() + 4 * g, layout.sizes[g],
                                     kernels.WAIT_MODES[mode], comm.cuda_stream)
                snap[lo:hi].copy_(packed[lo:hi])
        torch.cuda.synchronize()
        del keep
        got, want = snap[in_tile], packed[in_tile]
        same = torch.equal(got.view(torch.int16), want.view(torch.int16))
        bad += int(not same or bool(torch.isnan(got.double()).any()))
    assert bad == 0, f"{_name(cfg)} ({mode}): {bad} of {runs} runs saw a region before its data"


@pytest.mark.parametrize("cfg", [c for c in CONFIGS if c.epilogue in ("tma", "staged")
                                 and c.dtype not in build.FP8_DTYPES][:3], ids=_name)
def test_graph_replay_with_new_inputs(cfg, libraries):
    """One launch captured in a CUDA graph (the TMA store map is a kernel parameter) and
    replayed with fresh inputs copied in: every replay exact."""
    lib = libraries[cfg]
    ctas = lib.max_ctas(torch.cuda.current_device()) // cfg.cta_multiple * cfg.cta_multiple
    gen = torch.Generator(device="cuda").manual_seed(random.randrange(2**31))
    layout = Layout(cfg, 1, 1024, 1024, gaps=())
    ops = _operands(cfg, 1024, 1024, 512, gen)
    a, lda, b, ldb = ops.a, ops.lda, ops.b, ops.ldb
    packed = torch.full((layout.numel,), float("nan"), dtype=DTYPE[cfg.out_dtype], device="cuda")
    counters = torch.zeros(len(layout.sizes), dtype=torch.int32, device="cuda")
    items, group = layout.items.cuda(), layout.group.cuda()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())

    def launch():
        lib.run(a.data_ptr(), b.data_ptr(), packed.data_ptr(), 1, 1024, 1024, 512, lda, ldb,
                items.data_ptr(), group.data_ptr(), len(layout.tiles), counters.data_ptr(), ctas,
                None, None, torch.cuda.current_stream().cuda_stream)

    with torch.cuda.stream(stream):
        launch()  # warm (loads the kernel, builds the TMA maps)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        launch()
    for replay in range(3):
        fresh = _operands(cfg, 1024, 1024, 512, gen)
        ref = fresh.ref
        a.copy_(fresh.a)
        b.copy_(fresh.b)
        packed.fill_(float("nan"))
        counters.zero_()
        graph.replay()
        torch.cuda.synchronize()
        _check_packed(cfg, layout, packed, ref)
        assert counters.tolist() == layout.sizes, f"replay {replay}: counters {counters.tolist()}"
