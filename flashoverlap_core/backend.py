"""The backend contract.

A backend turns a :class:`~flashoverlap_core.plan.Plan` into device work. It provides four
pieces: a signaling GEMM that writes the packed layout, a device-side wait on a group's
counter, the collective on a group's contiguous region (normally through
:class:`~flashoverlap_core.collectives.RegionExchange`, i.e. torch.distributed on the caller's
group) and the post-communication reorder. Backends are found through the
``flashoverlap.backends`` entry-point group; an entry point names a zero-argument callable (the
class) returning a :class:`Backend`. Importing a backend module must stay cheap: no device
context, no compilation.
"""
from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from .reorder import add_rmsnorm
from .tiles import Schedule

if TYPE_CHECKING:
    from .tile_trace import TileTrace


def b_layout(b: torch.Tensor) -> str:
    """'row' for a contiguous [K, N] b, 'col' for the transpose of a contiguous [N, K]
    (``weight.t()``), 'strided' otherwise. A 1x1 b, which is both, is 'col' (what every
    build takes, fp8's too)."""
    if b.stride(0) == 1 and b.stride(1) >= max(1, b.shape[0]):
        return "col"
    if b.stride(1) == 1 and b.stride(0) >= max(1, b.shape[1]):
        return "row"
    return "strided"


@dataclass(frozen=True)
class OverlapSpec:
    """What a call asks for, known before any device work."""

    m: int
    n: int
    k: int
    op: str  # one of plan.PLAN_OPS ("custom" for a callable)
    world_size: int
    dtype: str
    device_type: str
    b_layout: str = "row"  # "row" (contiguous [K, N]), "col" ([N, K] transposed) or "strided"
    send_splits: tuple[int, ...] | None = None
    out_dtype: str | None = None  # fp8 calls (dtype "float8_e4m3fn"): the result's dtype
    # fp8 calls: the scales' kind (fp8.scaling_kind): "tensorwise", "rowwise" (either scale per
    # row or column) or "blockwise" (1x128 groups of a along K, 128x128 blocks of b)
    scaling: str | None = None
    # all_to_all: rows per rank that the key's calls are expected to have (the mean over the
    # ranks of their first call's rows, the same on every rank: agreement.agree), for a tile
    # rule that weighs the waves; None where nothing is known (m is then the world size)
    rows_hint: int | None = None

    @property
    def fp8(self) -> bool:
        return self.out_dtype is not None

    def dequantized(self) -> "OverlapSpec":
        """The float32 call an fp8 call runs as on a backend without native fp8."""
        return dataclasses.replace(self, dtype="float32", out_dtype=None, scaling=None)


@dataclass
class OverlapCall:
    """Everything a backend needs to run one overlapped call (already validated)."""

    a: torch.Tensor
    b: torch.Tensor
    plan: "object"  # flashoverlap_core.plan.Plan
    op: str | Callable
    group: "object | None"  # torch.distributed ProcessGroup, or None when not initialised
    rank: int
    world_size: int
    out: torch.Tensor
    recv_splits: tuple[int, ...] | None = None
    # fp8 calls: float32 scales, 0-dim or [M, 1] (scale_a) and 0-dim or [1, N] (scale_b), or
    # block-wise [M, ceil(K/128)] and [ceil(K/128), ceil(N/128)] (flashoverlap_core/fp8.py);
    # out is in the plan's out_dtype
    scale_a: torch.Tensor | None = None
    scale_b: torch.Tensor | None = None


