"""The argument checks of a call, written once: what ``overlap`` checks on a key's first call,
what the torch custom ops check before their fake kernels, and what those kernels check on
shapes alone (under torch.compile). Each check raises ``TypeError`` or ``ValueError`` saying
what was given and what is accepted, before any device work.

:func:`check_arguments` is every check of a call that needs no backend; it is made of
:func:`check_operands` (a, b, op and dtypes: no group needed) and :func:`check_rows` (the
rows and splits against the world size), which a shape-only run makes on its own. What the
checks found becomes the contract's :class:`OverlapSpec` and :class:`OverlapCall` through
:func:`spec_of` and :func:`call_of`.
"""
from __future__ import annotations

import torch

from .backend import OverlapCall, OverlapSpec, b_layout
from .collectives import resolve_group
from .ops import of, op_name
from .plan import DTYPES, Plan, check_out_dtype, check_splits, dtype_name


def check_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (or a DLPack array), got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")


def check_operands(a, b, op, out_dtype=None) -> tuple[int, int, int, str, str, str | None]:
    """The checks of ``a``, ``b`` and ``op`` (``out_dtype`` given for fp8 calls only, after
    fp8.check): ``(m, n, k, op name, dtype name, result dtype name or None)``."""
    check_tensor("a", a)
    check_tensor("b", b)
    (m, k), (kb, n) = a.shape, b.shape
    if k != kb:
        raise ValueError(f"a is [{m}, {k}] and b is [{kb}, {n}]: a.shape[1] must equal b.shape[0]")
    if a.dtype != b.dtype:
        raise TypeError(f"a and b must have the same dtype, got {a.dtype} and {b.dtype}")
    if str(a.dtype).startswith("torch.float8") and out_dtype is None:
        raise TypeError(f"{a.dtype} a and b need scale_a and scale_b (float32: tensor-wise "
                        "0-dim, row-wise [M, 1] and [1, N], or block-wise [M, ceil(K/128)] and "
                        "[ceil(K/128), ceil(N/128)]) and give out_dtype (bfloat16 by default): "
                        "fo.overlap(a, b, op, scale_a=..., scale_b=..., out_dtype=...)")
    dtype = dtype_name(a.dtype)
    result_name = check_out_dtype(dtype, out_dtype)
    if a.device != b.device:
        raise ValueError(f"a and b must be on the same device, got {a.device} and {b.device}")
    name = op_name(op)
    if min(n, k) < 1 or m < of(name).min_rows:
        raise ValueError(f"M, N and K must all be >= 1 (M >= 0 for all_to_all: a rank may have "
                         f"no rows to send), got M={m}, N={n}, K={k}")
    return m, n, k, name, dtype, result_name


def check_splits_use(op: str, world_size: int, m: int, send_splits, recv_splits):
    """``(send, recv)`` checked: splits only for an op that takes them (all_to_all), where
    ``send_splits`` is required at world size > 1; None for those not given."""
    if not of(op).splits:
        if send_splits is not None or recv_splits is not None:
            raise ValueError(f"send_splits/recv_splits only apply to op='all_to_all', not {op!r}")
        return None, None
    if send_splits is None and world_size > 1:
        raise ValueError(f"all_to_all at world size {world_size} needs send_splits: "
                         f"rows of a @ b to send to each rank, {world_size} ints summing to M={m}")
    send = check_splits("send_splits", send_splits, world_size, m) if send_splits is not None else None
    recv = check_splits("recv_splits", recv_splits, world_size, None) if recv_splits is not None else None
    if world_size == 1 and recv is not None and recv != (m,):
        raise ValueError(f"at world size 1 recv_splits must be [{m}], got {list(recv)}")
    return send, recv


def check_rows(op: str, m: int, world_size: int, send_splits, recv_splits):
    """The checks of a's ``m`` rows and the splits against the world size: ``(send, recv,
    rows of the result)`` (rows None: known only after the ranks exchange their splits)."""
    kind = of(op)
    if kind.output == "block" and m % world_size:
        raise ValueError(f"{op} needs M divisible by the world size: M={m}, W={world_size}")
    send, recv = check_splits_use(op, world_size, m, send_splits, recv_splits)
    return send, recv, kind.output_rows(m, world_size, recv)


