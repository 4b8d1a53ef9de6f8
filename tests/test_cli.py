"""The ``flashoverlap`` command, run as a user runs it: in a subprocess, under a timeout."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TIMEOUT = 240
TESTS = Path(__file__).resolve().parent


def flashoverlap(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flashoverlap_core.tools.cli", *args],
                          capture_output=True, text=True, timeout=TIMEOUT,
                          env={**os.environ, **(env or {})})


def test_report_lists_the_reference_backend_and_the_versions_it_promises():
    done = flashoverlap("report")
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines()]
    # reference runs on as many host ranks as asked for, not on "0 devices"
    assert ["reference", "any", "yes", "host"] in [row[:4] for row in rows], done.stdout
    assert "cpu=gloo (built into torch " in done.stdout
    # the compilers and headers of the cuda backend, whether or not it can run here
    cuda = next(line for line in done.stdout.splitlines() if line.startswith("cuda versions:"))
    assert "nvcc " in cuda and "cutlass headers " in cuda, done.stdout


def test_report_json_names_every_backend_with_its_versions():
    done = flashoverlap("report", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    backends = {b["name"]: b for b in report["backends"]}
    assert backends["reference"]["available"], report["backends"]
    assert {"nvcc", "cutlass headers"} <= set(backends["cuda"]["versions"]), backends["cuda"]
    assert report["torch"] and report["torch_distributed_collectives"]["cpu"].startswith("gloo")


@pytest.mark.timeout(TIMEOUT + 30)
def test_bench_on_two_cpu_ranks_agrees_and_writes_json(tmp_path):
    out = tmp_path / "results" / "bench.json"
    done = flashoverlap("bench", "--backend", "reference", "--world-size", "2",
                        "--shapes", "64x48x32,30x17x9", "--iters", "2", "--warmup", "1",
                        "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    header = next(line for line in done.stdout.splitlines() if line.startswith("shape"))
    for column in ("op", "baseline ms", "overlapped ms", "speedup", "max error", "backend", "ok"):
        assert column in header
    rows = [line.split() for line in done.stdout.splitlines()
            if line.startswith(("64x48x32 ", "30x17x9 "))]
    # reduce_scatter of 30 rows on 2 ranks is fine; every op on both shapes ran and agreed
    assert len(rows) == 8, done.stdout
    assert all(row[-1] == "yes" and row[-2] == "reference" for row in rows), done.stdout
    # the output says what is compared, and why CPU ranks show no speedup
    assert "baseline: a @ b, then torch.distributed's collective" in done.stdout
    assert "not a fast path" in done.stdout and "bench/results/" in done.stdout
    assert "Warning" not in done.stdout + done.stderr, done.stderr  # a clean main job

    record = json.loads(out.read_text())
    hardware = record["hardware"]
    assert (hardware["backend"], hardware["device_type"], hardware["world_size"]) == \
        ("reference", "cpu", 2)
    for key in ("device", "date", "commit", "command", "environment"):
        assert key in record
    assert record["environment"]["torch"]
    results = record["results"]
    assert {r["op"] for r in results} == {"allreduce", "reduce_scatter", "all_to_all", "allgather"}
    assert all(r["status"] == "ok" and r["max_error"] <= r["bound"] for r in results)
    assert all(len(r["overlapped_ms_per_iter"]) == 2 for r in results)


def test_bench_skips_what_cannot_run_and_rejects_bad_shapes():
    done = flashoverlap("bench", "--backend", "reference", "--world-size", "2",
                        "--shapes", "7x8x9", "--ops", "reduce_scatter", "--iters", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SKIPPED" in done.stdout and "divisible" in done.stdout

    declined = flashoverlap("bench", "--backend", "fake_backends:NoAllgather", "--world-size",
                            "2", "--shapes", "8x8x8", "--ops", "allgather,allreduce", "--iters",
                            "1", env={"PYTHONPATH": str(TESTS)})
    assert declined.returncode == 0, declined.stdout + declined.stderr
    assert "8x8x8 allgather: skipped: backend 'fake-no-allgather' declines it: no GEMM that " \
        "waits for rows" in declined.stdout, declined.stdout

    bad = flashoverlap("bench", "--shapes", "12x12")
    assert bad.returncode != 0 and "MxNxK" in bad.stderr


@pytest.mark.full
def test_bench_fails_when_the_overlapped_result_is_wrong():
    """A backend that forgets the post-communication reorder must not pass the main job."""
    done = flashoverlap("bench", "--backend", "broken_backends:NoPostReorder", "--world-size", "2",
                        "--shapes", "256x256x8", "--ops", "allreduce", "--iters", "1",
                        env={"PYTHONPATH": str(TESTS)})
    assert done.returncode == 1, done.stdout + done.stderr
    row = next(line.split() for line in done.stdout.splitlines() if line.startswith("256x256x8"))
    assert row[-1] == "MISMATCH", done.stdout
