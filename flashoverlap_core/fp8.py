"""fp8 inputs: ``a`` and ``b`` in float8_e4m3fn with float32 scales, bf16 or fp16 out.

``fo.overlap(a8, b8, op, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)`` returns
``op((a8 * sa) @ (b8 * sb))``, accumulated in float32 (the meaning of ``torch._scaled_mm``):

* ``b`` is laid out as ``torch._scaled_mm`` takes it, column-major ``[K, N]`` (``weight.t()``
  of an fp8 ``[N, K]`` weight);
* the scales, float32, on a's device, finite, in one of three kinds (:func:`scaling_kind`,
  from their shapes; a's ``m`` rows are this rank's, for allgather its ``[m, K]`` shard, and
  each rank's ``scale_a`` scales its own rows: ``allgather(a_r * scale_a_r) @ (b * scale_b)``):

  - tensor-wise: both 0-dim;
  - row-wise: ``scale_a`` 0-dim or ``[M, 1]`` and ``scale_b`` 0-dim or ``[1, N]``, at least
    one of them not 0-dim;
  - block-wise (DeepSeek-V3 style, torch's ``ScalingType.BlockWise1x128`` for a and
    ``BlockWise128x128`` for b): ``scale_a`` is ``[M, ceil(K/128)]``, one scale per row and
    group of 128 consecutive k (a[r, k] is scaled by scale_a[r, k // 128]); ``scale_b`` is
    ``[ceil(K/128), ceil(N/128)]``, one scale per 128x128 block of b (b[k, n] by
    scale_b[k // 128, n // 128]). K and N need not be multiples of 128: the last group or
    block is partial and its scale applies to the elements it has. Any strides: torch's own
    layouts (``scale_a`` outer-dim-major, strides ``(1, M)``; ``scale_b`` as ``_scaled_mm``
    takes it, ``weight_scale.t()`` of a contiguous ``[ceil(N/128), ceil(K/128)]``, strides
    ``(1, ceil(K/128))``) are read in place. ``scale_b`` may also have
    ``round_up(ceil(K/128), 4)`` rows, as ``torch.nn.functional.scaled_mm`` wants it padded:
    the rows past ``ceil(K/128)`` are not read. Both scales are block-wise or neither (where
    ceil(K/128) is 1, ``[M, 1]`` is both a row-wise and a block-wise ``scale_a``; shapes that
    fit both kinds are row-wise, which then means the same product);

* ``out_dtype`` is bfloat16 (the default) or float16;
* every op; inference only: an fp8 input or scale that requires grad is a TypeError.

An fp8 call is a call kind of its own (``api.overlap_scaled``): its spec has dtype
``float8_e4m3fn``, the ``out_dtype`` and the ``scaling`` kind, its plan the ``out_dtype`` and
(block-wise) the ``scaling`` too, and it carries its scales. A backend with ``native_fp8`` (an
fp8 signaling GEMM) runs it. A "sequential" plan runs torch's scaled GEMM and one collective
(:class:`ScaledSequentialCall`: ``torch._scaled_mm``, block-wise
``torch.nn.functional.scaled_mm``) where the device has it. Otherwise it runs dequantized
(:class:`DequantizedCall`: the inputs times their scales in float32, the float32 call, the
result rounded to ``out_dtype``). all_to_all alike (issue 32), through its per-call rows and
splits path (:class:`~flashoverlap_core.all_to_all.AllToAllCall`): each call's row-wise or
block-wise ``scale_a`` has that call's rows, and its key holds the scales' kind, not their rows.
allgather alike (issue 32): a native backend gets the fp8 call with this rank's scales
(``PreparedCall.run_scaled``, as allreduce's) and gathers the e4m3 rows with every rank's
``scale_a``; the key holds this rank's scales' shapes, so a later call's scale_a of other rows,
dtype or device is refused before any device work.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from .backend import OverlapCall, b_layout
from .plan import SCALINGS

FP8_DTYPES = tuple(d for d in (getattr(torch, "float8_e4m3fn", None),) if d is not None)
OUT_DTYPES = (torch.bfloat16, torch.float16)
DEFAULT_OUT_DTYPE = torch.bfloat16  # an fp8 call's result without out_dtype
INFERENCE_ONLY = ("fp8 calls are for inference: no autograd through them (call under "
                  "torch.no_grad(), or with inputs that do not require grad)")


def is_fp8(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in FP8_DTYPES


BLOCK = 128  # block-wise scales: groups of 128 along K (a), blocks of 128x128 (b)
KINDS = ("tensorwise", "rowwise", "blockwise")


def blocks(size: int) -> int:
    """Groups of :data:`BLOCK` covering ``size`` elements (the last one may be partial)."""
    return -(-size // BLOCK)


def padded_blocks(k: int) -> int:
    """ceil(K/128) rounded up to a multiple of 4: the rows torch.nn.functional.scaled_mm wants
    in a 128x128 ``scale_b``."""
    return -(-blocks(k) // 4) * 4


def scaling_kind(m: int, n: int, k: int, scale_a, scale_b) -> str | None:
    """The kind of an fp8 call's scales from their shapes alone: "tensorwise", "rowwise",
    "blockwise", or None (shapes that fit no kind; :func:`check` says what is wrong)."""
    sa, sb = tuple(scale_a.shape), tuple(scale_b.shape)
    row_a, row_b = sa in ((), (m, 1)), sb in ((), (1, n))
    if row_a and row_b:
        return "tensorwise" if sa == sb == () else "rowwise"
    if sa == (m, blocks(k)) and len(sb) == 2 and sb[0] in (blocks(k), padded_blocks(k)) \
            and sb[1] == blocks(n):
        return "blockwise"
    return None


def expected_shapes(m: int, n: int, k: int) -> str:
    """The scales' shapes an fp8 call of a [m, k] @ [k, n] takes, of each kind, as text (what
    the checks' messages say)."""
    kb, nb = blocks(k), blocks(n)
    padded = f" (or [{padded_blocks(k)}, {nb}])" if padded_blocks(k) != kb else ""
    return (f"tensor-wise: both 0-dim; row-wise: scale_a 0-dim or [{m}, 1] and scale_b 0-dim or "
            f"[1, {n}]; block-wise: scale_a [{m}, {kb}] (1x{BLOCK} groups of a along K: "
            f"ceil({k}/{BLOCK}) = {kb}) and scale_b [{kb}, {nb}]{padded} ({BLOCK}x{BLOCK} "
            f"blocks of b: ceil({k}/{BLOCK}) x ceil({n}/{BLOCK}))")


