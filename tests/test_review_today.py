"""Adversarial review (h3) of four changes: stale counters dropped with the prune,
refund(decision=), the cross-slot check before the in-flight cap, bad rules as RulesError.
Real redis-server processes (conftest); each test names the one invariant it checks."""

from __future__ import annotations

import asyncio
import random
import socket
from typing import Any

import pytest
import redis.asyncio as redis_asyncio

from aiolimit import InvalidRequestError, Limiter
from aiolimit.testing import ManualClock

START = 1_700_000_040.0  # on a minute boundary


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- change 2: refund(ids, weight, decision=) ------------------------------------------------


async def test_refund_of_a_real_degraded_decision_is_returned_as_is() -> None:
    """README/docstring: 'A degraded decision charged nothing: it is returned as is, and nothing
    is sent.' A real fail-open decision (store down) has no details, so plans_charged raises
    'identifier ... was not charged' before the degraded check (_limiter.py refund)."""
    url = f"redis://127.0.0.1:{_closed_port()}"
    async with Limiter(url, "5/minute", on_error="open", deadline=0.5) as limiter:
        degraded = await limiter.try_acquire("user:1")
        assert degraded.allowed and degraded.degraded
        assert await limiter.refund("user:1", decision=degraded) is degraded


async def test_refund_with_another_limiters_decision_credits_nothing_here(
    redis_url: str, prefix: str
) -> None:
    """refund(decision=) 'credits only the pairs that decision charged'. A decision admitted by
    limiter A (prefix p:a) charged nothing under limiter B (prefix p:b); B.refund(ids,
    decision=a_decision) must not credit B's counters (or must be an InvalidRequestError).
    Observed: it credits B's 2/minute pair, and B admits a 3rd request within a minute."""
    clock = ManualClock(START)
    async with Limiter(redis_url, "2/minute", prefix=prefix + ":a", clock=clock) as a, Limiter(
        redis_url, "2/minute", prefix=prefix + ":b", clock=clock
    ) as b:
        from_a = await a.try_acquire("user:1")
        assert from_a.allowed
        assert [(await b.try_acquire("user:1")).allowed for _ in range(2)] == [True, True]
        try:
            await b.refund("user:1", decision=from_a)
        except InvalidRequestError:
            pass
        admitted = (await b.try_acquire("user:1")).allowed
        assert not admitted, "B admitted 3 within one minute under 2/minute"


async def test_refund_twice_with_one_decision_does_not_over_admit(
    redis_url: str, prefix: str
) -> None:
    """refund(decision=d) credits 'only the pairs that decision charged': d charged 1 unit, so
    refunding it twice must not give back a unit another request was charged. Observed: the
    second refund credits the other request's unit; 3 admitted within a minute under 2/minute."""
    clock = ManualClock(START)
    async with Limiter(redis_url, "2/minute", prefix=prefix, clock=clock) as limiter:
        d = await limiter.try_acquire("user:1")
        assert d.allowed
        assert (await limiter.try_acquire("user:1")).allowed  # another request
        await limiter.refund("user:1", decision=d)
        try:
            await limiter.refund("user:1", decision=d)
        except InvalidRequestError:
            pass
        admitted = [(await limiter.try_acquire("user:1")).allowed for _ in range(2)]
        assert admitted == [True, False], "3 admitted within one minute under 2/minute"


async def test_refund_of_a_decision_never_gives_back_more_than_it_charged(
    redis_url: str, prefix: str
) -> None:
    """d charged weight 1; refund(ids, 5, decision=d) must credit at most 1 (or be an
    InvalidRequestError). Observed: 5 are credited, other requests' charges included."""
    clock = ManualClock(START)
    async with Limiter(redis_url, "5/minute", prefix=prefix, clock=clock) as limiter:
        d = await limiter.try_acquire("user:1")
        assert d.allowed
        assert (await limiter.try_acquire("user:1", 4)).allowed  # another request: full
        try:
            await limiter.refund("user:1", 5, decision=d)
        except InvalidRequestError:
            pass
        remaining = (await limiter.peek("user:1")).remaining
        assert remaining <= 1, f"{remaining} left after refunding a decision that charged 1"
