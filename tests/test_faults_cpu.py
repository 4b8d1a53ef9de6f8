"""A rank that dies or stalls: every other rank raises fo.CommunicationError within the group's
timeout plus a few seconds, never hangs (docs/design.md, "Failure model"; issue 33).

On the CPU (gloo): a rank that raises before a call (its process lives on), one that exits in the
middle of a sequence, one that sleeps past the timeout. The default run has the three at world
size 2, at once, with a recovery after the raise (a process group made anew, then
fo.forget_prepared(): calls work again); the full matrix (``pytest --full -m full``) has world
sizes 3 and 4 and a second process group that keeps working. In-process tests check the error
type, the deadline's sources and the failed-group record. The GPU's are tests/gpu/test_faults.py.
"""
from __future__ import annotations

import pickle
import tempfile
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import flashoverlap_core as fo
from flashoverlap_core import api, faults as core_faults
from flashoverlap_core.tools import faults

TIMEOUT_S = 2.0  # the process groups' timeout in the spawned tests


def _run_all(specs):
    """Every scenario at once (each on its own ranks), with its problems."""
    with ThreadPoolExecutor(len(specs)) as pool:
        results = list(pool.map(faults.run, specs))
    return [(r, faults.problems(r)) for r in results]


def _describe(result) -> str:
    lines = [f"{result['scenario']['fault']} at world size {result['scenario']['world_size']}:"]
    for r in result["ranks"]:
        lines.append(f"  rank {r['rank']} {r['role']} {r['status']} after {r['after_fault_s']} s: "
                     f"{r['error_type']}: {(r['error'] or '')[:400]}; then {r['then']}")
    return "\n".join(lines)


@pytest.mark.timeout(240)
def test_every_survivor_raises_within_the_timeout_at_world_size_2():
    specs = [faults.scenario(f, 2, timeout_s=TIMEOUT_S, then="recover" if f == "raise" else "")
             for f in faults.FAULTS]
    for result, found in _run_all(specs):
        assert not found, _describe(result) + "\n" + "\n".join(found)
        survivor = result["ranks"][0]
        assert survivor["calls"] == result["scenario"]["at"]  # the calls before the fault worked
        assert "process group" in survivor["error"] and "'allreduce'" in survivor["error"]
        if result["scenario"]["fault"] == "raise":  # recovered: a new process group, then forget
            assert all(r["then"]["exact"] for r in result["ranks"]), _describe(result)


@pytest.mark.full
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [3, 4])
def test_every_survivor_raises_within_the_timeout_at_world_sizes_3_and_4(world):
    specs = [faults.scenario(f, world, timeout_s=TIMEOUT_S, faulty=world - 1, op=op)
             for f, op in zip(faults.FAULTS, ("allreduce", "reduce_scatter", "allreduce"))]
    for result, found in _run_all(specs):
        assert not found, _describe(result) + "\n" + "\n".join(found)


@pytest.mark.full
@pytest.mark.timeout(400)
def test_another_process_group_keeps_working_and_a_middle_rank_may_fail():
    specs = [faults.scenario("raise", 3, timeout_s=TIMEOUT_S, faulty=1, then="other_group"),
             faults.scenario("exit", 3, timeout_s=TIMEOUT_S, faulty=1, at=0)]
    results = _run_all(specs)
    for result, found in results:
        assert not found, _describe(result) + "\n" + "\n".join(found)
    assert all(r["then"]["exact"] and r["then"]["calls"] == 4 for r in results[0][0]["ranks"])


# ---- in one process ---------------------------------------------------------------------------

@pytest.fixture
def one_rank_group():
    """A gloo process group of one rank (torch.distributed initialised here), torn down after."""
    if dist.is_initialized():
        pytest.skip("torch.distributed is initialised already")
    with tempfile.TemporaryDirectory() as where:
        dist.init_process_group("gloo", init_method=f"file://{where}/init", rank=0, world_size=1,
                                timeout=timedelta(seconds=7))
        try:
            yield dist.group.WORLD
        finally:
            api.forget_prepared()
            fo.set_timeout(None)
            dist.destroy_process_group()


def test_the_error_names_the_group_the_op_and_what_happened_and_pickles():
    e = core_faults.CommunicationError("'0' (the default group)", "a peer stalled", op="allreduce",
                                       rank=1, world_size=4, elapsed_s=21.5, timeout_s=20)
    text = str(e)
    for part in ("'0' (the default group)", "rank 1 of 4", "'allreduce'", "a peer stalled",
                 "timeout 20 s", "waited 21.5 s", "fo.forget_prepared()"):
        assert part in text, text
    assert isinstance(e, RuntimeError) and fo.CommunicationError is core_faults.CommunicationError
    again = pickle.loads(pickle.dumps(e))
    assert str(again) == text and again.op == "allreduce"
    told = e.for_op("reduce_scatter")
    assert told.op == "reduce_scatter" and "an earlier 'allreduce' call" in str(told)


