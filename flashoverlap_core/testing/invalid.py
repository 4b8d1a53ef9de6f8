"""Invalid calls, and a backend that proves they are rejected before any device work.

:class:`Tripwire` wraps the backend under test: it answers every question the API asks before a
run (availability, support, tiles, schedule, plan checks) exactly as that backend does, but its
``run`` raises :class:`DeviceWorkStarted`. An invalid call must raise ValueError/TypeError, so a
call that gets as far as the backend's ``run`` fails the test; a valid call reaching the tripwire
shows that the tripwire is live.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

import flashoverlap_core as fo
from flashoverlap_core import registry
from flashoverlap_core.backend import Backend, OverlapSpec
from flashoverlap_core.plan import GATHER_OP, PLAN_OPS, dtype_name

M, N, K = 8, 6, 5


class DeviceWorkStarted(RuntimeError):
    """The backend's run() was reached: the call was not rejected up front."""


class Tripwire(Backend):
    def __init__(self, inner: Backend):
        self.inner = inner
        self.name = f"tripwire-{inner.name}"
        self.device_type = inner.device_type
        self.priority = inner.priority - 1000  # never preferred by auto-selection

    def probe(self):
        return self.inner.probe()

    def unsupported_reasons(self, spec):
        return self.inner.unsupported_reasons(spec)

    def default_tile(self, spec):
        return self.inner.default_tile(spec)

    def wave_size(self, spec, tile):
        return self.inner.wave_size(spec, tile)

    def schedule(self, spec, tile=None):
        return self.inner.schedule(spec, tile)

    def plan_reasons(self, plan):
        return self.inner.plan_reasons(plan)

    def run(self, call):
        raise DeviceWorkStarted(f"{self.inner.name}.run() was called")


def tripwire(backend_name: str) -> str:
    """Register a tripwire around ``backend_name``; its name, for ``backend=``."""
    return registry.register(Tripwire(registry.get(backend_name))).name


def valid_dtype(backend_name: str, device_type: str) -> torch.dtype:
    """The first of float32, bfloat16, float16 that the backend runs (the valid calls use it)."""
    backend = registry.get(backend_name)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        spec = OverlapSpec(M, N, K, "allreduce", 1, dtype_name(dtype), device_type)
        if not backend.unsupported_reasons(spec):
            return dtype
    raise pytest.UsageError(f"backend {backend_name!r} runs none of float32, bfloat16, float16")


@dataclass(frozen=True)
class Ctx:
    """What an invalid call is built from: the device and world size it runs with."""

    device: torch.device
    world_size: int
    backend: str  # the tripwire's name
    dtype: torch.dtype = torch.float32  # a dtype the backend runs

    @property
    def other_dtype(self) -> torch.dtype:
        return torch.float16 if self.dtype != torch.float16 else torch.bfloat16

    def t(self, *shape, dtype=None, device=None):
        return torch.randn(*shape).to(dtype=dtype or self.dtype, device=device or self.device)

    def call(self, **kw) -> dict:
        """A valid allreduce call's arguments, with ``kw`` replacing some."""
        args = dict(a=self.t(M, K), b=self.t(K, N), op="allreduce", backend=self.backend)
        args.update(kw)
        return args

    def plan(self, **kw):
        args = dict(m=M, n=N, k=K, op="allreduce", world_size=self.world_size,
                    dtype=self.dtype, backend=self.backend)
        args.update(kw)
        return fo.plan(**args)

    def foreign_plan(self, **fields):
        """A valid plan with ``fields`` changed afterwards: a plan made for another call, which
        the backend under test need not be able to make itself (one in a dtype it does not run:
        ``fo.plan`` would refuse that first, rightly, with the backend's reason)."""
        return dataclasses.replace(self.plan(), **fields)


@dataclass(frozen=True)
class Invalid:
    label: str
    error: type  # TypeError or ValueError (a subclass is fine)
    match: str  # a word of the message that says what is wrong (case-insensitive)
    build: Callable[[Ctx], dict]  # fo.overlap keyword arguments
    world_size: int = 1  # 1: in the test process, no torch.distributed; 2: on two ranks


@dataclass(frozen=True)
class OpCall:
    """Builds the arguments of a call of ``op`` (known before building: building may itself
    ask the backend for a plan of that op)."""

    op: str
    build: Callable[[Ctx], dict]

    def __call__(self, c: Ctx) -> dict:
        return self.build(c)


