"""The communication side of an overlapped call, through torch.distributed.

One :class:`RegionExchange` per call: ``start(g)`` hands group g's contiguous region to the
collective of the caller's process group (whichever collective library it uses) as soon as the
backend knows the group's tiles are in the packed buffer; ``wait()`` joins them; ``finish()``
runs the post-communication reorder into the call's output. A "rows" plan has none: its
allreduce works in place and its reduce_scatter receives into the output's rows (an
all_to_all through torch.distributed lands each group in one buffer first, since
``all_to_all_single`` takes one contiguous output, then moves each source's whole rows to
their place). Collectives are launched with
``async_op=True`` on the current stream, so a backend that sets its communication stream
current before ``start`` gets them ordered after its device-side wait.
"""
from __future__ import annotations

from functools import lru_cache

import torch
import torch.distributed as dist

from .backend import OverlapCall
from .faults import collective as _collective
from .ops import of
from .plan import destination_chunks, layout_unit
from .reorder import add_rmsnorm, block_tiles, stream_offsets, unpack_tiles
from .tiles import RASTERS


# torch 2.13 renamed the tensor forms (the old names warn); older torch has only the old names.
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def resolve_group(group) -> tuple[object | None, int, int]:
    """(group, rank, world size); (None, 0, 1) when torch.distributed is not initialised."""
    initialised = dist.is_available() and dist.is_initialized()
    if group is not None:
        if not dist.is_available() or not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group must be a torch.distributed ProcessGroup or None, "
                            f"got {type(group).__name__}")
        if not initialised:
            raise ValueError("group was given but torch.distributed is not initialised")
    if not initialised:
        return None, 0, 1
    group = group if group is not None else dist.group.WORLD
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the given process group")
    return group, rank, dist.get_world_size(group)


def _default_group_reader():
    """A function giving the default process group, or None when torch.distributed is not
    initialised. It is part of every call's key, so it reads torch's own record directly where
    this torch has it (about 0.1 us instead of 0.5)."""
    world = getattr(getattr(dist, "distributed_c10d", None), "_world", None)
    if world is not None and isinstance(getattr(type(world), "default_pg", None), property):
        return lambda: world.default_pg
    return lambda: dist.group.WORLD if dist.is_initialized() else None


current_default_group = _default_group_reader()


def exchange_objects(obj, group, what: str = "the first call's exchange between the ranks") -> list:
    """Every rank's ``obj`` (small, picklable), in rank order: one collective, host synced
    (under the group's timeout: a peer that does not take part is a CommunicationError)."""
    views = [None] * dist.get_world_size(group)
    with _collective(group, what):
        dist.all_gather_object(views, obj, group=group)
    return views


