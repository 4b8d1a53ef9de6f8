"""Spawned ranks joined in one process group, for the tools, the tests and the benchmarks.

``RankPool(world_size, device_type)`` starts one process per rank (rank r on device r for an
accelerator), initialises torch.distributed with torch's default collective library for that
device type, and runs module-level functions on every rank at once.

``shared_devices=True`` (default: ``$FLASHOVERLAP_SHARED_DEVICES=1``) is the test topology of
ranks that share devices: rank r runs on device r mod the device count, so the world size may
exceed it, and each rank gets the environment its backend says such ranks need
(:meth:`Backend.rank_environment`; e.g. a host id of its own for the collective library). It
exercises every multi-rank code path with the real collective library; it measures no speed. Nothing can hang the
caller: every call has a timeout, after which the pool is killed and ``RankTimeout`` raised;
an exception on a rank comes back as ``RankError`` with that rank's traceback.

:class:`Ranks` is what a job with many calls holds: a pool started on first use and started
again after a call killed it, or one rank run in the caller's own process.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from datetime import timedelta

DEFAULT_TIMEOUT = 300.0
ENV_SHARED_DEVICES = "FLASHOVERLAP_SHARED_DEVICES"


def shared_devices_default() -> bool:
    """Whether spawned ranks share devices unless told otherwise (``$FLASHOVERLAP_SHARED_DEVICES``)."""
    value = os.environ.get(ENV_SHARED_DEVICES, "").strip().lower()
    if value in ("", "0", "false", "no"):
        return False
    if value in ("1", "true", "yes"):
        return True
    raise ValueError(f"{ENV_SHARED_DEVICES} must be 1 or 0, got {value!r}")


def device_count(device_type: str) -> int:
    """Devices of ``device_type`` (0 for the host), without creating a device context."""
    if device_type == "cpu":
        return 0
    import torch

    return torch.get_device_module(device_type).device_count()


def topology(world_size: int, device_type: str, shared_devices: bool) -> dict:
    """Where each rank runs and the environment each gets: ``devices`` (per rank: device index,
    None on the host), ``shared_devices``, ``device_count`` and ``env`` (per rank). A world
    size above the device count without ``shared_devices`` is a ValueError."""
    from flashoverlap_core import registry

    count = device_count(device_type)
    if device_type == "cpu":
        devices = [None] * world_size
    elif count < 1:
        raise ValueError(f"no {device_type} device is visible: cannot place {world_size} rank(s)")
    elif world_size > count and not shared_devices:
        raise ValueError(f"{world_size} ranks need {world_size} {device_type} devices, "
                         f"{count} visible; let ranks share devices (shared_devices=True, "
                         f"{ENV_SHARED_DEVICES}=1: a correctness-only test topology)")
    else:
        devices = [r % count for r in range(world_size)]
    envs = []
    for r in range(world_size):
        env: dict = {}
        for backend in registry.candidates(device_type):
            if backend.device_type == device_type:  # the device's own collective library
                env.update(backend.rank_environment(r, world_size, shared_devices))
        envs.append(env)
    return {"world_size": world_size, "device_type": device_type, "device_count": count,
            "shared_devices": bool(shared_devices), "devices": devices, "env": envs}


class RankError(RuntimeError):
    """A function raised on one or more ranks."""


class RankTimeout(TimeoutError):
    """Ranks did not answer in time (a hang, or a rank that died); the pool was killed."""


def _join(rank, world_size, device_type, device_index, init_file, env, pg_timeout) -> str:
    """Set this rank's environment and device and join the process group; its library's name."""
    for name, value in env.items():  # None: unset what the parent's environment has
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    import torch
    import torch.distributed as dist

    if device_type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        device_id = None
    else:
        torch.get_device_module(device_type).set_device(device_index)
        device_id = torch.device(device_type, device_index)
    collective = dist.Backend.default_device_backend_map[device_type]
    init_process_group(collective, f"file://{init_file}", rank, world_size, pg_timeout, device_id)
    return collective


CONNECT_TIMEOUT = 120.0  # seconds the ranks may take to connect, whatever the group's timeout


def init_process_group(collective: str, init_method: str, rank: int, world_size: int,
                       timeout: float, device_id=None) -> None:
    """``torch.distributed.init_process_group`` whose collectives time out after ``timeout``
    seconds while its ranks may take up to :data:`CONNECT_TIMEOUT` to connect (on a loaded host a
    short timeout would otherwise fail the connection itself)."""
    import torch.distributed as dist

    dist.init_process_group(collective, init_method=init_method, rank=rank,
                            world_size=world_size,
                            timeout=timedelta(seconds=max(timeout, CONNECT_TIMEOUT)),
                            device_id=device_id)
    if timeout < CONNECT_TIMEOUT:
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout))


def _worker(rank, world_size, device_type, device_index, init_file, env, pg_timeout, inbox,
            outbox):
    try:
        import torch.distributed as dist

        collective = _join(rank, world_size, device_type, device_index, init_file, env,
                           pg_timeout)
        outbox.put(("ready", rank, collective))
    except BaseException:
        outbox.put(("err", rank, traceback.format_exc()))
        return
    while True:
        task = inbox.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            outbox.put(("ok", rank, fn(*args, **kwargs)))
        except BaseException:
            outbox.put(("err", rank, traceback.format_exc()))
    try:
        dist.destroy_process_group()
    except Exception:
        pass


class RankPool:
    """``world_size`` ranks in one process group; see the module docstring."""

    def __init__(self, world_size: int, device_type: str = "cpu", *, env: dict | None = None,
                 timeout: float = DEFAULT_TIMEOUT, pg_timeout: float = 60.0,
                 shared_devices: bool | None = None):
        """``env``: variables set on every rank (a value of None unsets the variable there)."""
        self.world_size, self.device_type, self.timeout = world_size, device_type, timeout
        shared = shared_devices_default() if shared_devices is None else shared_devices
        self.topology = topology(world_size, device_type, shared)
        ctx = mp.get_context("spawn")
        self._dir = tempfile.TemporaryDirectory(prefix="flashoverlap-pool-")
        init_file = os.path.join(self._dir.name, "init")
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(world_size)]
        self._procs = [
            ctx.Process(target=_worker, daemon=True,
                        args=(r, world_size, device_type, self.topology["devices"][r], init_file,
                              {**self.topology["env"][r], **(env or {})}, pg_timeout,
                              self._inboxes[r], self._outbox))
            for r in range(world_size)]
        for p in self._procs:
            p.start()
        self.collective = self._collect(timeout, "start")[0]

    def _collect(self, timeout: float, what: str) -> list:
        results, errors = [None] * self.world_size, {}
        deadline = time.monotonic() + timeout
        pending = set(range(self.world_size))
        while pending:
            left = deadline - time.monotonic()
            if errors and left > 10:  # the others may be stuck in a collective: don't wait long
                deadline, left = time.monotonic() + 10, 10
            try:
                kind, rank, value = self._outbox.get(timeout=max(0.05, min(left, 1.0)))
            except queue.Empty:
                dead = [r for r in pending if not self._procs[r].is_alive()]
                if dead or time.monotonic() >= deadline:
                    self.close(kill=True)
                    if errors:
                        break
                    why = f"ranks {sorted(dead)} died" if dead else f"no answer in {timeout:.0f} s"
                    raise RankTimeout(f"{what} on {self.world_size} rank(s): {why}; "
                                      f"still pending: ranks {sorted(pending)}")
                continue
            pending.discard(rank)
            if kind == "err":
                errors[rank] = value
            else:
                results[rank] = value
        if errors:
            if pending:
                self.close(kill=True)
            detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise RankError(f"{what} failed on ranks {sorted(errors)}"
                            f"{' (others did not answer: ' + str(sorted(pending)) + ')' if pending else ''}"
                            f":\n{detail}")
        return results

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def run(self, fn, *args, timeout: float | None = None, **kwargs) -> list:
        """``fn(*args, **kwargs)`` on every rank at once; the per-rank results, in rank order."""
        if not self.alive:
            raise RankError("the rank pool is closed (an earlier call failed or timed out)")
        for inbox in self._inboxes:
            inbox.put((fn, args, kwargs))
        return self._collect(timeout or self.timeout, getattr(fn, "__name__", str(fn)))

    def close(self, kill: bool = False) -> None:
        for p, inbox in zip(self._procs, self._inboxes):
            if p.is_alive() and not kill:
                inbox.put(None)
        for p in self._procs:
            p.join(timeout=0 if kill else 10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._procs = []
        self._dir.cleanup()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _once_worker(rank, world_size, device_type, device_index, init_file, env, pg_timeout, fn,
                 args, kwargs, outbox):
    try:
        _join(rank, world_size, device_type, device_index, init_file, env, pg_timeout)
        outbox.put((rank, "ok", fn(*args, **kwargs), None, None, time.time()))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        outbox.put((rank, "raised", None, type(e).__name__,
                    f"{e}\n{traceback.format_exc()}", time.time()))
    outbox.close()
    outbox.join_thread()
    # No clean-up that could wait for a dead or stalled peer (destroy_process_group): leave.
    os._exit(0)


def run_once(world_size: int, fn, *args, device_type: str = "cpu", timeout: float = 120.0,
             pg_timeout: float = 60.0, env: dict | None = None,
             shared_devices: bool | None = None, **kwargs) -> list[dict]:
    """``fn(*args, **kwargs)`` once on ``world_size`` fresh ranks in one process group, where a
    rank may die, raise or hang without taking the others with it (fault tests): per rank, in
    rank order, ``{"rank", "status", "value", "error_type", "error", "exitcode", "ended"}`` with
    status "ok" (returned ``value``), "raised" (``error_type``, ``error``: text and
    traceback), "died" (ended without answering: ``exitcode``) or "hung" (no answer within
    ``timeout`` seconds of the start: killed). ``ended``: the rank's wall-clock time at its
    answer (``time.time()``)."""
    shared = shared_devices_default() if shared_devices is None else shared_devices
    where = topology(world_size, device_type, shared)
    ctx = mp.get_context("spawn")
    outbox = ctx.Queue()
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="flashoverlap-once-") as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_once_worker, daemon=True,
                             args=(r, world_size, device_type, where["devices"][r], init_file,
                                   {**where["env"][r], **(env or {})}, pg_timeout, fn, args,
                                   kwargs, outbox))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while len(results) < world_size and time.monotonic() < deadline:
            try:
                rank, status, value, kind, text, ended = outbox.get(timeout=0.2)
                results[rank] = {"rank": rank, "status": status, "value": value,
                                 "error_type": kind, "error": text, "exitcode": None,
                                 "ended": ended}
                continue
            except queue.Empty:
                pass
            for r, p in enumerate(procs):
                if r not in results and not p.is_alive():
                    try:  # its answer may still be in the pipe
                        rank, status, value, kind, text, ended = outbox.get(timeout=0.5)
                        results[rank] = {"rank": rank, "status": status, "value": value,
                                         "error_type": kind, "error": text, "exitcode": None,
                                         "ended": ended}
                    except queue.Empty:
                        results[r] = {"rank": r, "status": "died", "value": None,
                                      "error_type": None, "error": None,
                                      "exitcode": p.exitcode, "ended": time.time()}
        for r, p in enumerate(procs):
            if r not in results:
                results[r] = {"rank": r, "status": "hung", "value": None, "error_type": None,
                              "error": None, "exitcode": None, "ended": time.time()}
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
            if results[r]["status"] == "died":
                results[r]["exitcode"] = p.exitcode
    return [results[r] for r in range(world_size)]


class Ranks:
    """Where a job's per-rank work runs: a :class:`RankPool` started on first use and started
    again when a call killed it or was cut short (a timeout in the caller, an interrupt: its
    ranks may be stuck in a collective). With ``in_process=True`` and one rank, the work runs
    in the caller's process, without a process group, which is quicker.

    :meth:`run` returns the per-rank results in rank order, like :meth:`RankPool.run`.
    """

    def __init__(self, world_size: int, device_type: str = "cpu", *, env: dict | None = None,
                 timeout: float = DEFAULT_TIMEOUT, pg_timeout: float = 60.0,
                 in_process: bool = False, shared_devices: bool | None = None):
        self.world_size, self.device_type, self.timeout = world_size, device_type, timeout
        self.env, self.pg_timeout = env, pg_timeout
        self.shared_devices = shared_devices_default() if shared_devices is None else shared_devices
        self.in_process = in_process and world_size == 1
        self.pool: RankPool | None = None
        self._settled = True  # False while a call is out: a call cut short leaves it False

    def run(self, fn, *args, timeout: float | None = None, **kwargs) -> list:
        if self.in_process:
            return [fn(*args, **kwargs)]
        if self.pool is not None and not (self._settled and self.pool.alive):
            self.close()
        if self.pool is None:
            self.pool = RankPool(self.world_size, self.device_type, env=self.env,
                                 timeout=max(self.timeout, 120.0), pg_timeout=self.pg_timeout,
                                 shared_devices=self.shared_devices)
        self._settled = False
        try:
            results = self.pool.run(fn, *args, timeout=timeout or self.timeout, **kwargs)
        except RankError:  # every rank answered, or the pool killed itself: no loose ends
            self._settled = True
            raise
        self._settled = True
        return results

    def topology(self) -> dict:
        """Where the ranks run (see :func:`topology`), known without starting them."""
        return topology(self.world_size, self.device_type, self.shared_devices)

    def close(self, kill: bool = False) -> None:
        """Stop the ranks: cleanly when they are idle (unless ``kill``), else kill them."""
        if self.pool is not None:
            self.pool.close(kill=kill or not (self._settled and self.pool.alive))
        self.pool, self._settled = None, True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
