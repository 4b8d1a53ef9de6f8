"""The cuda backend's operand rules (backends/cuda/gemm.py), on CPU tensors: what the kernels
read in place, what they read as copies (16-byte aligned rows; sm80: K padded with zeros, a
row-major b with N % 8 != 0 taken column-major), and the first call's warm-up
(backends/cuda/call_base.py)."""
from __future__ import annotations

import pytest
import torch

from flashoverlap_backends.cuda import gemm
from flashoverlap_backends.cuda.call_base import WarmUps
from flashoverlap_backends.cuda.device_state import ENV_ARCH

DTYPE = torch.bfloat16


def _product(a_op, b_op, col, k):
    """a @ b as the kernel computes it from its operands (b's rows: [N, K] when ``col``)."""
    b_kn = b_op.t() if col else b_op
    return a_op[:, :k].float() @ b_kn[:k].float()


def test_the_architecture_is_forced_or_a_clear_error(monkeypatch):
    for arch in ("80", "90"):
        monkeypatch.setenv(ENV_ARCH, arch)
        assert gemm.arch() == int(arch)
    monkeypatch.setenv(ENV_ARCH, "75")
    with pytest.raises(ValueError, match=f"{ENV_ARCH} must be 80 or 90, got '75'"):
        gemm.arch()


def test_sm80_pads_k_and_takes_narrow_row_major_b_column_major():
    assert [gemm.padded_k(80, k) for k in (1, 8, 13, 16)] == [8, 8, 16, 16]
    assert [gemm.padded_k(90, k) for k in (1, 8, 13, 16)] == [1, 8, 13, 16]
    row_b, narrow_b = torch.zeros(16, 64, dtype=DTYPE), torch.zeros(16, 13, dtype=DTYPE)
    weight_t = torch.zeros(13, 16, dtype=DTYPE).t()
    assert not gemm.takes_col_major(80, row_b) and not gemm.takes_col_major(90, narrow_b)
    assert gemm.takes_col_major(80, narrow_b)
    assert gemm.takes_col_major(90, weight_t) and gemm.takes_col_major(80, weight_t)


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("k", [8, 13, 64])
@pytest.mark.parametrize("b_layout", ["row", "col"])
def test_operands_compute_the_same_product(arch, k, b_layout):
    gen = torch.Generator().manual_seed(k)
    a = torch.randn(24, k, generator=gen).to(DTYPE)
    n = 40
    b = (torch.randn(k, n, generator=gen) if b_layout == "row"
         else torch.randn(n, k, generator=gen).t()).to(DTYPE)
    col = gemm.takes_col_major(arch, b)
    ops = gemm.Operands(arch, a, b, col)
    assert ops.k == gemm.padded_k(arch, k)
    for a_ptr, lda, b_ptr, ldb, copies in (ops.of_key(a, b), ops.of_rows(a, b)):
        # contiguous rows of a multiple of 16 bytes are read in place, others copied
        assert (copies is None) == (k % 8 == 0)
        if copies is None:
            assert (a_ptr, b_ptr) == (a.data_ptr(), b.data_ptr())
            assert (lda, ldb) == (a.stride(0), b.stride(1) if col else b.stride(0))
            continue
        a_op, b_op = copies  # sm80: zero columns beyond K; rows of 16-byte multiples
        assert a_op.shape[1] == ops.k and not a_op[:, k:].any()
        assert lda % 8 == 0 and ldb % 8 == 0
        assert (a_ptr, lda, b_ptr, ldb) == (a_op.data_ptr(), a_op.stride(0),
                                            b_op.data_ptr(), b_op.stride(0))
        assert torch.equal(_product(a_op, b_op, col, ops.k), a.float() @ b.float())


def test_unaligned_operands_are_copied_to_aligned_rows():
    base = torch.randn(32 * 65 + 1).to(DTYPE)
    a = base[1:1 + 32 * 64].view(32, 64)  # aligned strides, base off by one element
    b = torch.randn(64, 48).to(DTYPE)
    ops = gemm.Operands(90, a, b, False)
    assert ops.direct and not gemm.bases_aligned(a, b)
    a_ptr, lda, b_ptr, ldb, (a_op, b_op) = ops.of_key(a, b)
    assert a_ptr % gemm.ALIGN_BYTES == 0 and torch.equal(a_op, a) and b_op is b
    odd = torch.randn(32, 70).to(DTYPE)[:, :64]  # row stride 70: not a multiple of 8
    ops = gemm.Operands(90, odd, b, False)
    assert not ops.direct and ops.b_direct
    a_ptr, lda, _, _, (a_op, _) = ops.of_key(odd, b)
    assert lda % 8 == 0 and torch.equal(a_op, odd)
    _, lda, _, _, copies = ops.of_rows(odd, b)  # a's strides are checked per call
    assert copies is not None and lda % 8 == 0


def test_a_call_without_rows_copies_nothing():
    b = torch.randn(13, 40).to(DTYPE)
    ops = gemm.Operands(80, torch.zeros(4, 13, dtype=DTYPE), b, False)  # K padded: no direct
    empty = torch.zeros(0, 13, dtype=DTYPE)
    assert ops.of_rows(empty, b) == (empty.data_ptr(), 16, b.data_ptr(), ops.ldb, None)


def test_the_first_call_of_a_key_warms_up_once(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    warm = WarmUps()
    assert warm.first(("lib", None, "allreduce", "bfloat16"))
    assert not warm.first(("lib", None, "allreduce", "bfloat16"))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not warm.first(("lib", None, "allreduce", "bfloat16"))
    with pytest.raises(ValueError, match="cannot be captured in a CUDA graph"):
        warm.first(("lib", None, "reduce_scatter", "bfloat16"))
