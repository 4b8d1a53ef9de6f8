#!/usr/bin/env bash
# Everything the GPU machine does, in one call: install, build (or reuse carried prebuilt
# kernels), GPU tests, the conformance suite against `cuda`, and the benchmarks. Logs and
# result JSON go to $OUT (the device tool brings them back). Every step runs under `timeout`.
#
#   bash ci/gpu.sh [STAGE...]   (default: build tests callpath gemm reorder offload sm80
#                                conformance mainjob report cache; also: tuning, e2e, compile,
#                                multirank (or its parts), moe, moe-tests, fusednorm,
#                                fusednorm-multirank, fp8, gemmfp8, overhead)
# The kernel cache (.fo_build/cache) comes back as $OUT/kernel-cache.tar.gz: unpack it into
# the repository and carry `.fo_build` in the next call, which then rebuilds nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG_NAME=gpu
# shellcheck source=ci/lib.sh
source ci/lib.sh

STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(build tests callpath gemm reorder offload sm80 conformance mainjob report cache)

run_stage() {  # the stages, most important first (a call may run out of time at the end)
  case $1 in
    # Kernels: carried prebuilt objects (same sources and nvcc) are reused; the rest compile here.
    build) stage build 360 flashoverlap build --backend cuda --jobs 16 ;;  # + 8 fp8 builds
    report) stage report 60 flashoverlap report ;;
    tests) FO_GEMM_TEST_CONFIGS=-e4m3 stage tests 300 $PY -m pytest -q -p no:cacheprovider tests/gpu \
             --ignore tests/gpu/test_multirank.py --ignore tests/gpu/test_cuda_fp8.py ;;
    callpath) stage callpath 180 $PY bench/callpath.py ;;
    e2e) stage e2e 420 $PY bench/e2e_mlp.py ;;
    moe) stage moe 300 $PY bench/moe.py ;;  # all_to_all of MoE steps at world size 1
    compile) stage compile 420 $PY -m pytest -q -p no:cacheprovider -rs tests/gpu/test_compile.py ;;
    cache) tar -czf "$OUT/kernel-cache.tar.gz" -C "$PWD" .fo_build/cache \
             && echo "cache: $(du -h "$OUT/kernel-cache.tar.gz" | cut -f1)" | tee -a "$SUMMARY" ;;
    # The Ampere/Ada (sm_80) kernels run on Hopper too: their correctness is checked here.
    sm80) FLASHOVERLAP_CUDA_ARCH=80 FO_STRESS_RUNS=200 stage sm80 120 $PY -m pytest -q \
            -p no:cacheprovider tests/gpu -k "world1 or stress or offload" ;;
    conformance) stage conformance 240 $PY -m pytest -q -p no:cacheprovider --pyargs \
                   flashoverlap_core.testing --fo-backend cuda --fo-world-sizes 1 ;;
    gemm) stage gemm 240 $PY bench/gemm.py ;;
    # fp8 (issue 23): the e4m3 signaling GEMM's tests, the conformance suite's fp8 cases against
    # cuda, and the fp8 set of bench/gemm.py against torch._scaled_mm (gemm-fp8-*.json)
    fp8) FO_GEMM_TEST_CONFIGS=e4m3 stage fp8-tests 420 $PY -m pytest -q -p no:cacheprovider -rs \
           tests/gpu/test_cuda_fp8.py tests/gpu/test_gemm_epilogue.py -k "e4m3 or test_cuda_fp8"
         stage fp8-conformance 240 $PY -m pytest -q -p no:cacheprovider -rs --pyargs \
           flashoverlap_core.testing --fo-backend cuda --fo-world-sizes 1 -k fp8 ;;
    gemmfp8) stage gemmfp8 300 $PY bench/gemm.py --fp8 ${FO_GEMM_FP8_ARGS:-} ;;
    reorder) stage reorder 60 $PY bench/reorder.py ;;
    offload) stage offload 120 $PY bench/offload.py --timeline "$OUT/timeline.png" ;;
    tuning) stage tuning 300 $PY bench/tuning.py --timeline "$OUT/tuning-timeline.png" ${FO_TUNING_ARGS:-} ;;
    # The main job with the signaling backend and with the decomposition baseline, side by side.
    mainjob) stage mainjob-cuda 90 flashoverlap bench --backend cuda --json "$OUT/bench-cuda.json"
             stage mainjob-decomposition 90 flashoverlap bench --backend decomposition \
               --device cuda --json "$OUT/bench-decomposition.json"
             # fp8 (issue 23): e4m3 with row-wise scales against torch._scaled_mm + NCCL
             stage mainjob-fp8 90 flashoverlap bench --backend cuda --dtype float8_e4m3fn \
               --json "$OUT/bench-cuda-fp8.json" ;;
    # Ranks sharing the one GPU (each its own NCCL host id, NCCL's socket transport on
    # loopback): every multi-rank path of the cuda backend, correctness only (no speed figure
    # comes from it). Fits one 10-minute device command; writes multirank-h200-<date>.json.
    # (or its parts: multirank-conformance, multirank-tests, multirank-bench, multirank-summary)
    multirank) for part in conformance tests bench summary; do run_stage "multirank-$part"; done ;;
    multirank-conformance)
      stage multirank-conformance 240 $PY -m pytest -q -p no:cacheprovider -rs --pyargs \
        flashoverlap_core.testing.test_collectives --fo-backend cuda --fo-shared-devices \
        --fo-world-sizes 2,3,4 --junitxml "$OUT/multirank-conformance.xml" ;;
    multirank-tests)
      stage multirank-tests 330 env FO_MULTIRANK_WORLD_SIZES=2,4 $PY -m pytest -q -p no:cacheprovider \
        -rs tests/gpu/test_multirank.py --junitxml "$OUT/multirank-tests.xml" ;;
    multirank-bench)
      stage multirank-bench 100 $PY bench/multigpu.py --world-size 2 --shared-devices \
        --backend cuda --quick --shapes 1024x1024x512,2048x768x1024 --candidates 4 \
        --json "$OUT/multigpu-w2-shared.json" ;;
    multirank-summary)
      stage multirank-summary 30 $PY ci/junit_summary.py multirank \
        "$OUT/multirank-h200-$(date -u +%Y%m%d-%H%M%S).json" --world-sizes 2,3,4 \
        "$OUT/multirank-conformance.xml" "$OUT/multirank-tests.xml" \
        --extra "$OUT/multigpu-w2-shared.json" \
        --note "ranks sharing one GPU through NCCL's socket transport: correctness only" ;;
    # all_to_all with each call's rows and splits at world size 1 (world sizes 2-4: multirank)
    moe-tests) FO_STRESS_RUNS=100 FO_CONCURRENT_ROUNDS=100 FO_REPEAT_CALLS=500 \
      stage moe-tests 240 $PY -m pytest -q -p no:cacheprovider -rs tests/gpu/test_cuda_moe.py \
        tests/gpu/test_cuda.py -k "all_to_all or moe or world1 or lazy" ;;
    # The post-reorder fused into residual add + RMSNorm (issue 22): its GPU tests, its
    # conformance cases at world size 1, and bench/fused_norm.py (writes
    # fused-norm-<device>-<date>.json; summary.met). ~5 minutes, at most 9.5.
    fusednorm)
      stage fusednorm-tests 180 $PY -m pytest -q -p no:cacheprovider -rs tests/gpu/test_fused_norm.py
      stage fusednorm-conformance 120 $PY -m pytest -q -p no:cacheprovider -rs --pyargs \
        flashoverlap_core.testing.test_add_rmsnorm --fo-backend cuda --fo-world-sizes 1
      stage fusednorm-bench 270 $PY bench/fused_norm.py ;;
    # Its conformance cases at W = 2-4 with ranks sharing the one GPU (correctness only).
    fusednorm-multirank) stage fusednorm-multirank 500 $PY -m pytest -q -p no:cacheprovider -rs \
        --pyargs flashoverlap_core.testing.test_add_rmsnorm --fo-backend cuda --fo-shared-devices \
        --fo-world-sizes 2,3,4 --junitxml "$OUT/fusednorm-multirank.xml" ;;
    # The default call against a @ b + the same collective at world size 1 (issue 30: rows
    # plans, no post-reorder): writes overhead-<device>-<date>.json (summary.met).
    overhead) stage overhead 540 $PY bench/overhead.py ${FO_OVERHEAD_ARGS:-} ;;
    *) echo "unknown stage $1" | tee -a "$SUMMARY" ;;
  esac
}
for s in "${STAGES[@]}"; do run_stage "$s"; done
cat "$SUMMARY"
grep -q "rc=[1-9]" "$SUMMARY" && exit 1 || exit 0
