"""Public entry points: ``overlap``, ``plan`` and ``backends``.

The call path is *prepare once, launch many*. The first call of a key (shapes, strides, dtypes,
device, op kind, splits, process group, plan, backend choice) checks every argument (a wrong one
raises ``TypeError`` or ``ValueError`` saying what was given and what is accepted, before any
device work), selects the backend, makes or looks up the plan, checks with one small
collective that every rank of the group runs the same plan, and lets the backend prepare what
its calls need (:meth:`Backend.prepare`: tables, kernels, communicator, workspaces). Later
calls of the key check only what can change between them (``out``) and launch.

The first call of a key is collective when the group has several ranks (the plan check, and a
backend's communicator): every rank must make the same calls in the same order, as with any
collective; ranks whose calls differ on a key's first use (unequal allgather rows, say) are told
so, but a rank that reuses a key another rank sees for the first time cannot be.

Environment variables read when a key is first prepared, not on every call:
``FLASHOVERLAP_BACKEND`` (backend choice) and those of the plan lookup (the tuning cache);
``WORLD_SIZE`` once per process, at the first call (a launcher's ranks that never joined a
process group are warned).
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import os
import threading
import warnings
from typing import Callable

import torch

from . import fp8, registry
from .backend import Backend, OverlapCall, OverlapSpec, PreparedCall, b_layout, call_reasons
from .all_to_all import AllToAllCall
from .collectives import SequentialCall, current_default_group, exchange_objects, resolve_group
from .grouping import MAX_GROUPS, wave_group_sizes
from .plan import (CUSTOM_OP, DTYPES, GATHER_OP, LAYOUTS, OPS, PLAN_OPS, Plan, _check_int,
                   all_to_all_groups, block_rows_for, check_out_dtype, check_splits,
                   destination_group_sizes, dtype_name, group_unit, moved_dtype,
                   transfer_bytes_per_tile)
from .tiles import Schedule, TileGrid

PlanLookup = Callable[[OverlapSpec, Backend, object, str], "Plan | None"]
_plan_lookup: PlanLookup | None = None


def set_plan_lookup(lookup: PlanLookup | None) -> None:
    """Where calls without ``plan=`` look for a tuned plan first: ``lookup(spec, backend,
    group, transfer)`` returns a Plan or None (then the backend's heuristic plan is used).
    The tuning layer installs its cache here; None turns tuned plans off."""
    global _plan_lookup
    _plan_lookup = lookup
    forget_prepared()


# ---- argument checks (first call of a key) -----------------------------------------------------

def _check_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (or a DLPack array), got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")


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


def _check_out(out, shape, dtype: torch.dtype, device: torch.device, n: int) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
    if out.dtype != dtype or out.device != device:
        raise ValueError(f"out must be {dtype} on {device}, got {out.dtype} on {out.device}")
    if shape is not None and tuple(out.shape) != shape:
        raise ValueError(f"out must have shape {shape}, got {tuple(out.shape)}")
    if out.dim() != 2 or out.shape[1] != n or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [rows, {n}] tensor, "
                         f"got shape {tuple(out.shape)} strides {out.stride()}")


def _result_rows(op: str, m: int, world_size: int) -> int:
    """Rows of c = (gathered) a @ b, the M of the plan."""
    return m * world_size if op == GATHER_OP else m


def _output_rows(op: str, m: int, world_size: int, recv) -> int | None:
    """Rows of the call's result (None: known only after the ranks exchange their splits)."""
    if op == "reduce_scatter":
        return m // world_size
    if op == "all_to_all":
        if world_size == 1:
            return m
        return sum(recv) if recv is not None else None
    return _result_rows(op, m, world_size)


# ---- the call ------------------------------------------------------------------------------------

class _Prepared:
    """One key's prepared call: the backend's PreparedCall and what a later call checks."""

    __slots__ = ("prepared", "plan", "out_shape", "dtype", "device")

    def __init__(self, prepared, plan, out_shape, dtype, device):
        # A plain tuple: torch.empty parses it faster than a torch.Size (about a microsecond).
        out_shape = tuple(out_shape) if out_shape is not None else None
        self.prepared, self.plan, self.out_shape = prepared, plan, out_shape
        self.dtype, self.device = dtype, device

    def fits(self, out) -> bool:
        """Whether a later call's ``out`` (None or a tensor) can go straight to launch."""
        return out is None or (isinstance(out, torch.Tensor) and out.shape == self.out_shape
                               and out.dtype == self.dtype and out.device == self.device
                               and out.is_contiguous())

    def run(self, a, b, out, op):
        if out is None and self.out_shape is not None:
            out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        return self.prepared.run(a, b, out, op)

    def run_scaled(self, a, b, scale_a, scale_b, out, op):
        if out is None:
            out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        return self.prepared.run_scaled(a, b, scale_a, scale_b, out, op)


ROWS_PER_CALL = "per call"  # all_to_all's rows in its key: each call's own
MAX_PREPARED = 512  # keys kept; the oldest is dropped (and prepared again if it comes back)
_prepared: dict = {}
_prepare_lock = threading.Lock()


def forget_prepared() -> None:
    """Drop every prepared call and every settled choice (the next call of each key prepares
    it again; at world size > 1 that is collective: call it on every rank)."""
    with _prepare_lock:
        _prepared.clear()
        _settled.clear()
        for table in _keyed_tables:
            table.clear()


_keyed_tables: list[dict] = []


def keyed_table() -> dict:
    """A table of the caller's own from call keys to prepared calls (an op built on
    ``overlap``, with its own key: ``overlap_add_rmsnorm``), dropped with the prepared calls
    (:func:`forget_prepared`); fill it with :func:`remember`."""
    table: dict = {}
    _keyed_tables.append(table)
    return table


def remember(table: dict, key, value) -> None:
    """``table[key] = value``, keeping the last :data:`MAX_PREPARED` keys."""
    table[key] = value
    while len(table) > MAX_PREPARED:
        table.pop(next(iter(table)))


def _splits_key(splits):
    """Splits as a hashable key part (a list or tensor of ints becomes a tuple); anything else
    is left for the argument checks to refuse."""
    if splits is None or isinstance(splits, tuple):
        return splits
    try:
        return tuple(splits.tolist() if isinstance(splits, torch.Tensor) else splits)
    except TypeError:
        return ("not splits", id(splits))


def overlap(a: torch.Tensor, b: torch.Tensor, op: str | Callable = "allreduce", group=None, *,
            plan: Plan | None = None, out: torch.Tensor | None = None, send_splits=None,
            recv_splits=None, backend: str | None = None) -> torch.Tensor:
    """The collective ``op`` applied to ``a @ b`` (see docs/design.md for the exact
    semantics), with the communication overlapped with the GEMM that produces it.

    ``a``, ``b`` and ``out`` may also be any DLPack arrays (e.g. CuPy's): they are viewed as
    torch tensors without a copy, and the result comes back in ``a``'s array type.
    """
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        kind = op if op.__class__ is str else type(op)
        if kind == "all_to_all":  # rows and splits are each call's own: not in the key
            key = ((ROWS_PER_CALL, a.shape[1]), b.shape, a.stride()[1:], b.stride(), a.dtype,
                   b.dtype, a.device, kind, group if group is not None else current_default_group(),
                   id(plan), backend, None, None)
            entry = _prepared.get(key)
            if entry is not None:
                return entry.prepared.run(a, b, out, op, send_splits, recv_splits)
            return _first_call(key, a, b, op, group, plan, out, send_splits, recv_splits, backend)
        key = _call_key(a, b, kind, group, plan, backend, send_splits, recv_splits)
        entry = _prepared.get(key)
        if entry is not None:
            if out is None and entry.out_shape is not None:  # the common call: a new result
                out = torch.empty(entry.out_shape, dtype=entry.dtype, device=entry.device)
                return entry.prepared.run(a, b, out, op)
            if entry.fits(out):
                return entry.run(a, b, out, op)
        return _first_call(key, a, b, op, group, plan, out, send_splits, recv_splits, backend)
    a, a_type = _from_dlpack(a)
    b, _ = _from_dlpack(b)
    if out is not None:
        out, _ = _from_dlpack(out)
    _check_tensor("a", a)  # neither a tensor nor a DLPack array: say so
    _check_tensor("b", b)
    result = overlap(a, b, op, group, plan=plan, out=out, send_splits=send_splits,
                     recv_splits=recv_splits, backend=backend)
    return result if a_type is None else _to_array_type(result, a_type)


def _from_dlpack(x):
    """(torch view of x, x's type) for a DLPack array that is not a torch tensor."""
    if isinstance(x, torch.Tensor) or not hasattr(x, "__dlpack__"):
        return x, None
    return torch.from_dlpack(x), type(x)


def _to_array_type(t: torch.Tensor, kind: type):
    library = importlib.import_module(kind.__module__.split(".")[0])
    return library.from_dlpack(t)


def _call_key(a, b, kind, group, plan, backend, send_splits, recv_splits) -> tuple:
    """The key of a call whose op is not all_to_all (see :func:`overlap`)."""
    return (a.shape, b.shape, a.stride(), b.stride(), a.dtype, b.dtype, a.device, kind,
            group if group is not None else current_default_group(), id(plan), backend,
            _splits_key(send_splits), _splits_key(recv_splits))


def prepared_call(a, b, op: str, group=None, plan: Plan | None = None, backend: str | None = None):
    """What ``overlap(a, b, op, group, plan=plan, backend=backend)`` runs (op allreduce or
    reduce_scatter): its key's prepared call, a :class:`PreparedCall` or alike, prepared on the
    key's first use (every argument checked, collective at world size > 1) and not run. For
    ops built on an overlapped call (``overlap_add_rmsnorm``: ``run_add_rmsnorm``)."""
    key = _call_key(a, b, op, group, plan, backend, None, None)
    entry = _prepared.get(key)
    if entry is None:
        entry, _ = _prepare(key, a, b, op, group, plan, None, None, None, backend)
    return entry.prepared


def overlap_scaled(a, b, op: str | Callable = "allreduce", group=None, *, scale_a=None,
                   scale_b=None, out_dtype=None, plan: Plan | None = None, out=None,
                   send_splits=None, recv_splits=None, backend: str | None = None) -> torch.Tensor:
    """The fp8 call: ``op((a * scale_a) @ (b * scale_b))`` in ``out_dtype`` (bfloat16 by
    default) for float8_e4m3fn ``a`` and ``b`` (flashoverlap_core/fp8.py says what each argument
    takes). It runs on a backend with native fp8 as an fp8 call, else dequantized as a float32
    call; all_to_all always runs dequantized (its per-call rows and splits path carries no
    scales). The call path is :func:`overlap`'s: a key's first call checks and prepares."""
    out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
    kind = op if op.__class__ is str else type(op)
    tensors = all(isinstance(t, torch.Tensor) for t in (a, b, scale_a, scale_b))
    key = None
    if tensors and kind != "all_to_all":
        # overlap's key, then the scales' layout and the result's dtype
        key = _call_key(a, b, kind, group, plan, backend, send_splits, recv_splits) + (
            scale_a.shape, scale_a.stride(), scale_a.dtype, scale_a.device, scale_b.shape,
            scale_b.stride(), scale_b.dtype, scale_b.device, out_dtype)
        entry = _prepared.get(key)
        if entry is not None and entry.fits(out):
            return entry.run_scaled(a, b, scale_a, scale_b, out, op)
    fp8.check(a, b, scale_a, scale_b, out_dtype)
    if kind == "all_to_all":
        return _all_to_all_dequantized(a, b, group, scale_a, scale_b, out_dtype, plan, out,
                                       send_splits, recv_splits, backend)
    return _first_call(key, a, b, op, group, plan, out, send_splits, recv_splits, backend,
                       (scale_a, scale_b, out_dtype))


def _all_to_all_dequantized(a, b, group, scale_a, scale_b, out_dtype, plan, out, send_splits,
                            recv_splits, backend) -> torch.Tensor:
    """An fp8 all_to_all: the float32 call of the dequantized inputs, rounded to out_dtype."""
    if out is not None and (not isinstance(out, torch.Tensor) or out.dtype != out_dtype):
        raise ValueError(f"out must be a {out_dtype} tensor, got "
                         f"{getattr(out, 'dtype', type(out).__name__)}")
    a32, b32 = fp8.dequantized(a, b, scale_a, scale_b)
    try:
        result = overlap(a32, b32, "all_to_all", group, send_splits=send_splits,
                         recv_splits=recv_splits, backend=backend,
                         plan=plan.dequantized() if isinstance(plan, Plan) else plan)
    except registry.BackendError as e:
        raise registry.BackendError(f"{e}\n(an fp8 all_to_all runs dequantized, as a float32 "
                                    "call, on a backend that takes float32)") from None
    if out is None:
        return result.to(out_dtype)
    if out.shape != result.shape:
        raise ValueError(f"out must be a {out_dtype} tensor of shape {tuple(result.shape)}, got "
                         f"{tuple(out.shape)}")
    return out.copy_(result)


def _first_call(key, a, b, op, group, plan, out, send_splits, recv_splits, backend, scales=None):
    """Check everything, prepare the key if it is new (:func:`_prepare`), and run the call.
    ``scales``: an fp8 call's (scale_a, scale_b, out_dtype), checked (:func:`overlap_scaled`)."""
    entry, call = _prepare(key, a, b, op, group, plan, out, send_splits, recv_splits, backend,
                           scales)
    if call is None:  # all_to_all: each call is laid out from its own splits
        return entry.prepared.run(a, b, out, op, send_splits, recv_splits)
    if scales:
        return entry.prepared.run_scaled(a, b, scales[0], scales[1], call.out, op)
    return entry.prepared.run(a, b, call.out, op)


def _prepare(key, a, b, op, group, plan, out, send_splits, recv_splits, backend,
             scales=None):
    """Check everything and prepare the key if it is new: (its entry, the checked call, or
    None for all_to_all).

    What decides the collectives a call issues (backend and plan) is settled once per *group
    key*: the facts of a call that are the same on every rank of the group (op, group, the
    shapes every rank shares, dtype, device type, the plan and backend asked for). Its first
    call is collective at world size > 1 (:func:`_agree`); a new local key under a settled
    group key (this rank's own strides, say) prepares without communicating, so ranks whose
    local keys differ never disagree on whether a call is a first call. all_to_all's key leaves
    out the rows and splits (each call's own): it is its group key, and each call cuts the
    settled plan to its rows (:class:`AllToAllCall`). ``scales``: as :func:`_first_call`'s."""
    if not _launch_checked:
        _warn_if_launched_alone()
    try:
        c = check_arguments(a, b, op, group, plan, out, send_splits, recv_splits,
                            scales[2] if scales else None)
    except (TypeError, ValueError) as e:
        if op.__class__ is str and op == "all_to_all":
            _tell_agreeing_peers(group, e)
        raise
    if scales:
        c["scale_a"], c["scale_b"] = scales[:2]
    a2a = c["op"] == "all_to_all"
    gkey = key if a2a else _group_key(c, a, op, plan, backend)  # all_to_all's key is shared
    with _prepare_lock:
        entry = _prepared.get(key)
        if entry is None:
            if _capturing(a.device):
                raise ValueError(
                    "the first call of this key (shapes, strides, dtype, op, group, plan) cannot be "
                    "captured in a graph: preparing it loads kernels, builds tables and checks the "
                    "plan across ranks, with host synchronisation. Run the call once outside the "
                    "capture (a warm-up call), then capture")
            settled = _settled.get(gkey)
            if settled is None:
                call, chosen = _agree(c, a, b, op, plan, out, recv_splits, backend)
                _settled[gkey] = (chosen, call.plan)
                while len(_settled) > MAX_PREPARED:
                    _settled.pop(next(iter(_settled)))
            else:
                chosen, agreed = settled
                spec = _spec_of(c, a, b)
                reasons = call_reasons(chosen, spec) + chosen.plan_reasons(agreed)
                if reasons:  # a fact of this rank's own (b's layout, say) the choice cannot take
                    raise ValueError(f"backend {chosen.name!r}, which the ranks agreed on for this "
                                     f"call, cannot run it with this rank's arguments: "
                                     + "; ".join(reasons))
                call = _call_of(c, a, b, op, agreed, out)
            prepared = AllToAllCall(chosen, call) if a2a else _make_prepared(chosen, call)
            shape = call.out.shape if call.out is not None and not a2a else None
            entry = _Prepared(prepared, call.plan, shape, call.plan.result_dtype, a.device)
            _prepared[key] = entry
            while len(_prepared) > MAX_PREPARED:
                _prepared.pop(next(iter(_prepared)))
        elif not a2a:  # prepared meanwhile by another thread: this call's out still needs its checks
            call = _call_of(c, a, b, op, entry.plan, out)
    return entry, (None if a2a else call)


_launch_checked = False  # whether this process's first call looked for a launcher's WORLD_SIZE


def _warn_if_launched_alone() -> None:
    """Once per process, at the first call: warn when a launcher (torchrun) started this process
    as one of several ranks (``WORLD_SIZE`` > 1) but no process group is initialised, so that
    every call would run at world size 1, on this rank alone."""
    global _launch_checked
    _launch_checked = True
    world = os.environ.get("WORLD_SIZE", "").strip()
    if not world.isdigit() or int(world) <= 1:
        return
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return
    warnings.warn(
        f"WORLD_SIZE={world} is set (a launcher such as torchrun started this process as one of "
        f"{world} ranks), but torch.distributed has no process group: fo.overlap runs at world "
        "size 1, on this rank alone. Call torch.distributed.init_process_group() (gloo on the "
        "CPU, the device's collective library on an accelerator) before the first call",
        RuntimeWarning)


def _make_prepared(chosen: Backend, call: OverlapCall):
    """The prepared call of a new key: a "sequential" plan runs the plain path; an fp8 call
    runs dequantized there and on a backend without native fp8."""
    if call.scale_a is not None and (call.plan.strategy == "sequential" or not chosen.native_fp8):
        return fp8.DequantizedCall(_make_prepared(chosen, fp8.dequantized_call(call)))
    if call.plan.strategy == "sequential":
        return SequentialCall(call)
    return chosen.prepare(call)


def _tell_agreeing_peers(group, error) -> None:
    """An all_to_all key holds only what every rank shares, so when this rank's first call of
    it is invalid, the other ranks are in the first call's exchange (:func:`_agree`): take part
    with the error, and every rank raises, naming this one."""
    try:
        group, _, world = resolve_group(group)
    except (TypeError, ValueError):
        return
    if group is not None and world > 1:
        exchange_objects(([], None, _error_text(error), 0, None), group)


def _group_key(c: dict, a, op, plan, backend) -> tuple:
    """The facts of a call every rank of its group shares (see :func:`_first_call`)."""
    kind = op if op.__class__ is str else type(op)
    return (kind, c["group"], c["m"], c["n"], c["k"], a.dtype, c["out_dtype"], a.device.type,
            plan, backend)


_settled: dict = {}  # group key -> (backend, plan) the ranks agreed on


def _capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device``'s type is being captured into a graph."""
    module = getattr(torch, device.type, None)
    check = getattr(module, "is_current_stream_capturing", None)
    return bool(check is not None and check())


def check_arguments(a, b, op="allreduce", group=None, plan=None, out=None, send_splits=None,
                    recv_splits=None, out_dtype=None) -> dict:
    """Every check of a call that needs no backend and no device work (TypeError/ValueError
    saying what is wrong); what they found: m, n, k, op, dtype, out_dtype (an fp8 call's result
    dtype, else None), group, rank, world_size, send, recv, rows (of the result; None when only
    the ranks' splits tell). Also what the torch custom ops run before their fake kernels.
    ``out_dtype`` is given for fp8 calls only (after fp8.check)."""
    _check_tensor("a", a)
    _check_tensor("b", b)
    (m, k), (kb, n) = a.shape, b.shape
    if k != kb:
        raise ValueError(f"a is [{m}, {k}] and b is [{kb}, {n}]: a.shape[1] must equal b.shape[0]")
    if a.dtype != b.dtype:
        raise TypeError(f"a and b must have the same dtype, got {a.dtype} and {b.dtype}")
    if str(a.dtype).startswith("torch.float8") and out_dtype is None:
        raise TypeError(f"{a.dtype} a and b need scale_a and scale_b (float32, 0-dim or [M, 1] "
                        "and 0-dim or [1, N]) and give out_dtype (bfloat16 by default): "
                        "fo.overlap(a, b, op, scale_a=..., scale_b=..., out_dtype=...)")
    dtype = dtype_name(a.dtype)
    result_name = check_out_dtype(dtype, out_dtype)
    if a.device != b.device:
        raise ValueError(f"a and b must be on the same device, got {a.device} and {b.device}")
    op_name = _op_name(op)
    if min(n, k) < 1 or m < (0 if op_name == "all_to_all" else 1):
        raise ValueError(f"M, N and K must all be >= 1 (M >= 0 for all_to_all: a rank may have "
                         f"no rows to send), got M={m}, N={n}, K={k}")
    group, rank, world = resolve_group(group)
    if op_name == "reduce_scatter" and m % world:
        raise ValueError(f"reduce_scatter needs M divisible by the world size: M={m}, W={world}")
    send, recv = _check_splits_use(op_name, world, m, send_splits, recv_splits)
    if plan is not None and not isinstance(plan, Plan):
        raise TypeError(f"plan must be a flashoverlap_core.Plan or None, got {type(plan).__name__}")
    rows = _output_rows(op_name, m, world, recv)
    if out is not None:
        _check_out(out, (rows, n) if rows is not None else None,
                   DTYPES[result_name or dtype], a.device, n)
    return dict(m=m, n=n, k=k, op=op_name, dtype=dtype, out_dtype=result_name, group=group,
                rank=rank, world_size=world, send=send, recv=recv, rows=rows)


def _spec_of(c: dict, a, b) -> OverlapSpec:
    return OverlapSpec(_result_rows(c["op"], c["m"], c["world_size"]), c["n"], c["k"], c["op"],
                       c["world_size"], c["dtype"], a.device.type, b_layout(b), c["send"],
                       c["out_dtype"])


def _call_of(c: dict, a, b, op, plan: Plan, out) -> OverlapCall:
    if out is None and c["rows"] is not None:
        out = torch.empty((c["rows"], c["n"]), dtype=plan.result_dtype, device=a.device)
    return OverlapCall(a, b, plan, op, c["group"], c["rank"], c["world_size"], out, c["recv"],
                       c.get("scale_a"), c.get("scale_b"))


def _plan_for(c: dict, spec: OverlapSpec, chosen: Backend, plan, op) -> Plan:
    """The plan the call runs with ``chosen``: ``plan`` checked against the call, else the
    tuned or default plan."""
    if plan is None:
        transfer = type(op).__name__ if c["op"] == CUSTOM_OP else ""
        return _default_plan(spec, chosen, c["group"], transfer)
    rows = (plan.m, plan.send_splits) if c["op"] == "all_to_all" else (spec.m, c["send"])
    wrong = plan.mismatches(m=rows[0], n=spec.n, k=spec.k, op=c["op"], world_size=c["world_size"],
                            dtype=c["dtype"], send_splits=rows[1],  # all_to_all: checked per call
                            out_dtype=c["out_dtype"])
    wrong += chosen.plan_reasons(plan)
    if wrong:
        raise ValueError("the plan does not fit this call: " + "; ".join(wrong))
    return plan


def _agree(c: dict, a, b, op, plan, out, recv_splits, backend) -> tuple[OverlapCall, Backend]:
    """The backend and plan of a new group key. At world size > 1 this is one small collective
    (two when the ranks' first choices differ): every rank sends the backends it can run the
    call on, its plan's digest, or why it cannot; the ranks take the first backend of rank 0's
    order that every rank can run, and must then run the same plan. Any rank's error (no
    backend, a plan that does not fit, plans that differ) is raised on every rank, naming the
    rank: a per-rank difference is an error, never a hang."""
    spec = _spec_of(c, a, b)
    world, group = c["world_size"], c["group"]
    plan_backend = plan.backend if plan is not None else None
    selection = spec
    if c["op"] == "all_to_all":
        # rows and splits are each call's own: the plan this settles (tile, order, number of
        # groups) comes from what every rank shares; each call then cuts it to its rows
        spec = selection = dataclasses.replace(
            spec, m=world, send_splits=(1,) * world if world > 1 else None)
        if world > 1 and registry.explicit_choice(backend, plan_backend) is None:
            # nor may the automatic choice follow this rank's own splits
            selection = dataclasses.replace(spec, send_splits=None)

    def attempt(names):
        """(fit names, plan, digest, error text) for this rank, choosing among ``names``."""
        try:
            able = registry.able(selection, backend, plan_backend)
            # this rank's own facts (its splits, say) may rule out more than the selection did
            fit = [x for x in able if not call_reasons(x, spec)
                   and (names is None or x.name in names)]
            if names is not None:
                fit.sort(key=lambda x: names.index(x.name))
            if not fit:
                why = "; ".join(f"{x.name}: {'; '.join(call_reasons(x, spec))}"
                                for x in able if call_reasons(x, spec))
                raise registry.BackendError(
                    f"no backend{' of ' + str(names) if names else ''} can run this call with "
                    f"this rank's arguments{': ' + why if why else ''}")
            chosen_plan = _plan_for(c, spec, fit[0], plan, op)
            return fit, chosen_plan, _plan_digest(chosen_plan), None
        except (TypeError, ValueError) as e:
            return [], None, None, e

    fit, chosen_plan, digest, error = attempt(None)
    if group is None or world == 1:
        if error is not None:
            raise error
        return _call_of(c, a, b, op, chosen_plan, out), fit[0]
    views = exchange_objects(([x.name for x in fit], digest, _error_text(error), a.shape[0],
                              _plan_summary(chosen_plan)), group)
    _raise_errors(views, error)
    common = [n for n in views[0][0] if all(n in v[0] for v in views)]
    if not common:
        raise registry.BackendError(
            "no backend can run this call on every rank of the group: "
            + "; ".join(f"rank {r} can run {v[0]}" for r, v in enumerate(views)))
    if any(v[0][0] != common[0] for v in views):  # some rank's first choice is not common
        fit, chosen_plan, digest, error = attempt([common[0]])
        views = exchange_objects(([x.name for x in fit], digest, _error_text(error), a.shape[0],
                                  _plan_summary(chosen_plan)), group)
        _raise_errors(views, error)
    _check_same_plan(c["op"], views)
    return _call_of(c, a, b, op, chosen_plan, out), fit[0]


def _error_text(error) -> str | None:
    return None if error is None else f"{type(error).__name__}: {error}"


def _raise_errors(views, error) -> None:
    failed = {r: v[2] for r, v in enumerate(views) if v[2] is not None}
    if not failed:
        return
    if error is not None:
        raise error
    raise ValueError("this call failed on other ranks of the group: "
                     + "; ".join(f"rank {r}: {text}" for r, text in failed.items()))


def _plan_digest(plan: Plan) -> str:
    fields = plan.to_dict()
    if plan.op == "all_to_all":  # each rank's rows, splits and groups are its own ...
        for own in ("M", "send_splits", "group_sizes"):
            fields.pop(own)
        if plan.grouping == "destinations":  # ... but not the number of groups
            fields["groups"] = plan.num_groups
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def _plan_summary(plan: Plan | None):
    return None if plan is None else (plan.describe_grid(), plan.group_sizes, plan.backend)


def _check_same_plan(op: str, views) -> None:
    """Every rank runs the same plan, and allgather's shards have the same rows everywhere
    (a tuning cache on one host only, say, would otherwise deadlock or corrupt the result)."""
    if op == GATHER_OP and len({v[3] for v in views}) > 1:
        rows = {r: v[3] for r, v in enumerate(views)}
        raise ValueError(f"allgather needs the same rows of a on every rank; the ranks have {rows}")
    differ = [r for r, v in enumerate(views) if v[1] != views[0][1]]
    if differ:
        first, other = views[0][4], views[differ[0]][4]
        raise ValueError(
            f"the ranks of the group do not run the same plan for this call: ranks {differ} differ "
            f"from rank 0 (rank 0: {first[0]}, groups {list(first[1])}, backend {first[2]}; rank "
            f"{differ[0]}: {other[0]}, groups {list(other[1])}, backend {other[2]}). Give every "
            "rank the same plan= or the same tuning cache (FLASHOVERLAP_TUNING_CACHE)")


# ---- plans ---------------------------------------------------------------------------------------

def make_plan(backend: Backend, spec: OverlapSpec, tile=None, group_sizes=None,
              wave_size=None, schedule=None, layout=None) -> Plan:
    """A plan for ``spec`` with ``backend``'s defaults for whatever is not given. ``layout``:
    None takes "rows" (groups of whole row bands, no post-reorder) wherever the backend runs it
    and the groups allow it, else "tiles"; "rows" or "tiles" asks for that one."""
    tile = tile if tile is not None else backend.default_tile(spec)
    if isinstance(tile, (str, bytes)) or not hasattr(tile, "__len__"):
        raise TypeError(f"tile must be a pair (BM, BN) of ints, got {tile!r}")
    if len(tile) != 2:
        raise ValueError(f"tile must be a pair (BM, BN), got {tile!r}")
    tile = (_check_int("tile BM", tile[0], 1), _check_int("tile BN", tile[1], 1))
    wave = _check_int("wave_size", wave_size if wave_size is not None else backend.wave_size(spec, tile), 1)
    if layout is not None and layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS} or None, got {layout!r}")
    rows_ok = "rows" in backend.layouts(spec) and layout != "tiles" and spec.op != GATHER_OP
    if layout == "rows" and not rows_ok and spec.op != GATHER_OP:
        raise ValueError(f"backend {backend.name!r} runs {spec.op} plans in layout 'tiles' only")
    sched = schedule if schedule is not None else backend.schedule(spec)
    rows = block_rows_for(spec.op, spec.m, spec.world_size, spec.send_splits)
    if group_sizes is None and spec.op == "all_to_all":  # the rule every rank computes alike
        chosen = "rows" if rows_ok else "tiles"
        if schedule is None and chosen == "rows":  # strips of 2 bands: small blocks still split
            sched = Schedule(sched.raster, min(sched.swizzle, 2))
        grid = TileGrid(rows, spec.n, tile[0], tile[1], sched)
        groups = all_to_all_groups(spec.world_size, grid.num_tiles)
        return _checked(backend, Plan(
            spec.m, spec.n, spec.k, spec.op, spec.world_size, spec.dtype, tile, wave,
            destination_group_sizes(grid, groups, chosen), sched, spec.send_splits, backend.name,
            grouping="destinations", out_dtype=spec.out_dtype, layout=chosen))
    if group_sizes is None:
        if rows_ok and schedule is None:
            sched = _strips_for_groups(sched, rows, spec.n, tile, wave)
        total = TileGrid(rows, spec.n, tile[0], tile[1], sched).num_tiles
        itemsize = torch.empty((), dtype=moved_dtype(spec.op, spec.dtype, spec.out_dtype)).element_size()
        group_sizes = wave_group_sizes(
            total, wave, unit=group_unit(spec.op, spec.world_size, spec.n, tile,
                                         "rows" if rows_ok else "tiles", sched),
            bytes_per_tile=transfer_bytes_per_tile(spec.op, spec.n, spec.k, tile, itemsize))
    elif isinstance(group_sizes, (str, bytes)) or not hasattr(group_sizes, "__iter__"):
        raise TypeError(f"group_sizes must be a sequence of ints, got {type(group_sizes).__name__}")
    plan = Plan(spec.m, spec.n, spec.k, spec.op, spec.world_size, spec.dtype, tile, wave,
                tuple(group_sizes), sched, spec.send_splits, backend.name, out_dtype=spec.out_dtype,
                layout=layout if layout == "rows" else None)
    # Groups of whole bands need no post-reorder. Not an all_to_all's own group sizes, which
    # differ between ranks: its layout must be the same on every rank (what a rank receives
    # is laid out by its sender's), so it takes "rows" only when asked.
    if rows_ok and plan.layout == "tiles" and plan.row_parts is not None and spec.op != "all_to_all":
        plan = dataclasses.replace(plan, layout="rows")
    return _checked(backend, plan)