class SequentialCall:
    """The plain path, for a plan whose strategy is "sequential" (the tuner found that
    overlapping would not pay): the device's own GEMM, then one collective on the whole result,
    through torch.distributed on the caller's group."""

    def __init__(self, call: OverlapCall, norm=None, native=None):
        self.collective = of(call.op).collective
        # a collective over one rank is the identity: none is issued at world size 1 (the
        # overlapped call issues none there either)
        self.group = call.group if call.world_size > 1 else None
        self.world = call.world_size
        self.norm = norm  # the backend's fused add + RMSNorm over rows (Backend.add_rmsnorm_rows)
        # the backend's own collectives on the group (Backend.plain_collectives), else torch's
        self.native = native if self.group is not None else None
        self.gemm_dtype = call.a.dtype  # what torch.matmul(a, b) returns

    def run(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None, op) -> torch.Tensor:
        if self.collective == "all_gather":
            return torch.matmul(self.gathered(a), b, out=out)
        in_place = self.collective in ("all_reduce", None) or self.group is None
        return self.collect(torch.matmul(a, b, out=out) if in_place else torch.matmul(a, b),
                            out, op)

    def makes_result(self, dtype) -> bool:
        """Whether :meth:`run_new` serves this call: the GEMM's own result is the call's (the
        result dtype is the GEMM's, and the collective works in place or gathers a's rows)."""
        return dtype == self.gemm_dtype and (self.collective != "reduce_scatter"
                                             or self.group is None)

    def run_new(self, a: torch.Tensor, b: torch.Tensor, op) -> torch.Tensor:
        """:meth:`run` into a new result that the GEMM allocates (a call without ``out``: one
        allocation and dispatch fewer on the host, what decode-sized calls are bound by)."""
        return self.run(a, b, None, op)

    def gathered(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's ``t`` stacked by rows (allgather's input; fp8 moves as its bytes)."""
        if self.group is None:
            return t
        rows = t.contiguous()
        one_byte_float = rows.element_size() == 1 and rows.is_floating_point()  # fp8
        raw = rows.view(torch.uint8) if one_byte_float else rows
        out = raw.new_empty((raw.shape[0] * self.world,) + tuple(raw.shape[1:]))
        with _collective(self.group, "the plain path's all-gather"):
            if self.native is not None:
                self.native.all_gather(out, raw)
            else:
                all_gather_single(out, raw, group=self.group)
        return out.view(rows.dtype)

    def collect(self, product: torch.Tensor, out: torch.Tensor | None, op) -> torch.Tensor:
        """The collective half of the plain path, on the whole ``product`` (``out`` itself, or
        a buffer apart from it for reduce_scatter): the result in ``out``."""
        collective, group = self.collective, self.group
        if collective in ("all_reduce", None) or group is None:
            if out is not None and product is not out:
                out = out.copy_(product)
            else:
                out = product
            if collective is None:  # a callable op: called on the whole result
                op(out.view(-1), 0)
            elif group is not None:
                with _collective(group, "the plain path's allreduce"):
                    if self.native is not None:
                        self.native.all_reduce(out)
                    else:
                        dist.all_reduce(out, group=group)
            return out
        with _collective(group, "the plain path's reduce-scatter"):
            if self.native is not None:  # (all_to_all: AllToAllCall)
                self.native.reduce_scatter(out, product)
            else:
                reduce_scatter_single(out, product, group=group)
        return out

    def run_add_rmsnorm(self, a, b, op, residual, weight, eps: float):
        """PreparedCall.run_add_rmsnorm: the plain call, then the add and the norm in one
        kernel of the backend's where it has one, else in torch."""
        x = self.run(a, b, residual.new_empty(residual.shape), op)
        fused = self.norm(x, residual, weight, eps) if self.norm is not None else None
        return fused if fused is not None else add_rmsnorm(x, residual, weight, eps)


def packed_buffer(call: OverlapCall) -> torch.Tensor:
    """Where a call's GEMM writes its packed tiles: for a "rows" allreduce or callable op, the
    output itself (its groups are whole rows, transferred in place); else a buffer of its own."""
    plan = call.plan
    if plan.layout == "rows" and plan.kind.in_place and call.out is not None:
        return call.out.view(-1)
    dtype = call.out.dtype if call.out is not None else call.a.dtype
    return torch.empty(plan.packed_numel, dtype=dtype, device=call.a.device)


INVALID = -1  # what a rank whose all_to_all arguments were invalid sends in the count exchange


def exchange_rows(send, group, device) -> list[int]:
    """What each rank sends this one (one all_to_all of the W counts ``send``), as they came:
    the invalid mark included."""
    mine = torch.tensor(send, dtype=torch.int64, device=device)
    theirs = torch.empty_like(mine)
    with _collective(group, "all_to_all's exchange of row counts"):
        dist.all_to_all_single(theirs, mine, group=group)
    return theirs.tolist()


def rows_from_ranks(send, group, device) -> list[int]:
    """Rows each rank sends this one (one all_to_all of W counts); a ValueError on every rank
    when one of them had invalid arguments (it sent the invalid mark)."""
    rows = exchange_rows(send, group, device)
    bad = [r for r, v in enumerate(rows) if v == INVALID]
    if bad:
        raise ValueError(f"all_to_all: the arguments of rank(s) {bad} were invalid (they raised "
                         "the error); this call of the group is abandoned on every rank")
    return rows


