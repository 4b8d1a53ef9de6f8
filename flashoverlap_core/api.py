"""Public entry points: ``overlap``, ``plan`` and ``backends``, and the call path's key table.

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

The pieces of a first call have homes of their own: the argument checks in
:mod:`~flashoverlap_core.checks`, plan building in :mod:`~flashoverlap_core.planning`, and the
ranks' agreement on backend and plan in :mod:`~flashoverlap_core.agreement`. This module keeps
the keys (:func:`call_key`, :func:`group_key`), the table of prepared calls and the dispatch.

Environment variables read when a key is first prepared, not on every call:
``FLASHOVERLAP_BACKEND`` (backend choice) and those of the plan lookup (the tuning cache);
``WORLD_SIZE`` once per process, at the first call (a launcher's ranks that never joined a
process group are warned).
"""
from __future__ import annotations

import importlib
import math
import os
import threading
import warnings
from typing import Callable

import torch

from . import faults, fp8, planning, registry
from .agreement import agree, tell_agreeing_peers
from .all_to_all import AllToAllCall
from .backend import Backend, OverlapCall, PreparedCall, b_layout, call_reasons
from .checks import call_of, check_arguments, check_tensor, span_bytes, spec_of
from .collectives import SequentialCall, current_default_group
from .ops import of
from .plan import Plan
from .planning import PlanLookup, make_plan, plan


def set_plan_lookup(lookup: PlanLookup | None) -> None:
    """Where calls without ``plan=`` look for a tuned plan first: ``lookup(spec, backend,
    group, transfer)`` returns a Plan or None (then the backend's heuristic plan is used).
    The tuning layer installs its cache here; None turns tuned plans off."""
    planning.set_lookup(lookup)
    forget_prepared()


# ---- the call ------------------------------------------------------------------------------------

