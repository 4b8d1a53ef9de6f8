"""A rank that dies or stalls on the cuda backend (FlashOverlap's own NCCL communicators, ranks
sharing the GPUs there are): every other rank raises fo.CommunicationError within the deadline
plus a few seconds, never hangs (docs/design.md, "Failure model"; issue 33).

The three faults of tests/test_faults_cpu.py (raise before a call, exit, sleep past the
deadline) at world sizes 2 and 4, in three ways of running the calls: launched one by one
(FLASHOVERLAP_CUDA_GRAPH=0), replaying the call path's own graph (the default), and replaying a
graph the caller captured. Then: a second process group keeps working after a fault in the
first; a recovery (a new process group, fo.forget_prepared()) works in the same process; a soak
of 2,000 mixed calls at world size 2 with exact results, flat memory and the watchdog's
bookkeeping drained. The deadline is fo.set_timeout's (FAULT_TIMEOUT_S), far below the process
group's own (PG_TIMEOUT_S), so torch's watchdog never acts first. Every rank runs in a fresh
process under a hard timeout (tools/ranks.run_once): a hang is a failure, never a stuck run.

    FLASHOVERLAP_REQUIRE_HW=1 pytest tests/gpu/test_faults.py -v
"""
from __future__ import annotations

import os
import sys

import pytest

from flashoverlap_core.tools import faults
from flashoverlap_core.tools.ranks import RankError, RankTimeout, Ranks
from test_cuda import needs_cuda

pytestmark = [pytest.mark.timeout(900), needs_cuda]


@pytest.fixture(autouse=True)
def _watchdog_on(monkeypatch):
    """These tests are the watchdog's verification: turn it on (off by default until its cost
    per call is measured); the ranks spawned inherit it."""
    monkeypatch.setenv("FLASHOVERLAP_WATCHDOG", "1")
WORLD_SIZES = [int(w) for w in os.environ.get("FO_MULTIRANK_WORLD_SIZES", "2,4").split(",")]
PG_TIMEOUT_S = 300.0  # the process group's (torch's watchdog): never reached
FAULT_TIMEOUT_S = 10.0  # FlashOverlap's deadline (fo.set_timeout)
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}
ENV = {**MULTICAST_OFF, "FLASHOVERLAP_BACKEND": None, "FLASHOVERLAP_TUNING_CACHE": "off"}
RUNS = {"launches": {"mode": "eager", "env": {"FLASHOVERLAP_CUDA_GRAPH": "0"}},
        "replays": {"mode": "eager", "env": {}},  # from the second call: the call path's graph
        "capture": {"mode": "capture", "env": {}}}  # the caller's graph, replayed


def _spec(fault: str, world: int, run: str = "replays", **kw) -> dict:
    kw.setdefault("op", "allreduce")
    return faults.scenario(fault, world, timeout_s=PG_TIMEOUT_S, fo_timeout=FAULT_TIMEOUT_S,
                           shape=(512, 384, 64), dtype="bfloat16", backend="cuda",
                           mode=RUNS[run]["mode"], **kw)


def _run(spec: dict, run: str = "replays") -> dict:
    return faults.run(spec, "cuda", env={**ENV, **RUNS[run]["env"]}, shared_devices=True,
                      hard_timeout=600)


def _assert_no_problems(result: dict) -> None:
    found = faults.problems(result)
    lines = [f"  rank {r['rank']} {r['role']} {r['status']} after {r['after_fault_s']} s: "
             f"{r['error_type']}: {(r['error'] or '')[:500]}; then {r['then']}"
             for r in result["ranks"]]
    assert not found, "\n".join(found + lines)


@pytest.mark.parametrize("run", list(RUNS))
@pytest.mark.parametrize("fault", faults.FAULTS)
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_every_survivor_raises_within_the_deadline(world, fault, run):
    op = "reduce_scatter" if fault == "exit" else "allreduce"
    result = _run(_spec(fault, world, run, op=op, faulty=world - 1), run)
    _assert_no_problems(result)
    for r in result["ranks"]:
        if r["role"] == "survivor":
            assert "process group" in r["error"], r["error"]  # names the group ...
            if run != "capture":  # ... and the op (a replay of the caller's graph is no call:
                assert f"'{op}'" in r["error"], r["error"]  # fo.check_group raised it)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_a_second_process_group_keeps_working(world):
    """Rank 1 skips a call on the default group (its process lives on): the others raise on
    that group, and then every rank's calls on a second group of the same ranks, made before
    the fault (its own communicator), still give exact results."""
    result = _run(_spec("raise", world, then="other_group", faulty=1))
    _assert_no_problems(result)
    assert all(r["then"]["exact"] and r["then"]["calls"] == 4 for r in result["ranks"]), result