def _a2a(**kw):
    return lambda c: c.call(op="all_to_all", **kw)


def _gather(out_rows=None, plan=None, **kw):
    """An allgather call, with ``out`` of ``out_rows`` rows and a plan of op ``plan`` for M
    rows (at W > 1 not the call's W x M) when given."""
    def build(c):
        args = dict(kw, op="allgather")
        if out_rows is not None:
            args["out"] = c.t(out_rows, N)
        if plan is not None:
            args["plan"] = c.plan(op=plan, world_size=c.world_size)
        return c.call(**args)
    return OpCall("allgather", build)


INVALID = [
    Invalid("a-not-tensor", TypeError, "torch.Tensor", lambda c: c.call(a=[[1.0] * K] * M)),
    Invalid("b-not-tensor", TypeError, "torch.Tensor", lambda c: c.call(b=3.0)),
    Invalid("a-1d", ValueError, "2-D", lambda c: c.call(a=c.t(M * K))),
    Invalid("b-3d", ValueError, "2-D", lambda c: c.call(b=c.t(1, K, N))),
    Invalid("k-mismatch", ValueError, "must equal", lambda c: c.call(b=c.t(K + 1, N))),
    Invalid("dtype-mismatch", TypeError, "same dtype", lambda c: c.call(b=c.t(K, N, dtype=c.other_dtype))),
    Invalid("dtype-float64", TypeError, "not supported",
            lambda c: c.call(a=c.t(M, K, dtype=torch.float64), b=c.t(K, N, dtype=torch.float64))),
    Invalid("dtype-int32", TypeError, "not supported",
            lambda c: c.call(a=c.t(M, K, dtype=torch.int32), b=c.t(K, N, dtype=torch.int32))),
    Invalid("device-mismatch", ValueError, "same device", lambda c: c.call(b=c.t(K, N, device="meta"))),
    Invalid("empty-m", ValueError, ">= 1", lambda c: c.call(a=c.t(0, K))),
    Invalid("empty-n", ValueError, ">= 1", lambda c: c.call(b=c.t(K, 0))),
    Invalid("empty-k", ValueError, ">= 1", lambda c: c.call(a=c.t(M, 0), b=c.t(0, N))),
    Invalid("op-unknown", ValueError, "op must be", lambda c: c.call(op="broadcast")),
    Invalid("op-type", TypeError, "op must be", lambda c: c.call(op=3)),
    Invalid("group-type", TypeError, "group", lambda c: c.call(group="world")),
    Invalid("backend-type", TypeError, "backend", lambda c: c.call(backend=3)),
    Invalid("splits-for-allreduce", ValueError, "all_to_all", lambda c: c.call(send_splits=[M])),
    Invalid("recv-splits-for-reduce-scatter", ValueError, "all_to_all",
            lambda c: c.call(op="reduce_scatter", recv_splits=[M])),
    Invalid("splits-type", TypeError, "send_splits", _a2a(send_splits="8")),
    Invalid("splits-not-int", TypeError, "send_splits", _a2a(send_splits=[8.0])),
    Invalid("splits-too-long", ValueError, "send_splits", _a2a(send_splits=[M - 1, 1])),
    Invalid("splits-negative", ValueError, "send_splits", _a2a(send_splits=[-M])),
    Invalid("splits-sum", ValueError, "sum", _a2a(send_splits=[M + 1])),
    Invalid("recv-splits-wrong", ValueError, "recv_splits", _a2a(send_splits=[M], recv_splits=[M + 1])),
    Invalid("plan-type", TypeError, "plan", lambda c: c.call(plan="plan")),
    Invalid("plan-other-m", ValueError, "does not fit", lambda c: c.call(plan=c.plan(m=M + 1))),
    Invalid("plan-other-op", ValueError, "does not fit",
            lambda c: c.call(op="reduce_scatter", plan=c.plan())),
    Invalid("plan-other-dtype", ValueError, "does not fit",
            lambda c: c.call(plan=c.foreign_plan(dtype=dtype_name(c.other_dtype)))),
    Invalid("out-type", TypeError, "out", lambda c: c.call(out=[0.0])),
    Invalid("out-shape", ValueError, "shape", lambda c: c.call(out=c.t(M + 1, N))),
    Invalid("out-dtype", ValueError, "out", lambda c: c.call(out=c.t(M, N, dtype=c.other_dtype))),
    Invalid("out-device", ValueError, "out", lambda c: c.call(out=c.t(M, N, device="meta"))),
    Invalid("out-not-contiguous", ValueError, "contiguous", lambda c: c.call(out=c.t(N, M).t())),
    Invalid("allgather-send-splits", ValueError, "all_to_all", _gather(send_splits=[M])),
    Invalid("allgather-recv-splits", ValueError, "all_to_all", _gather(recv_splits=[M])),
    Invalid("allgather-plan-other-op", ValueError, "does not fit", _gather(plan="allreduce")),
    Invalid("allgather-out-shape", ValueError, "shape", _gather(out_rows=M + 1)),
    # on two ranks
    Invalid("reduce-scatter-m-not-divisible", ValueError, "divisible",
            lambda c: c.call(op="reduce_scatter", a=c.t(M + 1, K)), world_size=2),
    Invalid("reduce-scatter-out-rows", ValueError, "shape",
            lambda c: c.call(op="reduce_scatter", out=c.t(M, N)), world_size=2),
    Invalid("a2a-without-send-splits", ValueError, "send_splits", _a2a(), world_size=2),
    Invalid("a2a-splits-short", ValueError, "send_splits", _a2a(send_splits=[M]), world_size=2),
    Invalid("a2a-splits-negative", ValueError, "send_splits", _a2a(send_splits=[M + 1, -1]), world_size=2),
    Invalid("a2a-splits-sum", ValueError, "sum", _a2a(send_splits=[1, 1]), world_size=2),
    Invalid("a2a-recv-splits-long", ValueError, "recv_splits",
            _a2a(send_splits=[4, 4], recv_splits=[4, 4, 0]), world_size=2),
    Invalid("splits-for-allreduce-2", ValueError, "all_to_all",
            lambda c: c.call(send_splits=[4, 4]), world_size=2),
    Invalid("plan-other-world-size", ValueError, "does not fit",
            lambda c: c.call(plan=c.plan(world_size=1)), world_size=2),
    Invalid("allgather-out-local-rows", ValueError, "shape", _gather(out_rows=M), world_size=2),
    Invalid("allgather-plan-local-rows", ValueError, "does not fit",  # a plan's M is W x m
            _gather(plan="allgather"), world_size=2),
]
BY_LABEL = {case.label: case for case in INVALID}

