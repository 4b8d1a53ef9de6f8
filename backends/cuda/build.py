"""Just-in-time build of FlashOverlap's CUDA kernel libraries and runtime.

Every GEMM configuration (tile, cluster, schedule, dtype, layout of b) is one shared object
compiled from ``csrc/cuda/gemm_sm90.cu`` or ``gemm_sm80.cu`` with ``-D`` macros (fp8
all_to_all's builds from ``gemm_sm90_blocks_scaled.cu``, fp8 allgather's from
``gemm_sm90_ex_scaled.cu``: :func:`gemm_source`); it exports the C ABI of
``csrc/cuda/gemm_api.h`` and depends on the ABI of no torch or Python build.
The device-side waits, counter resets, post-reorders, the prepared calls and NCCL's entry points
live in the runtime, a Python extension module (pybind11) linked from its translation units
(``RUNTIME_SOURCES``, one per call kind) and ``runtime_binding.cpp``, the one file that lists
what Python may call. It is built for the Python that runs it (its ABI is in the file name and
the hash) and loads the GEMM libraries itself. Everything links the CUDA runtime statically and
needs no torch headers.

Objects are cached under ``$FLASHOVERLAP_CACHE_DIR`` (default ``~/.cache/flashoverlap``), in
``cuda/{config name}-{hash of sources and flags}-{hash of the toolchain}.so`` (the runtime:
``.so`` is Python's extension suffix, e.g. ``.cpython-312-x86_64-linux-gnu.so``); the toolchain
is nvcc's version, and CUTLASS's or pybind11's where the job uses them. A build runs under a
file lock and is renamed into place atomically, so concurrent processes (one per rank) build
once. ``FLASHOVERLAP_NO_JIT=1`` forbids compiling, and a machine without nvcc uses any object
built from the same sources and flags (``flashoverlap build`` elsewhere, cache copied): a
missing object is then an error that says how to prebuild it.

This module imports no torch and creates no device context.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

DTYPES = {"bf16": 0, "fp16": 1, "e4m3": 2}  # name in a config -> FO_DTYPE (of a and b)
OUT_DTYPES = {"bf16": 0, "fp16": 1}  # -> FO_OUT_DTYPE (of the packed output)
FP8_DTYPES = ("e4m3",)  # scaled builds (fo_gemm_run_scaled); sm90 only
DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "bf16": "bf16", "fp16": "fp16",
                 "float8_e4m3fn": "e4m3", "e4m3": "e4m3"}
SCHEDULES = {90: {"cooperative": 0, "pingpong": 1}, 80: {"multistage": 2}}
# Epilogues per architecture -> FO_EPILOGUE (csrc/cuda/gemm_sm90.cu and gemm_sm80.cu say what
# each does). "none" skips full tiles' stores: an upper bound for measurements, wrong output.
EPILOGUES = {90: {"direct": 0, "tma": 1, "vec16": 2, "none": 3, "tma_wg": 4},
             80: {"direct": 0, "staged": 1, "none": 3}}
TMA_EPILOGUES = ("tma", "tma_wg")  # sm90: shared-memory slots (epi_slots) and TMA stores


class BuildError(RuntimeError):
    """A kernel library could not be found or compiled."""


@dataclass(frozen=True)
class GemmConfig:
    """One compiled signaling-GEMM configuration."""

    arch: int = 90  # 90: sm_90a (Hopper); 80: sm_80 code that runs on sm_80/86/89/90
    tile_m: int = 128
    tile_n: int = 256
    tile_k: int = 64
    cluster_m: int = 2
    cluster_n: int = 1
    dtype: str = "bf16"  # of a and b ("bf16"/"bfloat16", "fp16"/"float16", "e4m3"/"float8_e4m3fn");
    # fp32 accumulation
    b_col_major: bool = True  # b is [N, K] row-major (weight.t() of an nn.Linear)
    schedule: str = "cooperative"  # sm90: cooperative | pingpong; sm80: multistage
    stages: int = 0  # mainloop pipeline stages; 0: as many as fit (sm90), 4 (sm80)
    epilogue: str = "direct"  # how tiles leave the math threads (EPILOGUES)
    epi_slots: int = 0  # sm90 tma: shared-memory slots, one column block each (0: 2)
    blocks: bool = False  # destination blocks of unequal rows too (all_to_all's per-call layout)
    out_dtype: str = ""  # of the output: e4m3 builds "bf16" (default) or "fp16"; else dtype's
    fast_accum: bool = True  # e4m3: accumulate in the tensor cores throughout (CUTLASS's
    # FP8FastAccum), or (False) promote into fp32 registers every 4 MMAs ("splitacc")
    block_scaled: bool = False  # e4m3 with block-wise scales (1x128 groups of a, 128x128 blocks
    # of b) applied in the main loop, promoted every 128 k (FO_FP8_BLOCK; cooperative 128x128x128)
    scale_tma: bool = True  # block_scaled: scale_a's K tiles by TMA where its layout allows;
    # False: always the scale warp's cp.async copies (FO_SCALE_TMA=0, name suffix _cpa)
    scale_warp: bool = False  # e4m3 tensor-/row-wise (sm90): a producer warp stages each item's
    # scales, tracked by its first stage's barrier (FO_SCALE_WARP=1, name suffix _scw), instead
    # of the math threads before the item's main loop
    item_prefetch: bool = False  # sm90: the producer stages the next round's table rows in
    # shared memory a round ahead (FO_ITEM_PREFETCH=1, name suffix _ipf)
    signal_defer: bool = False  # tma_wg: each tile is signalled at its math group's next
    # epilogue, not after waiting for its writes (FO_WG_DEFER=1, name suffix _dsig)
    block_lockstep: bool = False  # block_scaled: the two math warpgroups run each tile's K loop
    # in step, as CUTLASS's block-scaled main loop does, instead of half a K tile apart
    # (FO_BLOCK_LOCKSTEP=1, name suffix _lock)
    block_pipe: bool = False  # block_scaled, tile_n 128: two partial fragments, so a K tile's
    # wgmmas run while the previous one's are promoted (FO_BLOCK_PIPE=1, name suffix _pipe)
    stock: bool = False  # e4m3 (sm90): CUTLASS's own persistent kernel with FlashOverlap's item
    # scheduler and signaling epilogue (gemm_sm90_stock.cu, name suffix _stock): in-place "rows"
    # results only, no unequal blocks; tile_k 128; the epilogue fields do not apply
    stock_epi_n: int = 0  # stock: the width of CUTLASS's epilogue tile (FO_STOCK_EPI_N, "_enN"
    # in the name before "_stock"; 64 rows pingpong, 128 cooperative); 0: its EpilogueTileAuto
    # (64x32, 128x32)
    gather: bool = False  # e4m3 for allgather: its source (gemm_sm90_ex_scaled.cu, stock:
    # gemm_sm90_stock_ex_scaled.cu) adds fo_gemm_run_ex_scaled, the GEMM whose items wait for
    # their rows, with scales (no -D macro: the source alone tells it apart, so every other
    # build keeps its name and cached object)

    def __post_init__(self):
        object.__setattr__(self, "dtype", DTYPE_ALIASES.get(self.dtype, self.dtype))
        out = DTYPE_ALIASES.get(self.out_dtype, self.out_dtype)
        if not out:
            out = "bf16" if self.dtype in FP8_DTYPES else self.dtype
        object.__setattr__(self, "out_dtype", out)
        problems = self.problems()
        if problems:
            raise ValueError(f"invalid GEMM config {self}: " + "; ".join(problems))

    def problems(self) -> list[str]:
        out = []
        if self.arch not in SCHEDULES:
            return [f"arch must be one of {sorted(SCHEDULES)}, got {self.arch!r}"]
        if self.dtype not in DTYPES:
            out.append(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        out += self._fp8_problems()
        if self.schedule not in SCHEDULES[self.arch]:
            out.append(f"schedule for sm{self.arch} must be one of {sorted(SCHEDULES[self.arch])}, "
                       f"got {self.schedule!r}")
        if self.stages != 0 and not 2 <= self.stages <= 12:
            out.append(f"stages must be 0 (auto) or 2..12, got {self.stages}")
        if self.epilogue not in EPILOGUES[self.arch]:
            out.append(f"epilogue for sm{self.arch} must be one of {sorted(EPILOGUES[self.arch])}, "
                       f"got {self.epilogue!r}")
        if self.epi_slots and self.epilogue not in TMA_EPILOGUES:
            out.append(f"epi_slots applies to the tma epilogues only, got {self.epi_slots} with "
                       f"{self.epilogue!r}")
        if self.epilogue in TMA_EPILOGUES and (self.tile_n % 32 or not 0 <= self.epi_slots <= self.column_blocks):
            out.append(f"the tma epilogue needs tile_n % 32 == 0 and epi_slots in 0..its column "
                       f"blocks (tile_n / 64, or tile_n / 32 where tile_n % 64 != 0), got "
                       f"tile_n={self.tile_n}, epi_slots={self.epi_slots}")
        if self.epilogue == "vec16" and self.tile_n % 32:
            out.append(f"the vec16 epilogue needs tile_n % 32 == 0, got {self.tile_n}")
        if self.item_prefetch and self.arch != 90:
            out.append("item_prefetch applies to sm90 builds")
        if self.signal_defer and self.epilogue != "tma_wg":
            out.append(f"signal_defer applies to the tma_wg epilogue, got {self.epilogue!r}")
        if self.block_lockstep and not self.block_scaled:
            out.append("block_lockstep applies to block-scaled builds")
        if self.block_pipe and not (self.block_scaled and self.tile_n == 128):
            out.append("block_pipe applies to block-scaled builds with tile_n 128")
        if self.arch == 90:
            min_m = 128 if self.schedule == "cooperative" else 64
            if self.tile_m % min_m or self.tile_m > 256:
                out.append(f"{self.schedule} tile_m must be a multiple of {min_m} up to 256, "
                           f"got {self.tile_m}")
            if self.tile_n % 16 or not 16 <= self.tile_n <= 256:
                out.append(f"tile_n must be a multiple of 16 in 16..256, got {self.tile_n}")
            if self.tile_k % 16 or not 16 <= self.tile_k <= 128:
                out.append(f"tile_k must be a multiple of 16 in 16..128, got {self.tile_k}")
            if self.cluster_m < 1 or self.cluster_n < 1 or self.cluster_m * self.cluster_n > 8:
                out.append(f"cluster {self.cluster_m}x{self.cluster_n}: need sizes >= 1, "
                           "product <= 8")
        else:
            if self.tile_m % 64 or self.tile_n % 64 or self.tile_m * self.tile_n > 128 * 256:
                out.append(f"sm80 tile_m and tile_n must be multiples of 64 (one warp per 64x64), "
                           f"at most 128x256 in all, got {self.tile_m}x{self.tile_n}")
            if self.tile_k not in (32, 64):
                out.append(f"sm80 tile_k must be 32 or 64, got {self.tile_k}")
            if (self.cluster_m, self.cluster_n) != (1, 1):
                out.append("sm80 has no clusters: cluster must be 1x1")
        return out

    def _fp8_problems(self) -> list[str]:
        if self.dtype not in FP8_DTYPES:
            out = [] if self.fast_accum else ["fast_accum applies to e4m3 builds"]
            if self.block_scaled or not self.scale_tma or self.scale_warp:
                out.append("block_scaled, scale_tma and scale_warp apply to e4m3 builds")
            if self.stock or self.stock_epi_n:
                out.append("stock (CUTLASS's kernel, gemm_sm90_stock.cu) and its stock_epi_n are "
                           "for e4m3 builds")
            if self.gather:
                out.append("gather applies to e4m3 builds (a 16-bit allgather runs "
                           "fo_gemm_run_ex, which every build has)")
            if self.dtype in DTYPES and self.out_dtype != self.dtype:
                out.append(f"a {self.dtype} build writes {self.dtype}, got out_dtype "
                           f"{self.out_dtype!r} (out_dtype is for e4m3 builds)")
            return out
        out = []
        if self.out_dtype not in OUT_DTYPES:
            out.append(f"e4m3 out_dtype must be one of {sorted(OUT_DTYPES)}, got {self.out_dtype!r}")
        if self.arch != 90:
            out.append("e4m3 needs sm90 (fp8 wgmma); sm80 kernels take bf16 and fp16")
        if not self.b_col_major:
            out.append("e4m3 b must be column-major (fp8 wgmma reads both operands K-major)")
        if self.tile_k % 32:
            out.append(f"e4m3 tile_k must be a multiple of 32 (one fp8 wgmma), got {self.tile_k}")
        if self.scale_warp and self.block_scaled:
            out.append("scale_warp is for tensor- and row-wise scales (a block-scaled build's "
                       "scale warp already loads its scales)")
        if self.block_scaled and (self.schedule != "cooperative" or self.tile_m != 128
                                  or self.tile_k != 128 or self.tile_n not in (128, 256)
                                  or not self.fast_accum):
            out.append("block_scaled needs the cooperative schedule, 128 x (128 or 256) x 128 "
                       "tiles (one group of 128 k per K tile, one or two 128-column blocks of b "
                       "per tile) and fast_accum (its main loop promotes per group), got "
                       f"{self.schedule} {self.tile_m}x{self.tile_n}x{self.tile_k}, "
                       f"fast_accum={self.fast_accum}")
        if not self.scale_tma and not self.block_scaled:
            out.append("scale_tma=False applies to block_scaled builds (how their scales load)")
        if self.gather and self.blocks:
            out.append("gather (allgather's fo_gemm_run_ex_scaled) and blocks (all_to_all's "
                       "fo_gemm_run_blocks_scaled) are builds of their own: not both")
        if self.stock:
            if (self.blocks or self.scale_warp or self.item_prefetch
                    or self.signal_defer or self.block_lockstep or self.block_pipe
                    or not self.scale_tma or self.stages or self.tile_k != 128
                    or not self.fast_accum or self.epilogue != "tma" or self.epi_slots):
                out.append("stock (CUTLASS's kernel, gemm_sm90_stock.cu) takes tile_k 128, fast "
                           "accumulation, its own TMA epilogue (epilogue 'tma', no slots), its own "
                           "stage count, and none of blocks, scale_warp, item_prefetch, "
                           "signal_defer, block_lockstep, block_pipe, scale_tma=False")
            if self.block_scaled and self.tile_n % 128:
                out.append(f"stock block_scaled needs whole 128-column blocks of b per tile, got "
                           f"tile_n {self.tile_n}")
        if self.stock_epi_n and not (self.stock and self.stock_epi_n % 16 == 0
                                     and self.tile_n % self.stock_epi_n == 0):
            out.append(f"stock_epi_n (the stock build's epilogue tile width) needs stock=True, a "
                       f"multiple of 16 that divides tile_n, got {self.stock_epi_n} with "
                       f"stock={self.stock}, tile_n={self.tile_n}")
        return out

    @property
    def tile(self) -> tuple[int, int]:
        return (self.tile_m, self.tile_n)

    @property
    def cta_multiple(self) -> int:
        return self.cluster_m * self.cluster_n

    @property
    def column_blocks(self) -> int:
        """sm90 tma epilogues: the column blocks of a tile, one shared-memory slot and one TMA
        store each: 64 columns, or 32 where tile_n is not a multiple of 64 and always for
        tma_wg (gemm_sm90.cu)."""
        return self.tile_n // (64 if self.tile_n % 64 == 0 and self.epilogue != "tma_wg" else 32)


def default_config(arch: int, dtype: str = "bf16", b_col_major: bool = True,
                   epilogue: str = "direct") -> GemmConfig:
    """A representative configuration (the kernel table in kernels.py says what plans run)."""
    if arch >= 90:
        return GemmConfig(arch=90, dtype=dtype, b_col_major=b_col_major, epilogue=epilogue)
    return GemmConfig(arch=80, tile_m=128, tile_n=128, tile_k=32, cluster_m=1, cluster_n=1,
                      dtype=dtype, b_col_major=b_col_major, schedule="multistage",
                      epilogue=epilogue)


def config_name(config: GemmConfig) -> str:
    """A file-name-safe name that identifies the configuration, e.g.
    ``sm90_bf16_bcol_128x256x64_c2x1_cooperative``, ``sm90_e4m3_bf16_bcol_...`` (e4m3 a and b,
    bf16 out; ``_splitacc`` without fast accumulation; ``_gather``: fp8 allgather's)."""
    layout = "bcol" if config.b_col_major else "brow"
    dtypes = config.dtype + (f"_{config.out_dtype}" if config.dtype in FP8_DTYPES else "")
    name = (f"sm{config.arch}_{dtypes}_{layout}_{config.tile_m}x{config.tile_n}x{config.tile_k}"
            f"_c{config.cluster_m}x{config.cluster_n}_{config.schedule}")
    if not config.fast_accum:
        name += "_splitacc"
    if config.block_scaled:
        name += "_block128" + ("" if config.scale_tma else "_cpa")
        name += ("_lock" if config.block_lockstep else "") + ("_pipe" if config.block_pipe else "")
    if config.stages:
        name += f"_s{config.stages}"
    if config.scale_warp:
        name += "_scw"
    if config.item_prefetch:
        name += "_ipf"
    if config.signal_defer:
        name += "_dsig"
    if config.epilogue != "direct":
        name += f"_e{config.epilogue}{config.epi_slots or ''}"
    if config.stock_epi_n:  # (before _gather and _stock: names end in "_stock", "_gather_stock")
        name += f"_en{config.stock_epi_n}"
    if config.blocks:
        name += "_blocks"
    if config.gather:
        name += "_gather"
    if config.stock:
        name += "_stock"
    return name


# ---- tools and paths -------------------------------------------------------------------------

def source_dir() -> Path:
    """csrc/cuda: from the installed ``flashoverlap_csrc`` package, else beside this repo."""
    candidates = []
    spec = importlib.util.find_spec("flashoverlap_csrc")
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) / "cuda" for p in spec.submodule_search_locations]
    candidates.append(Path(__file__).resolve().parents[2] / "csrc" / "cuda")
    for path in candidates:
        if (path / "flashoverlap_cuda.h").is_file():
            return path
    raise BuildError("FlashOverlap's CUDA sources (csrc/cuda/flashoverlap_cuda.h) were not found in "
                     + ", ".join(map(str, candidates)) + "; reinstall flashoverlap")


