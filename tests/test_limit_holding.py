"""Holding Concurrency slots (limit(), limited(), leases), on both stores."""

from __future__ import annotations

import asyncio
import time

import anyio
import pytest

from aiolimit import Concurrency, LeaseExpired, RateLimited, WeightNeverFits
from aiolimit.testing import ManualClock
from tests._workers import Backend

START = 1_700_000_000.0


async def test_a_limit_object_shared_by_tasks_releases_each_ones_lease(backend: Backend) -> None:
    """``guard = limiter.limit(ids)`` used by concurrent tasks as ``async with guard:`` (the
    way an asyncio.Semaphore is shared): each exit releases its own lease (it released the
    latest admission's, so one lease was held until its lease_ttl)."""
    limiter = backend.limiter([Concurrency(2, lease_ttl=3600)])
    guard = limiter.limit("job:1", timeout=0)
    inside = asyncio.Event()
    leave = asyncio.Event()

    async def user() -> None:
        async with guard:
            inside.set()
            await leave.wait()

    with anyio.fail_after(10):
        first = asyncio.create_task(user())
        await inside.wait()
        second = asyncio.create_task(user())
        await asyncio.sleep(0.05)
        leave.set()
        await asyncio.gather(first, second)
        # Both holders have left: both slots must be free again.
        free = await limiter.peek("job:1", 2)
    assert free.allowed, f"after both exits only {free.remaining} of 2 slots are free"


async def test_expired_lease_release_does_not_free_anothers_slot(backend: Backend) -> None:
    clock = ManualClock(start=START)
    limiter = backend.limiter([Concurrency(1, lease_ttl=10)], clock=clock)
    a = await limiter.try_acquire("job:1")
    assert a.allowed and a.lease is not None
    clock.advance(11)
    b = await limiter.try_acquire("job:1")
    assert b.allowed and b.lease is not None
    with pytest.raises(LeaseExpired):
        await a.lease.renew()
    await a.lease.release()
    await a.lease.release()  # twice: idempotent
    c = await limiter.try_acquire("job:1")
    assert not c.allowed, "releasing an expired lease freed the slot its successor holds"
    await b.lease.release()
    d = await limiter.try_acquire("job:1")
    assert d.allowed and d.lease is not None
    await d.lease.release()


async def test_limited_releases_on_error_and_cancellation(backend: Backend) -> None:
    limiter = backend.limiter([Concurrency(1, lease_ttl=3600)])
    started = asyncio.Event()

    @limiter.limited("job:1", timeout=0)
    async def fails() -> None:
        raise ValueError("boom")

    @limiter.limited("job:1", timeout=0)
    async def sleeps() -> None:
        started.set()
        await asyncio.sleep(3600)

    with anyio.fail_after(10):
        with pytest.raises(ValueError):
            await fails()
        task = asyncio.create_task(sleeps())
        await started.wait()
        with pytest.raises(RateLimited):
            await fails()  # the slot is held by sleeps()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        with pytest.raises(ValueError):
            await fails()  # the slot came back


async def test_many_waiters_never_exceed_concurrency(backend: Backend) -> None:
    """40 tasks wait for 3 slots; at no moment more than 3 hold one; each is admitted."""
    limiter = backend.limiter([Concurrency(3, lease_ttl=3600)])
    holding = 0
    peak = 0

    async def worker(n: int) -> None:
        nonlocal holding, peak
        async with limiter.limit("job:1", timeout=20):
            holding += 1
            peak = max(peak, holding)
            await asyncio.sleep(0.002 * (n % 5))
            holding -= 1

    started = time.monotonic()
    with anyio.fail_after(30):
        await asyncio.gather(*(worker(n) for n in range(40)))
    assert peak <= 3
    # A release in this process wakes waiters at once: no poll-interval sleeping.
    assert time.monotonic() - started < 5
    assert (await limiter.peek("job:1", 3)).allowed


async def test_concurrency_waiter_times_out_on_time(backend: Backend) -> None:
    limiter = backend.limiter([Concurrency(1, lease_ttl=3600)])
    held = await limiter.try_acquire("job:1")
    assert held.lease is not None
    for timeout in (0.0, 0.05, 0.3, 0.7):
        started = time.monotonic()
        with pytest.raises(RateLimited):
            await limiter.acquire("job:1", timeout=timeout)
        took = time.monotonic() - started
        assert timeout <= took + 0.001 and took < timeout + 0.1, (timeout, took)
    await held.lease.release()


async def test_weight_never_fits_does_not_wait(backend: Backend) -> None:
    limiter = backend.limiter([Concurrency(2, lease_ttl=3600)])
    with anyio.fail_after(2):
        with pytest.raises(WeightNeverFits):
            await limiter.acquire("job:1", 3)
        with pytest.raises(WeightNeverFits):
            async with limiter.limit("job:1", 3):
                pass
