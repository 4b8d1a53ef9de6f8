"""Run the packaged conformance suite in a child pytest, as a backend's author would."""
from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
# --fo-world-sizes of a backend's whole suite: the default run's, then the full matrix's own
WORLD_SIZES = ["1,2", pytest.param("3,4", marks=pytest.mark.full)]
# passed tests a backend that runs every case has at least, per WORLD_SIZES entry
MIN_PASSED = {"1,2": 150, "3,4": 100}


def world_size_args(world_sizes: str) -> list[str]:
    """The suite's arguments for one WORLD_SIZES entry. Beyond the default run's "1,2" only
    the tests at those world sizes run: the rest of the suite (single-process cases at W1,
    argument checks, plan properties, checks that need W2) does not depend on them and ran
    in the default run already."""
    args = ["--fo-world-sizes", world_sizes]
    if world_sizes != "1,2":
        args += ["-k", " or ".join(f"W{w}" for w in world_sizes.split(","))]
    return args


def plugin_args() -> list[str]:
    """Load the plugin explicitly only when the package's pytest11 entry point is not installed
    (loading it both ways would register it twice)."""
    installed = any(ep.value == "flashoverlap_core.testing.plugin" for ep in entry_points(group="pytest11"))
    return [] if installed else ["-p", "flashoverlap_core.testing.plugin"]


def run_suite(backend: str, *args: str, timeout: float, env: dict | None = None,
              paths: tuple[str, ...] = (), fail_fast: bool = False) -> subprocess.CompletedProcess:
    """``pytest --pyargs flashoverlap_core.testing --fo-backend backend *args``, with ``paths``
    and this directory importable (for ``broken_backends:...``) and no backend choice
    inherited. ``fail_fast`` (a run that must fail, with ``--maxfail``): the tests in the
    child's own process first (tests/suite_order.py)."""
    child_env = {k: v for k, v in os.environ.items()
                 if k not in ("FLASHOVERLAP_BACKEND", "FLASHOVERLAP_REQUIRE_HW", "PYTEST_ADDOPTS")}
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [*map(str, paths), str(TESTS), str(REPO),
                                                            os.environ.get("PYTHONPATH")]))
    child_env.update(env or {})
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "flashoverlap_core.testing", "--fo-backend", backend,
           "-p", "no:cacheprovider", "-q", "-rfEs", "--tb=short", *plugin_args(),
           *(["-p", "suite_order"] if fail_fast else []), *args]
    return subprocess.run(cmd, cwd=REPO, env=child_env, capture_output=True, text=True, timeout=timeout)


def summary(result: subprocess.CompletedProcess) -> dict[str, int]:
    """Counts of pytest's last line ("3 failed, 10 passed, 2 skipped in 4.5s")."""
    lines = [l for l in result.stdout.splitlines() if l.strip()]
    counts = {}
    for part in (lines[-1] if lines else "").split(" in ")[0].split(","):
        words = part.strip(" =").split()
        if len(words) == 2 and words[0].isdigit():
            counts[words[1].rstrip("s")] = int(words[0])  # failed, passed, skipped, error, ...
    return counts


def unexpected_skips(result: subprocess.CompletedProcess) -> list[str]:
    """The skips of a run (given -rs) but those of checks that need a world size the run did
    not ask for (the world sizes 3 and 4 of the full matrix skip what needs 2: the default run
    has it)."""
    return [line for line in result.stdout.splitlines()
            if line.startswith("SKIPPED") and "not in --fo-world-sizes" not in line]


def describe(result: subprocess.CompletedProcess) -> str:
    """The child's header (backend, seed) and the end of its output, for an assertion message."""
    header = [l for l in result.stdout.splitlines() if l.startswith("flashoverlap conformance:")]
    return f"exit {result.returncode}; {' '.join(header)}\n...{result.stdout[-4000:]}\n{result.stderr[-2000:]}"
