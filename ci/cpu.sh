#!/usr/bin/env bash
# The CPU test run, as on a fresh machine: a virtual environment, torch==2.13.0 (the CPU build;
# installed first so that nothing pulls a multi-GB accelerator build), the package with its test,
# examples and cuda extras, then exactly the README's test command, the full matrix's own tests
# (pytest --full -m full: world sizes 3-4, compile variants, long sequences, faults) and the
# examples under torchrun (ci/examples.sh). Every stage runs; the script fails if any did. "No
# tests collected" (pytest exit code 5) is a failure, not a pass.
#   VENV   where the environment goes (default: .venv in the repository)
set -euo pipefail
cd "$(dirname "$0")/.."

TEST_COMMAND="pytest"
if ! grep -qxF "$TEST_COMMAND" README.md; then
    echo "ci/cpu.sh: README.md no longer shows the test command '$TEST_COMMAND' on a line of its own;" \
         "update TEST_COMMAND here to match it" >&2
    exit 1
fi

VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# shellcheck disable=SC1091
source "$VENV/bin/activate"
python -m pip install --quiet torch==2.13.0
# the cuda extra too (CUTLASS's headers, pybind11): where nvcc is present, the CPU tests of the
# cuda runtime's binding build it and run (ci/compile_cuda.sh then reuses that build)
python -m pip install --quiet -e '.[test,examples,cuda]'

failed=0
stage() {  # stage NAME CMD...: run it, say its status, time and CPU time (of all its processes)
    local name=$1 start=$SECONDS status TIMEFORMAT="ci/cpu.sh: $1: %0U s user + %0S s system CPU"
    shift
    echo "+ $*"
    set +e
    time "$@"
    status=$?
    set -e
    if [ "$status" -eq 5 ]; then
        echo "ci/cpu.sh: $name collected no tests: that is a failure" >&2
        status=1
    fi
    echo "ci/cpu.sh: $name: exit status $status after $((SECONDS - start)) s"
    [ "$status" -eq 0 ] || failed=1
}

stage "the README's test command" $TEST_COMMAND
stage "the full matrix" pytest --full -m full
stage "the examples" bash ci/examples.sh
exit "$failed"
