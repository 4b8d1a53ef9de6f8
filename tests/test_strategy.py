"""The strategy choice of default calls (overlap or the plain path): the fixed rules, the
prediction on synthetic rates and links, the measurement's cache and its fallback. No device
work beyond a small host GEMM calibration."""
from __future__ import annotations

import warnings

import pytest
import torch

import flashoverlap_core as fo
from flashoverlap_core.tuning import strategy as st
from flashoverlap_core.tuning.cache import TuningCache
from flashoverlap_core.tuning.model import Contention, CostCurve

H200_LIKE = st.GemmRates(flops_per_s=800e12, bytes_per_s=4.0e12, fixed_s=5e-6)
NVLINK = CostCurve.affine(15e-6, 150e9, 1 << 30)  # assumed: latency, bus rate of a collective
PCIE = CostCurve.affine(30e-6, 20e9, 1 << 30)


def plan_of(m, n, k, op="allreduce", world=8, **kw):
    """A plan with an H200-sized kernel: 128x256 tiles, 132 per wave."""
    kw.setdefault("tile", (128, 256))
    kw.setdefault("wave_size", 132)
    return fo.plan(m, n, k, op=op, world_size=world, backend="reference", dtype=torch.bfloat16,
                   **kw)


@pytest.fixture(autouse=True)
def _auto(monkeypatch):
    monkeypatch.delenv(st.ENV_STRATEGY, raising=False)
    st.forget()


def test_fixed_rules(monkeypatch):
    assert st.fixed_choice(plan_of(4096, 8192, 1024, world=1)).strategy == st.PLAIN
    assert st.fixed_choice(plan_of(4096, 8192, 1024, world=4)) is None
    monkeypatch.setenv(st.ENV_STRATEGY, "overlap")
    assert st.fixed_choice(plan_of(1, 8192, 1024, world=1)).strategy == st.OVERLAP
    monkeypatch.setenv(st.ENV_STRATEGY, "PLAIN")
    assert st.fixed_choice(plan_of(16384, 8192, 1024)).strategy == st.PLAIN
    monkeypatch.setenv(st.ENV_STRATEGY, "fastest")
    with pytest.raises(ValueError, match="FLASHOVERLAP_STRATEGY must be one of auto"):
        st.fixed_choice(plan_of(16384, 8192, 1024))


def test_a_callable_op_always_overlaps(monkeypatch):
    p = fo.plan(4096, 1024, 512, op="custom", world_size=1, backend="reference",
                dtype=torch.bfloat16)
    monkeypatch.setenv(st.ENV_STRATEGY, "plain")
    assert st.fixed_choice(p).strategy == st.OVERLAP


@pytest.mark.parametrize("m,n,k", [(1, 8192, 3584), (16, 8192, 1024), (64, 4096, 7168),
                                   (256, 8192, 3584)])
@pytest.mark.parametrize("link", [NVLINK, PCIE])
def test_decode_sizes_run_plain(m, n, k, link):
    p = st.predict(plan_of(m, n, k), H200_LIKE, link)
    assert p.strategy == st.PLAIN, p
    assert p.plain_s < p.overlap_s


def test_prefill_with_a_transfer_to_hide_overlaps():
    p = st.predict(plan_of(4096, 8192, 3584), H200_LIKE, NVLINK)
    assert p.strategy == st.OVERLAP and p.overlap_s < 0.97 * p.plain_s


def test_the_tile_layout_pays_its_reorder():
    rows = plan_of(16384, 8192, 1024)
    tiles = plan_of(16384, 8192, 1024, layout="tiles")
    assert rows.layout == "rows" and tiles.layout == "tiles"
    a, b = st.predict(rows, H200_LIKE, NVLINK), st.predict(tiles, H200_LIKE, NVLINK)
    assert a.plain_s == pytest.approx(b.plain_s)
    assert b.overlap_s > a.overlap_s + 2 * 16384 * 8192 * 2 / H200_LIKE.bytes_per_s * 0.99