def _why_not(name: str, scale, m: int, n: int, k: int, other) -> str:
    """What is wrong with the shapes of a call whose scales fit no kind, naming ``name``."""
    got = list(scale.shape)
    kb = blocks(k)
    if name == "scale_a" and scale.dim() == 2 and scale.shape[0] == m and scale.shape[1] != 1 \
            and scale.shape[1] != kb:
        covers = scale.shape[1] * BLOCK
        return (f"scale_a {got} has {scale.shape[1]} groups of {BLOCK} along K, which cover "
                f"K in ({covers - BLOCK}, {covers}]; K={k} needs ceil({k}/{BLOCK}) = {kb} "
                f"groups (the last one may be partial): [{m}, {kb}]")
    if name == "scale_b" and scale.dim() == 2 and scale.shape[0] not in (1, kb, padded_blocks(k)):
        return (f"scale_b {got} has {scale.shape[0]} block rows of {BLOCK} along K; K={k} needs "
                f"ceil({k}/{BLOCK}) = {kb} (the last block may be partial): [{kb}, {blocks(n)}]")
    if name == "scale_b" and scale.dim() == 2 and scale.shape[0] != 1 and \
            scale.shape[1] != blocks(n):
        return (f"scale_b {got} has {scale.shape[1]} block columns of {BLOCK}; N={n} needs "
                f"ceil({n}/{BLOCK}) = {blocks(n)}: [{kb}, {blocks(n)}]")
    return f"{name} has shape {got}"


