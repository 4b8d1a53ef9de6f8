"""Adopt GEMM objects built on another machine into this machine's kernel cache.

A cached object is named ``{config}-{sources and flags digest}-{toolchain digest}.so``
(backends/cuda/build.py). Objects compiled elsewhere (a CPU machine with nvcc, carried in
.fo_build) from the same sources and flags but by an nvcc whose ``--version`` line differs keep
another toolchain digest, and this machine would compile them again. This links each such
object under this machine's name (they are sm_80/sm_90a code built against the same CUTLASS
headers, which the driver loads whichever CUDA 13 nvcc made them), and says what it did.

    python ci/adopt_cache.py      # in the repository root, FLASHOVERLAP_CACHE_DIR as the tests use
"""
from __future__ import annotations

import os
import sys

from flashoverlap_backends.cuda import build, kernels


def main() -> int:
    nvcc = build.find_nvcc()
    if nvcc is None:
        print("adopt_cache: no nvcc here: the cache is used as it is (FLASHOVERLAP_NO_JIT rules)")
        return 0
    print(f"adopt_cache: nvcc here: {build.nvcc_version(nvcc)}")
    adopted = kept = 0
    for config in dict.fromkeys(kernels.all_configs(sorted(kernels.CONFIGS, reverse=True))):
        job = build._gemm_job(config)
        target = build.cache_dir() / (f"{job.name}-{build._digest(job)}-"
                                      f"{build._toolchain_digest(nvcc, job)}{job.suffix}")
        if target.is_file():
            kept += 1
            continue
        found = build._prebuilt(job)
        if found is None:
            continue
        os.link(found, target)
        adopted += 1
    print(f"adopt_cache: {kept} objects already under this toolchain's names, {adopted} adopted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
