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
"""
from __future__ import annotations

from collections import OrderedDict

import torch
import torch.distributed as dist

from .backend import Backend, OverlapCall
from .checks import check_out_apart, check_splits_use
from .collectives import INVALID, exchange_objects, exchange_rows, rows_from_ranks
from .faults import collective as _collective
from .ops import KINDS

ALL_TO_ALL = KINDS["all_to_all"]

MAX_PLANS = 1024  # per prepared call: plans (and backend preparations) of recent row splits


class AllToAllCall:
    """The prepared all_to_all of one key (see the module docstring)."""

    def __init__(self, backend: Backend, template: OverlapCall):
        self.backend, self.plan = backend, template.plan
        self.group, self.rank, self.world = template.group, template.rank, template.world_size
        self.n = template.plan.n
        self.prepares = type(backend).prepare is not Backend.prepare
        # a backend that lays each call out from its own splits needs no plan per split
        self.native = (backend.prepare_all_to_all(template)
                       if self.plan.grouping == "destinations" and self.plan.strategy == "overlap"
                       else None)
        self._plans: OrderedDict = OrderedDict()
        self._prepared: OrderedDict = OrderedDict()
        self.verified = self.group is None or self.world == 1  # the first call checks splits

    def workspace_bytes(self) -> int:
        """Device memory the backend's preparations keep beyond the calls' outputs (the native
        call's buffers, or those of the prepared plans): ``fo.prepared_calls()`` reports it."""
        runners = [self.native] if self.native is not None else list(self._prepared.values())
        return sum(r.workspace_bytes() for r in runners if hasattr(r, "workspace_bytes"))

    # ---- per call ------------------------------------------------------------------------
    def run(self, a, b, out, op, send_splits, recv_splits) -> torch.Tensor:
        try:  # everything that can refuse this rank's call, before any communication
            send, recv, rows = self._checked(a, send_splits, recv_splits)
            if out is not None:
                self._check_out(out, a, rows)
                check_out_apart(out, a=a, b=b)
            # the backend may refuse these rows
            plan = self._plan_for(a.shape[0], send) if self.native is None else None
        except (TypeError, ValueError) as e:
            if not self.verified:
                self._verify(None, None, a.device, e)  # the peers are in the check: tell them
            elif recv_splits is None and self.group is not None:
                self._tell_peers(a.device)  # they are in the count exchange: let them know
            raise
        if not self.verified:
            self._verify(send, recv, a.device, None)
        if self.native is not None:
            return self._native(a, b, out, send, recv)
        if out is None and rows is not None:
            out = torch.empty((rows, self.n), dtype=a.dtype, device=a.device)
        if plan.strategy == "sequential":
            return self._sequential(a, b, out, send, recv)
        call = OverlapCall(a, b, plan, op, self.group, self.rank, self.world, out, recv)
        if not self.prepares:
            return self.backend.run(call)
        return self._prepared_for(plan, recv, call).run(a, b, out, op)

    def _checked(self, a, send_splits, recv_splits):
        m, world = a.shape[0], self.world
        if a.shape[1] != self.plan.k:
            raise ValueError(f"a must be [rows, {self.plan.k}], got {tuple(a.shape)}")
        send, recv = check_splits_use("all_to_all", world, m, send_splits, recv_splits)
        return send or (m,), recv, ALL_TO_ALL.output_rows(m, world, recv)

    def _check_out(self, out, a, rows) -> None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
        if out.dtype != a.dtype or out.device != a.device:
            raise ValueError(f"out must be {a.dtype} on {a.device}, got {out.dtype} on {out.device}")
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
            plan = self.plan.for_rows(m, send)
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

    def _native(self, a, b, out, send, recv):
        """The backend's own per-call layout: recv_splits omitted are one count exchange."""
        if recv is None:
            recv = tuple(self._received(send, a.device))
            out = self._out_for(out, a, sum(recv))
        elif out is None:
            out = torch.empty((sum(recv), self.n), dtype=a.dtype, device=a.device)
        return self.native.run(a, b, out, send, recv)

    def _received(self, send, device) -> list[int]:
        """Rows each rank sends this one: [M] at world size 1, else one count exchange."""
        if self.group is None or self.world == 1:
            return list(send)
        return rows_from_ranks(send, self.group, device)

    def _out_for(self, out, a, rows: int):
        if out is None:
            return a.new_empty((rows, self.n))
        if out.shape[0] != rows:
            raise ValueError(f"out has {out.shape[0]} rows, but the ranks send this rank "
                             f"{rows} rows (their send_splits)")
        return out

    def _sequential(self, a, b, out, send, recv):
        """The plan's "sequential" strategy: the device's GEMM, then one all_to_all_single."""
        c = torch.matmul(a, b)
        if self.group is None or self.world == 1:
            return c if out is None else out.copy_(c)
        if recv is None:
            recv = self._received(send, a.device)
            out = self._out_for(out, c, sum(recv))
        with _collective(self.group, "the plain path's all_to_all"):
            dist.all_to_all_single(out, c, output_split_sizes=list(recv),
                                   input_split_sizes=list(send), group=self.group)
        return out
