"""The native all_to_all layout (csrc/cuda/a2a_layout.cuh: the closed forms from which the cuda
backend builds each call's work items on the device and its collectives' counts on the host)
against the Python plan, the specification, in both layouts:

* "tiles": the work items in execution order (Plan.item_table) with their groups and packed
  offsets, each part's offset and size on both sides (Plan.regions), and the post-reorder's
  tiles of the received blocks with their staging offsets (RegionExchange.block_layouts' rule);
* "rows": the same items at their final places in the row-major product (row0 * N + col0), each
  part the rows of Plan.slabs (send: rows of the product; receive: rows of the output, the
  source's first row plus the chunk's), and no post-reorder.

Compiled as a host program with the system's C++ compiler (no GPU, no nvcc)."""
from __future__ import annotations

import random
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from flashoverlap_core.collectives import chunk_numels
from flashoverlap_core.plan import Plan, destination_group_sizes
from flashoverlap_core.reorder import block_tiles
from flashoverlap_core.tiles import Schedule, TileGrid
from flashoverlap_backends.cuda.build import find_nvcc

ROOT = Path(__file__).resolve().parents[1]
COMPILER = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
NVCC = find_nvcc()
pytestmark = pytest.mark.skipif(COMPILER is None, reason="no C++ compiler on PATH")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (the kernels' headers "
                                "compile with it)")


def _host_program(factory, compiler: str, source: str) -> Path:
    """``tests/native/<source>`` built with the csrc/cuda headers."""
    exe = factory.mktemp("native") / Path(source).stem
    subprocess.run([compiler, "-std=c++17", "-O1", f"-I{ROOT / 'csrc' / 'cuda'}",
                    str(ROOT / "tests" / "native" / source), "-o", str(exe)],
                   check=True, capture_output=True, text=True)
    return exe


@pytest.fixture(scope="module")
def layout_program(tmp_path_factory) -> Path:
    return _host_program(tmp_path_factory, COMPILER, "a2a_layout_main.cpp")


@pytest.fixture(scope="module")
def decode_program(tmp_path_factory) -> Path:
    return _host_program(tmp_path_factory, NVCC, "decode_items_main.cu")


def decoded(program: Path, lines: list[str]) -> list[list[tuple]]:
    """The kernels' decode_item of each input line's items (decode_items_main.cu)."""
    out = subprocess.run([str(program)], input="".join(lines), capture_output=True, text=True,
                         check=True).stdout.split("end\n")[:-1]
    return [[tuple(map(int, row.split())) for row in part.splitlines()] for part in out]


def native_layouts(program: Path, cases) -> list[dict]:
    """Each case (tile, n, schedule, groups, send, recv, layout) through the host program."""
    text = "".join(f"{bm} {bn} {n} {int(s.raster == 'm')} {s.swizzle} {g} {int(layout == 'rows')} "
                   f"{len(send)} {' '.join(map(str, send))} {' '.join(map(str, recv))}\n"
                   for (bm, bn), n, s, g, send, recv, layout in cases)
    lines = subprocess.run([str(program)], input=text, capture_output=True, text=True,
                           check=True).stdout.splitlines()
    out, i = [], 0

    def parts(name):
        nonlocal i
        assert lines[i] == name, (name, lines[i])
        rows = [list(map(int, x.split())) for x in lines[i + 1:i + 1 + groups]]
        i += 1 + groups
        return [list(zip(r[0::2], r[1::2])) for r in rows]  # [group][block] = (offset, count)

    for (_, _, _, groups, _, _, _) in cases:
        count = int(lines[i].split()[1])
        items = [tuple(map(int, x.split())) for x in lines[i + 1:i + 1 + count]]
        i += 1 + count
        send, recv = parts("send"), parts("recv")
        count = int(lines[i].split()[1])
        unpack = [tuple(map(int, x.split())) for x in lines[i + 1:i + 1 + count]]
        i += 1 + count
        assert lines[i] == "end"
        i += 1
        out.append({"items": items, "send": send, "recv": recv, "unpack": unpack})
    return out


