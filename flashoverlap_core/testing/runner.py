"""One case, run on one rank (a spawned rank, or the test process itself at world size 1).

``run_case`` builds the rank's inputs from seeds, makes the plan the case asks for, calls
``fo.overlap`` with a NaN-poisoned ``out`` and checks the result against the float64 reference
(:mod:`.checks`). It raises AssertionError saying what is wrong; it returns a short summary.
"""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import torch.distributed as dist

import flashoverlap_core as fo
from flashoverlap_core.backend import OverlapSpec
from flashoverlap_core.grouping import wave_group_sizes
from flashoverlap_core.plan import GATHER_OP, block_rows_for, group_unit
from flashoverlap_core.tiles import TileGrid

from .cases import (MIXED_SPLITS, MOE_SPLITS, Case, moe_recv_given, rank_input, recv_splits,
                    rank_rows, seed_of)
from .checks import Expected, expected, mismatch


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def op_name(case: Case) -> str:
    return "custom" if case.op == "custom" else case.op


def spec_of(case: Case, seed: int, rank: int, device_type: str, call: int = 0) -> OverlapSpec:
    """What ``rank``'s call asks of the backend (to ask it whether it supports the call)."""
    m, splits = rank_rows(case, seed, rank, call)
    if case.op == GATHER_OP:
        m *= case.world_size  # the plan's M is the rows of the result
    return OverlapSpec(m, case.n, case.k, op_name(case), case.world_size, case.dtype, device_type,
                       case.layout, splits if case.splits != "none" else None)


def explicit_group_sizes(case: Case, base: fo.Plan, rng: random.Random) -> tuple[int, ...] | None:
    """group_sizes for the case's grouping, over the base plan's tiles (None: plan's default)."""
    total = base.num_tiles
    unit = group_unit(base.op, base.world_size, base.n, base.tile)
    if case.grouping == "one":
        return (total,)
    if case.grouping == "per_wave":
        return wave_group_sizes(total, base.wave_size, unit=unit, max_groups=total)
    if case.grouping == "uneven":
        units = total // unit
        if units < 2:
            return (total,)
        cuts = sorted(rng.sample(range(1, units), min(units - 1, rng.randint(1, 5))))
        return tuple(unit * (b - a) for a, b in zip([0] + cuts, cuts + [units]))
    return None


def tile_refusal(backend, spec: OverlapSpec, tile: tuple[int, int]) -> list[str]:
    """Why the backend has no kernel for ``tile`` (its ``plan_reasons`` for a one-group plan
    with that tile); empty when it has one."""
    schedule = backend.schedule(spec, tile)
    rows = block_rows_for(spec.op, spec.m, spec.world_size, spec.send_splits)
    total = TileGrid(rows, spec.n, *tile, schedule).num_tiles
    plan = fo.Plan(spec.m, spec.n, spec.k, spec.op, spec.world_size, spec.dtype, tile,
                   backend.wave_size(spec, tile), (total,), schedule, spec.send_splits, backend.name)
    return backend.plan_reasons(plan)


def for_backend(case: Case, backend, seed: int, device_type: str) -> tuple[Case, str | None]:
    """The case as ``backend`` runs it, and why it cannot (None when it can).

    The shapes' small tiles make many tiles and groups. A backend whose kernels have other
    tiles refuses them (``plan_reasons``); the case then asks for the tile the backend declares
    for the call (``default_tile``) and its id says so (``-backend-tile-for-BMxBN``). A case
    whose tile the backend refuses either way is a skip with both reasons: nothing runs with
    another tile than its id shows."""
    if case.grouping == "auto":  # no plan: overlap's own default tile
        return case, None
    spec = spec_of(case, seed, 0, device_type)
    refused = tile_refusal(backend, spec, case.tile)
    if not refused:
        return case, None
    declared = tuple(backend.default_tile(spec))
    again = tile_refusal(backend, spec, declared)
    if again:
        return case, (f"backend {backend.name!r} runs neither the case's tile {case.tile} "
                      f"({'; '.join(refused)}) nor its own default tile {declared} "
                      f"({'; '.join(again)})")
    return dataclasses.replace(case, tile=declared, requested_tile=case.tile), None


