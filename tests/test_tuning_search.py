"""The timing model and the predictive search, on synthetic models (no device work)."""
from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashoverlap_core.tuning.model import Contention, CostCurve, GemmTiming, OverlapModel
from flashoverlap_core.tuning.search import (all_groupings, best_ends, measured_candidates,
                                             predictive_search, sizes_from_ends)


def synthetic(waves, wave_size=4, wave_s=1.0, latency=0.0, bytes_per_s=1.0, tile_bytes=1,
              contention=Contention(), post=0.0, unit=1, tiles=None):
    tiles = tiles if tiles is not None else waves * wave_size
    timing = GemmTiming(wave_size, tuple(wave_s * (w + 1) for w in range(waves)))
    prefix = np.arange(tiles + 1) * tile_bytes
    cost = CostCurve.affine(latency, bytes_per_s, max(1, int(prefix[-1])))
    return OverlapModel(timing, prefix, cost, contention, post, unit)


# ---- the pieces ----------------------------------------------------------------------------------
def test_cost_curve_interpolates_extrapolates_and_irons_out_noise():
    curve = CostCurve((100, 200, 400), (1.0, 0.5, 3.0))  # 200 B measured faster than 100 B
    assert curve(50) == 1.0  # below the smallest size: the smallest size's time
    assert curve(150) == 1.0  # noise ironed out: never faster for more bytes
    assert curve(300) == pytest.approx(2.0)
    assert curve(800) == pytest.approx(3.0 + 400 * (2.0 / 200))  # last segment's bandwidth
    assert np.allclose(curve(np.array([100, 400])), [1.0, 3.0])
    assert CostCurve.free()(10**9) == 0.0
    assert CostCurve.from_dict(curve.to_dict()) == curve
    with pytest.raises(ValueError, match="increasing"):
        CostCurve((2, 1), (0.0, 0.0))


def test_gemm_timing_ready_is_the_end_of_the_wave_of_the_last_tile():
    timing = GemmTiming(4, (1.0, 2.0, 3.0))
    assert list(timing.ready([1, 4, 5, 12])) == [1.0, 1.0, 2.0, 3.0]
    assert timing.end == 3.0 and GemmTiming.from_dict(timing.to_dict()) == timing
    with pytest.raises(ValueError, match=">= 1"):
        Contention(0.5, 1.0)


def test_simulation_by_hand():
    """4 waves of 1 tile ending at 1, 2, 3, 4 s; a transfer costs 1 s per tile."""
    plain = synthetic(4, wave_size=1)
    assert plain.sequential() == 8.0  # GEMM 4 s, then 4 tiles
    assert plain.predict((2, 2)) == 6.0  # [2, 4] then [4, 6]
    assert plain.predict((1, 1, 1, 1)) == 5.0
    # transfers half as fast beside the GEMM: 2 s at half speed, then 1 s alone
    assert synthetic(4, wave_size=1, contention=Contention(1.0, 2.0)).predict((2, 2)) == 7.0
    # the GEMM half as fast beside the transfer: it reaches 4 s of work at 5 s
    slow = synthetic(4, wave_size=1, contention=Contention(2.0, 1.0))
    assert [(g.start, g.end) for g in slow.schedule((2, 2))] == [(2.0, 4.0), (5.0, 7.0)]
    assert synthetic(4, wave_size=1, post=0.5).predict((2, 2)) == 6.5


