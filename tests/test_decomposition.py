"""The decomposition strategy on the CPU: its packing of sub-GEMM results, end-to-end calls at
world sizes 1 and 2 (spawned gloo ranks) against a float64 reference, and its place in
backend selection.

The package conformance suite runs against it too (``pytest --pyargs flashoverlap_core.testing
--fo-backend decomposition``, see test_conformance_suite below).
"""
from __future__ import annotations

import pytest
import torch

import flashoverlap_core as fo
from flashoverlap_core import registry
from flashoverlap_core.decomposition import (AcceleratorDecomposition, DecompositionBackend,
                                             HostStreams, compute_rect, packed_rects,
                                             rows_in_order, streams_for)
from suite_runner import (MIN_PASSED, WORLD_SIZES, describe, run_suite, summary, unexpected_skips,
                          world_size_args)
from test_torch_ops_ranks import ranks as shared_ranks

SEED = 20261129


def plans():
    """Plans of every layout feature: ragged edges, schedules, groups cutting bands, blocks."""
    yield fo.Plan(37, 29, 5, "allreduce", 1, "float32", (8, 6), 3, (4, 7, 9, 5))
    yield fo.Plan(64, 64, 8, "allreduce", 1, "float32", (16, 16), 4, (3, 5, 8),
                  fo.Schedule("n", 2))
    yield fo.Plan(50, 40, 3, "custom", 1, "float32", (16, 8), 2, (1, 9, 10),
                  fo.Schedule("m", 3))
    yield fo.Plan(48, 33, 4, "reduce_scatter", 3, "float32", (8, 10), 3, (6, 12, 6))
    yield fo.Plan(40, 19, 4, "all_to_all", 3, "float32", (7, 5), 2, (5, 11, 4, 8),
                  fo.Schedule("n", 2), send_splits=(17, 0, 23))
    yield fo.Plan(256, 96, 4, "allreduce", 1, "float32", (128, 96), 1, (1, 1))


@pytest.mark.parametrize("plan", list(plans()), ids=repr)
def test_rectangles_cover_each_tile_once_and_pack_exactly(plan):
    gen = torch.Generator().manual_seed(SEED)
    a = torch.randn(plan.m, plan.k, generator=gen, dtype=torch.float64)
    b = torch.randn(plan.n, plan.k, generator=gen, dtype=torch.float64).t()
    packed = torch.full((plan.packed_numel,), float("nan"), dtype=torch.float64)
    covered = 0
    for rects in packed_rects(plan):
        for r in rects:
            compute_rect(a, b, packed, r)
            covered += r.bands * r.cols * r.tile_rows * r.tile_cols
    assert covered == plan.packed_numel
    expected = (a @ b).flatten()[plan.packed_index()]
    torch.testing.assert_close(packed, expected, rtol=0, atol=1e-12)


def test_whole_row_groups_are_one_matmul_each_written_in_place():
    backend = DecompositionBackend()
    spec = fo.OverlapSpec(1024, 96, 16, "allreduce", 1, "float32", "cpu")
    plan = fo.make_plan(backend, spec, group_sizes=(2, 3, 3))
    rects = packed_rects(plan)
    assert [len(g) for g in rects] == [1, 1, 1]
    assert all(r.row_major for g in rects for r in g)


def reference(op, a, b, world, rank, send=None):
    """float64 result of ``op`` on every rank's c = a_r @ b_r (inputs regenerated per rank)."""
    ab = [inputs(a.shape[0], b.shape[1], a.shape[1], a.dtype, r) for r in range(world)]
    cs = [a_r.double() @ b_r.double() for a_r, b_r in ab]
    if op == "allreduce":
        return sum(cs)
    if op == "reduce_scatter":
        rows = a.shape[0] // world
        return sum(cs)[rank * rows:(rank + 1) * rows]
    starts = [sum(send[:d]) for d in range(world)]
    return torch.cat([c[starts[rank]:starts[rank] + send[rank]] for c in cs])


def inputs(m, n, k, dtype, rank):
    gen = torch.Generator().manual_seed(SEED + rank)
    a = torch.randn(m, k, generator=gen).to(dtype)
    b = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype).t()  # nn.Linear weight.t()
    return a, b


TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def check_call(op, m, n, k, dtype, group_sizes=None, tile=None, send=None):
    """On one rank: overlap() with the decomposition backend against the float64 result."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    a, b = inputs(m, n, k, dtype, rank)
    plan = fo.plan(m, n, k, op if isinstance(op, str) else "custom", world, dtype, tile=tile,
                   group_sizes=group_sizes, backend="decomposition", send_splits=send)
    kw = {}
    if op == "all_to_all":
        kw = {"send_splits": send, "recv_splits": [send[rank]] * world}
    got = fo.overlap(a, b, op, plan=plan, **kw)
    want = (reference(op, a, b, world, rank, send) if isinstance(op, str)
            else a.double() @ b.double())
    assert got.dtype == dtype and got.shape == want.shape
    if want.numel() == 0:
        return 0.0
    error = (got.double() - want).abs().max().item() / (want.abs().max().item() + 1)
    assert error <= TOLERANCE[dtype], f"{op} {m}x{n}x{k} {dtype}: relative error {error}"
    return error


CASES = [
    ("allreduce", 100, 70, 33, torch.float32, None, None, None),
    ("allreduce", 256, 128, 64, torch.bfloat16, None, (32, 48), None),
    ("reduce_scatter", 96, 50, 20, torch.float32, None, (16, 16), None),
    ("reduce_scatter", 64, 64, 64, torch.float16, None, None, None),
    ("all_to_all", 45, 31, 12, torch.float32, None, (8, 8), [30, 15]),
    ("all_to_all", 40, 24, 8, torch.bfloat16, None, (16, 8), [0, 40]),
]


def test_one_rank_without_torch_distributed():
    for op, m, n, k, dtype, groups, tile, send in CASES:
        check_call(op, m, n, k, dtype, groups, tile, [m] if send else None)


def test_one_rank_custom_op_sees_every_region_in_order():
    seen = []
    a, b = inputs(70, 40, 9, torch.float32, 0)
    plan = fo.plan(70, 40, 9, "custom", 1, torch.float32, tile=(16, 16), group_sizes=(5, 5, 5),
                   backend="decomposition")
    out = fo.overlap(a, b, lambda region, g: seen.append((g, region.clone())), plan=plan)
    torch.testing.assert_close(out, a @ b)
    assert [g for g, _ in seen] == [0, 1, 2]
    flat = (a @ b).flatten()[plan.packed_index()]
    for g, region in seen:
        r = plan.regions[g]
        torch.testing.assert_close(region, flat[r.offset:r.offset + r.numel])


@pytest.fixture
def two_ranks():
    return shared_ranks(2)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}x{c[3]}-{c[4]}")
def test_two_gloo_ranks(two_ranks, case):
    op, m, n, k, dtype, groups, tile, send = case
    errors = two_ranks.run(check_call, op, m, n, k, dtype, groups, tile, send)
    assert len(errors) == 2


def test_cpu_runs_with_the_stream_shim():
    assert type(streams_for(torch.device("cpu"))) is HostStreams


def test_selection_prefers_decomposition_to_reference():
    order = [b.name for b in registry.candidates("cpu")]
    assert order.index("decomposition") < order.index("reference")
    spec = fo.OverlapSpec(8, 8, 8, "allreduce", 1, "float32", "cpu")
    assert registry.select(spec).name == "decomposition"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world_sizes", WORLD_SIZES)
def test_conformance_suite(world_sizes):
    """The packaged suite against the decomposition backend, which runs every case: a run
    whose cases were skipped (or not collected) fails as surely as one whose cases failed."""
    result = run_suite("decomposition", *world_size_args(world_sizes), timeout=880)
    counts = summary(result)
    assert result.returncode == 0, describe(result)
    assert counts.get("passed", 0) >= MIN_PASSED[world_sizes] and not unexpected_skips(result), \
        describe(result)


def test_accelerator_variant_names_the_accelerator_or_says_there_is_none():
    backend = AcceleratorDecomposition()
    if torch.accelerator.is_available():
        assert backend.probe() is None
        assert backend.device_type == torch.accelerator.current_accelerator().type
    else:
        assert "no accelerator" in backend.probe() and backend.device_count() == 0


def test_whole_row_allreduce_writes_the_output_in_place():
    a, b = inputs(300, 40, 16, torch.float32, 0)
    out = torch.full((300, 40), float("nan"))
    plan = fo.plan(300, 40, 16, "allreduce", 1, torch.float32, backend="decomposition")
    assert plan.tile == (128, 40) and rows_in_order(plan)
    assert fo.overlap(a, b, plan=plan, out=out) is out
    torch.testing.assert_close(out, a @ b)
    assert rows_in_order(fo.plan(300, 40, 16, "allreduce", 1, torch.float32, tile=(128, 32),
                                 backend="decomposition"))  # "rows" layout: whole bands
    assert not rows_in_order(fo.plan(300, 40, 16, "allreduce", 1, torch.float32, tile=(128, 32),
                                     backend="decomposition", layout="tiles"))
