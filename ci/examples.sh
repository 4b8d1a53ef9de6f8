#!/usr/bin/env bash
# The examples as a user runs them: each under torchrun at world size 2 on the CPU (gloo),
# under a timeout (a hang is a failure). Each must exit 0 with one line per rank saying it ran
# ("<name> example: rank R of 2: ..."), and no rank may have run alone (fo's warning that a
# launcher's rank has no process group). Needs the package with its examples extra
# (pip install -e '.[examples]': transformers, for examples/llama.py).
#   NPROC             ranks (default 2)
#   EXAMPLE_TIMEOUT   seconds each example may take (default 600)
set -uo pipefail
cd "$(dirname "$0")/.."
NPROC=${NPROC:-2}
log=$(mktemp)
trap 'rm -f "$log"' EXIT

failed=0
for example in api in_a_model llama; do
  start=$SECONDS
  timeout --kill-after=10 "${EXAMPLE_TIMEOUT:-600}" \
    torchrun --standalone --nproc_per_node "$NPROC" "examples/$example.py" >"$log" 2>&1
  rc=$?
  # counted, not lines: the ranks share one output, so two reports may share a line
  ranks=$(grep -o "example: rank [0-9]* of $NPROC: " "$log" | wc -l)
  alone=$(grep -c "torch.distributed has no process group" "$log")
  if [ "$rc" -ne 0 ] || [ "$ranks" -ne "$NPROC" ] || [ "$alone" -ne 0 ]; then
    why="exit $rc"
    [ "$rc" -eq 124 ] && why="timed out"
    echo "examples/$example.py: FAILED ($why, $ranks of $NPROC ranks reported, $alone ran" \
         "alone) after $((SECONDS - start)) s; its output:"
    cat "$log"
    failed=1
  else
    echo "examples/$example.py: passed on $NPROC ranks in $((SECONDS - start)) s"
    grep "example: rank" "$log" | sed 's/^/  /'
  fi
done
exit "$failed"
