"""The timing model's order effects, its fit to traced calls and the never-slower choice, on
synthetic models (no device work)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flashoverlap_core as fo
from flashoverlap_core.tile_trace import TileTrace
from flashoverlap_core.tuning.model import (Contention, CostCurve, GatherModel, GemmTiming,
                                            OverlapModel, advance_transfer, fit_contention,
                                            slowdown)
from flashoverlap_core.tuning.search import SEQUENTIAL, all_groupings, predictive_search


def model_of(wave_ends, per_tile_s=1.0, wave_size=1, contention=Contention(), post=0.0,
             latency=0.0):
    """Waves of ``wave_size`` one-byte tiles; a transfer costs latency + per_tile_s per tile."""
    tiles = len(wave_ends) * wave_size
    cost = CostCurve.affine(latency, 1.0 / per_tile_s, tiles)
    return OverlapModel(GemmTiming(wave_size, tuple(wave_ends)), np.arange(tiles + 1), cost,
                        contention, post)


def test_contention_round_trips_and_old_entries_still_load():
    c = Contention(1.2, 1.1, 3e-6, 8e-6)
    assert Contention.from_dict(c.to_dict()) == c
    assert Contention.from_dict({"gemm": 1.5, "comm": 1.0}) == Contention(1.5, 1.0)
    with pytest.raises(ValueError, match="delays"):
        Contention(gap_s=-1.0)


def test_stream_delays_by_hand():
    k = Contention(gap_s=0.1, lag_s=0.3)
    # waiting for the group: it starts lag after its tiles are done
    start, at_start, end, done = advance_transfer(0.0, 0.0, 2.0, 1.0, 4.0, k)
    assert (start, at_start, end, done) == pytest.approx((2.3, 2.3, 3.3, 3.3))
    # the group was finished before the stream got to it: the gap only
    start, at_start, end, done = advance_transfer(3.0, 3.0, 2.0, 1.0, 4.0, k)
    assert (start, at_start, end, done) == pytest.approx((3.1, 3.1, 4.1, 4.0))
    # a gap longer than the wait
    start, *_ = advance_transfer(0.0, 1.95, 2.0, 1.0, 4.0, Contention(gap_s=0.5, lag_s=0.01))
    assert start == pytest.approx(0.5)


def test_the_order_of_the_groups_changes_the_prediction():
    """4 waves of 1 tile ending at 1..4 s, 1 s per tile of transfer."""
    blind = model_of([1.0, 2.0, 3.0, 4.0])
    assert blind.predict((1, 3)) == blind.predict((3, 1)) == 7.0
    # the GEMM half as fast beside a transfer: sending 1 tile early delays the last 3
    slowed = model_of([1.0, 2.0, 3.0, 4.0], contention=Contention(gemm=2.0))
    assert slowed.predict((1, 3)) == pytest.approx(7.5)  # [1, 2] then [4.5, 7.5]
    assert slowed.predict((3, 1)) == pytest.approx(7.0)  # [3, 6], GEMM done at 5, then [6, 7]
    groups = slowed.schedule((1, 3))
    assert [(g.ready, g.ready_at) for g in groups] == [(1.0, 1.0), (4.0, 4.5)]
    # a lag after each group's last tile: the last group's transfer tail
    lagged = model_of([1.0, 2.0, 3.0, 4.0], per_tile_s=0.25, contention=Contention(lag_s=0.1))
    assert lagged.predict((1, 3)) == pytest.approx(4.85)
    assert lagged.predict((3, 1)) == pytest.approx(4.35)


def test_progress_curve_maps_gemm_work_to_call_time():
    slowed = model_of([1.0, 2.0, 3.0, 4.0], contention=Contention(gemm=2.0))
    call = slowed.simulate((1, 1, 2))
    # alone to 1, slowed by 2 while each transfer runs, alone while waiting
    assert call.when([0.5, 1.0, 1.5, 2.0]) == pytest.approx([0.5, 1.0, 2.0, 2.5])
    assert call.when(4.0) == pytest.approx(call.groups[-1].ready_at)
    assert np.all(np.diff(call.times) >= 0) and np.all(np.diff(call.progress) >= 0)


def test_calibration_makes_the_one_group_prediction_the_measured_call():
    model = model_of([1.0, 2.0], post=0.3)
    assert model.calibrated(4.5).sequential() == pytest.approx(4.5)
    assert model.calibrated(3.5).post_s == pytest.approx(-0.5)  # signed: origin before the call


@given(st.lists(st.floats(0.1, 4.0), min_size=2, max_size=6), st.floats(0.05, 4.0),
       st.floats(1e-3, 20.0))
@settings(max_examples=60, deadline=None)
def test_calibrated_predictions_stay_positive_and_keep_the_measured_one_group_call(
        steps, per_tile_s, measured):
    # a busy host measures the one-group call far below its simulation: a shift by the
    # difference would predict a well-overlapped grouping to take no time, or less than none
    model = model_of(list(np.cumsum(steps)), per_tile_s=per_tile_s).calibrated(measured)
    one = (model.num_tiles,)
    assert model.predict(one) == pytest.approx(measured)
    raw = replace(model, post_s=0.0)
    for sizes in all_groupings(model):
        predicted = model.predict(sizes)
        assert predicted > 0
        if model.post_s < 0:  # scaled: each grouping keeps its simulated ratio to one group
            assert predicted / measured == pytest.approx(raw.predict(sizes) / raw.predict(one))
        else:  # shifted
            assert predicted == pytest.approx(raw.predict(sizes) + model.post_s)
    choice = predictive_search(model, plain_s=measured * 2)
    assert choice.predicted_s > 0


def test_gather_model_calibrated_below_its_simulation_stays_positive():
    model = gather_model(band_s=2.0)
    one = (model.num_tiles,)
    raw = model.predict(one)
    scaled = replace(model, post_s=-0.9 * raw)
    assert scaled.predict(one) == pytest.approx(0.1 * raw)
    for sizes in ((4, 4), (2, 2, 2, 2), (4, 2, 2)):  # whole bands of 2 tiles, 8 in all
        assert scaled.predict(sizes) == pytest.approx(0.1 * model.predict(sizes))
        assert scaled.predict(sizes) > 0


# ---- fitting the contention to traces --------------------------------------------------------
def synthetic_trace(model: OverlapModel, group_sizes) -> TileTrace:
    """The trace the model predicts: each tile done when its wave is, transfers as scheduled."""
    call = model.simulate(group_sizes)
    wave = model.timing.wave_size
    tile_end = np.repeat(call.when(model.timing.wave_ends), wave)[:model.num_tiles]
    return TileTrace.from_stamps(
        wave_size=wave, group_sizes=group_sizes, item_end=tile_end,
        item_worker=np.arange(model.num_tiles) % wave,
        transfer_start=[g.start for g in call.groups], transfer_end=[g.end for g in call.groups],
        call_end=call.end)


@pytest.mark.parametrize("truth", [Contention(), Contention(1.3, 1.0, 2e-3, 5e-3),
                                   Contention(1.0, 1.5, 0.0, 1e-2),
                                   Contention(1.25, 1.4, 1e-3, 4e-3)])
def test_fit_recovers_the_contention_of_traced_calls(truth):
    waves = 12
    ends = tuple(0.1 * (w + 1) for w in range(waves))
    # 1.5x as much transfer as GEMM: the later groups queue up (gaps), the first ones wait (lags)
    model = model_of(ends, per_tile_s=0.15 / 4, wave_size=4, contention=truth)
    traces = [synthetic_trace(model, (4,) * waves), synthetic_trace(model, (8, 4, 12, 24))]
    fitted = fit_contention(traces, model_of(ends, per_tile_s=0.15 / 4, wave_size=4))
    assert fitted.gemm == pytest.approx(truth.gemm, rel=1e-6)
    assert fitted.comm == pytest.approx(truth.comm, rel=1e-6)
    assert fitted.gap_s == pytest.approx(truth.gap_s, abs=1e-9)
    assert fitted.lag_s == pytest.approx(truth.lag_s, abs=1e-9)


def test_fit_counts_what_a_transfer_takes_beyond_its_cost_as_the_streams_delay():
    """Each transfer takes 2 ms more in the call than alone (its cost curve): the fit keeps
    the slowdowns and adds the 2 ms to the gap and the lag, which predicts the same calls."""
    ends = tuple(0.1 * (w + 1) for w in range(12))
    truth = Contention(1.2, 1.3, 1e-3, 4e-3)
    in_call = model_of(ends, per_tile_s=0.15 / 4, wave_size=4, contention=truth, latency=2e-3)
    alone = model_of(ends, per_tile_s=0.15 / 4, wave_size=4)
    groupings = [(4,) * 12, (8, 4, 12, 24), (24, 8, 8, 8)]
    fitted = fit_contention([synthetic_trace(in_call, g) for g in groupings[:2]], alone)
    assert (fitted.gemm, fitted.comm) == pytest.approx((1.2, 1.3), rel=1e-6)
    assert (fitted.gap_s, fitted.lag_s) == pytest.approx((3e-3, 6e-3), abs=1e-9)
    model = replace(alone, contention=fitted)
    for sizes in groupings:
        assert model.predict(sizes) == pytest.approx(in_call.predict(sizes), rel=2e-3)


def test_fit_refuses_traces_without_transfer_times():
    model = model_of([1.0, 2.0])
    trace = TileTrace.from_stamps(wave_size=1, group_sizes=[2], item_end=[1.0, 2.0],
                                  item_worker=[0, 0])
    with pytest.raises(ValueError, match="start and end"):
        fit_contention([trace], model)
    with pytest.raises(ValueError, match="at least one"):
        fit_contention([], model)


def test_slowdown_follows_the_rate_model():
    assert slowdown(2.0, 3.0, 2.0) == pytest.approx(2.0)  # 2/f + 1 = 2 -> f = 2
    assert slowdown(2.0, 1.9, 1.0) == 1.0  # faster than alone: noise
    assert slowdown(2.0, 3.0, 0.0) == 1.0  # never together: nothing to learn


# ---- never slower --------------------------------------------------------------------------------
def test_a_transfer_too_small_to_hide_falls_back_to_the_plain_path():
    # 8 waves of 1 ms; the whole output moves in 2 us, each transfer has 20 us of fixed cost
    tiny = model_of([1e-3 * (w + 1) for w in range(8)], per_tile_s=2e-6 / 8, latency=20e-6,
                    post=50e-6)
    plain = 8.0e-3  # the device's own GEMM, then one transfer: faster than the signaling GEMM
    choice = predictive_search(tiny, plain_s=plain)
    assert choice.fell_back and choice.strategy == SEQUENTIAL
    assert choice.predicted_s == plain and choice.group_sizes == (tiny.num_tiles,)
    assert choice.overlap_s >= choice.sequential_s * (1 - 0.005)
    # without a measured plain path the fallback is one group through the overlapped call
    alone = predictive_search(tiny)
    assert alone.fell_back and alone.strategy == "overlap" and alone.plain_s is None


def test_overlap_that_beats_the_plain_path_is_kept_and_a_faster_plain_path_wins():
    model = model_of([1.0, 2.0, 3.0, 4.0], per_tile_s=0.5)  # GEMM 4 s, transfer 2 s
    choice = predictive_search(model, plain_s=5.5)
    assert not choice.fell_back and choice.strategy == "overlap"
    assert choice.predicted_s < 5.5 * (1 - 0.005)
    faster = predictive_search(model, plain_s=choice.predicted_s * 0.99)
    assert faster.strategy == SEQUENTIAL and faster.overlap_s == choice.predicted_s


# ---- allgather: the transfer first, the computation after it --------------------------------
def gather_model(band_s: float, bands=4, world=2, contention=Contention()) -> GatherModel:
    """``bands`` row bands per shard of one-tile waves taking 1 s; one byte per tile, so a
    band of every shard is ``world`` bytes, gathered in ``band_s`` seconds."""
    tiles = bands * world
    cost = CostCurve.affine(0.0, world / band_s, tiles)
    return GatherModel(GemmTiming(1, tuple(float(w + 1) for w in range(tiles))),
                       np.arange(tiles + 1), cost, world, contention, 0.0, world)


def test_gather_model_by_hand():
    fast = gather_model(1.0)  # own shard 4 s, the gather 1 s per band
    assert fast.sequential() == 8.0  # everything arrived at 4 s, the rest 4 s
    assert fast.predict((2, 2, 2, 2)) == 8.0  # never waits
    slow = gather_model(2.0)
    assert slow.sequential() == 12.0  # waits for the whole gather: 8 s, then 4 s
    assert slow.predict((2, 2, 2, 2)) == 9.0  # arrivals at 2, 4, 6, 8; the last band exposed
    assert slow.predict((6, 2)) == 10.0  # 6 s, 3 tiles, then the last band at 8 + 1
    lagged = gather_model(2.0, contention=Contention(gap_s=0.5, lag_s=0.25))
    # chunk 1 arrives at 4, computed from 4.25 to 6.25; chunk 2 at 4 + 0.5 + 4, from 8.75
    assert lagged.predict((4, 4)) == pytest.approx(10.75)
    with pytest.raises(ValueError, match="row bands"):
        slow.predict((3, 5))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 7), st.integers(2, 4), st.floats(0.1, 4.0),
       st.sampled_from([0.0, 0.3]), st.sampled_from([0.0, 0.2, 1.0]))
def test_search_finds_the_best_chunks_of_a_gather(bands, world, band_s, gap, lag):
    model = gather_model(band_s, bands, world, Contention(gap_s=gap, lag_s=lag))
    brute = min(model.predict(sizes) for sizes in all_groupings(model))
    choice = predictive_search(model, min_gain=0.0)
    assert choice.predicted_s == pytest.approx(brute, rel=1e-9)
    assert all(s % model.unit == 0 for s in choice.group_sizes)


def test_gather_model_of_a_plan():
    plan = fo.plan(2 * 300, 512, 64, op="allgather", world_size=2, backend="reference",
                   dtype="float32")
    timing = GemmTiming(plan.wave_size, tuple(1e-3 * (w + 1) for w in range(
        -(-plan.num_tiles // plan.wave_size))))
    model = GatherModel.for_plan(plan, timing, CostCurve.affine(1e-5, 1e10, 1 << 20))
    bands = -(-plan.shard_rows // plan.tile[0])
    assert model.unit * bands == plan.num_tiles
    assert model.prefix_bytes[-1] == 2 * 300 * 64 * 4  # all of the gathered a
    assert list(model.boundaries()) == [model.unit * (b + 1) for b in range(bands)]
    assert model.predict(plan.group_sizes) > 0