# ---- the search ----------------------------------------------------------------------------------
@st.composite
def models(draw):
    wave_size = draw(st.integers(1, 5))
    unit = draw(st.sampled_from([1, 1, 2, 3]))
    waves = draw(st.integers(1, 8))
    tiles = max(unit, (waves * wave_size - draw(st.integers(0, wave_size - 1))) // unit * unit)
    waves = -(-tiles // wave_size)
    steps = draw(st.lists(st.floats(0.01, 2.0), min_size=waves, max_size=waves))
    sizes = draw(st.lists(st.integers(1, 64), min_size=tiles, max_size=tiles))
    points = sorted(set(draw(st.lists(st.integers(0, sum(sizes) * 2), min_size=1, max_size=4))))
    seconds = draw(st.lists(st.floats(0.0, 3.0), min_size=len(points), max_size=len(points)))
    contention = Contention(draw(st.sampled_from([1.0, 1.0, 1.2, 2.0, 3.5])),
                            draw(st.sampled_from([1.0, 1.0, 1.3, 2.0, 4.0])),
                            draw(st.sampled_from([0.0, 0.0, 0.05, 0.5])),
                            draw(st.sampled_from([0.0, 0.0, 0.02, 0.3, 1.0])))
    return OverlapModel(GemmTiming(wave_size, tuple(np.cumsum(steps))),
                        np.concatenate([[0], np.cumsum(sizes)]) * 2,
                        CostCurve(tuple(points), tuple(sorted(seconds))), contention,
                        draw(st.floats(0.0, 1.0)), unit)


@settings(max_examples=600, deadline=None)
@given(models())
def test_search_finds_the_optimum_of_every_wave_boundary_partition(model):
    brute = min(model.predict(sizes) for sizes in all_groupings(model))
    choice = predictive_search(model, min_gain=0.0)
    assert choice.predicted_s == pytest.approx(brute, rel=1e-9, abs=1e-12)
    assert model.predict(choice.group_sizes) == pytest.approx(choice.predicted_s)
    assert sum(choice.group_sizes) == model.num_tiles
    assert all(s % model.unit == 0 for s in choice.group_sizes)
    assert set(np.cumsum(choice.group_sizes)) <= set(model.boundaries())
    assert choice.predicted_s <= choice.sequential_s
    assert predictive_search(model).predicted_s >= brute  # with the default minimum gain


def test_boundaries_are_wave_ends_in_multiples_of_the_unit():
    model = synthetic(5, wave_size=5, unit=2, tiles=24)
    assert list(model.boundaries()) == [4, 10, 14, 20, 24]


def test_overlap_that_pays_is_chosen():
    choice = predictive_search(synthetic(8, latency=0.01, tile_bytes=1, bytes_per_s=4.0))
    assert not choice.fell_back and len(choice.group_sizes) > 1
    assert choice.predicted_s < choice.sequential_s


@pytest.mark.parametrize("why, model", [
    ("transfers are free", synthetic(8, bytes_per_s=1e12)),
    ("no process group", OverlapModel(GemmTiming(4, (1.0, 2.0)), np.arange(9), CostCurve.free())),
    ("each transfer's fixed cost dwarfs the GEMM", synthetic(8, latency=100.0, bytes_per_s=1e12)),
    ("running together slows both down a lot",
     synthetic(8, tile_bytes=1, bytes_per_s=4.0, contention=Contention(3.0, 3.0))),
])
def test_falls_back_to_one_group_when_overlap_does_not_pay(why, model):
    choice = predictive_search(model)
    assert choice.fell_back, why
    assert choice.group_sizes == (model.num_tiles,)
    assert choice.predicted_s == pytest.approx(model.sequential())


def test_min_gain_keeps_one_group_for_a_marginal_gain():
    model = synthetic(8, latency=0.01, tile_bytes=1, bytes_per_s=4.0)
    gain = 1 - predictive_search(model).predicted_s / model.sequential()
    assert predictive_search(model, min_gain=gain * 1.01).fell_back
    assert not predictive_search(model, min_gain=gain * 0.99).fell_back


@pytest.mark.parametrize("contention", [Contention(), Contention(1.3, 1.6, 1e-6, 3e-6)])
def test_search_on_500_waves_takes_well_under_a_second(contention):
    model = synthetic(500, wave_size=132, wave_s=2e-5, latency=2e-5, tile_bytes=65536,
                      bytes_per_s=4e11, contention=contention)
    began = time.process_time()  # CPU time: other jobs on the machine do not count
    choice = predictive_search(model)
    elapsed = time.process_time() - began
    assert elapsed < 1.0, f"search of 500 waves took {elapsed:.3f} s of CPU"
    assert len(choice.group_sizes) > 1  # (choice.search_s is wall time: the machine's load)


def test_measured_candidates_are_every_grouping_or_a_coarser_grid():
    small = synthetic(4)
    assert len(measured_candidates(small, limit=64)) == 2 ** 3
    large = synthetic(100)
    extra = [(400,), (1,) * 400]
    found = measured_candidates(large, limit=64, extra=extra)
    assert len(found) == 64 + 1 and found[0] == (400,) and (1,) * 400 in found
    assert len(set(found)) == len(found)
    assert all(sum(g) == 400 for g in found)
    assert sizes_from_ends(best_ends(large))  # a grouping, ends ascending
