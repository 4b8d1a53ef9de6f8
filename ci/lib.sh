# Shared by the device scripts (ci/gpu.sh, ci/multigpu.sh): source it with LOG_NAME set.
# Sets the environment (NVLink multicast off everywhere), $OUT, $LOG, $SUMMARY and $PY,
# installs carried wheels (.whl/) and the package, and defines `stage`.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/flashoverlap-${LOG_NAME}-out}
mkdir -p "$OUT"
LOG="$OUT/${LOG_NAME}-log.txt"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
export FO_RESULTS_DIR="$OUT"
export FLASHOVERLAP_CACHE_DIR=${FLASHOVERLAP_CACHE_DIR:-$PWD/.fo_build/cache}
PY=${PYTHON:-python3}

stage() {  # stage NAME SECONDS CMD...: run under a timeout, log it, record its status
  local name=$1 secs=$2; shift 2
  echo "=== $name: $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout --kill-after=10 "$secs" "$@" 2>&1 | tee -a "$LOG" | tail -40
  local rc=${PIPESTATUS[0]}
  echo "$name rc=$rc (${rc/124/TIMEOUT}) $((SECONDS - t0))s" | tee -a "$SUMMARY"
  return 0
}

# The device machines reach no package index: missing packages travel as wheels in .whl/.
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
timeout 300 $PY -m pip install -q --no-deps --no-build-isolation --no-index -e . >>"$LOG" 2>&1 \
  || { echo "install FAILED" | tee -a "$SUMMARY"; tail -20 "$LOG"; exit 1; }

# sweep_stage RESERVED:CTAS NAME SECONDS CMD...: `stage` under one setting of the SMs the
# signaling GEMM leaves free (FLASHOVERLAP_CUDA_RESERVED_SMS) and the CTAs the overlapped calls'
# NCCL kernels may take (FLASHOVERLAP_CUDA_NCCL_CTAS; allgather's follows, 4 for NCCL's own: 0)
sweep_stage() {
  local rc=$1; shift
  local ctas=${rc##*:}
  ( export FLASHOVERLAP_CUDA_RESERVED_SMS=${rc%%:*} FLASHOVERLAP_CUDA_NCCL_CTAS=$ctas
    export FLASHOVERLAP_CUDA_GATHER_NCCL_CTAS=$([ "$ctas" = 0 ] && echo 4 || echo "$ctas")
    stage "$@" )
}