def find_nvcc() -> str | None:
    """nvcc from $CUDA_HOME (or $CUDA_PATH), else from PATH, else /usr/local/cuda; None if none."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            path = Path(os.environ[var]) / "bin" / "nvcc"
            if path.is_file():
                return str(path)
    found = shutil.which("nvcc")
    if found:
        return found
    return "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").is_file() else None


def nvcc_path() -> str:
    nvcc = find_nvcc()
    if nvcc is None:
        raise BuildError("nvcc was not found: install the CUDA toolkit (12.4 or newer) and set "
                         "CUDA_HOME or put nvcc on PATH, or prebuild the kernels with "
                         "`flashoverlap build` on a machine that has it and copy the cache")
    return nvcc


@lru_cache(maxsize=None)
def nvcc_version(nvcc: str) -> str:
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise BuildError(f"{nvcc} --version failed: {e}") from None
    return out.strip().splitlines()[-1]


def cutlass_include_dirs() -> list[Path]:
    """CUTLASS headers shipped in the ``nvidia-cutlass`` package (module ``cutlass_library``)."""
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or spec.origin is None:
        raise BuildError("the CUTLASS headers are missing: pip install nvidia-cutlass "
                         "(or pip install 'flashoverlap[cuda]')")
    root = Path(spec.origin).parent / "source"
    dirs = [root / "include", root / "tools" / "util" / "include"]
    if not (dirs[0] / "cutlass" / "cutlass.h").is_file():
        raise BuildError(f"the nvidia-cutlass package at {root.parent} has no CUTLASS headers under "
                         f"{dirs[0]}; reinstall it: pip install --force-reinstall nvidia-cutlass")
    return dirs


def cutlass_version(include: Path) -> str:
    """major.minor.patch from the headers' cutlass/version.h ("unknown" if unreadable)."""
    try:
        text = (include / "cutlass" / "version.h").read_text()
    except OSError:
        return "unknown"
    parts = [re.search(rf"#define\s+CUTLASS_{p}\s+(\d+)", text) for p in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) for m in parts) if all(parts) else "unknown"


