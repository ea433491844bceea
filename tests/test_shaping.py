"""Shaping: ``acquire(..., timeout=...)`` on a token bucket reserves each waiter's turn.

Waiters of a GCRA bucket are charged at once and told how long to wait, so they are admitted
in arrival order with one store call each. A window limit cannot reserve: its waiters sleep
the retry_after and all retry together (a herd), which the decision counts below measure.
"""

from __future__ import annotations

import asyncio
from itertools import pairwise
from typing import Any

import anyio
import pytest
from redis.crc import key_slot

from aiolimit import Decision, Limit, Limiter, MinInterval, RateLimited, TokenBucket
from aiolimit._keys import main_key
from aiolimit.testing import ManualClock

START = 1_700_000_000.0
US = 1_000_000


def elapsed_us(clock: ManualClock) -> int:
    return round(clock.time() * US) - round(START * US)


def turn_us(decision: Decision) -> int:
    """The delay a reservation was given (its pairs' retry_after while allowed)."""
    return max(round(pair.retry_after * US) for pair in decision.details)


async def settle() -> None:
    """Lets every ready task run a few steps."""
    for _ in range(20):
        await asyncio.sleep(0)


async def decided(limiter: Limiter, count: int) -> None:
    """Waits (at most 5 s of real time) until the limiter has made ``count`` decisions."""
    with anyio.fail_after(5):
        while limiter.statistics().decisions < count:  # noqa: ASYNC110 - a plain counter
            await asyncio.sleep(0.001)


async def crowd(limiter: Limiter, clock: ManualClock, n: int, **options: Any) -> list[Any]:
    """``n`` concurrent acquire calls; each result is a Decision or the RateLimited raised."""
    await asyncio.gather(*(limiter.peek("ip:1") for _ in range(n)))  # open the connections
    return await asyncio.gather(
        *(limiter.acquire("ip:1", **options) for _ in range(n)), return_exceptions=True
    )


async def test_token_bucket_waiters_take_turns_in_arrival_order(
    store_url: str, prefix: str
) -> None:
    """10 acquirers of 5/s (burst 1): one call each, then each wakes exactly at its 0.2 s turn."""
    clock = ManualClock(start=START)
    limits = [TokenBucket(5, per=1, burst=1)]
    async with Limiter(store_url, limits, prefix=prefix, clock=clock) as limiter:
        await asyncio.gather(*(limiter.peek("ip:1") for _ in range(10)))  # open the connections
        returned: list[tuple[int, Decision]] = []

        async def waiter(arrival: int) -> None:
            returned.append((arrival, await limiter.acquire("ip:1", timeout=60)))

        tasks = [asyncio.create_task(waiter(arrival)) for arrival in range(10)]
        await decided(limiter, 10)
        await settle()
        assert len(returned) == 1  # the first had the token; the others hold reservations
        for turn in range(1, 10):
            clock.advance(0.199_999)
            await settle()
            assert len(returned) == turn, "nobody wakes before its turn"
            clock.advance(0.000_001)
            await settle()
            assert len(returned) == turn + 1, "the next waiter wakes exactly at its turn"
        await asyncio.gather(*tasks)
        assert [turn_us(decision) for _, decision in returned] == [
            turn * 200_000 for turn in range(10)
        ]
        if store_url == "memory://":  # on Redis, arrival is the order the server saw them
            assert [arrival for arrival, _ in returned] == list(range(10))
        stats = limiter.statistics()
        assert (stats.decisions, stats.allowed, stats.refused, stats.waits) == (10, 10, 0, 9)


async def test_token_bucket_crowd_costs_one_call_per_acquirer(store_url: str, prefix: str) -> None:
    """With autojump, 10 acquirers of 5/s (burst 1) all pass by 1.8 s with 10 decisions in all."""
    clock = ManualClock(start=START, autojump=True)
    limits = [TokenBucket(5, per=1, burst=1)]
    async with Limiter(store_url, limits, prefix=prefix, clock=clock) as limiter:
        results = await crowd(limiter, clock, 10, timeout=60)
        assert all(isinstance(r, Decision) and r.allowed for r in results)
        assert sorted(turn_us(r) for r in results) == [turn * 200_000 for turn in range(10)]
        stats = limiter.statistics()
        assert stats.decisions == 10  # no retries: no herd
        # At most 9 sleep; fewer when other waiters' autojumping sleeps moved the clock past
        # a waiter's turn while its call was in flight (its turn is still exact, above).
        assert stats.waits <= 9
        assert elapsed_us(clock) >= 1_800_000


async def test_token_bucket_crowd_ends_after_exactly_nine_turns(prefix: str) -> None:
    """With autojump, 10 acquirers of 5/s (burst 1) move the clock by exactly 9 x 0.2 s."""
    clock = ManualClock(start=START, autojump=True)
    limits = [TokenBucket(5, per=1, burst=1)]
    async with Limiter("memory://", limits, prefix=prefix, clock=clock) as limiter:
        await crowd(limiter, clock, 10, timeout=60)
        assert elapsed_us(clock) == 1_800_000


