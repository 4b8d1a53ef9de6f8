"""Ranks agree on what decides a call's collectives (backend, plan), whatever their own data:
on gloo ranks, with stand-in backends whose answers differ from rank to rank."""
from __future__ import annotations

import pytest
import torch

import flashoverlap_core as fo
from flashoverlap_core import api, registry
from flashoverlap_core.reference import ReferenceBackend
from flashoverlap_core.tools.ranks import RankPool
from test_torch_ops_ranks import ranks as shared_ranks


class EqualSplitsOnly(ReferenceBackend):
    """Prefers host tensors and declines unequal all_to_all splits (as a signaling GEMM that
    needs equal destination blocks does)."""

    name = "fake-equal-splits"
    device_type = "cpu"
    priority = 50

    def unsupported_reasons(self, spec):
        if spec.op != "all_to_all" or spec.world_size == 1:
            return []
        if spec.send_splits is None:  # the automatic choice: each call's splits are unknown
            return ["per-call splits (fake backend for tests)"]
        if len(set(spec.send_splits)) > 1:
            return ["unequal splits (fake backend for tests)"]
        return []


class OnRankZeroOnly(ReferenceBackend):
    """Available on rank 0 only (a device or a package only one host has)."""

    name = "fake-rank-zero-only"
    device_type = "cpu"
    priority = 60

    def probe(self):
        import torch.distributed as dist

        return None if dist.get_rank() == 0 else "not on this rank (fake backend for tests)"


def _mixed_splits(seed):
    """Rank 0 sends equal splits, the others unequal ones, with the automatic choice."""
    import torch.distributed as dist

    api.forget_prepared()
    registry.register(EqualSplitsOnly())
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = [4 * world] + [3 + r for r in range(1, world)]
    splits = [[4] * world] + [[r + 3 - (world - 1)] + [1] * (world - 1) for r in range(1, world)]
    splits = [[4] * world] + [[3 + r - (world - 1)] + [1] * (world - 1) for r in range(1, world)]
    b = torch.randn(6, 5, generator=torch.Generator().manual_seed(seed))
    a_all = [torch.randn(rows[r], 6, generator=torch.Generator().manual_seed(seed + r + 1))
             for r in range(world)]
    recv = [splits[src][rank] for src in range(world)]
    out = fo.overlap(a_all[rank], b, "all_to_all", send_splits=splits[rank], recv_splits=recv)
    want = torch.cat([(a_all[src].double() @ b.double())[sum(splits[src][:rank]):
                                                         sum(splits[src][:rank + 1])]
                      for src in range(world)])
    return {"backend": fo.prepared_calls()[-1]["backend"],
            "error": float((out.double() - want).abs().max()) if want.numel() else 0.0}


@pytest.mark.full
def test_ranks_whose_splits_differ_choose_alike():
    with RankPool(3, timeout=240) as pool:
        results = pool.run(_mixed_splits, 7)
    assert len({r["backend"] for r in results}) == 1, results
    assert results[0]["backend"] != EqualSplitsOnly.name, results  # rank 1 and 2 cannot run it
    assert all(r["error"] < 1e-4 for r in results), results


def _one_rank_has_a_backend(seed):
    import torch.distributed as dist

    api.forget_prepared()
    registry.register(OnRankZeroOnly())
    rank = dist.get_rank()
    b = torch.randn(8, 5, generator=torch.Generator().manual_seed(seed))
    a = torch.randn(6, 8, generator=torch.Generator().manual_seed(seed + rank))
    out = fo.overlap(a, b, "allreduce")
    again = fo.overlap(a, b, "allreduce")  # prepared: no exchange
    want = sum(torch.randn(6, 8, generator=torch.Generator().manual_seed(seed + r)).double()
               for r in range(dist.get_world_size())) @ b.double()
    return {"backend": fo.prepared_calls()[-1]["backend"],
            "error": max(float((x.double() - want).abs().max()) for x in (out, again))}


def test_a_backend_only_one_rank_has_is_not_chosen():
    with RankPool(2, timeout=240) as pool:
        results = pool.run(_one_rank_has_a_backend, 3)
    assert {r["backend"] for r in results} != {OnRankZeroOnly.name}, results
    assert len({r["backend"] for r in results}) == 1, results
    assert all(r["error"] < 1e-4 for r in results), results