def python_include_dirs() -> list[Path]:
    """pybind11's headers and this Python's (Python.h), for the runtime's binding."""
    try:
        import pybind11
    except ImportError:
        raise BuildError("pybind11 is missing (the runtime's Python binding is built with it): "
                         "pip install pybind11 (or pip install 'flashoverlap[cuda]')") from None
    paths = sysconfig.get_paths()
    dirs = list(dict.fromkeys(Path(paths[k]) for k in ("include", "platinclude") if paths.get(k)))
    if not any((d / "Python.h").is_file() for d in dirs):
        raise BuildError(f"this Python's C headers (Python.h) are not in {', '.join(map(str, dirs))}: "
                         "install its development package (e.g. python3-dev, python3.12-dev)")
    return [Path(pybind11.get_include())] + dirs


def extension_suffix() -> str:
    """The file suffix of this Python's extension modules (its ABI)."""
    return sysconfig.get_config_var("EXT_SUFFIX") or ".so"


def cache_dir() -> Path:
    """Where built objects live: $FLASHOVERLAP_CACHE_DIR, else ~/.cache/flashoverlap."""
    if os.environ.get("FLASHOVERLAP_CACHE_DIR"):
        base = Path(os.environ["FLASHOVERLAP_CACHE_DIR"])
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flashoverlap"
    return base / "cuda"


