"""Never slower, end to end on the CPU: where the plain path (the device's own GEMM, then one
transfer) beats every grouping timed (or, with nothing timed, is predicted to), the tuned plan
says "sequential" and ``overlap`` runs the plain path for that shape; where a timed grouping
beats it, that grouping is stored, whatever was predicted."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import flashoverlap_core as fo
from flashoverlap_core.api import forget_prepared
from flashoverlap_core.transfers import HostOffload
from flashoverlap_core.tuning.search import SEQUENTIAL, Choice, predictive_search
from flashoverlap_core.tuning.tuner import (Job, ModelParts, build_model, sample_groupings,
                                            store_plan, tuned_plan)

# The reference backend computes tile by tile in Python: with a copy to host memory that takes
# microseconds, nothing is left to hide, and torch.matmul then one copy is far faster.
JOB = Job(512, 1024, 16, "offload", "float32", "reference", iters=2, warmup=1, trace_reps=1,
          rounds=3)


@pytest.fixture(scope="module")
def parts(tmp_path_factory) -> ModelParts:
    return build_model(JOB, str(tmp_path_factory.mktemp("cache") / "tuning.json"))


def test_the_tuner_measures_the_plain_path_and_chooses_it(parts):
    model = parts.model()
    assert model.num_tiles > 4 and parts.plain_s is not None and parts.plain_s > 0
    assert model.sequential() == pytest.approx(parts.sequential_s)  # calibrated
    assert parts.plain_s < parts.sequential_s  # the host GEMM beats the tile-by-tile one
    choice = predictive_search(model, plain_s=parts.plain_s)
    assert choice.fell_back and choice.strategy == SEQUENTIAL
    plan = tuned_plan(parts, choice)
    assert plan.strategy == SEQUENTIAL and plan.group_sizes == (plan.num_tiles,)


def test_a_measured_plain_path_wins_over_predicted_overlap(parts):
    model = parts.model()
    halves = (model.num_tiles // 2, model.num_tiles - model.num_tiles // 2)
    optimistic = Choice(halves, 1e-9, parts.sequential_s, 0.0, False)  # predicted to pay
    measured = {halves: parts.plain_s * 1.5, (model.num_tiles,): parts.sequential_s}
    assert tuned_plan(parts, optimistic, measured).strategy == SEQUENTIAL
    faster = {halves: parts.plain_s * 0.5, (model.num_tiles,): parts.sequential_s}
    kept = tuned_plan(parts, optimistic, faster)
    assert kept.strategy == "overlap" and kept.group_sizes == halves
    assert tuned_plan(parts, optimistic).group_sizes == halves  # nothing measured: the choice
    # the plain path timed beside the groupings counts over the one build_model measured
    faster_plain = {**faster, SEQUENTIAL: parts.plain_s * 0.4}
    assert tuned_plan(parts, optimistic, faster_plain).strategy == SEQUENTIAL
    assert tuned_plan(parts, optimistic, {**faster, SEQUENTIAL: parts.plain_s}).group_sizes \
        == halves


def test_a_measured_grouping_wins_over_a_predicted_plain_path(parts):
    """A busy host's model may predict the plain path where a timed grouping beat it: what was
    timed decides (flashoverlap tune's "stored: the fastest timed")."""
    model = parts.model()
    one = (model.num_tiles,)
    pessimistic = Choice(one, parts.plain_s, parts.sequential_s, 0.0, True, SEQUENTIAL,
                         parts.plain_s)
    assert tuned_plan(parts, pessimistic).strategy == SEQUENTIAL  # nothing timed: the choice
    timed = {one: parts.plain_s * 0.7, SEQUENTIAL: parts.plain_s}
    kept = tuned_plan(parts, pessimistic, timed)
    assert kept.strategy == "overlap" and kept.group_sizes == one
    assert tuned_plan(parts, pessimistic, {one: parts.plain_s * 1.1,
                                           SEQUENTIAL: parts.plain_s}).strategy == SEQUENTIAL


def test_overlap_runs_the_plain_path_for_a_sequential_tuned_plan(parts, tmp_path, monkeypatch):
    cache = tmp_path / "tuning.json"
    plan = tuned_plan(parts, predictive_search(parts.model(), plain_s=parts.plain_s))
    store_plan(JOB, parts, plan, str(cache), measured_ms=parts.plain_s * 1e3)
    monkeypatch.setenv("FLASHOVERLAP_TUNING_CACHE", str(cache))
    forget_prepared()
    gen = torch.Generator().manual_seed(7)
    a = torch.randn(JOB.m, JOB.k, generator=gen)
    w = torch.randn(JOB.n, JOB.k, generator=gen)
    offload = HostOffload(JOB.m * JOB.n, torch.float32, pin_memory=False)
    offload.host.fill_(float("nan"))
    out = fo.overlap(a, w.t(), offload, backend="reference")
    expected = (a.double() @ w.double().t()).float()
    assert torch.allclose(out, expected, atol=1e-4)
    # the plain path hands the row-major result to the op in one piece; the overlapped call
    # would hand it the packed (tile by tile) layout
    assert torch.allclose(offload.host.view(JOB.m, JOB.n), expected, atol=1e-4)
    forget_prepared()


def test_sampling_times_the_plain_path_beside_the_groupings(parts):
    tiles = parts.model().num_tiles
    samples = sample_groupings(dataclasses.replace(JOB, rounds=3), [(tiles,), SEQUENTIAL])
    assert [len(s) for s in samples] == [3, 3] and min(map(min, samples)) > 0
