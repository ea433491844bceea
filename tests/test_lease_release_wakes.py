"""A release in this process wakes a Concurrency waiter at once, a cancelled holder's too."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from aiolimit import Concurrency
from aiolimit.testing import ManualClock
from tests._workers import Backend

START = 1_700_000_000.0


@pytest.mark.parametrize("yields", list(range(12)))
async def test_release_racing_a_waiters_refusal_wakes_it(backend: Backend, yields: int) -> None:
    """README: a waiter for a full Concurrency limit "tries again at once when a lease is
    released in this process". On a manual clock that does not move, a waiter that missed
    the release sleeps its poll interval forever: a release that lands between the waiter's
    refused call and its registering for releases is missed (it waits up to 250 ms on a real
    clock, regardless of the release)."""
    clock = ManualClock(start=START)
    limiter = backend.limiter([Concurrency(1, lease_ttl=3600)], clock=clock)
    await limiter.peek("job:1")
    missed = []
    for attempt in range(5):
        held = await limiter.try_acquire("job:1")
        assert held.allowed and held.lease is not None
        waiter = asyncio.create_task(limiter.acquire("job:1"))
        for _ in range(yields):
            await asyncio.sleep(0)
        await held.lease.release()
        done, _ = await asyncio.wait({waiter}, timeout=1.0)
        if not done:
            missed.append(attempt)
            clock.advance(1)  # the poll sleep ends: it finds the slot free
            await asyncio.wait_for(waiter, 2)
        decision = waiter.result()
        assert decision.lease is not None
        await decision.lease.release()
    assert not missed, f"waiter missed the release in attempts {missed} (yields={yields})"


async def test_release_by_a_cancelled_holder_wakes_waiter(backend: Backend) -> None:
    """A holder whose scope is cancelled (anyio: re-delivered at the release's await)
    releases its lease, and the waiter in this process is woken by it (on this manual clock
    it would otherwise sleep for ever; on a real clock, its poll interval)."""
    clock = ManualClock(start=START)
    limiter = backend.limiter([Concurrency(1, lease_ttl=3600)], clock=clock)
    inside = asyncio.Event()

    async def holder() -> None:
        import anyio

        with anyio.CancelScope() as scope:
            async with limiter.limit("job:1", timeout=0):
                inside.set()
                scope.cancel()
                await asyncio.sleep(3600)

    hold = asyncio.create_task(holder())
    await inside.wait()
    waiter = asyncio.create_task(limiter.acquire("job:1"))
    await hold
    done, _ = await asyncio.wait({waiter}, timeout=1.0)  # (the manual clock stands still)
    if not done:
        clock.advance(1)
        await asyncio.wait_for(waiter, 2)
    decision = waiter.result()
    assert decision.lease is not None
    await decision.lease.release()
    assert done, "the waiter was not woken by the release"


async def test_a_release_that_lands_while_the_refusal_is_on_its_way_wakes_the_waiter(
    standalone_proxy: Any, prefix: str
) -> None:
    """The waiter's acquire is refused by the store, and its reply held back (proxy) until a
    release in this process has landed and woken its waiters: nobody was waiting yet. The
    waiter counts releases from before its call, so it tries again at once instead of
    sleeping its poll interval (for ever on this manual clock). It did sleep (and
    test_release_racing_a_waiters_refusal_wakes_it failed once in a CI run, at yields=7)."""
    from aiolimit import Limiter

    clock = ManualClock(start=START)
    seen, gate = asyncio.Event(), asyncio.Event()
    armed = False

    def on_request(link: Any, data: bytes) -> None:
        nonlocal armed
        if armed and b"acquire" in data:
            armed = False
            link.marks["held"] = True
            seen.set()

    async def on_reply(link: Any, data: bytes) -> None:
        if link.marks.pop("held", False):
            await gate.wait()

    standalone_proxy.on_request, standalone_proxy.on_reply = on_request, on_reply
    limits = [Concurrency(1, lease_ttl=3600)]
    async with Limiter(standalone_proxy.url, limits, prefix=prefix, clock=clock) as limiter:
        held = await limiter.try_acquire("job:1")
        assert held.allowed and held.lease is not None
        armed = True
        waiter = asyncio.create_task(limiter.acquire("job:1"))
        await asyncio.wait_for(seen.wait(), 2)
        await asyncio.sleep(0.05)  # (the store has refused it by now; the reply waits)
        await held.lease.release()
        gate.set()
        done, _ = await asyncio.wait({waiter}, timeout=1.0)
        if not done:
            clock.advance(1)  # (the poll sleep ends: it finds the slot free)
            await asyncio.wait_for(waiter, 2)
        decision = waiter.result()
        assert decision.lease is not None
        await decision.lease.release()
    assert done, "the waiter slept through a release that landed before it waited"
