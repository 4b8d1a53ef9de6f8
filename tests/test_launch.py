"""RankPool: results in rank order, a raising rank comes back as RankError with its traceback,
a hanging rank as RankTimeout within the timeout, and a pool that timed out is killed. Ranks:
fresh ranks after a call killed the pool or was cut short, one rank in the caller's process."""
import time

import pytest
import torch
import torch.distributed as dist

from flashoverlap_core.tools.ranks import RankError, RankPool, Ranks, RankTimeout


def rank_and_size():
    return dist.get_rank(), dist.get_world_size()


def sum_of_ranks():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item()


def raise_on_rank_1():
    if dist.get_rank() == 1:
        raise ZeroDivisionError("rank 1 divided by zero on purpose")
    return "fine"


def hang_on_rank_1():
    if dist.get_rank() == 1:
        time.sleep(3600)
    return "fine"


def raise_on_rank_0_while_rank_1_waits():
    if dist.get_rank() == 0:
        raise KeyError("rank 0 gave up before the collective")
    sum_of_ranks()  # rank 1 waits for rank 0 here


@pytest.fixture(scope="module")
def pool():
    with RankPool(2, "cpu", timeout=120) as p:
        yield p


@pytest.mark.timeout(300)
def test_runs_on_every_rank_in_rank_order(pool):
    assert pool.collective == "gloo"
    assert pool.run(rank_and_size) == [(0, 2), (1, 2)]
    assert pool.run(sum_of_ranks) == [3.0, 3.0]


@pytest.mark.timeout(300)
def test_a_raising_rank_gives_rank_error_with_its_traceback(pool):
    with pytest.raises(RankError) as info:
        pool.run(raise_on_rank_1)
    message = str(info.value)
    assert "rank 1" in message and "Traceback" in message and "raise_on_rank_1" in message
    assert "ZeroDivisionError: rank 1 divided by zero on purpose" in message
    assert pool.alive and pool.run(rank_and_size) == [(0, 2), (1, 2)]  # every rank answered


def processes_of(pool):
    return list(pool._procs)


@pytest.mark.full
@pytest.mark.timeout(300)
def test_a_hanging_rank_gives_rank_timeout_and_the_pool_is_killed():
    pool = RankPool(2, "cpu", timeout=120)
    procs = processes_of(pool)
    start = time.monotonic()
    with pytest.raises(RankTimeout, match=r"still pending: ranks \[1\]"):
        pool.run(hang_on_rank_1, timeout=5)
    assert time.monotonic() - start < 5 + 15
    assert not pool.alive and not any(p.is_alive() for p in procs)
    with pytest.raises(RankError, match="closed"):
        pool.run(rank_and_size)


@pytest.mark.full
@pytest.mark.timeout(300)
def test_a_rank_failing_while_another_waits_in_a_collective_does_not_hang():
    pool = RankPool(2, "cpu", timeout=120, pg_timeout=600)
    procs = processes_of(pool)
    start = time.monotonic()
    with pytest.raises(RankError, match=r"others did not answer: \[1\]") as info:
        pool.run(raise_on_rank_0_while_rank_1_waits)
    assert "KeyError: 'rank 0 gave up before the collective'" in str(info.value)
    assert time.monotonic() - start < 60
    assert not any(p.is_alive() for p in procs)


def pid():
    import os

    return os.getpid()


@pytest.mark.full
@pytest.mark.timeout(300)
def test_ranks_start_new_ranks_after_a_call_killed_theirs_or_was_cut_short(monkeypatch):
    with Ranks(2, "cpu", timeout=120) as ranks:
        first = ranks.run(pid)
        with pytest.raises(RankError):
            ranks.run(raise_on_rank_1)  # every rank answered: the same ranks go on
        assert ranks.run(pid) == first
        with pytest.raises(RankTimeout):
            ranks.run(hang_on_rank_1, timeout=5)  # the pool is killed
        second = ranks.run(pid)
        assert ranks.run(rank_and_size) == [(0, 2), (1, 2)]
        assert set(second).isdisjoint(first), "the killed ranks were reused"
        # an interrupt in the caller (pytest-timeout, Ctrl-C) may leave the ranks inside a
        # collective: the next call must not reuse them
        pool = ranks.pool
        monkeypatch.setattr(pool, "run", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
        with pytest.raises(KeyboardInterrupt):
            ranks.run(rank_and_size)
        assert set(ranks.run(pid)).isdisjoint(second) and not pool.alive


def test_one_rank_in_process_runs_here():
    import os

    assert Ranks(1, "cpu", in_process=True).run(pid) == [os.getpid()]