def _strips_for_groups(sched: Schedule, block_rows, n: int, tile, wave: int) -> Schedule:
    """``sched`` with its swizzle halved (down to 2) until every block has a strip of bands
    for each of the groups the default grouping makes (a "rows" plan's groups are whole
    strips)."""
    bands = -(-min(block_rows) // tile[0])
    waves = -(-len(block_rows) * bands * -(-n // tile[1]) // wave)
    swizzle, want = sched.swizzle, min(MAX_GROUPS, waves)
    while swizzle > 2 and -(-bands // swizzle) < want:
        swizzle //= 2
    return sched if swizzle == sched.swizzle else Schedule(sched.raster, swizzle)


def _checked(backend: Backend, plan: Plan) -> Plan:
    reasons = backend.plan_reasons(plan)
    if reasons:
        raise ValueError(f"backend {backend.name!r} cannot run this plan: " + "; ".join(reasons))
    return plan


def _default_plan(spec: OverlapSpec, backend: Backend, group=None, transfer: str = "") -> Plan:
    """The tuned plan from the installed plan lookup when it has one, else the heuristic plan.
    Every rank must see the same tuned plans: the first call checks that they agree."""
    tuned = _plan_lookup(spec, backend, group, transfer) if _plan_lookup is not None else None
    return tuned if tuned is not None else make_plan(backend, spec)


def plan(m: int, n: int, k: int, op: str = "allreduce", world_size: int = 1,
         dtype=torch.bfloat16, tile=None, group_sizes=None, backend: str | None = None, *,
         send_splits=None, wave_size: int | None = None, schedule: Schedule | None = None,
         b_layout: str = "col", out_dtype=None, layout: str | None = None) -> Plan:
    """Build an inspectable plan (``describe()``, ``to_json()``) to pass to :func:`overlap`.

    ``backend`` defaults to the one :func:`overlap` would run the call on, for tensors on the
    default device (the most preferred available accelerator's, else the CPU): the explicit
    choice in ``FLASHOVERLAP_BACKEND``, else the automatic choice for that device type and this
    call. Its kernel decides the default tile, wave size and tile order. A plan names its
    backend, and a call given the plan runs on that backend. ``send_splits`` (rows per
    destination) is required for an ``all_to_all`` plan at world size > 1. For ``allgather``,
    ``m`` is the rows of the result (world size x the rows of each rank's ``a``). fp8:
    ``dtype=torch.float8_e4m3fn`` with the result's ``out_dtype`` (bfloat16 by default, or
    float16). ``layout``: "rows" (groups of whole row bands, written and received in their
    final rows: no post-reorder), "tiles" (any group sizes, a post-reorder after the
    collective), or None: "rows" wherever the backend runs it and ``group_sizes`` are whole
    bands, else "tiles".
    """
    for name, value in (("M", m), ("N", n), ("K", k), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if op not in PLAN_OPS:
        raise ValueError(f"op must be one of {OPS}, or {CUSTOM_OP!r} for a plan of a callable op, "
                         f"got {op!r}")
    if op in ("reduce_scatter", GATHER_OP) and m % world_size:
        raise ValueError(f"{op} needs M divisible by the world size: M={m}, W={world_size}")
    send, _ = _check_splits_use(op, world_size, m, send_splits, None)
    chosen = registry.get(backend) if backend is not None else None
    device_type = (chosen or registry.default_backend()).device_type or "cpu"
    name = dtype_name(dtype)
    spec = OverlapSpec(m, n, k, op, world_size, name, device_type, b_layout, send,
                       check_out_dtype(name, out_dtype))
    if chosen is None:  # overlap's choice; an all_to_all chooses from what every rank shares
        chosen = registry.select(dataclasses.replace(spec, m=world_size, send_splits=None)
                                 if op == "all_to_all" else spec)
    reasons = call_reasons(chosen, spec)
    if reasons:
        raise ValueError(f"backend {chosen.name!r} cannot run this call: " + "; ".join(reasons))
    return make_plan(chosen, spec, tile, group_sizes, wave_size, schedule, layout)


def backends() -> list[registry.BackendStatus]:
    """Every known backend with whether it is available here and, if not, why (probed
    afresh)."""
    return registry.backends()


def prepared_calls() -> list[dict]:
    """What each prepared call key runs, oldest first: ``op``, the shapes of ``a`` and ``b``
    (this rank's), ``b_layout``, ``dtype`` (of a and b), ``out_dtype`` (an fp8 call's result,
    else None), ``device``, the plan's ``M``, ``N``, ``K`` and ``world_size`` (all_to_all's
    rows are each call's own: its ``a`` is ``["per call", K]`` and its ``M`` ``"per call"``),
    the ``backend`` that runs it, the plan's ``strategy`` (a "sequential" plan runs the
    device's matmul and torch.distributed, whatever backend made it), ``groups`` and
    ``layout``, ``workspace_bytes`` (device memory the call keeps beyond its outputs), and
    ``runner``, the type name of the prepared call. Read from the call path's table, which
    keeps the last :data:`MAX_PREPARED` keys since :func:`forget_prepared`."""
    from types import SimpleNamespace

    found = []
    for key, entry in list(_prepared.items()):  # a copy: another thread may prepare meanwhile
        a_shape, b_shape, _, b_strides = key[:4]
        p, runner = entry.plan, entry.prepared
        ran_by = getattr(runner, "backend", None)
        # b_layout reads only shape and stride(dim): the key's own, without making a tensor
        b_view = SimpleNamespace(shape=b_shape, stride=b_strides.__getitem__)
        found.append({
            "op": p.op, "a": list(a_shape), "b": list(b_shape),
            "b_layout": b_layout(b_view), "dtype": p.dtype, "out_dtype": p.out_dtype,
            "device": str(entry.device), "M": ROWS_PER_CALL if p.op == "all_to_all" else p.m,
            "N": p.n, "K": p.k,
            "world_size": p.world_size,
            "backend": ran_by.name if isinstance(ran_by, Backend) else p.backend,
            "strategy": p.strategy, "groups": p.num_groups, "layout": p.layout,
            "workspace_bytes": runner.workspace_bytes() if hasattr(runner, "workspace_bytes") else 0,
            "runner": type(runner).__name__})
    return found


__all__ = ["PreparedCall", "backends", "check_arguments", "forget_prepared", "keyed_table",
           "make_plan", "overlap", "overlap_scaled", "plan", "prepared_call", "prepared_calls",
           "remember", "set_plan_lookup"]
