"""The conformance matrix on spawned ranks (one pool per world size)."""
import warnings

import pytest

from flashoverlap_core.tools.ranks import RankError, RankTimeout

from .cases import rank_matrix
from .plugin import settings
from .runner import run_case, unsupported


def pytest_generate_tests(metafunc):
    if "rank_case" in metafunc.fixturenames:
        cases = rank_matrix(settings(metafunc.config).world_sizes)
        metafunc.parametrize("rank_case", cases, ids=[c.id for c in cases])


def test_overlap_on_ranks(rank_case, fo_pools, fo_backend, fo_target, fo_settings):
    why = unsupported(fo_backend, rank_case, fo_settings.seed, fo_target.device_type)
    if why:
        pytest.skip(why)
    try:
        results = fo_pools.run(rank_case.world_size, run_case, rank_case, fo_settings.seed)
    except (RankError, RankTimeout) as e:  # a wrong result or an exception on some rank; a hang
        results, failure = None, f"{type(e).__name__}: {e}"
    if results is None:
        pytest.fail(failure, pytrace=False)
    refused = next((r["tile_refused"] for r in results if r["tile_refused"]), None)
    if refused:
        warnings.warn(f"{fo_backend.name!r} has no kernel for tile {rank_case.tile} "
                      f"({'; '.join(refused)}): the case ran with its default tile")