def _layouts_differ_per_call(seed):
    """Rank 0 passes b = w.t() in both calls, rank 1 w.t() then a contiguous copy: rank 1's
    second call is a new local key, rank 0's is not. Neither may wait for the other."""
    import torch.distributed as dist

    api.forget_prepared()
    rank, world = dist.get_rank(), dist.get_world_size()
    w = torch.randn(5, 8, generator=torch.Generator().manual_seed(seed))
    results = []
    for call in range(2):
        a = torch.randn(6, 8, generator=torch.Generator().manual_seed(seed + 10 * call + rank))
        b = w.t().contiguous() if rank == 1 and call == 1 else w.t()
        out = fo.overlap(a, b, "reduce_scatter", backend="reference")
        full = sum(torch.randn(6, 8, generator=torch.Generator().manual_seed(seed + 10 * call + r))
                   .double() for r in range(world)) @ w.t().double()
        rows = 6 // world
        results.append(float((out.double() - full[rank * rows:(rank + 1) * rows]).abs().max()))
    return {"errors": results, "keys": len(fo.prepared_calls())}


def test_a_new_local_key_under_a_known_call_does_not_communicate():
    results = shared_ranks(2).run(_layouts_differ_per_call, 11, timeout=120)
    assert [r["keys"] for r in results] == [1, 2], results
    assert all(e < 1e-4 for r in results for e in r["errors"]), results


def _bad_plan_on_rank_one(seed):
    import torch.distributed as dist

    api.forget_prepared()
    rank = dist.get_rank()
    a, b = torch.randn(8, 4), torch.randn(4, 6)
    plan = fo.plan(8, 6, 4, "allreduce", world_size=2, dtype=torch.float32, backend="reference",
                   tile=(4, 4) if rank == 0 else (4, 2))
    try:
        fo.overlap(a, b, "allreduce", plan=plan)
    except ValueError as e:
        return str(e)
    return "no error"


def test_a_plan_that_differs_is_an_error_on_every_rank():
    messages = shared_ranks(2).run(_bad_plan_on_rank_one, 1, timeout=120)
    assert all("do not run the same plan" in m for m in messages), messages


class TileByRows(ReferenceBackend):
    """Takes its all_to_all tile from the key's expected rows (as the cuda backend weighs its
    waves), and records the hint it was given."""

    name = "fake-tile-by-rows"
    device_type = "cpu"
    priority = -1000  # named by the call only: the ranks' pool is shared with other tests
    hints: list = []

    def default_tile(self, spec):
        if spec.op == "all_to_all":
            TileByRows.hints.append(spec.rows_hint)
            return (4, 8) if (spec.rows_hint or 0) >= 10 else (4, 4)
        return super().default_tile(spec)


def _rows_differ_per_rank(seed):
    """Rank 0 has 2 rows, rank 1 30 (mean 16): both plan the key with the mean as the hint."""
    import torch.distributed as dist

    api.forget_prepared()
    registry.register(TileByRows())
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = [2, 30]
    splits = [[1, 1], [20, 10]]
    b = torch.randn(6, 12, generator=torch.Generator().manual_seed(seed))
    a_all = [torch.randn(rows[r], 6, generator=torch.Generator().manual_seed(seed + r + 1))
             for r in range(world)]
    recv = [splits[src][rank] for src in range(world)]
    out = fo.overlap(a_all[rank], b, "all_to_all", send_splits=splits[rank], recv_splits=recv,
                     backend=TileByRows.name)
    want = torch.cat([(a_all[src].double() @ b.double())[sum(splits[src][:rank]):
                                                         sum(splits[src][:rank + 1])]
                      for src in range(world)])
    prepared = list(api._prepared.values())[-1].prepared
    return {"backend": fo.prepared_calls()[-1]["backend"], "tile": tuple(prepared.plan.tile),
            "hint": TileByRows.hints[-1], "error": float((out.double() - want).abs().max())}


def test_all_to_all_tile_follows_the_ranks_mean_rows():
    results = shared_ranks(2).run(_rows_differ_per_rank, 5, timeout=120)
    assert {r["backend"] for r in results} == {TileByRows.name}, results
    assert [(r["hint"], r["tile"]) for r in results] == [(16, (4, 8))] * 2, results
    assert all(r["error"] < 1e-4 for r in results), results
