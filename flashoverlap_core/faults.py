"""What a rank sees when a peer dies or stalls: :class:`CommunicationError`, never a hang.

Every collective a call issues has a deadline. Through torch.distributed (the CPU's collective
library, the python paths, the first call's agreement, all_to_all's count exchange) the group's
own timeout applies, and the library's error comes out of ``fo.overlap`` as a
:class:`CommunicationError` naming the group, the op and what happened. A backend with
communicators of its own watches them itself (an accelerator backend's watchdog) and records their
failure here. A group that failed stays failed: every later call on it raises at once, with the
first failure's story, until :func:`forget` (``fo.forget_prepared()``), which the documented
recovery calls after the process group is made anew (docs/design.md, "Failure model").

The deadline is the group's timeout (``init_process_group(timeout=...)``), unless
``FLASHOVERLAP_TIMEOUT`` (seconds) or :func:`set_timeout` says otherwise; :func:`timeout` is what
applies. This module names no collective library: the backends bring their own.
"""
from __future__ import annotations

import os
import threading
from typing import Callable

import torch.distributed as dist

ENV_TIMEOUT = "FLASHOVERLAP_TIMEOUT"
DEFAULT_TIMEOUT_S = 600.0  # when neither the group nor the settings say (torch's default for accelerators)

_timeout_override: float | None = None
failures: dict = {}  # group -> CommunicationError: the first failure of each failed group
_probes: list[Callable] = []
_forget_hooks: list[Callable] = []
_lock = threading.Lock()


class CommunicationError(RuntimeError):
    """A collective of a FlashOverlap call failed or did not finish in time: a peer rank died or
    stalled, or the collective library reported an error. The group is then failed: every later
    call on it raises this error until the process group is made anew and
    ``fo.forget_prepared()`` is called (docs/design.md, "Failure model").

    Attributes: ``group`` (its name), ``rank`` and ``world_size`` (this rank's, in the group),
    ``op`` (the call that raised), ``failed_op`` (the call whose communication failed, when
    known), ``what`` (what happened), ``elapsed_s`` (how long the failed work had waited, when
    known) and ``timeout_s`` (the deadline that applied)."""

    def __init__(self, group: str, what: str, *, op: str | None = None, rank: int | None = None,
                 world_size: int | None = None, failed_op: str | None = None,
                 elapsed_s: float | None = None, timeout_s: float | None = None):
        self.group, self.what, self.op, self.rank, self.world_size = group, what, op, rank, world_size
        self.failed_op, self.elapsed_s, self.timeout_s = failed_op, elapsed_s, timeout_s
        super().__init__(self._text())

    def _text(self) -> str:
        where = f"process group {self.group}"
        if self.rank is not None:
            where += f" (rank {self.rank} of {self.world_size})"
        op = f", op {self.op!r}" if self.op else ""
        first = (f" (failed in an earlier {self.failed_op!r} call)"
                 if self.failed_op and self.failed_op != self.op else "")
        timing = ""
        if self.timeout_s is not None:
            timing = f" [timeout {self.timeout_s:g} s"
            timing += f", waited {self.elapsed_s:.1f} s]" if self.elapsed_s else "]"
        return (f"communication failed on {where}{op}{first}: {self.what}{timing}. Every call on "
                "this group now raises this error; to go on, make the process group anew on "
                "every surviving rank and call fo.forget_prepared()")

    def for_op(self, op) -> "CommunicationError":
        """This failure, told to a call of ``op``."""
        return CommunicationError(self.group, self.what, op=op_name(op), rank=self.rank,
                                  world_size=self.world_size,
                                  failed_op=self.failed_op or self.op, elapsed_s=self.elapsed_s,
                                  timeout_s=self.timeout_s)

    def __reduce__(self):  # picklable across processes (the rank helpers send errors back)
        return (_rebuild, (self.group, self.what, self.op, self.rank, self.world_size,
                           self.failed_op, self.elapsed_s, self.timeout_s))


