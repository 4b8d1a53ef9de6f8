"""Fault injection on spawned ranks: one rank raises, exits or sleeps in the middle of a sequence
of ``fo.overlap`` calls, and every other rank must raise ``fo.CommunicationError`` within the
deadline plus a few seconds, never hang (docs/design.md, "Failure model").

:func:`run` starts fresh ranks (:func:`.ranks.run_once`, where a rank may die without taking
the others with it), runs :func:`sequence` on each and says, per rank, what happened and how
long after the fault. The tests (tests/test_faults_cpu.py, tests/gpu/test_faults.py) and
bench/faults.py build on it. A scenario is a plain dict (:func:`scenario`):

* ``fault``: "raise" (the faulty rank raises before its call, its process lives on), "exit"
  (it ends its process), "sleep" (it sleeps ``sleep_s``, then calls on), or "none";
* ``mode``: "eager" (each call launched, then the device synchronised), "capture" (a call
  captured once into a device graph by the caller, replayed per step; accelerators only);
* ``then``: after the survivors raised, what every live rank does next: "" (nothing),
  "other_group" (calls on a second process group of the same ranks, made before the fault:
  they must still work) or "recover" (a process group made anew and ``fo.forget_prepared()``:
  calls must work again).

Inputs are small integers, so every result is exact in every dtype and is checked exactly.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from .ranks import init_process_group, run_once

FAULTS = ("raise", "exit", "sleep")
SLACK_S = 10.0  # what "within the timeout plus a few seconds" allows on a loaded host


def scenario(fault: str, world_size: int = 2, *, timeout_s: float = 5.0, faulty: int = 1,
             at: int = 3, calls: int = 8, op: str = "allreduce", shape=(120, 96, 64),
             dtype: str = "float32", mode: str = "eager", then: str = "",
             sleep_s: float | None = None, fo_timeout: float | None = None,
             backend: str | None = None) -> dict:
    """A scenario (see the module doc). ``timeout_s``: the process group's timeout;
    ``fo_timeout``: ``fo.set_timeout``'s (None: the group's applies); ``at``: the index of the
    call before which the faulty rank faults (after ``at`` good calls)."""
    if fault not in FAULTS + ("none",):
        raise ValueError(f"fault must be one of {FAULTS + ('none',)}, got {fault!r}")
    return {"fault": fault, "world_size": world_size, "timeout_s": timeout_s, "faulty": faulty,
            "at": at, "calls": calls, "op": op, "shape": tuple(shape), "dtype": dtype,
            "mode": mode, "then": then,
            "sleep_s": sleep_s if sleep_s is not None else (fo_timeout or timeout_s) + 3,
            "fo_timeout": fo_timeout, "backend": backend}


# ---- on each rank ----------------------------------------------------------------------------

def _inputs(spec: dict, rank: int, step: int, device):
    import torch

    m, n, k = spec["shape"]
    dtype = getattr(torch, spec["dtype"])
    g = torch.Generator().manual_seed(1000 * rank + step)
    a = torch.randint(-1, 2, (m, k), generator=g).to(dtype=dtype, device=device)
    b = torch.randint(-1, 2, (n, k), generator=g).to(dtype=dtype, device=device).t()
    return a, b


def _expected(spec: dict, group, step: int, device):
    """The exact result of ``spec["op"]`` on every rank's step-``step`` inputs, on this rank."""
    import torch
    import torch.distributed as dist

    group = group if group is not None else dist.group.WORLD
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank(group)
    total = None
    for r in ranks:
        a, b = _inputs(spec, r, step, "cpu")
        c = a.double() @ b.double()
        total = c if total is None else total + c
    if spec["op"] == "reduce_scatter":
        rows = total.shape[0] // len(ranks)
        total = total[me * rows:(me + 1) * rows]
    return total.to(device=device)


def _sync(device) -> None:
    import torch

    if device.type != "cpu":
        torch.get_device_module(device.type).synchronize()


class _Step:
    """One step of the sequence on ``group``: an eager call, or the replay of a captured one."""

    def __init__(self, spec, group, device):
        import torch

        import flashoverlap_core as fo

        self.spec, self.group, self.device, self.fo = spec, group, device, fo
        self.rank = torch.distributed.get_rank()
        self.graph = None
        if spec["mode"] == "capture":
            module = torch.get_device_module(device.type)
            self.a, self.b = _inputs(spec, self.rank, 0, device)
            self.call()  # warm-up, outside the capture
            self.call()
            _sync(device)
            graph_type = next(getattr(module, n) for n in dir(module)
                              if n.endswith("Graph") and n[:1].isupper())
            self.graph = graph_type()
            with module.graph(self.graph):
                self.out = self.call()

    def call(self, a=None, b=None):
        kw = {"backend": self.spec["backend"]} if self.spec["backend"] else {}
        return self.fo.overlap(self.a if a is None else a, self.b if b is None else b,
                               self.spec["op"], self.group, **kw)

    def run(self, step: int):
        """The step's result (synchronised) and what it must equal. A replayed graph makes no
        call that could raise: ``fo.check_group`` says whether the group failed meanwhile."""
        if self.graph is not None:
            self.graph.replay()
            _sync(self.device)
            self.fo.check_group(self.group)
            return self.out, _expected(self.spec, self.group, 0, self.device)
        a, b = _inputs(self.spec, self.rank, step, self.device)
        out = self.call(a, b)
        _sync(self.device)
        return out, _expected(self.spec, self.group, step, self.device)


