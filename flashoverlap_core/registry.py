"""Backend discovery and selection.

Selection reads as three steps: an explicit choice (``backend=`` argument, then the plan's
backend, then ``FLASHOVERLAP_BACKEND``), else auto-detection by the tensors' device type, then
the choice is logged with its reason. Backends come from the ``flashoverlap.backends``
entry-point group (in-tree and out-of-tree alike) plus the built-in reference backend; a name of
the form ``module:attr`` loads a backend that is not installed as an entry point (handy while
writing one). Entry points are read, and each backend probed, once per process
(:func:`refresh` forgets both; :func:`backends` always asks afresh). Selection runs when a call's
key is first seen (see ``api``), so ``FLASHOVERLAP_BACKEND`` is read then, not on every call.
"""
from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass
from importlib.metadata import entry_points

from .backend import Backend, OverlapSpec, call_reasons

log = logging.getLogger("flashoverlap")

ENTRY_POINT_GROUP = "flashoverlap.backends"
ENV_BACKEND = "FLASHOVERLAP_BACKEND"
BUILTIN = {"reference": "flashoverlap_core.reference:ReferenceBackend", "decomposition": "flashoverlap_core.decomposition:DecompositionBackend"}


class BackendError(ValueError):
    """No backend fits: unknown name, unavailable, or cannot run the call."""


@dataclass(frozen=True)
class BackendStatus:
    name: str
    device_type: str | None
    available: bool
    reason: str  # why unavailable ("" when available)

    def line(self) -> str:
        state = "available" if self.available else f"unavailable: {self.reason}"
        return f"{self.name} (device {self.device_type or 'any'}): {state}"


_loaded: dict[str, Backend] = {}
_load_errors: dict[str, str] = {}
_discovered: dict[str, str] | None = None  # entry points, read once per process
_probed: dict[str, str | None] = {}  # backend name -> its probe's answer, kept until refresh()


def _targets() -> dict[str, str]:
    global _discovered
    if _discovered is None:
        found = dict(BUILTIN)
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            found.setdefault(ep.name, ep.value)
        _discovered = found
    return _discovered


def refresh() -> None:
    """Forget discovered entry points and probe answers (the next selection reads and probes
    afresh); loaded backends stay."""
    global _discovered
    _discovered = None
    _probed.clear()


def _instantiate(target: str) -> Backend:
    module, _, attr = target.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    backend = obj() if callable(obj) and not isinstance(obj, Backend) else obj
    if not isinstance(backend, Backend):
        raise TypeError(f"{target} did not give a flashoverlap_core.Backend")
    return backend


def register(backend: Backend) -> Backend:
    """Make ``backend`` selectable by its name in this process."""
    if not isinstance(backend, Backend) or not backend.name:
        raise TypeError("register() takes a Backend instance with a name")
    _loaded[backend.name] = backend
    _load_errors.pop(backend.name, None)
    _probed.pop(backend.name, None)
    return backend


def _load(name: str) -> Backend | None:
    if name in _loaded:
        return _loaded[name]
    target = name if ":" in name else _targets().get(name)
    if target is None or name in _load_errors:
        return None
    try:
        backend = _instantiate(target)
    except Exception as e:  # a broken plugin must not break the others
        _load_errors[name] = f"failed to load {target}: {type(e).__name__}: {e}"
        return None
    _loaded[name] = backend
    if ":" in name:
        _loaded[backend.name] = backend
    return backend


def load(name: str) -> tuple[Backend | None, str]:
    """The named backend whether or not it is available here, and why it could not be loaded
    ("" when it was): for tools that work without the device (``flashoverlap build``)."""
    backend = _load(name)
    return backend, "" if backend is not None else _load_errors.get(name, "no such backend")


def _probe(backend: Backend, fresh: bool = False) -> str | None:
    """The backend's own probe, asked once per process (``fresh``: ask again); one that raises
    is unavailable, with the error as its reason."""
    if not fresh and backend.name in _probed and _loaded.get(backend.name) is backend:
        return _probed[backend.name]
    try:
        reason = backend.probe()
    except Exception as e:  # a broken plugin must not break the listing or the selection
        reason = f"probe failed: {type(e).__name__}: {e}"
    if _loaded.get(backend.name) is backend:
        _probed[backend.name] = reason
    return reason


