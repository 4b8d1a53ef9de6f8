"""allgather (issue 12) on the host: the plan's chunks, the order in which the reference and
the decomposition read them, and calls on spawned ranks that the conformance suite does not
make (a strided a, the sequential strategy, the tracer). The suite itself runs the op's
correctness matrix (``pytest --pyargs flashoverlap_core.testing -k allgather``)."""
import json

import pytest
import torch

import flashoverlap_core as fo
from flashoverlap_core import decomposition
from flashoverlap_core.backend import OverlapCall
from flashoverlap_core.gather import GatherExchange, execute_tiles
from flashoverlap_core.plan import Plan, group_unit
from flashoverlap_core.reference import ReferenceBackend
from flashoverlap_core.tile_trace import NoRecorder
from flashoverlap_core.tools.ranks import RankPool


def gather_plan(**kw) -> Plan:
    """W=3 shards of 5 rows, N=10, tile 2x4: 3 bands x 3 column tiles per shard, 27 tiles;
    groups of 2 bands and 1 band (rows [0, 4) and [4, 5) of every shard)."""
    args = dict(m=15, n=10, k=6, op="allgather", world_size=3, dtype="float32", tile=(2, 4),
                wave_size=4, group_sizes=(18, 9))
    args.update(kw)
    return Plan(**args)


# ---- the plan ------------------------------------------------------------------------------------

def test_groups_are_chunks_of_whole_bands_of_every_shard():
    plan = gather_plan()
    assert plan.block_rows == (5, 5, 5) and plan.shard_rows == 5
    assert plan.chunk_bands == ((0, 2), (2, 3))
    assert [plan.chunk_rows(g) for g in range(2)] == [(0, 4), (4, 5)]
    # group 1 is the last band (row 4) of each shard: rows 4, 9 and 14 of the result
    assert sorted({t.row0 for t in plan.groups[1]}) == [4, 9, 14]
    assert all(t.rows == 1 for t in plan.groups[1])
    # the packed buffer is the gathered a: chunk by chunk, shard by shard, K elements a row
    assert plan.packed_shape == (15, 6) and plan.packed_numel == 90
    assert [(r.offset, r.numel, r.dest_numels) for r in plan.regions] == [
        (0, 72, (24, 24, 24)), (72, 18, (6, 6, 6))]
    rows = plan.packed_index().view(-1, 6)[:, 0] // 6
    assert rows.tolist() == [0, 1, 2, 3, 5, 6, 7, 8, 10, 11, 12, 13, 4, 9, 14]


def test_a_rank_computes_its_own_shard_first_then_each_chunk():
    plan = gather_plan()
    local = plan.local_tiles(1)
    assert len(local) == 9 and {t.block for t in local} == {1}
    for g, size in enumerate(plan.group_sizes):
        arriving = plan.arriving_tiles(1, g)
        assert len(arriving) == size * 2 // 3 and 1 not in {t.block for t in arriving}


def test_group_sizes_must_be_whole_bands():
    assert group_unit("allgather", 3, 10, (2, 4)) == 9
    with pytest.raises(ValueError, match="whole row bands.*multiples of 9"):
        gather_plan(group_sizes=(10, 17))


def test_result_rows_must_be_a_multiple_of_the_world_size():
    with pytest.raises(ValueError, match="divisible"):
        gather_plan(m=16, group_sizes=(27,))


def test_no_output_tiles_are_packed():
    with pytest.raises(ValueError, match="gathered rows of a"):
        gather_plan().packed_tiles


def test_describe_names_the_chunks():
    text = gather_plan().describe()
    assert "gathers rows [0, 4) of every shard" in text and "gathers rows [4, 5)" in text
    assert "own shard's 9 tiles first" in text


def test_strategy_is_validated_and_round_trips():
    plan = gather_plan(strategy="sequential")
    assert Plan.from_json(plan.to_json()) == plan and "strategy sequential" in plan.describe()
    legacy = json.loads(gather_plan().to_json())
    del legacy["strategy"]  # plans written before the field existed
    assert Plan.from_dict(legacy).strategy == "overlap"
    with pytest.raises(ValueError, match="strategy"):
        gather_plan(strategy="fused")


@pytest.mark.parametrize("backend", ["reference", "decomposition"])
def test_default_plans_take_whole_bands(backend):
    plan = fo.plan(4 * 300, 96, 64, op="allgather", world_size=4, dtype=torch.float32,
                   backend=backend)
    unit = group_unit("allgather", 4, 96, plan.tile)
    assert plan.m == 1200 and all(s % unit == 0 for s in plan.group_sizes)


# ---- the order of reads, with a transport that records what happens ------------------------------