def test_the_deadline_is_set_timeout_then_the_environment_then_the_groups(one_rank_group,
                                                                          monkeypatch):
    monkeypatch.delenv(core_faults.ENV_TIMEOUT, raising=False)
    assert core_faults.timeout(one_rank_group) == 7.0  # the group's own
    assert core_faults.timeout(None) == core_faults.DEFAULT_TIMEOUT_S
    monkeypatch.setenv(core_faults.ENV_TIMEOUT, "12.5")
    assert core_faults.timeout(one_rank_group) == 12.5
    fo.set_timeout(3)
    assert core_faults.timeout(one_rank_group) == 3.0
    fo.set_timeout(None)
    monkeypatch.setenv(core_faults.ENV_TIMEOUT, "soon")
    with pytest.raises(ValueError, match="FLASHOVERLAP_TIMEOUT"):
        core_faults.timeout(one_rank_group)
    with pytest.raises(ValueError, match="positive"):
        fo.set_timeout(0)


def test_a_failed_group_raises_at_once_until_forget_prepared(one_rank_group):
    a, b = torch.ones(8, 4), torch.ones(4, 8)
    assert torch.equal(fo.overlap(a, b, "allreduce", one_rank_group), a @ b)
    core_faults.record(one_rank_group, core_faults.error(one_rank_group, "a peer died",
                                                         "allreduce", timeout_s=7.0))
    for call in (lambda: fo.overlap(a, b, "allreduce", one_rank_group),
                 lambda: fo.overlap(a, b, "reduce_scatter"),  # the default group: the same one
                 lambda: fo.overlap_add_rmsnorm(a, b, torch.zeros(8, 8), torch.ones(8))):
        with pytest.raises(fo.CommunicationError, match="a peer died") as info:
            call()
        assert "rank 0 of 1" in str(info.value)
    api.forget_prepared()  # the documented recovery (with a process group made anew)
    assert torch.equal(fo.overlap(a, b, "allreduce", one_rank_group), a @ b)


def test_only_communication_errors_of_collectives_are_converted(one_rank_group):
    with pytest.raises(fo.CommunicationError, match="an exchange: Timed out"):
        with core_faults.collective(one_rank_group, "an exchange", "allreduce"):
            raise RuntimeError("Timed out waiting 2000ms for recv operation to complete")
    api.forget_prepared()
    for error in (torch.OutOfMemoryError("out of memory"), ValueError("bad")):
        with pytest.raises(type(error)):
            with core_faults.collective(one_rank_group, "an exchange"):
                raise error
    assert not core_faults.failures


def test_call_with_deadline_returns_raises_or_gives_up():
    import threading

    assert core_faults.call_with_deadline(lambda: 5, 5, "x") == 5
    with pytest.raises(KeyError):
        core_faults.call_with_deadline(lambda: {}["k"], 5, "x")
    stuck = threading.Event()
    with pytest.raises(TimeoutError, match="making a communicator did not finish within 0.2 s"):
        core_faults.call_with_deadline(stuck.wait, 0.2, "making a communicator")
    stuck.set()


def test_fault_benchmark_writes_as_it_goes_and_counts_torch_hangs_apart(tmp_path, monkeypatch):
    """bench/faults.py's driver, its scenarios stubbed: the JSON is rewritten after every
    scenario (complete only after the last), a scenario on torch's own path that outlives
    --torch-limit counts as torch's hang, not FlashOverlap's, and torch's scenarios get that
    limit as their hard timeout."""
    import importlib
    import json
    import sys
    import time
    from pathlib import Path

    bench = Path(__file__).resolve().parent.parent / "bench"
    monkeypatch.setenv("FO_RESULTS_DIR", str(tmp_path))
    monkeypatch.syspath_prepend(str(bench))
    for name in ("common", "faults"):
        sys.modules.pop(name, None)
    module = importlib.import_module("faults")
    limits, seen, calls = {}, [], []

    def run(spec, device_type, *, env=None, shared_devices=None, hard_timeout=None, path="fo"):
        limits[path] = hard_timeout
        hung = path == "torch" and spec["world_size"] == 4
        ranks = [{"rank": r, "role": "faulty" if r == spec["faulty"] else "survivor",
                  "status": "hung" if hung and r != spec["faulty"] else "ok",
                  "error_type": "CommunicationError", "after_fault_s": 1.5, "exitcode": None,
                  "error": ""} for r in range(spec["world_size"])]
        calls.append(spec)
        if len(calls) == 4:  # the last scenario: the first three's JSON is written meanwhile
            for _ in range(100):
                seen[:] = [p.name for p in tmp_path.glob("faults-*.json")]
                if seen:
                    break
                time.sleep(0.05)
        return {"scenario": spec, "ranks": ranks}

    monkeypatch.setattr(module, "device_tag", lambda: "cpu")
    monkeypatch.setattr(sys.modules["common"], "device_name", lambda device_type: "cpu")
    monkeypatch.setattr(module.faults, "run", run)
    monkeypatch.setattr(module.faults, "problems", lambda result: [])
    try:
        assert module.main(["--worlds", "2,4", "--faults", "raise", "--runs", "launches",
                            "--timeout", "3", "--parallel", "1"]) == 0
    finally:
        for name in ("common", "faults"):
            sys.modules.pop(name, None)
    files = list(tmp_path.glob("faults-*.json"))
    assert len(files) == 1 and seen, (files, seen)  # one file, there before the last scenario
    doc = json.loads(files[0].read_text())
    summary = doc["summary"]
    assert summary["complete"] and summary["scenarios_done"] == summary["scenarios"] == 4
    assert summary["hangs"] == 0 and summary["torch_hangs"] == 3
    assert limits == {"torch": 5 * 3 + 40, "fo": 6 * 3 + 240}
    assert len(doc["rows"]) == 2 + 2 + 4 + 4
