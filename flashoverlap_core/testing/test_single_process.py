"""World size 1 with torch.distributed not initialised, in the test process itself: the
collective is the identity, and a custom op sees every group's region."""
import pytest
import torch.distributed as dist

from .cases import single_process_matrix
from .runner import parametrize, run_case, unsupported


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        parametrize(metafunc, "case", single_process_matrix())


def test_without_distributed(case, fo_backend, fo_target, fo_settings):
    assert not dist.is_initialized(), "this test needs a process without torch.distributed"
    why = unsupported(fo_backend, case, fo_settings.seed, fo_target.device_type)
    if why:
        pytest.skip(why)
    result = run_case(fo_target, case, fo_settings.seed)
    assert case.grouping == "auto" or tuple(result["tile"]) == case.tile, (
        f"ran tile {result['tile']}, the case is {case.id}")
    assert not dist.is_initialized(), "overlap() initialised torch.distributed"