INVALID_PLANS = [  # (label, error, message word, fo.plan keyword arguments replacing valid ones)
    ("m-zero", ValueError, ">= 1", dict(m=0)),
    ("m-bool", TypeError, "int", dict(m=True)),
    ("k-float", TypeError, "int", dict(k=5.0)),
    ("world-size-zero", ValueError, ">= 1", dict(world_size=0)),
    ("op-unknown", ValueError, "op must be", dict(op="broadcast")),
    ("dtype-float64", TypeError, "not supported", dict(dtype=torch.float64)),
    ("reduce-scatter-m-not-divisible", ValueError, "divisible", dict(op="reduce_scatter", world_size=3)),
    ("a2a-without-send-splits", ValueError, "send_splits", dict(op="all_to_all", world_size=2)),
    ("a2a-splits-sum", ValueError, "sum", dict(op="all_to_all", world_size=2, send_splits=[1, 2])),
    ("splits-for-allreduce", ValueError, "all_to_all", dict(send_splits=[M])),
    ("tile-not-pair", TypeError, "tile", dict(tile=4)),
    ("tile-length", ValueError, "tile", dict(tile=(4,))),
    ("tile-zero", ValueError, "tile", dict(tile=(0, 4))),
    ("tile-float", TypeError, "tile", dict(tile=(4.0, 4))),
    ("wave-size-zero", ValueError, "wave_size", dict(wave_size=0)),
    ("group-sizes-type", TypeError, "group_sizes", dict(group_sizes="4")),
    ("group-sizes-empty", TypeError, "group_sizes", dict(group_sizes=[])),
    ("group-size-zero", ValueError, "group_sizes", dict(tile=(4, 3), group_sizes=[0, 4])),
    ("group-sizes-sum", ValueError, "sum", dict(tile=(4, 3), group_sizes=[1, 1])),
    ("reduce-scatter-groups-unbalanced", ValueError, "unbalanced",
     dict(op="reduce_scatter", world_size=2, tile=(4, 3), group_sizes=[1, 3])),
    ("backend-type", TypeError, "backend", dict(backend=3)),
    ("allgather-m-not-divisible", ValueError, "divisible", dict(op="allgather", world_size=3)),
    ("allgather-splits", ValueError, "all_to_all", dict(op="allgather", send_splits=[M])),
    ("allgather-groups-not-bands", ValueError, "band",  # tile 4x3: a band of 2 shards is 4 tiles
     dict(op="allgather", world_size=2, tile=(4, 3), group_sizes=[1, 3])),
]


