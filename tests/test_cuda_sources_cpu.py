"""The C sources keep one home per export (csrc/cuda; issue 29). flashoverlap_cuda.h declares every
exported function (``FO_API``) of the runtime, and gemm_api.h, which it includes, those of the GEMM
libraries (which include it alone), but for fp8 all_to_all's fo_gemm_run_blocks_scaled, which
gemm_blocks_scaled.h declares, and fp8 allgather's fo_gemm_run_ex_scaled, which gemm_ex_scaled.h
declares (both included by flashoverlap_cuda.h too; issue 32). Each export is defined once in
the object that exports it: the GEMM libraries' in gemm_abi.cuh, those two in
gemm_sm90_blocks_scaled.cu and gemm_sm90_ex_scaled.cu (GEMM sources that are gemm_sm90.cu plus
one of them, so that gemm_sm90.cu and every object built from it stay as they are), the
runtime's in one of its translation units (``build.RUNTIME_SOURCES``). No other header defines one or opens an ``extern "C"`` block.
The sources are read as text; no compiler is needed (but for the last test, which links the
runtime with FLASHOVERLAP_COMPILE_TESTS=1 and nvcc)."""
from __future__ import annotations

import ctypes
import os
import re
import subprocess
from collections import Counter
from dataclasses import replace

import pytest

from flashoverlap_backends.cuda import build

SRC = build.source_dir()
HEADER = "flashoverlap_cuda.h"
GEMM_API = "gemm_api.h"  # the GEMM libraries' part of the C ABI (HEADER includes it)
GEMM_ABI = "gemm_abi.cuh"  # the C functions every GEMM source (one object each) shares
GEMM_SOURCES = {"gemm_sm90.cu", "gemm_sm80.cu", "gemm_sm90_stock.cu"}  # (stock: fp8 on
# CUTLASS's own kernel, build.GemmConfig.stock; its C functions are gemm_abi.cuh's too)
# GEMM sources that are another one plus exports of their own (source -> the one it includes),
# declared in a header of their own (VARIANT_APIS: source -> it; HEADER includes it)
GEMM_VARIANTS = {"gemm_sm90_blocks_scaled.cu": "gemm_sm90.cu",
                 "gemm_sm90_ex_scaled.cu": "gemm_sm90.cu",
                 "gemm_sm90_stock_ex_scaled.cu": "gemm_sm90_stock.cu"}
# what each variant adds to the GEMM libraries' C ABI
VARIANT_APIS = {"gemm_sm90_blocks_scaled.cu": "gemm_blocks_scaled.h",
                "gemm_sm90_ex_scaled.cu": "gemm_ex_scaled.h",
                "gemm_sm90_stock_ex_scaled.cu": "gemm_ex_scaled.h"}
PROGRAMS = {"gemm_sm90_selftest.cu"}  # a host program that includes gemm_sm90.cu, no object

EXPORT = re.compile(r"\bFO_API\s+[\w\s*]*?\b(fo_\w+)\s*\(")
NOISE = re.compile(r'"(?:\\.|[^"\\\n])*"|//[^\n]*|/\*.*?\*/', re.S)


def strip(text: str) -> str:
    """C text without comments, and string literals emptied (but "C", of extern "C")."""
    return NOISE.sub(lambda m: '"C"' if m.group(0) == '"C"' else '""' if m.group(0)[0] == '"'
                     else " ", text)


def code(name: str) -> str:
    return strip((SRC / name).read_text())


def exports_in(text: str) -> tuple[list[str], list[str]]:
    """(declared, defined): the FO_API functions of stripped text, told apart by what follows
    their parameter list (``;`` or ``{``)."""
    declared, defined = [], []
    for m in EXPORT.finditer(text):
        depth, i = 1, m.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        (defined if text[i:].lstrip().startswith("{") else declared).append(m.group(1))
    return declared, defined


def exports(name: str) -> tuple[list[str], list[str]]:
    return exports_in(code(name))