def jit_allowed() -> bool:
    return os.environ.get("FLASHOVERLAP_NO_JIT", "") in ("", "0")


# ---- flags -----------------------------------------------------------------------------------

GENCODE = {
    "sm90": ["-gencode=arch=compute_90a,code=sm_90a"],
    # sm_80 machine code runs on sm_80/86/89; sm_90 machine code on Hopper; PTX for later GPUs.
    "sm80": ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90",
             "-gencode=arch=compute_80,code=compute_80"],
    "runtime": ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90a,code=sm_90a",
                "-gencode=arch=compute_80,code=compute_80"],
}
COMMON_FLAGS = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-DNDEBUG", "--threads=2",
                "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden"]
LINK_FLAGS = ["-shared", "--cudart=static"]


def gemm_defines(config: GemmConfig) -> list[str]:
    return [
        f"-DFO_TILE_M={config.tile_m}", f"-DFO_TILE_N={config.tile_n}", f"-DFO_TILE_K={config.tile_k}",
        f"-DFO_CLUSTER_M={config.cluster_m}", f"-DFO_CLUSTER_N={config.cluster_n}",
        f"-DFO_DTYPE={DTYPES[config.dtype]}", f"-DFO_B_COL_MAJOR={int(config.b_col_major)}",
        f"-DFO_SCHEDULE={SCHEDULES[config.arch][config.schedule]}", f"-DFO_STAGES={config.stages}",
        f"-DFO_EPILOGUE={EPILOGUES[config.arch][config.epilogue]}",
    ] + ([f"-DFO_EPI_SLOTS={config.epi_slots}"] if config.epi_slots else []) + (
        ["-DFO_BLOCKS=1"] if config.blocks else []) + (
        [f"-DFO_OUT_DTYPE={OUT_DTYPES[config.out_dtype]}",
         f"-DFO_FP8_FAST_ACCUM={int(config.fast_accum)}"] if config.dtype in FP8_DTYPES else []) + (
        ["-DFO_FP8_BLOCK=1"] if config.block_scaled else []) + (
        ["-DFO_SCALE_TMA=0"] if not config.scale_tma else []) + (
        ["-DFO_SCALE_WARP=1"] if config.scale_warp else []) + (
        ["-DFO_ITEM_PREFETCH=1"] if config.item_prefetch else []) + (
        ["-DFO_WG_DEFER=1"] if config.signal_defer else []) + (
        ["-DFO_BLOCK_LOCKSTEP=1"] if config.block_lockstep else []) + (
        ["-DFO_BLOCK_PIPE=1"] if config.block_pipe else []) + (
        [f"-DFO_STOCK_EPI_N={config.stock_epi_n}"] if config.stock_epi_n else [])


