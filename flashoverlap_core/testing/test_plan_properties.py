"""Property tests of the plan invariants (docs/design.md, "The plan"), on random plans and on the
plans the backend under test makes by default."""
from collections import Counter

import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import flashoverlap_core as fo
from flashoverlap_core.plan import (GATHER_OP, PLAN_OPS, STRATEGIES, Plan, block_rows_for,
                                    destination_group_sizes, dtype_name, group_unit)
from flashoverlap_core.reorder import unpack_block
from flashoverlap_core.tiles import RASTERS, Schedule, TileGrid

SETTINGS = settings(max_examples=60, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def compositions(draw, total: int, parts: int, min_part: int) -> tuple[int, ...]:
    """``total`` cut into ``parts`` parts of at least ``min_part`` (0 allowed)."""
    cuts = sorted(draw(st.lists(st.integers(0, total - parts * min_part), min_size=parts - 1,
                                max_size=parts - 1)))
    return tuple(b - a + min_part for a, b in zip([0] + cuts, cuts + [total - parts * min_part]))


@st.composite
def send_splits(draw, m: int, world_size: int):
    splits = list(compositions(draw, m, world_size, 0))
    if world_size > 1 and draw(st.booleans()):  # always some all_to_all with a zero split
        d = draw(st.integers(0, world_size - 1))
        splits[(d + 1) % world_size] += splits[d]
        splits[d] = 0
    return tuple(splits)


@st.composite
def plans(draw) -> Plan:
    op = draw(st.sampled_from(PLAN_OPS))
    w = draw(st.integers(1, 5))
    blocks = op in ("reduce_scatter", GATHER_OP)  # M is W x the rows of each block
    m = w * draw(st.integers(1, 10)) if blocks else draw(st.integers(1, 40))
    n = draw(st.integers(1, 40))
    splits = None
    if op == "all_to_all" and (w > 1 or draw(st.booleans())):
        splits = draw(send_splits(m, w))
    tile = (draw(st.integers(1, 16)), draw(st.integers(1, 16)))
    schedule = Schedule(draw(st.sampled_from(RASTERS)), draw(st.integers(1, 4)))
    total = TileGrid(block_rows_for(op, m, w, splits), n, *tile, schedule).num_tiles
    unit = group_unit(op, w, n, tile)
    groups = draw(st.integers(1, min(8, total // unit)))
    sizes = tuple(unit * s for s in compositions(draw, total // unit, groups, 1))
    return Plan(m, n, draw(st.integers(1, 64)), op, w, draw(st.sampled_from(["float32", "float16", "bfloat16"])),
                tile, draw(st.integers(1, 8)), sizes, schedule, splits,
                strategy=draw(st.sampled_from(STRATEGIES)))


@st.composite
def rows_plans(draw, max_world: int = 4, destinations: bool = True) -> Plan:
    """Random "rows" plans: groups of whole strips of bands ("waves") or the all_to_all
    "destinations" rule (unless ``destinations`` is False), ragged shapes, partial last bands
    and columns, zero splits; world sizes 1 to ``max_world``."""
    op = draw(st.sampled_from(["allreduce", "reduce_scatter", "all_to_all", "custom"]))
    w = draw(st.integers(1, max_world))
    m = w * draw(st.integers(1, 12)) if op == "reduce_scatter" else draw(st.integers(1, 48))
    n = draw(st.integers(1, 40))
    splits = draw(send_splits(m, w)) if op == "all_to_all" and w > 1 else None
    tile = (draw(st.integers(1, 8)), draw(st.integers(1, 16)))
    schedule = Schedule("n", draw(st.integers(1, 4)))
    grid = TileGrid(block_rows_for(op, m, w, splits), n, *tile, schedule)
    common = dict(m=m, n=n, k=draw(st.integers(1, 32)), op=op, world_size=w, dtype="float32",
                  tile=tile, wave_size=draw(st.integers(1, 8)), schedule=schedule,
                  send_splits=splits, layout="rows")
    if op == "all_to_all" and destinations and draw(st.booleans()):
        groups = draw(st.integers(1, 5))
        return Plan(group_sizes=destination_group_sizes(grid, groups, "rows"),
                    grouping="destinations", **common)
    assume(op != "all_to_all" or len(set(grid.block_rows)) == 1)  # "waves": equal blocks
    unit = group_unit(op, w, n, tile, "rows", schedule)
    units = -(-grid.num_tiles // unit)
    cuts = compositions(draw, units, draw(st.integers(1, min(6, units))), 1)
    ends = [min(grid.num_tiles, unit * sum(cuts[:i + 1])) for i in range(len(cuts))]
    return Plan(group_sizes=tuple(b - a for a, b in zip([0] + ends, ends)), **common)


def block_bounds(plan: Plan) -> list[tuple[int, int]]:
    out, row = [], 0
    for rows in plan.block_rows:
        out.append((row, row + rows))
        row += rows
    return out


def check_invariants(plan: Plan) -> None:
    m, n = plan.packed_shape  # allgather: the packed buffer holds the gathered a [M, K]
    index = plan.packed_index()
    # the packed layout is a permutation of the output's elements
    assert index.numel() == m * n == plan.packed_numel
    assert torch.equal(index.sort().values, torch.arange(m * n))
    # the groups, in execution order, hold every tile exactly once
    seen = Counter(t for group in plan.groups for t in group)
    assert set(seen) == set(plan.grid.execution_order) and set(seen.values()) == {1}
    assert [len(g) for g in plan.groups] == list(plan.group_sizes)
    # regions are back to back, each exactly its group's tiles, split by destination
    offset = 0
    for g, region in enumerate(plan.regions):
        assert region.index == g and region.offset == offset
        assert region.numel == sum(region.dest_numels)
        assert plan.op == GATHER_OP or region.numel == sum(t.numel for t in plan.groups[g])
        offset += region.numel
    assert offset == m * n
    if plan.op == GATHER_OP:
        check_gather_chunks(plan)
        return
    for tile, g, off in plan.packed_tiles:
        r = plan.regions[g]
        assert r.offset <= off and off + tile.numel <= r.offset + r.numel
    # each destination's part of each region holds rows of that destination only
    bounds = block_bounds(plan)
    for region in plan.regions:
        start = region.offset
        for d, numel in enumerate(region.dest_numels):
            rows = index[start:start + numel] // n
            assert numel == 0 or (bounds[d][0] <= rows.min() and rows.max() < bounds[d][1])
            start += numel
    if plan.op == "reduce_scatter":
        for region in plan.regions:
            assert len(set(region.dest_numels)) == 1, f"group {region.index} unbalanced"
    if plan.op == "all_to_all" and plan.send_splits is not None:
        for d, rows in enumerate(plan.send_splits):
            assert sum(r.dest_numels[d] for r in plan.regions) == rows * n


def check_gather_chunks(plan: Plan) -> None:
    """allgather: the chunks are consecutive runs of rows covering every shard; each group's
    tiles are exactly those whose rows its chunk brings, and its region holds those rows of each
    shard in rank order; a rank computes its own tiles first, then each chunk's other tiles."""
    shard, w = plan.shard_rows, plan.world_size
    chunks = [plan.chunk_rows(g) for g in range(plan.num_groups)]
    assert chunks[0][0] == 0 and chunks[-1][1] == shard
    assert all(end > start for start, end in chunks)
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    index = plan.packed_index()
    for g, (start, end) in enumerate(chunks):
        for t in plan.grid.execution_order:
            row = t.row0 - t.block * shard
            inside = start <= row and row + t.rows <= end
            assert inside == (t in plan.groups[g]) and (inside or row + t.rows <= start or end <= row)
        r = plan.regions[g]
        rows = index[r.offset:r.offset + r.numel].view(w, end - start, plan.k)[:, :, 0] // plan.k
        assert torch.equal(rows, torch.arange(w).unsqueeze(1) * shard + torch.arange(start, end))
    for rank in range(w):
        local = plan.local_tiles(rank)
        arriving = [t for g in range(plan.num_groups) for t in plan.arriving_tiles(rank, g)]
        assert {t.block for t in local} <= {rank} and rank not in {t.block for t in arriving}
        assert len(local) + len(arriving) == plan.num_tiles
        assert set(local) | set(arriving) == set(plan.grid.execution_order)


def check_pack_unpack(plan: Plan) -> None:
    """Packing c, then unpacking what each destination receives (its part of every region,
    in group order) with unpack_block, gives c back."""
    c = torch.randn(*plan.packed_shape, dtype=torch.float64)
    packed = c.flatten()[plan.packed_index()]
    out = torch.full_like(c, float("nan"))
    for d, (lo, hi) in enumerate(block_bounds(plan)):
        parts = []
        for region in plan.regions:
            start = region.offset + sum(region.dest_numels[:d])
            parts.append(packed[start:start + region.dest_numels[d]])
        if plan.op == GATHER_OP or plan.layout == "rows":  # rows arrive in order, row-major
            out[lo:hi] = torch.cat(parts).view(hi - lo, out.shape[1])
        else:
            unpack_block(torch.cat(parts), out[lo:hi], plan.tile, plan.schedule)
    assert torch.equal(out, c)


@SETTINGS
@given(plans())
def test_plan_invariants(plan):
    check_invariants(plan)


@SETTINGS
@given(plans())
def test_pack_then_unpack_is_identity(plan):
    check_pack_unpack(plan)


@SETTINGS
@given(rows_plans())
def test_rows_plans_are_whole_bands_received_in_their_final_rows(plan):
    """A "rows" plan's groups are whole row bands of each block, each part of a region is its
    destination's rows in order (what a rank receives, concatenated, is its rows: no
    post-reorder), and its regions are the tile layout's."""
    assert plan.row_parts is not None
    check_invariants(plan)
    check_pack_unpack(plan)
    bm, index = plan.tile[0], plan.packed_index()
    for slabs in plan.slabs:
        for row0, row1, offset in slabs:
            want = torch.arange(row0 * plan.n, row1 * plan.n)
            assert torch.equal(index[offset:offset + want.numel()], want)
    for parts in plan.row_parts:
        assert all(r0 % bm == 0 and r0 <= r1 for r0, r1 in parts)
    if plan.grouping == "waves":
        tiles = Plan.from_dict(plan.to_dict() | {"layout": "tiles"})
        assert tiles.regions == plan.regions and tiles.groups == plan.groups


@SETTINGS
@given(rows_plans(max_world=1, destinations=False), st.integers(0, 2**31 - 1))
def test_rows_and_tiles_layouts_compute_the_same_result(plan, seed):
    """The reference backend's result is bit for bit the same in both layouts (W = 1)."""
    assume(plan.m > 0)
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(plan.m, plan.k, generator=gen, dtype=torch.float64)
    b = torch.randn(plan.k, plan.n, generator=gen, dtype=torch.float64)
    op = plan.op if plan.op != "custom" else (lambda region, index: None)
    tiles = Plan.from_dict(plan.to_dict() | {"layout": "tiles"})
    got = [fo.overlap(a.float(), b.float(), op, plan=p, backend="reference") for p in (plan, tiles)]
    assert torch.equal(got[0], got[1])
    torch.testing.assert_close(got[0].double(), a @ b, rtol=1e-4, atol=1e-4)


@SETTINGS
@given(plans())
def test_json_round_trip(plan):
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.to_dict() == plan.to_dict()
    assert again.describe() == plan.describe()
    assert torch.equal(again.packed_index(), plan.packed_index())


@st.composite
def backend_calls(draw):
    op = draw(st.sampled_from(PLAN_OPS))
    w = draw(st.integers(1, 4))
    blocks = op in ("reduce_scatter", GATHER_OP)
    m = w * draw(st.integers(1, 300)) if blocks else draw(st.integers(1, 1200))
    splits = draw(send_splits(m, w)) if op == "all_to_all" else None
    return dict(m=m, n=draw(st.integers(1, 1200)), k=draw(st.integers(1, 4097)), op=op,
                world_size=w, dtype=draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16])),
                send_splits=splits, b_layout=draw(st.sampled_from(["row", "col"])))


@SETTINGS
@given(call=backend_calls())
def test_backend_default_plans(call, fo_backend):
    """The plans the backend under test makes by default satisfy the same invariants."""
    spec = fo.OverlapSpec(call["m"], call["n"], call["k"], call["op"], call["world_size"],
                          dtype_name(call["dtype"]), fo_backend.device_type or "cpu",
                          call["b_layout"], call["send_splits"])
    assume(not fo_backend.unsupported_reasons(spec))  # declined calls are skips elsewhere
    plan = fo.plan(backend=fo_backend.name, **call)
    assert plan.backend == fo_backend.name
    check_invariants(plan)
    check_pack_unpack(plan)


def test_an_all_to_all_with_its_own_group_sizes_keeps_the_tile_layout():
    """Each rank's own all_to_all group sizes may be whole bands on one rank and not on
    another: the layout, which receivers rely on, must not follow them (the core's rule,
    whatever backend is under test)."""
    kw = dict(tile=(16, 8), group_sizes=[40, 40], send_splits=[128, 128], backend="reference")
    whole = fo.plan(256, 40, 8, "all_to_all", 2, torch.float32, **kw)
    assert whole.row_parts is not None and whole.layout == "tiles"
    assert fo.plan(256, 40, 8, "all_to_all", 2, torch.float32, layout="rows", **kw).layout == "rows"
