"""The few device questions every layer asks, for any torch device type, without naming one.

Nothing here creates a device context unless asked about a device: ``device_name("cpu")``
reads the host's CPU model.
"""
from __future__ import annotations

import platform
from functools import lru_cache
from pathlib import Path
from typing import Callable

import torch


def current_device(device_type: str) -> torch.device:
    """The caller's current device of that type (the host for "cpu")."""
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, torch.get_device_module(device_type).current_device())


def device_name(device_type: str, index: int | None = None) -> str:
    """The product name of device ``index`` (default: the current one), or the CPU's model
    name for "cpu". Tuning results are keyed by it, so every caller must name devices alike."""
    if device_type == "cpu":
        return _cpu_name()
    if index is None:
        index = current_device(device_type).index
    return _accelerator_name(device_type, index)


@lru_cache(maxsize=1)
def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@lru_cache(maxsize=16)
def _accelerator_name(device_type: str, index: int) -> str:
    return torch.get_device_module(device_type).get_device_name(index)


def synchronizer(device_type: str) -> Callable[[], None]:
    """What waits for the device's queued work: a no-op on the host, where work and the CPU
    collectives' waits are synchronous."""
    if device_type == "cpu":
        return lambda: None
    return torch.get_device_module(device_type).synchronize
