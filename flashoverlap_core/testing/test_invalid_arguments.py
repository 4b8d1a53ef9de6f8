"""Every kind of invalid argument raises ValueError/TypeError before any device work: the calls
go to a tripwire around the backend under test, whose run() raises DeviceWorkStarted."""

import pytest

import flashoverlap_core as fo

from .invalid import (DECLINED, INVALID, INVALID_PLANS, K, M, N, Ctx, Invalid, attempt,
                      attempt_on_rank, attempt_unless_declined, declined,
                      mismatched_recv_splits_on_rank, raised_by, tripwire,
                      unequal_allgather_rows_on_rank, valid_dtype)

IN_PROCESS = [case for case in INVALID if case.world_size == 1]
ON_RANKS = [case for case in INVALID if case.world_size > 1]


def judge(case, raised: tuple[str, ...], message: str) -> None:
    if DECLINED in raised:
        pytest.skip(f"{case.label}: {message}")
    if "DeviceWorkStarted" in raised:
        pytest.fail(f"{case.label}: the invalid call reached the backend's run()", pytrace=False)
    assert raised, f"{case.label}: the invalid call returned without an error"
    assert case.error.__name__ in raised, (
        f"{case.label}: raised {raised[0]} ({message}), expected {case.error.__name__}")
    assert case.match.lower() in message.lower(), (
        f"{case.label}: the message does not say what is wrong (expected {case.match!r}): {message}")


@pytest.fixture
def ctx(fo_target):
    device = fo_target.device(0)
    return Ctx(device, 1, tripwire(fo_target.backend_name),
               valid_dtype(fo_target.backend_name, device.type))


def test_valid_call_reaches_the_tripwire(ctx):
    raised, message = attempt(lambda c: c.call(), ctx)
    assert "DeviceWorkStarted" in raised, f"a valid call did not reach run(): {raised} {message}"


@pytest.mark.parametrize("case", IN_PROCESS, ids=[c.label for c in IN_PROCESS])
def test_invalid_argument(case, ctx):
    judge(case, *attempt_unless_declined(case, ctx))


@pytest.mark.parametrize("label, error, match, kwargs", INVALID_PLANS, ids=[c[0] for c in INVALID_PLANS])
def test_invalid_plan_argument(label, error, match, kwargs, ctx):
    why = declined(ctx, kwargs.get("op", "allreduce"))
    if why:
        pytest.skip(f"{label}: {why}")
    judge(Invalid(label, error, match, None), *raised_by(lambda: ctx.plan(**kwargs)))


@pytest.fixture(scope="module")
def rank_attempts(_fo_pool_set, fo_settings):
    """All invalid calls of two ranks, made in one round trip."""
    if 2 not in fo_settings.world_sizes:
        pytest.skip(f"needs world size 2, not in --fo-world-sizes {list(fo_settings.world_sizes)}")
    return _fo_pool_set.run(2, attempt_on_rank, [case.label for case in ON_RANKS])


@pytest.mark.parametrize("case", ON_RANKS, ids=[c.label for c in ON_RANKS])
def test_invalid_argument_on_two_ranks(case, rank_attempts):
    for rank, results in enumerate(rank_attempts):
        assert "DeviceWorkStarted" in results["valid"][0], f"rank {rank}: a valid call did not reach run()"
        judge(case, *results[case.label])


def test_recv_splits_that_disagree_with_the_senders(_fo_pool_set, fo_settings):
    if 2 not in fo_settings.world_sizes:
        pytest.skip(f"needs world size 2, not in --fo-world-sizes {list(fo_settings.world_sizes)}")
    for rank, (raised, message) in enumerate(_fo_pool_set.run(2, mismatched_recv_splits_on_rank)):
        assert "ValueError" in raised and "recv_splits" in message, (
            f"rank {rank}: expected a ValueError about recv_splits, got {raised[:1]} {message!r}")


def test_allgather_with_unequal_rows(_fo_pool_set, fo_settings):
    if 2 not in fo_settings.world_sizes:
        pytest.skip(f"needs world size 2, not in --fo-world-sizes {list(fo_settings.world_sizes)}")
    for rank, (raised, message) in enumerate(_fo_pool_set.run(2, unequal_allgather_rows_on_rank)):
        if DECLINED in raised:
            pytest.skip(message)
        assert "ValueError" in raised and "same rows" in message, (
            f"rank {rank}: expected a ValueError saying the ranks need the same rows of a, "
            f"got {raised[:1]} {message!r}")


@pytest.mark.parametrize("call", ["overlap", "plan"])
def test_unknown_backend_lists_every_backend(call, ctx):
    with pytest.raises(ValueError) as info:
        if call == "overlap":
            fo.overlap(**ctx.call(backend="no-such-backend"))
        else:
            fo.plan(M, N, K, backend="no-such-backend")
    message = str(info.value)
    assert "no-such-backend" in message
    for status in fo.backends():
        assert status.name in message, f"{status.name} is not listed: {message}"
        assert status.available or status.reason in message, (
            f"{status.name}'s reason ({status.reason}) is not given: {message}")
