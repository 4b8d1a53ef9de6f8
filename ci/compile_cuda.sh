#!/usr/bin/env bash
# Compile-check every CUDA source (csrc/cuda/*.cu) for sm_90a and sm_80 without a GPU: the
# objects are built with the flags of backends/cuda/build.py, in representative configurations
# (build.py's CI_CHECK_CONFIGS: sm90 pingpong fp16, sm90 cooperative e4m3 with scales, sm80 fp16
# with unequal blocks, fp8 all_to_all's block-scaled build with unequal blocks, the stock fp8
# pingpong build (CUTLASS's own kernel); `build.py
# --all-configs` builds all of CHECK_CONFIGS), the runtime
# extension module from its translation units (build.py's RUNTIME_SOURCES) and its Python binding,
# imported so that no symbol is left undefined (the cached one when the tests built it in the same
# FLASHOVERLAP_CACHE_DIR), and the sm90 layout self-tests, built and run. Needs nvcc (CUDA_HOME or
# PATH), Python's C headers, the CUTLASS headers of the nvidia-cutlass package and pybind11,
# installed here into a temporary folder when the Python environment lacks them.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

for pair in cutlass_library:nvidia-cutlass pybind11:pybind11; do
  module=${pair%%:*} package=${pair#*:}
  if ! "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$module') is None)"; then
    echo "$package is not installed: installing it into $work/site"
    "$PYTHON" -m pip install --quiet --no-deps --target "$work/site" "$package"
  fi
done
export PYTHONPATH="$work/site${PYTHONPATH:+:$PYTHONPATH}"

start=$(date +%s)
"$PYTHON" backends/cuda/build.py --out "$work/objects" --jobs "${JOBS:-$(nproc)}"
echo "compile check passed in $(( $(date +%s) - start )) s"
