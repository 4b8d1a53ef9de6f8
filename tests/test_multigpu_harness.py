"""bench/multigpu.py on the CPU: a dry run at W=2 with tiny shapes (reference backend, gloo),
the robustness mode's rank-failure check finishing within its process-group timeout, and the
default shapes running every op at every world size."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "multigpu.py"
sys.path.insert(0, str(ROOT / "bench"))


def _run(tmp_path, *args, timeout=90):
    out = tmp_path / "result.json"
    env = {**os.environ, "FO_RESULTS_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--backend", "reference", "--device",
                           "cpu", "--iters", "2", "--warmup", "1", "--candidates", "4",
                           "--json", str(out), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


def test_dry_run_world_size_2_has_every_column(tmp_path):
    import multigpu

    proc, doc = _run(tmp_path, "--world-size", "2", "--shapes", "64x64x32")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for key in ("device", "date", "commit", "command", "world_size", "rows", "summary"):
        assert key in doc, key
    assert doc["world_size"] == 2
    assert {r["op"] for r in doc["rows"]} == {"allreduce", "reduce_scatter", "all_to_all"}
    for row in doc["rows"]:
        assert row["status"] == "ok", row
        for column in multigpu.COLUMNS:
            assert column in row, column
        for column in ("t_gemm_ms", "t_comm_ms", "sequential_ms", "decomposition_ms",
                       "fo_predicted_ms", "ideal_ms", "speedup_fo_predicted",
                       "efficiency_fo_predicted"):
            assert isinstance(row[column], float) and row[column] > 0, (column, row)
        # On the CPU torch's fused matmul + reduce-scatter cannot run: the row says why.
        assert row["symm_mem_ms"] is None
        assert row["notes"]["symm_mem"].startswith("unavailable: ")
        assert row["disagree"] == [] and row["bound"] is not None
    allreduce = next(r for r in doc["rows"] if r["op"] == "allreduce")
    assert allreduce["fo_best_ms"] is not None and allreduce["predictor_error_pct"] is not None
    assert doc["summary"]["mismatches"] == [] and doc["summary"]["errors"] == []


def test_rank_failure_fails_within_pg_timeout(tmp_path):
    pg_timeout = 5.0
    proc, doc = _run(tmp_path, "--world-size", "2", "--shapes", "32x32x16", "--ops",
                     "allreduce", "--robustness", "--skip-bench", "--calls", "20",
                     "--pg-timeout", str(pg_timeout))
    failure = doc["robustness"]["rank_failure"]
    assert failure["status"] == "ok", failure
    (other,) = failure["others"].values()
    assert other["event"] == "failed"
    assert 0 <= other["after_s"] <= failure["allowed_s"]
    assert failure["total_s"] < 60
    assert all(d["status"] == "ok" for d in doc["robustness"]["drift"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("world", [2, 4, 8])
def test_default_shapes_run_every_op_and_shard_k_by_the_world_size(world):
    """No default shape is measured twice or skipped for an op at any world size, and every
    LLM shape is a row-parallel layer: each rank holds 1/W of the hidden or FFN size as K."""
    import multigpu

    for quick in (False, True):
        shapes = multigpu.default_shapes(world, quick, on_cpu=False)
        assert len(set(shapes)) == len(shapes), f"duplicate shapes (quick={quick})"
        skipped = [(s, op) for s in shapes for op in multigpu.OPS
                   if multigpu.skip_reason(s, op, world)]
        assert not skipped, f"quick={quick}: {skipped}"
    for m, n, k in multigpu.llm_shapes(world):
        assert k * world in (n, multigpu.LLM_FFN[n]), (m, n, k)