class PreparedCall:
    """What a backend builds once for the calls of one key (shapes, strides, dtypes, device,
    op kind, splits, group, plan) and reuses: ``run`` launches one call whose arguments have
    already been checked against the key. The default re-enters :meth:`Backend.run` with an
    :class:`OverlapCall` per call; backends with a native launch override
    :meth:`Backend.prepare` and return their own."""

    def __init__(self, backend: "Backend", template: OverlapCall):
        # The template keeps what the key fixes, not the first call's tensors: holding them
        # would keep their memory alive as long as the key (and, inside a device graph's memory
        # pool, a tensor that no graph output owns). Subclasses read the tensors from
        # ``template`` in their own __init__ (the argument), before it returns.
        self.backend = backend
        self.template = dataclasses.replace(template, a=None, b=None, out=None, scale_a=None,
                                            scale_b=None)


    def workspace_bytes(self) -> int:
        """Device memory this prepared call holds for its calls beyond their outputs (packed
        and staging buffers, counters): ``fo.prepared_calls()`` reports it."""
        return 0
    def run(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None, op) -> torch.Tensor:
        return self.backend.run(self._call(a, b, out, op))

    def run_add_rmsnorm(self, a: torch.Tensor, b: torch.Tensor, op, residual: torch.Tensor,
                        weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(normed, residual_out)`` of ``fo.overlap_add_rmsnorm`` (op allreduce or
        reduce_scatter; ``residual`` has the result's shape and a's dtype, ``weight`` is [N],
        both checked): the post-communication reorder fused into the residual add and the
        RMSNorm. The default re-enters :meth:`Backend.run_add_rmsnorm`; a backend whose
        prepared call has a fused kernel overrides this."""
        call = self._call(a, b, residual.new_empty(residual.shape), op)
        return self.backend.run_add_rmsnorm(call, residual, weight, eps)

    def _call(self, a, b, out, op) -> OverlapCall:
        t = self.template
        return OverlapCall(a, b, t.plan, op, t.group, t.rank, t.world_size, out, t.recv_splits)

    def run_scaled(self, a, b, scale_a, scale_b, out, op) -> torch.Tensor:
        """An fp8 call of this key (backends with ``native_fp8``): ``run`` with its scales."""
        t = self.template
        return self.backend.run(OverlapCall(a, b, t.plan, op, t.group, t.rank, t.world_size, out,
                                            t.recv_splits, scale_a, scale_b))


class Backend(abc.ABC):
    """Base class of every backend. Subclasses set ``name`` and ``device_type``."""

    name: str = ""
    device_type: str | None = None  # None: runs on any torch device
    priority: int = 0  # auto-selection prefers higher priorities for a device type
    # fp8 calls (spec.dtype "float8_e4m3fn", spec.out_dtype): True, the backend runs them
    # itself (OverlapCall.scale_a/scale_b, PreparedCall.run_scaled) and declines what it cannot
    # in unsupported_reasons; False, the core runs them on it dequantized, as float32 calls
    # (call_reasons asks it about that float32 call)
    native_fp8: bool = False

    def probe(self) -> str | None:
        """``None`` when usable here, else why not. Must not create a device context."""
        return None

    def unsupported_reasons(self, spec: OverlapSpec) -> list[str]:
        """Why this backend cannot run ``spec`` (empty list: it can)."""
        return []

    def default_tile(self, spec: OverlapSpec) -> tuple[int, int]:
        return (128, 128)

    def wave_size(self, spec: OverlapSpec, tile: tuple[int, int]) -> int:
        """Tiles finished at once (resident CTAs of a persistent kernel)."""
        return 4

    def schedule(self, spec: OverlapSpec, tile=None) -> Schedule:
        """The order in which this backend's kernel visits the tiles of one block, for plans of
        ``tile`` (None: whatever tile)."""
        return Schedule()

    def layouts(self, spec: OverlapSpec) -> tuple[str, ...]:
        """The packed layouts (plan.LAYOUTS) this backend runs for ``spec``, preferred first:
        "rows" (groups of whole row bands, nothing reordered after the collective) and
        "tiles"."""
        return ("rows", "tiles")

    def add_rmsnorm_rows(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                         eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The plain path's residual add + RMSNorm over the rows of ``x`` (a finished result)
        as one kernel of the backend's, returning ``(normed, x + residual)``; None where the
        backend has none (then torch's ops run it)."""
        return None

    def plain_collectives(self, call: OverlapCall):
        """The plain path's collectives on ``call.group`` through the backend's own library,
        or None (then torch.distributed runs them on the group): an object with
        ``all_reduce(t)``, ``reduce_scatter(out, t)`` and ``all_gather(out, t)`` that issue
        one collective on the current stream, as torch.distributed's forms of the same name,
        and optionally ``all_to_all(out, t, send_splits, recv_splits)`` (as
        ``all_to_all_single`` with those split sizes). Called once per prepared key, on every
        rank alike."""
        return None

    def plan_reasons(self, plan) -> list[str]:
        """Why this backend cannot execute ``plan`` (a tile it has no kernel for, say)."""
        return []

    def device_count(self) -> int:
        """Devices this backend can use (0 for host-only backends)."""
        return 0

    def rank_environment(self, rank: int, world_size: int, shared_devices: bool) -> dict[str, str]:
        """Environment variables rank ``rank`` of a spawned group of ``world_size`` needs
        before its collective library starts. ``shared_devices``: ranks share devices (rank r
        on device r mod count), a test topology that only checks correctness; a backend whose
        collective library refuses two ranks on one device says here how to make it accept
        them. Read in the parent process: no device context."""
        return {}

    def prebuild(self, archs: list[int] | None = None, jobs: int | None = None) -> list[str]:
        """Compile this backend's kernels ahead of time (for ``archs``, its own naming of the
        device generations; None: what it supports); the paths written. Nothing to build: []."""
        return []

    def versions(self) -> dict[str, str]:
        """Versions of what the backend runs on (collective library, compiler, ...)."""
        return {}

    def prepare(self, template: OverlapCall) -> PreparedCall:
        """Build, once per key, what the calls of ``template``'s key need (tables, kernels,
        communicator, workspaces); called on the first call of a key, outside graph
        capture. ``template`` is that first call (its tensors are only examples)."""
        return PreparedCall(self, template)

    def prepare_all_to_all(self, template: OverlapCall):
        """all_to_all calls whose rows and splits are each call's own (expert parallelism):
        an object whose ``run(a, b, out, send_splits, recv_splits)`` runs one call of
        ``template``'s key laid out from its own splits (checked, ``out`` made, recv_splits
        known), or None, the default: each call's rows then get their own plan
        (``Plan.for_rows``) and :meth:`prepare`, kept per split."""
        return None

    @abc.abstractmethod
    def run(self, call: OverlapCall) -> torch.Tensor:
        """Run the overlapped call; the result goes to (and is) ``call.out``."""

    def run_add_rmsnorm(self, call: OverlapCall, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(normed, residual_out)``: the call (allreduce or reduce_scatter) with its
        post-communication reorder fused into ``residual_out = residual + result`` and
        ``normed = rmsnorm(residual_out) * weight`` (float32 math, the result's dtype; see
        :func:`flashoverlap_core.reorder.add_rmsnorm`). Optional: the default runs the call,
        then the add and the norm in torch; ``call.out`` is scratch space for the result."""
        return add_rmsnorm(self.run(call), residual, weight, eps)

    def trace(self, call: OverlapCall) -> "TileTrace":
        """Run the call like :meth:`run` (the result goes to ``call.out``) and report when each
        tile was finished, by which worker, and when each group's transfer ran: a
        :class:`flashoverlap_core.tile_trace.TileTrace`. Optional; the tuner and
        ``flashoverlap trace`` need it."""
        raise NotImplementedError(
            f"backend {self.name!r} cannot trace a call: it does not implement Backend.trace(), "
            "which the tuner and `flashoverlap trace` need (they run on backends that do, e.g. "
            "'reference')")


def call_reasons(backend: Backend, spec: OverlapSpec) -> list[str]:
    """Why ``backend`` cannot run ``spec`` (empty: it can). An fp8 call on a backend without
    native fp8 is the float32 call it runs as (the core dequantizes the inputs)."""
    if spec.fp8 and not backend.native_fp8:
        reasons = backend.unsupported_reasons(spec.dequantized())
        return [f"{r} (no native fp8 on {backend.name!r}: an fp8 call runs dequantized, as a "
                "float32 call)" for r in reasons]
    return backend.unsupported_reasons(spec)
