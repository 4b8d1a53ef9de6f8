"""The native all_to_all layout (csrc/cuda/a2a_layout.cuh: the closed forms from which the cuda
backend builds each call's work items on the device and its collectives' counts on the host)
against the Python plan, the specification: the work items in execution order (Plan.item_table)
with their groups and packed offsets, and the post-reorder's tiles of the received blocks with
their staging offsets (RegionExchange.block_layouts' rule). Compiled as a host program with
the system's C++ compiler (no GPU, no nvcc)."""
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


@pytest.fixture(scope="module")
def layout_program(tmp_path_factory) -> Path:
    exe = tmp_path_factory.mktemp("a2a") / "a2a_layout"
    subprocess.run([COMPILER, "-std=c++17", "-O1", f"-I{ROOT / 'csrc' / 'cuda'}",
                    str(ROOT / "tests" / "native" / "a2a_layout_main.cpp"), "-o", str(exe)],
                   check=True, capture_output=True, text=True)
    return exe


@pytest.fixture(scope="module")
def decode_program(tmp_path_factory) -> Path:
    exe = tmp_path_factory.mktemp("decode") / "decode_items"
    subprocess.run([NVCC, "-std=c++17", "-O1", f"-I{ROOT / 'csrc' / 'cuda'}",
                    str(ROOT / "tests" / "native" / "decode_items_main.cu"), "-o", str(exe)],
                   check=True, capture_output=True, text=True)
    return exe


def decoded(program: Path, lines: list[str]) -> list[list[tuple]]:
    """The kernels' decode_item of each input line's items (decode_items_main.cu)."""
    out = subprocess.run([str(program)], input="".join(lines), capture_output=True, text=True,
                         check=True).stdout.split("end\n")[:-1]
    return [[tuple(map(int, row.split())) for row in part.splitlines()] for part in out]


def native_layouts(program: Path, cases) -> list[dict]:
    text = "".join(f"{bm} {bn} {n} {int(s.raster == 'm')} {s.swizzle} {g} {len(send)} "
                   f"{' '.join(map(str, send))} {' '.join(map(str, recv))}\n"
                   for (bm, bn), n, s, g, send, recv in cases)
    lines = subprocess.run([str(program)], input=text, capture_output=True, text=True,
                           check=True).stdout.splitlines()
    out, i = [], 0
    for (_, _, _, groups, _, _) in cases:
        count = int(lines[i].split()[1])
        items = [tuple(map(int, x.split())) for x in lines[i + 1:i + 1 + count]]
        i += 1 + count
        assert lines[i] == "parts"
        parts = [tuple(map(int, x.split())) for x in lines[i + 1:i + 1 + groups]]
        i += 1 + groups
        count = int(lines[i].split()[1])
        unpack = [tuple(map(int, x.split())) for x in lines[i + 1:i + 1 + count]]
        i += 1 + count
        assert lines[i] == "end"
        i += 1
        out.append({"items": items, "parts": parts, "unpack": unpack})
    return out


def plan_items(tile, n, schedule, groups, send):
    """Plan.item_table of the plan the cuda backend runs for these rows, with each item's group."""
    grid = TileGrid(tuple(send), n, tile[0], tile[1], schedule)
    plan = Plan(sum(send), n, 64, "all_to_all", len(send), "bfloat16", tile, 128,
                destination_group_sizes(grid, groups), schedule,
                tuple(send) if len(send) > 1 else None, grouping="destinations")
    items, item_group = plan.item_table()
    rows = [tuple(r) + (g,) for r, g in zip(items.tolist(), item_group.tolist())]
    parts = [tuple(plan.regions[g].offset + sum(plan.regions[g].dest_numels[:d])
                   for d in range(len(send))) for g in range(groups)]
    return rows, parts


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


def random_case(rng: random.Random):
    bm = rng.choice([64, 128, 128])
    bn = rng.choice([64, 128, 256])
    n = rng.choice([1, 8, 200, 256, 1000, 4096, rng.randint(1, 3000)])
    schedule = Schedule(rng.choice("nm"), rng.choice([1, 2, 3, 8]))
    world = rng.choice([1, 2, 3, 4, 8])
    groups = rng.choice([1, 2, 4, 5]) if world > 1 else rng.choice([1, 4])

    def rows():
        hot = rng.random() < 0.3
        return [0 if rng.random() < 0.2 else rng.randint(1, 2000 if hot else 400) for _ in range(world)]

    return (bm, bn), n, schedule, groups, rows(), rows()


def test_native_layout_matches_the_plan(layout_program):
    rng = random.Random()  # fresh cases every run; a failure prints its case
    cases = [random_case(rng) for _ in range(60)]
    cases += [((128, 256), 4096, Schedule("n", 8), 4, [300, 0, 77], [5, 129, 0]),  # zeros, ragged
              ((128, 256), 7168, Schedule("n", 8), 4, [0, 0], [0, 0]),  # a rank with no rows
              ((128, 128), 100, Schedule("m", 3), 3, [1, 1000, 129, 5], [128, 127, 0, 1])]
    for case, got in zip(cases, native_layouts(layout_program, cases)):
        tile, n, schedule, groups, send, recv = case
        items, parts = plan_items(tile, n, schedule, groups, send)
        assert got["items"] == items, f"work items differ for {case}"
        assert got["parts"] == parts, f"part offsets differ for {case}"
        assert got["unpack"] == expected_unpack(tile, n, schedule, groups, recv), \
            f"receive tiles differ for {case}"


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
        schedule = Schedule(rng.choice("nm"), rng.choice([1, 3, 8]))
        world = rng.choice([1, 2, 3, 5, 8])
        groups = rng.choice([1, 4, 5])
        rows = [0 if rng.random() < 0.2 else rng.randint(1, 1500) for _ in range(world)]
        if not sum(rows):
            rows[0] = 1
        cases.append((tile, n, schedule, groups, rows))
        lines.append(f"blocks {tile[0]} {tile[1]} {n} {int(schedule.raster == 'm')} "
                     f"{schedule.swizzle} {groups} {world} {' '.join(map(str, rows))}\n")
    for case, got in zip(cases, decoded(decode_program, lines)):
        tile, n, schedule, groups, rows = case
        grid = TileGrid(tuple(rows), n, tile[0], tile[1], schedule)
        plan = Plan(sum(rows), n, 64, "all_to_all", len(rows), "bfloat16", tile, 128,
                    destination_group_sizes(grid, groups), schedule,
                    tuple(rows) if len(rows) > 1 else None, grouping="destinations")
        assert got == _tiles(plan), f"decoded items differ for {case}"


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
