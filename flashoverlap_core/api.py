"""Public entry points: ``overlap``, ``plan`` and ``backends``.

Every argument is checked here, before any device work, and a wrong one raises ``TypeError``
or ``ValueError`` saying what was given and what is accepted.
"""
from __future__ import annotations

import importlib
from functools import lru_cache
from typing import Callable

import torch

from . import registry
from .backend import Backend, OverlapCall, OverlapSpec
from .collectives import resolve_group
from .grouping import wave_group_sizes
from .plan import (CUSTOM_OP, DTYPES, OPS, PLAN_OPS, Plan, _check_int, block_rows_for, check_splits,
                   dtype_name)
from .tiles import Schedule, TileGrid
from .tuning import lookup_plan


def _check_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (or a DLPack array), got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")


def b_layout(b: torch.Tensor) -> str:
    """'row' for a contiguous [K, N] b, 'col' for the transpose of a contiguous [N, K]
    (``weight.t()``), 'strided' otherwise."""
    if b.stride(1) == 1 and b.stride(0) >= max(1, b.shape[1]):
        return "row"
    if b.stride(0) == 1 and b.stride(1) >= max(1, b.shape[0]):
        return "col"
    return "strided"


def _op_name(op) -> str:
    if callable(op) and not isinstance(op, str):
        return CUSTOM_OP
    if not isinstance(op, str):
        raise TypeError(f"op must be one of {OPS} or a callable op(region, index), "
                        f"got {type(op).__name__}")
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS} or a callable op(region, index), got {op!r}")
    return op


def _check_splits_use(op: str, world_size: int, m: int, send_splits, recv_splits):
    if op != "all_to_all":
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


def _check_out(out, shape, like: torch.Tensor, n: int) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
    if out.dtype != like.dtype or out.device != like.device:
        raise ValueError(f"out must be {like.dtype} on {like.device}, got {out.dtype} on {out.device}")
    if shape is not None and tuple(out.shape) != shape:
        raise ValueError(f"out must have shape {shape}, got {tuple(out.shape)}")
    if out.dim() != 2 or out.shape[1] != n or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [rows, {n}] tensor, "
                         f"got shape {tuple(out.shape)} strides {out.stride()}")


def _output_rows(op: str, m: int, world_size: int, recv) -> int | None:
    if op == "reduce_scatter":
        return m // world_size
    if op == "all_to_all":
        if world_size == 1:
            return m
        return sum(recv) if recv is not None else None
    return m


def overlap(a: torch.Tensor, b: torch.Tensor, op: str | Callable = "allreduce", group=None, *,
            plan: Plan | None = None, out: torch.Tensor | None = None, send_splits=None,
            recv_splits=None, backend: str | None = None) -> torch.Tensor:
    """The collective ``op`` applied to ``a @ b`` (see DESIGN.md for the exact semantics),
    with the communication overlapped with the GEMM that produces it.

    ``a``, ``b`` and ``out`` may also be any DLPack arrays (e.g. CuPy's): they are viewed as
    torch tensors without a copy, and the result comes back in ``a``'s array type.
    """
    a, a_type = _from_dlpack(a)
    b, _ = _from_dlpack(b)
    if out is not None:
        out, _ = _from_dlpack(out)
    result = _overlap(a, b, op, group, plan, out, send_splits, recv_splits, backend)
    return result if a_type is None else _to_array_type(result, a_type)


def _from_dlpack(x):
    """(torch view of x, x's type) for a DLPack array that is not a torch tensor."""
    if isinstance(x, torch.Tensor) or not hasattr(x, "__dlpack__"):
        return x, None
    return torch.from_dlpack(x), type(x)


def _to_array_type(t: torch.Tensor, kind: type):
    library = importlib.import_module(kind.__module__.split(".")[0])
    return library.from_dlpack(t)


def _overlap(a, b, op, group, plan, out, send_splits, recv_splits, backend):
    _check_tensor("a", a)
    _check_tensor("b", b)
    (m, k), (kb, n) = a.shape, b.shape
    if k != kb:
        raise ValueError(f"a is [{m}, {k}] and b is [{kb}, {n}]: a.shape[1] must equal b.shape[0]")
    if a.dtype != b.dtype:
        raise TypeError(f"a and b must have the same dtype, got {a.dtype} and {b.dtype}")
    dtype = dtype_name(a.dtype)
    if a.device != b.device:
        raise ValueError(f"a and b must be on the same device, got {a.device} and {b.device}")
    if min(m, n, k) < 1:
        raise ValueError(f"M, N and K must all be >= 1, got M={m}, N={n}, K={k}")
    op_name = _op_name(op)
    group, rank, world = resolve_group(group)
    if op_name == "reduce_scatter" and m % world:
        raise ValueError(f"reduce_scatter needs M divisible by the world size: M={m}, W={world}")
    send, recv = _check_splits_use(op_name, world, m, send_splits, recv_splits)
    if plan is not None and not isinstance(plan, Plan):
        raise TypeError(f"plan must be a flashoverlap_core.Plan or None, got {type(plan).__name__}")
    rows = _output_rows(op_name, m, world, recv)
    if out is not None:
        _check_out(out, (rows, n) if rows is not None else None, a, n)

    spec = OverlapSpec(m, n, k, op_name, world, dtype, a.device.type, b_layout(b), send)
    chosen = registry.select(spec, backend, plan.backend if plan is not None else None)
    if plan is None:
        transfer = type(op).__name__ if op_name == CUSTOM_OP else ""
        plan = _default_plan(spec, chosen.name, group, transfer)
    else:
        wrong = plan.mismatches(m=m, n=n, k=k, op=op_name, world_size=world, dtype=dtype,
                                send_splits=send)
        wrong += chosen.plan_reasons(plan)
        if wrong:
            raise ValueError("the plan does not fit this call: " + "; ".join(wrong))
    if out is None and rows is not None:
        out = torch.empty((rows, n), dtype=a.dtype, device=a.device)
    call = OverlapCall(a, b, plan, op, group, rank, world, out, recv)
    return chosen.run(call)


