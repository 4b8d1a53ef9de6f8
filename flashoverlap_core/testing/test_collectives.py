"""The conformance matrix on spawned ranks (one pool per world size)."""
import pytest

from flashoverlap_core.tools.ranks import RankError, RankTimeout

from .cases import default_choice_matrix, moe_matrix, rank_matrix
from .plugin import settings
from .runner import parametrize, run_case, unsupported


def pytest_generate_tests(metafunc):
    if "rank_case" in metafunc.fixturenames:
        parametrize(metafunc, "rank_case", rank_matrix(settings(metafunc.config).world_sizes))
    if "moe_case" in metafunc.fixturenames:
        parametrize(metafunc, "moe_case", moe_matrix(settings(metafunc.config).world_sizes))
    if "default_case" in metafunc.fixturenames:
        cases = default_choice_matrix(settings(metafunc.config).world_sizes)
        metafunc.parametrize("default_case", cases, ids=[c.id for c in cases])


def test_overlap_on_ranks(rank_case, fo_pools, fo_backend, fo_target, fo_settings):
    why = unsupported(fo_backend, rank_case, fo_settings.seed, fo_target.device_type)
    if why:
        pytest.skip(why)
    try:
        results = fo_pools.run(rank_case.world_size, run_case, rank_case, fo_settings.seed)
    except (RankError, RankTimeout) as e:  # a wrong result or an exception on some rank; a hang
        pytest.fail(f"{type(e).__name__}: {e}", pytrace=False)
    ran = {tuple(r["tile"]) for r in results}
    assert rank_case.grouping == "auto" or ran == {rank_case.tile}, (
        f"the ranks ran tiles {ran}, the case is {rank_case.id}")


def test_default_choice_on_ranks(default_case, fo_pools, fo_target, fo_settings):
    """No backend= and no FLASHOVERLAP_BACKEND, on the tensors of the backend under test: the
    automatic choice users get. Every rank must choose alike (one rank's own rows or splits
    picking another backend made every call fail), and the result must be right."""
    try:
        results = fo_pools.run(default_case.world_size, run_case, default_case, fo_settings.seed,
                               default_choice=True)
    except (RankError, RankTimeout) as e:
        pytest.fail(f"{type(e).__name__}: {e}", pytrace=False)
    chosen = [(r["backends"], r["strategies"]) for r in results]
    assert all(c == chosen[0] for c in chosen), (
        f"the ranks of {default_case.id} chose differently (backends, strategies per rank): {chosen}")


def test_moe_sequence_on_ranks(moe_case, fo_pools, fo_backend, fo_target, fo_settings):
    """Expert parallelism: each call's rows and splits are new on every rank, at different
    rates, skewed, with zeros and ranks without rows; recv_splits given on some calls only.
    Every call against float64; no call may hang or disagree across ranks."""
    default = moe_case.choice == "default"
    why = None if default else unsupported(fo_backend, moe_case, fo_settings.seed,
                                           fo_target.device_type)
    if why:
        pytest.skip(why)
    try:
        results = fo_pools.run(moe_case.world_size, run_case, moe_case, fo_settings.seed,
                               default_choice=default)
    except (RankError, RankTimeout) as e:
        pytest.fail(f"{type(e).__name__}: {e}", pytrace=False)
    chosen = [r["backends"] for r in results]
    assert all(c == chosen[0] for c in chosen), f"the ranks chose differently: {chosen}"
