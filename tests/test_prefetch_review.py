"""Adversarial review of prefetched allowances (``aiolimit/_prefetch.py``) on real servers."""

from __future__ import annotations

import asyncio
import random

import pytest

from aiolimit import ConfigurationError, FixedWindow, Limit, Limiter
from aiolimit._clock import LocalClock
from tests._nodes import stored

pytestmark = pytest.mark.asyncio


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


async def test_prefetch_refuses_a_clock_of_each_process_s_own(redis_url: str) -> None:
    """With ``LocalClock`` each process judges by its own clock, and the store judges a key by
    max(now, its last write): a process whose clock is ahead moves the key into the next bucket
    while another's allowance, charged in the bucket before, would still admit by its own clock
    (with B 0.95 s ahead, B was admitted 10 of ``FixedWindow(10, per=1)`` in the new bucket and
    A one more from its allowance). So prefetch takes the server's clock or an authority."""
    with pytest.raises(ConfigurationError, match="one clock"):
        Limiter(redis_url, [FixedWindow(10, per=1)], prefetch=8, clock=LocalClock())
    async with Limiter("memory://", [FixedWindow(10, per=1)], prefetch=8) as alone:
        # (memory:// is this process's alone: its one clock judges everything)
        for _ in range(12):
            await alone.try_acquire("ip:s")
        assert alone.statistics().allowed == 10


@pytest.mark.parametrize("short", [False, True])
@pytest.mark.parametrize("seed", range(6))
async def test_several_limiters_with_refunds_cancellations_and_short_buckets_store_exactly(
    redis_url: str, prefix: str, seed: int, short: bool
) -> None:
    rng = random.Random(seed)
    rules = {"ip": [Limit(300, per=3600, precision=60)], "user": [FixedWindow(250, per=3600)]}
    if short:
        rules = {
            "ip": [Limit(300, per=60, precision=0.02), Limit(1000, per=30, precision=0.033)],
            "user": [Limit(250, per=60, precision=0.05)],
        }
    limiters = [
        Limiter(
            redis_url,
            rules,
            prefix=prefix,
            prefetch=rng.choice([4, 16, 64]),
            cache_refusals=rng.random() < 0.5,
        )
        for _ in range(3)
    ]
    admitted = {"ip:a": 0, "user:b": 0}
    refunded = {"ip:a": 0, "user:b": 0}

    async def one(limiter: Limiter) -> None:
        ids = rng.choice([["ip:a"], ["user:b"], ["ip:a", "user:b"], ["user:b", "ip:a"]])
        w = rng.choice([1, 1, 1, 2, 5])
        d = await limiter.try_acquire(ids, w)
        if d.allowed:
            for i in ids:
                admitted[i] += w
            if rng.random() < 0.15:
                await asyncio.sleep(0)
                for i in ids:
                    refunded[i] += w
                await asyncio.shield(limiter.refund(ids, decision=d))

    try:
        for _ in range(80):
            tasks = [asyncio.create_task(one(rng.choice(limiters))) for _ in range(10)]
            await asyncio.sleep(0)
            if rng.random() < 0.3:
                for _ in range(rng.randint(1, 3)):
                    await asyncio.sleep(0)
            if short and rng.random() < 0.3:
                await asyncio.sleep(rng.random() * 0.02)
            for t in tasks:
                if rng.random() < 0.2:
                    t.cancel()
            res = await asyncio.gather(*tasks, return_exceptions=True)
            for r in res:
                if isinstance(r, Exception):
                    raise r
    finally:
        for limiter in limiters:
            await limiter.aclose()
    net_ip = admitted["ip:a"] - refunded["ip:a"]
    net_user = admitted["user:b"] - refunded["user:b"]
    assert await stored(redis_url, prefix, "ip:a", rules["ip"]) == net_ip
    assert await stored(redis_url, prefix, "user:b", rules["user"]) == net_user
    assert net_ip <= 300 and net_user <= 250
