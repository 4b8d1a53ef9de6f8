"""bench/e2e_mlp.py on the CPU (gloo ranks, tiny shapes): every overlapped call of the fo block,
forward and backward, is recorded with the backend that ran it, both blocks are measured against
a float64 run of the same block, and a block whose allgather takes the wrong rows fails."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flashoverlap_core.reference import ReferenceBackend
from test_allgather_broken import ShardsOutOfOrder

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
SCRIPT = ROOT / "bench" / "e2e_mlp.py"
T, H, I = 32, 16, 24  # tokens, hidden, intermediate


def _run(tmp_path, *args, world=2, dtype="float32", timeout=180):
    # tests/ importable on every rank: a broken backend is loaded by module:attr
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "FO_RESULTS_DIR": str(tmp_path), "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--world-size",
                           str(world), "--shapes", f"{T}x{H}x{I}", "--dtype", dtype, "--iters",
                           "1", "--no-compile", "--timeout", "120", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    (written,) = tmp_path.glob(f"e2e-mlp-w{world}-*.json")
    (row,) = json.loads(written.read_text())["rows"]
    return proc, row


@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.full), 2])
def test_calls_backends_and_float64_errors_are_recorded(tmp_path, world):
    proc, row = _run(tmp_path, world=world)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # Forward: the gathered token rows times this rank's gate/up shard (weight.t(): "col"),
    # then the down projection reduce-scattered. Backward: the gathered input's gradient is
    # reduce-scattered from a GEMM with the gate/up weight (as it is: "row"); the reduce-
    # scattered output's gradient is all-gathered once for the down weight's gradient and the
    # input's (two GEMMs on the gathered rows: no overlapped call).
    shapes = {(c["pass"], c["op"]): (c["a"], c["b"], c["b_layout"]) for c in row["calls"]}
    w = world
    assert shapes == {
        ("forward", "allgather"): ([T // w, H], [H, 2 * I // w], "col"),
        ("forward", "reduce_scatter"): ([T, I // w], [I // w, H], "col"),
        ("backward", "reduce_scatter"): ([T, 2 * I // w], [2 * I // w, H], "row")}, row["calls"]
    for c in row["calls"]:
        # host tensors: fo picks the decomposition for both ops, and runs it overlapped
        assert (c["backend"], c["strategy"]) == ("decomposition", "overlap"), c
        assert isinstance(c["equal_to_torch"], bool) and 0 <= c["err_fo"] < 1e-5, c
        assert c["err_torch"] < 1e-5 and c["max_abs_diff_vs_torch"] < 1e-5, c
    assert row["backends"] == {"allgather": "decomposition", "reduce_scatter": "decomposition"}
    for key in ("fwd_err_fo", "fwd_err_torch", "grad_err_fo", "grad_err_torch"):
        assert isinstance(row[key], float) and 0 <= row[key] < 1e-5, (key, row)
    assert isinstance(row["fwd_bitwise_equal"], bool) and row["fo_within_bound"] is True
    assert "backends {'allgather': 'decomposition'" in proc.stdout


def test_bfloat16_errors_are_rounding_and_the_chosen_backend_is_recorded(tmp_path):
    """In bf16 both blocks are a few ulps from float64 (not 0: the reference is exact), and a
    backend chosen with --backend is what the forward calls record."""
    proc, row = _run(tmp_path, "--backend", "reference", world=1, dtype="bfloat16")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for key in ("fwd_err_fo", "fwd_err_torch", "grad_err_fo", "grad_err_torch"):
        assert 1e-4 < row[key] < 3e-2, (key, row)
    forward = [c for c in row["calls"] if c["pass"] == "forward"]
    assert {c["op"]: c["backend"] for c in forward} == row["backends"] == {
        "allgather": "reference", "reduce_scatter": "reference"}, row["calls"]


class WrongGatherRows(ShardsOutOfOrder):
    """The reference backend, except that allgather takes another rank's rows in place of the
    right ones (the block's reduce-scatters stay right)."""

    name = "broken-gather-rows-only"

    def run(self, call):
        if call.plan.op == "allgather":
            return super().run(call)
        return ReferenceBackend.run(self, call)


@pytest.mark.full
def test_a_wrong_block_fails_against_float64(tmp_path):
    """fo's block with a wrong allgather is far from float64 while torch's is not, the call
    says which op, and the script fails."""
    proc, row = _run(tmp_path, "--backend", "test_e2e_mlp:WrongGatherRows")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert row["fo_within_bound"] is False and row["fwd_err_fo"] > 1e-2 > row["fwd_err_torch"]
    gather = next(c for c in row["calls"] if (c["pass"], c["op"]) == ("forward", "allgather"))
    assert gather["backend"] == "broken-gather-rows-only", gather
    assert not gather["equal_to_torch"] and gather["err_fo"] > 1e-2 > gather["err_torch"], gather
    assert "FAILED" in proc.stdout
