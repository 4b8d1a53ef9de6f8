#!/usr/bin/env bash
# Issue 33's all_to_all pairing failure: it shows in one W = 2 conformance run of several, so
# many runs go at once, each a variant's environment (ranks sharing the GPU, -x: the first
# failure ends a run). Run on the device after a build, from ci/round.sh's "a2a-race" stage.
#   FO_RACE_VARIANTS  variants separated by ";", each "NAME=VALUE ..." (default: the watchdog
#                     off and on)
#   FO_RACE_COPIES    runs of each variant at once (default 2)
#   FO_RACE_K         the cases (default: allreduce, reduce_scatter and all_to_all: the failing
#                     case is the first all_to_all after the others)
# Each run's log goes to $OUT/race/<variant>-<copy>.txt; one line per run on stdout: its
# variant, pytest's last line, NCCL's first warning and the seed.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?}"
PY=${PYTHON:-python3}
variants=${FO_RACE_VARIANTS:-FLASHOVERLAP_WATCHDOG=0;FLASHOVERLAP_WATCHDOG=1}
copies=${FO_RACE_COPIES:-2}
k=${FO_RACE_K:-allreduce or reduce_scatter or all_to_all}
mkdir -p "$OUT/race"
one() {  # one NAME VARS...: a conformance run with VARS set
  local name=$1; shift
  local log="$OUT/race/$name.txt"
  env NCCL_DEBUG=${NCCL_DEBUG:-WARN} "$@" timeout 280 "$PY" -m pytest -q -p no:cacheprovider -x \
    --pyargs flashoverlap_core.testing.test_collectives --fo-backend cuda --fo-shared-devices \
    --fo-world-sizes 2 -k "$k" >"$log" 2>&1
  local rc=$?
  echo "$name [$*] rc=$rc: $(tail -1 "$log") | $(grep -m1 -o 'NCCL WARN.*' "$log" | cut -c1-110) |" \
       "$(grep -m1 -o 'seed [0-9]*' "$log")"
}
i=0
IFS=';' read -ra list <<<"$variants"
for v in "${list[@]}"; do
  i=$((i + 1))
  for c in $(seq 1 "$copies"); do
    # shellcheck disable=SC2086
    one "v$i-$c" $v &
  done
done
wait
# at most 8 files come back from a device call: the logs travel as one archive
tar -czf "$OUT/race-logs.tgz" -C "$OUT" race && rm -rf "$OUT/race"
