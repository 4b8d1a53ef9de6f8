"""The op table (flashoverlap_core/ops.py) is the one rule for an op's rows, and the argument
checks are written once: the eager call's and the fake kernel's agree, message for message."""
from __future__ import annotations

import pytest
import torch

from flashoverlap_core import ops
from flashoverlap_core.checks import check_arguments
from flashoverlap_core.plan import Plan, group_unit
from flashoverlap_core.tiles import Schedule, TileGrid
from flashoverlap_core.torch_ops import result_rows


@pytest.mark.parametrize("op", ops.PLAN_OPS)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_rows_of_each_op(op, world):
    kind, m = ops.of(op), 6
    rows = kind.result_rows(m, world)
    send = (1,) * (world - 1) + (rows - world + 1,) if kind.splits and world > 1 else None
    blocks = kind.block_rows(rows, world, send)
    assert sum(blocks) == rows
    tiles = TileGrid(blocks, 8, 2, 4, Schedule()).num_tiles
    assert Plan(rows, 8, 4, op, world, "float32", (2, 4), 1, (tiles,),
                send_splits=send).block_rows == blocks
    recv = (m,) * world if kind.splits else None
    expected = {"allreduce": m, "reduce_scatter": m // world, "all_to_all": m * world,
                "allgather": m * world, "custom": m}[op]
    assert kind.output_rows(m, world, recv) == (m if kind.splits and world == 1 else expected)
    assert group_unit(op, world, 10, (2, 4)) == kind.group_unit(world, 10, (2, 4))


def test_the_table_reads_like_the_ops():
    assert ops.REDUCE_OPS == ("allreduce", "reduce_scatter")
    assert [k for k in ops.PLAN_OPS if ops.of(k).in_place] == ["allreduce", "custom"]
    assert ops.of(print).name == ops.CUSTOM_OP and ops.op_name(print) == ops.CUSTOM_OP
    assert ops.of("allgather").gathers and ops.of("all_to_all").min_rows == 0
    with pytest.raises(ValueError, match="op must be one of"):
        ops.op_name("allgatherr")
    with pytest.raises(TypeError, match="op must be one of"):
        ops.op_name(3)


@pytest.mark.parametrize("a_shape, b_shape, op, dtype", [
    ((4, 3), (2, 5), "allreduce", torch.float32),      # K differs
    ((4,), (3, 5), "allreduce", torch.float32),        # not 2-D
    ((4, 3), (3, 5), "allreduce", torch.float64),      # dtype not supported
    ((4, 3), (3, 5), "allgatherr", torch.float32),     # no such op
    ((0, 3), (3, 5), "reduce_scatter", torch.float32),  # M >= 1
])
def test_eager_and_fake_checks_say_the_same(a_shape, b_shape, op, dtype):
    a, b = torch.empty(a_shape, dtype=dtype), torch.empty(b_shape, dtype=dtype)
    with pytest.raises((TypeError, ValueError)) as eager:
        check_arguments(a, b, op)
    with pytest.raises(type(eager.value)) as fake:
        result_rows(op, a.to("meta"), b.to("meta"), 1)
    assert str(fake.value) == str(eager.value)
