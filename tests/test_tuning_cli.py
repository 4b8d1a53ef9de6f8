"""``flashoverlap tune`` and ``flashoverlap trace`` on two CPU ranks, run as a user runs them:
in a subprocess, under a timeout (through their modules until the top-level command lists them)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from flashoverlap_core.tuning import trace_main, tune_main
from flashoverlap_core.tuning.cache import FORMAT

TIMEOUT = 240


def command(module: str, *args: str, cache) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"flashoverlap_core.tuning.{module}", *args,
                           "--cache", str(cache)], capture_output=True, text=True,
                          timeout=TIMEOUT)


@pytest.mark.timeout(2 * TIMEOUT + 30)
def test_tune_then_trace_the_tuned_plan_on_two_cpu_ranks(tmp_path):
    cache, rows = tmp_path / "cache" / "tuning.json", tmp_path / "rows.json"
    done = command("tune_cli", "--shapes", "512x256x16,256x128x8", "--op", "allreduce",
                   "--world-size", "2", "--backend", "reference", "--iters", "2",
                   "--warmup", "1", "--exhaustive", "--candidates", "4", "--json", str(rows),
                   cache=cache)
    assert done.returncode == 0, done.stdout + done.stderr
    header = next(line for line in done.stdout.splitlines() if "predicted ms" in line)
    assert "measured ms" in header and "sequential ms" in header
    assert "] 4/4 " in done.stderr  # the progress bar: model and timings of both shapes
    stored = json.loads(cache.read_text())
    assert stored["format"] == FORMAT
    plans = {(e["key"]["M"], e["key"]["N"], e["key"]["K"]): e for e in stored["plans"]}
    assert set(plans) == {(512, 256, 16), (256, 128, 8)}
    for entry in plans.values():
        key = entry["key"]
        assert (key["op"], key["world_size"], key["collective"], key["backend"]) == \
            ("allreduce", 2, "gloo", "reference")
        assert entry["value"]["measured_ms"] > 0
    assert stored["curves"] and stored["gemm"] and stored["contention"]
    table = json.loads(rows.read_text())["rows"]
    assert all(r["predicted_ms"] > 0 and r["measured_ms"] > 0 for r in table)
    two_waves = next(r for r in table if r["shape"] == "512x256x16")
    assert two_waves["waves"] == 2 and two_waves["candidates_timed"] == 2  # [8] and [4, 4]

    png = tmp_path / "timeline.png"
    done = command("trace_cli", "--shape", "512x256x16", "--op", "allreduce", "--world-size",
                   "2", "--backend", "reference", "--tuned", "--out", str(png),
                   "--json", str(tmp_path / "trace.json"), cache=cache)
    assert done.returncode == 0, done.stdout + done.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    traced = json.loads((tmp_path / "trace.json").read_text())
    tuned = plans[(512, 256, 16)]["value"]["plan"]["group_sizes"]
    assert traced["plan"]["group_sizes"] == tuned
    assert "no tuned plan" not in done.stderr
    assert f"timeline written to {png}" in done.stdout


@pytest.mark.parametrize("main, argv, message", [
    (tune_main, ["--shapes", "64x64"], "MxNxK"),
    (tune_main, ["--shapes", "64x64x64", "--backend", "decomposition", "--world-size", "1"],
     "Backend.trace()"),
    (trace_main, ["--shape", "64x64x64", "--groups", "1,0"], "ints >= 1"),
])
def test_commands_refuse_what_they_cannot_do(main, argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code != 0
    assert message in str(exited.value.code) + capsys.readouterr().err