@dataclass(frozen=True)
class Job:
    """One object to build: its name, nvcc flags, source files (of csrc/cuda), and what it
    includes beyond them: CUTLASS, or Python and pybind11 (an extension module of this Python)."""

    name: str
    flags: tuple[str, ...]
    sources: tuple[str, ...]
    needs_cutlass: bool = False
    python: bool = False

    @property
    def suffix(self) -> str:
        return extension_suffix() if self.python else ".so"


def gemm_source(config: GemmConfig) -> str:
    """The source file (csrc/cuda) of a configuration: gemm_sm90.cu or gemm_sm80.cu; for e4m3
    builds with unequal destination blocks (fp8 all_to_all's) gemm_sm90_blocks_scaled.cu, which
    is gemm_sm90.cu plus fo_gemm_run_blocks_scaled (gemm_blocks_scaled.h), and for fp8
    allgather's (gather=True) gemm_sm90_ex_scaled.cu, gemm_sm90.cu plus fo_gemm_run_ex_scaled
    (gemm_ex_scaled.h), on CUTLASS's kernel (stock) gemm_sm90_stock_ex_scaled.cu: sources of
    their own, so that every other configuration's source, and so its cached object, stays as
    it is."""
    if config.arch != 90:
        return "gemm_sm80.cu"
    if config.dtype in FP8_DTYPES and config.gather:
        return "gemm_sm90_stock_ex_scaled.cu" if config.stock else "gemm_sm90_ex_scaled.cu"
    if config.stock:
        return "gemm_sm90_stock.cu"
    return "gemm_sm90_blocks_scaled.cu" if config.blocks and config.dtype in FP8_DTYPES \
        else "gemm_sm90.cu"


