"""all_to_all for expert parallelism: each call's rows and splits are its own.

In an MoE layer every rank has its own number of token rows (zero at times) and its own
``send_splits`` (skewed, with zeros, new every step). None of that is in a prepared key: the
key and the plan the ranks settle on (``agreement.agree``) hold only what every rank shares (the
tile, the tile order, the number of groups G), and :class:`AllToAllCall` cuts that plan to each
call's rows (:meth:`Plan.for_rows`, cached). With the "destinations" grouping (the default) a
rank knows what each source sends it in each group from the rows that source sends it alone,
so every rank issues the same G collectives whatever its data:

* ``recv_splits`` given: nothing is exchanged, no host sync (but on the key's first call);
* ``recv_splits`` omitted: one all_to_all of W counts per call (a host sync), as users of
  ``torch.distributed.all_to_all_single`` exchange them.

Bad arguments (splits of the wrong length, negative, not summing to the rows) raise before any
device work. The first call of a key (the same call on every rank: the key holds only what the
ranks share) checks ``recv_splits`` against what the ranks send, in one count exchange and one
exchange of the verdict, so that a rank's error, its invalid arguments included, is raised on
every rank, naming it. Later, a rank whose arguments are invalid takes part in the count
exchange (recv_splits omitted) with a mark that makes every rank raise; given recv_splits are
then the caller's word, as with all_to_all_single: a rank that raises leaves its peers waiting
in the call's collectives until the process group's timeout.

fp8 (``fo.overlap(a8, b8, "all_to_all", scale_a=..., scale_b=..., out_dtype=...)``; issue 32):
the key holds the scales' kind (tensor-wise, row-wise and which side, block-wise) and the result
dtype, never their rows: each call's row-wise or block-wise ``scale_a`` has that call's rows
(checked per call, as the splits are, before any device work). A backend with native fp8 gets
each call's scales (its own per-call layout: ``run_scaled``); one without runs the float32 call
of the dequantized inputs and rounds the result to ``out_dtype``; the plain ("sequential")
path runs torch's scaled GEMM (:class:`~flashoverlap_core.fp8.ScaledSequentialCall`, else the
dequantized product), then the all_to_all of the result.
"""
from __future__ import annotations

from collections import OrderedDict

import torch
import torch.distributed as dist

from . import fp8
from .backend import Backend, OverlapCall
from .checks import check_out_apart, check_splits_use
from .collectives import INVALID, exchange_objects, exchange_rows, rows_from_ranks
from .faults import collective as _collective
from .ops import KINDS

ALL_TO_ALL = KINDS["all_to_all"]

MAX_PLANS = 1024  # per prepared call: plans (and backend preparations) of recent row splits


