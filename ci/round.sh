#!/usr/bin/env bash
# One device call of this session's verification: the stages named in $@ after a build, then
# the new kernel objects (only those built here) back through $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
# A kernel cache carried compressed (.fo_carry/cache.tgz, made here with
# `tar czf .fo_carry/cache.tgz -C .fo_build cache`): a third of the size of .fo_build itself
if [ -f .fo_carry/cache.tgz ]; then mkdir -p .fo_build && tar xzf .fo_carry/cache.tgz -C .fo_build; fi
touch /tmp/fo-marker
LOG_NAME=round
source ci/lib.sh
run_one() {
  local s=$1
  case $s in
    build) stage build ${FO_BUILD_SECONDS:-200} flashoverlap build --backend cuda --jobs 16 ;;
    # the block-scaled 128x256 builds (not prebuilt by default: kernels.FP8_BLOCK_CONFIGS), for
    # fp8-k (FO_FP8_K=wide_tile) and the bench's blk256 variants
    build-wide) stage build-wide ${FO_BUILD_SECONDS:-200} $PY -c "from flashoverlap_backends.cuda import build, kernels; from dataclasses import replace; c = kernels.block_scaled_configs(90, (128, 256)); build.prebuild(c + [replace(x, epi_slots=1) for x in c[:1]], jobs=16)" ;;
    epilogue) FO_GEMM_TEST_CONFIGS=${FO_GEMM_TEST_CONFIGS:--e4m3} stage epilogue 170 $PY -m pytest -q -x -p no:cacheprovider tests/gpu/test_gemm_epilogue.py ;;
    moe-tests) FO_STRESS_RUNS=100 FO_CONCURRENT_ROUNDS=100 FO_REPEAT_CALLS=500 stage moe-tests 150 $PY -m pytest -q -p no:cacheprovider -rs tests/gpu/test_cuda_moe.py tests/gpu/test_cuda.py -k "all_to_all or moe or world1 or lazy" ;;
    fp8) FO_GEMM_TEST_CONFIGS=e4m3 stage fp8-tests ${FO_FP8_SECONDS:-120} $PY -m pytest -q -p no:cacheprovider -rs tests/gpu/test_cuda_fp8.py tests/gpu/test_gemm_epilogue.py -k "e4m3 or test_cuda_fp8" ;;
    callpath) stage callpath 90 $PY bench/callpath.py ;;
    mr-conf) stage multirank-conformance 240 $PY -m pytest -q -p no:cacheprovider -rs --pyargs flashoverlap_core.testing.test_collectives --fo-backend cuda --fo-shared-devices --fo-world-sizes ${FO_MR_WORLDS:-2,3,4} --junitxml "$OUT/multirank-conformance.xml" ;;
    gemm) stage gemm 240 $PY bench/gemm.py ${FO_GEMM_ARGS:-} ;;
    # the conformance suite's fp8 cases (every op and scaling) on cuda, ranks sharing the GPU
    fp8-conf) stage fp8-conformance ${FO_FP8_CONF_SECONDS:-300} $PY -m pytest -q -p no:cacheprovider -rs --pyargs flashoverlap_core.testing.test_fp8 --fo-backend cuda --fo-shared-devices --fo-world-sizes ${FO_FP8_WORLDS:-1,2,3,4} --junitxml "$OUT/fp8-conformance.xml" ;;
    cuda-tests) stage cuda-tests ${FO_CUDA_TESTS_SECONDS:-150} $PY -m pytest -q -p no:cacheprovider -rfEs --tb=short --durations=5 tests/gpu/test_cuda.py ${FO_CUDA_K:+-k "$FO_CUDA_K"} ;;
    plain) stage plain-path 90 $PY -m pytest -q -p no:cacheprovider -rfEs --tb=short tests/gpu/test_cuda.py -k "plain_path or native_call" ;;
    # tests/gpu/test_cuda_fp8.py by name (FO_FP8_K), e.g. wide_tile
    fp8-k) stage fp8-k ${FO_FP8_SECONDS:-120} $PY -m pytest -q -p no:cacheprovider -rfEs --tb=short tests/gpu/test_cuda_fp8.py -k "${FO_FP8_K:?}" ;;
    # the fp8 builds on CUTLASS's own kernel (gemm_sm90_stock.cu): order, signal, where they run
    fp8-stock) stage fp8-stock ${FO_FP8_SECONDS:-150} $PY -m pytest -q -p no:cacheprovider -rfEs --tb=short tests/gpu/test_cuda_fp8_stock.py ;;
    fp8all) stage fp8-all 150 $PY -m pytest -q -p no:cacheprovider -rfEs --tb=short tests/gpu/test_cuda_fp8.py ;;
    # issue 33's all_to_all pairing failure: many W = 2 runs at once, a variant each (ci/a2a_race.sh)
    a2a-race) stage a2a-race ${FO_RACE_SECONDS:-300} bash ci/a2a_race.sh ;;
    norm) stage fused-norm ${FO_NORM_SECONDS:-150} $PY -m pytest -q -p no:cacheprovider -rfEs --tb=short tests/gpu/test_fused_norm.py ;;
    norm-plain) stage norm-plain 90 $PY -m pytest -q -p no:cacheprovider -rs tests/gpu/test_fused_norm.py -k "plain or rows" ;;
    mr[234]) stage "multirank-w${s#mr}" ${FO_MR_SECONDS:-150} $PY -m pytest -v -p no:cacheprovider -rfEs --tb=short --durations=12 --pyargs flashoverlap_core.testing.test_collectives --fo-backend cuda --fo-shared-devices --fo-world-sizes "${s#mr}" ${FO_MR_K:+-k "$FO_MR_K"} ;;
    strategy) stage strategy 150 $PY bench/strategy.py ;;
    tuning) stage tuning ${FO_TUNING_SECONDS:-150} $PY bench/tuning.py ${FO_TUNING_ARGS:-} ;;
    mr-outs) FO_MULTIRANK_WORLD_SIZES=${FO_MR_WORLDS:-2,4} stage multirank-own-outputs 150 $PY -m pytest -q -p no:cacheprovider -rfEs --tb=short tests/gpu/test_multirank.py -k own_outputs ;;
    # tests/gpu/test_multirank.py by name (FO_MR_K; mr2..mr4 are the conformance suite)
    mr-k) FO_MULTIRANK_WORLD_SIZES=${FO_MR_WORLDS:-2,4} stage multirank-tests ${FO_MR_SECONDS:-150} $PY -m pytest -q -p no:cacheprovider -rfEs --tb=short tests/gpu/test_multirank.py -k "${FO_MR_K:?}" ;;
    mr-strategy) FO_MULTIRANK_WORLD_SIZES=${FO_MR_WORLDS:-2,4} stage multirank-strategy 120 $PY -m pytest -q -p no:cacheprovider -rfEs --tb=short tests/gpu/test_multirank.py -k same_strategy ;;
    gemmfp8) stage gemmfp8 240 $PY bench/gemm.py --fp8 ${FO_GEMM_FP8_ARGS:-} ;;
    # stock CUTLASS fp8 row-wise GEMMs beside the product and _scaled_mm (their objects are
    # built into .fo_build/cache/cutlass_ref where missing, and come back with the cache)
    cutlass-ref) stage cutlass-ref ${FO_REF_SECONDS:-330} $PY bench/cutlass_ref.py --jobs 16 ${FO_REF_ARGS:-} ;;
    moe) stage moe 200 $PY bench/moe.py ;;
    faults-tests) stage faults-tests ${FO_FAULTS_SECONDS:-420} $PY -m pytest -v -p no:cacheprovider -rfEs --tb=short --durations=10 ${FO_FAULTS_WORKERS:+-n $FO_FAULTS_WORKERS} tests/gpu/test_faults.py ${FO_FAULTS_K:+-k "$FO_FAULTS_K"} ;;
    faults-bench) stage faults-bench ${FO_FAULTS_BENCH_SECONDS:-400} $PY bench/faults.py ${FO_FAULTS_ARGS:-} ;;
    cache) ( cd .fo_build/cache && find . -type f -name '*.so' -newer /tmp/fo-marker | tar -cz -T - \
             | split -b 15m - "$OUT/new-cache.tgz.part-" ) && echo "cache: $(ls "$OUT" | grep -c new-cache) parts" | tee -a "$SUMMARY" ;;
    profile) stage profile 150 $PY bench/overhead.py --profile "${FO_PROFILE_ROWS:?}" ;;
    b2b) stage profile-b2b 150 $PY bench/overhead.py --back-to-back --profile "${FO_PROFILE_ROWS:?}" ;;
    split) stage overhead-split ${FO_SPLIT_SECONDS:-150} $PY bench/overhead.py --split "${FO_SPLIT_ROWS:?}" ;;
    # the fault tests (xdist: scenarios at once, each in its own processes) beside the fault
    # benchmark: neither times anything but seconds-long timeouts
    faults) stage faults-bench ${FO_FAULTS_BENCH_SECONDS:-400} $PY bench/faults.py ${FO_FAULTS_ARGS:-} >/dev/null &
            stage faults-tests ${FO_FAULTS_SECONDS:-420} $PY -m pytest -v -p no:cacheprovider -rfEs --tb=short \
              --durations=10 -n ${FO_FAULTS_WORKERS:-4} tests/gpu/test_faults.py
            wait ;;
    # two or more GPUs, one per rank (never ranks sharing a GPU): the strategy decision against
    # both strategies measured, the conformance suite on real links, the multi-GPU benchmark
    strategy-mg) stage strategy-w${FO_MG_WORLD:-2} ${FO_STRATEGY_SECONDS:-300} $PY bench/strategy.py --world-size ${FO_MG_WORLD:-2} ${FO_STRATEGY_ARGS:-} ;;
    # the same rows under each "RESERVED_SMS:NCCL_CTAS" of FO_SWEEP (the SMs the signaling GEMM
    # leaves free, the CTAs its collectives may take; allgather's bound follows, 4 for 0)
    ctas-sweep) for rc in ${FO_SWEEP:?}; do
                  sweep_stage "$rc" "sweep-$rc" ${FO_STRATEGY_SECONDS:-120} $PY bench/strategy.py --world-size ${FO_MG_WORLD:-2} ${FO_STRATEGY_ARGS:-}
                done ;;
    conf-mg) stage conformance-w${FO_MG_WORLD:-2} ${FO_CONF_SECONDS:-240} $PY -m pytest -q -p no:cacheprovider -rfEs --pyargs flashoverlap_core.testing.test_collectives --fo-backend cuda --fo-world-sizes ${FO_MG_WORLD:-2} --junitxml "$OUT/conformance-w${FO_MG_WORLD:-2}.xml" ;;
    multigpu) stage multigpu-w${FO_MG_WORLD:-2} ${FO_MULTIGPU_SECONDS:-300} $PY bench/multigpu.py --world-size ${FO_MG_WORLD:-2} --backend cuda --json "$OUT/multigpu-w${FO_MG_WORLD:-2}.json" ${FO_MULTIGPU_ARGS:---quick} ;;
    # on FO_MG_WORLD GPUs, one rank each: MoE all_to_all steps and the Llama-style TP MLP block
    moe-mg) stage moe-w${FO_MG_WORLD:-2} ${FO_MOE_SECONDS:-200} $PY bench/moe.py --world-size ${FO_MG_WORLD:-2} ;;
    e2e-mg) stage e2e-w${FO_MG_WORLD:-2} ${FO_E2E_SECONDS:-200} $PY bench/e2e_mlp.py --world-size ${FO_MG_WORLD:-2} ${FO_E2E_ARGS:-} ;;
    overhead) stage overhead ${FO_OVERHEAD_SECONDS:-540} $PY bench/overhead.py ${FO_OVERHEAD_ARGS:-} ;;
    gather) stage gather-tests ${FO_GATHER_SECONDS:-240} $PY -m pytest -q -p no:cacheprovider -rfEs --tb=short tests/gpu/test_cuda_allgather.py ${FO_GATHER_K:+-k "$FO_GATHER_K"} ;;
    # Nsight Compute on the fp8 kernels (bench/fp8_ncu.py): the report and its details as CSV
    ncu-fp8) stage ncu-fp8 ${FO_NCU_SECONDS:-240} ncu --profile-from-start off --nvtx --set ${FO_NCU_SET:-full} \
               -f -o "$OUT/fp8-ncu" $PY bench/fp8_ncu.py ${FO_NCU_ARGS:-}
             ncu --import "$OUT/fp8-ncu.ncu-rep" --csv --page details >"$OUT/fp8-ncu-details.csv" 2>&1 || true
             ncu --import "$OUT/fp8-ncu.ncu-rep" --csv --page raw >"$OUT/fp8-ncu-raw.csv" 2>&1 || true
             # FO_NCU_SOURCE=1: per-SASS-instruction counters (warp stalls sampled by instruction)
             if [ "${FO_NCU_SOURCE:-0}" = 1 ]; then
               ncu --import "$OUT/fp8-ncu.ncu-rep" --csv --page source --print-source sass \
                 >"$OUT/fp8-ncu-source.csv" 2>&1 || true
               $PY bench/ncu_source.py "$OUT/fp8-ncu-source.csv" --top 30 \
                 --json "$OUT/fp8-ncu-source-extract.json" --source "bench/fp8_ncu.py ${FO_NCU_ARGS:-}" \
                 >"$OUT/fp8-ncu-source-extract.txt" 2>&1 || true
               head -c 600 "$OUT/fp8-ncu-source.csv" >>"$LOG"
             fi
             # the report itself is large (it would push the results archive past what comes
             # back); FO_NCU_KEEP=1 keeps it
             [ "${FO_NCU_KEEP:-0}" = 1 ] || rm -f "$OUT/fp8-ncu.ncu-rep" ;;
    # Nsight Compute on one all_to_all call (bench/a2a_ncu.py): its table kernel and GEMM
    ncu-a2a) stage ncu-a2a ${FO_NCU_SECONDS:-120} ncu --profile-from-start off --set ${FO_NCU_SET:-full} \
               -f -o "$OUT/a2a-ncu" $PY bench/a2a_ncu.py ${FO_NCU_ARGS:-}
             ncu --import "$OUT/a2a-ncu.ncu-rep" --csv --page details >"$OUT/a2a-ncu-details.csv" 2>&1 || true ;;
    # objects compiled elsewhere (carried .fo_build) under this machine's toolchain names
    adopt) stage adopt-cache 60 $PY ci/adopt_cache.py ;;
    *) echo "unknown stage $s" | tee -a "$SUMMARY" ;;
  esac
  # kernel objects built inside the stage (a JIT build inside a test is slow and skews timings)
  echo "  new objects after $s: $(find .fo_build/cache -name '*.so' -newer /tmp/fo-marker | wc -l)" | tee -a "$SUMMARY"
}
# A stage may carry one variable for itself alone: NAME=VALUE:stage (FLASHOVERLAP_WATCHDOG=1:mr-outs)
for s in "$@"; do
  if [[ $s == *=*:* ]]; then
    echo "--- ${s%%:*} for ${s#*:}" | tee -a "$SUMMARY" "$LOG"
    ( export "${s%%:*}"; run_one "${s#*:}" )
  else
    run_one "$s"
  fi
done
# (files come back at most 16 MiB each: the archive in parts of 15 MiB, joined with cat)
ls "$OUT"/new-cache.tgz.part-* >/dev/null 2>&1 || ( cd .fo_build/cache && find . -type f -name '*.so' -newer /tmp/fo-marker | tar -cz -T - \
    | split -b 15m - "$OUT/new-cache.tgz.part-" ) && ls -la "$OUT"
cat "$SUMMARY"
# At most 8 files come back: results and logs travel as one archive (see ci/bundle.sh)
bash ci/bundle.sh
