"""Token-bucket reservations (held turns) given back on cancel or timeout, exactly once."""

from __future__ import annotations

import asyncio

import anyio
import pytest

from aiolimit import Decision, Limiter, RateLimited, TokenBucket
from aiolimit.testing import ManualClock
from tests._workers import Backend

START = 1_700_000_000.0
US = 1_000_000


async def settle(limiter: Limiter | None = None) -> None:
    for _ in range(50):
        await asyncio.sleep(0.001)
    if limiter is not None:
        with anyio.fail_after(5):
            while limiter._protocol._tasks:  # background undos landed
                await asyncio.wait(set(limiter._protocol._tasks))


def turn(decision: Decision) -> float:
    return max(p.retry_after for p in decision.details)


async def test_cancelled_turn_goes_to_next_waiter_once(backend: Backend) -> None:
    clock = ManualClock(start=START)
    limiter = backend.limiter([TokenBucket(1, per=1, burst=1)], clock=clock)
    admitted: dict[str, float] = {}

    async def waiter(name: str) -> None:
        await limiter.acquire("ip:1", timeout=30)
        admitted[name] = clock.time() - START

    assert (await limiter.try_acquire("ip:1")).allowed  # A, at 0
    b = asyncio.create_task(waiter("B"))
    await settle()
    c = asyncio.create_task(waiter("C"))
    await settle()
    b.cancel()
    with pytest.raises(asyncio.CancelledError):
        await b
    await settle(limiter)
    d = asyncio.create_task(waiter("D"))
    await settle()
    e = asyncio.create_task(waiter("E"))
    await settle()
    for _ in range(5):
        clock.advance(1)
        await settle()
    with anyio.fail_after(5):
        await asyncio.gather(c, d, e)
    assert admitted == {"D": 1.0, "C": 2.0, "E": 3.0}, admitted
    # Nothing extra is free: the next admission is at 4 (now: 5 -> immediate), and only one.
    assert (await limiter.try_acquire("ip:1")).allowed
    assert not (await limiter.try_acquire("ip:1")).allowed


async def test_timed_out_waiter_charges_nothing(backend: Backend) -> None:
    clock = ManualClock(start=START)
    limiter = backend.limiter([TokenBucket(1, per=1, burst=1)], clock=clock)
    assert (await limiter.try_acquire("ip:1")).allowed
    before = await limiter.peek("ip:1")
    for timeout in (0, 1e-9, 0.5, 0.999_999):
        with anyio.fail_after(2):
            with pytest.raises(RateLimited):
                await limiter.acquire("ip:1", timeout=timeout)
    after = await limiter.peek("ip:1")
    assert after.retry_after == before.retry_after
    assert clock.time() == START  # nothing slept


async def test_turn_exactly_at_timeout_is_reserved(backend: Backend) -> None:
    clock = ManualClock(start=START, autojump=True)
    limiter = backend.limiter([TokenBucket(1, per=1, burst=1)], clock=clock)
    assert (await limiter.try_acquire("ip:1")).allowed
    with anyio.fail_after(2):
        decision = await limiter.acquire("ip:1", timeout=1.0)
    assert decision.allowed and clock.time() - START == 1.0


async def test_refund_during_held_turn_never_double_admits(backend: Backend) -> None:
    """A holds [0,1), B holds a turn [1,2). A refund of more than was charged while B waits,
    then B is cancelled: at most one admission per second from then on."""
    clock = ManualClock(start=START)
    limiter = backend.limiter([TokenBucket(1, per=1, burst=1)], clock=clock)
    assert (await limiter.try_acquire("ip:1")).allowed
    b = asyncio.create_task(limiter.acquire("ip:1", timeout=30))
    await settle()
    await limiter.refund("ip:1", 5)
    got_now = (await limiter.try_acquire("ip:1")).allowed
    clock.advance(1)
    await settle()
    assert b.done() and b.result().allowed
    at_one = (await limiter.try_acquire("ip:1")).allowed
    # admissions in [0, 1]: A (refunded), maybe the one at 0, B at 1, maybe one at 1.
    assert got_now + at_one <= 1, (got_now, at_one)


async def test_reset_while_turn_held_then_cancel(backend: Backend) -> None:
    clock = ManualClock(start=START)
    limiter = backend.limiter([TokenBucket(1, per=1, burst=1)], clock=clock)
    assert (await limiter.try_acquire("ip:1")).allowed
    b = asyncio.create_task(limiter.acquire("ip:1", timeout=30))
    await settle()
    await limiter.reset("ip:1")
    b.cancel()
    with pytest.raises(asyncio.CancelledError):
        await b
    await settle(limiter)
    assert (await limiter.try_acquire("ip:1")).allowed
    assert not (await limiter.try_acquire("ip:1")).allowed


async def test_many_waiters_one_bucket_never_over_admitted(backend: Backend) -> None:
    """30 waiters on 2/s burst 2, a third of them cancelled at random times: admissions in
    any 1 s window <= rate + burst, and each admission at or after its turn."""
    clock = ManualClock(start=START)
    limiter = backend.limiter([TokenBucket(2, per=1, burst=2)], clock=clock)
    times: list[float] = []

    async def waiter() -> None:
        await limiter.acquire("ip:1", timeout=60)
        times.append(clock.time() - START)

    tasks = []
    for _ in range(30):
        tasks.append(asyncio.create_task(waiter()))
        await settle()
    for n, task in enumerate(tasks):
        if n % 3 == 1 and n > 2:  # (0 and 1 were admitted at once)
            task.cancel()
    await settle(limiter)
    for _ in range(80):
        clock.advance(0.25)
        await settle()
    with anyio.fail_after(5):
        await asyncio.gather(*tasks, return_exceptions=True)
    times.sort()
    assert len(times) == 30 - 9, times
    for t in times:
        inside = [u for u in times if t <= u < t + 1]
        assert len(inside) <= 2 + 2, (t, inside)
    # (Later waiters keep their turns: the cancelled ones leave holes, 14 s at the end.)
    assert times[-1] <= 14.0, times
