#!/usr/bin/env bash
# The multi-GPU run (issue 6) in one call on a 2-, 4- or 8-GPU machine: install, build, the
# conformance suite against `cuda` at every world size in 2,4,8 that fits the machine, the
# strategy decision per world size (bench/strategy.py --world-size) and a sweep of the SMs left
# to the collectives at the largest, then bench/multigpu.py per world size (quick pass with the
# robustness checks, the end-to-end MLP block, then the full shape set). bench/multigpu.py runs every op, allgather included (its rows
# run on the backend fo picks for it where `cuda` declines it, and say so; torch's fused
# all-gather matmul is timed where symmetric memory works). Logs and result JSON go to $OUT;
# every step runs under `timeout`; multicast stays off.
#
#   bash ci/multigpu.sh        (FO_MULTIGPU_FULL=0 skips the full shape set;
#                               FO_MULTIGPU_ARGS adds arguments to every bench/multigpu.py run)
set -uo pipefail
cd "$(dirname "$0")/.."
LOG_NAME=multigpu
# shellcheck source=ci/lib.sh
source ci/lib.sh

# a kernel cache carried compressed (ci/round.sh says how), under this machine's toolchain names
if [ -f .fo_carry/cache.tgz ]; then
  mkdir -p .fo_build && tar xzf .fo_carry/cache.tgz -C .fo_build
  stage adopt-cache 60 $PY ci/adopt_cache.py
fi
stage build 300 flashoverlap build --backend cuda --jobs 16
GPUS=$(timeout 60 $PY -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
echo "GPUs: $GPUS" | tee -a "$SUMMARY"
SIZES=()
for w in 2 4 8; do [ "$w" -le "$GPUS" ] && SIZES+=("$w"); done
if [ ${#SIZES[@]} -eq 0 ]; then
  echo "fewer than 2 GPUs: nothing to run" | tee -a "$SUMMARY"; exit 1
fi
LIST=$(IFS=,; echo "${SIZES[*]}")

# the collectives' conformance first (about 30 s at W = 2), the speed next, the rest of the
# suite (fp8, MoE sequences, the fused norm) after it: a machine lent for minutes gives both
stage conformance-collectives 600 $PY -m pytest -q -p no:cacheprovider \
  --pyargs flashoverlap_core.testing.test_collectives --fo-backend cuda --fo-world-sizes "$LIST" \
  --junitxml "$OUT/conformance-collectives.xml"

for w in "${SIZES[@]}"; do  # the strategy decision against both strategies (issue 31)
  stage "strategy-w$w" 600 $PY bench/strategy.py --world-size "$w"
done
# the SMs the signaling GEMM leaves to the collectives (R) and the CTAs they may take (C):
# the default (24:24) against its neighbours, on the prefill rows
for rc in ${FO_SWEEP:-4:0 16:16 24:24 32:32}; do
  sweep_stage "$rc" "sweep-w${SIZES[-1]}-$rc" 300 $PY bench/strategy.py --world-size \
    "${SIZES[-1]}" --tokens 4096,16384 --nk 8192x1024,8192x3584,4096x7168
done
stage conformance 1800 $PY -m pytest -q -p no:cacheprovider --pyargs flashoverlap_core.testing \
  --fo-backend cuda --fo-world-sizes "$LIST" --junitxml "$OUT/conformance.xml" \
  --deselect flashoverlap_core/testing/test_collectives.py
for w in "${SIZES[@]}"; do
  # shellcheck disable=SC2086
  stage "multigpu-w$w-quick" 1200 $PY bench/multigpu.py --world-size "$w" --backend cuda \
    --quick --robustness --json "$OUT/multigpu-w$w-quick.json" ${FO_MULTIGPU_ARGS:-}
done
for w in "${SIZES[@]}"; do  # the Llama-style TP MLP block (issue 13), writes e2e-mlp-w<W>-*.json
  stage "e2e-w$w" 900 $PY bench/e2e_mlp.py --world-size "$w"
done
for w in "${SIZES[@]}"; do  # MoE all_to_all steps (issue 21), writes moe-<device>-*.json
  stage "moe-w$w" 900 $PY bench/moe.py --world-size "$w"
done
if [ "${FO_MULTIGPU_FULL:-1}" = 1 ]; then
  for w in "${SIZES[@]}"; do
    # shellcheck disable=SC2086
    stage "multigpu-w$w" 4800 $PY bench/multigpu.py --world-size "$w" --backend cuda \
      --json "$OUT/multigpu-w$w.json" ${FO_MULTIGPU_ARGS:-}
  done
fi
stage report 60 $PY bench/multigpu_report.py "$OUT"/multigpu-w*.json
cat "$SUMMARY"
