"""Spawned CPU ranks shared by test_torch_ops.py and test_nn.py (this module has no tests).

One pool per world size for the whole session: starting ranks and, in each rank, importing
torch.compile's machinery costs far more than the checks themselves on a 2-core machine.
"""
from __future__ import annotations

import atexit
import os
import shutil

import pytest

from flashoverlap_core.tools.ranks import Ranks

# world size 4 is in the full matrix only (tests/conftest.py)
WORLD_SIZES = (1, 2, pytest.param(4, marks=pytest.mark.full))
# Inductor compiles in the rank itself (no compile-worker pool on a 2-core CI machine).
RANK_ENV = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}
_POOLS: dict[int, Ranks] = {}


def _cpp_compiler() -> str | None:
    """What inductor's CPU code generation compiles with (it looks for $CXX, else g++)."""
    return shutil.which(os.environ.get("CXX", "g++"))


# torch.compile's default backend on the CPU: skipped, with the reason, without a C++ compiler;
# on spawned ranks a compile variant of the full matrix (the default run compiles with
# aot_eager there, and with inductor in this process: test_add_rmsnorm.py)
INDUCTOR = pytest.param("inductor", marks=[pytest.mark.full, pytest.mark.skipif(
    _cpp_compiler() is None, reason="inductor's CPU code needs a C++ compiler ($CXX or g++)")])


def ranks(world_size: int) -> Ranks:
    """The session's ranks of ``world_size`` (started on first use, restarted after a failure)."""
    if world_size not in _POOLS:
        _POOLS[world_size] = Ranks(world_size, "cpu", env=RANK_ENV, timeout=300)
    return _POOLS[world_size]


@atexit.register
def _close_all() -> None:
    for pool in _POOLS.values():
        pool.close()