@pytest.mark.parametrize(
    ("limit", "decisions", "waits"),
    [
        # One per 0.2 s window: every round all waiters retry and one wins: 10 + 9 + ... + 1.
        (Limit(1, per=0.2), 55, 45),
        # Five per second: five pass, the other five sleep to the next window and retry once.
        (Limit(5, per=1), 15, 5),
    ],
    ids=["1-per-0.2s", "5-per-second"],
)
async def test_window_crowd_retries_as_a_herd(
    store_url: str, prefix: str, limit: Limit, decisions: int, waits: int
) -> None:
    """A window limit cannot reserve: its 10 waiters all pass, at the cost of repeated calls
    (about the herd's count: on Redis a call that finds nothing in flight leaves at once, so
    one waiter may win a round before the others have asked, saving a retry or two)."""
    clock = ManualClock(start=START, autojump=True)
    async with Limiter(store_url, [limit], prefix=prefix, clock=clock) as limiter:
        results = await crowd(limiter, clock, 10, timeout=60)
        assert all(isinstance(r, Decision) and r.allowed for r in results)
        stats = limiter.statistics()
        assert stats.allowed == 10
        assert stats.waits == stats.decisions - 10
        assert decisions - 2 <= stats.decisions <= decisions, (stats.decisions, waits)


async def test_timeout_reserves_only_turns_within_it(store_url: str, prefix: str) -> None:
    """With a 1 s timeout, 6 of 10 get turns 0..1.0 s; 4 fail at once, charging nothing."""
    clock = ManualClock(start=START, autojump=True)
    limits = [TokenBucket(5, per=1, burst=1)]
    async with Limiter(store_url, limits, prefix=prefix, clock=clock) as limiter:
        results = await crowd(limiter, clock, 10, timeout=1.0)
        admitted = [r for r in results if isinstance(r, Decision)]
        refused = [r for r in results if isinstance(r, RateLimited)]
        assert sorted(turn_us(d) for d in admitted) == [turn * 200_000 for turn in range(6)]
        # Refusals charged nothing: each saw the 6 reservations only (the next turn at 1.2 s).
        assert [round(e.decision.retry_after * US) for e in refused] == [1_200_000] * 4
        assert limiter.statistics().decisions == 10


async def test_timeout_zero_never_waits_nor_reserves(store_url: str, prefix: str) -> None:
    """acquire(timeout=0) on an empty bucket raises at once and leaves no reservation behind."""
    clock = ManualClock(start=START, autojump=True)
    limits = [TokenBucket(1, per=1, burst=1)]
    async with Limiter(store_url, limits, prefix=prefix, clock=clock) as limiter:
        assert (await limiter.acquire("ip:1", timeout=0)).allowed
        with pytest.raises(RateLimited) as caught:
            await limiter.acquire("ip:1", timeout=0)
        assert caught.value.decision.retry_after == 1.0
        assert elapsed_us(clock) == 0
        assert (await limiter.peek("ip:1")).retry_after == 1.0


async def test_a_cancelled_waiters_turn_goes_to_the_next_arrival(
    store_url: str, prefix: str
) -> None:
    """A cancelled waiter hands its reserved turn back: the next arrival takes it.

    Before, the turn stayed a gap (giving a turn back in the middle of the queue would have
    let two later waiters through at once with one TAT); the script now keeps the gaps, so
    the undo frees that turn alone. The test after this one checks the middle of the queue.
    """
    clock = ManualClock(start=START)
    async with Limiter(store_url, [MinInterval(0.2)], prefix=prefix, clock=clock) as limiter:
        assert (await limiter.acquire("ip:1", timeout=10)).allowed
        cancelled = asyncio.create_task(limiter.acquire("ip:1", timeout=10))
        await decided(limiter, 2)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        await asyncio.sleep(0.2)  # the undo runs in the background (a round trip)
        late = asyncio.create_task(limiter.acquire("ip:1", timeout=10))
        await decided(limiter, 3)
        clock.advance(0.4)
        assert turn_us(await late) == 200_000


async def test_a_cancelled_waiter_never_lets_two_through_at_once(
    store_url: str, prefix: str
) -> None:
    """Cancelling a waiter in the middle of the queue never admits two within the interval."""
    clock = ManualClock(start=START)
    async with Limiter(store_url, [MinInterval(0.2)], prefix=prefix, clock=clock) as limiter:
        admitted: dict[str, int] = {}

        async def waiter(name: str) -> None:
            await limiter.acquire("ip:1", timeout=10)
            admitted[name] = elapsed_us(clock)

        tasks = {}
        for number, name in enumerate("ABC", start=1):
            tasks[name] = asyncio.create_task(waiter(name))
            await decided(limiter, number)
        tasks.pop("B").cancel()
        await settle()
        tasks["D"] = asyncio.create_task(waiter("D"))
        await decided(limiter, 4)
        for _ in range(10):
            clock.advance(0.1)
            await settle()
        await asyncio.gather(*tasks.values())
        times = sorted(admitted.values())
        assert all(later - earlier >= 200_000 for earlier, later in pairwise(times)), admitted


