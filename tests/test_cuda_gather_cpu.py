"""The cuda backend's allgather, the parts that need no GPU: the GEMM's item table and each
item's arrival flag (``backends/cuda/gather_call.py``), the grid that leaves SMs to the transfer,
the test knobs, and that the backend now takes the op. The kernel architecture is forced
through ``FLASHOVERLAP_CUDA_ARCH``, so nothing asks a device."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashoverlap_core as fo
from flashoverlap_backends.cuda import CudaBackend, kernels
from flashoverlap_backends.cuda import gather_call
from flashoverlap_backends.cuda.backend import ENV_ARCH, ENV_RESERVED_SMS
from flashoverlap_core.grouping import wave_group_sizes
from flashoverlap_core.plan import group_unit
from flashoverlap_core.tiles import Schedule, TileGrid


def gather_plan(m, n, k, world, tile, chunks, wave=8) -> fo.Plan:
    """An allgather plan of W shards of m rows whose groups are ``chunks`` runs of bands."""
    rows = (m,) * world
    total = TileGrid(rows, n, *tile, Schedule("n", 8)).num_tiles
    unit = group_unit("allgather", world, n, tile)
    sizes = wave_group_sizes(total, max(unit, total // chunks), unit=unit, max_groups=chunks)
    return fo.Plan(m * world, n, k, "allgather", world, "bfloat16", tile, wave, tuple(sizes),
                   Schedule("n", 8))


plans = st.builds(
    gather_plan, m=st.integers(1, 300), n=st.integers(1, 300), k=st.integers(1, 64),
    world=st.integers(1, 4), tile=st.sampled_from([(128, 256), (128, 128), (16, 32), (8, 8)]),
    chunks=st.integers(1, 5))


def tile_of(plan, item):
    """(row0, rows, col0, cols) of an item (block, band, column tile, offset), as the kernel
    decodes it (common.cuh, decode_item)."""
    block, band, col, _ = item
    (bm, bn), m = plan.tile, plan.shard_rows
    row0 = block * m + band * bm
    return row0, min(bm, m - band * bm), col * bn, min(bn, plan.n - col * bn)


@settings(max_examples=60, deadline=None)
@given(plan=plans, data=st.data())
def test_items_run_own_tiles_first_then_chunks_in_order_each_waiting_for_its_rows(plan, data):
    """Own tiles first (copied before the GEMM: no flag; the loopback test's own_waits gives
    them their chunk's flag too), then chunk by chunk, each tile waiting for its own rows."""
    rank = data.draw(st.integers(0, plan.world_size - 1))
    own_waits = data.draw(st.booleans())
    items, wait = gather_call.gather_items(plan, rank, waits=True, own_waits=own_waits)
    assert items.dtype == torch.int64 and wait.dtype == torch.int32
    assert items.shape == (plan.num_tiles, 4) and wait.shape == (plan.num_tiles,)
    rects = [tile_of(plan, it) for it in items.tolist()]
    assert sorted(rects) == sorted((t.row0, t.rows, t.col0, t.cols) for t in plan.grid.execution_order)
    local = len(plan.local_tiles(rank))
    assert all(b == rank for b in items[:local, 0].tolist())
    assert all(b != rank for b in items[local:, 0].tolist())
    chunks = plan.num_groups
    last_chunk = -1
    for i, ((block, _, _, offset), flag) in enumerate(zip(items.tolist(), wait.tolist())):
        row0, rows, col0, _ = rects[i]
        assert offset == row0 * plan.n + col0  # the tile's place in the row-major out
        if block == rank and not own_waits:
            assert flag == -1
            continue
        shard, g = divmod(flag, chunks)
        assert shard == block  # it waits for its own shard's rows ...
        start, end = plan.chunk_rows(g)  # ... and for the chunk that brings them
        assert start <= row0 - block * plan.shard_rows and row0 - block * plan.shard_rows + rows <= end
        if i >= local:  # arriving tiles come chunk by chunk
            assert g >= last_chunk
            last_chunk = g


@settings(max_examples=20, deadline=None)
@given(plan=plans)
def test_without_waits_every_item_waits_for_nothing(plan):
    items, wait = gather_call.gather_items(plan, 0, waits=False)
    assert (wait == -1).all()
    with_waits, _ = gather_call.gather_items(plan, 0, waits=True)
    assert sorted(map(tuple, items.tolist())) == sorted(map(tuple, with_waits.tolist()))


@settings(max_examples=30, deadline=None)
@given(plan=plans)
def test_chunk_table_is_the_plan_chunks(plan):
    table = gather_call.chunk_table(plan)
    assert len(table) == 2 * plan.num_groups
    assert table[0] == 0 and table[-1] == plan.shard_rows
    assert table == [r for g in range(plan.num_groups) for r in plan.chunk_rows(g)]


def test_world_one_item_table_keeps_the_plan_order():
    """At world size 1 without the loopback nothing is gathered: the order is the plan's
    execution order (its swizzle across all bands, not chunk by chunk)."""
    plan = gather_plan(1000, 1000, 64, 1, (128, 256), 3)
    items, _ = gather_call.gather_items(plan, 0, waits=False)
    expect = [(t.block, t.row0 // 128, t.col0 // 256) for t in plan.grid.execution_order]
    assert [tuple(r[:3]) for r in items.tolist()] == expect


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_default_schedule_items_fit_the_cluster_build(world):
    """Consecutive items share a column tile, so the 2x1-cluster kernels run them (an item
    table that did not fit would run the 1x1 build: correct, slower)."""
    plan = gather_plan(2048, 4096, 64, world, (128, 256), 4)
    for rank in range(world):
        items, _ = gather_call.gather_items(plan, rank, waits=True)
        assert kernels.cluster_fits(items, (2, 1))


def test_flag_index_is_shard_major():
    plan = gather_plan(256, 64, 8, 3, (16, 32), 4)
    assert [gather_call.flag_index(plan, s, g) for s in range(3) for g in range(plan.num_groups)] == \
        list(range(3 * plan.num_groups))


# ---- the grid leaves SMs to the transfer --------------------------------------------------------

@pytest.mark.parametrize("wave, sms, max_ctas, reserve, multiple, grid", [
    (128, 132, 132, 4, 2, 128),   # the default plan already leaves 4 SMs
    (132, 132, 132, 4, 2, 128),   # a plan's wave of every SM is capped
    (132, 132, 132, 5, 2, 126),   # whole clusters
    (128, 132, 120, 4, 2, 120),   # not more than can be resident at once
    (64, 132, 132, 4, 2, 64),     # a smaller wave stays as it is
    (396, 132, 396, 4, 1, 128),   # several CTAs per SM (sm80): still at most SMs - reserve CTAs
    (132, 132, 132, 0, 2, 132),   # nothing waits: the plan's wave
])
def test_gather_grid(wave, sms, max_ctas, reserve, multiple, grid):
    assert gather_call.gather_grid(wave, sms, max_ctas, reserve, multiple) == grid


def test_gather_grid_that_cannot_fit_says_what_to_change():
    with pytest.raises(ValueError, match="FLASHOVERLAP_CUDA_RESERVED_SMS"):
        gather_call.gather_grid(128, 4, 132, 4, 2)


def test_reserve(monkeypatch):
    monkeypatch.setenv(ENV_RESERVED_SMS, "0")
    options = gather_call.GatherOptions(nccl_ctas=6)
    assert gather_call.gather_reserve(1, options) == 0  # nothing waits
    own_copy = gather_call.GatherOptions(nccl_ctas=6, loopback=gather_call.LOOPBACK_OWN_COPY)
    assert gather_call.gather_reserve(1, own_copy) == 0  # own rows copied first: nothing waits
    chunks = gather_call.GatherOptions(nccl_ctas=6, loopback=gather_call.LOOPBACK_CHUNKS)
    assert gather_call.gather_reserve(1, chunks) == gather_call.MIN_FREE_SMS  # loopback: no NCCL
    assert gather_call.gather_reserve(2, options) == 6  # every NCCL CTA has a free SM
    assert gather_call.gather_reserve(2, chunks) == 6  # the loopback is for world size 1 only
    monkeypatch.setenv(ENV_RESERVED_SMS, "9")
    assert gather_call.gather_reserve(2, options) == 9


def test_default_reserve_and_nccl_bound_follow_the_world_size(monkeypatch):
    """Unset: 4 SMs free at world size 1, 24 above, where the collective's kernels run on them;
    the communicator's CTA bound is the reserve unless FLASHOVERLAP_CUDA_GATHER_NCCL_CTAS says."""
    monkeypatch.delenv(ENV_RESERVED_SMS, raising=False)
    default = gather_call.GatherOptions()
    assert gather_call.gather_reserve(2, default) == 24
    assert gather_call.gather_nccl_ctas(2, default) == 24
    assert gather_call.gather_reserve(1, gather_call.GatherOptions(loopback=1)) == 4
    assert gather_call.gather_nccl_ctas(4, gather_call.GatherOptions(nccl_ctas=6)) == 6
    assert gather_call.gather_reserve(4, gather_call.GatherOptions(nccl_ctas=30)) == 30
    monkeypatch.setenv(ENV_RESERVED_SMS, "10")
    assert gather_call.gather_nccl_ctas(2, default) == 10


def test_loopback_modes():
    off, chunks, own = (gather_call.GatherOptions(loopback=v) for v in (0, 1, 2))
    assert [o.gathers(1) for o in (off, chunks, own)] == [False, True, True]
    assert [o.own_chunks(1) for o in (off, chunks, own)] == [False, True, False]
    assert all(o.gathers(2) and not o.own_chunks(2) for o in (off, chunks, own))


# ---- knobs ----------------------------------------------------------------------------------------

def test_options_from_the_environment(monkeypatch):
    for name in (gather_call.ENV_LOOPBACK, gather_call.ENV_DELAY, gather_call.ENV_NO_WAIT,
                 gather_call.ENV_NCCL_CTAS):
        monkeypatch.delenv(name, raising=False)
    assert gather_call.GatherOptions.from_env() == gather_call.GatherOptions()
    monkeypatch.setenv(gather_call.ENV_LOOPBACK, "1")
    monkeypatch.setenv(gather_call.ENV_DELAY, "250")
    monkeypatch.setenv(gather_call.ENV_NO_WAIT, "1")
    monkeypatch.setenv(gather_call.ENV_NCCL_CTAS, "2")
    assert gather_call.GatherOptions.from_env() == gather_call.GatherOptions(2, 1, 250, True)


@pytest.mark.parametrize("name, value", [
    (gather_call.ENV_DELAY, "-5"), (gather_call.ENV_DELAY, "soon"), (gather_call.ENV_NCCL_CTAS, "0"),
    (gather_call.ENV_LOOPBACK, "yes"), (gather_call.ENV_LOOPBACK, "3"),
])
def test_bad_knobs_are_value_errors_naming_the_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        gather_call.GatherOptions.from_env()


# ---- the backend takes the op -------------------------------------------------------------------

@pytest.fixture(params=sorted(kernels.CONFIGS))
def backend(request, monkeypatch):
    monkeypatch.setenv(ENV_ARCH, str(request.param))
    return CudaBackend()


@pytest.mark.parametrize("world", [1, 2, 8])
@pytest.mark.parametrize("dtype", kernels.DTYPES)
def test_allgather_is_supported(backend, world, dtype):
    spec = fo.OverlapSpec(m=256 * world, n=512, k=64, op="allgather", world_size=world,
                          dtype=dtype, device_type="cuda", b_layout="col")
    assert backend.unsupported_reasons(spec) == []


def test_allgather_float32_is_declined_with_a_way_out(backend):
    spec = fo.OverlapSpec(m=256, n=512, k=64, op="allgather", world_size=1, dtype="float32",
                          device_type="cuda")
    reasons = backend.unsupported_reasons(spec)
    assert len(reasons) == 1 and "backend='decomposition'" in reasons[0]


def test_default_tile_counts_the_waves_of_each_shard():
    """allgather's blocks are its shards (as reduce_scatter's are destinations): 4 shards of
    200 rows make 8 bands of 128-row tiles, not the 7 bands of 800 rows in one block."""
    kw = dict(m=800, n=512, k=4096, dtype="bfloat16", device_type="cuda")
    shards = fo.OverlapSpec(op="allgather", world_size=4, **kw)
    one_block = fo.OverlapSpec(op="allreduce", world_size=1, **kw)
    # wave 14: one block is 14 tiles of 128x256 (1 wave) or 28 of 128x128 (2 waves): the
    # cooperative tile; the shards are 16 tiles (2 waves) or 32 (3 waves): ragged, pingpong.
    assert kernels.default_tile(90, one_block, 14) == (128, 256)
    assert kernels.default_tile(90, shards, 14) == (128, 128)


# ---- fp8 (issue 32): e4m3 rows and every rank's scales --------------------------------------------

def test_gathered_rows_keep_16_byte_strides_for_every_dtype():
    """The gathered buffer's row stride is a multiple of 16 bytes (TMA): 8 16-bit elements,
    16 e4m3 ones (a K of 72 e4m3 bytes takes rows of 80)."""
    assert gather_call.row_align(torch.bfloat16) == gather_call.row_align(torch.float16) == 8
    assert gather_call.row_align(torch.float8_e4m3fn) == 16
    assert gather_call.round_up(72, gather_call.row_align(torch.float8_e4m3fn)) == 80


def test_gathered_scales_have_a_row_per_gathered_row():
    """One column (a scale per row: tensor-wise scales run as per-row ones), block-wise one per
    group of 128 k, the last one partial."""
    assert [gather_call.scale_groups(k, False) for k in (1, 128, 4096)] == [1, 1, 1]
    assert [gather_call.scale_groups(k, True) for k in (1, 128, 129, 300, 4096)] == [1, 1, 2, 3, 32]


@pytest.mark.parametrize("kind", ["tensorwise", "rowwise", "column-of-wider", "blockwise-torch",
                                  "blockwise-rows", "one-row"])
def test_scale_strides_read_this_ranks_scale_a_as_the_native_call_does(kind):
    """The strides handed to fo_gather_run_scaled make the own scales' copy (gather_call.cu:
    row r, group g at scale_a[r * s0 + g * s1]) read every kind of scale_a as its [m, G]
    values: a 0-dim one repeated on every row, a column of a wider tensor, torch's
    outer-dim-major block-wise layout; scale_b's strides only block-wise."""
    m, k, n = 5, 300, 200
    blockwise = kind.startswith("blockwise")
    groups = gather_call.scale_groups(k, blockwise)
    sb = torch.rand(3, 2).t().contiguous().t() if blockwise else torch.rand(1, n)
    sa = {"tensorwise": torch.tensor(0.75), "rowwise": torch.rand(m, 1),
          "column-of-wider": torch.rand(m, 3)[:, 1:2], "blockwise-torch": torch.rand(3, m).t(),
          "blockwise-rows": torch.rand(m, 3), "one-row": torch.rand(4, 2)[2:3, 1:2]}[kind]
    rows = 1 if kind == "one-row" else m
    strides = gather_call.scale_strides(sa, sb, blockwise)
    assert len(strides) == 4 and min(strides) >= 0
    base = sa.storage_offset()
    read = torch.tensor([[sa.as_strided((), (), base + r * strides[0] + g * strides[1]).item()
                          for g in range(groups)] for r in range(rows)])
    assert torch.equal(read, sa.expand(rows, groups) if sa.dim() == 0 else sa)
    if blockwise:
        assert strides[2:] == tuple(sb.stride())
    else:
        assert strides[2:] == (0, 0)
