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
    (["tune", "--shapes", "64x64x64", "--scaling", "blockwise", "--backend", "reference",
      "--world-size", "1"], "--scaling is for fp8"),
    (["tune", "--shapes", "64x64x64", "--op", "all_to_all", "--dtype", "float8_e4m3fn",
      "--backend", "reference", "--world-size", "1"], "tune all_to_all with --dtype float32"),
    (["trace", "--shape", "64x64x64", "--scaling", "rowwise", "--dtype", "float16",
      "--backend", "reference", "--world-size", "1"], "--scaling is for fp8"),
    (["tune", "--shapes", "64x64x64", "--dtype", "float8_e4m3fn", "--scaling", "columnwise"],
     "invalid choice"),
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



def test_fp8_tuning_stores_plans_by_scaling_and_calls_find_them(tmp_path, capsys):
    """fp8 as serving runs it: e4m3 inputs with row-wise or block-wise scales, bfloat16 out.
    A block-wise tuned plan has a key of its own (its kernels differ); tensor-wise and
    row-wise calls share the other; each call kind finds its own; the trace draws one."""
    import torch

    from flashoverlap_core import fp8, registry
    from flashoverlap_core.backend import OverlapSpec
    from flashoverlap_core.tuning.cache import TuningCache, lookup_plan

    cache = tmp_path / "tuning.json"
    common = ["--op", "reduce_scatter", "--backend", "reference", "--world-size", "1",
              "--dtype", "float8_e4m3fn", "--iters", "1", "--warmup", "0", "--cache", str(cache)]
    assert main(["tune", "--shapes", "384x256x300", "--scaling", "blockwise", *common]) == 0
    assert main(["tune", "--shapes", "384x256x300", *common]) == 0  # default: row-wise
    out = capsys.readouterr().out
    assert "float8_e4m3fn (blockwise scales)" in out and "float8_e4m3fn (rowwise scales)" in out
    stored = {e["key"].get("scaling"): e["value"]["plan"]
              for e in json.loads(cache.read_text())["plans"]}
    assert set(stored) == {"blockwise", None}, stored
    for scaling, plan in stored.items():
        assert (plan["dtype"], plan["out_dtype"], plan.get("scaling")) == (
            "float8_e4m3fn", "bfloat16", scaling), plan
    curves = json.loads(cache.read_text())["curves"]
    assert [c["key"]["dtype"] for c in curves] == ["bfloat16"]  # what moves: the result
    backend = registry.get("reference")
    for kind, want in (("blockwise", "blockwise"), ("rowwise", None), ("tensorwise", None)):
        spec = OverlapSpec(384, 256, 300, "reduce_scatter", 1, "float8_e4m3fn", "cpu", "col",
                           None, "bfloat16", kind)
        plan = lookup_plan(spec, backend, cache=TuningCache(cache))
        assert plan is not None and plan.scaling == want, (kind, plan)
    a, b, sa, sb = fp8.example_inputs(5, 300, 260, "blockwise", "cpu",
                                      torch.Generator().manual_seed(3))
    assert (sa.shape, sb.shape, b.stride()) == ((5, 3), (3, 3), (1, 260))
    assert fp8.scaling_kind(5, 300, 260, sa, sb) == "blockwise"
    png = tmp_path / "fp8.png"
    assert main(["trace", "--shape", "384x256x300", "--backend", "reference", "--world-size",
                 "2", "--dtype", "float8_e4m3fn", "--scaling", "blockwise", "--out",
                 str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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
