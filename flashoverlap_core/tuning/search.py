"""Choosing the grouping: dynamic programming over wave boundaries, the never-slower fallback,
and the candidate sets of the measured (exhaustive) search.

Groups are runs of whole waves (``OverlapModel.boundaries``). Under the model, what happens
after a group's transfer depends on the groups before it only through when that transfer
ended and how far the GEMM had got by then (the state), and ending earlier with the GEMM further
along is never worse: a later state is an earlier one shifted in time, and more progress at the
same time means the next group is ready no later and less of the GEMM is left to slow the next
transfer down. (This holds while running both together beats running them one after the other,
``gemm * (1 - 1/comm) <= 1``; beyond that the model says overlap does not pay, and a state
that waited can beat one that did not -- the search then still returns a valid grouping, and
the fallback below takes over.) So the best groupings of the first j boundaries extend best
groupings of some first i by one group from i to j: a dynamic program over n boundaries in
O(n^2), vectorised over i, keeping per boundary the states that no other beats on both counts
(one, unless the transfers slow the GEMM down).

Never slower: the grouping is used only when it is predicted to beat, by ``min_gain``, both the
one-group overlapped call and the plain path (the device's own GEMM, then one collective;
measured by the tuner); otherwise the choice is the faster of those two, and for the plain path
its strategy is "sequential" (``Plan.strategy``).
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

import numpy as np

from .model import OverlapModel

OVERLAP, SEQUENTIAL = "overlap", "sequential"  # Plan.strategy values


@dataclass(frozen=True)
class Choice:
    """The grouping chosen for a model, with its predicted and the sequential duration."""

    group_sizes: tuple[int, ...]
    predicted_s: float  # of what is chosen (the plain path's measured time for "sequential")
    sequential_s: float  # predicted, one group through the overlapped call
    search_s: float  # how long the search took
    fell_back: bool  # overlap predicted not to pay: one group, or the plain path
    strategy: str = OVERLAP  # SEQUENTIAL: run the plain path (the groups are then unused)
    plain_s: float | None = None  # the plain path, measured (None: not measured)
    overlap_s: float | None = None  # the best grouping's prediction, chosen or not


def sizes_from_ends(ends) -> tuple[int, ...]:
    """Group sizes from increasing group ends (tile counts)."""
    ends = [int(e) for e in ends]
    return tuple(b - a for a, b in zip([0] + ends, ends))


def best_ends(model: OverlapModel, max_states: int = 16) -> list[int]:
    """The group ends that finish the call earliest (dynamic program, see the module
    docstring); ``model`` is an OverlapModel or a GatherModel.

    A state is a history ending a group at a boundary, two numbers that are better lower
    (``model.initial`` / ``model.step``; for the output-side ops when the group's transfer
    ended and minus how far the GEMM had got). Per boundary only the states no other state
    beats on both counts are kept; with no GEMM slowdown there is only ever one. Beyond
    ``max_states`` of them, the extremes and states evenly spread between them are kept (exact
    on every small case tested against brute force; on 500 waves within 0.2% of keeping twice
    as many).
    """
    ends = model.boundaries()
    tiles = np.concatenate([[0], ends])
    # Every kept state, in boundary order: its boundary (0: nothing sent yet), its two numbers
    # and the state it came from. State 0 is the start.
    room = len(ends) * max_states + 1
    at, parent = np.zeros(room, np.int64), np.full(room, -1, np.int64)
    first, second = np.zeros(room), np.zeros(room)
    first[0], second[0] = model.initial()
    count = 1
    for j in range(1, len(ends) + 1):
        a, b = model.step(tiles[at[:count]], first[:count], second[:count], int(ends[j - 1]))
        order = np.lexsort((b, a))
        better = b[order][1:] < np.minimum.accumulate(b[order])[:-1]
        front = order[np.concatenate([[True], better])]
        if len(front) > max_states:  # keep the extremes and states spread between them
            front = front[np.unique(np.linspace(0, len(front) - 1, max_states).round().astype(int))]
        new = slice(count, count + len(front))
        at[new], first[new], second[new], parent[new] = j, a[front], b[front], front
        count += len(front)
    state = int(np.flatnonzero(at[:count] == len(ends))[np.argmin(first[new])])
    chosen = []
    while state > 0:
        chosen.append(int(ends[at[state] - 1]))
        state = int(parent[state])
    return chosen[::-1]


MIN_GAIN = 0.005  # overlap must be predicted to save 0.5%: below that, measurement noise decides


def predictive_search(model: OverlapModel, min_gain: float = MIN_GAIN,
                      plain_s: float | None = None) -> Choice:
    """The predicted-best grouping, unless it is not predicted to be faster, by the fraction
    ``min_gain``, than both the one-group call and the plain path (``plain_s``: its measured
    seconds; None: not measured, so only one group is the alternative)."""
    began = time.perf_counter()
    sequential = model.sequential()
    best = sizes_from_ends(best_ends(model))
    predicted = model.predict(best)
    baseline = sequential if plain_s is None else min(sequential, plain_s)
    if predicted < baseline * (1.0 - min_gain):
        return Choice(best, predicted, sequential, time.perf_counter() - began, False,
                      OVERLAP, plain_s, predicted)
    if plain_s is not None and plain_s <= sequential:
        choice = (model.num_tiles,), plain_s, SEQUENTIAL
    else:
        choice = (model.num_tiles,), sequential, OVERLAP
    return Choice(choice[0], choice[1], sequential, time.perf_counter() - began, True,
                  choice[2], plain_s, predicted)


def all_groupings(model: OverlapModel, boundaries=None):
    """Every grouping whose group ends are among ``boundaries`` (default: every wave boundary);
    2^(n-1) of them for n boundaries."""
    ends = list(model.boundaries() if boundaries is None else boundaries)
    inner, last = ends[:-1], ends[-1]
    for picked in itertools.product((False, True), repeat=len(inner)):
        yield sizes_from_ends([e for e, keep in zip(inner, picked) if keep] + [last])


def measured_candidates(model: OverlapModel, limit: int = 64, extra=()) -> list[tuple[int, ...]]:
    """Groupings for the measured search: every wave-boundary grouping when there are at most
    ``limit``, else every grouping over a coarser grid of boundaries (evenly spaced among the
    wave boundaries) with at most ``limit`` members; plus ``extra`` (e.g. the predicted
    choice). One group comes first."""
    ends = model.boundaries()
    keep = max(1, int(math.log2(max(limit, 1))) + 1)
    if len(ends) > keep:
        picks = np.unique(np.round(np.linspace(0, len(ends) - 1, keep)).astype(int))
        ends = ends[picks]
    found = sorted(all_groupings(model, ends), key=len)
    for sizes in extra:
        if tuple(sizes) not in found:
            found.append(tuple(sizes))
    return found
