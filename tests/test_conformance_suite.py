"""The packaged conformance suite passes against the reference backend, fails against each
deliberately broken backend (so it catches real faults), and reports missing hardware as
skips with reasons, or as failures under FLASHOVERLAP_REQUIRE_HW=1. The default run takes
world sizes 1 and 2; ``--full`` (tests/conftest.py) adds 3 and 4, the broken backends and the
hang."""
import re

import pytest

from broken_backends import BROKEN
from suite_runner import (MIN_PASSED, WORLD_SIZES, describe, run_suite, summary, unexpected_skips,
                          world_size_args)

CONFORMANCE_MESSAGE = re.compile(r"outside the error bound|never written|op\(region, index\)|outside out")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world_sizes", WORLD_SIZES)
def test_reference_backend_passes_the_suite(world_sizes):
    result = run_suite("reference", *world_size_args(world_sizes), timeout=840)
    counts = summary(result)
    assert result.returncode == 0, describe(result)
    assert counts.get("passed", 0) >= MIN_PASSED[world_sizes], describe(result)
    assert set(counts) <= {"passed", "skipped", "deselected", "warning"}, describe(result)
    assert not unexpected_skips(result), describe(result)
    assert "flashoverlap conformance: backend reference" in result.stdout
    assert "backend-tile-for" not in result.stdout  # every tile ran as the case asks


@pytest.mark.timeout(300)
def test_a_backend_without_the_cases_tiles_runs_the_tile_it_declares():
    """Cases whose small tile the backend has no kernel for run with its declared tile, and
    their ids say so; none is turned into a warning or passes with a tile its id hides."""
    result = run_suite("fake_backends:FixedTiles", "-k", "single_process", "-rA", timeout=240)
    counts = summary(result)
    assert result.returncode == 0 and set(counts) == {"passed", "deselected"}, describe(result)
    substituted = [line for line in result.stdout.splitlines()
                   if "backend-tile-for-" in line and "PASSED" in line]
    assert substituted and all("-tile8x8-backend-tile-for-" in line for line in substituted), \
        describe(result)


@pytest.mark.timeout(300)
def test_a_case_no_tile_of_the_backend_can_run_is_a_skip_with_the_reason():
    result = run_suite("fake_backends:NoTileFits", "-k", "single_process and not auto", timeout=240)
    counts = summary(result)
    assert result.returncode == 0 and counts.get("skipped", 0) >= 5, describe(result)
    assert "runs neither the case's tile" in result.stdout, describe(result)
    assert "nor its own default tile (4, 4)" in result.stdout, describe(result)


@pytest.mark.timeout(600)
@pytest.mark.full
@pytest.mark.parametrize("broken", BROKEN)
def test_broken_backend_fails_the_suite(broken):
    result = run_suite(f"broken_backends:{broken}", "--fo-world-sizes", "1,2", "--maxfail", "3",
                       timeout=540, fail_fast=True)
    assert result.returncode == 1, f"the suite did not fail as it must: {describe(result)}"
    assert summary(result).get("failed", 0) >= 1, describe(result)
    assert CONFORMANCE_MESSAGE.search(result.stdout), (
        f"the failures are not the suite's result checks: {describe(result)}")
    assert f"backend broken_backends:{broken}" in result.stdout


@pytest.mark.full
@pytest.mark.timeout(300)
def test_a_hang_is_a_failure_and_the_next_test_gets_a_fresh_pool():
    result = run_suite("broken_backends:HangsOnRank1", "--fo-world-sizes", "2", "--fo-timeout", "8",
                       "-k", "W2-allreduce and (1x1x1 or tile16x2)", timeout=240)
    counts = summary(result)
    assert result.returncode == 1 and counts.get("failed") == 2 and "passed" not in counts, describe(result)
    # one failure report per test (the short summary may repeat the reason, or not)
    timed_out = [line for line in result.stdout.splitlines()
                 if line.startswith("RankTimeout: run_case on 2 rank(s): no answer in 8 s")]
    assert len(timed_out) == 2, describe(result)


@pytest.mark.timeout(300)
def test_unknown_backend_is_a_usage_error():
    result = run_suite("no-such-backend", timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode not in (0, 1, 5) and "no-such-backend" in output, describe(result)
    assert "reference" in output, f"the error does not list the known backends: {describe(result)}"


SELECT_BACKEND_TESTS = ["-k", "single_process or two_ranks or W2"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("require_hw", [False, True])
def test_unavailable_backend_skips_with_reason(require_hw):
    env = {"FLASHOVERLAP_REQUIRE_HW": "1"} if require_hw else {}
    result = run_suite("fake_backends:Unavailable", *SELECT_BACKEND_TESTS, timeout=240, env=env)
    counts = summary(result)
    if require_hw:
        failures = counts.get("failed", 0) + counts.get("error", 0)  # a failing fixture is an error
        assert result.returncode == 1 and failures >= 10 and "skipped" not in counts, describe(result)
        assert "FLASHOVERLAP_REQUIRE_HW=1 but" in result.stdout, describe(result)
    else:
        assert result.returncode == 0 and counts.get("skipped", 0) >= 10 and "failed" not in counts, describe(result)
    assert "no frobnicator device found" in result.stdout, f"the reason is not given: {describe(result)}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("require_hw", [False, True])
def test_too_few_devices_skips_with_reason(require_hw):
    """World sizes asked for beyond the backend's device count are hardware skips."""
    env = {"FLASHOVERLAP_REQUIRE_HW": "1"} if require_hw else {}
    result = run_suite("fake_backends:FewDevices", "--fo-world-sizes", "1,2,3", "-k", "W2 or W3",
                       timeout=240, env=env)
    counts = summary(result)
    expected = {"failed", "error"} if require_hw else {"skipped"}
    assert sum(counts.get(e, 0) for e in expected) >= 10, describe(result)
    assert set(counts) <= expected | {"deselected", "warning"}, describe(result)
    assert "needs 2 fakedev devices" in result.stdout, f"the reason is not given: {describe(result)}"
