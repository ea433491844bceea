"""Refills ahead (``Allowances.low``): a busy identifier's next units are asked for in the
background once its allowance runs low, so that the calls that follow are admitted here rather
than finding it empty and waiting for the store. On real servers: the store still counts
exactly what was admitted and what is held, whatever happens to the refill meanwhile."""

from __future__ import annotations

import asyncio
import logging

import pytest

from aiolimit import BackendError, Limit, Limiter
from tests._nodes import held, settle, stored
from tests._proxy import Proxy

pytestmark = pytest.mark.asyncio


async def test_a_busy_identifier_gets_its_next_units_before_it_runs_out(
    redis_url: str, prefix: str
) -> None:
    """One caller, calls spaced by more than a round trip: after the call that makes it busy,
    no call goes to the store (each allowance's successor was taken in the background before
    it ran out). Without refills ahead, every allowance's end sent one call to the store."""
    limits = [Limit(100_000, per=3600, precision=60)]
    async with Limiter(redis_url, limits, prefix=prefix, prefetch=16) as limiter:
        for _ in range(300):
            assert (await limiter.try_acquire("ip:a")).allowed
            await asyncio.sleep(0.001)
        statistics = limiter.statistics()
        asked = statistics.decisions - statistics.prefetched
        # (the first call, and the second that took the first units ahead; a slow machine
        # may find one allowance empty now and then)
        assert asked <= 6, asked
        await settle(limiter)
        assert await stored(redis_url, prefix, "ip:a", limits) == 300 + held(limiter, "ip:a")
    assert await stored(redis_url, prefix, "ip:a", limits) == 300


async def test_a_refill_ahead_the_store_refuses_charges_nothing(
    redis_url: str, prefix: str
) -> None:
    """Another process takes what is left between this one's last reply and its refill
    ahead: the refill is refused (sized from a stale remaining), charges nothing, and the
    identifier ends with exactly the limit admitted."""
    limits = [Limit(40, per=3600, precision=60)]
    async with (
        Limiter(redis_url, limits, prefix=prefix, prefetch=16) as limiter,
        Limiter(redis_url, limits, prefix=prefix) as other,
    ):
        admitted = 0
        for _ in range(3):  # (the second takes units ahead, the third is admitted here)
            admitted += (await limiter.try_acquire("ip:r")).allowed
        assert held(limiter, "ip:r") == 1
        while (await other.try_acquire("ip:r")).allowed:  # (all that is left)
            admitted += 1
        # The last unit held is taken here: the allowance is empty, its refill is asked for
        # in the background, with the store full.
        admitted += (await limiter.try_acquire("ip:r")).allowed
        await settle(limiter)
        assert held(limiter, "ip:r") == 0
        for _ in range(5):
            admitted += (await limiter.try_acquire("ip:r")).allowed
        assert admitted == 40
        await settle(limiter)
        assert await stored(redis_url, prefix, "ip:r", limits) == 40


async def _busy_with_a_refill_in_flight(limiter: Limiter, proxy: Proxy, ident: str) -> int:
    """Makes ``ident`` busy, then delays the store's replies and takes the allowance down
    until a refill ahead is sent: the admissions made."""
    admitted = 0
    for _ in range(2):  # (the second takes 2 units ahead)
        admitted += (await limiter.try_acquire(ident)).allowed
    proxy.delay = 0.3
    sent = len(limiter._ahead)
    while not limiter._ahead or len(limiter._ahead) == sent:
        decision = await limiter.try_acquire(ident)
        assert decision.allowed
        admitted += 1
    await asyncio.sleep(0.05)  # (the refill is sent; its reply is late)
    assert limiter._prefetch is not None and limiter._prefetch._in_flight == 1
    return admitted


async def test_a_reset_while_a_refill_ahead_is_in_flight_keeps_none_of_its_units(
    redis_url: str, prefix: str, standalone_proxy: Proxy
) -> None:
    """The reset wipes the units the refill charged: they are never admitted after it (the
    reply, late, comes under the old epoch), and from the reset on at most the limit is."""
    limits = [Limit(30, per=3600, precision=60)]
    async with (
        Limiter(standalone_proxy.url, limits, prefix=prefix, prefetch=50, deadline=2) as limiter,
        Limiter(redis_url, limits, prefix=prefix) as other,
    ):
        await _busy_with_a_refill_in_flight(limiter, standalone_proxy, "ip:z")
        await limiter.reset("ip:z")
        await settle(limiter)
        standalone_proxy.delay = 0.0
        assert held(limiter, "ip:z") == 0
        after = 0
        for _ in range(40):
            after += (await limiter.try_acquire("ip:z")).allowed
            after += (await other.try_acquire("ip:z")).allowed
        assert after == 30, after
        await settle(limiter)
    assert await stored(redis_url, prefix, "ip:z", limits) == 30


async def test_aclose_while_a_refill_ahead_is_in_flight_gives_its_units_back(
    redis_url: str, prefix: str, standalone_proxy: Proxy
) -> None:
    limits = [Limit(1000, per=3600, precision=60)]
    limiter = Limiter(standalone_proxy.url, limits, prefix=prefix, prefetch=50, deadline=2)
    admitted = await _busy_with_a_refill_in_flight(limiter, standalone_proxy, "ip:q")
    await limiter.aclose()  # (waits for the refill, whose units go back at once)
    assert not limiter._ahead
    assert await stored(redis_url, prefix, "ip:q", limits) == admitted


async def test_a_refill_ahead_cut_by_the_deadline_raises_nowhere_and_is_undone(
    redis_url: str, prefix: str, standalone_proxy: Proxy, caplog: pytest.LogCaptureFixture
) -> None:
    """``on_error="raise"``, replies later than the deadline: the refill fails in its task
    (logged at debug, never an unretrieved exception), the call it was sent for is undone,
    and the next call, the store answering again, decides as usual."""
    limits = [Limit(1000, per=3600, precision=60)]
    caplog.set_level(logging.DEBUG, logger="aiolimit")
    async with Limiter(
        standalone_proxy.url, limits, prefix=prefix, prefetch=50, deadline=0.1, on_error="raise"
    ) as limiter:
        admitted = 0
        for _ in range(2):
            admitted += (await limiter.try_acquire("ip:d")).allowed
        standalone_proxy.delay = 0.3
        while held(limiter, "ip:d"):
            admitted += (await limiter.try_acquire("ip:d")).allowed
        ahead = list(limiter._ahead)
        assert ahead
        await asyncio.wait(ahead)
        assert all(task.exception() is None for task in ahead)
        assert "taking units ahead in the background failed" in caplog.text
        with pytest.raises(BackendError):
            await limiter.try_acquire("ip:d")  # (the allowance is empty, the store late)
        standalone_proxy.delay = 0.0
        await asyncio.sleep(0.4)  # (the late replies are in)
        admitted += (await limiter.try_acquire("ip:d")).allowed
        await settle(limiter)
        assert await stored(redis_url, prefix, "ip:d", limits) == admitted + held(limiter, "ip:d")
    assert await stored(redis_url, prefix, "ip:d", limits) == admitted