def _gemm_job(config: GemmConfig) -> Job:
    """The job of one GEMM configuration."""
    source = gemm_source(config)
    flags = GENCODE[f"sm{config.arch}"] + COMMON_FLAGS + gemm_defines(config) + LINK_FLAGS
    return Job(config_name(config), tuple(flags), (source,), needs_cutlass=True)


# The runtime object's translation units (csrc/cuda), one per call kind; together they define
# every runtime function of flashoverlap_cuda.h (tests/test_cuda_sources_cpu.py checks it).
RUNTIME_SOURCES = ("runtime.cu", "nccl.cu", "overlap_call.cu", "add_rmsnorm.cu", "gather_call.cu",
                   "all_to_all_call.cu")
# Their Python binding (pybind11, compiled by the host compiler through nvcc), linked with them
# into one extension module.
BINDING_SOURCE = "runtime_binding.cpp"
RUNTIME_JOB = Job("runtime", tuple(GENCODE["runtime"] + COMMON_FLAGS + LINK_FLAGS),
                  RUNTIME_SOURCES + (BINDING_SOURCE,), python=True)


def command(job: Job, output: str | Path) -> list[str]:
    """The nvcc command line of a job."""
    src = source_dir()
    includes = [src] + (cutlass_include_dirs() if job.needs_cutlass else []) + (
        python_include_dirs() if job.python else [])
    return ([nvcc_path()] + list(job.flags) + [f"-I{d}" for d in includes]
            + [str(src / s) for s in job.sources] + ["-o", str(output)])


# ---- building --------------------------------------------------------------------------------

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def _sources(*sources: str) -> list[Path]:
    """``sources`` and every file of csrc/cuda they include, transitively (quoted includes that
    name a file there; CUTLASS's and pybind11's headers are covered by the toolchain digest)."""
    src = source_dir()
    seen, todo = [], list(sources)
    while todo:
        name = todo.pop()
        path = src / name
        if path in seen or not path.is_file():
            continue
        seen.append(path)
        todo += INCLUDE.findall(path.read_text())
    return sorted(seen)


def _digest(job: Job) -> str:
    """Hash of the job's sources, the csrc/cuda files they include, its flags (include paths
    vary by install) and, for an extension module, the Python ABI: an edit elsewhere in
    csrc/cuda leaves this job's cached object valid."""
    h = hashlib.sha256()
    for path in _sources(*job.sources):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    h.update("\0".join(job.flags + job.sources).encode())
    if job.python:
        h.update(b"\0python " + extension_suffix().encode())
    return h.hexdigest()[:16]


def _toolchain_digest(nvcc: str, job: Job) -> str:
    text = nvcc_version(nvcc)
    # (used?, label, package, include dirs); "cutlass" keeps the cached GEMM objects' names
    for used, label, package, where in (
            (job.needs_cutlass, "cutlass", "nvidia-cutlass", cutlass_include_dirs),
            (job.python, "pybind11", "pybind11", python_include_dirs)):
        if used:
            try:
                text += f"\0{label} " + importlib.metadata.version(package)
            except importlib.metadata.PackageNotFoundError:
                text += f"\0{label} at " + str(where()[0])
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def _prebuilt(job: Job) -> Path | None:
    """An object built from these sources and flags by any nvcc (for machines without nvcc)."""
    found = sorted(cache_dir().glob(f"{job.name}-{_digest(job)}-*{job.suffix}"),
                   key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def _build(job: Job) -> Path:
    """The cached object of a job, compiled first (under a lock) if needed. Its file is
    ``{name}-{hash of sources and flags}-{hash of the toolchain}{suffix}``."""
    name = job.name
    nvcc = find_nvcc()
    if nvcc is None or not jit_allowed():
        found = _prebuilt(job)
        if found is not None:
            return found
        if nvcc is None:
            nvcc_path()  # raises the explained error
        raise BuildError(
            f"{name} is not built and FLASHOVERLAP_NO_JIT is set: prebuild it with "
            f"`flashoverlap build` (same FLASHOVERLAP_CACHE_DIR={cache_dir().parent}) "
            "or unset FLASHOVERLAP_NO_JIT")
    target = cache_dir() / f"{name}-{_digest(job)}-{_toolchain_digest(nvcc, job)}{job.suffix}"
    if target.is_file():
        return target
    from filelock import FileLock  # only needed when compiling

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if target.is_file():  # built by another process while we waited
            return target
        fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=job.suffix, dir=target.parent)
        os.close(fd)
        cmd = command(job, tmp)
        try:
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-40:])
                raise BuildError(f"building {name} failed:\n$ {' '.join(cmd)}\n{tail}")
            os.chmod(tmp, 0o755)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


