"""Plan building: the plan a call runs with, made from a backend's defaults or looked up.

:func:`plan` is the public ``fo.plan`` (an inspectable plan to pass to ``overlap``);
:func:`make_plan` makes a backend's plan for a spec, with whatever is not given taken from the
backend (tile, wave size, tile order) and the default grouping; :func:`plan_for` is the plan a
call's first use runs with: the one given, checked against the call, else the tuned plan of the
installed lookup (:func:`set_lookup`: the tuning cache), else the backend's default.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Protocol

import torch

from . import registry
from .backend import Backend, OverlapSpec, call_reasons
from .checks import check_splits_use
from .grouping import MAX_GROUPS, wave_group_sizes
from .ops import CUSTOM_OP, OPS, PLAN_OPS, of
from .plan import (LAYOUTS, Plan, _check_int, all_to_all_groups, check_out_dtype, check_scaling,
                   destination_group_sizes, dtype_name, group_unit, moved_dtype,
                   transfer_bytes_per_tile)
from .tiles import Schedule, TileGrid

PlanLookup = Callable[[OverlapSpec, Backend, object, str], "Plan | None"]
_plan_lookup: PlanLookup | None = None


def set_lookup(lookup: PlanLookup | None) -> None:
    """Where calls without ``plan=`` look for a tuned plan first (``api.set_plan_lookup``,
    which also drops the prepared calls)."""
    global _plan_lookup
    _plan_lookup = lookup


class StrategyChoice(Protocol):
    """How a default plan's strategy (overlap or the plain path) is chosen; the tuning layer
    installs one (:func:`set_strategy`, ``tuning.strategy``) without the API importing it."""

    def mode(self, plan: Plan) -> str:
        """What this rank would do, the same on every rank that decides alike: a fixed strategy
        ("overlap", "sequential"), or "predict" (collective over the group at its first call)."""

    def decide(self, plan: Plan, backend: Backend, group, device,
               predict_on: Plan | None = None) -> tuple[Plan, dict]:
        """``plan`` with its strategy, and what ``fo.prepared_calls()`` shows about the choice;
        ``predict_on``: the plan whose times are predicted instead (all_to_all: its key's plan
        holds no rows, so the plan of the ranks' mean rows, evenly split)."""


_strategy: StrategyChoice | None = None


def set_strategy(choice: StrategyChoice | None) -> None:
    """How default plans choose between overlap and the plain path (None: always overlap)."""
    global _strategy
    _strategy = choice


def strategy_mode(plan: Plan, source: str) -> str | None:
    """The strategy mode of a plan from ``source`` ("given", "tuned", "default"): None when its
    strategy stands as it is (a given or tuned plan, or no choice installed)."""
    if source != "default" or _strategy is None:
        return None
    return _strategy.mode(plan)


def decide_strategy(plan: Plan, backend: Backend, group, device,
                    predict_on: Plan | None = None) -> tuple[Plan, dict]:
    """A default plan with the installed choice's strategy, and the choice's facts
    (``predict_on``: see :meth:`StrategyChoice.decide`)."""
    return _strategy.decide(plan, backend, group, device, predict_on)


def plan_for(c: dict, spec: OverlapSpec, chosen: Backend, plan, op) -> Plan:
    """The plan a checked call (``c``: what ``check_arguments`` found) runs with ``chosen``:
    ``plan`` checked against the call, else the tuned or default plan."""
    return plan_and_source(c, spec, chosen, plan, op)[0]


def plan_and_source(c: dict, spec: OverlapSpec, chosen: Backend, plan, op) -> tuple[Plan, str]:
    """:func:`plan_for`, and where the plan came from: "given" (``plan=``), "tuned" (the
    installed lookup) or "default" (the backend's heuristic; its strategy is still to choose)."""
    if plan is None:
        transfer = type(op).__name__ if c["op"] == CUSTOM_OP else ""
        tuned = (_plan_lookup(spec, chosen, c["group"], transfer) if _plan_lookup is not None
                 else None)
        if tuned is not None:
            return tuned, "tuned"
        return make_plan(chosen, spec), "default"
    rows = (plan.m, plan.send_splits) if of(c["op"]).splits else (spec.m, c["send"])
    wrong = plan.mismatches(m=rows[0], n=spec.n, k=spec.k, op=c["op"], world_size=c["world_size"],
                            dtype=c["dtype"], send_splits=rows[1],  # all_to_all: checked per call
                            out_dtype=c["out_dtype"], scaling=c.get("scaling"))
    wrong += chosen.plan_reasons(plan)
    if wrong:
        raise ValueError("the plan does not fit this call: " + "; ".join(wrong))
    return plan, "given"


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
    kind = of(spec.op)
    rows_ok = "rows" in backend.layouts(spec) and layout != "tiles" and not kind.gathers
    if layout == "rows" and not rows_ok and not kind.gathers:
        raise ValueError(f"backend {backend.name!r} runs {spec.op} plans in layout 'tiles' only")
    sched = schedule if schedule is not None else backend.schedule(spec, tile)
    rows = kind.block_rows(spec.m, spec.world_size, spec.send_splits)
    if group_sizes is None and kind.splits:  # the rule every rank computes alike
        # "rows" strips are whole bands in raster "n" only (Plan checks a "rows" one)
        chosen = "rows" if rows_ok and (layout == "rows" or sched.raster == "n") else "tiles"
        if schedule is None and chosen == "rows":  # strips of 2 bands: small blocks still split
            sched = Schedule(sched.raster, min(sched.swizzle, 2))
        grid = TileGrid(rows, spec.n, tile[0], tile[1], sched)
        groups = all_to_all_groups(spec.world_size, grid.num_tiles)
        return _checked(backend, Plan(
            spec.m, spec.n, spec.k, spec.op, spec.world_size, spec.dtype, tile, wave,
            destination_group_sizes(grid, groups, chosen), sched, spec.send_splits, backend.name,
            grouping="destinations", out_dtype=spec.out_dtype, layout=chosen,
            scaling=spec.scaling if spec.scaling == "blockwise" else None))
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
                layout=layout if layout == "rows" else None,
                scaling=spec.scaling if spec.scaling == "blockwise" else None)
    # Groups of whole bands need no post-reorder. Not an all_to_all's own group sizes, which
    # differ between ranks: its layout must be the same on every rank (what a rank receives
    # is laid out by its sender's), so it takes "rows" only when asked.
    if rows_ok and plan.layout == "tiles" and plan.row_parts is not None and not kind.splits:
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