def make_plan(backend: Backend, spec: OverlapSpec, tile=None, group_sizes=None,
              wave_size=None, schedule=None) -> Plan:
    """A plan for ``spec`` with ``backend``'s defaults for whatever is not given."""
    tile = tile if tile is not None else backend.default_tile(spec)
    if isinstance(tile, (str, bytes)) or not hasattr(tile, "__len__"):
        raise TypeError(f"tile must be a pair (BM, BN) of ints, got {tile!r}")
    if len(tile) != 2:
        raise ValueError(f"tile must be a pair (BM, BN), got {tile!r}")
    tile = (_check_int("tile BM", tile[0], 1), _check_int("tile BN", tile[1], 1))
    wave = _check_int("wave_size", wave_size if wave_size is not None else backend.wave_size(spec, tile), 1)
    sched = schedule if schedule is not None else backend.schedule(spec)
    if group_sizes is None:
        rows = block_rows_for(spec.op, spec.m, spec.world_size, spec.send_splits)
        total = TileGrid(rows, spec.n, tile[0], tile[1], sched).num_tiles
        itemsize = torch.empty((), dtype=DTYPES[spec.dtype]).element_size()
        unit = spec.world_size if spec.op == "reduce_scatter" else 1
        group_sizes = wave_group_sizes(total, wave, unit=unit,
                                       bytes_per_tile=itemsize * tile[0] * tile[1])
    elif isinstance(group_sizes, (str, bytes)) or not hasattr(group_sizes, "__iter__"):
        raise TypeError(f"group_sizes must be a sequence of ints, got {type(group_sizes).__name__}")
    plan = Plan(spec.m, spec.n, spec.k, spec.op, spec.world_size, spec.dtype, tile, wave,
                tuple(group_sizes), sched, spec.send_splits, backend.name)
    reasons = backend.plan_reasons(plan)
    if reasons:
        raise ValueError(f"backend {backend.name!r} cannot run this plan: " + "; ".join(reasons))
    return plan


@lru_cache(maxsize=256)
def _default_plan(spec: OverlapSpec, backend_name: str, group=None, transfer: str = "") -> Plan:
    """The tuned plan from the tuning cache when there is one, else the heuristic plan.
    Every rank must see the same cache, or ranks could pick different groupings."""
    backend = registry.get(backend_name)
    tuned = lookup_plan(spec, backend, group, transfer)
    return tuned if tuned is not None else make_plan(backend, spec)


def plan(m: int, n: int, k: int, op: str = "allreduce", world_size: int = 1,
         dtype=torch.bfloat16, tile=None, group_sizes=None, backend: str | None = None, *,
         send_splits=None, wave_size: int | None = None, schedule: Schedule | None = None,
         b_layout: str = "col") -> Plan:
    """Build an inspectable plan (``describe()``, ``to_json()``) to pass to :func:`overlap`.

    ``backend`` defaults to the explicit choice in ``FLASHOVERLAP_BACKEND``, else the best
    available accelerator backend, else the reference; its kernel decides the default tile,
    wave size and tile order. ``send_splits`` (rows per destination) is required for an
    ``all_to_all`` plan at world size > 1.
    """
    for name, value in (("M", m), ("N", n), ("K", k), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if op not in PLAN_OPS:
        raise ValueError(f"op must be one of {PLAN_OPS}, got {op!r}")
    if op == "reduce_scatter" and m % world_size:
        raise ValueError(f"reduce_scatter needs M divisible by the world size: M={m}, W={world_size}")
    send, _ = _check_splits_use(op, world_size, m, send_splits, None)
    chosen = registry.get(backend) if backend is not None else registry.default_backend()
    device_type = chosen.device_type or "cpu"
    spec = OverlapSpec(m, n, k, op, world_size, dtype_name(dtype), device_type, b_layout, send)
    reasons = chosen.unsupported_reasons(spec)
    if reasons:
        raise ValueError(f"backend {chosen.name!r} cannot run this call: " + "; ".join(reasons))
    return make_plan(chosen, spec, tile, group_sizes, wave_size, schedule)


def backends() -> list[registry.BackendStatus]:
    """Every known backend with whether it is available here and, if not, why."""
    return registry.backends()
