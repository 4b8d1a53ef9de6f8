"""Rank agreement: the backend and plan of a new group key, the same on every rank.

What decides which collectives a call issues (its backend and plan) must come out the same on
every rank of the group. :func:`agree` settles it on a group key's first call: at world size >
1 in one small exchange (two when the ranks' first choices differ), in which every rank sends
the backends it can run the call on, its plan's digest, or why it cannot. A per-rank
difference (no backend, a plan that does not fit, plans that differ, allgather shards of
different rows) is raised on every rank, naming the rank: an error, never a hang.
:func:`tell_agreeing_peers` is how a rank whose own arguments were invalid still takes part.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json

from . import registry
from .backend import Backend, OverlapCall, call_reasons
from .checks import call_of, spec_of
from .collectives import exchange_objects, resolve_group
from .grouping import equal_splits
from .ops import of
from .plan import Plan
from .planning import decide_strategy, make_plan, plan_and_source, strategy_mode


def agree(c: dict, a, b, op, plan, out, recv_splits, backend
          ) -> tuple[OverlapCall, Backend, dict | None]:
    """The backend and plan of a new group key. At world size > 1 this is one small collective
    (two when the ranks' first choices differ): every rank sends the backends it can run the
    call on, its plan's digest, or why it cannot; the ranks take the first backend of rank 0's
    order that every rank can run, and must then run the same plan. Any rank's error (no
    backend, a plan that does not fit, plans that differ) is raised on every rank, naming the
    rank: a per-rank difference is an error, never a hang.

    A default plan's strategy (overlap or the plain path) is chosen after the exchange, from
    what every rank then knows alike (:func:`planning.decide_strategy`): each rank sends how it
    would choose, and ranks that would choose differently (another ``FLASHOVERLAP_STRATEGY``,
    say) are an error too. Returns the call, the backend and the choice's facts (None when the
    plan was given or tuned)."""
    spec = spec_of(c, a, b)
    world, group = c["world_size"], c["group"]
    plan_backend = plan.backend if plan is not None else None
    selection = spec
    splits = of(c["op"]).splits
    if splits:
        # rows and splits are each call's own: the plan this settles (tile, order, number of
        # groups) comes from what every rank shares; each call then cuts it to its rows. Alone,
        # a rank's own rows are what its calls are expected to have (the tile rule's hint);
        # in a group the hint is the ranks' mean, known after the first exchange below
        spec = selection = dataclasses.replace(
            spec, m=world, send_splits=(1,) * world if world > 1 else None,
            rows_hint=a.shape[0] if group is None or world == 1 else None)
        if world > 1 and registry.explicit_choice(backend, plan_backend) is None:
            # nor may the automatic choice follow this rank's own splits
            selection = dataclasses.replace(spec, send_splits=None)

    def attempt(names, spec=spec):
        """(fit names, plan, digest, error text, strategy mode) for this rank, choosing among
        ``names``."""
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
            chosen_plan, source = plan_and_source(c, spec, fit[0], plan, op)
            mode = strategy_mode(chosen_plan, source)
            return fit, chosen_plan, _plan_digest(chosen_plan), None, mode
        except (TypeError, ValueError) as e:
            return [], None, None, e, None

    fit, chosen_plan, digest, error, mode = attempt(None)
    if group is None or world == 1:
        if error is not None:
            raise error
        return _decided(c, a, b, op, chosen_plan, out, fit[0], mode, group)
    views = exchange_objects(([x.name for x in fit], digest, _error_text(error), a.shape[0],
                              _plan_summary(chosen_plan), mode), group)
    _raise_errors(views, error)
    common = [n for n in views[0][0] if all(n in v[0] for v in views)]
    if not common:
        raise registry.BackendError(
            "no backend can run this call on every rank of the group: "
            + "; ".join(f"rank {r} can run {v[0]}" for r, v in enumerate(views)))
    if any(v[0][0] != common[0] for v in views):  # some rank's first choice is not common
        fit, chosen_plan, digest, error, mode = attempt([common[0]])
        views = exchange_objects(([x.name for x in fit], digest, _error_text(error), a.shape[0],
                                  _plan_summary(chosen_plan), mode), group)
        _raise_errors(views, error)
    _check_same_plan(c["op"], views)
    _check_same_mode(views)
    if splits:
        # all_to_all: the plan again with the ranks' mean rows as the tile rule's hint (the
        # same on every rank: every rank's rows were in the exchange), settled in one more
        # exchange, which every rank takes part in whatever its plan's source
        hinted = dataclasses.replace(spec, rows_hint=sum(v[3] for v in views) // world)
        fit, chosen_plan, digest, error, mode = attempt([fit[0].name], hinted)
        views = exchange_objects(([x.name for x in fit], digest, _error_text(error), a.shape[0],
                                  _plan_summary(chosen_plan), mode), group)
        _raise_errors(views, error)
        _check_same_plan(c["op"], views)
        _check_same_mode(views)
        return _decided(c, a, b, op, chosen_plan, out, fit[0], mode, group,
                        _expected_rows_plan(fit[0], hinted, mode))
    return _decided(c, a, b, op, chosen_plan, out, fit[0], mode, group)


def _expected_rows_plan(backend, hinted, mode) -> Plan | None:
    """An all_to_all key's strategy is predicted on the default plan of the ranks' mean rows
    (``hinted.rows_hint``, the same on every rank), split evenly over the destinations: the
    key's own plan holds no rows. None when nothing is predicted (or no rows were sent)."""
    rows, world = hinted.rows_hint, hinted.world_size
    if mode != "predict" or not rows:
        return None
    splits = tuple(equal_splits(rows, world))
    try:
        return make_plan(backend, dataclasses.replace(hinted, m=rows, send_splits=splits))
    except (TypeError, ValueError):
        return None  # then the key overlaps, as without rows (strategy.fixed_choice)


def _decided(c, a, b, op, plan, out, backend, mode, group, predict_on=None):
    """The call with its plan's strategy chosen (a default plan), the backend, the facts
    (``predict_on``: an all_to_all key's plan of its expected rows)."""
    facts = None
    if mode is not None:
        plan, facts = decide_strategy(plan, backend, group, a.device, predict_on)
    return call_of(c, a, b, op, plan, out), backend, facts


def _check_same_mode(views) -> None:
    """Every rank chooses the strategy of a default plan alike (the same fixed choice, or
    every rank predicting: that takes a collective every rank must join)."""
    differ = [r for r, v in enumerate(views) if v[5] != views[0][5]]
    if differ:
        modes = {r: v[5] or "the plan's own" for r, v in enumerate(views)}
        raise ValueError(
            f"the ranks of the group would not choose this call's strategy (overlap or the plain "
            f"path) alike: {modes}. Give every rank the same FLASHOVERLAP_STRATEGY, plan= and "
            "tuning cache (FLASHOVERLAP_TUNING_CACHE)")


def tell_agreeing_peers(group, error) -> None:
    """An all_to_all key holds only what every rank shares, so when this rank's first call of
    it is invalid, the other ranks are in the first call's exchange (:func:`agree`): take part
    with the error, and every rank raises, naming this one."""
    try:
        group, _, world = resolve_group(group)
    except (TypeError, ValueError):
        return
    if group is not None and world > 1:
        exchange_objects(([], None, _error_text(error), 0, None, None), group)


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
    if plan.kind.splits:  # each rank's rows, splits and groups are its own ...
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
    if of(op).gathers and len({v[3] for v in views}) > 1:
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
