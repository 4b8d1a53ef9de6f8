"""The runtime's Python binding (csrc/cuda/runtime_binding.cpp) on the CPU: the extension module
builds with nvcc (or comes from the cache) and imports without a GPU; it exports what the call
modules use; every field of the header's descriptions is bound and reaches the C side; wrong
argument types raise TypeError; failures raise KernelError with the library's path; and a GEMM
library (here a fake one with the same C ABI, built by the host compiler) loads through it.
Skipped without nvcc (or pybind11 and Python's headers)."""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from flashoverlap_backends.cuda import build, runtime

ROOT = Path(__file__).resolve().parents[1]
HEADER = ROOT / "csrc" / "cuda" / "flashoverlap_cuda.h"
GEMM_API = ROOT / "csrc" / "cuda" / "gemm_api.h"  # (HEADER includes it)

# What the call modules, benchmarks and GPU tests call.
FUNCTIONS = {
    "check", "last_error", "load_kernels", "wait_counter", "reset_counters", "unpack_tiles",
    "add_rmsnorm_tiles", "nccl_load", "nccl_version", "nccl_unique_id", "nccl_comm_init",
    "nccl_set_capture_comm", "nccl_comm_destroy", "call_create", "call_destroy", "call_graph_state",
    "call_add_rmsnorm_graph_state", "call_set_add_rmsnorm", "call_run", "call_run_scaled",
    "call_run_add_rmsnorm", "a2a_create", "a2a_destroy", "a2a_set_buffers", "a2a_run",
    "a2a_run_scaled",
    "gather_create", "gather_destroy", "gather_load_kernels", "gather_run", "gather_run_scaled"}
# binding class -> the C struct of flashoverlap_cuda.h it fills
DESCRIPTIONS = {"CallDescription": "fo_call_desc", "GatherDescription": "fo_gather_desc",
                "A2aDescription": "fo_a2a_desc", "A2aBuffers": "fo_a2a_buffers",
                "GemmParams": "fo_gemm_params", "GemmScales": "fo_gemm_scales",
                "GemmDescription": "fo_gemm_config"}


@pytest.fixture(scope="module")
def native():
    if build.find_nvcc() is None and build._prebuilt(build.RUNTIME_JOB) is None:
        pytest.skip("nvcc not found (the runtime extension is built with it)")
    try:
        build.python_include_dirs()
        path = build.build_runtime()
    except build.BuildError as e:
        if "failed" in str(e):
            raise
        pytest.skip(str(e))
    return runtime.load(path)


def test_the_runtime_is_built_for_this_python(monkeypatch):
    """No nvcc needed: the runtime job links the binding into an extension module whose cache
    name and hash carry the Python ABI; the GEMM objects' do not."""
    job, gemm = build.RUNTIME_JOB, build._gemm_job(build.GemmConfig())
    assert job.python and not gemm.python
    assert "runtime_binding.cpp" in job.sources and "runtime.cu" in job.sources
    assert job.suffix == sysconfig.get_config_var("EXT_SUFFIX") and gemm.suffix == ".so"
    before = build._digest(job), build._digest(gemm)
    monkeypatch.setattr(build, "extension_suffix", lambda: ".cpython-399-x86_64-linux-gnu.so")
    assert build._digest(job) != before[0] and build._digest(gemm) == before[1]
    assert build.RUNTIME_JOB.suffix == ".cpython-399-x86_64-linux-gnu.so"
    if build.find_nvcc() is not None and importlib.util.find_spec("pybind11") is not None:
        import pybind11

        cmd = build.command(job, "out.so")
        assert f"-I{pybind11.get_include()}" in cmd
        assert [c for c in cmd if c.endswith((".cu", ".cpp"))] == [
            str(build.source_dir() / s) for s in job.sources]