def check_scales(m: int, n: int, k: int, device, scale_a, scale_b) -> str:
    """The scales' own checks (TypeError/ValueError before any device work): float32 tensors on
    ``device``, shaped as one kind (both block-wise or neither) and, where their values can be
    read on the host side of this check (not under torch.compile's fake tensors), finite. The
    kind (:func:`scaling_kind`)."""
    for name, scale in (("scale_a", scale_a), ("scale_b", scale_b)):
        if scale is None:
            raise TypeError(f"an fp8 call needs {name}, a float32 tensor: "
                            f"{expected_shapes(m, n, k)}")
        if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32:
            raise TypeError(f"{name} must be a float32 tensor, got "
                            f"{getattr(scale, 'dtype', type(scale).__name__)}")
        if scale.device != device:
            raise ValueError(f"{name} must be on {device} like a, got {scale.device}")
    kind = scaling_kind(m, n, k, scale_a, scale_b)
    if kind is None:
        row_a = tuple(scale_a.shape) in ((), (m, 1))
        block_a = tuple(scale_a.shape) == (m, blocks(k))
        a_ok = row_a or block_a
        culprit = ("scale_b", scale_b, scale_a) if a_ok else ("scale_a", scale_a, scale_b)
        mixed = ""
        if block_a and not row_a and tuple(scale_b.shape) in ((), (1, n)):
            mixed = (" (block-wise scale_a goes with block-wise scale_b; torch's scaled GEMMs "
                     "take no mix of block-wise and row-wise or tensor-wise scales)")
        elif row_a and scale_b.dim() == 2 and scale_b.shape[1] == blocks(n) and \
                scale_b.shape[0] in (blocks(k), padded_blocks(k)):
            mixed = (f" (block-wise scale_b goes with block-wise scale_a [{m}, {blocks(k)}])")
        raise ValueError(f"{_why_not(culprit[0], culprit[1], m, n, k, culprit[2])}{mixed}; "
                         f"the scales must be one of: {expected_shapes(m, n, k)}")
    check_finite(scale_a, scale_b)
    return kind


def check_finite(scale_a, scale_b) -> None:
    """ValueError where a scale holds inf or NaN. Reads the values where :func:`_readable`
    allows: a key's first call, and its later calls whose scales are in host memory (no device
    sync to pay there)."""
    for name, scale in (("scale_a", scale_a), ("scale_b", scale_b)):
        if _readable(scale) and scale.numel() and not bool(torch.isfinite(scale).all()):
            raise ValueError(f"{name} has non-finite values (inf or NaN): every scale must be "
                             "finite")


def _readable(t: torch.Tensor) -> bool:
    """Whether the check may read ``t``'s values: a plain tensor (not a fake or functional one
    under torch.compile, nor on the meta device), outside a compiled region."""
    return (type(t) is torch.Tensor and t.device.type != "meta"
            and not torch.compiler.is_compiling())


def check(a, b, scale_a, scale_b, out_dtype) -> torch.dtype:
    """The fp8 call's own checks (TypeError/ValueError, no device work); the output dtype."""
    return check_call(a, b, scale_a, scale_b, out_dtype)[0]


def check_call(a, b, scale_a, scale_b, out_dtype) -> tuple[torch.dtype, str]:
    """:func:`check`, and the scales' kind (:func:`scaling_kind`)."""
    if not (is_fp8(a) and is_fp8(b)):
        got = [getattr(t, "dtype", type(t).__name__) for t in (a, b)]
        raise TypeError(f"scale_a, scale_b and out_dtype are for float8_e4m3fn a and b; got "
                        f"a {got[0]} and b {got[1]} (both must be float8_e4m3fn)")
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"a and b must be 2-D, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    (m, k), (_, n) = a.shape, b.shape
    if b_layout(b) != "col":
        raise ValueError("fp8 b must be column-major [K, N], as torch._scaled_mm takes it: "
                         f"weight.t() of a contiguous fp8 [N, K] weight; got strides {b.stride()}")
    if b.shape[0] != k:
        raise ValueError(f"a is [{m}, {k}] and b is [{b.shape[0]}, {n}]: a.shape[1] must equal "
                         "b.shape[0]")
    kind = check_scales(m, n, k, a.device, scale_a, scale_b)
    out_dtype = DEFAULT_OUT_DTYPE if out_dtype is None else out_dtype
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be torch.bfloat16 or torch.float16, got {out_dtype}")
    if any(t.requires_grad for t in (a, b, scale_a, scale_b)) and torch.is_grad_enabled():
        raise TypeError(INFERENCE_ONLY)
    return out_dtype, kind


def example_inputs(m: int, n: int, k: int, scaling: str, device, generator=None):
    """Random e4m3 ``a`` [m, k] and ``b`` [k, n] (column-major: ``w.t()`` of an e4m3
    [n, k] weight) with float32 scales of the ``scaling`` kind ("tensorwise": 0-dim;
    "rowwise": [m, 1] and [1, n]; "blockwise": [m, ceil(k/128)] and [ceil(k/128),
    ceil(n/128)]): inputs for timing and tuning an fp8 call. (a, b, scale_a, scale_b)."""
    if scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")
    f8 = FP8_DTYPES[0]
    a = torch.randn(m, k, generator=generator, device=device).to(f8)
    w = (torch.randn(n, k, generator=generator, device=device) / k ** 0.25).to(f8)
    shapes = {"tensorwise": ((), ()), "rowwise": ((m, 1), (1, n)),
              "blockwise": ((m, blocks(k)), (blocks(k), blocks(n)))}[scaling]
    scales = [torch.rand(size, generator=generator, device=device) / 16 + 1 / 32
              for size in shapes]
    return a, w.t(), scales[0], scales[1]