def _rebuild(group, what, op, rank, world_size, failed_op, elapsed_s, timeout_s):
    return CommunicationError(group, what, op=op, rank=rank, world_size=world_size,
                              failed_op=failed_op, elapsed_s=elapsed_s, timeout_s=timeout_s)


def op_name(op) -> str | None:
    if op is None or isinstance(op, str):
        return op
    return f"callable {getattr(op, '__name__', type(op).__name__)}"


# ---- the deadline ------------------------------------------------------------------------------

def set_timeout(seconds: float | None) -> None:
    """The deadline of FlashOverlap's own communication, in seconds, for every group (None: each
    group's own timeout, or ``FLASHOVERLAP_TIMEOUT``). Backends watching communicators of their
    own apply it to those they made already too."""
    global _timeout_override
    if seconds is not None and not (isinstance(seconds, (int, float)) and seconds > 0):
        raise ValueError(f"the timeout must be a positive number of seconds or None, got {seconds!r}")
    _timeout_override = None if seconds is None else float(seconds)
    for hook in list(_forget_hooks):
        hook(timeout_changed=True)


def group_timeout(group, device_type: str | None = None) -> float | None:
    """The timeout the process group was made with (seconds), if torch says."""
    if group is None:
        return None
    import torch

    for kind in ([device_type] if device_type else []) + ["cpu"]:
        try:
            value = group._get_backend(torch.device(kind)).options._timeout
            return value.total_seconds()
        except (AttributeError, RuntimeError, TypeError, ValueError):
            continue
    return None


def timeout(group=None, device_type: str | None = None) -> float:
    """The deadline that applies to ``group``'s communication (seconds): :func:`set_timeout`'s,
    else ``FLASHOVERLAP_TIMEOUT``, else the group's own timeout, else
    :data:`DEFAULT_TIMEOUT_S`."""
    if _timeout_override is not None:
        return _timeout_override
    value = os.environ.get(ENV_TIMEOUT, "").strip()
    if value:
        try:
            seconds = float(value)
        except ValueError:
            seconds = -1.0
        if not seconds > 0:
            raise ValueError(f"{ENV_TIMEOUT} must be a positive number of seconds, got {value!r}")
        return seconds
    return group_timeout(group, device_type) or DEFAULT_TIMEOUT_S


