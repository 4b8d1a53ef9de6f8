"""What each op means, in one table: the code that depends on an op reads its row here.

A call's ``op`` is a name (``"allreduce"``, ``"reduce_scatter"``, ``"all_to_all"``,
``"allgather"``) or a callable ``op(region, index)``, whose plans and specs name it
``"custom"``. :func:`op_name` turns what a user passed into one of those names (or says what is
accepted); :func:`of` gives the row of a name (or of a callable). A row says:

* ``collective``: what torch.distributed runs on a group's region: ``"all_reduce"``,
  ``"reduce_scatter"``, ``"all_to_all"`` or ``"all_gather"``; None for a callable, which is
  called instead;
* ``blocks``: how the rows of c = (gathered) a @ b split into blocks: ``"one"``; ``"ranks"``,
  W equal blocks (reduce_scatter: one per destination, allgather: one per source shard);
  ``"splits"``, one per destination of ``send_splits`` rows (all_to_all);
* ``output``: what the call returns of c: ``"all"`` of it, this rank's ``"block"``
  (reduce_scatter), or the rows it has ``"received"`` (all_to_all);
* ``reduces``: the ranks' results are summed (the ops ``overlap_add_rmsnorm`` takes);
* ``splits``: ``send_splits`` and ``recv_splits`` apply, and the rows are each call's own
  (M = 0 allowed, rows not part of a prepared key);
* ``gathers``: the collective feeds the GEMM instead of consuming it (allgather: a is the
  rank's shard, c has W times its rows, and the plan packs the gathered a);
* ``in_place``: a "rows" plan's packed buffer is the output itself (the collective works in
  place, or nothing is moved).

The rows of each call follow from these (:meth:`OpKind.result_rows`,
:meth:`OpKind.output_rows`, :meth:`OpKind.block_rows`), as does the unit of its group sizes
(:meth:`OpKind.group_unit`).
"""
from __future__ import annotations

from dataclasses import dataclass

OPS = ("allreduce", "reduce_scatter", "all_to_all", "allgather")
GATHER_OP = "allgather"  # the one op whose collective comes before the GEMM
CUSTOM_OP = "custom"  # a callable op: one block, laid out like allreduce
PLAN_OPS = OPS + (CUSTOM_OP,)


@dataclass(frozen=True)
class OpKind:
    """One op's row of the table (see the module docstring)."""

    name: str
    collective: str | None
    blocks: str  # "one", "ranks" or "splits"
    output: str = "all"  # "all", "block" or "received"
    reduces: bool = False
    splits: bool = False
    gathers: bool = False

    @property
    def in_place(self) -> bool:
        """Whether a "rows" plan's packed buffer is the output: one block, not gathered."""
        return self.blocks == "one"

    @property
    def min_rows(self) -> int:
        """The fewest rows of a: 0 where the rows are each call's own (a rank may have none
        to send), else 1."""
        return 0 if self.splits else 1

    def result_rows(self, m: int, world_size: int) -> int:
        """Rows of c = (gathered) a @ b for a of ``m`` rows: the plan's M."""
        return m * world_size if self.gathers else m

    def output_rows(self, m: int, world_size: int, recv_splits=None) -> int | None:
        """Rows of the call's result for a of ``m`` rows (None: known only after the ranks
        exchange their splits)."""
        if self.output == "block":
            return m // world_size
        if self.output == "received" and world_size > 1:
            return sum(recv_splits) if recv_splits is not None else None
        return self.result_rows(m, world_size)

    def block_rows(self, m: int, world_size: int, send_splits=None) -> tuple[int, ...]:
        """Rows of each block of c of ``m`` rows (the plan's M): sent to each destination,
        or for allgather computed from each source rank's shard."""
        if self.blocks == "ranks":
            return (m // world_size,) * world_size
        if self.blocks == "splits" and send_splits is not None:
            return tuple(send_splits)
        return (m,)

    def group_unit(self, world_size: int, n: int, tile: tuple[int, int], strip: int = 1) -> int:
        """Tiles every group size must be a multiple of, with the default tile order and a
        layout that takes ``strip`` tiles of a block at a time: allgather, one row band of
        every shard (W x column tiles: a group is a chunk of whole bands); reduce_scatter, a
        strip of every destination (each group holds the same rows for every rank); else a
        strip."""
        if self.gathers:
            return world_size * -(-n // tile[1])
        return (world_size if self.blocks == "ranks" else 1) * strip


KINDS = {kind.name: kind for kind in (
    OpKind("allreduce", "all_reduce", "one", reduces=True),
    OpKind("reduce_scatter", "reduce_scatter", "ranks", "block", reduces=True),
    OpKind("all_to_all", "all_to_all", "splits", "received", splits=True),
    OpKind(GATHER_OP, "all_gather", "ranks", gathers=True),
    OpKind(CUSTOM_OP, None, "one"),
)}
REDUCE_OPS = tuple(name for name in OPS if KINDS[name].reduces)


def of(op) -> OpKind:
    """The row of ``op``: a name of :data:`PLAN_OPS`, or a callable (``"custom"``)."""
    return KINDS[op if isinstance(op, str) else CUSTOM_OP]


def op_name(op) -> str:
    """The name of a user's ``op``: itself for a name of :data:`OPS`, ``"custom"`` for a
    callable; anything else is a TypeError or ValueError saying what is accepted."""
    if callable(op) and not isinstance(op, str):
        return CUSTOM_OP
    if not isinstance(op, str):
        raise TypeError(f"op must be one of {OPS} or a callable op(region, index), "
                        f"got {type(op).__name__}")
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS} or a callable op(region, index), got {op!r}")
    return op
