"""bench/strategy.py --world-size 2 on the CPU: a dry run of the multi-rank decision harness
(reference backend, gloo; its times mean nothing): every op gets a row with both strategies
timed, the default call's choice, the same choice on every rank, and the facts it came from."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "strategy.py"


def test_dry_run_world_size_2(tmp_path):
    env = {**os.environ, "FO_RESULTS_DIR": str(tmp_path)}
    env.pop("FLASHOVERLAP_STRATEGY", None)  # (the conformance plugin sets it): the default's own
    proc = subprocess.run([sys.executable, str(SCRIPT), "--world-size", "2", "--backend",
                           "reference", "--nk", "64x32", "--tokens", "4,130", "--rounds", "1"],
                          capture_output=True, text=True, timeout=240, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = list(tmp_path.glob("strategy-w2-dryrun-reference-*.json"))
    assert len(files) == 1, proc.stdout[-2000:]
    doc = json.loads(files[0].read_text())
    assert doc["world_size"] == 2 and doc["backend"] == "reference"
    rows = doc["rows"]
    assert sorted({(r["op"], r["M"]) for r in rows}) == sorted(
        (op, m) for op in ("allreduce", "reduce_scatter", "all_to_all", "allgather")
        for m in (4, 130))
    for r in rows:
        assert "error" not in r, r
        assert r["T_overlap_ms"] > 0 and r["T_plain_ms"] > 0, r
        assert r["predicted"] in ("overlap", "sequential") and r["ranks_agree"], r
        assert r["faster"] in ("overlap", "sequential") and r["loss"] >= 0, r
        assert set(r["facts"]) == {"gemm_rates", "curve", "contention", "bounded_curve"}, r
        assert r["facts"]["bounded_curve"] is None, r  # cuda's bounded communicator only
        assert r["facts"]["curve"]["sizes"] and r["wave_size"] >= 1, r
        # every op predicted (all_to_all on the plan of the ranks' mean rows, evenly split)
        assert r["predicted_overlap_ms"] > 0 and r["predicted_plain_ms"] > 0, r
    assert doc["summary"]["rows"] == len(rows) and doc["summary"]["ranks_agree"] is True


def test_refit_reads_the_dry_run(tmp_path):
    """bench/strategy_refit.py predicts the rows again under the model's variants, offline."""
    env = {**os.environ, "FO_RESULTS_DIR": str(tmp_path)}
    env.pop("FLASHOVERLAP_STRATEGY", None)
    subprocess.run([sys.executable, str(SCRIPT), "--world-size", "2", "--backend", "reference",
                    "--nk", "64x32", "--tokens", "130", "--rounds", "1", "--ops",
                    "allreduce,allgather,all_to_all"],
                   capture_output=True, text=True, timeout=240, cwd=ROOT, env=env, check=True)
    run = next(tmp_path.glob("strategy-w2-dryrun-reference-*.json"))
    out = tmp_path / "refit.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "strategy_refit.py"), str(run),
                           "--json", str(out)], capture_output=True, text=True, timeout=240,
                          cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["rows"] == 2  # all_to_all is a fixed rule: left out
    assert doc["as_run"] is not None and len(doc["variants"]) == 5 * 5 * 2 * 2
    for v in doc["variants"]:
        assert 0 <= v["rows_within_3pct"] <= 2 and v["median_abs_error"] >= 0, v
    # a run without the facts is refused, not scored
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"rows": [{k: v for k, v in r.items() if k != "facts"}
                                         for r in json.loads(run.read_text())["rows"]]}))
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "strategy_refit.py"), str(bare)],
                          capture_output=True, text=True, timeout=240, cwd=ROOT, env=env)
    assert proc.returncode == 1 and "no usable rows" in proc.stderr