def sources(suffix: str) -> list[str]:
    return sorted(p.name for p in SRC.glob(f"*{suffix}"))


def test_every_export_is_declared_in_the_header_and_defined_once_per_object():
    declared, defined_there = exports(HEADER)
    gemm_declared, gemm_defined_there = exports(GEMM_API)
    assert set(VARIANT_APIS) == set(GEMM_VARIANTS)
    variant_declared = []
    for source, header in VARIANT_APIS.items():
        here, defined_in_header = exports(header)
        assert f'#include "{header}"' in (SRC / source).read_text(), source
        assert set(exports(source)[1]) == set(here), (
            f"{source} defines {sorted(exports(source)[1])}, {header} declares {sorted(here)}")
    for header in dict.fromkeys(VARIANT_APIS.values()):  # (a header may serve two variants)
        here, defined_in_header = exports(header)
        defined_there += defined_in_header
        variant_declared += here
    defined_there += gemm_defined_there
    assert not defined_there, f"the headers define {defined_there}"
    for header in (GEMM_API, *VARIANT_APIS.values()):
        assert f'#include "{header}"' in (SRC / HEADER).read_text()
    declared += gemm_declared + variant_declared
    assert len(declared) == len(set(declared)), "declared twice: " + str(
        [n for n, k in Counter(declared).items() if k > 1])
    gemm = exports(GEMM_ABI)[1]
    variants = [n for source in GEMM_VARIANTS for n in exports(source)[1]]
    runtime = [n for source in build.RUNTIME_SOURCES for n in exports(source)[1]]
    # each variant is an object of its own: the ABI's functions and its own, each once
    objects = [(source, gemm + exports(source)[1]) for source in GEMM_VARIANTS]
    for name, defined in ((GEMM_ABI, gemm), *objects, ("the runtime", runtime)):
        twice = [n for n, k in Counter(defined).items() if k > 1]
        assert not twice, f"{name} defines {twice} more than once"
        assert set(defined) <= set(declared), (
            f"{name} exports {sorted(set(defined) - set(declared))}, which {HEADER} does not declare")
    missing = set(declared) - set(gemm) - set(variants) - set(runtime)
    assert not missing, f"{HEADER} declares {sorted(missing)}, which no object defines"


def test_no_header_but_the_gemm_abi_defines_an_export():
    for header in sources(".cuh") + sources(".h"):
        if header in (GEMM_ABI, HEADER, GEMM_API, *VARIANT_APIS.values()):
            continue
        declared, defined = exports(header)
        assert not declared + defined, f"{header} declares or defines {declared + defined}: " \
                                       f"exports belong in {HEADER} and a .cu"
        assert 'extern "C"' not in code(header), f'{header} opens an extern "C" block'


def test_every_translation_unit_is_a_gemm_source_a_program_or_the_runtime():
    units = set(sources(".cu"))
    assert set(build.RUNTIME_SOURCES) <= units, "RUNTIME_SOURCES names a missing file"
    known = GEMM_SOURCES | set(GEMM_VARIANTS) | PROGRAMS | set(build.RUNTIME_SOURCES)
    assert units == known, f"{sorted(units - known)} belong to no object"
    for unit in units - PROGRAMS:  # translation units include headers only (a variant: its base)
        included = re.findall(r'^\s*#\s*include\s+"([^"]+)"', (SRC / unit).read_text(), re.M)
        sources_in = [h for h in included if h.endswith(".cu")]
        assert sources_in == ([GEMM_VARIANTS[unit]] if unit in GEMM_VARIANTS else []), (
            f"{unit} includes {included}")
    # build.py compiles the variants: fp8 all_to_all's builds (e4m3, unequal blocks) and fp8
    # allgather's (e4m3, gather) only
    from flashoverlap_backends.cuda.build import GemmConfig

    variant = GemmConfig(tile_k=128, cluster_m=1, dtype="e4m3", epilogue="tma", blocks=True)
    assert build.gemm_source(variant) == "gemm_sm90_blocks_scaled.cu"
    gather = GemmConfig(tile_k=128, dtype="e4m3", epilogue="tma", gather=True)
    assert build.gemm_source(gather) == "gemm_sm90_ex_scaled.cu"
    stock = GemmConfig(tile_n=128, tile_k=128, dtype="e4m3", schedule="pingpong", epilogue="tma",
                       stock=True)
    assert build.gemm_source(stock) == "gemm_sm90_stock.cu"
    assert build.gemm_source(replace(stock, gather=True)) == "gemm_sm90_stock_ex_scaled.cu"
    assert build.gemm_source(GemmConfig(cluster_m=1, blocks=True)) == "gemm_sm90.cu"
    assert build.gemm_source(GemmConfig(tile_k=128, dtype="e4m3")) == "gemm_sm90.cu"
    assert {build.gemm_source(variant), build.gemm_source(gather),
            build.gemm_source(replace(stock, gather=True))} == set(GEMM_VARIANTS)


