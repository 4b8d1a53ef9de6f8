"""pytest plugin of the child runs that must fail (tests/suite_runner.py's ``fail_fast``): the
suite's tests that run in the pytest process itself come first, the tests on spawned ranks after
them, so that a deliberately broken backend's first failures come before any rank pool is
started and ``--maxfail`` ends the run early. Nothing is left out: the run goes on through the
tests on ranks until ``--maxfail`` failures."""
from __future__ import annotations

import pytest


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: "_fo_pool_set" in getattr(item, "fixturenames", ()))  # stable
