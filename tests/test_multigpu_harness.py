"""bench/multigpu.py on the CPU: a dry run at W=2 with tiny shapes (reference backend, gloo),
the allgather rows (timed, checked against float64, a wrong or unwritten result caught), the
robustness mode's rank-failure check finishing within its process-group timeout, and the
default shapes running every op at every world size."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
SCRIPT = ROOT / "bench" / "multigpu.py"
sys.path.insert(0, str(ROOT / "bench"))


def _run(tmp_path, *args, timeout=90, backend="reference"):
    out = tmp_path / "result.json"
    # tests/ importable: the broken backends below are loaded by module:attr on every rank
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "FO_RESULTS_DIR": str(tmp_path), "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--backend", backend, "--device",
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
    assert [r["op"] for r in doc["rows"]] == list(multigpu.OPS)
    for row in doc["rows"]:
        assert row["status"] == "ok", row
        for column in multigpu.COLUMNS:
            assert column in row, column
        for column in ("t_gemm_ms", "t_comm_ms", "sequential_ms", "decomposition_ms",
                       "fo_default_ms", "fo_predicted_ms", "ideal_ms", "speedup_fo_predicted",
                       "efficiency_fo_predicted"):
            assert isinstance(row[column], float) and row[column] > 0, (column, row)
        # every result was checked, and each fo variant says what it ran on
        assert {"fo_default", "fo_predicted", "decomposition"} <= set(row["max_error"]), row
        assert set(row["max_error"]) | {"sequential"} == set(row["ref_error"]), row
        assert set(row["notes"]["ran"]) == set(row["max_error"]) - {"symm_mem"}, row
        assert row["notes"]["ran"]["decomposition"].startswith("decomposition/overlap"), row
        # On the CPU torch's fused matmul + reduce-scatter cannot run: the row says why.
        assert row["symm_mem_ms"] is None
        assert row["notes"]["symm_mem"].startswith("unavailable: ")
        assert row["disagree"] == [] and row["bound"] is not None
    allreduce = next(r for r in doc["rows"] if r["op"] == "allreduce")
    assert allreduce["fo_best_ms"] is not None and allreduce["predictor_error_pct"] is not None
    assert doc["summary"]["mismatches"] == [] and doc["summary"]["errors"] == []


@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.full), 2])
def test_allgather_rows_are_timed_and_checked(tmp_path, world):
    """Each rank's GEMM is the gathered [M, K] @ [K, N]: 4 row bands of 128 per rank at W=2
    (several chunkings to measure), a ragged shape of one partial band, and an M that the
    world size does not divide (skipped, saying why)."""
    proc, doc = _run(tmp_path, "--world-size", str(world), "--ops", "allgather", "--shapes",
                     f"{512 * world}x64x32,{6 * world}x40x24,{2 * world + 1}x8x8", timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    big, ragged, odd = doc["rows"]
    assert odd["status"] == ("skipped" if world > 1 else "ok"), odd
    for row in (big, ragged):
        assert row["op"] == "allgather" and row["status"] == "ok", row
        for column in ("t_gemm_ms", "sequential_ms", "decomposition_ms", "fo_default_ms",
                       "fo_predicted_ms", "fo_best_ms", "speedup_fo_best"):
            assert isinstance(row[column], float) and row[column] > 0, (column, row)
        assert row["t_comm_ms"] > 0, row  # at W=1 too: the group of one still copies
        assert row["predicted_ms"] is None and "no allgather workload" in row["notes"]["tuner"]
        assert row["symm_mem_ms"] is None
        assert row["notes"]["symm_mem"].startswith("unavailable: symmetric memory needs CUDA")
        # checked against the sequential result and against float64, within the bound
        assert set(row["max_error"]) == {"fo_default", "fo_predicted", "fo_best",
                                         "decomposition"}, row
        assert all(e <= row["bound"] for e in row["max_error"].values()), row
        assert all(e <= row["bound"] for e in row["ref_error"].values()), row
        ran = row["notes"]["ran"]
        assert ran["fo_predicted"] == ran["fo_best"] == "reference/overlap (PreparedCall)", ran
        assert ran["decomposition"].startswith("decomposition/overlap"), ran
        # default arguments: fo's own choice on host tensors is the decomposition
        assert ran["fo_default"].startswith("decomposition/overlap"), ran
        assert row["notes"]["backend"] == "backend 'reference'", row["notes"]
    if world == 2:  # 4 bands per rank: the plan's own grouping and 1, 2, 4 chunks
        assert big["candidates"] >= 3 and big["groups_best"] is not None, big
        tiles = sum(big["groups_predicted"])
        assert sum(big["groups_best"]) == tiles and tiles == 2 * 4 * 1, big
    assert doc["summary"]["allgather"]["cases"] == (2 if world > 1 else 3)
    # the README's table shows the rows, with the backend fo's plan ran on
    import multigpu_report

    text = multigpu_report.markdown([doc])
    cells = [line.split(" | ") for line in text.splitlines() if f"| {big['shape']} |" in line]
    assert len(cells) == 1 and len(cells[0]) == len(multigpu_report.HEADER), text
    assert "allgather" in cells[0] and "reference/overlap" in cells[0], text
    assert "allgather geomean speedup FO" in text, text
    assert "symm-mem allgather: unavailable: symmetric memory needs CUDA" in text, text


@pytest.mark.parametrize("broken", ["test_allgather_broken:ShardsOutOfOrder",
                                    "test_allgather_broken:UnwrittenArrivingTile"])
@pytest.mark.full
def test_wrong_allgather_result_is_a_mismatch(tmp_path, broken):
    """A backend that takes the wrong rank's rows, or never writes a tile (caught only because
    the output is poisoned: the timed calls left the right values there), fails the row."""
    proc, doc = _run(tmp_path, "--world-size", "2", "--ops", "allgather", "--shapes",
                     "512x64x32", backend=broken, timeout=120)
    (row,) = doc["rows"]
    assert row["status"] == "mismatch", row
    assert {"fo_predicted", "fo_best"} <= set(row["disagree"]), row
    assert "decomposition" not in row["disagree"] and "fo_default" not in row["disagree"], row
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.full
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
        cases = multigpu.cases_for(None, multigpu.OPS, world, quick, on_cpu=False)
        assert len(set(cases)) == len(cases), f"duplicate cases (quick={quick})"
        assert {op for _, op in cases} == set(multigpu.OPS)
        skipped = [(s, op) for s, op in cases if multigpu.skip_reason(s, op, world)]
        assert not skipped, f"quick={quick}: {skipped}"
    for m, n, k in multigpu.llm_shapes(world):
        assert k * world in (n, multigpu.LLM_FFN[n]), (m, n, k)
    for m, n, k in multigpu.llm_gather_shapes(world):  # column-parallel: N sharded, K whole
        assert k in multigpu.LLM_FFN and n * world in (2 * multigpu.LLM_FFN[k], 3 * k), (m, n, k)
