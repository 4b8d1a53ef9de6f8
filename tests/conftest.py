"""The default run and the full matrix.

``pytest`` (the README's command) runs every op, dtype and backend at world sizes 1 and 2, the
MoE sequences, the fused norm and fp8 in a few minutes. ``pytest --full`` also runs the tests
marked ``full``: world sizes 3 and 4, compile variants, long sequences and faults (hangs, dead
ranks, deliberately broken backends). A test opts into the full matrix only with
``@pytest.mark.full`` (or ``pytest.param(..., marks=pytest.mark.full)`` for one parameter);
everything else is in the default run.
"""
from __future__ import annotations

import pytest


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", default=False,
                     help="run the full matrix: the tests marked full too (world sizes 3-4, "
                          "compile variants, long sequences, faults)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("full"):
        return
    full = [item for item in items if item.get_closest_marker("full") is not None]
    if full:
        config.hook.pytest_deselected(items=full)
        items[:] = [item for item in items if item.get_closest_marker("full") is None]
        config.stash[_LEFT_OUT] = len(full)


_LEFT_OUT = pytest.StashKey[int]()


def pytest_terminal_summary(terminalreporter, config):
    left_out = config.stash.get(_LEFT_OUT, 0)
    if left_out:
        terminalreporter.write_line(f"{left_out} tests of the full matrix were not run: "
                                    "`pytest --full` runs them too")