def header_fields(struct: str) -> list[str]:
    """The member names of ``typedef struct { ... } struct;`` in flashoverlap_cuda.h (or the
    gemm_api.h it includes)."""
    text = re.sub(r"//[^\n]*", "", HEADER.read_text() + GEMM_API.read_text())
    body = re.search(r"typedef struct \{([^}]*)\}\s*" + struct + ";", text).group(1)
    names = []
    for declaration in filter(str.strip, body.split(";")):
        for part in declaration.split(","):
            names.append(re.findall(r"[A-Za-z_]\w*", part)[-1])
    return names


def test_the_module_exports_what_python_calls(native):
    assert FUNCTIONS <= set(dir(native))
    assert {"GemmLibrary", "Call", "A2a", "Gather"} | set(DESCRIPTIONS) <= set(dir(native))
    assert (native.ABI_VERSION, native.FP8_DTYPE) == (runtime.ABI_VERSION, runtime.FP8_DTYPE_CODE)
    assert runtime.load(native.__file__) is native  # imported once per process


@pytest.mark.parametrize("cls", sorted(DESCRIPTIONS))
def test_every_field_of_the_header_is_bound(native, cls):
    fields = header_fields(DESCRIPTIONS[cls])
    assert len(fields) >= 4
    missing = [f for f in fields if not hasattr(getattr(native, cls), f)]
    assert not missing, f"{cls} does not bind {missing} of {DESCRIPTIONS[cls]}"


def test_a_description_reads_back_what_python_set(native):
    desc = native.CallDescription(L=3, N=4096, ldo=1 << 40, packed=0x7F0012345600, staging=None,
                                  group_sizes=(5, 6, 7), steps=range(8),
                                  block_tiles=[0x7F00AA000000], use_graph=True)
    assert (desc.L, desc.N, desc.ldo) == (3, 4096, 1 << 40)
    assert (desc.packed, desc.staging) == (0x7F0012345600, 0)
    assert (desc.group_sizes, desc.steps) == ([5, 6, 7], list(range(8)))
    assert desc.block_tiles == [0x7F00AA000000]
    assert desc.abi_version == runtime.ABI_VERSION and desc.use_graph == 1
    desc.comm_stream, desc.wait_mode = 0x5500, runtime.WAIT_MODES["spin_kernel"]
    assert (desc.comm_stream, desc.wait_mode, desc.K) == (0x5500, 1, 0)
    gather = native.GatherDescription(chunk_rows=[0, 64, 64, 128], num_chunks=2, ldg=8192)
    assert (gather.chunk_rows, gather.num_chunks, gather.ldg) == ([0, 64, 64, 128], 2, 8192)
    scales = native.GemmScales(0x1000, 0x2000, 1, 0)
    params = native.GemmParams(a=0x3000, lda=64, N=512, scales=scales)
    assert (params.a, params.lda, params.N, params.b) == (0x3000, 64, 512, 0)
    assert (params.scales.a, params.scales.b, params.scales.a_per_row) == (0x1000, 0x2000, 1)
    params.scales = None
    assert params.scales is None
    buffers = native.A2aBuffers(tile_capacity=7, packed_numel=1 << 33)
    assert (buffers.tile_capacity, buffers.packed_numel, buffers.items) == (7, 1 << 33, 0)


def test_wrong_types_raise_type_error(native):
    desc = native.CallDescription()
    for field, value in (("L", "3"), ("L", 1.5), ("L", 1 << 40), ("packed", 1.5), ("packed", -16),
                         ("packed", "0x10"), ("group_sizes", ["a"]), ("group_sizes", 3)):
        with pytest.raises(TypeError):
            setattr(desc, field, value)
    with pytest.raises(TypeError):
        native.CallDescription(N="4096")
    with pytest.raises(AttributeError):
        native.CallDescription(num_group=1)  # a misspelt field is no silent no-op
    with pytest.raises(TypeError):
        native.Call()  # handles come from call_create only
    with pytest.raises(TypeError):  # a handle, not an address
        native.call_run(0x1000, 0x2000, 64, 0x3000, 64, 0x4000, 0, 0)
    with pytest.raises(TypeError):
        native.wait_counter(0x1000, 1, "spin_kernel", 0)  # modes are runtime.WAIT_MODES' codes
    with pytest.raises(TypeError):
        native.GemmLibrary(3)