class RecordingExchange(GatherExchange):
    """The exchange of a rank of a fake group: the other shards are already in ``full`` (no
    torch.distributed), and every start, wait and read is logged."""

    def __init__(self, call, full: torch.Tensor, log: list):
        super().__init__(call)
        self.full, self.log = full, log

    def start(self, g):
        self.log.append(("start", g))

    def wait(self, g):
        self.log.append(("wait", g))

    def chunk(self, g):
        start, end = self.plan.chunk_rows(g)
        shard = self.plan.shard_rows
        return self.full.view(self.call.world_size, shard, -1)[:, start:end]

    def rows(self, source, start, end):
        self.log.append(("read", source, self.plan.group_of_band[start // self.plan.tile[0]]))
        return self.full[source * self.plan.shard_rows + start:source * self.plan.shard_rows + end]


def fake_rank_call(rank: int):
    plan = gather_plan()
    full = torch.randn(15, 6, dtype=torch.float64).float()
    b = torch.randn(6, 10)
    out = torch.full((15, 10), float("nan"))
    call = OverlapCall(full[rank * 5:(rank + 1) * 5], b, plan, "allgather", None, rank, 3, out)
    return call, full


def check_read_order(log: list, rank: int, groups: int, own_reads: bool = True) -> None:
    """Every chunk started before any read; own rows read first (when logged); chunk g read
    only after wait(g); the chunks waited for in group order."""
    starts = [e for e in log if e[0] == "start"]
    assert starts == [("start", g) for g in range(groups)] and log[:groups] == starts
    waits = [i for i, e in enumerate(log) if e[0] == "wait"]
    assert [log[i][1] for i in waits] == list(range(groups))
    before_first_wait = [e for e in log[:waits[0]] if e[0] == "read"]
    assert all(e[1] == rank for e in before_first_wait) and (before_first_wait or not own_reads)
    for i, e in enumerate(log):
        if e[0] == "read" and e[1] != rank:
            assert ("wait", e[2]) in log[:i], f"chunk {e[2]} read before it was waited for"


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_reference_reads_each_chunk_after_waiting_for_it(rank):
    call, full = fake_rank_call(rank)
    log = []
    execute_tiles(call, NoRecorder(), torch.float32, RecordingExchange(call, full, log))
    check_read_order(log, rank, 2)
    torch.testing.assert_close(call.out, full @ call.b)


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_decomposition_multiplies_own_rows_first_then_each_chunk_after_its_wait(rank, monkeypatch):
    """run_gather reads chunks through exchange.chunk() (logged as reads of the other shards)
    and multiplies through product_into (logged too)."""
    call, full = fake_rank_call(rank)
    log = []

    class Logged(RecordingExchange):
        def __init__(self, c):
            super().__init__(c, full, log)

        def chunk(self, g):
            log.extend(("read", s, g) for s in range(3) if s != rank)
            return super().chunk(g)

    def logged_product(x, y, dest):
        log.append(("matmul", dest.numel()))
        original(x, y, dest)

    original = decomposition.product_into
    monkeypatch.setattr(decomposition, "GatherExchange", Logged)
    monkeypatch.setattr(decomposition, "product_into", logged_product)
    decomposition.DecompositionBackend().run(call)
    torch.testing.assert_close(call.out, full @ call.b)
    assert log[:3] == [("start", 0), ("start", 1), ("matmul", 5 * 10)]  # own rows, no wait
    runs = 2 if rank == 1 else 1  # the other shards in one or two runs of ranks
    matmuls = [i for i, e in enumerate(log) if e[0] == "matmul"]
    assert len(matmuls) == 1 + 2 * runs
    check_read_order([e for e in log if e[0] != "matmul"], rank, 2, own_reads=False)


def test_reference_trace_stamps_every_tile_and_chunk():
    a, b = torch.randn(5, 6), torch.randn(6, 10)
    plan = gather_plan(m=5, world_size=1, group_sizes=(6, 3))
    out = torch.empty(5, 10)
    trace = ReferenceBackend().trace(OverlapCall(a, b, plan, "allgather", None, 0, 1, out))
    assert len(trace.item_end) == plan.num_tiles
    assert all(end is not None for end in trace.transfer_end)
    torch.testing.assert_close(out, a @ b)


# ---- on spawned ranks ------------------------------------------------------------------------------

def shard(label: str, rank: int) -> torch.Tensor:
    """Rank ``rank``'s a for call ``label``: a strided view ([7, 9], row stride 18)."""
    g = torch.Generator().manual_seed(sum(map(ord, label)) * 10 + rank)
    return torch.randn(7, 18, generator=g)[:, ::2]


def strided_sequential_and_repeat_on_rank(backend: str) -> list[str]:
    """Calls the suite does not make: an a that is a strided view, a sequential plan, and the
    first call's key called again with fresh values."""
    import torch.distributed as dist

    rank, w = dist.get_rank(), dist.get_world_size()
    problems = []
    for label in ("strided", "sequential", "again"):
        b = torch.randn(11, 9, generator=torch.Generator().manual_seed(len(label))).t()
        plan = None
        if label == "sequential":
            plan = Plan(7 * w, 11, 9, "allgather", w, "float32", (4, 11), 1, (w * 2,),
                        backend=backend, strategy="sequential")
        out = fo.overlap(shard(label, rank), b, op="allgather", plan=plan, backend=backend)
        want = torch.cat([shard(label, r) for r in range(w)]).double() @ b.double()
        if out.shape != want.shape or not torch.allclose(out.double(), want, atol=1e-4):
            problems.append(f"{label}: rank {rank} got {tuple(out.shape)} "
                            f"{out.double().sub(want).abs().max() if out.shape == want.shape else ''}")
    return problems


@pytest.mark.full
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["reference", "decomposition"])
def test_strided_a_sequential_plan_and_repeat_on_three_ranks(backend):
    with RankPool(3, "cpu", timeout=240) as pool:
        problems = pool.run(strided_sequential_and_repeat_on_rank, backend)
    assert problems == [[], [], []]
