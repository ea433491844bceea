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
running decision's in ``aiolimit._deadline.DECISION_DEADLINE``; a store falls back to a budget of
its own when there is none (a limiter with ``deadline=None``).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from aiolimit._connection import is_retryable, map_errors
from aiolimit._errors import BackendUnavailable
from aiolimit._validation import check_seconds

T = TypeVar("T")

FIRST_BACKOFF = 0.05
MAX_BACKOFF = 0.5
#: Seconds an attempt needs at least; with less left before the deadline, give up.
LAST_ATTEMPT = 0.02


def check_deadline_seconds(seconds: object) -> float:
    return check_seconds("deadline", seconds, 0, 300, open_low=True)


#: The first retry waits at most this long: a connection reset or a moved slot is usually
#: over by the next attempt, and a decision should not pay 50 ms for it.
FIRST_RETRY = 0.005


def backoff(attempt: int) -> float:
    """Seconds to wait before retry ``attempt`` (0-based): the first within FIRST_RETRY, then
    50 ms doubling to 500 ms; jittered (each wait within [base/2, base])."""
    if attempt == 0:
        return random.random() * FIRST_RETRY
    base: float = min(MAX_BACKOFF, FIRST_BACKOFF * 2 ** (attempt - 1))
    return base / 2 + random.random() * base / 2


def _described(error: BaseException) -> str:
    """``error`` for the give-up message. An attempt cut by the deadline (a ``TimeoutError``
    from a cancellation) may have been cut while redis-py paused after an error it had met,
    such as the 0.25 s it sleeps after a CLUSTERDOWN: that error is what kept the call from
    succeeding, so it is named, not only the cut."""
    cut = error.__cause__ if isinstance(error, TimeoutError) else None
    met = cut.__context__ if isinstance(cut, asyncio.CancelledError) else None
    if isinstance(met, Exception):
        return f"{met!r}, then the deadline cut the attempt"
    return repr(error)


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
                    f"({failures} attempt{'s' if failures > 1 else ''}); "
                    f"last error: {_described(error)}"
                ) from error
            if statistics is not None:
                statistics.retries += 1
            await asyncio.sleep(pause)
        try:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("the deadline passed before the call was sent")
            async with asyncio.timeout(remaining):
                return await attempt()
        except Exception as exc:
            if not is_retryable(exc):
                with map_errors(address):
                    raise
            error = exc
            failures += 1