def test_host_arrays_are_checked_against_their_counts(native):
    short = native.CallDescription(num_groups=3, group_sizes=[4, 4])
    with pytest.raises(ValueError, match="group_sizes has 2 entries, num_groups needs 3"):
        native.call_create(short)
    blocks = native.CallDescription(num_groups=1, group_sizes=[1], num_blocks=2,
                                    block_out_offset=[0, 8], block_tiles=[16])
    with pytest.raises(ValueError, match="block_"):
        native.call_create(blocks)
    with pytest.raises(ValueError, match="chunk_rows"):
        native.gather_create(native.GatherDescription(num_chunks=2, chunk_rows=[0, 1]))


def test_failures_raise_kernel_errors_that_name_the_library(native):
    native.check(0, "nothing")
    path = re.escape(native.__file__)
    with pytest.raises(runtime.KernelError,
                       match=r"^some call failed \(cudaError 2\): .* \[" + path + r"\]$"):
        native.check(2, "some call")
    with pytest.raises(runtime.KernelError, match=r"fo_reset_counters failed \(cudaError 1\): "
                                                  r"fo_reset_counters: need n >= 0 counters"):
        native.reset_counters(None, 4, 0)
    assert issubclass(runtime.KernelError, RuntimeError)


@pytest.mark.parametrize("field, value, message", [
    ("abi_version", 99, "descriptor ABI 99, library ABI"),
    ("wait_mode", 7, "wait_mode 7 is not 0 or 1"),
    ("elem_size", 3, "elem_size 3 is not 2 or 4")])
def test_a_description_reaches_the_c_side(native, field, value, message):
    """fo_call_create's own checks read the fields Python set (before any CUDA call)."""
    desc = native.CallDescription(gemm_launch=0x1000, packed=0x2000, staging=0x2000,
                                  counters=0x3000, num_groups=1, group_sizes=[4], per_step=1,
                                  elem_size=2)
    setattr(desc, field, value)
    with pytest.raises(runtime.KernelError,
                       match=r"fo_call_create failed \(cudaError 1\): .*" + message):
        native.call_create(desc)


@pytest.mark.parametrize("fields, message", [
    (dict(scaled=1), "need the GEMM (gemm_run_blocks, or with scaled = 1 gemm_run_blocks_scaled)"),
    (dict(scaled=1, gemm_run_blocks_scaled=0x2000, scale_a_per_row=2, scale_b_per_col=1),
     "or both FO_SCALE_BLOCKS (2) (got scaled 1, modes 2 and 1)"),
    (dict(scaled=1, gemm_run_blocks_scaled=0x2000, scale_a_per_row=3),
     "(got scaled 1, modes 3 and 0)"),
    (dict(scaled=2, gemm_run_blocks_scaled=0x2000), "scaled must be 0 or 1")])
def test_an_fp8_all_to_all_description_reaches_the_c_side(native, fields, message):
    """fo_a2a_create's checks of the fp8 fields (issue 32), before any CUDA call."""
    desc = native.A2aDescription(gemm_run_blocks=0x1000, tile_m=128, tile_n=256, N=512,
                                 swizzle=8, groups=1, world=1, rank=0, K=128, num_ctas=128,
                                 elem_size=2, **fields)
    assert all(getattr(desc, name) == value for name, value in fields.items())
    with pytest.raises(runtime.KernelError,
                       match=r"fo_a2a_create failed \(cudaError 1\): .*" + re.escape(message)):
        native.a2a_create(desc)


GATHER = dict(gemm_run_ex=0x1000, world=1, rank=0, block_rows=128, N=512, K=128, copy_cols=128,
              items=0x2000, item_group=0x2000, item_wait=0x2000, num_items=4, num_ctas=128,
              gathered=0x3000, ldg=128, arrive_flags=0x4000, wait_flags=0x4000, num_chunks=1,
              chunk_rows=[0, 128], elem_size=1, comm_stream=0x5000)