def parametrize(metafunc, argname: str, cases: list[Case]) -> None:
    """Parametrize ``argname`` with the cases as the backend under test runs them (see
    :func:`for_backend`); left as they are when the backend is unavailable (every test then
    skips with the reason)."""
    from .plugin import settings

    s = settings(metafunc.config)
    backend, _ = s._resolved
    params = []
    for case in cases:
        why = None
        if backend is not None:
            case, why = for_backend(case, backend, s.seed, backend.device_type or "cpu")
        marks = [pytest.mark.skip(reason=why)] if why else []
        params.append(pytest.param(case, id=case.id, marks=marks))
    metafunc.parametrize(argname, params)


def case_plan(case: Case, seed: int, rank: int, backend: str, device_type: str) -> fo.Plan:
    """The plan the call uses: the case's tile and grouping. With grouping "auto" the call
    passes no plan; this is the one overlap makes by default."""
    spec = spec_of(case, seed, rank, device_type)
    kwargs = dict(m=spec.m, n=case.n, k=case.k, op=spec.op, world_size=case.world_size,
                  dtype=case.dtype, backend=backend, send_splits=spec.send_splits, b_layout=case.layout)
    if case.grouping == "auto":
        return fo.plan(**kwargs)
    base = fo.plan(tile=case.tile, **kwargs)
    rng = random.Random(seed_of(seed, case.id, "groups", rank if case.op == "all_to_all" else 0))
    sizes = explicit_group_sizes(case, base, rng)
    if sizes is None:
        return base
    return fo.plan(tile=base.tile, group_sizes=sizes, **kwargs)


class RecordingOp:
    """A custom op that records each call (index, a copy of the region, where it lies) and
    then negates the region in place or leaves it alone."""

    def __init__(self, negate: bool):
        self.negate = negate
        self.calls: list[tuple[int, torch.Tensor, int, bool]] = []

    def __call__(self, region: torch.Tensor, index: int) -> None:
        self.calls.append((index, region.clone(), region.data_ptr(), region.is_contiguous()))
        if self.negate:
            region.neg_()


def check_custom_calls(op: RecordingOp, plan: fo.Plan, want: Expected, dtype) -> list[str]:
    """The op ran once per group, in group order, on each group's region of one packed buffer,
    holding exactly that group's finished tiles (the pre-communication reorder)."""
    indices = [i for i, *_ in op.calls]
    if indices != list(range(plan.num_groups)):
        return [f"op(region, index) was called with indices {indices}, expected "
                f"{list(range(plan.num_groups))} (once per group, in group order)"]
    problems, index = [], plan.packed_index()
    base = op.calls[0][2]
    itemsize = torch.empty((), dtype=dtype).element_size()
    for (g, region, ptr, contiguous), r in zip(op.calls, plan.regions):
        if not contiguous or region.numel() != r.numel or region.dtype != dtype:
            problems.append(f"group {g}: region has {region.numel()} {region.dtype} elements"
                            f"{'' if contiguous else ', not contiguous'}; the plan's region is "
                            f"{r.numel} contiguous {dtype} elements")
            continue
        if ptr - base != r.offset * itemsize:
            problems.append(f"group {g}: region starts {(ptr - base) // itemsize} elements after "
                            f"group 0's, the plan says {r.offset}")
        part = index[r.offset:r.offset + r.numel]
        wrong = mismatch(region, Expected(want.ref.flatten()[part], want.tol.flatten()[part]),
                         f"group {g}'s region when op was called")
        if wrong:
            problems.append(wrong)
    return problems


