"""``flashoverlap tune`` and ``flashoverlap trace`` on two CPU ranks, run as a user runs them:
in a subprocess, under a timeout; and every command's refusal of bad arguments: one line, exit
status 2, before any rank starts."""
from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from flashoverlap_core.tools.cli import main
from flashoverlap_core.tools.progress import Progress
from flashoverlap_core.tuning.cache import FORMAT

TIMEOUT = 240


def command(*args: str, cache) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flashoverlap_core.tools.cli", *args,
                           "--cache", str(cache)], capture_output=True, text=True,
                          timeout=TIMEOUT)


TUNE = ("tune", "--shapes", "512x256x16,256x128x8", "--op", "allreduce", "--world-size", "2",
        "--backend", "reference", "--iters", "2", "--warmup", "1", "--exhaustive",
        "--candidates", "4")


@pytest.mark.timeout(3 * TIMEOUT + 30)
def test_tune_then_trace_the_tuned_plan_on_two_cpu_ranks(tmp_path):
    cache, rows = tmp_path / "cache" / "tuning.json", tmp_path / "rows.json"
    done = command(*TUNE, "--json", str(rows), cache=cache)
    assert done.returncode == 0, done.stdout + done.stderr
    header = next(line for line in done.stdout.splitlines() if "predicted ms" in line)
    for column in ("measured ms", "one group ms", "plain ms", "chosen: tiles per group",
                   "fell back"):
        assert column in header, header
    # progress on plain lines (stderr is not a terminal): no carriage returns
    assert "\r" not in done.stderr and "[4/4] done" in done.stderr, done.stderr
    stored = json.loads(cache.read_text())
    assert stored["format"] == FORMAT
    plans = {(e["key"]["M"], e["key"]["N"], e["key"]["K"]): e for e in stored["plans"]}
    assert set(plans) == {(512, 256, 16), (256, 128, 8)}
    for entry in plans.values():
        key = entry["key"]
        assert (key["op"], key["world_size"], key["collective"], key["backend"]) == \
            ("allreduce", 2, "gloo", "reference")
        assert entry["value"]["measured_ms"] > 0
    assert stored["curves"]  # the transfer's cost curve, reused by later tunings
    table = json.loads(rows.read_text())["rows"]
    assert all(r["predicted_ms"] > 0 and r["measured_ms"] > 0 for r in table)
    assert all(r["source"] == "measured" for r in table)
    two_waves = next(r for r in table if r["shape"] == "512x256x16")
    assert two_waves["waves"] == 2 and two_waves["candidates_timed"] == 2  # [8] and [4, 4]
    for r in table:  # what is stored is never slower than the plain path
        assert r["stored_ms"] <= r["plain_ms"] or r["stored_groups"] == "sequential", r

    # a second run reuses what the cache holds: the same rows, nothing measured again
    again = command(*TUNE, "--json", str(rows), cache=cache)
    assert again.returncode == 0, again.stdout + again.stderr
    reused = json.loads(rows.read_text())["rows"]
    assert [r["source"] for r in reused] == ["cache", "cache"]
    assert [r["measured_ms"] for r in reused] == [r["measured_ms"] for r in table]
    assert "0 tuned plan(s) written" in again.stdout

    png = tmp_path / "timeline.png"
    done = command("trace", "--shape", "512x256x16", "--op", "allreduce", "--world-size",
                   "2", "--backend", "reference", "--tuned", "--out", str(png),
                   "--json", str(tmp_path / "trace.json"), cache=cache)
    assert done.returncode == 0, done.stdout + done.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    traced = json.loads((tmp_path / "trace.json").read_text())
    tuned = plans[(512, 256, 16)]["value"]["plan"]
    if tuned.get("strategy") != "sequential":  # a sequential plan traces the heuristic groups
        assert traced["plan"]["group_sizes"] == tuned["group_sizes"]
    assert "no tuned plan" not in done.stderr
    assert f"timeline written to {png.resolve()}" in done.stdout


@pytest.mark.parametrize("argv, message", [
    (["tune", "--shapes", "64x64"], "MxNxK"),
    (["tune", "--shapes", "64x64x64", "--backend", "decomposition", "--world-size", "1"],
     "Backend.trace()"),
    (["tune", "--shapes", "63x64x64", "--op", "reduce_scatter", "--backend", "reference",
      "--world-size", "2"], "divisible"),
    (["trace", "--shape", "64x64x64", "--groups", "1,0"], "ints >= 1"),
    (["trace", "--shape", "512x512x256", "--groups", "5,5", "--backend", "reference",
      "--world-size", "2"], "must sum to the tile count"),
    (["bench", "--world-size", "0"], "int >= 1"),
    (["bench", "--ops", "allreduce,gather"], "allreduce, reduce_scatter, all_to_all"),
    (["bench", "--backend", "no-such-backend"], "no-such-backend"),
    (["bench", "--backend", "reference", "--device", "cpu", "--world-size", "1",
      "--iters", "0"], "int >= 1"),
])
def test_bad_arguments_are_one_line_and_exit_status_2(argv, message, capsys):
    try:
        status = main(argv)
    except SystemExit as exited:
        status = exited.code
    err = capsys.readouterr().err
    assert status == 2, err
    first = err.splitlines()[0]
    assert message in first and first.startswith(f"flashoverlap {argv[0]}: error: "), err
    assert "Traceback" not in err



@pytest.mark.timeout(TIMEOUT + 30)
def test_trace_by_default_shows_several_groups(tmp_path):
    """The first timeline a newcomer draws shows overlap: the default shape's default plan
    has several groups."""
    trace = tmp_path / "trace.json"
    done = command("trace", "--backend", "reference", "--world-size", "2", "--out",
                   str(tmp_path / "t.png"), "--json", str(trace), cache=tmp_path / "cache.json")
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(json.loads(trace.read_text())["plan"]["group_sizes"]) >= 2
    assert "nothing overlaps" not in done.stdout


def test_trace_says_when_one_group_cannot_overlap(tmp_path, capsys):
    png = tmp_path / "small.png"
    assert main(["trace", "--shape", "512x512x256", "--backend", "reference", "--world-size",
                 "1", "--out", str(png)]) == 0
    out = capsys.readouterr().out
    assert "one group: its transfer starts after the whole GEMM, so nothing overlaps" in out
    assert f"timeline written to {png.resolve()}" in out


def test_trace_help_gives_its_defaults(capsys):
    with pytest.raises(SystemExit) as done:
        main(["trace", "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for default in ("default: allreduce", "default: timeline.png in the current directory",
                    "default: 1024x1024x512 on the CPU"):
        assert default in text, text


class Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("stream, redraws", [(io.StringIO(), False), (Terminal(), True)])
def test_progress_redraws_only_on_a_terminal(stream, redraws):
    progress = Progress(2, stream)
    for step in ("model", "timing"):
        progress.begin(step)
        progress.end()
    progress.finish()
    text = stream.getvalue()
    assert ("\r" in text) == redraws
    if not redraws:  # a log gets one plain line per step
        assert text.splitlines() == ["[1/2] model ...", "[2/2] timing ...", "[2/2] done"]