def expanded(scale: torch.Tensor, rows: int, cols: int, row_block: int) -> torch.Tensor:
    """A block-wise scale as one float per element of its [rows, cols] operand: each entry
    repeated over its ``row_block`` x :data:`BLOCK` block (rows past ``rows`` and columns
    past ``cols``, the partial last block's missing part, cut off)."""
    used = scale[:-(-rows // row_block), :blocks(cols)]
    return used.repeat_interleave(row_block, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]


def dequantized(a, b, scale_a, scale_b) -> tuple[torch.Tensor, torch.Tensor]:
    """(a * scale_a, b * scale_b) in float32; b keeps its column-major layout."""
    (m, k), n = a.shape, b.shape[1]
    if scaling_kind(m, n, k, scale_a, scale_b) == "blockwise":
        sa = expanded(scale_a, m, k, 1)  # [M, K]
        sb = expanded(scale_b, k, n, BLOCK)  # [K, N]
        return a.float() * sa, (b.t().float() * sb.t()).t()
    return a.float() * scale_a, (b.t().float() * scale_b.t()).t()


def dequantized_call(call: OverlapCall) -> OverlapCall:
    """The float32 call an fp8 call runs as (its example tensors, the plan's float32 twin)."""
    a, b = dequantized(call.a, call.b, call.scale_a, call.scale_b)
    out = (None if call.out is None
           else torch.empty(call.out.shape, dtype=torch.float32, device=call.out.device))
    return dataclasses.replace(call, a=a, b=b, plan=call.plan.dequantized(), out=out,
                               scale_a=None, scale_b=None)


class ScaledSequentialCall:
    """The plain path of an fp8 key (a "sequential" plan): torch's scaled GEMM on the device
    (``torch._scaled_mm`` for tensor-wise and row-wise scales, with fast accumulation on
    accelerators as the native fp8 kernels; block-wise, ``torch.nn.functional.scaled_mm`` with
    ``BlockWise1x128`` / ``BlockWise128x128``, its scales put in the layouts it wants), then one
    collective on its result, as :class:`~flashoverlap_core.collectives.SequentialCall`; for
    allgather, the e4m3 bytes are gathered, never dequantized rows.

    allgather means ``allgather(a_r * scale_a_r) @ (b * scale_b)``: rank r's rows take rank
    r's own ``scale_a`` (ranks compute their activation scales independently), so scale_a is
    gathered with the rows, whatever its kind. Row-wise ``[m, 1]`` and block-wise
    ``[m, ceil(K/128)]`` scales are gathered as rows (any strides: torch's outer-dim-major
    block-wise layout too). A 0-dim scale_a (tensor-wise, or row-wise with a ``[1, N]``
    scale_b) is gathered as one scale per rank and applied to that rank's ``m`` rows: as a
    row-wise ``[W*m, 1]`` scale_a (0-dim scale_b as ``[1, N]``) where torch's ``_scaled_mm``
    takes row-wise scales for the device and out_dtype, else one GEMM per rank's ``m``-row
    slice with that rank's scale. ``b`` and ``scale_b`` are the same on every rank.

    A row-wise call with one 0-dim scale runs with it expanded to its row-wise shape (torch
    takes no mix of a 0-dim and a row-wise scale); two row-wise scales go to torch as they are. A block-wise GEMM that torch refuses at run
    time (a shape its kernel does not take) runs dequantized from then on, with a warning."""

    def __init__(self, call: OverlapCall, native=None):
        from .collectives import SequentialCall  # the collective half of the plain path

        self.plain = SequentialCall(call, native=native)
        self.fast = call.a.device.type != "cpu"
        self.blockwise = call.plan.scaling == "blockwise"
        self.dequantize = False  # set when torch refused the block-wise GEMM of a call
        # allgather with a 0-dim scale_a: whether the gathered rows can take every rank's scale
        # as one row-wise [W*m, 1] scale_a (else one GEMM per rank's rows)
        self.rowwise_gather = (
            self.plain.collective == "all_gather" and self.plain.group is not None
            and not self.blockwise and call.scale_a.dim() == 0
            and scaled_mm_takes(call.a.device, call.a.dtype, call.a.shape[1], call.b.shape[1],
                                True, call.plan.result_dtype))

    @staticmethod
    def available(call: OverlapCall) -> bool:
        """Whether torch runs this call's fp8 GEMM on its device (a tiny probe at prepare time,
        with the call's kind of scales; block-wise also K and N multiples of 16, as torch's fp8
        GEMMs want)."""
        dev = call.a.device
        if call.plan.scaling == "blockwise":
            k, n = call.a.shape[1], call.b.shape[1]
            if not blockwise_available(dev) or k % 16 or n % 16:
                return False
            a = torch.zeros(16, BLOCK, device=dev, dtype=call.a.dtype)
            b = torch.zeros(BLOCK, BLOCK, device=dev, dtype=call.b.dtype).t()
            try:
                blockwise_mm(a, b, torch.ones(16, 1, device=dev), torch.ones(1, 1, device=dev),
                             call.plan.result_dtype)
            except (RuntimeError, NotImplementedError, TypeError, ValueError):
                return False
            return True
        rowwise = call.scale_a.dim() != 0 or call.scale_b.dim() != 0  # one 0-dim: row-wise
        return scaled_mm_takes(dev, call.a.dtype, call.a.shape[1], call.b.shape[1], rowwise,
                               call.plan.result_dtype)

    def product(self, a, b, scale_a, scale_b, out_dtype, out=None):
        """The scaled product in ``out_dtype``; into ``out`` (contiguous) where given, as the
        plain path's in-place collectives take it (no copy of the result into the call's
        output). all_to_all's plain path takes it alone, then the all_to_all of the result."""
        if self.blockwise and not self.dequantize:
            try:
                return blockwise_mm(a, b, scale_a, scale_b, out_dtype)
            except (RuntimeError, NotImplementedError, ValueError) as e:
                import warnings

                warnings.warn(f"torch.nn.functional.scaled_mm refused a block-wise fp8 GEMM "
                              f"of [{a.shape[0]}, {a.shape[1]}] x [{b.shape[0]}, "
                              f"{b.shape[1]}] ({e}); this key's plain path runs the "
                              "dequantized product from now on", RuntimeWarning)
                self.dequantize = True
        if self.dequantize:
            a32, b32 = dequantized(a, b, scale_a, scale_b)
            return torch.matmul(a32, b32).to(out_dtype)
        if scale_a.dim() != scale_b.dim():  # one 0-dim, one row-wise: torch takes no mix
            scale_a = _rowwise(scale_a, a.shape[0], 1)
            scale_b = _rowwise(scale_b, 1, b.shape[1])
        extra = {} if out is None else {"out": out}
        return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype,
                                use_fast_accum=self.fast, **extra)

    def run_scaled(self, a, b, scale_a, scale_b, out, op) -> torch.Tensor:
        plain = self.plain
        if plain.collective == "all_gather":
            m = a.shape[0]
            a = plain.gathered(a)
            if scale_a.dim() or plain.group is None:  # row-wise or block-wise: rows of their own
                return out.copy_(self.product(a, b, plain.gathered(scale_a), scale_b, out.dtype))
            scales = plain.gathered(scale_a.reshape(1, 1))  # [W, 1]: every rank's own scale
            if self.rowwise_gather:
                return out.copy_(self.product(a, b, scales.repeat_interleave(m, 0), scale_b,
                                               out.dtype))
            for r in range(plain.world):  # one GEMM per rank's rows, with its 0-dim scale
                rows = slice(r * m, (r + 1) * m)
                into = out[rows] if out.is_contiguous() else None
                product = self.product(a[rows], b, scales[r, 0], scale_b, out.dtype, into)
                if product is not into:
                    out[rows].copy_(product)
            return out
        in_place = plain.collective in ("all_reduce", None) or plain.group is None
        into = out if in_place and out.is_contiguous() else None
        product = self.product(a, b, scale_a, scale_b, out.dtype, into)
        return plain.collect(product, out, op)


def _rowwise(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A tensor-wise or row-wise scale as ``torch._scaled_mm``'s row-wise one: ``[rows, cols]``
    (``[M, 1]`` for a, ``[1, N]`` for b), contiguous; a 0-dim scale repeated."""
    if scale.dim() == 0:
        return scale.reshape(1, 1).expand(rows, cols).contiguous()
    return scale.contiguous()


@functools.lru_cache(maxsize=None)
def _scaled_mm_probe(device: torch.device, dtype, k_rem: int, n_rem: int, rowwise: bool,
                     out_dtype) -> bool:
    if not hasattr(torch, "_scaled_mm"):
        return False
    k, n = 32 + k_rem, 16 + n_rem  # the shape's residues mod 16: what torch's checks look at
    a = torch.zeros(16, k, device=device, dtype=dtype)
    b = torch.zeros(n, k, device=device, dtype=dtype).t()
    sa = torch.ones((16, 1) if rowwise else (), device=device)
    sb = torch.ones((1, n) if rowwise else (), device=device)
    try:
        torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=out_dtype,
                         use_fast_accum=device.type != "cpu")
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def scaled_mm_takes(device: torch.device, dtype, k: int, n: int, rowwise: bool,
                    out_dtype) -> bool:
    """Whether ``torch._scaled_mm`` runs a [*, k] x [k, n] fp8 GEMM on ``device`` (probed once
    per residue of K and N modulo 16: some devices' fp8 GEMMs want multiples of 16, others not)."""
    return _scaled_mm_probe(torch.device(device), dtype, k % 16, n % 16, bool(rowwise), out_dtype)


def blockwise_available(device: torch.device) -> bool:
    """Whether this torch has a block-wise scaled GEMM API (``torch.nn.functional.scaled_mm``
    with ``ScalingType.BlockWise1x128`` and ``BlockWise128x128``); whether the device runs it
    is :meth:`ScaledSequentialCall.available`'s probe."""
    import torch.nn.functional as F

    kinds = getattr(F, "ScalingType", None)
    return (device.type != "cpu" and hasattr(F, "scaled_mm")
            and hasattr(kinds, "BlockWise1x128") and hasattr(kinds, "BlockWise128x128"))


def torch_blockwise_scales(scale_a: torch.Tensor, scale_b: torch.Tensor, k: int):
    """Block-wise scales in the layouts ``torch.nn.functional.scaled_mm`` takes (torch
    2.11-2.13, sm_90): ``scale_a`` [M, ceil(K/128)] with strides (1, M) (outer-dim-major);
    ``scale_b`` [round_up(ceil(K/128), 4), ceil(N/128)] with strides (1, that row count), the
    rows past ceil(K/128) zero. Copies only what is not laid out so already."""
    m, kb = scale_a.shape
    if not (scale_a.stride(0) == 1 and (scale_a.stride(1) == m or kb == 1)):
        scale_a = scale_a.t().contiguous().t()
    rows, nb = padded_blocks(k), scale_b.shape[1]
    if not (tuple(scale_b.shape) == (rows, nb) and scale_b.stride(0) == 1
            and (scale_b.stride(1) == rows or nb == 1)):
        padded = scale_b.new_zeros(nb, rows)
        padded[:, :blocks(k)] = scale_b[:blocks(k)].t()
        scale_b = padded.t()
    return scale_a, scale_b


def blockwise_mm(a, b, scale_a, scale_b, out_dtype) -> torch.Tensor:
    """(a * scale_a) @ (b * scale_b) for block-wise scales on torch's block-wise scaled GEMM
    (``torch.nn.functional.scaled_mm``; accumulation as torch's kernel does it)."""
    import torch.nn.functional as F

    sa, sb = torch_blockwise_scales(scale_a, scale_b, a.shape[1])
    kinds = F.ScalingType
    return F.scaled_mm(a, b, sa, kinds.BlockWise1x128, sb, kinds.BlockWise128x128,
                       output_dtype=out_dtype)


class DequantizedCall:
    """The prepared calls of an fp8 key that run dequantized: each call's inputs times their
    scales in float32, then ``inner`` (the prepared float32 call: a backend's, or the
    sequential path), its result rounded into ``out``."""

    def __init__(self, inner):
        self.inner = inner
        self.backend = getattr(inner, "backend", None)

    def run_scaled(self, a, b, scale_a, scale_b, out, op) -> torch.Tensor:
        a32, b32 = dequantized(a, b, scale_a, scale_b)
        result = self.inner.run(a32, b32, torch.empty(out.shape, dtype=torch.float32,
                                                      device=out.device), op)
        return out.copy_(result)
