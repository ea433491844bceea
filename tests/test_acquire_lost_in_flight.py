"""Waiters cancelled or cut by the deadline while their call is in flight."""

from __future__ import annotations

import asyncio

import anyio
import pytest

from aiolimit import BackendError, Concurrency, Limiter, TokenBucket
from aiolimit.testing import ManualClock
from tests._proxy import Proxy

START = 1_700_000_000.0


async def _drain(limiter: Limiter) -> None:
    with anyio.fail_after(10):
        while limiter._protocol._tasks:
            await asyncio.wait(set(limiter._protocol._tasks))


@pytest.mark.parametrize("how", ["cancel", "deadline"])
async def test_reserving_call_lost_in_flight_frees_its_turn(
    standalone_proxy: Proxy, redis_url: str, prefix: str, how: str
) -> None:
    clock = ManualClock(start=START)
    limits = [TokenBucket(1, per=1, burst=1)]
    async with Limiter(
        standalone_proxy.url, limits, prefix=prefix, clock=clock, deadline=0.2
    ) as limiter:
        assert (await limiter.try_acquire("ip:1")).allowed  # A: [0, 1)
        standalone_proxy.delay = 0.4  # the reply to B's reserving call comes late
        b = asyncio.create_task(limiter.acquire("ip:1", timeout=30))
        await asyncio.sleep(0.1)
        if how == "cancel":
            b.cancel()
            with pytest.raises(asyncio.CancelledError):
                await b
        else:
            with pytest.raises(BackendError):
                await b
        await asyncio.sleep(0.5)
        standalone_proxy.delay = 0.0
        await _drain(limiter)
    async with Limiter(redis_url, limits, prefix=prefix, clock=clock) as fresh:
        c = asyncio.create_task(fresh.acquire("ip:1", timeout=30))
        for _ in range(20):
            await asyncio.sleep(0.005)
        clock.advance(1)
        with anyio.fail_after(2):
            got = await c  # B's turn [1, 2) was freed: C is admitted at 1
        assert got.allowed
        assert not (await fresh.try_acquire("ip:1")).allowed


async def test_lease_taking_call_cancelled_in_flight_leaves_no_lease(
    standalone_proxy: Proxy, redis_url: str, prefix: str
) -> None:
    limits = [Concurrency(1, lease_ttl=3600)]
    async with Limiter(standalone_proxy.url, limits, prefix=prefix, deadline=2) as limiter:
        await limiter.peek("job:1")
        standalone_proxy.delay = 0.3
        task = asyncio.create_task(limiter.acquire("job:1", timeout=5))
        await asyncio.sleep(0.1)  # the call reached the server; its reply is late
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.4)
        standalone_proxy.delay = 0.0
        await _drain(limiter)
    async with Limiter(redis_url, limits, prefix=prefix) as fresh:
        decision = await fresh.try_acquire("job:1")
        assert decision.allowed, "a cancelled acquire left its lease behind"
        assert decision.lease is not None
        await decision.lease.release()