def build_gemm(config: GemmConfig) -> Path:
    """Path of the shared object of one signaling-GEMM configuration (built if needed)."""
    return _build(_gemm_job(config))


def build_runtime() -> Path:
    """Path of the runtime extension module: waits, counter resets, post-reorders, prepared
    calls, and the loader of the GEMM libraries (built if needed; runtime.load imports it)."""
    return _build(RUNTIME_JOB)


def prebuild(configs, jobs: int | None = None) -> list[Path]:
    """Build the runtime and every configuration in ``configs``, ``jobs`` at a time."""
    configs = list(dict.fromkeys(configs))
    jobs = jobs or max(1, min(len(configs) + 1, os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(build_runtime)] + [pool.submit(build_gemm, c) for c in configs]
        return [f.result() for f in futures]


# ---- compile check (CI: nvcc, no GPU) ---------------------------------------------------------

# Representative configurations, every feature of the kernels in at least one (`build.py
# --all-configs` compiles them all) ...
CHECK_CONFIGS = (
    GemmConfig(),  # sm90 cooperative, bf16, b column-major, cluster 2x1
    GemmConfig(epilogue="tma"),
    GemmConfig(cluster_m=1, epilogue="tma", epi_slots=4, blocks=True),  # all_to_all's
    GemmConfig(tile_n=128, cluster_m=1, cluster_n=2, dtype="fp16", b_col_major=False,
               schedule="pingpong", epilogue="tma"),
    GemmConfig(tile_n=128, schedule="pingpong", epilogue="vec16"),
    GemmConfig(tile_k=128, dtype="e4m3", out_dtype="fp16", epilogue="tma", epi_slots=4,
               scale_warp=True),  # the cooperative fp8 default (kernels.FP8_CONFIGS)
    GemmConfig(tile_n=128, tile_k=128, dtype="e4m3", epilogue="tma", block_scaled=True),
    default_config(80),
    default_config(80, dtype="fp16", b_col_major=False, epilogue="staged"),
    # fp8 all_to_all's (gemm_sm90_blocks_scaled.cu): block-wise (the 128x256 tile: two
    # column blocks of b per tile), and row-wise pingpong
    GemmConfig(tile_k=128, cluster_m=1, dtype="e4m3", epilogue="tma", block_scaled=True,
               blocks=True),
    GemmConfig(tile_n=128, tile_k=128, cluster_m=1, dtype="e4m3", out_dtype="fp16",
               schedule="pingpong", epilogue="tma", blocks=True),
    # fp8 allgather's (gemm_sm90_ex_scaled.cu): row-wise cooperative (not in CI's list)
    GemmConfig(tile_k=128, dtype="e4m3", epilogue="tma", epi_slots=4, gather=True),
    # fp8 on CUTLASS's own kernel (gemm_sm90_stock.cu): tensor-/row-wise pingpong, block-wise
    # cooperative (kernels.STOCK_FP8_CONFIGS)
    GemmConfig(tile_n=128, tile_k=128, dtype="e4m3", schedule="pingpong", epilogue="tma",
               stock=True),
    GemmConfig(tile_n=128, tile_k=128, cluster_m=1, dtype="e4m3", out_dtype="fp16",
               epilogue="tma", block_scaled=True, stock=True),
)
# ... and the compile check's default (CI's): one sm90 16-bit, one sm90 e4m3 scaled and one sm80
# build, each a configuration that plans use (the tma and staged epilogues), fp8 all_to_all's
# block-scaled build (gemm_sm90_blocks_scaled.cu) and the stock fp8 pingpong build
# (gemm_sm90_stock.cu): every GEMM source of its own.
# Between them: both sm90 schedules, both layouts of b, both 16-bit dtypes and fp8 (row-wise
# and block-wise), clusters 1x2 and 2x1, and unequal destination blocks (all_to_all's sm80 and
# fp8 builds). The GPU machine builds every configuration of the kernel table (ci/gpu.sh's
# build stage).
CI_CHECK_CONFIGS = (  # (indices into CHECK_CONFIGS: a test checks what they name)
    CHECK_CONFIGS[3],  # sm90 pingpong 128x128, fp16, b row-major, cluster 1x2, tma
    CHECK_CONFIGS[5],  # sm90 cooperative 128x256x128, e4m3 -> fp16 (scaled, the scale warp), tma4
    replace(CHECK_CONFIGS[8], blocks=True),  # sm80 128x128x32, fp16, b row-major, staged, blocks
    CHECK_CONFIGS[9],  # sm90 cooperative 128x256x128, e4m3 block-scaled, 1x1, tma, blocks
    CHECK_CONFIGS[12],  # fp8 on CUTLASS's own kernel: pingpong 128x128x128, e4m3 row-wise
)
# Host self-tests of the sm90 epilogues' layout assumptions (gemm_sm90_selftest.cu), one per
# accumulator layout: cooperative 128x256 and pingpong 128x128; cooperative 128x224 (the tma
# epilogue's 32-column blocks, 64-byte swizzle); e4m3 row-wise and block-wise (cooperative
# 128x128 and 128x256: the rows its main loop scales by, and its column blocks); the tma_wg
# epilogue of pingpong 128x128x128 e4m3 (32-column blocks).
SELFTEST_CONFIGS = (GemmConfig(epilogue="tma"), GemmConfig(tile_n=128, schedule="pingpong", epilogue="tma"),
                    GemmConfig(tile_n=224, epilogue="tma", epi_slots=4),
                    GemmConfig(tile_k=128, dtype="e4m3", epilogue="tma", epi_slots=4),
                    GemmConfig(tile_n=128, tile_k=128, dtype="e4m3", epilogue="tma",
                               block_scaled=True),
                    GemmConfig(tile_k=128, dtype="e4m3", epilogue="tma", block_scaled=True),
                    GemmConfig(tile_n=128, tile_k=128, dtype="e4m3", schedule="pingpong",
                               epilogue="tma_wg"))


def selftest_job(config: GemmConfig) -> Job:
    """The job that builds the host self-test program of an sm90 configuration."""
    gemm = _gemm_job(config)
    flags = [f for f in gemm.flags if f not in LINK_FLAGS] + ["-DFO_LAYOUT_SELFTEST"]
    return Job("selftest_" + gemm.name, tuple(flags), ("gemm_sm90_selftest.cu",), needs_cutlass=True)


# Imports the runtime extension module in a fresh interpreter, which binds every symbol at load
# (Python dlopens with RTLD_NOW): a symbol that no translation unit defines fails the import.
_IMPORT_RUNTIME = """import importlib.machinery, importlib.util, sys
loader = importlib.machinery.ExtensionFileLoader("fo_runtime", sys.argv[1])
loader.exec_module(importlib.util.module_from_spec(
    importlib.util.spec_from_file_location("fo_runtime", sys.argv[1], loader=loader)))
"""


def compile_check(out_dir: str | Path, jobs: int = 2, selftests: bool = True,
                  configs=CI_CHECK_CONFIGS) -> bool:
    """Compile every CUDA source for its architectures, in representative configurations
    (``configs``), build the runtime extension module from all its translation units and its
    binding and import it (no symbol left undefined), and build and run the sm90 layout
    self-tests (host programs, no GPU); print one line per job. True when all passed.

    The runtime is the cached object of :func:`build_runtime` (content-addressed by sources,
    flags and toolchain), so a run that built it already (the CPU tests of its binding) does
    not compile it again."""
    import sys
    import time

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    checks = [_gemm_job(c) for c in configs] + (
        [selftest_job(c) for c in SELFTEST_CONFIGS] if selftests else [])
    # the slowest first (sm80 builds three architectures; the runtime, when not cached yet,
    # compiles its units one after another): two workers then finish at about the same time
    checks.sort(key=lambda job: not job.name.startswith("sm80"))
    checks.insert(0, RUNTIME_JOB)

    def run(job: Job):
        start = time.monotonic()
        if job is RUNTIME_JOB:
            before = _prebuilt(job)
            try:
                path = build_runtime()
            except BuildError as e:
                return job.name, subprocess.CompletedProcess([], 1, "", str(e)), \
                    time.monotonic() - start, ["build_runtime()"]
            cmd = [sys.executable, "-c", _IMPORT_RUNTIME, str(path)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            name = f"{job.name} ({'cached, ' if path == before else ''}imported: {path.name})"
            return name, done, time.monotonic() - start, cmd
        program = job.name.startswith("selftest_")
        flags = job.flags if program else (
            tuple(f for f in job.flags if f not in LINK_FLAGS) + ("-c",))
        output = out_dir / (job.name if program else f"{job.name}.o")
        cmd = command(replace(job, flags=flags), output)
        done = subprocess.run(cmd, capture_output=True, text=True)
        if program and done.returncode == 0:
            done = subprocess.run([str(output)], capture_output=True, text=True)
        return job.name, done, time.monotonic() - start, cmd

    ok = True
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for name, done, seconds, cmd in pool.map(run, checks):
            print(f"{'ok  ' if done.returncode == 0 else 'FAIL'} {seconds:6.1f}s  {name}", flush=True)
            if done.returncode != 0:
                ok = False
                print("$ " + " ".join(cmd) + "\n" + (done.stderr or done.stdout)[-6000:], flush=True)
    return ok


if __name__ == "__main__":
    import argparse
    import sys

    parser = argparse.ArgumentParser(description="Compile-check FlashOverlap's CUDA sources.")
    parser.add_argument("--out", default=tempfile.mkdtemp(prefix="fo-compile-check-"))
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--no-selftests", action="store_true",
                        help="skip building and running the sm90 layout self-tests")
    parser.add_argument("--all-configs", action="store_true",
                        help="compile every configuration of CHECK_CONFIGS, not only CI's four")
    args = parser.parse_args()
    configs = CHECK_CONFIGS if args.all_configs else CI_CHECK_CONFIGS
    sys.exit(0 if compile_check(args.out, args.jobs, not args.no_selftests, configs) else 1)
