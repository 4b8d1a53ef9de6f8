"""An ``out`` that shares memory with ``a`` or ``b``: the call would read its inputs while it
writes ``out`` and return a wrong result without a word (``torch.matmul(a, b, out=a)`` does, on
the CPU). ``fo.overlap`` refuses it with a ValueError before any work, on the first call of a key
and on later ones (the fast path's check), for every op; disjoint parts of one buffer stay
allowed."""
from __future__ import annotations

import random

import pytest
import torch

import flashoverlap_core as fo
from flashoverlap_core.checks import touches


@pytest.fixture(autouse=True)
def _fresh():
    fo.api.forget_prepared()
    yield
    fo.api.forget_prepared()


def _refused(call, *unchanged):
    before = [t.clone() for t in unchanged]
    with pytest.raises(ValueError, match="out must not share memory with"):
        call()
    for t, was in zip(unchanged, before):  # nothing ran: the inputs are as they were
        assert torch.equal(t, was)


@pytest.mark.parametrize("op", ["allreduce", "reduce_scatter", "allgather"])
def test_out_that_is_an_input_is_refused(op):
    x, w = torch.randn(8, 8), torch.randn(8, 8)
    _refused(lambda: fo.overlap(x, w, op, out=x), x, w)
    _refused(lambda: fo.overlap(x, w, op, out=w), x, w)


def test_out_overlapping_some_rows_of_a_is_refused():
    buf = torch.randn(16, 8)
    w = torch.randn(8, 8)
    _refused(lambda: fo.overlap(buf[:8], w, out=buf[4:12]), buf, w)


def test_out_overlapping_a_column_major_b_is_refused():
    a, w = torch.randn(8, 8), torch.randn(8, 8)
    _refused(lambda: fo.overlap(a, w.t(), out=w), a, w)


def test_all_to_all_out_that_is_a_is_refused():
    x, w = torch.randn(8, 8), torch.randn(8, 8)
    _refused(lambda: fo.overlap(x, w, "all_to_all", send_splits=[8], out=x), x, w)


def test_a_later_call_of_the_same_key_is_refused_too():
    """The first call prepares the key with a good out; a later call takes the fast path."""
    x, w, out = torch.randn(8, 8), torch.randn(8, 8), torch.empty(8, 8)
    fo.overlap(x, w, out=out)
    _refused(lambda: fo.overlap(x, w, out=x), x, w)
    torch.testing.assert_close(fo.overlap(x, w, out=out), x @ w)  # the key still works


def test_disjoint_parts_of_one_buffer_are_allowed():
    w = torch.randn(8, 8)
    buf = torch.zeros(24, 8)
    a, out = buf[:8].copy_(torch.randn(8, 8)), buf[8:16]  # rows of one buffer
    result = fo.overlap(a, w, out=out)
    assert result is out
    torch.testing.assert_close(out, a @ w)
    # a as columns of a wider buffer, out after it in the same storage
    flat = torch.zeros(8 * 24 + 64)
    wide = flat[:8 * 24].view(8, 24).copy_(torch.randn(8, 24))
    out2 = flat[8 * 24:].view(8, 8)
    torch.testing.assert_close(fo.overlap(wide[:, :8], w, out=out2), wide[:, :8] @ w)


def _element_bytes(t: torch.Tensor, base: int) -> set[int]:
    """Every byte offset (from ``base``) that an element of ``t`` covers."""
    size = t.element_size()
    index = torch.zeros((), dtype=torch.long)
    for d, s in zip(t.shape, t.stride()):
        index = index.unsqueeze(-1) + torch.arange(d) * s
    starts = (t.data_ptr() - base) + index.flatten() * size
    return {int(s) + i for s in starts for i in range(size)}


def test_touches_never_misses_and_is_exact_on_rows_and_columns():
    rng = random.Random(1234)
    storage = torch.zeros(4096, dtype=torch.float16)
    base = storage.data_ptr()
    for _ in range(400):
        rows, cols = rng.randint(1, 9), rng.randint(1, 9)
        kind = rng.choice(["rows", "cols", "contiguous", "expanded"])
        offset = rng.randint(0, 200)
        if kind == "rows":  # a slice of a wider row-major buffer
            width = cols + rng.randint(0, 6)
            t = storage[offset:offset + rows * width].view(rows, width)[:, :cols]
        elif kind == "cols":  # the transpose of such a slice
            width = rows + rng.randint(0, 6)
            t = storage[offset:offset + cols * width].view(cols, width)[:, :rows].t()
        elif kind == "contiguous":
            t = storage[offset:offset + rows * cols].view(rows, cols)
        else:  # rows that repeat one row (stride 0): the span test decides
            t = storage[offset:offset + cols].view(1, cols).expand(rows, cols)
        lo = base + rng.randint(0, 260) * 2
        hi = lo + rng.randint(1, 80) * 2
        truth = any(lo - base <= x < hi - base for x in _element_bytes(t, base))
        found = touches(t, lo, hi)
        assert found or not truth, (kind, t.shape, t.stride(), lo - base, hi - base)
        if kind != "expanded":
            assert found == truth, (kind, t.shape, t.stride(), lo - base, hi - base)
