"""The cases of the conformance matrix and the inputs they run on.

Not the full cartesian product: every world size runs every op on every shape once, and the
other dimensions (dtype, layout of ``b``, grouping, splits, poisoned ``out`` or not) rotate with
the shape index and the world size, so each pair of values of two dimensions appears somewhere
while the whole suite stays a few minutes on two host cores.

Inputs come from seeds alone: any rank regenerates any rank's ``a``, ``b`` and splits from
(base seed, case, rank), which is how each rank recomputes the float64 reference by itself.
"""
from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

import torch

COLLECTIVES = ("allreduce", "reduce_scatter", "all_to_all", "allgather")
DTYPES = ("float32", "float16", "bfloat16")
GROUPINGS = ("one", "per_wave", "uneven", "heuristic", "auto")
"""one group; one group per wave; random uneven explicit group_sizes; the backend's default
grouping for an explicit tile (fo.plan without group_sizes); no plan at all (overlap's default)."""
LAYOUTS = ("row", "col", "strided")
"""b contiguous [K, N]; w.t() of a contiguous [N, K]; every other column of a [K, 2N]."""
SPLITS = ("send+recv", "send", "none")  # all_to_all: splits given; "none" only at world size 1
MIXED_SPLITS = "mixed"  # send+recv, equal splits on rank 0 and unequal (with a zero) elsewhere
MOE_SPLITS = "moe"
"""An MoE sequence: every call, each rank's rows and splits are new (rank r's rows change every
r + 1 calls, its splits every call), skewed towards one destination, with zeros; a rank has no
rows at all now and then; recv_splits are given on even calls and omitted on odd ones."""
CHOICES = ("named", "default")
"""the backend under test named in every call (backend=); or no backend= and no
FLASHOVERLAP_BACKEND: the automatic choice users get, which every rank must make alike."""
CUSTOM_KINDS = ("noop", "negate")


@dataclass(frozen=True)
class Shape:
    m: int
    n: int
    k: int
    tile: tuple[int, int]  # small, so that there are many tiles and groups


SHAPES = (
    Shape(1, 1, 1, (1, 1)),
    Shape(7, 127, 4097, (4, 16)),
    Shape(127, 7, 127, (16, 2)),
    Shape(1000, 127, 7, (64, 32)),
    Shape(4097, 7, 33, (256, 4)),
    Shape(127, 1000, 1, (32, 64)),
    Shape(33, 257, 129, (8, 32)),
    Shape(64, 64, 64, (8, 8)),
    Shape(200, 96, 1000, (24, 16)),
    Shape(2, 4097, 16, (1, 512)),
)


@dataclass(frozen=True)
class Case:
    op: str  # one of COLLECTIVES, or "custom"
    world_size: int
    dtype: str
    m: int  # rows of a (all_to_all: the most rows a rank has; ranks have 1..m; allgather:
    # every rank's rows, so the result has W*m)
    n: int
    k: int
    tile: tuple[int, int]
    layout: str
    grouping: str
    poison_out: bool = True  # pass out= filled with NaN; else let overlap allocate it
    splits: str = "send+recv"  # all_to_all only
    custom: str = "noop"  # custom op only
    calls: int = 1  # back-to-back calls with the same plan (fresh inputs each), e.g. 2
    choice: str = "named"  # one of CHOICES
    requested_tile: tuple[int, int] | None = None  # the shape's tile, when the backend has no
    # kernel for it and ``tile`` is the one the backend declares instead (see runner.for_backend)

    @property
    def id(self) -> str:
        op = f"custom-{self.custom}" if self.op == "custom" else self.op
        if self.op == "all_to_all":
            op += "-" + self.splits
        return (f"W{self.world_size}-{op}-{self.dtype}-{self.m}x{self.n}x{self.k}-b{self.layout}-"
                f"{self.grouping}-{self._tile}-"
                f"{'out' if self.poison_out else 'alloc'}"
                f"{f'-x{self.calls}' if self.calls > 1 else ''}"
                f"{'-default-backend' if self.choice == 'default' else ''}")

    @property
    def _tile(self) -> str:
        if self.grouping == "auto":
            return "tile-default"  # no plan is passed: overlap's own tile
        note = ("" if self.requested_tile is None else
                f"-backend-tile-for-{self.requested_tile[0]}x{self.requested_tile[1]}")
        return f"tile{self.tile[0]}x{self.tile[1]}{note}"

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def reduces(self) -> bool:
        return self.op in ("allreduce", "reduce_scatter")


