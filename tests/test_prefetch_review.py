"""Adversarial review of prefetched allowances (``aiolimit/_prefetch.py``) on real servers."""

from __future__ import annotations

import asyncio

import pytest

from aiolimit import Limit, Limiter
from tests._nodes import stored

pytestmark = pytest.mark.asyncio


async def settle(limiter: Limiter, within: float = 10.0) -> None:
    protocol = limiter._protocol
    async with asyncio.timeout(within):
        while protocol._tasks:  # noqa: ASYNC110 - the protocol has no event for it
            await asyncio.sleep(0.005)


async def test_a_reset_during_a_prefetching_call_leaves_no_allowance(
    redis_url: str, prefix: str
) -> None:
    """A call that takes units ahead is in flight when this limiter resets the identifier:
    the reset wipes those units from the store, so they must not be admitted here after it
    (the reset cannot drop an allowance that does not exist yet)."""
    limits = [Limit(40, per=3600, precision=60)]
    async with (
        Limiter(redis_url, limits, prefix=prefix, prefetch=100) as limiter,
        Limiter(redis_url, limits, prefix=prefix) as other,
    ):
        assert (await limiter.try_acquire("ip:z")).allowed  # (busy now: the next takes ahead)
        call = asyncio.create_task(limiter.try_acquire("ip:z"))
        await asyncio.sleep(0)  # (sent)
        await limiter.reset("ip:z")
        assert (await call).allowed  # (ran before the reset: admitted, wiped by it)
        after = 0
        for _ in range(50):
            after += (await limiter.try_acquire("ip:z")).allowed
            after += (await other.try_acquire("ip:z")).allowed
        # After the reset, at most the limit is admitted.
        assert after <= 40, after


async def test_a_limiter_closed_during_a_prefetching_call_gives_its_units_back(
    redis_url: str, prefix: str
) -> None:
    """aclose while a call that takes units ahead is in flight: the allowance it opens once
    the reply comes must still be given back, so the store ends counting what was admitted."""
    limits = [Limit(1000, per=3600, precision=60)]
    limiter = Limiter(redis_url, limits, prefix=prefix, prefetch=50)
    admitted = (await limiter.try_acquire("ip:q")).allowed  # (busy now: the next takes ahead)
    call = asyncio.create_task(limiter.try_acquire("ip:q"))
    await asyncio.sleep(0)
    await limiter.aclose()
    admitted += (await call).allowed  # (sent before the close: answered)
    assert await stored(redis_url, prefix, "ip:q", limits) == admitted
