"""all_to_all under expert parallelism on gloo ranks: each call's rows and splits are its own
(zeros, skew, ranks without rows), and nothing of them may make ranks disagree or hang."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flashoverlap_core as fo
from flashoverlap_core import api, collectives
from flashoverlap_core.reference import ReferenceBackend
from flashoverlap_core.tools.ranks import RankPool
from test_torch_ops_ranks import ranks as shared_ranks


def _want(a_all, b_all, splits, rank):
    """float64 rows that every source sends ``rank``, in source order."""
    parts = []
    for src, (a, b) in enumerate(zip(a_all, b_all)):
        start = sum(splits[src][:rank])
        parts.append(a[start:start + splits[src][rank]].double() @ b.double())
    return torch.cat(parts)


def _issue_repro(_):
    """3 ranks, M = N = K = 1: call 1 with splits [0,1,0], [0,0,1], [0,1,0] and b = w.t(), call
    2 with [0,1,0] everywhere and b = w.t().contiguous() (the same strides for a 1x1 b): rank
    0's arguments repeat, ranks 1 and 2's are new."""
    import torch.distributed as dist

    api.forget_prepared()
    rank = dist.get_rank()
    w = torch.ones(1, 1, dtype=torch.bfloat16)
    a = torch.full((1, 1), float(rank + 1), dtype=torch.bfloat16)
    first = [[0, 1, 0], [0, 0, 1], [0, 1, 0]]
    results = []
    for splits, b in ((first, w.t()), ([[0, 1, 0]] * 3, w.t().contiguous())):
        recv = [s[rank] for s in splits]
        out = fo.overlap(a, b, "all_to_all", send_splits=splits[rank], recv_splits=recv)
        want = torch.tensor([[float(src + 1)] for src in range(3) if splits[src][rank]])
        results.append(bool(torch.equal(out.double(), want.double().reshape(out.shape))))
    return results


@pytest.mark.full
def test_the_issue_repro_does_not_hang():
    with RankPool(3, timeout=120) as pool:
        assert pool.run(_issue_repro, 0) == [[True, True]] * 3


def _sequence(seed, calls, backend):
    """``calls`` calls whose rows and splits change every call on every rank (a rank has no
    rows now and then); recv_splits given on every other call; each checked against float64."""
    import torch.distributed as dist

    api.forget_prepared()
    rank, world = dist.get_rank(), dist.get_world_size()
    worst = 0.0
    for call in range(calls):
        rng = random.Random(seed * 1000 + call)
        rows = [0 if rng.random() < 0.15 else rng.randint(1, 70) for _ in range(world)]
        splits = []
        for r in range(world):
            cuts = sorted(rng.choices(range(rows[r] + 1), k=world - 1))
            splits.append([y - x for x, y in zip([0] + cuts, cuts + [rows[r]])])
        g = [torch.Generator().manual_seed(seed + 31 * call + r) for r in range(world)]
        a_all = [torch.randn(rows[r], 24, generator=g[r]).to(torch.bfloat16) for r in range(world)]
        b_all = [torch.randn(24, 40, generator=g[r]).to(torch.bfloat16) for r in range(world)]
        recv = [s[rank] for s in splits] if call % 2 == 0 else None
        out = fo.overlap(a_all[rank], b_all[rank], "all_to_all", send_splits=splits[rank],
                         recv_splits=recv, backend=backend)
        want = torch.cat([(a_all[src][sum(splits[src][:rank]):sum(splits[src][:rank + 1])]
                           .double() @ b_all[src].double()) for src in range(world)])
        assert out.shape == want.shape, (call, out.shape, want.shape)
        if want.numel():
            worst = max(worst, float((out.double() - want).abs().max() / want.abs().max()))
    return {"worst": worst, "keys": len(fo.prepared_calls()),
            "backends": sorted({c["backend"] for c in fo.prepared_calls()})}


@pytest.mark.full
def test_forty_calls_of_changing_rows_and_splits():
    with RankPool(2, timeout=240) as pool:
        for backend in (None, "reference", "decomposition"):
            results = pool.run(_sequence, 3, 40, backend)
            for r in results:
                assert r["worst"] < 2e-2, (backend, results)
                assert r["keys"] == 1, (backend, results)  # rows and splits are not in the key
            assert len({tuple(r["backends"]) for r in results}) == 1, results


def _count_exchanges(seed):
    import torch.distributed as dist

    api.forget_prepared()
    rank, world = dist.get_rank(), dist.get_world_size()
    calls = []
    real = collectives.rows_from_ranks
    collectives.rows_from_ranks = lambda *a: calls.append(1) or real(*a)
    try:
        counts = {}
        for given in (True, False):
            before = len(calls)
            for call in range(3):
                send = [2 + rank + call, 6 - rank]
                recv = [2 + r + call if rank == 0 else 6 - r for r in range(world)]
                a = torch.randn(sum(send), 4)
                fo.overlap(a, torch.randn(4, 5), "all_to_all", send_splits=send,
                           recv_splits=recv if given else None, backend="reference")
            counts[given] = len(calls) - before
        return counts
    finally:
        collectives.rows_from_ranks = real


def test_given_recv_splits_exchange_nothing():
    for counts in shared_ranks(2).run(_count_exchanges, 5, timeout=120):
        assert counts == {True: 0, False: 3}, counts


def _bad_splits_on_rank_one(first_call: bool):
    """Rank 1's send_splits sum to 7 while its a has 6 rows, on the key's first call (given
    recv_splits are checked then) or on a later one (recv_splits omitted: the count exchange)."""
    import torch.distributed as dist

    api.forget_prepared()
    rank = dist.get_rank()
    b = torch.randn(4, 5)
    if not first_call:
        fo.overlap(torch.randn(6, 4), b, "all_to_all", send_splits=[3, 3])  # prepares the key
    send = [3, 4] if rank == 1 else [3, 3]
    try:
        fo.overlap(torch.randn(6, 4), b, "all_to_all", send_splits=send,
                   recv_splits=[3, 3] if first_call else None)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("first_call", [True, False])
def test_invalid_splits_on_one_rank_raise_on_every_rank(first_call):
    messages = shared_ranks(2).run(_bad_splits_on_rank_one, first_call, timeout=120)
    assert "must sum to the rows of a" in messages[1], messages
    if first_call:
        assert "rank 1" in messages[0] and "must sum to the rows of a" in messages[0], messages
    else:
        assert "rank(s) [1]" in messages[0] and "invalid" in messages[0], messages


def test_negative_splits_are_refused_before_any_work():
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    for bad, match in (([-1], "must be >= 0"), ([1, 2], "must have one entry per rank"),
                       ([4], "must sum to the rows")):
        try:
            fo.overlap(a, b, "all_to_all", send_splits=bad)
        except ValueError as e:
            assert match in str(e), (bad, str(e))
        else:
            raise AssertionError(f"send_splits {bad} were accepted")


def test_no_rows_at_world_size_one():
    out = fo.overlap(torch.randn(0, 4), torch.randn(4, 5), "all_to_all")
    assert out.shape == (0, 5)


def test_the_moe_benchmark_runs_on_host_ranks(tmp_path):
    """bench/moe.py end to end on 2 gloo ranks (a dry run: host times say nothing)."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "FO_RESULTS_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "moe.py", "--device", "cpu", "--world-size", "2",
                           "--hidden", "32", "--tokens", "12,30", "--iters", "1"],
                          cwd=root / "bench", env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    doc = json.loads(next(tmp_path.glob("moe-cpu-*.json")).read_text())
    assert [r["tokens"] for r in doc["rows"]] == [12, 30]
    assert all(r["fo_rel_err"] < 1e-4 and r["fo_backend"] for r in doc["rows"]), doc["rows"]
    assert doc["summary"]["backends"] and doc["world_size"] == 2


