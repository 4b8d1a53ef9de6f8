"""The fused post-reorder's plumbing, on the CPU: the band table a fused kernel reads rows
through (flashoverlap_core/reorder.py) against the tile-by-tile post-reorder on random plans,
and how ``fo.overlap_add_rmsnorm`` reaches a prepared call's ``run_add_rmsnorm`` (the cuda
backend's fused kernel is one): once per key after the first call's checks, the default
(post-reorder, then add + norm in torch) where a backend has no fused path, the sequential
strategy, and the table dropped with the prepared calls."""
from __future__ import annotations

import random

import pytest
import torch

import flashoverlap_core as fo
from flashoverlap_core import add_rmsnorm as norm
from flashoverlap_core import api, registry
from flashoverlap_core.backend import PreparedCall
from flashoverlap_core.plan import Plan
from flashoverlap_core.reference import ReferenceBackend
from flashoverlap_core.reorder import (add_rmsnorm, band_offsets, block_tiles, row_index,
                                       stream_offsets, unpack_tiles)
from flashoverlap_core.tiles import Schedule


@pytest.mark.parametrize("seed", range(40))
def test_rows_through_the_band_table_equal_the_post_reorder(seed):
    rng = random.Random(seed)
    rows, n = rng.randint(1, 70), rng.randint(1, 70)
    tile = (rng.choice([1, 3, 8, 16]), rng.choice([1, 5, 8, 16]))
    tiles = block_tiles(rows, n, tile, Schedule(rng.choice("nm"), rng.randint(1, 4)))
    order = list(range(len(tiles)))
    rng.shuffle(order)  # the source holds the tiles in any order, with gaps between them
    offsets, at = [0] * len(tiles), rng.randint(0, 5)
    for i in order:
        offsets[i], at = at, at + tiles[i].numel + rng.randint(0, 3)
    source = torch.randn(at + 1)
    want = unpack_tiles(source, offsets, tiles, torch.empty(rows, n))
    table = band_offsets(tiles, offsets, rows, n, tile)
    assert len(table) == -(-rows // tile[0]) and all(len(b) == -(-n // tile[1]) for b in table)
    assert torch.equal(source[row_index(table, rows, n, tile)], want)


def test_band_table_refuses_tiles_that_are_not_the_grid():
    tiles = block_tiles(10, 12, (4, 8), Schedule())
    offsets = stream_offsets(tiles)
    with pytest.raises(ValueError, match="do not cover"):
        band_offsets(tiles[:-1], offsets[:-1], 10, 12, (4, 8))
    with pytest.raises(ValueError, match="once"):
        band_offsets(tiles + tiles[:1], offsets + [0], 10, 12, (4, 8))
    with pytest.raises(ValueError, match="not one tile"):
        band_offsets(tiles, offsets, 10, 12, (4, 4))


class Fused(PreparedCall):
    """A prepared call with its own fused path, recording what it was given."""

    calls: list = []

    def run_add_rmsnorm(self, a, b, op, residual, weight, eps):
        type(self).calls.append((op, eps))
        return super().run_add_rmsnorm(a, b, op, residual, weight, eps)


class FusingBackend(ReferenceBackend):
    name = "fake-fusing"
    prepared = 0

    def prepare(self, template):
        type(self).prepared += 1
        return Fused(self, template)


@pytest.fixture
def fusing(monkeypatch):
    """The fake backend's name; it vanishes from the registry after the test (as in
    tests/test_registry.py), so that no later test probes it."""
    for name in ("_loaded", "_load_errors", "_probed"):
        monkeypatch.setattr(registry, name, dict(getattr(registry, name)))
    monkeypatch.setattr(Fused, "calls", [])
    monkeypatch.setattr(FusingBackend, "prepared", 0)
    api.forget_prepared()
    yield f"{__name__}:FusingBackend"
    api.forget_prepared()


def _inputs(m=12, n=10, k=6, dtype=torch.float32):
    g = torch.Generator().manual_seed(m * 100 + n)
    return (torch.randn(m, k, generator=g, dtype=dtype), torch.randn(k, n, generator=g, dtype=dtype),
            torch.randn(m, n, generator=g, dtype=dtype), torch.randn(n, generator=g, dtype=dtype))


def _reference(a, b, residual, weight, eps):
    x = residual.double() + a.double() @ b.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double(), x


def _close(got, want):
    return all(float((g.double() - w).abs().max()) < 1e-4 for g, w in zip(got, want))


def test_a_prepared_calls_fused_path_runs_once_per_key_after_the_checks(fusing, monkeypatch):
    a, b, residual, weight = _inputs()
    checked = []
    monkeypatch.setattr(norm, "check", lambda *args: checked.append(args) or 12)
    for eps in (1e-6, 1e-5, 0.0):
        got = fo.overlap_add_rmsnorm(a, b, residual, weight, eps=eps, backend=fusing)
        assert _close(got, _reference(a, b, residual, weight, eps))
    assert Fused.calls == [("allreduce", 1e-6), ("allreduce", 1e-5), ("allreduce", 0.0)]
    assert FusingBackend.prepared == 1 and len(checked) == 1  # later calls: the key's table
    fo.overlap_add_rmsnorm(a, b, residual, weight.double(), backend=fusing)  # another key
    assert len(checked) == 2 and FusingBackend.prepared == 1  # the same overlap key
    api.forget_prepared()
    fo.overlap_add_rmsnorm(a, b, residual, weight, backend=fusing)
    assert len(checked) == 3 and FusingBackend.prepared == 2


def test_eps_is_checked_on_every_call(fusing):
    a, b, residual, weight = _inputs()
    fo.overlap_add_rmsnorm(a, b, residual, weight, backend=fusing)
    for bad in (-1.0, float("nan"), "small"):
        with pytest.raises(ValueError, match="eps must be a real number >= 0"):
            fo.overlap_add_rmsnorm(a, b, residual, weight, eps=bad, backend=fusing)
    got = fo.overlap_add_rmsnorm(a, b, residual, weight, eps=1, backend=fusing)  # an int is fine
    assert _close(got, _reference(a, b, residual, weight, 1.0))


def test_a_later_call_with_a_wrong_residual_is_still_refused(fusing):
    a, b, residual, weight = _inputs()
    fo.overlap_add_rmsnorm(a, b, residual, weight, backend=fusing)
    with pytest.raises(ValueError, match="residual must be"):
        fo.overlap_add_rmsnorm(a, b, residual[:-1], weight, backend=fusing)
    with pytest.raises(TypeError, match="residual must be a torch.Tensor"):
        fo.overlap_add_rmsnorm(a, b, residual.tolist(), weight, backend=fusing)
    assert len(Fused.calls) == 1


@pytest.mark.parametrize("backend", ["reference", "decomposition"])
@pytest.mark.parametrize("strategy", ["overlap", "sequential"])
def test_backends_without_a_fused_kernel_and_the_sequential_strategy(backend, strategy):
    api.forget_prepared()
    a, b, residual, weight = _inputs(13, 20, 7)
    plan = Plan(13, 20, 7, "allreduce", 1, "float32", (4, 8), 2, (3, 5, 4), Schedule("n", 2),
                backend=backend, strategy=strategy)
    got = fo.overlap_add_rmsnorm(a, b.t().contiguous().t(), residual, weight, eps=1e-5,
                                 plan=plan, backend=backend)
    assert _close(got, _reference(a, b, residual, weight, 1e-5))


def test_the_default_is_the_post_reorder_then_add_and_norm():
    a, b, residual, weight = _inputs()
    prepared = api.prepared_call(a, b, "allreduce", backend="decomposition")
    normed, resid = prepared.run_add_rmsnorm(a, b, "allreduce", residual, weight, 1e-6)
    want = add_rmsnorm(a @ b, residual, weight, 1e-6)
    assert torch.allclose(normed, want[0], atol=1e-5) and torch.allclose(resid, want[1], atol=1e-5)