def _device():
    import torch

    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is None:
        return torch.device("cpu")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def _wait_for(path: Path, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if path.exists():
            return True
        time.sleep(0.05)
    return False


JOIN_TIMEOUT_S = 120.0  # how long the faulty rank waits for the others to have connected


def _joined(where: Path, rank: int) -> None:
    """Mark that this rank's process groups are made (its connections to every peer are up)."""
    (where / f"joined-{rank}").write_text(repr(time.time()))


def _inject(spec: dict, rank: int, call: int, where: Path) -> None:
    """The faulty rank's fault, before its call ``call`` (its time written for the parent).
    First it waits until every rank has joined: a fault while a peer is still connecting fails
    that peer's ``init_process_group`` (gloo's connectFullMesh), which is not the failure under
    test."""
    if spec["fault"] == "none":
        return
    for r in range(spec["world_size"]):
        _wait_for(where / f"joined-{r}", JOIN_TIMEOUT_S)
    (where / "fault").write_text(repr(time.time()))
    if spec["fault"] == "exit":
        os._exit(17)
    if spec["fault"] == "raise":
        raise RuntimeError(f"rank {rank} raised before call {call} (injected fault)")
    time.sleep(spec["sleep_s"])


def sequence(spec: dict, where: str) -> dict:
    """One rank's part of a scenario (run by :func:`run` on every rank; ``where``: a folder all
    ranks share). Returns what happened: ``calls`` done, ``exact`` (every result checked),
    ``error_type``, ``error``, ``raised_at`` (wall clock), ``then`` (the follow-up's
    ``exact``, or its error)."""
    import torch
    import torch.distributed as dist

    import flashoverlap_core as fo

    where = Path(where)
    rank, device = dist.get_rank(), _device()
    if spec["fo_timeout"]:
        fo.set_timeout(spec["fo_timeout"])
    other = dist.new_group(list(range(spec["world_size"]))) if spec["then"] == "other_group" else None
    _joined(where, rank)
    report = {"rank": rank, "calls": 0, "exact": True, "error_type": None, "error": None,
              "raised_at": None, "then": None}
    faulty = rank == spec["faulty"]
    # The call during which a peer fails returns (its collectives run on after the call), and its
    # result is garbage once the watchdog aborted them: the error comes at the next call. So a
    # wrong result is forgiven only when the very next step raised.
    wrong = None
    try:
        step = _Step(spec, None, device)
        for i in range(spec["calls"]):
            if faulty and i == spec["at"]:
                _inject(spec, rank, i, where)
            out, expected = step.run(i)
            if wrong is not None:
                report["exact"] = False  # a wrong result, and the next step went on
            wrong = None if torch.equal(out.double(), expected) else i
            report["calls"] += 1
        if wrong is not None:
            report["exact"] = False
    except BaseException as e:  # noqa: BLE001 - reported
        report.update(error_type=type(e).__name__, error=str(e), raised_at=time.time())
        if not faulty:
            (where / f"raised-{rank}").write_text(repr(time.time()))
    if spec["fault"] == "raise":
        # the faulty rank lives on until every survivor raised (else its process would end and
        # the survivors would see a dead peer, not a stalled one); then, with "then", every rank
        # goes on
        survivors = [r for r in range(spec["world_size"]) if r != spec["faulty"]]
        for r in survivors:
            _wait_for(where / f"raised-{r}", 3 * (spec["fo_timeout"] or spec["timeout_s"]) + 60)
        if spec["then"]:
            report["then"] = _then(spec, other, device, where)
    return report


def sequence_torch(spec: dict, where: str) -> dict:
    """:func:`sequence` on torch's own path (``a @ b``, then ``dist.all_reduce`` on the process
    group's communicator, the device synchronised after each call): the same faults, for
    comparing how each path ends a survivor (torch's watchdog may tear the process down)."""
    import torch
    import torch.distributed as dist

    where = Path(where)
    rank, device = dist.get_rank(), _device()
    faulty = rank == spec["faulty"]
    _joined(where, rank)
    report = {"rank": rank, "calls": 0, "exact": True, "error_type": None, "error": None,
              "raised_at": None, "then": None}
    try:
        for i in range(spec["calls"]):
            if faulty and i == spec["at"]:
                _inject(spec, rank, i, where)
            a, b = _inputs(spec, rank, i, device)
            out = a @ b
            dist.all_reduce(out)
            _sync(device)
            report["calls"] += 1
    except BaseException as e:  # noqa: BLE001 - reported
        report.update(error_type=type(e).__name__, error=str(e), raised_at=time.time())
        if not faulty:
            (where / f"raised-{rank}").write_text(repr(time.time()))
    if spec["fault"] == "raise" and faulty:  # lives on, as in sequence()
        for r in range(spec["world_size"]):
            if r != rank:
                _wait_for(where / f"raised-{r}", 3 * spec["timeout_s"] + 60)
    return report


def _then(spec: dict, other, device, where: Path) -> dict:
    """The follow-up on every live rank: calls on the other group, or after a recovery."""
    import torch
    import torch.distributed as dist

    import flashoverlap_core as fo

    group = other
    try:
        if spec["then"] == "recover":
            backend, rank = dist.get_backend(), dist.get_rank()
            dist.destroy_process_group()
            init_process_group(backend, f"file://{where / 'init-again'}", rank,
                               spec["world_size"], spec["timeout_s"],
                               device if device.type != "cpu" else None)
            fo.forget_prepared()
            group = None
        fresh = dict(spec, mode="eager")
        step = _Step(fresh, group, device)
        exact, calls = True, 0
        for i in range(4):
            out, expected = step.run(100 + i)
            exact &= bool(torch.equal(out.double(), expected))
            calls += 1
        return {"calls": calls, "exact": exact, "error": None}
    except BaseException as e:  # noqa: BLE001 - reported
        return {"calls": 0, "exact": False, "error": f"{type(e).__name__}: {e}"}


# ---- in the parent ----------------------------------------------------------------------------

def run(spec: dict, device_type: str = "cpu", *, env: dict | None = None,
        shared_devices: bool | None = None, hard_timeout: float | None = None,
        path: str = "fo") -> dict:
    """Run ``spec`` on fresh ranks (overlapped calls: ``FLASHOVERLAP_STRATEGY=overlap`` unless
    ``env`` says otherwise; ``path="torch"``: :func:`sequence_torch`). Returns ``{"scenario",
    "fault_at", "ranks"}``, with per rank its ``status`` (run_once's), ``role`` ("faulty" or
    "survivor"), the report of :func:`sequence` and ``after_fault_s``: its error's time after
    the fault, or for a rank that died (torn down), when it was found dead."""
    import tempfile

    budget = hard_timeout or (3 * spec["timeout_s"] + spec["sleep_s"] + 120)
    fn = sequence_torch if path == "torch" else sequence
    with tempfile.TemporaryDirectory(prefix="flashoverlap-faults-") as where:
        outcomes = run_once(spec["world_size"], fn, spec, where, device_type=device_type,
                            timeout=budget, pg_timeout=spec["timeout_s"],
                            env={"FLASHOVERLAP_STRATEGY": "overlap", **(env or {})},
                            shared_devices=shared_devices)
        fault_file = Path(where) / "fault"
        fault_at = float(fault_file.read_text()) if fault_file.exists() else None
    ranks = []
    for o in outcomes:
        report = o["value"] or {}
        raised_at = report.get("raised_at") or (o["ended"] if o["status"] == "died" else None)
        ranks.append({
            "rank": o["rank"], "status": o["status"],
            "role": "faulty" if o["rank"] == spec["faulty"] and spec["fault"] != "none" else "survivor",
            "calls": report.get("calls"), "exact": report.get("exact"),
            "error_type": report.get("error_type") or o["error_type"],
            "error": report.get("error") or o["error"],
            "after_fault_s": (raised_at - fault_at) if raised_at and fault_at else None,
            "then": report.get("then"), "exitcode": o["exitcode"]})
    return {"scenario": spec, "fault_at": fault_at, "ranks": ranks}


def problems(result: dict, limit_s: float | None = None) -> list[str]:
    """What is wrong with a run of a scenario (empty: it passed): a hang anywhere, a survivor
    that did not raise ``CommunicationError`` within ``limit_s`` of the fault (default: the
    deadline + :data:`SLACK_S`), a result before the fault that was not exact, a follow-up
    that failed."""
    spec = result["scenario"]
    deadline = spec["fo_timeout"] or spec["timeout_s"]
    limit = limit_s if limit_s is not None else deadline + SLACK_S
    found = []
    for r in result["ranks"]:
        who = f"rank {r['rank']} ({r['role']})"
        if r["status"] == "hung":
            found.append(f"{who} hung")
            continue
        if r["role"] == "faulty":
            continue
        if r["status"] != "ok":
            found.append(f"{who} ended {r['status']}: {r['error_type']}: {r['error']}")
            continue
        if not r["exact"]:
            found.append(f"{who}: a result before the fault was not exact")
        if spec["fault"] == "none":
            if r["error_type"]:
                found.append(f"{who} raised without a fault: {r['error_type']}: {r['error']}")
            continue
        if r["error_type"] != "CommunicationError":
            found.append(f"{who} raised {r['error_type']} (not CommunicationError): {r['error']}")
        elif r["after_fault_s"] is None or r["after_fault_s"] > limit:
            found.append(f"{who} raised {r['after_fault_s']} s after the fault (limit {limit:g} s)")
        then = r["then"]
        if spec["then"] and spec["fault"] == "raise" and (not then or then["error"] or not then["exact"]):
            found.append(f"{who}: after the fault, {spec['then']} failed: {then}")
    return found


__all__ = ["FAULTS", "SLACK_S", "problems", "run", "scenario", "sequence", "sequence_torch"]