def test_more_contention_never_predicts_faster():
    p = plan_of(8192, 8192, 3584)
    easy = st.predict(p, H200_LIKE, NVLINK, Contention())
    hard = st.predict(p, H200_LIKE, NVLINK, Contention(gemm=1.5, comm=1.5, gap_s=2e-5,
                                                      lag_s=2e-5))
    assert hard.overlap_s >= easy.overlap_s and hard.plain_s == easy.plain_s


def test_allgather_and_reduce_scatter_are_predicted():
    for op in ("allgather", "reduce_scatter"):
        small = st.predict(plan_of(8, 8192, 3584, op=op), H200_LIKE, NVLINK)
        assert small.strategy == st.PLAIN and small.overlap_s > 0 and small.plain_s > 0


def test_rates_roofline_and_whole_tiles():
    r = H200_LIKE
    assert r.plain_s(1, 8192, 8192, 2, 2) == pytest.approx(5e-6 + 8192 * 8192 * 2 / 4e12,
                                                           rel=1e-3)
    assert r.plain_s(8192, 8192, 8192, 2, 2) == pytest.approx(5e-6 + 2 * 8192 ** 3 / 800e12)
    # one token in 128-row tiles: the signaling GEMM computes whole tiles
    p = plan_of(1, 8192, 8192)
    t = r.signaling_timing(p, 2, 2)
    assert t.end > 2 * r.plain_s(1, 8192, 8192, 2, 2)
    with pytest.raises(ValueError, match="positive"):
        st.GemmRates(0.0, 1.0, 0.0)


def test_measured_rates_on_the_host_are_sane_and_quick():
    import time
    began = time.perf_counter()
    r = st.measure_rates(torch.float32, torch.device("cpu"), None)
    assert r.flops_per_s > 1e8 and r.bytes_per_s > 1e7 and r.fixed_s >= 0
    assert time.perf_counter() - began < 5.0
    assert st.GemmRates.from_dict(r.to_dict()) == r


class _Backend:
    name = "reference"

    def versions(self):
        return {"fake": "1"}


def test_cached_facts_are_used_without_measuring(tmp_path, monkeypatch):
    cache = TuningCache(tmp_path / "t.json")
    p = plan_of(4096, 1024, 512, world=2)
    calls = []
    monkeypatch.setattr(st, "measure_rates", lambda *a: calls.append("gemm") or H200_LIKE)
    monkeypatch.setattr(st, "measure_collective", lambda *a: calls.append("coll") or NVLINK)
    first = st.group_facts(p, _Backend(), None, torch.device("cpu"), cache)
    assert calls == ["gemm", "coll"] and first == (H200_LIKE, NVLINK)
    st.forget()
    assert st.group_facts(p, _Backend(), None, torch.device("cpu"), cache) == first
    assert calls == ["gemm", "coll"]  # from the file this time
    # another dtype of the same group: its own GEMM rates, its own curve
    p16 = fo.plan(4096, 1024, 512, op="allreduce", world_size=2, backend="reference",
                  dtype=torch.float16)
    st.group_facts(p16, _Backend(), None, torch.device("cpu"), cache)
    assert calls == ["gemm", "coll"] * 2


def test_a_failed_measurement_falls_back_once_with_a_warning(monkeypatch):
    def broken(*a):
        raise RuntimeError("no collective today")

    monkeypatch.setattr(st, "group_facts", broken)
    st._warned.clear()
    big, small = plan_of(4096, 1024, 512, world=2), plan_of(16, 1024, 512, world=2)
    with pytest.warns(RuntimeWarning, match="overlapping where M >= 1024"):
        chosen, why = st.choose(big, _Backend(), None, torch.device("cpu"))
    assert chosen.strategy == st.OVERLAP and "fallback" in why.reason
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        chosen, _ = st.choose(small, _Backend(), None, torch.device("cpu"))
    assert chosen.strategy == st.PLAIN


def test_choose_marks_the_plan(monkeypatch):
    monkeypatch.setattr(st, "group_facts", lambda *a, **k: (H200_LIKE, NVLINK))
    p = plan_of(1, 8192, 3584, world=2)
    chosen, why = st.choose(p, _Backend(), None, torch.device("cpu"))
    assert chosen.strategy == st.PLAIN and why.plain_s < why.overlap_s
    assert chosen.group_sizes == p.group_sizes and chosen.tile == p.tile
