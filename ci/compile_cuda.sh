#!/usr/bin/env bash
# Compile-check every CUDA source (csrc/cuda/*.cu) for sm_90a and sm_80 without a GPU: the
# objects are built with the flags of backends/cuda/build.py, in representative configurations
# (sm90 cooperative bf16, pingpong fp16 and e4m3 with scales; sm80 bf16 and fp16), and links the
# runtime from its translation units (build.py's RUNTIME_SOURCES) leaving no symbol undefined.
# Needs nvcc (CUDA_HOME or PATH) and the CUTLASS headers of the nvidia-cutlass package, installed
# here into a temporary folder when the Python environment lacks them.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if ! "$PYTHON" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("cutlass_library") is None)'; then
  echo "nvidia-cutlass is not installed: installing it into $work/site"
  "$PYTHON" -m pip install --quiet --no-deps --target "$work/site" nvidia-cutlass
  export PYTHONPATH="$work/site${PYTHONPATH:+:$PYTHONPATH}"
fi

start=$(date +%s)
"$PYTHON" backends/cuda/build.py --out "$work/objects" --jobs "${JOBS:-$(nproc)}"
echo "compile check passed in $(( $(date +%s) - start )) s"