async def _admissions(
    limiter: Limiter, clock: ManualClock, ids: Any, n: int, seconds: float
) -> tuple[list[Decision], list[int]]:
    """``n`` concurrent ``acquire(ids, timeout=60)`` while the manual clock steps 50 ms at a
    time for ``seconds``: the decisions, and when (µs after START) their waiters got them
    back, in order."""
    await asyncio.gather(*(limiter.peek(ids) for _ in range(n)))  # open the connections
    returned: list[tuple[int, Decision]] = []

    async def waiter() -> None:
        decision = await limiter.acquire(ids, timeout=60)
        returned.append((elapsed_us(clock), decision))

    tasks = [asyncio.create_task(waiter()) for _ in range(n)]
    await decided(limiter, n)
    for _ in range(round(seconds / 0.05)):
        await asyncio.sleep(0.01)  # (real time: a retry's round trip)
        await settle()
        clock.advance(0.05)
    await asyncio.sleep(0.01)
    await settle()
    await asyncio.gather(*tasks)
    return [decision for _, decision in sorted(returned, key=lambda item: item[0])], sorted(
        at for at, _ in returned
    )


@pytest.mark.parametrize(
    ("limits", "ids"),
    [
        ([TokenBucket(5, per=1, burst=1), TokenBucket(2, per=1, burst=1)], "ip:1"),
        ({"ip": [TokenBucket(5, per=1, burst=1)], "user": [TokenBucket(2, per=1, burst=1)]},
         ["ip:1", "user:1"]),
    ],
    ids=["one identifier, two buckets", "two identifiers, a bucket each"],
)  # fmt: skip
async def test_a_waiter_under_several_buckets_waits_for_the_slowest_turn(
    store_url: str, prefix: str, limits: Any, ids: Any
) -> None:
    """6 acquirers under 5/s and 2/s (burst 1 each). A call under several buckets reserves no
    turn (each bucket would reserve its own, and the caller pass at the latest: its unit on
    the faster bucket charged at a turn it does not use, an over-admission there); it waits
    and asks again. They all pass, at the slower bucket's pace: never two within 0.5 s."""
    clock = ManualClock(start=START)
    async with Limiter(store_url, limits, prefix=prefix, clock=clock) as limiter:
        decisions, times = await _admissions(limiter, clock, ids, 6, 3.0)
    assert len(decisions) == 6 and all(d.allowed for d in decisions)
    assert all(later - earlier >= 500_000 for earlier, later in pairwise(times)), times


async def test_a_waiter_under_a_bucket_and_a_window_never_passes_either(
    store_url: str, prefix: str
) -> None:
    """A bucket (5/s, burst 1) that reserves turns and a window (3 per 2 s) that cannot: 8
    acquirers all pass, never more than 3 in any 2 s and never two within 0.2 s."""
    clock = ManualClock(start=START)
    limits = [TokenBucket(5, per=1, burst=1), Limit(3, per=2, precision=0.1)]
    async with Limiter(store_url, limits, prefix=prefix, clock=clock) as limiter:
        decisions, times = await _admissions(limiter, clock, "ip:1", 8, 6.0)
    assert all(d.allowed for d in decisions) and len(times) == 8, times
    assert all(later - earlier >= 200_000 for earlier, later in pairwise(times)), times
    for i, start in enumerate(times):
        assert sum(1 for t in times[i:] if t < start + 2_000_000) <= 3, times


@pytest.mark.cluster
async def test_on_the_cluster_two_slots_buckets_wait_for_the_slowest_turn(
    redis_cluster_url: str, prefix: str
) -> None:
    """The same across two slots of a Redis Cluster (check, then commit, on each): every
    waiter passes, at the slower bucket's pace."""
    limits = {"ip": [TokenBucket(5, per=1, burst=1)], "user": [TokenBucket(2, per=1, burst=1)]}
    clock = ManualClock(start=START)
    async with Limiter(redis_cluster_url, limits, prefix=prefix, clock=clock) as limiter:
        assert key_slot(main_key(prefix, "ip:1").encode()) != key_slot(
            main_key(prefix, "user:1").encode()
        )
        decisions, times = await _admissions(limiter, clock, ["ip:1", "user:1"], 6, 3.0)
    assert len(decisions) == 6 and all(d.allowed for d in decisions)
    assert all(later - earlier >= 500_000 for earlier, later in pairwise(times)), times
