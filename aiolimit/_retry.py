"""Retrying store calls with backoff, within one decision's deadline.

A cluster call can fail for a moment while the cluster heals: a primary died and its replica is
not promoted yet (connection refused, CLUSTERDOWN), slots are migrating (TRYAGAIN, or redis-py's
"TTL exhausted" when ASKING and the command took different connections), or a node is slow.
redis-py's own cluster retry loop ignores its backoff and burns out in milliseconds against a
dead node, so aiolimit turns it off and retries here instead: about 50 ms, doubling to 500 ms,
jittered, and never past the decision's deadline. Past it, ``BackendUnavailable``.

Resending is only safe because of what is resent: read-only ``check`` calls, and charging calls
that carry an operation id, which the scripts apply once (see ``lua/decide.lua``).

The deadline is absolute, on ``time.monotonic()``: the limiter's failure policy publishes the
running decision's in ``aiolimit._failure.DECISION_DEADLINE``; a store falls back to a budget of
its own when there is none (a limiter with ``deadline=None``).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
from redis import exceptions as redis_errors

from aiolimit._errors import BackendUnavailable, ConfigurationError
from aiolimit._failure import DECISION_DEADLINE
from aiolimit._stores.base import translate_errors

T = TypeVar("T")

FIRST_BACKOFF = 0.05
MAX_BACKOFF = 0.5
#: Seconds an attempt needs at least; with less left before the deadline, give up.
LAST_ATTEMPT = 0.02

_RETRYABLE: tuple[type[BaseException], ...] = (
    redis_errors.ConnectionError,  # also covers redis-py's MaxConnectionsError
    redis_errors.TimeoutError,
    redis_errors.ClusterDownError,  # CLUSTERDOWN, and MASTERDOWN (a subclass)
    redis_errors.TryAgainError,
    redis_errors.SlotNotCoveredError,
    redis_errors.BusyLoadingError,  # a restarted node still loading
    redis_errors.ReadOnlyError,  # a write reached a demoted primary
    redis_errors.AskError,
    redis_errors.MovedError,
    ConnectionError,
    TimeoutError,
    asyncio.TimeoutError,
)


def current_deadline() -> float | None:
    """The running decision's absolute deadline (``time.monotonic()``), set by the limiter."""
    return DECISION_DEADLINE.get()


def check_deadline_seconds(seconds: object) -> float:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise ConfigurationError(f"deadline must be seconds (a number), got {seconds!r}")
    if not 0 < seconds <= 300:
        raise ConfigurationError(f"deadline must be 0 < seconds <= 300, got {seconds!r}")
    return float(seconds)


def is_retryable(error: BaseException) -> bool:
    """True for errors that a moment later, on a healed cluster, may not happen again."""
    if isinstance(error, _RETRYABLE):
        return True
    if isinstance(error, redis_errors.ClusterError):
        return "TTL exhausted" in str(error)
    if isinstance(error, redis_errors.RedisClusterException):
        # No startup node reachable right now (all restarting, or a network blip). A seed that
        # answers but is not a cluster is a configuration error and is not retried.
        cause = error.__context__ or error.__cause__
        return "cannot be connected" in str(error) and isinstance(
            cause, (redis_errors.ConnectionError, redis_errors.TimeoutError, OSError)
        )
    return False


def backoff(attempt: int) -> float:
    """Seconds to wait before retry ``attempt`` (0-based): 50 ms doubling to 500 ms, jittered."""
    base: float = min(MAX_BACKOFF, FIRST_BACKOFF * 2**attempt)
    return base / 2 + random.random() * base / 2


class RetryStatistics:
    """Counters of one store's retry loop (this process only)."""

    __slots__ = ("gave_up", "retries")

    def __init__(self) -> None:
        self.retries = 0
        self.gave_up = 0


async def call_with_retries(
    attempt: Callable[[], Awaitable[T]],
    *,
    deadline: float,
    address: str,
    statistics: RetryStatistics | None = None,
    failed: BaseException | None = None,
) -> T:
    """Runs ``attempt`` until it succeeds, retrying retryable errors until ``deadline``.

    Each attempt is also cut off at the deadline (a paused node would otherwise hold it for a
    whole socket timeout). A non-retryable error is raised at once, translated. ``failed`` is
    the retryable error of an attempt made elsewhere (a pipeline): the first try here is then
    already a retry and waits its backoff.
    """
    failures = 0 if failed is None else 1
    error = failed
    while True:
        if error is not None:
            # The last pause is cut short so that one more attempt still fits the deadline.
            pause = min(backoff(failures - 1), deadline - time.monotonic() - LAST_ATTEMPT)
            if pause < 0:
                if statistics is not None:
                    statistics.gave_up += 1
                raise BackendUnavailable(
                    f"store at {address} did not answer within the deadline "
                    f"({failures} attempt{'s' if failures > 1 else ''}); last error: {error!r}"
                ) from error
            if statistics is not None:
                statistics.retries += 1
            await anyio.sleep(pause)
        try:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("the deadline passed before the call was sent")
            async with asyncio.timeout(remaining):
                return await attempt()
        except Exception as exc:
            if not is_retryable(exc):
                with translate_errors(address):
                    raise
            error = exc
            failures += 1