@lru_cache(maxsize=4096)
def chunk_numels(rows: int, n: int, tile: tuple[int, int], schedule, groups: int,
                 layout: str = "tiles") -> tuple[int, ...]:
    """Elements of each group's chunk of a destination block of ``rows`` rows
    (plan.destination_chunks over the block's tiles in schedule order)."""
    tiles = block_tiles(rows, n, tile, schedule)
    unit = layout_unit(layout, n, tile, schedule)
    return tuple(sum(t.numel for t in tiles[lo:hi])
                 for lo, hi in destination_chunks(len(tiles), groups, unit))


class RegionExchange:
    """Collectives of one call, one per group, on regions of the packed buffer."""

    def __init__(self, call: OverlapCall, packed: torch.Tensor):
        self.call, self.plan, self.packed = call, call.plan, packed
        self.works: list = []
        self.started = 0
        plan, op = self.plan, call.op
        self.kind = op if isinstance(op, str) else "custom"
        self.collective = of(op).collective
        self.num_collectives = plan.num_groups
        if self.kind == "reduce_scatter" and call.group is not None:
            # "rows": each group brings this rank's next whole rows, straight into the output
            self.staging = call.out.view(-1) if plan.layout == "rows" else \
                packed.new_empty(plan.m // call.world_size * plan.n)
            self.recv_offsets = self._offsets([r.dest_numels[call.rank] for r in plan.regions])
        elif self.kind == "all_to_all" and call.group is not None:
            if plan.grouping == "destinations":
                self._counts_by_rule()
            else:
                self._exchange_counts()
        else:
            self.staging = packed

    @staticmethod
    def _offsets(sizes):
        out, acc = [], 0
        for s in sizes:
            out.append(acc)
            acc += s
        return out

    # ---- all_to_all bookkeeping: what each rank sends me in each group -------------------
    def _counts_by_rule(self):
        """A "destinations" plan: what each source sends this rank in each group follows from
        the rows it sends (plan.destination_chunks), the same rule on every rank. With
        recv_splits given nothing is exchanged (no host sync); without them, the rows are one
        all_to_all of W counts (a host sync), as all_to_all_single users exchange them."""
        call, plan = self.call, self.plan
        rows = call.recv_splits
        if rows is None:
            rows = self._rows_from_ranks()
        groups = plan.num_groups
        per_source = [chunk_numels(r, plan.n, plan.tile, plan.schedule, groups, plan.layout)
                      for r in rows]
        self._received([list(c) for c in zip(*per_source)], groups, list(rows))

    def _rows_from_ranks(self) -> list[int]:
        return rows_from_ranks(self.plan.block_rows, self.call.group, self.packed.device)

    def _exchange_counts(self):
        """A "waves" plan (explicit group sizes, each rank's own): what each source sends this
        rank per group is exchanged through the group on every call (a host sync): the
        sources' splits and groups may change from call to call."""
        self._received(*self._counts_from_ranks())

    def _received(self, recv_counts, num_collectives, recv_rows):
        call, plan = self.call, self.plan
        self.recv_counts, self.num_collectives, self.recv_rows = recv_counts, num_collectives, recv_rows
        rows = sum(self.recv_rows)
        if call.out is None:  # recv_splits were omitted: the output size is known only now
            call.out = self.packed.new_empty((rows, plan.n))
        elif call.out.shape[0] != rows:
            raise ValueError(f"out has {call.out.shape[0]} rows, but the ranks send this rank "
                             f"{rows} rows (their send_splits)")
        self.staging = self.packed.new_empty(sum(self.recv_rows) * plan.n)
        self.recv_offsets = self._offsets([sum(c) for c in self.recv_counts])

    def _counts_from_ranks(self):
        """(elements from each source per group [group][source], collectives, rows from each
        source), from one all_gather of the ranks' plan headers and one all_to_all."""
        call, plan, w = self.call, self.plan, self.call.world_size
        device = self.packed.device
        given = call.recv_splits
        header = [plan.num_groups, plan.tile[0], plan.tile[1], RASTERS.index(plan.schedule.raster),
                  plan.schedule.swizzle, plan.n, *plan.block_rows,
                  int(given is not None), *(given if given is not None else [0] * w)]
        mine = torch.tensor(header, dtype=torch.int64, device=device)
        gathered = [torch.empty_like(mine) for _ in range(w)]
        with _collective(call.group, "the exchange of the ranks' plan headers"):
            dist.all_gather(gathered, mine, group=call.group)
        headers = torch.stack(gathered).tolist()
        self._check_headers(headers)
        g_max = max(h[0] for h in headers)
        counts = torch.zeros(w, g_max, dtype=torch.int64)
        for g, region in enumerate(plan.regions):
            counts[:, g] = torch.tensor(region.dest_numels)
        recv = torch.empty(w * g_max, dtype=torch.int64, device=device)
        with _collective(call.group, "the exchange of per-group counts"):
            dist.all_to_all_single(recv, counts.flatten().to(device), group=call.group)
        return recv.view(w, g_max).t().tolist(), g_max, [h[6 + call.rank] for h in headers]

    def _check_headers(self, headers):
        w, me = self.call.world_size, self.call.rank
        layout = [tuple(h[1:6]) for h in headers]
        if len(set(layout)) != 1:
            raise ValueError("all_to_all plans differ across ranks in (tile BM, BN, raster, "
                             f"swizzle, N): {layout}; every rank must use the same tile and order")
        for q, h in enumerate(headers):
            if h[6 + w]:
                expected = [headers[s][6 + q] for s in range(w)]
                if h[7 + w:7 + 2 * w] != expected:
                    who = "this rank" if q == me else f"rank {q}"
                    raise ValueError(f"recv_splits of {who} are {h[7 + w:7 + 2 * w]}, but the "
                                     f"ranks send it {expected} rows (their send_splits)")

    # ---- the collectives --------------------------------------------------------------------
    def region(self, g: int) -> torch.Tensor:
        r = self.plan.regions[g]
        return self.packed[r.offset:r.offset + r.numel]

    def start(self, g: int) -> None:
        """Launch group g's collective (its tiles must be in the packed buffer)."""
        if g != self.started:
            raise RuntimeError(f"groups must start in order: expected {self.started}, got {g}")
        self.started += 1
        if self.collective is None:  # a callable op: called instead
            self.call.op(self.region(g), g)
            return
        group = self.call.group
        if group is None:
            return  # world size 1 without torch.distributed: the collective is the identity
        region = self.region(g) if g < self.plan.num_groups else self.packed[:0]
        with _collective(group, f"group {g}'s collective"):
            self._launch(g, group, region)

    def _launch(self, g: int, group, region) -> None:
        if self.collective == "all_reduce":
            work = dist.all_reduce(region, group=group, async_op=True)
        elif self.collective == "reduce_scatter":
            off = self.recv_offsets[g]
            part = self.staging[off:off + region.numel() // self.call.world_size]
            work = reduce_scatter_single(part, region, group=group, async_op=True)
        else:
            off, counts = self.recv_offsets[g], self.recv_counts[g]
            sends = list(self.plan.regions[g].dest_numels) if g < self.plan.num_groups else [0] * len(counts)
            work = dist.all_to_all_single(self.staging[off:off + sum(counts)], region,
                                          output_split_sizes=counts, input_split_sizes=sends,
                                          group=group, async_op=True)
        self.works.append(work)

    def launch_remaining(self) -> None:
        """Launch the trailing empty collectives an all_to_all has when other ranks have more
        groups (every rank must take part in each group's collective)."""
        while self.started < self.num_collectives:
            self.start(self.started)

    def wait(self) -> None:
        """Launch any trailing collectives, then make the current stream wait for all."""
        self.launch_remaining()
        with _collective(self.call.group, "waiting for the call's collectives"):
            for work in self.works:
                work.wait()
        self.works.clear()

    # ---- post-communication reorder ----------------------------------------------------------
    def block_layouts(self):
        """For every received block: (its rows of the output, its tiles in schedule order, the
        staging offset of each tile). all_to_all blocks arrive in one segment per group."""
        out, plan = self.call.out, self.plan
        if self.kind != "all_to_all" or self.call.group is None:
            tiles = block_tiles(out.shape[0], plan.n, plan.tile, plan.schedule)
            yield out, tiles, stream_offsets(tiles)
            return
        row = 0
        for s, rows in enumerate(self.recv_rows):
            tiles = block_tiles(rows, plan.n, plan.tile, plan.schedule)
            segments = [(self.recv_offsets[g] + sum(c[:s]), c[s]) for g, c in enumerate(self.recv_counts)]
            offsets, g, used = [], 0, 0
            for t in tiles:
                while used == segments[g][1]:
                    g, used = g + 1, 0
                offsets.append(segments[g][0] + used)
                used += t.numel
            yield out[row:row + rows], tiles, offsets
            row += rows

    def row_moves(self) -> list[tuple[int, int, int]]:
        """A "rows" all_to_all: (staging offset, output offset, elements) of each source's
        part of each group. What a source sends this rank comes group by group, each part its
        next whole rows, so a part's place is the source's first row plus what came before."""
        out, placed, n = [], [0] * len(self.recv_rows), self.plan.n
        starts = self._offsets([r * n for r in self.recv_rows])
        for g, counts in enumerate(self.recv_counts):
            at = self.recv_offsets[g]
            for s, count in enumerate(counts):
                if count:
                    out.append((at, starts[s] + placed[s], count))
                at += count
                placed[s] += count
        return out

    def finish(self) -> torch.Tensor:
        out = self.call.out
        if self.plan.layout != "rows":
            for rows_view, tiles, offsets in self.block_layouts():
                unpack_tiles(self.staging, offsets, tiles, rows_view)
        elif self.kind == "all_to_all" and self.call.group is not None:
            flat = out.view(-1)
            for src, dst, count in self.row_moves():
                flat[dst:dst + count].copy_(self.staging[src:src + count])
        elif self.staging.data_ptr() != out.data_ptr():  # rows computed apart from out
            out.view(-1).copy_(self.staging[:out.numel()])
        return out


# ---- the call as tables (for backends that issue it natively) ---------------------------------

def collective_steps(exchange: RegionExchange) -> tuple[list[int], int, int]:
    """The collectives of a call as a flat table, for a backend that issues them without
    Python per group: ``(rows, num_steps, per_step)``, where step s has ``per_step`` entries
    (one per peer for all_to_all, else one) of {send offset, send count, recv offset,
    recv count}, in elements of the packed buffer (send) and the staging buffer (recv).
    allreduce is in place (recv = send); reduce_scatter receives its 1/W part; all_to_all
    sends each peer its part and receives each source's part at its place in the staging
    buffer; a step past this rank's groups moves nothing but still takes part."""
    call, plan, world = exchange.call, exchange.plan, exchange.call.world_size
    rows: list[int] = []
    if exchange.kind == "all_to_all" and call.group is not None:
        for g in range(exchange.num_collectives):
            region = plan.regions[g] if g < plan.num_groups else None
            send_off = region.offset if region is not None else 0
            recv_off = exchange.recv_offsets[g]
            for peer, got in enumerate(exchange.recv_counts[g]):
                sent = region.dest_numels[peer] if region is not None else 0
                rows += [send_off, sent, recv_off, got]
                send_off += sent
                recv_off += got
        return rows, exchange.num_collectives, world
    for g, region in enumerate(plan.regions):
        if exchange.kind == "reduce_scatter" and call.group is not None:
            rows += [region.offset, region.numel, exchange.recv_offsets[g], region.numel // world]
        else:
            rows += [region.offset, region.numel, region.offset, region.numel]
    return rows, plan.num_groups, 1


def unpack_layouts(exchange: RegionExchange) -> list[tuple[int, list, list[int]]]:
    """The post-communication reorder as tables: per received block with tiles, (its first
    element in ``out``, its tiles as (row0, rows, col0, cols) relative to the block, each
    tile's element offset in the staging buffer); none for a "rows" plan."""
    out, layouts = exchange.call.out, []
    if exchange.plan.layout == "rows":
        return layouts
    for rows_view, tiles, offsets in exchange.block_layouts():
        if tiles:
            start = (rows_view.data_ptr() - out.data_ptr()) // out.element_size()
            layouts.append((start, [(t.row0, t.rows, t.col0, t.cols) for t in tiles], offsets))
    return layouts