def rank_matrix(world_sizes) -> list[Case]:
    """The cases run on spawned ranks."""
    cases = []
    for w in world_sizes:
        for o, op in enumerate(COLLECTIVES):
            for i, shape in enumerate(SHAPES):
                m = -(-shape.m // w) * w if op == "reduce_scatter" else shape.m
                cases.append(Case(
                    op, w, DTYPES[(i + w) % 3], m, shape.n, shape.k, shape.tile,
                    LAYOUTS[(i + w + o) % 3], GROUPINGS[(i + 2 * w + o) % 5],
                    poison_out=(i + w + o) % 4 != 3, splits=SPLITS[(i + w) % 2],
                    calls=2 if (i + o) % 3 == w % 3 else 1))
        for j in range(3):
            shape = SHAPES[(w + 3 * j) % len(SHAPES)]
            cases.append(Case("custom", w, DTYPES[(w + j) % 3], shape.m, shape.n, shape.k,
                              shape.tile, LAYOUTS[j], GROUPINGS[(w + j) % 5],
                              poison_out=(w + j) % 3 != 2, custom=CUSTOM_KINDS[(w + j) % 2]))
    return cases


def default_choice_matrix(world_sizes) -> list[Case]:
    """Cases without backend=: every op at every world size on two shapes, bf16 and fp16 (the
    dtypes accelerator backends take), all_to_all with splits equal on one rank and unequal on
    the others (ranks whose own facts would pick different backends)."""
    cases = []
    for w in world_sizes:
        for o, op in enumerate(COLLECTIVES):
            for j, shape in enumerate((SHAPES[6], SHAPES[8])):
                m = -(-shape.m // w) * w if op == "reduce_scatter" else shape.m
                cases.append(Case(op, w, DTYPES[1 + (j + o) % 2], m, shape.n, shape.k, shape.tile,
                                  LAYOUTS[(j + o) % 2], "auto", poison_out=j == 0,
                                  splits=MIXED_SPLITS if w > 1 else "send+recv",
                                  calls=2, choice="default"))
    return cases


def single_process_matrix() -> list[Case]:
    """World size 1 without torch.distributed: every op, each all_to_all splits variant and
    each custom kind, with every dtype and grouping appearing."""
    cases, i = [], 0
    variants = ([(op, "send+recv", "noop") for op in COLLECTIVES]
                + [("all_to_all", s, "noop") for s in SPLITS[1:]]
                + [("custom", "send+recv", kind) for kind in CUSTOM_KINDS for _ in DTYPES])
    for op, splits, kind in variants:
        shape = SHAPES[(2 * i + 1) % len(SHAPES)]
        cases.append(Case(op, 1, DTYPES[i % 3], shape.m, shape.n, shape.k, shape.tile,
                          LAYOUTS[i % 2], GROUPINGS[i % 5], poison_out=i % 3 != 2,
                          splits=splits, custom=kind))
        i += 1
    return cases


def seed_of(*parts) -> int:
    """A 63-bit seed from any printable parts, the same in every process."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass(frozen=True)
class RankInput:
    """What rank ``rank`` passes to overlap (on the host; the runner moves it to its device)."""

    a: torch.Tensor
    b: torch.Tensor  # [K, N]; a view for layouts "col" and "strided"
    send_splits: tuple[int, ...] | None  # all_to_all only


def rank_rows(case: Case, seed: int, rank: int, call: int = 0) -> tuple[int, tuple[int, ...] | None]:
    """(rows of a, send_splits) of one rank at call ``call``. all_to_all ranks have ragged row
    counts, and their splits are random with at least one zero when there are several ranks;
    in an MoE sequence both change from call to call (MOE_SPLITS)."""
    if case.op != "all_to_all":
        return case.m, None
    if case.splits == MOE_SPLITS:
        return moe_rows(case, seed, rank, call)
    rng = random.Random(seed_of(seed, case.id, "rows", rank))
    w = case.world_size
    if case.splits == MIXED_SPLITS and rank == 0:
        share = max(1, case.m // w)
        return share * w, (share,) * w
    m = rng.randint(max(1, case.m // 2), case.m)
    cuts = sorted(rng.choices(range(m + 1), k=w - 1))
    splits = [b - a for a, b in zip([0] + cuts, cuts + [m])]
    if w > 1:
        zero = (rank + case.m) % w  # move one destination's rows to its neighbour
        splits[(zero + 1) % w] += splits[zero]
        splits[zero] = 0
    return m, tuple(splits)


def moe_rows(case: Case, seed: int, rank: int, call: int) -> tuple[int, tuple[int, ...]]:
    w = case.world_size
    epoch = call // (rank + 1)
    rows = random.Random(seed_of(seed, case.id, "moe-rows", rank, epoch)).randint(1, case.m)
    if (call + rank) % 5 == 4:
        rows = 0  # no token routed here this step
    rng = random.Random(seed_of(seed, case.id, "moe-splits", rank, call))
    hot = rng.randrange(w)  # top-k routing with imbalance: one destination takes most rows
    weights = [5.0 if d == hot else rng.choice((0.0, 0.3, 1.0)) for d in range(w)]
    cuts = [0.0]
    for x in weights:
        cuts.append(cuts[-1] + x)
    ends = [round(rows * c / cuts[-1]) for c in cuts]
    return rows, tuple(b - a for a, b in zip(ends, ends[1:]))


def moe_recv_given(call: int) -> bool:
    """Whether call ``call`` of an MoE sequence passes recv_splits (the same on every rank)."""
    return call % 2 == 0


def moe_matrix(world_sizes) -> list[Case]:
    """MoE sequences (MOE_SPLITS): 8 calls each, three per world size with the backend named
    (every dtype and layout of b) and one with the automatic choice."""
    cases = []
    for w in world_sizes:
        for j, shape in enumerate((SHAPES[8], SHAPES[6], SHAPES[3])):
            cases.append(Case("all_to_all", w, DTYPES[(w + j) % 3], 4 * shape.m // 3, shape.n,
                              shape.k, shape.tile, LAYOUTS[(w + j) % 3], "auto",
                              poison_out=j != 1, splits=MOE_SPLITS, calls=8))
        shape = SHAPES[6]
        cases.append(Case("all_to_all", w, DTYPES[1 + w % 2], shape.m * 3, shape.n, shape.k,
                          shape.tile, "col", "auto", splits=MOE_SPLITS, calls=8, choice="default"))
    return cases


def rank_input(case: Case, seed: int, rank: int, device="cpu", call: int = 0) -> RankInput:
    """Rank ``rank``'s inputs for call ``call`` of the case, on ``device`` (b's view is taken
    there, so its layout is kept). Row counts and splits are the same for every call, but in
    an MoE sequence."""
    m, splits = rank_rows(case, seed, rank, call)
    g = torch.Generator().manual_seed(seed_of(seed, case.id, "tensors", rank, call))
    a = torch.randn(m, case.k, generator=g).to(case.torch_dtype)
    if case.layout == "col":
        b = torch.randn(case.n, case.k, generator=g).to(case.torch_dtype).to(device).t()
    elif case.layout == "strided":
        b = torch.randn(case.k, 2 * case.n, generator=g).to(case.torch_dtype).to(device)[:, ::2]
    else:
        b = torch.randn(case.k, case.n, generator=g).to(case.torch_dtype).to(device)
    return RankInput(a.to(device), b, splits)


def recv_splits(case: Case, seed: int, rank: int, call: int = 0) -> tuple[int, ...]:
    """Rows each rank sends to ``rank`` in an all_to_all (what its recv_splits must be)."""
    return tuple(rank_rows(case, seed, src, call)[1][rank] for src in range(case.world_size))