class _EqualBlocksOnly(ReferenceBackend):
    """Runs only equal destination blocks (as a signaling GEMM without row-granular blocks)."""

    name = "fake-equal-blocks"

    def plan_reasons(self, plan):
        if len(set(plan.block_rows)) > 1:
            return ["destination blocks of unequal rows (fake backend for tests)"]
        return []


def _unequal_rows_for_a_named_backend(_):
    import torch.distributed as dist

    from flashoverlap_core import registry

    api.forget_prepared()
    registry.register(_EqualBlocksOnly())
    rank = dist.get_rank()
    send = [2, 4] if rank == 1 else [3, 3]
    recv = [3, 2] if rank == 0 else [3, 4]
    try:
        fo.overlap(torch.randn(6, 4), torch.randn(4, 5), "all_to_all", send_splits=send,
                   recv_splits=recv, backend="fake-equal-blocks")
    except ValueError as e:
        return str(e)
    return "no error"


def test_rows_a_named_backend_refuses_on_one_rank_raise_on_every_rank():
    with RankPool(2, timeout=120) as pool:
        messages = pool.run(_unequal_rows_for_a_named_backend, 0)
    assert "unequal rows" in messages[1], messages
    assert "rank 1" in messages[0] and "unequal rows" in messages[0], messages


class _PerCallLayout(ReferenceBackend):
    """Lays out each call from its own splits (Backend.prepare_all_to_all), as the cuda backend
    does: here the product, then one all_to_all_single; it keeps what each call was given."""

    name = "fake-per-call-layout"

    def prepare_all_to_all(self, template):
        import torch.distributed as dist

        group, world = template.group, template.world_size
        backend = self

        class Rows:
            seen: list = []

            def run(self, a, b, out, send, recv):
                assert sum(send) == a.shape[0] and out.shape == (sum(recv), b.shape[1])
                self.seen.append((tuple(send), tuple(recv)))
                c = (a.double() @ b.double()).to(a.dtype)
                if group is None or world == 1:
                    return out.copy_(c)
                dist.all_to_all_single(out, c, list(recv), list(send), group=group)
                return out

        backend.rows = Rows()
        return backend.rows


def _sequence_per_call_layout(seed, calls):
    from flashoverlap_core import registry

    fake = _PerCallLayout()
    registry.register(fake)
    result = _sequence(seed, calls, fake.name)
    result["runner"] = fo.prepared_calls()[-1]["runner"]
    result["seen"] = len(fake.rows.seen)
    return result


@pytest.mark.parametrize("world", [1, pytest.param(3, marks=pytest.mark.full)])
def test_a_backend_that_lays_out_each_call_gets_every_call_with_its_splits(world):
    """prepare_all_to_all: once per key, then every call with its checked splits and the rows
    it receives (exchanged when recv_splits are omitted), and an out of that many rows."""
    with RankPool(world, timeout=240) as pool:
        results = pool.run(_sequence_per_call_layout, 5, 12)
    for r in results:
        assert r["worst"] < 2e-2 and r["keys"] == 1 and r["seen"] == 12, results
        assert r["backends"] == ["fake-per-call-layout"], results