@pytest.mark.parametrize("fields, message", [
    (dict(scaled=1, gathered_scales=0x6000, scale_a_per_row=1),
     "gemm_run_ex (with scaled = 1 gemm_run_ex_scaled), items"),
    (dict(scaled=1, gemm_run_ex_scaled=0x1100, scale_a_per_row=1),
     "needs gathered_scales and the scales' modes"),
    (dict(scaled=1, gemm_run_ex_scaled=0x1100, gathered_scales=0x6000),
     "(got gathered_scales 0x6000, modes 0 and 0)"),  # a gathered scale_a is per row
    (dict(scaled=1, gemm_run_ex_scaled=0x1100, gathered_scales=0x6000, scale_a_per_row=2,
          scale_b_per_col=1), "or both FO_SCALE_BLOCKS (2) (got gathered_scales 0x6000, modes 2 "
                              "and 1)"),
    (dict(scaled=1, gemm_run_ex_scaled=0x1100, gathered_scales=0x6000, scale_a_per_row=1,
          elem_size=2), "elem_size 2)"),  # e4m3 rows are bytes
    (dict(scaled=0, elem_size=1), "elem_size 1)"),  # 16-bit rows are not
    (dict(scaled=2), "scaled must be 0 or 1, got 2")])
def test_an_fp8_allgather_description_reaches_the_c_side(native, fields, message):
    """fo_gather_create's checks of the fp8 fields (issue 32), before any CUDA call."""
    desc = native.GatherDescription(**{**GATHER, **fields})
    assert all(getattr(desc, name) == value for name, value in fields.items())
    with pytest.raises(runtime.KernelError,
                       match=r"fo_gather_create failed \(cudaError 1\): .*" + re.escape(message)):
        native.gather_create(desc)


def test_gather_run_scaled_takes_a_handle_and_four_strides(native):
    with pytest.raises(TypeError):  # a handle, not an address
        native.gather_run_scaled(0x1000, 0x2000, 64, 0x3000, 64, 0x10, 0x20, (0, 0, 0, 0),
                                 0x4000, 64, 0, 0)
    gather = native.Gather  # handles come from gather_create only
    with pytest.raises(TypeError):
        gather()


# ---- a GEMM library through the runtime ---------------------------------------------------------

def _cuda_include() -> Path | None:
    nvcc = build.find_nvcc()
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda",
             str(Path(nvcc).resolve().parents[1]) if nvcc else None]
    found = [Path(h) / "include" for h in homes
             if h and (Path(h) / "include" / "cuda_runtime.h").is_file()]
    return found[0] if found else None


def fake_library(tmp_path: Path, abi: int | None = None, ex_scaled: bool = False) -> Path:
    cxx, include = shutil.which("c++") or shutil.which("g++"), _cuda_include()
    if cxx is None or include is None:
        pytest.skip("needs a C++ compiler and the CUDA headers")
    out = tmp_path / f"fake_gemm_{abi}{'_ex_scaled' if ex_scaled else ''}.so"
    subprocess.run([cxx, "-std=c++17", "-shared", "-fPIC", f"-I{build.source_dir()}",
                    f"-I{include}",
                    *([f"-DFAKE_ABI={abi}"] if abi is not None else []),
                    *(["-DFAKE_EX_SCALED"] if ex_scaled else []),
                    str(ROOT / "tests" / "native" / "fake_gemm_library.cpp"), "-o", str(out)],
                   check=True, capture_output=True, timeout=120)
    return out