def call_with_deadline(fn: Callable, seconds: float, what: str):
    """``fn()`` in a helper thread, waited for at most ``seconds``: its result, its exception,
    or ``TimeoutError`` naming ``what`` (the thread is then left behind, blocked where it was:
    a blocking call that cannot be interrupted, such as a communicator's creation)."""
    result: dict = {}

    def target():
        try:
            result["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            result["error"] = e

    worker = threading.Thread(target=target, name="flashoverlap-deadline", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise TimeoutError(f"{what} did not finish within {seconds:g} s")
    if "error" in result:
        raise result["error"]
    return result["value"]


# ---- failed groups -----------------------------------------------------------------------------

def describe(group) -> tuple[str, int | None, int | None]:
    """(name, this rank, world size) of a process group (None: the default group)."""
    try:
        group = group if group is not None else dist.group.WORLD
        name = getattr(group, "group_name", None) or "?"
        if getattr(group, "group_desc", "") in ("default_pg",) or group is dist.group.WORLD:
            name = f"{name!r} (the default group)"
        else:
            name = repr(name)
        return name, dist.get_rank(group), dist.get_world_size(group)
    except (RuntimeError, ValueError, AttributeError):
        return "'?'", None, None


def error(group, what: str, op=None, **facts) -> CommunicationError:
    """A :class:`CommunicationError` on ``group`` (None: the default group)."""
    name, rank, world = describe(group)
    return CommunicationError(name, what, op=op_name(op), rank=rank, world_size=world, **facts)


def record(group, failure: CommunicationError) -> CommunicationError:
    """Mark ``group`` failed (the first failure is kept) and return its failure."""
    group = group if group is not None else _default_group()
    with _lock:
        return failures.setdefault(group, failure)


def failure_of(group) -> CommunicationError | None:
    """``group``'s failure: recorded, or found now by a backend's probe (then recorded)."""
    group = group if group is not None else _default_group()
    found = failures.get(group)
    if found is None:
        for probe in list(_probes):
            found = probe(group)
            if found is not None:
                return record(group, found)
    return found


def check(group, op) -> None:
    """Raise ``group``'s failure, told to a call of ``op``, if it failed."""
    found = failure_of(group)
    if found is not None:
        raise found.for_op(op)


def check_group(group=None) -> None:
    """Raise ``group``'s :class:`CommunicationError` (None: the default group's) if its
    communication failed; nothing else, and no communication. A call raises it by itself; a
    loop that only replays a captured graph (whose replays call nothing that could raise)
    calls this to learn of a failure."""
    check(group, None)


def add_probe(probe: Callable) -> None:
    """``probe(group)`` -> a CommunicationError or None: how a backend that watches
    communicators of its own says a group failed (asked at a key's first call)."""
    if probe not in _probes:
        _probes.append(probe)


def on_forget(hook: Callable) -> None:
    """``hook(timeout_changed=False)`` is called by :func:`forget` (a backend drops what it
    keeps of failed groups) and with ``timeout_changed=True`` by :func:`set_timeout`."""
    if hook not in _forget_hooks:
        _forget_hooks.append(hook)


def forget() -> None:
    """Forget every failed group (``fo.forget_prepared()`` calls it): the recovery, once the
    process group has been made anew. Nothing is rebuilt until a call asks for it."""
    with _lock:
        failures.clear()
    for hook in list(_forget_hooks):
        hook(timeout_changed=False)


def _default_group():
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


# ---- torch.distributed's errors --------------------------------------------------------------

def is_communication_error(e: BaseException) -> bool:
    """Whether ``e``, raised by a torch.distributed collective, says the communication failed: a
    ``DistError`` (a backend error, a network or store error), or the plain ``RuntimeError``
    some collective libraries raise for a timeout or a closed connection (not a subclass of it:
    out of memory, a kernel's error)."""
    return isinstance(e, getattr(dist, "DistError", ())) or type(e) is RuntimeError


class collective:
    """Around a torch.distributed collective on ``group``: its communication error becomes a
    :class:`CommunicationError` naming the group and ``what`` was under way, and the group is
    failed. A group that failed already raises before the collective is tried. (A plain class,
    not a generator: it wraps every collective of the plain and decomposed paths.)"""

    __slots__ = ("group", "what", "op")

    def __init__(self, group, what: str, op=None):
        self.group, self.what, self.op = group, what, op

    def __enter__(self):
        if failures:
            check(self.group, self.op)
        return self

    def __exit__(self, kind, e, tb) -> bool:
        if (e is None or isinstance(e, CommunicationError) or not isinstance(e, RuntimeError)
                or not is_communication_error(e)):
            return False
        failure = record(self.group, error(self.group, f"{self.what}: {str(e).strip()}",
                                           self.op, timeout_s=timeout(self.group)))
        raise failure.for_op(self.op) from e


def raised(e: RuntimeError, group, op) -> CommunicationError | None:
    """What a call of ``op`` on ``group`` raises instead of ``e``: the group's failure (the
    collective library's error converted, or the one a backend recorded), or None to raise
    ``e`` itself."""
    if isinstance(e, CommunicationError):
        return e.for_op(op) if e.op is None else None
    found = failure_of(group)
    return found.for_op(op) if found is not None else None


__all__ = ["CommunicationError", "DEFAULT_TIMEOUT_S", "ENV_TIMEOUT", "add_probe",
           "call_with_deadline", "check", "check_group", "collective", "error", "failure_of", "forget",
           "on_forget", "raised", "record", "set_timeout", "timeout"]
