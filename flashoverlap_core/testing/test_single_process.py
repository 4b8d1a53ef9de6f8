"""World size 1 with torch.distributed not initialised, in the test process itself: the
collective is the identity, and a custom op sees every group's region."""
import pytest
import torch.distributed as dist

from .cases import single_process_matrix
from .runner import run_case, unsupported

CASES = single_process_matrix()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_without_distributed(case, fo_backend, fo_target, fo_settings):
    assert not dist.is_initialized(), "this test needs a process without torch.distributed"
    why = unsupported(fo_backend, case, fo_settings.seed, fo_target.device_type)
    if why:
        pytest.skip(why)
    run_case(fo_target, case, fo_settings.seed)
    assert not dist.is_initialized(), "overlap() initialised torch.distributed"
