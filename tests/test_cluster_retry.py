"""The cluster store's retry loop (aiolimit/_retry.py) alone: what is retried, how long it
waits, and that it never runs past the deadline. Pure logic: the attempts are plain functions.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from redis import exceptions as redis_errors

from aiolimit import BackendError, BackendUnavailable, ConfigurationError
from aiolimit._connection import is_retryable
from aiolimit._retry import (
    FIRST_BACKOFF,
    FIRST_RETRY,
    MAX_BACKOFF,
    RetryStatistics,
    backoff,
    call_with_retries,
)


def unreachable() -> redis_errors.RedisClusterException:
    try:
        try:
            raise redis_errors.ConnectionError("Error 111 connecting")
        except redis_errors.ConnectionError as cause:
            raise redis_errors.RedisClusterException(
                "Redis Cluster cannot be connected. Please provide at least one reachable node"
            ) from cause
    except redis_errors.RedisClusterException as exc:
        return exc


@pytest.mark.parametrize(
    "error",
    [
        redis_errors.ConnectionError("reset"),
        redis_errors.TimeoutError("slow"),
        redis_errors.ClusterDownError("CLUSTERDOWN The cluster is down"),
        redis_errors.TryAgainError("TRYAGAIN"),
        redis_errors.ClusterError("TTL exhausted."),
        redis_errors.MovedError("3999 127.0.0.1:6381"),
        redis_errors.AskError("3999 127.0.0.1:6381"),
        ConnectionRefusedError(),
        TimeoutError(),
        unreachable(),
    ],
    ids=repr,
)
def test_transient_errors_are_retried(error: BaseException) -> None:
    """Connection trouble, failover, migration and 'TTL exhausted' are worth another try."""
    assert is_retryable(error)


@pytest.mark.parametrize(
    "error",
    [
        redis_errors.ResponseError("ERR aiolimit: unknown mode"),
        redis_errors.NoScriptError("NOSCRIPT"),  # handled apart: reloaded, not waited for
        redis_errors.ClusterError("something else"),
        redis_errors.RedisClusterException(
            "Redis Cluster cannot be connected. ...: Cluster mode is not enabled on this node"
        ),
        ValueError("bug"),
    ],
    ids=repr,
)
def test_lasting_errors_are_not_retried(error: BaseException) -> None:
    """Script errors, a server not in cluster mode and bugs fail at once."""
    assert not is_retryable(error)


def test_backoff_retries_at_once_then_grows_from_50_ms_to_500_ms_with_jitter() -> None:
    """The first retry waits at most 5 ms; then each wait is within [base/2, base], base
    doubling from 50 ms and capped at 500 ms."""
    first = [backoff(0) for _ in range(200)]
    assert all(0 <= wait <= FIRST_RETRY for wait in first) and len(set(first)) > 1
    for attempt in range(1, 9):
        base = min(MAX_BACKOFF, FIRST_BACKOFF * 2 ** (attempt - 1))
        waits = [backoff(attempt) for _ in range(200)]
        assert all(base / 2 <= wait <= base for wait in waits)
        assert len(set(waits)) > 1  # jittered


async def test_gives_up_with_backend_unavailable_within_the_deadline() -> None:
    """An attempt that always fails is retried, then BackendUnavailable before the deadline."""
    calls = 0

    async def attempt() -> None:
        nonlocal calls
        calls += 1
        raise redis_errors.ConnectionError("refused")

    stats = RetryStatistics()
    started = time.monotonic()
    with pytest.raises(BackendUnavailable, match="attempts") as caught:
        await call_with_retries(attempt, deadline=started + 0.4, address="x", statistics=stats)
    assert time.monotonic() - started <= 0.4 + 0.05
    assert calls >= 3 and stats.retries == calls - 1 and stats.gave_up == 1
    assert isinstance(caught.value.__cause__, redis_errors.ConnectionError)


async def test_an_attempt_that_hangs_is_cut_at_the_deadline() -> None:
    """A call that never answers (a paused node) ends at the deadline, not a socket timeout."""

    async def attempt() -> None:
        await asyncio.sleep(30)

    started = time.monotonic()
    with pytest.raises(BackendUnavailable):
        await call_with_retries(attempt, deadline=started + 0.2, address="x")
    assert time.monotonic() - started < 0.3


async def test_success_after_transient_failures_returns_the_reply() -> None:
    """Two lost connections, then an answer: the answer is returned."""
    replies = iter([redis_errors.ConnectionError("a"), redis_errors.TryAgainError("b"), [1, 0]])

    async def attempt() -> list[int]:
        reply = next(replies)
        if isinstance(reply, BaseException):
            raise reply
        return reply

    assert await call_with_retries(attempt, deadline=time.monotonic() + 2, address="x") == [1, 0]


async def test_lasting_errors_are_translated_at_once() -> None:
    """A script error becomes BackendError, a non-cluster seed a ConfigurationError, unretried."""

    async def script_error() -> None:
        raise redis_errors.ResponseError("ERR aiolimit: unknown mode")

    async def not_a_cluster() -> None:
        raise redis_errors.RedisClusterException("...: Cluster mode is not enabled on this node")

    started = time.monotonic()
    with pytest.raises(BackendError):
        await call_with_retries(script_error, deadline=started + 5, address="x")
    with pytest.raises(ConfigurationError):
        await call_with_retries(not_a_cluster, deadline=started + 5, address="x")
    assert time.monotonic() - started < 0.1


async def test_giving_up_names_the_error_the_cut_attempt_had_met() -> None:
    """redis-py sleeps 0.25 s after a CLUSTERDOWN before it raises it; an attempt cut by the
    deadline in that sleep failed because of the CLUSTERDOWN, and the message says so (it said
    ``TimeoutError()``, as if the healthy node had not answered)."""

    async def attempt() -> None:
        try:
            raise redis_errors.ClusterDownError("The cluster is down")
        except redis_errors.ClusterDownError:
            await asyncio.sleep(30)  # (redis-py's own pause, cut by the deadline)
            raise

    started = time.monotonic()
    with pytest.raises(BackendUnavailable, match="ClusterDownError") as caught:
        await call_with_retries(attempt, deadline=started + 0.2, address="x")
    assert "deadline" in str(caught.value)
    assert time.monotonic() - started < 0.3