def _rows_touch(base: int, step: int, width: int, count: int, lo: int, hi: int) -> bool:
    """Whether one of ``count`` runs of ``width`` bytes at ``base + i * step`` (disjoint:
    step >= width) meets the byte range [lo, hi)."""
    first = max(0, (lo - width - base) // step + 1)
    last = min(count - 1, (hi - 1 - base) // step)
    return first <= last


def span_bytes(t: torch.Tensor) -> int:
    """Bytes from a tensor's first element to the end of its last (0 when it has none)."""
    if t.numel() == 0:
        return 0
    return (sum((d - 1) * s for d, s in zip(t.shape, t.stride())) + 1) * t.element_size()


def touches(t: torch.Tensor, lo: int, hi: int) -> bool:
    """Whether an element of ``t`` lies in the byte range [lo, hi) of its device's memory:
    exact for a 2-D tensor of disjoint rows or columns (slices of a wider buffer among them),
    else true whenever its span meets the range."""
    span = span_bytes(t)
    if span == 0:
        return False
    size = t.element_size()
    base = t.data_ptr()
    if base + span <= lo or base >= hi:
        return False
    if t.dim() == 2:
        (m, k), (s0, s1) = t.shape, t.stride()
        if s1 == 1 and s0 >= k:
            return _rows_touch(base, s0 * size, k * size, m, lo, hi)
        if s0 == 1 and s1 >= m:
            return _rows_touch(base, s1 * size, m * size, k, lo, hi)
    return True


def check_out_apart(out: torch.Tensor, **inputs) -> None:
    """A ValueError when the contiguous ``out`` shares memory with one of ``inputs`` (the call
    reads them while it writes out: the result would be wrong, silently)."""
    lo = out.data_ptr()
    hi = lo + out.numel() * out.element_size()
    for name, t in inputs.items():
        if t is not None and t.device == out.device and touches(t, lo, hi):
            raise ValueError(f"out must not share memory with {name}: the call reads {name} "
                             "while it writes out (pass another out, or none)")


def check_out(out, shape, dtype: torch.dtype, device: torch.device, n: int) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
    if out.dtype != dtype or out.device != device:
        raise ValueError(f"out must be {dtype} on {device}, got {out.dtype} on {out.device}")
    if shape is not None and tuple(out.shape) != shape:
        raise ValueError(f"out must have shape {shape}, got {tuple(out.shape)}")
    if out.dim() != 2 or out.shape[1] != n or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [rows, {n}] tensor, "
                         f"got shape {tuple(out.shape)} strides {out.stride()}")


def check_arguments(a, b, op="allreduce", group=None, plan=None, out=None, send_splits=None,
                    recv_splits=None, out_dtype=None) -> dict:
    """Every check of a call that needs no backend and no device work (TypeError/ValueError
    saying what is wrong); what they found: m, n, k, op, dtype, out_dtype (an fp8 call's result
    dtype, else None), group, rank, world_size, send, recv, rows (of the result; None when only
    the ranks' splits tell). Also what the torch custom ops run before their fake kernels.
    ``out_dtype`` is given for fp8 calls only (after fp8.check)."""
    m, n, k, name, dtype, result_name = check_operands(a, b, op, out_dtype)
    group, rank, world = resolve_group(group)
    send, recv, rows = check_rows(name, m, world, send_splits, recv_splits)
    if plan is not None and not isinstance(plan, Plan):
        raise TypeError(f"plan must be a flashoverlap_core.Plan or None, got {type(plan).__name__}")
    if out is not None:
        check_out(out, (rows, n) if rows is not None else None,
                  DTYPES[result_name or dtype], a.device, n)
        check_out_apart(out, a=a, b=b)
    return dict(m=m, n=n, k=k, op=name, dtype=dtype, out_dtype=result_name, group=group,
                rank=rank, world_size=world, send=send, recv=recv, rows=rows)


def spec_of(c: dict, a, b) -> OverlapSpec:
    """The spec of a checked call (``c``: what :func:`check_arguments` found)."""
    return OverlapSpec(of(c["op"]).result_rows(c["m"], c["world_size"]), c["n"], c["k"],
                       c["op"], c["world_size"], c["dtype"], a.device.type, b_layout(b),
                       c["send"], c["out_dtype"], c.get("scaling"))


def call_of(c: dict, a, b, op, plan: Plan, out) -> OverlapCall:
    """The call a backend runs, of a checked call with ``plan`` (``out`` allocated when None
    and the rows are known)."""
    if out is None and c["rows"] is not None:
        out = torch.empty((c["rows"], c["n"]), dtype=plan.result_dtype, device=a.device)
    return OverlapCall(a, b, plan, op, c["group"], c["rank"], c["world_size"], out, c["recv"],
                       c.get("scale_a"), c.get("scale_b"))