def raised_by(call: Callable[[], object]) -> tuple[tuple[str, ...], str]:
    """(names of the raised exception's classes, its message); ((), "") when it did not raise."""
    try:
        call()
    except Exception as e:  # reported back to the test, which judges it
        return tuple(cls.__name__ for cls in type(e).__mro__), str(e)
    return (), ""


def attempt(build: Callable[[Ctx], dict], ctx: Ctx) -> tuple[tuple[str, ...], str]:
    """What ``fo.overlap`` with the arguments ``build`` gives raises (see :func:`raised_by`)."""
    return raised_by(lambda: fo.overlap(**build(ctx)))


def declined(ctx: Ctx, op) -> str | None:
    """Why the backend under test declines the valid call of ``op`` that a case spoils (at this
    world size, e.g. allgather on a backend without it), or None. Such a case cannot show what
    it is about: the backend's refusal would come first, rightly, so the case is a skip."""
    if not isinstance(op, str) or op not in PLAN_OPS:
        return None
    rows = M * ctx.world_size if op == GATHER_OP else M
    spec = OverlapSpec(rows, N, K, op, ctx.world_size, dtype_name(ctx.dtype), ctx.device.type)
    reasons = registry.get(ctx.backend).unsupported_reasons(spec)
    return f"the backend declines {op} calls: " + "; ".join(reasons) if reasons else None


DECLINED = "Declined"  # in place of the raised classes: the case was not attempted


def attempt_unless_declined(case: "Invalid", ctx: Ctx) -> tuple[tuple[str, ...], str]:
    """:func:`attempt`, or ((DECLINED,), why) when the backend declines the case's valid call."""
    op = case.build.op if isinstance(case.build, OpCall) else case.build(ctx).get("op", "allreduce")
    why = declined(ctx, op)
    return ((DECLINED,), why) if why else attempt(case.build, ctx)


def attempt_on_rank(target, labels: list[str]) -> dict[str, tuple[tuple[str, ...], str]]:
    """Run the labelled invalid calls, and a valid one ("valid"), on this rank."""
    import torch.distributed as dist

    device = target.device(dist.get_rank())
    ctx = Ctx(device, dist.get_world_size(), tripwire(target.backend_name),
              valid_dtype(target.backend_name, device.type))
    results = {label: attempt_unless_declined(BY_LABEL[label], ctx) for label in labels}
    results["valid"] = attempt(lambda c: c.call(), ctx)
    return results


def unequal_allgather_rows_on_rank(target) -> tuple[tuple[str, ...], str]:
    """An allgather on two ranks whose a has M rows on rank 0 and M + 1 on rank 1. Only the
    ranks together can see it, so it goes to the real backend, not a tripwire."""
    import torch.distributed as dist

    rank = dist.get_rank()
    device = target.device(rank)
    ctx = Ctx(device, dist.get_world_size(), target.backend_name,
              valid_dtype(target.backend_name, device.type))
    why = declined(ctx, "allgather")
    if why:
        return (DECLINED,), why
    return attempt(lambda c: c.call(op="allgather", a=c.t(M + rank, K)), ctx)


def mismatched_recv_splits_on_rank(target) -> tuple[tuple[str, ...], str]:
    """An all_to_all on two ranks whose recv_splits disagree with what the other rank sends.
    Only the ranks together can see it, so it goes to the real backend, not a tripwire."""
    import torch.distributed as dist

    device = target.device(dist.get_rank())
    ctx = Ctx(device, dist.get_world_size(), target.backend_name,
              valid_dtype(target.backend_name, device.type))
    return attempt(_a2a(send_splits=[M // 2, M // 2], recv_splits=[M // 2 - 1, M // 2 + 1]), ctx)