def make_plan(tile, n, schedule, groups, rows, layout="tiles") -> Plan:
    """The plan of the cuda backend's all_to_all over destination blocks of these rows."""
    grid = TileGrid(tuple(rows), n, tile[0], tile[1], schedule)
    return Plan(sum(rows), n, 64, "all_to_all", len(rows), "bfloat16", tile, 128,
                destination_group_sizes(grid, groups, layout), schedule,
                tuple(rows) if len(rows) > 1 else None, grouping="destinations", layout=layout)


def plan_items(tile, n, schedule, groups, send, layout="tiles"):
    """The work items of the plan the cuda backend runs for these rows, with each item's
    group: Plan.item_table ("tiles"), or with each tile's final place in the row-major
    product ("rows": row0 * N + col0)."""
    plan = make_plan(tile, n, schedule, groups, send, layout)
    items, item_group = plan.item_table()
    rows = [tuple(r) + (g,) for r, g in zip(items.tolist(), item_group.tolist())]
    if layout == "rows":
        rows = [(blk, band, col, t.row0 * n + t.col0, g) for (blk, band, col, _, g), t
                in zip(rows, plan.execution_order)]
    return rows


def plan_parts(tile, n, schedule, groups, rows, layout="tiles"):
    """[group][block] = (offset, elements) of each part of a plan over blocks of these rows:
    "tiles", in the packed buffer (Plan.regions); "rows", the rows of Plan.slabs in the
    row-major [sum(rows), N] (offset None for an empty part: it has no rows to start at)."""
    plan = make_plan(tile, n, schedule, groups, rows, layout)
    if layout == "tiles":
        return [[(r.offset + sum(r.dest_numels[:d]), r.dest_numels[d]) for d in range(len(rows))]
                for r in plan.regions]
    out = []
    for g, slabs in enumerate(plan.slabs):
        starts = iter(slabs)
        part = []
        for d, (r0, r1) in enumerate(plan.row_parts[g]):
            if r1 > r0:
                first, end, _ = next(starts)
                assert (first, end) == (plan.grid.block_starts[d] + r0, plan.grid.block_starts[d] + r1)
                part.append((first * n, (end - first) * n))
            else:
                part.append((None, 0))
        out.append(part)
    return out


def native_parts(parts):
    """The native parts with empty ones' offsets left out (as plan_parts does for "rows")."""
    return [[(off if count else None, count) for off, count in g] for g in parts]