def backends() -> list[BackendStatus]:
    """Every known backend: name, device type, available here or not, and why not (entry
    points are read and every backend probed afresh)."""
    refresh()
    out = []
    for name in sorted(set(_targets()) | set(_loaded)):
        backend = _load(name)
        if backend is None:
            out.append(BackendStatus(name, None, False, _load_errors.get(name, "not found")))
            continue
        reason = _probe(backend, fresh=True)
        out.append(BackendStatus(name, backend.device_type, reason is None, reason or ""))
    return out


def _listing() -> str:
    return "\n".join("  " + s.line() for s in backends())  # an error path: probe afresh


def get(name: str) -> Backend:
    """The named backend, available here; else a BackendError listing every backend."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"backend must be a backend name (str), got {name!r}")
    backend = _load(name)
    if backend is None:
        why = _load_errors.get(name, "no such backend")
        raise BackendError(f"backend {name!r}: {why}. Known backends:\n{_listing()}")
    reason = _probe(backend)
    if reason is not None:
        raise BackendError(f"backend {name!r} is unavailable: {reason}. Known backends:\n{_listing()}")
    return backend


def explicit_choice(name: str | None, plan_backend: str | None = None) -> tuple[str, str] | None:
    """(name, reason) of an explicitly chosen backend, or None for auto-detection."""
    if name is not None:
        if not isinstance(name, str) or not name:
            raise TypeError(f"backend must be a backend name, got {name!r}")
        return name, "backend= argument"
    if plan_backend:
        return plan_backend, "the plan's backend"
    env = os.environ.get(ENV_BACKEND)
    if env:
        return env, f"override from {ENV_BACKEND}"
    return None


def select(spec: OverlapSpec, name: str | None = None, plan_backend: str | None = None) -> Backend:
    """Pick the backend for a call: explicit choice, else the best one for the device type."""
    return able(spec, name, plan_backend)[0]


def able(spec: OverlapSpec, name: str | None = None, plan_backend: str | None = None
         ) -> list[Backend]:
    """The backends that can run ``spec``, most preferred first: the explicit choice alone
    when there is one, else every candidate for the device type that can (a BackendError
    saying why when none can). The first is this process's choice; ranks of a group agree on
    the first one every rank can run (``api``)."""
    choice = explicit_choice(name, plan_backend)
    if choice is not None:
        backend = get(choice[0])
        reasons = _device_reasons(backend, spec) + call_reasons(backend, spec)
        if reasons:
            raise BackendError(f"backend {backend.name!r} ({choice[1]}) cannot run this call: "
                               f"{'; '.join(reasons)}. Known backends:\n{_listing()}")
        log.info("flashoverlap: backend %s chosen (%s)", backend.name, choice[1])
        return [backend]
    rejected, fit, passed_over = [], [], []
    for candidate in candidates(spec.device_type):
        reason = _probe(candidate)
        reasons = [reason] if reason else call_reasons(candidate, spec)
        if not reasons:
            fit.append(candidate)
            continue
        rejected.append(f"{candidate.name}: {'; '.join(reasons)}")
        if not fit:
            passed_over.append(rejected[-1])
    if not fit:
        raise BackendError(f"no backend can run this call on device {spec.device_type!r}:\n  "
                           + "\n  ".join(rejected or ["(no backend for this device type)"])
                           + f"\nKnown backends:\n{_listing()}")
    log.info("flashoverlap: backend %s chosen (auto detect for device %s%s)", fit[0].name,
             spec.device_type, "; passed over " + "; ".join(passed_over) if passed_over else "")
    return fit


def _device_reasons(backend: Backend, spec: OverlapSpec) -> list[str]:
    if backend.device_type not in (None, spec.device_type):
        return [f"it runs on {backend.device_type} tensors, these are on {spec.device_type}"]
    return []


def candidates(device_type: str) -> list[Backend]:
    """Loaded backends for a device type, most preferred first (device-specific before generic)."""
    found = [b for b in (_load(n) for n in sorted(set(_targets()) | set(_loaded))) if b is not None]
    fits = [b for b in found if b.device_type in (None, device_type)]
    unique = {id(b): b for b in fits}.values()
    return sorted(unique, key=lambda b: (b.device_type is None, -b.priority, b.name))


def default_backend() -> Backend:
    """The backend a plan is made for when neither tensors nor a name say: the explicit
    choice from the environment, else the most preferred available accelerator backend, else
    the reference."""
    choice = explicit_choice(None)
    if choice is not None:
        return get(choice[0])
    names = sorted(set(_targets()) | set(_loaded))
    found = [b for b in (_load(n) for n in names)
             if b is not None and b.device_type not in (None, "cpu") and _probe(b) is None]
    if found:
        return max(found, key=lambda b: b.priority)
    return get("reference")
