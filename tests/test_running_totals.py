"""A sliding window keeps running totals of the units charged into it (see
lua/sliding_window.lua). On a key that never idles they only grow: past 2**53 a Lua number
(a double) no longer holds them exactly, and the counts taken as their differences go wrong.
The script rebases them (the oldest kept total becomes 0) long before."""

from __future__ import annotations

import pytest
import redis.asyncio as redis_asyncio

from aiolimit import Limit, Limiter
from aiolimit.testing import ManualClock

AMOUNT = 10**12
WEIGHT = AMOUNT // 2 - 1  # odd: sums of it past 2**53 are not doubles
STEPS = 2**53 // WEIGHT + 200  # the running total passes 2**53 with 200 steps to spare


@pytest.mark.parametrize("store", ["redis", "memory"])
async def test_running_totals_of_a_busy_window_stay_exact_past_2_53(
    redis_url: str, prefix: str, store: str
) -> None:
    """One charge a second on a 2 s window with 1 s buckets: the window never empties, and
    every charge must leave exactly AMOUNT - 2 * WEIGHT (the last two buckets' charges)."""
    clock = ManualClock(1_700_000_000)
    url = redis_url if store == "redis" else "memory://"
    wrong = []
    async with Limiter(url, [Limit(AMOUNT, per=2, precision=1)], prefix=prefix, clock=clock) as lim:
        assert (await lim.try_acquire("k:1", WEIGHT)).allowed
        for step in range(STEPS):
            clock.advance(1)
            decision = await lim.try_acquire("k:1", WEIGHT)
            if not decision.allowed or decision.remaining != AMOUNT - 2 * WEIGHT:
                wrong.append((step, decision.allowed, decision.remaining))
                if len(wrong) > 5:
                    break
        if store == "redis":
            client = redis_asyncio.from_url(redis_url)
            try:
                stored = await client.hgetall(lim.storage_keys("k:1")[0])
            finally:
                await client.aclose()
            window = next(v for k, v in stored.items() if k.startswith(b"w"))
            numbers = [
                int(n) for n in window.replace(b"|", b",").replace(b":", b",").split(b",") if n
            ]
            assert max(numbers) < 2**53, window
    assert wrong == []
