#!/usr/bin/env bash
# Bundle what a device call wrote under $OUT (results, logs, junit files) into one archive,
# since at most 8 files come back from a call; the kernel-cache parts and summary.txt stay apart.
# Safe to run twice (ci/round.sh runs it; a caller whose round was cut short runs it again):
# each run writes the next results-N.tgz.
cd "${OUT:?}" || exit 1
files=$(find . -maxdepth 1 -type f ! -name 'new-cache.tgz.part-*' ! -name summary.txt \
          ! -name 'results-*.tgz' -printf '%f\n')
if [ -n "$files" ]; then
  n=1; while [ -e "results-$n.tgz" ]; do n=$((n + 1)); done
  # shellcheck disable=SC2086
  tar -czf "results-$n.tgz" $files && rm -f $files
fi
ls -la "$OUT"