def call_once(target, case: Case, seed: int, rank: int, plan: fo.Plan, call: int) -> list[str]:
    """One overlap call of the case (inputs of round ``call``) and what is wrong with it. A
    poisoned ``out`` is a row slice of a NaN buffer, so writes outside it are seen too."""
    device = target.device(rank)
    inp = rank_input(case, seed, rank, device, call)
    send = inp.send_splits if case.op == "all_to_all" and case.splits != "none" else None
    given = case.splits in ("send+recv", MIXED_SPLITS) or (case.splits == MOE_SPLITS
                                                           and moe_recv_given(call))
    recv = recv_splits(case, seed, rank, call) if case.op == "all_to_all" and given else None
    op = RecordingOp(case.custom == "negate") if case.op == "custom" else case.op
    want = expected(case, seed, rank, call)
    out = guarded = None
    if case.poison_out:
        rows, n = want.ref.shape
        guarded = torch.full((rows + 2, n), float("nan"), dtype=case.torch_dtype, device=device)
        out = guarded[1:rows + 1]
    result = fo.overlap(inp.a, inp.b, op, plan=None if case.grouping == "auto" else plan, out=out,
                        send_splits=send, recv_splits=recv, backend=target.backend_name)

    problems = []
    if out is not None and result is not out:
        problems.append("overlap(out=...) returned a tensor other than out")
    if result.dtype != case.torch_dtype or result.device != device:
        problems.append(f"result is {result.dtype} on {result.device}, expected "
                        f"{case.torch_dtype} on {device}")
    if guarded is not None and not guarded[[0, -1]].isnan().all():
        problems.append("elements outside out (the rows just before and after it) were written")
    if isinstance(op, RecordingOp):
        if device.type != "cpu":
            torch.accelerator.synchronize()  # the regions were copied on the communication stream
        problems += check_custom_calls(op, plan, want, case.torch_dtype)
        if op.negate:
            want = Expected(-want.ref, want.tol)
    wrong = mismatch(result, want, "result")
    if wrong:
        problems.append(wrong)
    return [f"call {call}: {p}" for p in problems] if case.calls > 1 else problems


def run_case(target, case: Case, seed: int) -> dict:
    """Run ``case`` on this rank and check it (see the module docstring). Returns the plan's
    groups, tiles and tile, and the backend that ran the call (from ``fo.prepared_calls``)."""
    rank, world = rank_and_world()
    assert world == case.world_size, f"running a W={case.world_size} case on {world} rank(s)"
    # The automatic choice makes its own plan (fo.plan would ask the device's default backend)
    # (an MoE sequence passes no plan either: its rows are each call's own)
    plan = (None if case.choice == "default" or case.splits == MOE_SPLITS
            else case_plan(case, seed, rank, target.backend_name, target.device_type))
    fo.api.forget_prepared()  # every rank, before its first call: what ran is this case's alone
    problems = [p for call in range(case.calls) for p in call_once(target, case, seed, rank, plan, call)]
    assert not problems, f"case {case.id}, seed {seed}, rank {rank} ({plan!r}):\n  " + "\n  ".join(problems)
    ran = fo.prepared_calls()
    return {"groups": ran[-1]["groups"], "tiles": plan.num_tiles if plan else None,
            "tile": plan.tile if plan else None, "backends": sorted({c["backend"] for c in ran}),
            "strategies": sorted({c["strategy"] for c in ran})}


def unsupported(backend, case: Case, seed: int, device_type: str) -> str | None:
    """Why ``backend`` declines the case (its ``unsupported_reasons``), or None."""
    calls = case.calls if case.splits == MOE_SPLITS else 1  # an MoE sequence's rows change
    for call in range(calls):
        for rank in range(case.world_size):
            reasons = backend.unsupported_reasons(spec_of(case, seed, rank, device_type, call))
            if reasons:
                return (f"backend {backend.name!r} does not support {case.id} (rank {rank}"
                        f"{f', call {call}' if calls > 1 else ''}): " + "; ".join(reasons))
    return None