def test_the_check_reads_declarations_and_definitions():
    text = strip('FO_API int fo_a(int (*f)(void), char x);\nFO_API void* fo_b(void) { return 0; }\n'
                 '// FO_API int fo_c(void) {}\n/* FO_API int fo_d(void) {} */\n'
                 'const char* s = "FO_API int fo_e(void); //";\nextern "C" {}\n')
    assert exports_in(text) == (["fo_a"], ["fo_b"])
    assert 'extern "C"' in text


@pytest.mark.skipif(os.environ.get("FLASHOVERLAP_COMPILE_TESTS") != "1" or build.find_nvcc() is None,
                    reason="set FLASHOVERLAP_COMPILE_TESTS=1 (and have nvcc) to link the runtime")
def test_each_runtime_unit_reports_through_the_one_fo_last_error(tmp_path):
    """The units share one error text (and one NCCL table): an argument check of each, which
    runs before any CUDA call (no GPU needed), is read back through runtime.cu's fo_last_error."""
    so = tmp_path / "runtime.so"
    done = subprocess.run(build.command(build.RUNTIME_JOB, so), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    lib = ctypes.CDLL(str(so))
    lib.fo_last_error.restype = ctypes.c_char_p
    desc, handle, p = ctypes.create_string_buffer(4096), ctypes.c_void_p(), ctypes.c_void_p(16)
    i64 = ctypes.c_int64
    calls = {  # unit: (call, the start of its message)
        "overlap_call.cu": (lambda: lib.fo_call_create(desc, ctypes.byref(handle)),
                            "fo_call_create: descriptor ABI 0"),
        "all_to_all_call.cu": (lambda: lib.fo_a2a_create(desc, ctypes.byref(handle)),
                               "fo_a2a_create: descriptor ABI 0"),
        "gather_call.cu": (lambda: lib.fo_gather_create(desc, ctypes.byref(handle)),
                           "fo_gather_create: descriptor ABI 0"),
        "add_rmsnorm.cu": (lambda: lib.fo_add_rmsnorm_tiles(p, p, 4, 8, 128, 128, 5, p, i64(8), p, 0,
                                                            ctypes.c_float(1e-6), p, p, i64(8), None),
                           "add_rmsnorm: dtype 5 is not"),
        "nccl.cu": (lambda: lib.fo_nccl_version(ctypes.byref(ctypes.c_int())),
                    "NCCL is not loaded (fo_nccl_load)"),
        "runtime.cu": (lambda: lib.fo_unpack_tiles(None, None, i64(1), None, None, 1, 3, None),
                       "fo_unpack_tiles: num_tiles=1"),
    }
    assert set(calls) == set(build.RUNTIME_SOURCES)
    for unit, (call, message) in calls.items():
        assert call() == 1, unit  # cudaErrorInvalidValue
        assert lib.fo_last_error().decode().startswith(message), unit