def expected_unpack(tile, n, schedule, groups, recv):
    """The received blocks' tiles in schedule order, source by source, with their staging
    offsets: group by group, source by source, each source's chunk back to back."""
    sizes = [chunk_numels(r, n, tile, schedule, groups) for r in recv]
    out, row = [], 0
    for s, rows in enumerate(recv):
        tiles = block_tiles(rows, n, tile, schedule)
        bounds = [g * len(tiles) // groups for g in range(groups + 1)]
        for g in range(groups):
            offset = sum(sizes[q][h] for h in range(g) for q in range(len(recv)))
            offset += sum(sizes[q][g] for q in range(s))
            for t in tiles[bounds[g]:bounds[g + 1]]:
                out.append((row + t.row0, t.rows, t.col0, t.cols, offset))
                offset += t.numel
        row += rows
    return out


def random_case(rng: random.Random, layout: str = "tiles"):
    """A random call: ragged N and rows (partial last bands and column tiles), zero-row blocks,
    unequal splits, 1-8 ranks; "rows" takes raster "n" (the layout's strips are whole bands)."""
    bm = rng.choice([64, 128, 128])
    bn = rng.choice([64, 128, 256])
    n = rng.choice([1, 8, 200, 256, 1000, 4096, rng.randint(1, 3000)])
    raster = rng.choice("nm") if layout == "tiles" else "n"
    schedule = Schedule(raster, rng.choice([1, 2, 3, 8]))
    world = rng.choice([1, 2, 3, 4, 5, 8])
    groups = rng.choice([1, 2, 4, 5]) if world > 1 else rng.choice([1, 4])

    def rows():
        hot = rng.random() < 0.3
        return [0 if rng.random() < 0.2 else rng.randint(1, 2000 if hot else 400) for _ in range(world)]

    return (bm, bn), n, schedule, groups, rows(), rows(), layout


FIXED_CASES = [
    ((128, 256), 4096, Schedule("n", 8), 4, [300, 0, 77], [5, 129, 0]),  # zeros, ragged
    ((128, 256), 7168, Schedule("n", 8), 4, [0, 0], [0, 0]),  # a rank with no rows
    ((128, 128), 100, Schedule("m", 3), 3, [1, 1000, 129, 5], [128, 127, 0, 1]),
    ((128, 256), 1000, Schedule("n", 2), 4, [1, 255, 256, 257], [2000, 0, 0, 3]),  # bands +- 1
    ((128, 128), 8, Schedule("n", 3), 5, [128 * 7 + 1, 0, 64, 0, 1], [0, 1, 2, 3, 4]),
    ((128, 256), 4097, Schedule("n", 1), 4, [513], [513]),  # world size 1, partial column
]


def test_native_layout_matches_the_plan(layout_program):
    rng = random.Random()  # fresh cases every run; a failure prints its case
    cases = [random_case(rng) for _ in range(60)] + [c + ("tiles",) for c in FIXED_CASES]
    for case, got in zip(cases, native_layouts(layout_program, cases)):
        tile, n, schedule, groups, send, recv, _ = case
        assert got["items"] == plan_items(tile, n, schedule, groups, send), \
            f"work items differ for {case}"
        assert got["send"] == plan_parts(tile, n, schedule, groups, send), \
            f"send parts differ for {case}"
        assert got["recv"] == plan_parts(tile, n, schedule, groups, recv), \
            f"receive parts differ for {case}"
        assert got["unpack"] == expected_unpack(tile, n, schedule, groups, recv), \
            f"receive tiles differ for {case}"


def test_native_rows_layout_matches_the_plan(layout_program):
    """The "rows" layout: items at their final places in the product, each part the plan's
    rows (Plan.slabs) on both sides, the parts of a block consecutive and covering it, no
    post-reorder."""
    rng = random.Random()
    cases = [random_case(rng, "rows") for _ in range(80)]
    cases += [c + ("rows",) for c in FIXED_CASES if c[2].raster == "n"]
    for case, got in zip(cases, native_layouts(layout_program, cases)):
        tile, n, schedule, groups, send, recv, layout = case
        assert got["items"] == plan_items(tile, n, schedule, groups, send, layout), \
            f"work items differ for {case}"
        assert native_parts(got["send"]) == plan_parts(tile, n, schedule, groups, send, layout), \
            f"send parts differ for {case}"
        assert native_parts(got["recv"]) == plan_parts(tile, n, schedule, groups, recv, layout), \
            f"receive parts differ for {case}"
        assert got["unpack"] == [], f"a 'rows' call has no post-reorder: {case}"
        for side, rows in (("send", send), ("recv", recv)):  # each block: its rows, in order
            start = 0
            for d, r in enumerate(rows):
                at = start * n
                for g in range(groups):
                    offset, count = got[side][g][d]
                    assert count == 0 or offset == at, (case, side, g, d)
                    at += count
                assert at == (start + r) * n, (case, side, d)
                start += r


def test_native_layout_counts_equal_what_the_collectives_move():
    """Each group's chunk sizes on the send side are what RegionExchange hands the collective."""
    tile, n, schedule = (128, 256), 1000, Schedule("n", 8)
    send = [300, 0, 77]
    grid = TileGrid(tuple(send), n, tile[0], tile[1], schedule)
    plan = Plan(sum(send), n, 64, "all_to_all", 3, "bfloat16", tile, 128,
                destination_group_sizes(grid, 4), schedule, tuple(send), grouping="destinations")
    for g, region in enumerate(plan.regions):
        assert list(region.dest_numels) == [chunk_numels(r, n, tile, schedule, 4)[g] for r in send]
    assert torch.tensor([r.numel for r in plan.regions]).sum() == sum(send) * n


def _tiles(plan) -> list[tuple]:
    """(row0, rows, col0, cols, packed offset, group) of the plan's items in execution order."""
    where = {t: (off, g) for t, g, off in plan.packed_tiles}
    return [(t.row0, t.rows, t.col0, t.cols) + where[t] for t in plan.execution_order]


@needs_nvcc
def test_the_kernels_decode_unequal_blocks_into_the_plans_tiles(decode_program):
    """The per-call work items over unequal destination blocks, decoded by the kernels'
    decode_item with block_starts: the plan's tiles, offsets and groups, in its order."""
    rng = random.Random()
    cases, lines = [], []
    for _ in range(40):
        tile = rng.choice([(128, 256), (128, 128), (64, 64)])
        n = rng.choice([1, 256, 1000, rng.randint(1, 3000)])
        layout = rng.choice(["tiles", "rows"])
        schedule = Schedule(rng.choice("nm") if layout == "tiles" else "n", rng.choice([1, 3, 8]))
        world = rng.choice([1, 2, 3, 5, 8])
        groups = rng.choice([1, 4, 5])
        rows = [0 if rng.random() < 0.2 else rng.randint(1, 1500) for _ in range(world)]
        if not sum(rows):
            rows[0] = 1
        cases.append((tile, n, schedule, groups, rows, layout))
        lines.append(f"blocks {tile[0]} {tile[1]} {n} {int(schedule.raster == 'm')} "
                     f"{schedule.swizzle} {groups} {int(layout == 'rows')} {world} "
                     f"{' '.join(map(str, rows))}\n")
    for case, got in zip(cases, decoded(decode_program, lines)):
        tile, n, schedule, groups, rows, layout = case
        plan = make_plan(tile, n, schedule, groups, rows, layout)
        want = _tiles(plan)
        if layout == "rows":  # written at its final place in the product (ldo = N)
            want = [(r0, r, c0, c, r0 * n + c0, g) for r0, r, c0, c, _, g in want]
        assert got == want, f"decoded items differ for {case}"


@needs_nvcc
def test_the_kernels_decode_equal_blocks_as_before(decode_program):
    """Plans of equal blocks (reduce_scatter, allreduce) keep their item decoding."""
    from flashoverlap_core import api

    plans = [api.plan(m, n, 64, op=op, world_size=w, tile=tile, backend="reference")
             for m, n, op, w, tile in ((1000, 776, "reduce_scatter", 4, (128, 256)),
                                       (777, 1000, "allreduce", 1, (128, 128)),
                                       (384, 72, "reduce_scatter", 3, (64, 64)))]
    lines = []
    for plan in plans:
        items, groups = plan.item_table()
        body = "".join(f"{' '.join(map(str, r))} {g}\n"
                       for r, g in zip(items.tolist(), groups.tolist()))
        blocks = len(plan.block_rows)
        lines.append(f"uniform {plan.tile[0]} {plan.tile[1]} {blocks} {plan.block_rows[0]} "
                     f"{plan.n} {plan.num_tiles}\n{body}")
    for plan, got in zip(plans, decoded(decode_program, lines)):
        assert got == _tiles(plan), plan


@needs_nvcc
@pytest.mark.parametrize("item", ["2 0 0 0 0", "0 2 0 0 0", "0 0 1 0 0", "0 0 0 -1 0",
                                  "0 0 0 80000 0", "1 2 0 0 0"])
def test_a_malformed_item_stops_the_kernel(decode_program, item):
    """An item outside its block, the matrix or the packed buffer traps (here: aborts)."""
    done = subprocess.run([str(decode_program)], input=f"uniform 128 256 2 200 256 1\n{item}\n",
                          capture_output=True, text=True)
    assert done.returncode != 0, done.stdout