class _Prepared:
    """One key's prepared call: the backend's PreparedCall and what a later call checks."""

    __slots__ = ("prepared", "plan", "out_shape", "dtype", "device", "strategy", "run_new",
                 "out_bytes", "spans")

    def __init__(self, prepared, plan, out_shape, dtype, device, strategy, a, b):
        # A plain tuple: torch.empty parses it faster than a torch.Size (about a microsecond).
        out_shape = tuple(out_shape) if out_shape is not None else None
        self.prepared, self.plan, self.out_shape = prepared, plan, out_shape
        self.dtype, self.device = dtype, device
        # what a later call's out is checked against: its bytes, and the bytes a's and b's
        # elements span from their first (the key fixes their shapes, strides and dtypes)
        self.out_bytes = math.prod(out_shape) * dtype.itemsize if out_shape is not None else 0
        self.spans = (span_bytes(a), span_bytes(b))
        self.strategy = strategy  # how a default plan's strategy was chosen (None: given/tuned)
        # A call without out whose runner makes the result itself (the plain path: the GEMM
        # allocates it, one dispatch fewer than torch.empty + an out= GEMM), else None.
        self.run_new = (prepared.run_new if isinstance(prepared, SequentialCall)
                        and prepared.makes_result(dtype) else None)

    def fits(self, out, a, b) -> bool:
        """Whether a later call's ``out`` (None or a tensor) can go straight to launch: its
        shape, dtype, device and layout, and its bytes apart from a's and b's spans (else the
        full checks decide: :func:`checks.check_out_apart`)."""
        if out is None:
            return True
        if not (isinstance(out, torch.Tensor) and out.shape == self.out_shape
                and out.dtype == self.dtype and out.device == self.device
                and out.is_contiguous()):
            return False
        lo = out.data_ptr()
        hi = lo + self.out_bytes
        span_a, span_b = self.spans
        first = a.data_ptr()
        if first < hi and lo < first + span_a:
            return False
        first = b.data_ptr()
        return not (first < hi and lo < first + span_b)

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
    it again; at world size > 1 that is collective: call it on every rank), and forget every
    failed group (the recovery after a CommunicationError, once the process group is made anew:
    docs/design.md, "Failure model")."""
    with _prepare_lock:
        _prepared.clear()
        _settled.clear()
        for table in _keyed_tables:
            table.clear()
    faults.forget()


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


# ---- the keys -------------------------------------------------------------------------------------

def call_key(a, b, kind, group, plan, backend, send_splits=None, recv_splits=None,
             more: tuple = ()) -> tuple:
    """The key of a call: what fixes its preparation. a's and b's shapes, strides, dtypes and
    device, the op's ``kind`` (its name, or a callable's type), the process group (the default
    group when None), the plan object, the backend asked for and the splits; then ``more``
    (:func:`tensor_facts` of a call's other tensors, an fp8 call's out dtype; an fp8
    all_to_all's: :func:`fp8_all_to_all_facts`). all_to_all's rows and splits are each call's
    own: not in its key (:data:`ROWS_PER_CALL`)."""
    group = group if group is not None else current_default_group()
    if kind == "all_to_all":
        key = ((ROWS_PER_CALL, a.shape[1]), b.shape, a.stride()[1:], b.stride(), a.dtype,
               b.dtype, a.device, kind, group, id(plan), backend, None, None)
    else:
        key = (a.shape, b.shape, a.stride(), b.stride(), a.dtype, b.dtype, a.device, kind,
               group, id(plan), backend, _splits_key(send_splits), _splits_key(recv_splits))
    return key + more if more else key


def tensor_facts(*tensors) -> tuple:
    """The shape, strides, dtype and device of each tensor, for :func:`call_key`'s ``more``."""
    return tuple(fact for t in tensors for fact in (t.shape, t.stride(), t.dtype, t.device))


def group_key(key: tuple, plan, out_dtype: str | None, scaling: str | None = None) -> tuple:
    """The part of a call's ``key`` that every rank of its group shares: the op's kind, the
    group, M, N, K, dtype (and an fp8 call's ``out_dtype`` and ``scaling`` kind), device type,
    the ``plan`` and the backend asked for; not this rank's strides (the layout of its b or of
    its scales) or device index.
    all_to_all's key holds nothing of a rank's own: it is its own group key."""
    a_shape, b_shape, _, _, dtype, _, device, kind, group, _, backend = key[:11]
    if kind == "all_to_all":
        return key
    return (kind, group, a_shape[0], b_shape[1], a_shape[1], dtype, out_dtype, scaling,
            device.type, plan, backend)


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
        if faults.failures:  # a failed group raises at once (docs/design.md, "Failure model")
            faults.check(group, op)
        kind = op if op.__class__ is str else type(op)
        key = call_key(a, b, kind, group, plan, backend, send_splits, recv_splits)
        entry = _prepared.get(key)
        try:
            if entry is not None:
                if out is None and entry.out_shape is not None:  # the common call: a new result
                    if entry.run_new is not None:
                        return entry.run_new(a, b, op)
                    out = torch.empty(entry.out_shape, dtype=entry.dtype, device=entry.device)
                    return entry.prepared.run(a, b, out, op)
                if kind == "all_to_all":  # each call's rows and splits (out_shape is None)
                    return entry.prepared.run(a, b, out, op, send_splits, recv_splits)
                if entry.fits(out, a, b):
                    return entry.run(a, b, out, op)
            return _first_call(key, a, b, op, group, plan, out, send_splits, recv_splits, backend)
        except RuntimeError as e:  # communication that failed: the group's CommunicationError
            failure = faults.raised(e, group, op)
            if failure is None:
                raise
            raise failure from e
    a, a_type = _from_dlpack(a)
    b, _ = _from_dlpack(b)
    if out is not None:
        out, _ = _from_dlpack(out)
    check_tensor("a", a)  # neither a tensor nor a DLPack array: say so
    check_tensor("b", b)
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


def prepared_call(a, b, op: str, group=None, plan: Plan | None = None, backend: str | None = None):
    """What ``overlap(a, b, op, group, plan=plan, backend=backend)`` runs (op allreduce or
    reduce_scatter): its key's prepared call, a :class:`PreparedCall` or alike, prepared on the
    key's first use (every argument checked, collective at world size > 1) and not run. For
    ops built on an overlapped call (``overlap_add_rmsnorm``: ``run_add_rmsnorm``)."""
    if faults.failures:
        faults.check(group, op)
    key = call_key(a, b, op, group, plan, backend)
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
    call; all_to_all too, each call with its own rows, splits and scales (its key holds the
    scales' kind and the result dtype: :func:`fp8_all_to_all_facts`), and allgather, whose
    scale_a is this rank's (of its shard's rows; the backend gathers it with them). The call
    path is :func:`overlap`'s: a key's first call checks and prepares."""
    out_dtype = fp8.DEFAULT_OUT_DTYPE if out_dtype is None else out_dtype
    kind = op if op.__class__ is str else type(op)
    tensors = all(isinstance(t, torch.Tensor) for t in (a, b, scale_a, scale_b))
    if faults.failures:
        faults.check(group, op)
    key = None
    try:
        if tensors and kind != "all_to_all":
            # overlap's key, then the scales' layout and the result's dtype
            key = call_key(a, b, kind, group, plan, backend, send_splits, recv_splits,
                           tensor_facts(scale_a, scale_b) + (out_dtype,))
            entry = _prepared.get(key)
            if entry is not None and entry.fits(out, a, b):
                if entry.device.type == "cpu":  # host scales: their read needs no sync
                    fp8.check_finite(scale_a, scale_b)
                return entry.run_scaled(a, b, scale_a, scale_b, out, op)
        elif tensors and a.dim() == 2 and b.dim() == 2:  # all_to_all: nothing of its rows
            key = call_key(a, b, kind, group, plan, backend,
                           more=fp8_all_to_all_facts(a, b, scale_a, scale_b) + (out_dtype,))
            entry = _prepared.get(key)
            if entry is not None:  # each call's rows, splits, scales and out checked there
                return entry.prepared.run_scaled(a, b, scale_a, scale_b, out, op, send_splits,
                                                 recv_splits)
        try:
            _, scaling = fp8.check_call(a, b, scale_a, scale_b, out_dtype)
        except (TypeError, ValueError) as e:
            if kind == "all_to_all":  # a first call: the peers are in its agreement
                tell_agreeing_peers(group, e)
            raise
        return _first_call(key, a, b, op, group, plan, out, send_splits, recv_splits, backend,
                           (scale_a, scale_b, out_dtype, scaling))
    except RuntimeError as e:
        failure = faults.raised(e, group, op)
        if failure is None:
            raise
        raise failure from e


def fp8_all_to_all_facts(a, b, scale_a, scale_b) -> tuple:
    """What an fp8 all_to_all key holds of its scales: what every rank shares and no call's
    rows (a row-wise or block-wise scale_a has each call's own): their kind (fp8.scaling_kind,
    of scale_a's own rows; each call checks them against a's: AllToAllCall) and which of them
    is per row or column (their dims)."""
    rows = scale_a.shape[0] if scale_a.dim() == 2 else a.shape[0]
    return (fp8.scaling_kind(rows, b.shape[1], a.shape[1], scale_a, scale_b), scale_a.dim(),
            scale_b.dim())


def _first_call(key, a, b, op, group, plan, out, send_splits, recv_splits, backend, scales=None):
    """Check everything, prepare the key if it is new (:func:`_prepare`), and run the call.
    ``scales``: an fp8 call's (scale_a, scale_b, out_dtype, scaling kind), checked
    (:func:`overlap_scaled`)."""
    entry, call = _prepare(key, a, b, op, group, plan, out, send_splits, recv_splits, backend,
                           scales)
    if call is None:  # all_to_all: each call is laid out from its own splits
        if scales:
            return entry.prepared.run_scaled(a, b, scales[0], scales[1], out, op, send_splits,
                                             recv_splits)
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
    call is collective at world size > 1 (:func:`agreement.agree`); a new local key under a settled
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
            tell_agreeing_peers(group, e)
        raise
    if scales:
        c["scale_a"], c["scale_b"] = scales[:2]
        c["scaling"] = scales[3]
    a2a = of(c["op"]).splits  # rows and splits are each call's own
    gkey = group_key(key, plan, c["out_dtype"], c.get("scaling"))
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
                faults.check(c["group"], op)  # a backend's watchdog may have failed the group
                call, chosen, facts = agree(c, a, b, op, plan, out, recv_splits, backend)
                _settled[gkey] = (chosen, call.plan, facts)
                while len(_settled) > MAX_PREPARED:
                    _settled.pop(next(iter(_settled)))
            else:
                chosen, agreed, facts = settled
                spec = spec_of(c, a, b)
                reasons = call_reasons(chosen, spec) + chosen.plan_reasons(agreed)
                if reasons:  # a fact of this rank's own (b's layout, say) the choice cannot take
                    raise ValueError(f"backend {chosen.name!r}, which the ranks agreed on for this "
                                     f"call, cannot run it with this rank's arguments: "
                                     + "; ".join(reasons))
                call = call_of(c, a, b, op, agreed, out)
            prepared = (AllToAllCall(chosen, call, _plain_collectives(chosen, call)
                                     if call.plan.strategy == "sequential" else None)
                        if a2a else _make_prepared(chosen, call))
            shape = call.out.shape if call.out is not None and not a2a else None
            entry = _Prepared(prepared, call.plan, shape, call.plan.result_dtype, a.device,
                              facts, a, b)
            _prepared[key] = entry
            while len(_prepared) > MAX_PREPARED:
                _prepared.pop(next(iter(_prepared)))
        elif not a2a:  # prepared meanwhile by another thread: this call's out still needs its checks
            call = call_of(c, a, b, op, entry.plan, out)
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
    runs ``torch._scaled_mm`` there (dequantized where the device lacks it), and dequantized on a
    backend without native fp8."""
    if call.scale_a is not None and call.plan.strategy == "sequential":
        native = _plain_collectives(chosen, call)
        if fp8.ScaledSequentialCall.available(call):
            return fp8.ScaledSequentialCall(call, native)
        return fp8.DequantizedCall(SequentialCall(fp8.dequantized_call(call), native=native))
    if call.scale_a is not None and not chosen.native_fp8:
        return fp8.DequantizedCall(_make_prepared(chosen, fp8.dequantized_call(call)))
    if call.plan.strategy == "sequential":
        return SequentialCall(call, chosen.add_rmsnorm_rows, _plain_collectives(chosen, call))
    return chosen.prepare(call)


def _plain_collectives(chosen: Backend, call: OverlapCall):
    """The backend's own collectives for the plain path (None: torch.distributed's); never
    made while the caller captures a graph (making them may take a collective of its own)."""
    if call.group is None or call.world_size == 1 or _capturing(call.a.device):
        return None  # (at world size 1 the plain path issues no collective)
    return chosen.plain_collectives(call)


_settled: dict = {}  # group key -> (backend, plan, strategy facts) the ranks agreed on


def _capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device``'s type is being captured into a graph."""
    module = getattr(torch, device.type, None)
    check = getattr(module, "is_current_stream_capturing", None)
    return bool(check is not None and check())


def backends() -> list[registry.BackendStatus]:
    """Every known backend with whether it is available here and, if not, why (probed
    afresh)."""
    return registry.backends()


def prepared_calls() -> list[dict]:
    """What each prepared call key runs, oldest first: ``op``, the shapes of ``a`` and ``b``
    (this rank's), ``b_layout``, ``dtype`` (of a and b), ``out_dtype`` (an fp8 call's result,
    else None), ``scaling`` ("blockwise" for block-wise fp8 scales, else None), ``device``,
    the plan's ``M``, ``N``, ``K`` and ``world_size`` (all_to_all's rows are each call's own:
    its ``a`` is ``["per call", K]`` and its ``M`` ``"per call"``),
    the ``backend`` that runs it, the plan's ``strategy`` (a "sequential" plan runs the
    device's matmul and torch.distributed, whatever backend made it) with
    ``strategy_reason``, ``predicted_overlap_s`` and ``predicted_plain_s`` (how a default
    plan's strategy was chosen: both predictions, None where none was needed), ``groups`` and
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
            "scaling": p.scaling,
            "device": str(entry.device), "M": ROWS_PER_CALL if p.kind.splits else p.m,
            "N": p.n, "K": p.k,
            "world_size": p.world_size,
            "backend": ran_by.name if isinstance(ran_by, Backend) else p.backend,
            "strategy": p.strategy, **_strategy_facts(entry.strategy),
            "groups": p.num_groups, "layout": p.layout,
            "workspace_bytes": runner.workspace_bytes() if hasattr(runner, "workspace_bytes") else 0,
            "runner": type(runner).__name__})
    return found


def _strategy_facts(facts: dict | None) -> dict:
    """prepared_calls' columns on the strategy choice: why, and both predicted durations."""
    facts = facts or {}
    return {"strategy_reason": facts.get("reason", "the plan's own (given or tuned)"),
            "predicted_overlap_s": facts.get("overlap_s"),
            "predicted_plain_s": facts.get("plain_s")}


__all__ = ["PreparedCall", "backends", "check_arguments", "forget_prepared", "keyed_table",
           "make_plan", "overlap", "overlap_scaled", "plan", "prepared_call", "prepared_calls",
           "remember", "set_plan_lookup"]