class AllToAllCall:
    """The prepared all_to_all of one key (see the module docstring)."""

    def __init__(self, backend: Backend, template: OverlapCall, plain=None):
        self.backend, self.plan = backend, template.plan
        # the plain path's collectives through the backend's own library (Backend.
        # plain_collectives; its all_to_all where it has one), else torch.distributed's
        self.plain = plain if hasattr(plain, "all_to_all") else None
        self.group, self.rank, self.world = template.group, template.rank, template.world_size
        self.n = template.plan.n
        self.result_dtype = template.plan.result_dtype  # an fp8 key's out_dtype
        self.prepares = type(backend).prepare is not Backend.prepare
        # fp8: the key's kind of scales (each call's are checked against it and its rows); a
        # backend without native fp8 runs the float32 call of the dequantized inputs
        self.scale_kind = self.scale_dims = None
        self.dequantize, self.scaled_mm = False, None
        if template.scale_a is not None:
            sa, sb = template.scale_a, template.scale_b
            self.scale_kind = fp8.scaling_kind(template.a.shape[0], self.n, self.plan.k, sa, sb)
            self.scale_dims = (sa.dim(), sb.dim())
            self.dequantize = not backend.native_fp8
            if self.plan.strategy == "sequential" and fp8.ScaledSequentialCall.available(template):
                self.scaled_mm = fp8.ScaledSequentialCall(template)  # the plain path's fp8 GEMM
        # what each call's rows cut: the float32 twin where the calls run dequantized
        self.runs_plan = self.plan.dequantized() if self.dequantize else self.plan
        # a backend that lays each call out from its own splits needs no plan per split
        self.native = None
        if self.plan.grouping == "destinations" and self.plan.strategy == "overlap":
            self.native = backend.prepare_all_to_all(fp8.dequantized_call(template)
                                                     if self.dequantize else template)
        self._plans: OrderedDict = OrderedDict()
        self._prepared: OrderedDict = OrderedDict()
        self.verified = self.group is None or self.world == 1  # the first call checks splits

    def workspace_bytes(self) -> int:
        """Device memory the backend's preparations keep beyond the calls' outputs (the native
        call's buffers, or those of the prepared plans): ``fo.prepared_calls()`` reports it."""
        runners = [self.native] if self.native is not None else list(self._prepared.values())
        return sum(r.workspace_bytes() for r in runners if hasattr(r, "workspace_bytes"))

    # ---- per call ------------------------------------------------------------------------
    def run_scaled(self, a, b, scale_a, scale_b, out, op, send_splits, recv_splits) -> torch.Tensor:
        """An fp8 call of this key: :meth:`run` with this call's scales."""
        return self.run(a, b, out, op, send_splits, recv_splits, (scale_a, scale_b))

    def run(self, a, b, out, op, send_splits, recv_splits, scales=None) -> torch.Tensor:
        try:  # everything that can refuse this rank's call, before any communication
            send, recv, rows = self._checked(a, send_splits, recv_splits)
            self._check_scales(a, scales)
            if out is not None:
                self._check_out(out, a, rows)
                check_out_apart(out, a=a, b=b)
            # the backend may refuse these rows (the plain path's GEMM takes any: no plan)
            plan = (self._plan_for(a.shape[0], send)
                    if self.native is None and self.plan.strategy != "sequential" else None)
        except (TypeError, ValueError) as e:
            if not self.verified:
                self._verify(None, None, a.device, e)  # the peers are in the check: tell them
            elif recv_splits is None and self.group is not None:
                self._tell_peers(a.device)  # they are in the count exchange: let them know
            raise
        if not self.verified:
            self._verify(send, recv, a.device, None)
        if self.native is not None:
            return self._native(a, b, out, send, recv, scales)
        if self.plan.strategy == "sequential":  # allocates its own result: the GEMM's, alone
            return self._sequential(a, b, out, send, recv, scales)
        if out is None and rows is not None:
            out = torch.empty((rows, self.n), dtype=self.result_dtype, device=a.device)
        if scales is not None and self.dequantize:
            return self._dequantized(a, b, scales, out, lambda a32, b32, into: self._overlapped(
                a32, b32, into, op, plan, recv, None))
        return self._overlapped(a, b, out, op, plan, recv, scales)

    def _dequantized(self, a, b, scales, out, run):
        """An fp8 call on a backend without native fp8: ``run(a32, b32, into)``, the float32
        call of the dequantized inputs (into a float32 twin of ``out``, None without one),
        rounded to the result dtype, into ``out`` where given."""
        a32, b32 = fp8.dequantized(a, b, *scales)
        into = None if out is None else torch.empty(out.shape, dtype=torch.float32,
                                                    device=out.device)
        result = run(a32, b32, into)
        return result.to(self.result_dtype) if out is None else out.copy_(result)

    def _overlapped(self, a, b, out, op, plan, recv, scales):
        """The call on the plan of its rows: the backend's run, or its preparation of the plan."""
        call = OverlapCall(a, b, plan, op, self.group, self.rank, self.world, out, recv,
                           *(scales or (None, None)))
        if not self.prepares:
            return self.backend.run(call)
        prepared = self._prepared_for(plan, recv, call)
        if scales is None:
            return prepared.run(a, b, out, op)
        return prepared.run_scaled(a, b, scales[0], scales[1], out, op)

    def _checked(self, a, send_splits, recv_splits):
        m, world = a.shape[0], self.world
        if a.shape[1] != self.plan.k:
            raise ValueError(f"a must be [rows, {self.plan.k}], got {tuple(a.shape)}")
        send, recv = check_splits_use("all_to_all", world, m, send_splits, recv_splits)
        return send or (m,), recv, ALL_TO_ALL.output_rows(m, world, recv)

    def _check_scales(self, a, scales) -> None:
        """An fp8 key's scales, each call's own: float32 on a's device, of the key's kind, and
        a row-wise or block-wise scale_a with this call's rows, and finite where they are in
        host memory (a device's are not read: no host sync per call; the key's first call
        checked them)."""
        if (scales is None) != (self.scale_kind is None):
            raise TypeError("this all_to_all key is an fp8 call's: it needs scale_a and scale_b"
                            if scales is None else
                            "scale_a and scale_b are for fp8 calls (fo.overlap with float8_e4m3fn "
                            "a and b); this all_to_all key's calls take none")
        if scales is None:
            return
        for name, scale in zip(("scale_a", "scale_b"), scales):
            if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32:
                raise TypeError(f"{name} must be a float32 tensor, got "
                                f"{getattr(scale, 'dtype', type(scale).__name__)}")
            if scale.device != a.device:
                raise ValueError(f"{name} must be on {a.device} like a, got {scale.device}")
        sa, sb = scales
        m = a.shape[0]
        if (sa.dim(), sb.dim()) == self.scale_dims and \
                fp8.scaling_kind(m, self.n, self.plan.k, sa, sb) == self.scale_kind:
            if a.device.type == "cpu":  # host scales: their read needs no sync
                fp8.check_finite(sa, sb)
            return
        if sa.dim() == 2 and self.scale_dims[0] == 2 and sa.shape[0] != m:
            raise ValueError(f"scale_a has {sa.shape[0]} rows, but this call's a has {m}: a "
                             f"{self.scale_kind} scale_a has one row per row of a (each call's "
                             f"own rows): [{m}, {sa.shape[1]}]")
        raise ValueError(f"this call's scales (scale_a {list(sa.shape)}, scale_b "
                         f"{list(sb.shape)}) are not the {self.scale_kind} scales of its key "
                         f"(its first call's: scale_a {self.scale_dims[0]}-D, scale_b "
                         f"{self.scale_dims[1]}-D); for a of {m} rows: "
                         f"{fp8.expected_shapes(m, self.n, self.plan.k)}")

    def _check_out(self, out, a, rows) -> None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
        if out.dtype != self.result_dtype or out.device != a.device:
            raise ValueError(f"out must be {self.result_dtype} on {a.device}, got {out.dtype} on "
                             f"{out.device}")
        if out.dim() != 2 or out.shape[1] != self.n or not out.is_contiguous() or (
                rows is not None and out.shape[0] != rows):
            want = f"[{rows if rows is not None else 'rows'}, {self.n}]"
            raise ValueError(f"out must be a contiguous {want} tensor, got shape "
                             f"{tuple(out.shape)} strides {out.stride()}")

    def _tell_peers(self, device) -> None:
        """Take part in the count exchange the other ranks are in, with the invalid mark."""
        exchange_rows([INVALID] * self.world, self.group, device)

    def _verify(self, send, recv, device, error) -> None:
        """The key's first call: the rows each rank sends every other (one all_to_all of W
        counts), this rank's recv_splits against them, and every rank's verdict (one exchange):
        any rank's error is raised on every rank."""
        sent = exchange_rows(send if send is not None else [INVALID] * self.world, self.group,
                             device)
        problem = None if error is None else f"{type(error).__name__}: {error}"
        if problem is None and INVALID not in sent and recv is not None and list(recv) != sent:
            problem = (f"ValueError: recv_splits of rank {self.rank} are {list(recv)}, but the "
                       f"ranks send it {sent} rows (their send_splits)")
        verdicts = exchange_objects(problem, self.group, "all_to_all's first-call check")
        self.verified = True
        failed = {r: v for r, v in enumerate(verdicts) if v is not None}
        if failed and error is None:
            raise ValueError("all_to_all: the first call of this shape failed on rank(s) "
                             f"{sorted(failed)}: " + "; ".join(f"rank {r}: {v}"
                                                           for r, v in failed.items()))

    # ---- cached per row split --------------------------------------------------------------
    def _plan_for(self, m: int, send: tuple[int, ...]):
        key = (m, send)
        plan = self._plans.get(key)
        if plan is None:
            plan = self.runs_plan.for_rows(m, send)
            reasons = self.backend.plan_reasons(plan)
            if reasons:
                raise ValueError(f"backend {self.backend.name!r} cannot run this call's rows "
                                 f"(send_splits {list(send)}): " + "; ".join(reasons))
            self._plans[key] = plan
            if len(self._plans) > MAX_PLANS:
                self._plans.popitem(last=False)
        return plan

    def _prepared_for(self, plan, recv, call):
        """A backend with its own preparation (device tables, kernels) prepares once per
        (plan, recv_splits): a preparation exchanges nothing for a "destinations" plan."""
        key = (plan, recv)
        prepared = self._prepared.get(key)
        if prepared is None:
            prepared = self.backend.prepare(call)
            self._prepared[key] = prepared
            if len(self._prepared) > MAX_PLANS:
                self._prepared.popitem(last=False)
        return prepared

    def _native(self, a, b, out, send, recv, scales=None):
        """The backend's own per-call layout: recv_splits omitted are one count exchange.
        ``scales``: an fp8 call's (the backend's ``run_scaled``, or where it has no native fp8
        its float32 call of the dequantized inputs)."""
        if recv is None:
            recv = tuple(self._received(send, a.device))
            out = self._out_for(out, a.device, sum(recv))
        elif out is None:
            out = torch.empty((sum(recv), self.n), dtype=self.result_dtype, device=a.device)
        if scales is None:
            return self.native.run(a, b, out, send, recv)
        if self.dequantize:
            return self._dequantized(a, b, scales, out, lambda a32, b32, into: self.native.run(
                a32, b32, into, send, recv))
        return self.native.run_scaled(a, b, scales[0], scales[1], out, send, recv)

    def _received(self, send, device) -> list[int]:
        """Rows each rank sends this one: [M] at world size 1, else one count exchange."""
        if self.group is None or self.world == 1:
            return list(send)
        return rows_from_ranks(send, self.group, device)

    def _out_for(self, out, device, rows: int):
        if out is None:
            return torch.empty((rows, self.n), dtype=self.result_dtype, device=device)
        if out.shape[0] != rows:
            raise ValueError(f"out has {out.shape[0]} rows, but the ranks send this rank "
                             f"{rows} rows (their send_splits)")
        return out

    def _sequential(self, a, b, out, send, recv, scales=None):
        """The plan's "sequential" strategy: the device's GEMM (fp8: :meth:`_scaled_product`),
        then one all_to_all_single."""
        alone = self.group is None or self.world == 1
        if alone and scales is None:  # the GEMM writes the result: no copy of it
            return torch.matmul(a, b) if out is None else torch.matmul(a, b, out=out)
        c = torch.matmul(a, b) if scales is None else self._scaled_product(a, b, *scales)
        if alone:
            return c if out is None else out.copy_(c)
        if recv is None:
            recv = self._received(send, a.device)
        out = self._out_for(out, c.device, sum(recv))
        with _collective(self.group, "the plain path's all_to_all"):
            if self.plain is not None:
                self.plain.all_to_all(out, c, send, recv)
            else:
                dist.all_to_all_single(out, c, output_split_sizes=list(recv),
                                       input_split_sizes=list(send), group=self.group)
        return out

    def _scaled_product(self, a, b, scale_a, scale_b) -> torch.Tensor:
        """The plain path's fp8 GEMM of this call's rows, in the result dtype: torch's scaled
        GEMM where it runs this key's calls (fp8.ScaledSequentialCall, probed at the key's first
        call), else the product of the dequantized inputs."""
        if a.shape[0] == 0:  # no rows: nothing to compute (torch's GEMMs may refuse M = 0)
            return torch.empty((0, self.n), dtype=self.result_dtype, device=a.device)
        if self.scaled_mm is not None:
            return self.scaled_mm.product(a, b, scale_a, scale_b, self.result_dtype)
        a32, b32 = fp8.dequantized(a, b, scale_a, scale_b)
        return torch.matmul(a32, b32).to(self.result_dtype)