def plan(m: int, n: int, k: int, op: str = "allreduce", world_size: int = 1,
         dtype=torch.bfloat16, tile=None, group_sizes=None, backend: str | None = None, *,
         send_splits=None, wave_size: int | None = None, schedule: Schedule | None = None,
         b_layout: str = "col", out_dtype=None, layout: str | None = None,
         scaling: str | None = None) -> Plan:
    """Build an inspectable plan (``describe()``, ``to_json()``) to pass to ``overlap``.

    ``backend`` defaults to the one ``overlap`` would run the call on, for tensors on the
    default device (the most preferred available accelerator's, else the CPU): the explicit
    choice in ``FLASHOVERLAP_BACKEND``, else the automatic choice for that device type and this
    call. Its kernel decides the default tile, wave size and tile order. A plan names its
    backend, and a call given the plan runs on that backend. ``send_splits`` (rows per
    destination) is required for an ``all_to_all`` plan at world size > 1. For ``allgather``,
    ``m`` is the rows of the result (world size x the rows of each rank's ``a``). fp8:
    ``dtype=torch.float8_e4m3fn`` with the result's ``out_dtype`` (bfloat16 by default, or
    float16) and the scales' ``scaling`` kind: "tensorwise", "rowwise" (these two share plans)
    or "blockwise" (1x128 groups of a along K and 128x128 blocks of b; its own kernels, so its
    own plans; None: tensor-wise or row-wise). ``layout``: "rows" (groups of whole row bands, written and received in their
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
    if of(op).blocks == "ranks" and m % world_size:
        raise ValueError(f"{op} needs M divisible by the world size: M={m}, W={world_size}")
    send, _ = check_splits_use(op, world_size, m, send_splits, None)
    chosen = registry.get(backend) if backend is not None else None
    device_type = (chosen or registry.default_backend()).device_type or "cpu"
    name = dtype_name(dtype)
    spec = OverlapSpec(m, n, k, op, world_size, name, device_type, b_layout, send,
                       check_out_dtype(name, out_dtype), check_scaling(name, scaling),
                       rows_hint=m if of(op).splits else None)  # all_to_all: the tile's rows
    if chosen is None:  # overlap's choice; an all_to_all chooses from what every rank shares
        chosen = registry.select(dataclasses.replace(spec, m=world_size, send_splits=None)
                                 if of(op).splits else spec)
    reasons = call_reasons(chosen, spec)
    if reasons:
        raise ValueError(f"backend {chosen.name!r} cannot run this call: " + "; ".join(reasons))
    return make_plan(chosen, spec, tile, group_sizes, wave_size, schedule, layout)
