"""Traces (TileTrace, the reference backend's trace()) and the measurements built on them, on
the CPU in this process (one rank, no process group) and on two spawned CPU ranks. The
contention fit and the slowdown rule are tested in tests/test_tuning_model.py."""
from __future__ import annotations

import pytest
import torch

import flashoverlap_core as fo
from flashoverlap_core import registry
from flashoverlap_core.backend import OverlapCall
from flashoverlap_core.tools.ranks import RankPool
from flashoverlap_core.transfers import HostOffload
from flashoverlap_core.tuning import measure
from flashoverlap_core.tuning.model import CostCurve
from flashoverlap_core.tuning.search import predictive_search
from flashoverlap_core.tile_trace import TileTrace
from flashoverlap_core.tuning.tuner import Job, build_model, measure_groupings, trace_rank

CPU = torch.device("cpu")


def test_tile_trace_checks_itself_and_round_trips():
    trace = TileTrace.from_stamps(wave_size=2, group_sizes=[3, 2], item_end=[1, 2, 4, 3, 5],
                                  item_worker=[0, 1, 0, 1, 0], transfer_start=[4.5, None],
                                  call_end=6)
    assert trace.wave_ends() == (2.0, 4.0, 5.0)  # a running maximum over waves
    assert trace.group_ready() == (4.0, 5.0) and trace.gemm_end == 5.0
    assert trace.transfer_end == (None, None) and trace.num_waves == 3
    assert TileTrace.from_dict(trace.to_dict()) == trace
    with pytest.raises(ValueError, match="sum to"):
        TileTrace.from_stamps(wave_size=2, group_sizes=[1], item_end=[1, 2], item_worker=[0, 1])
    with pytest.raises(ValueError, match="item_worker"):
        TileTrace.from_stamps(wave_size=2, group_sizes=[2], item_end=[1, 2], item_worker=[0])
    with pytest.raises(ValueError, match="format"):
        TileTrace.from_dict({"wave_size": 1})


def test_backends_without_trace_say_so():
    with pytest.raises(NotImplementedError, match="Backend.trace"):
        registry.get("decomposition").trace(None)


def _call(plan, op, m, n, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=gen)
    b = torch.randn(n, k, generator=gen).t()
    return a, b, OverlapCall(a, b, plan, op, None, 0, 1, torch.empty(m, n))


def test_reference_trace_runs_the_call_and_stamps_every_tile_and_group():
    plan = fo.plan(300, 200, 40, op="custom", backend="reference", dtype="float32",
                   group_sizes=[2, 3, 1])
    seen = []
    a, b, call = _call(plan, lambda region, g: seen.append(g), 300, 200, 40)
    trace = registry.get("reference").trace(call)
    assert torch.allclose(call.out, a @ b, atol=1e-4) and seen == [0, 1, 2]
    assert trace.num_items == plan.num_tiles and trace.group_sizes == plan.group_sizes
    assert list(trace.item_end) == sorted(trace.item_end)  # the host does tiles in order
    assert trace.item_worker == tuple(i % plan.wave_size for i in range(plan.num_tiles))
    for ready, start, end in zip(trace.group_ready(), trace.transfer_start, trace.transfer_end):
        assert ready <= start <= end <= trace.call_end
    plain = _call(plan, lambda region, g: None, 300, 200, 40)[2]
    registry.get("reference").run(plain)
    assert torch.equal(plain.out, call.out)


def test_measurements_in_one_process():
    offload = HostOffload(1 << 16, torch.float32, pin_memory=False)
    send = measure.transfer_fn(offload, None, 1)
    sizes = measure.log_sizes(1000, 1 << 18, align=4)
    assert sizes[0] == 1000 and sizes[-1] == 1 << 18 and all(s % 4 == 0 for s in sizes)
    curve = measure.measure_curve(send, sizes, torch.float32, CPU, None, iters=2, warmup=1)
    assert curve.sizes == tuple(sizes) and all(s >= 0 for s in curve.seconds)
    assert measure.transfer_fn("allreduce", None, 1) is None  # no process group: free
    assert measure.measure_curve(None, sizes, torch.float32, CPU, None) == CostCurve.free()


def test_tuning_one_shape_in_this_process(tmp_path):
    job = Job(512, 256, 32, "offload", "float32", "reference", iters=2, warmup=1, trace_reps=2)
    parts = build_model(job, str(tmp_path / "c.json"))
    model = parts.model()
    assert model.num_tiles == 8 and parts.timing.num_waves == 2
    assert parts.cost.max_bytes >= 512 * 256 * 4
    choice = predictive_search(model)
    assert choice.predicted_s > 0 and choice.sequential_s > 0
    times = measure_groupings(job, [choice.group_sizes, (4, 4)])
    assert len(times) == 2 and min(times) > 0
    again = build_model(job, str(tmp_path / "c.json"))  # the transfer's curve from the cache
    assert again.cost == parts.cost
    traced = trace_rank(job, (4, 4))
    assert TileTrace.from_dict(traced["trace"]).group_sizes == (4, 4)


def _allreduce_trace():
    job = Job(512, 256, 16, "allreduce", "float32", "reference")
    return trace_rank(job, (4, 4))


@pytest.mark.timeout(120)
def test_reference_trace_of_asynchronous_collectives_on_two_ranks():
    with RankPool(2, timeout=90) as pool:
        results = pool.run(_allreduce_trace)
    for result in results:
        trace = TileTrace.from_dict(result["trace"])
        assert trace.group_sizes == (4, 4)
        assert all(s is not None and e is not None and s <= e <= trace.call_end
                   for s, e in zip(trace.transfer_start, trace.transfer_end))