def test_recovery_in_the_same_process():
    """After the failure: a process group made anew and fo.forget_prepared(), then new calls
    (a new communicator) give exact results, on every rank."""
    result = _run(_spec("raise", 2, then="recover"))
    _assert_no_problems(result)
    assert all(r["then"]["exact"] and r["then"]["calls"] == 4 for r in result["ranks"]), result


def test_calls_without_a_fault_never_raise():
    """No false alarm: a whole sequence, every way of running it, with the deadline short."""
    for run in RUNS:
        result = _run(_spec("none", 2, run, calls=40), run)
        _assert_no_problems(result)
        assert all(r["calls"] == 40 and not r["error_type"] for r in result["ranks"]), result


# ---- the soak ---------------------------------------------------------------------------------

def soak(calls: int) -> dict:
    """``calls`` mixed calls in a row (allreduce, reduce_scatter, all_to_all with recv_splits,
    allgather; two shapes; fresh integer inputs, so every result is exact), each checked; the
    device memory allocated after the first 100 and at the end; the work the watchdog still
    follows at the end (its events drained)."""
    import torch
    import torch.distributed as dist

    import flashoverlap_core as fo
    from flashoverlap_backends.cuda import nccl

    fo.set_timeout(FAULT_TIMEOUT_S)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    shapes = ((512, 384, 64), (256, 640, 128))
    problems, memory = [], {}

    def ints(seed, rows, cols):
        g = torch.Generator().manual_seed(seed)
        return torch.randint(-1, 2, (rows, cols), generator=g).to(torch.bfloat16)

    for call in range(calls):
        op = ("allreduce", "reduce_scatter", "all_to_all", "allgather")[call % 4]
        m, n, k = shapes[(call // 4) % 2]
        bs = [ints(7 * call + 1, n, k) for _ in range(world)]  # one b for every rank
        b = bs[0].to(device).t()
        inputs = [ints(1000 * r + call, m, k) for r in range(world)]
        a = inputs[rank].to(device)
        kw = {}
        if op == "all_to_all":
            kw = {"send_splits": [m // world] * world, "recv_splits": [m // world] * world}
        out = fo.overlap(a, b, op, backend="cuda", **kw)
        full = [x.double() @ bs[0].double().t() for x in inputs]
        if op == "allreduce":
            expected = sum(full)
        elif op == "reduce_scatter":
            expected = sum(full)[rank * m // world:(rank + 1) * m // world]
        elif op == "all_to_all":
            rows = m // world
            expected = torch.cat([f[rank * rows:(rank + 1) * rows] for f in full])
        else:
            expected = torch.cat(inputs).double() @ bs[0].double().t()
        if not torch.equal(out.double().cpu(), expected):
            problems.append(f"call {call} ({op}) differs")
        del out
        if call == 99:
            torch.cuda.synchronize()
            memory["after_100"] = torch.cuda.memory_allocated()
    torch.cuda.synchronize()
    memory["end"] = torch.cuda.memory_allocated()
    import time

    time.sleep(0.5)  # a few looks of the watchdog
    # every watched communicator: the eager ones and their capture twins (the graph replays)
    pending = sum(nccl.pending(comm) for comm in list(nccl._watches))
    return {"problems": problems[:20], "memory": memory, "pending": pending,
            "communicators": len(nccl._comms)}


def test_soak_of_2000_mixed_calls_at_world_size_2_exact_and_flat():
    env = {**ENV, "FLASHOVERLAP_STRATEGY": "overlap",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__)] + sys.path)}
    with Ranks(2, "cuda", env=env, timeout=600, pg_timeout=PG_TIMEOUT_S,
               shared_devices=True) as ranks:
        try:
            results = ranks.run(soak, int(os.environ.get("FO_SOAK_CALLS", "2000")), timeout=600)
        except (RankError, RankTimeout) as e:
            pytest.fail(f"{type(e).__name__}: {e}", pytrace=False)
    for r in results:
        assert not r["problems"], results
        assert r["memory"]["end"] <= r["memory"]["after_100"] + (1 << 20), results
        assert r["pending"] == 0, results  # the watchdog's events all seen complete
        assert r["communicators"] >= 1, results