def test_a_gemm_library_loads_through_the_runtime(native, tmp_path):
    path = fake_library(tmp_path)
    lib = native.GemmLibrary(str(path))
    assert lib.path == str(path) and lib.fp8
    d = lib.description
    assert d.abi_version == runtime.ABI_VERSION
    assert (d.arch, d.tile_m, d.tile_n, d.cta_multiple) == (90, 128, 256, 2)
    assert lib.max_ctas(0) == 132 and lib.workspace_size(2, 128, 512, 64, 128) == 1024
    assert all((lib.launch_address, lib.set_node_address, lib.run_ex_address,
                lib.run_blocks_address))
    assert lib.run_blocks_scaled_address == 0  # fp8 all_to_all's builds' only: optional
    assert lib.run_ex_scaled_address == 0  # fp8 allgather's builds' only: optional
    lib.load_kernels()
    with pytest.raises(runtime.KernelError,
                       match=r"^fo_gemm_run failed \(cudaError 1\): fake run L=2 "
                       r"rows=128 N=512 K=64 lda=64 ldb=72 items=9 ctas=128 monitor=\(nil\) \["):
        lib.run(0x1000, 0x2000, 0x3000, 2, 128, 512, 64, 64, 72, 0x4000, 0x5000, 9, None, 128, None,
                None, 0)
    scales = native.GemmScales(0x10, 0x20, 1, 0)
    with pytest.raises(runtime.KernelError, match="fake run_scaled a_per_row=1 b_per_col=0"):
        lib.run_scaled(0x1000, 0x2000, scales, 0x3000, 1, 128, 512, 64, 64, 64, 0, 0, 1, 0, 2,
                       0, 0, 0)
    with pytest.raises(runtime.KernelError, match="fake run_ex ldo=512 flags=3"):
        lib.run_ex(1, 2, 3, 1, 128, 512, 64, 64, 64, 512, 4, 5, 6, 7, 3, 1, None, 2, None, None, 0)
    params = native.GemmParams(N=512)
    with pytest.raises(runtime.KernelError, match="fake launch without scales, N=512"):
        lib.launch(params, 0)
    params.scales = scales
    lib.launch(params, 0)
    assert lib.last_error() == "fake launch without scales, N=512"
    with pytest.raises(runtime.KernelError, match=r"^the native call \(GEMM library: fake "
                       r"launch without scales, N=512\) failed \(cudaError 4\)"):
        native.check(4, "the native call", lib)


def test_fp8_allgathers_gemm_is_optional_and_takes_its_scales(native, tmp_path):
    """fo_gemm_run_ex_scaled (issue 32): GemmLibrary finds it where a library exports it (fp8
    allgather's builds) and hands it its scales; a library without it says so."""
    scales = native.GemmScales(0x10, 0x20, 2, 2, (5, 1), (1, 3))
    args = (1, 2, scales, 3, 4, 128, 512, 128, 128, 128, 512, 4, 5, 6, 7, 8, 9, None, 2, None,
            None, 0)
    without = native.GemmLibrary(str(fake_library(tmp_path)))
    with pytest.raises(runtime.KernelError, match="has no fo_gemm_run_ex_scaled"):
        without.run_ex_scaled(*args)
    lib = native.GemmLibrary(str(fake_library(tmp_path, ex_scaled=True)))
    assert lib.run_ex_scaled_address and lib.run_ex_address
    assert lib.run_blocks_scaled_address == 0
    with pytest.raises(runtime.KernelError, match=r"^fo_gemm_run_ex_scaled failed \(cudaError 1\): "
                       "fake run_ex_scaled ldo=512 flags=8 a_per_row=2 b_per_col=2 a_stride=5,1"):
        lib.run_ex_scaled(*args)


def test_a_gemm_library_of_another_abi_is_refused(native, tmp_path):
    path = fake_library(tmp_path, abi=1)
    with pytest.raises(runtime.KernelError, match=re.escape(
            f"{path} has ABI version 1, expected {runtime.ABI_VERSION}: "
            "rebuild it (flashoverlap build)")):
        native.GemmLibrary(str(path))
    with pytest.raises(OSError):
        native.GemmLibrary(str(tmp_path / "missing.so"))
