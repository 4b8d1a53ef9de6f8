"""Where a tool's ranks run: which backend, on which device type, how many ranks."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import registry
from ..backend import Backend
from .args import UsageError


@dataclass(frozen=True)
class Hardware:
    backend: str  # the backend's name
    device_type: str
    world_size: int
    reason: str
    target: str  # how the ranks ask for it: its name, or the module:attr it was given as
    shared_devices: bool = False  # ranks share devices: correctness only, no speed figure


def _auto_backend() -> tuple[Backend, str]:
    """The most preferred available accelerator backend that has devices, else reference."""
    with_devices = [registry.get(s.name) for s in registry.backends()
                    if s.available and s.device_type not in (None, "cpu")]
    with_devices = [b for b in with_devices if b.device_count() > 0]
    if with_devices:
        return max(with_devices, key=lambda b: b.priority), \
            "auto detect: best available accelerator backend"
    return registry.get("reference"), "auto detect: no accelerator backend with devices here"


def _devices(backend: Backend, device_type: str) -> int | None:
    """Devices the ranks can use; None on the host, where ranks share it."""
    if device_type == "cpu":
        return None
    if backend.device_type is None:
        return torch.get_device_module(device_type).device_count()
    return backend.device_count()


def pick_hardware(backend: str | None, world_size: int | None,
                  device_type: str | None = None, shared_devices: bool = False) -> Hardware:
    """The explicit backend (``--backend``, else FLASHOVERLAP_BACKEND), else the most preferred
    available accelerator backend that has devices, else the reference backend on the CPU.
    A backend that runs on any device (reference, decomposition) runs on ``device_type``.
    With ``shared_devices`` the ranks may outnumber the devices (rank r on device r mod count;
    see tools/ranks.py): a topology for correctness checks, whose times say nothing.
    Raises :class:`UsageError` (or registry.BackendError) for what cannot run here."""
    choice = registry.explicit_choice(backend)
    if choice is not None:
        target, reason = choice
        chosen = registry.get(target)
    elif device_type is None:
        chosen, reason = _auto_backend()
    else:
        chosen, reason = registry.get("reference"), f"--device {device_type} without --backend"
    if chosen.device_type not in (None, device_type or chosen.device_type):
        raise UsageError(f"backend {chosen.name!r} runs on {chosen.device_type}, "
                         f"not on --device {device_type}")
    device_type = chosen.device_type or device_type or "cpu"
    devices = _devices(chosen, device_type)
    if devices == 0:
        raise UsageError(f"no {device_type} device here")
    if world_size is None:
        world_size = devices if devices is not None else 2
    if world_size < 1:
        raise UsageError(f"--world-size must be >= 1, got {world_size}")
    if devices is not None and world_size > devices and not shared_devices:
        raise UsageError(f"--world-size {world_size} needs {world_size} {device_type} devices; "
                         f"backend {chosen.name!r} sees {devices} (--shared-devices lets ranks "
                         "share them, for correctness checks only)")
    return Hardware(chosen.name, device_type, world_size, reason,
                    target if choice is not None else chosen.name,
                    shared_devices=bool(shared_devices and devices is not None))


def require_trace(name: str) -> None:
    """A :class:`UsageError` when the backend cannot trace calls (tuning and timelines need it)."""
    backend = registry.get(name)
    if type(backend).trace is Backend.trace:
        raise UsageError(f"backend {name!r} does not implement Backend.trace(), which this "
                         "command needs; try --backend reference")
