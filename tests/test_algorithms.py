"""Boundary cases of every algorithm, pinned to the microsecond, on real Redis and memory://.

Time comes from a ManualClock that starts on a 10-second boundary, so windows are easy to
place; each test states the arithmetic it expects.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from aiolimit import (
    Concurrency,
    Decision,
    FixedWindow,
    Limit,
    Limiter,
    MinInterval,
    SlidingLog,
    TokenBucket,
    WeightNeverFits,
)
from aiolimit.testing import ManualClock

START = 1_700_000_000.0  # a multiple of 10 s (and of 1 s, 2 s, 5 s, 60 s...)


def us(seconds: float) -> int:
    return round(seconds * 1_000_000)


def verdict(decision: Decision) -> tuple[bool, int, int, int]:
    """(allowed, remaining, retry_after µs, reset_after µs)."""
    return (
        decision.allowed,
        decision.remaining,
        us(decision.retry_after),
        us(decision.reset_after),
    )


def pairs(decision: Decision) -> list[tuple[str, bool, int, int, int]]:
    return [
        (p.identifier, p.allowed, p.remaining, us(p.retry_after), us(p.reset_after))
        for p in decision.details
    ]


async def release_all(decisions: Sequence[Decision]) -> None:
    for decision in decisions:
        if decision.lease is not None:
            await decision.lease.release()


# Capacity 5 of every algorithm (MinInterval: always 1).
FIVE: dict[str, Any] = {
    "fixed-window": FixedWindow(5, per=10),
    "sliding-window": Limit(5, per=10, precision=1),
    "sliding-log": SlidingLog(5, per=10),
    "token-bucket": TokenBucket(1, per=2, burst=5),
    "concurrency": Concurrency(5, lease_ttl=60),
}


# --- window edges -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "limit", [FixedWindow(5, per=10), Limit(5, per=10)], ids=["FixedWindow", "Limit"]
)
async def test_fixed_window_admits_a_burst_at_each_side_of_an_edge(
    store_url: str, prefix: str, limit: Any
) -> None:
    """A fixed window (or a Limit without precision) passes 5 just before its edge and 5 after."""
    clock = ManualClock(start=START + 9.999)
    async with Limiter(store_url, [limit], prefix=prefix, clock=clock) as limiter:
        before = [verdict(await limiter.try_acquire("ip:1")) for _ in range(5)]
        assert before == [(True, left, 0, 1_000) for left in (4, 3, 2, 1, 0)]
        assert verdict(await limiter.try_acquire("ip:1")) == (False, 0, 1_000, 1_000)
        clock.advance(0.001)  # the next window: a second burst 1 ms after the first
        after = [verdict(await limiter.try_acquire("ip:1")) for _ in range(5)]
        assert after == [(True, left, 0, 10_000_000) for left in (4, 3, 2, 1, 0)]
        assert not (await limiter.try_acquire("ip:1")).allowed


async def test_sliding_window_with_precision_stops_the_double_burst(
    store_url: str, prefix: str
) -> None:
    """Limit(5/10 s, precision 1 s): a burst at 9.5 s refuses everything until 19 s."""
    clock = ManualClock(start=START + 9.5)
    limits = [Limit(5, per=10, precision=1)]
    async with Limiter(store_url, limits, prefix=prefix, clock=clock) as limiter:
        for _ in range(5):
            assert (await limiter.try_acquire("ip:1")).allowed
        clock.advance(0.5)  # 10 s: where a fixed window would start afresh
        # bucket 9 (5 units) leaves the 10-bucket window at 19 s: 9 s from now
        assert verdict(await limiter.try_acquire("ip:1")) == (False, 0, 9_000_000, 9_000_000)
        clock.advance(8.999_999)
        assert verdict(await limiter.try_acquire("ip:1")) == (False, 0, 1, 1)
        clock.advance(0.000_001)
        assert verdict(await limiter.try_acquire("ip:1", 5)) == (True, 0, 0, 10_000_000)


async def test_sliding_window_frees_its_oldest_buckets_first(store_url: str, prefix: str) -> None:
    """retry_after is when enough of the oldest buckets have left, not when all have."""
    clock = ManualClock(start=START)
    limits = [Limit(4, per=10, precision=2)]  # 5 buckets of 2 s
    async with Limiter(store_url, limits, prefix=prefix, clock=clock) as limiter:
        assert (await limiter.try_acquire("ip:1", 1)).allowed  # bucket 0
        clock.advance(3)
        assert (await limiter.try_acquire("ip:1", 2)).allowed  # bucket 1
        clock.advance(3)
        assert (await limiter.try_acquire("ip:1", 1)).allowed  # bucket 3, at 6 s
        # weight 2 needs 2 free: bucket 0 leaves at 10 s (1 freed), bucket 1 at 12 s (3 freed)
        assert verdict(await limiter.try_acquire("ip:1", 2)) == (False, 0, 6_000_000, 10_000_000)
        # weight 1 needs 1 free: bucket 0 is enough
        assert verdict(await limiter.peek("ip:1", 1)) == (False, 0, 4_000_000, 10_000_000)


async def test_sliding_window_with_non_dividing_precision_errs_on_refusing(
    store_url: str, prefix: str
) -> None:
    """Limit(3/10 s, precision 3 s) counts 4 buckets: a unit charged as one opens counts 12 s."""
    clock = ManualClock(start=START + 1)  # START = 3k + 2 s: START + 1 s opens a bucket
    limits = [Limit(3, per=10, precision=3)]
    async with Limiter(store_url, limits, prefix=prefix, clock=clock) as limiter:
        assert verdict(await limiter.try_acquire("ip:1", 3)) == (True, 0, 0, 12_000_000)
        clock.advance(11.999_999)
        assert verdict(await limiter.try_acquire("ip:1")) == (False, 0, 1, 1)
        clock.advance(0.000_001)
        assert verdict(await limiter.try_acquire("ip:1", 3)) == (True, 0, 0, 12_000_000)


async def test_sliding_log_is_exact_at_the_window_edge(store_url: str, prefix: str) -> None:
    """SlidingLog(5/10 s): units logged at 9.5 s count until exactly 19.5 s, not a µs longer."""
    clock = ManualClock(start=START + 9.5)
    async with Limiter(store_url, [SlidingLog(5, per=10)], prefix=prefix, clock=clock) as limiter:
        for left in (4, 3, 2, 1, 0):
            assert verdict(await limiter.try_acquire("ip:1")) == (True, left, 0, 10_000_000)
        clock.advance(0.5)
        assert verdict(await limiter.try_acquire("ip:1")) == (False, 0, 9_500_000, 9_500_000)
        clock.advance(9.499_999)
        assert verdict(await limiter.try_acquire("ip:1", 2)) == (False, 0, 1, 1)
        clock.advance(0.000_001)
        assert verdict(await limiter.try_acquire("ip:1", 5)) == (True, 0, 0, 10_000_000)


# --- weights ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FIVE))
async def test_weight_equal_to_the_limit_is_admitted_once(
    store_url: str, prefix: str, name: str
) -> None:
    """A weight equal to the capacity fits a fresh identifier once; one more never fits."""
    clock = ManualClock(start=START)
    async with Limiter(store_url, [FIVE[name]], prefix=prefix, clock=clock) as limiter:
        full = await limiter.try_acquire("ip:1", 5)
        assert (full.allowed, full.remaining) == (True, 0)
        assert not (await limiter.try_acquire("ip:1", 1)).allowed
        with pytest.raises(WeightNeverFits):
            await limiter.try_acquire("ip:1", 6)
        with pytest.raises(WeightNeverFits):
            await limiter.acquire("ip:2", 6)  # fails at once: it never waits
        await release_all([full])


# --- token bucket and minimum interval --------------------------------------------------------


async def test_token_bucket_refills_to_its_burst_and_not_beyond(
    store_url: str, prefix: str
) -> None:
    """TokenBucket(3/s, burst 4): one idle second refills 3; an idle hour refills only to 4."""
    clock = ManualClock(start=START)
    limits = [TokenBucket(3, per=1, burst=4)]
    async with Limiter(store_url, limits, prefix=prefix, clock=clock) as limiter:
        assert verdict(await limiter.try_acquire("ip:1", 4)) == (True, 0, 0, 1_333_334)
        clock.advance(1)
        assert verdict(await limiter.try_acquire("ip:1", 3)) == (True, 0, 0, 1_333_334)
        assert verdict(await limiter.try_acquire("ip:1")) == (False, 0, 333_334, 1_333_334)
        clock.advance(3600)
        assert verdict(await limiter.peek("ip:1")) == (True, 4, 0, 0)  # full now
        assert verdict(await limiter.peek("ip:1", 4)) == (True, 4, 0, 0)
        assert verdict(await limiter.try_acquire("ip:1", 4)) == (True, 0, 0, 1_333_334)
        assert verdict(await limiter.try_acquire("ip:1")) == (False, 0, 333_334, 1_333_334)


async def test_token_bucket_retry_after_is_exact_to_the_microsecond(
    store_url: str, prefix: str
) -> None:
    """3/s (T = 333333.33 µs): a refusal waits ceil(T) µs; 1 µs earlier it is still refused."""
    clock = ManualClock(start=START)
    limits = [TokenBucket(3, per=1, burst=1)]
    async with Limiter(store_url, limits, prefix=prefix, clock=clock) as limiter:
        assert verdict(await limiter.try_acquire("ip:1")) == (True, 0, 0, 333_334)
        assert verdict(await limiter.try_acquire("ip:1")) == (False, 0, 333_334, 333_334)
        clock.advance(0.333_333)
        assert verdict(await limiter.try_acquire("ip:1")) == (False, 0, 1, 1)
        clock.advance(0.000_001)
        assert verdict(await limiter.try_acquire("ip:1")) == (True, 0, 0, 333_334)


async def test_token_bucket_does_not_drift_over_10000_units(store_url: str, prefix: str) -> None:
    """3/s, burst 2, a unit every 333333 µs: after 10000 units TAT is exactly 10000/3 s on."""
    clock = ManualClock(start=START)
    limits = [TokenBucket(3, per=1, burst=2)]
    async with Limiter(store_url, limits, prefix=prefix, clock=clock) as limiter:
        # Charging a unit at k * 333333 µs never lets the bucket idle (now <= TAT), so every
        # unit adds exactly T = 1e6 / 3 µs and TAT after n units is n * T from the start.
        for _ in range(10_000):
            assert (await limiter.try_acquire("ip:1")).allowed
            clock.advance(0.333_333)
        # Now is 10000 * 333333 µs from the start and TAT = 10000 T = 3333333333.33 µs, 3333.33
        # µs ahead. One unit fits now (burst 2; it would leave TAT 336666.67 µs ahead); two need
        # ceil(3333.33) µs more. Rounding T per unit either way would be off by 3333 µs.
        assert verdict(await limiter.peek("ip:1")) == (True, 1, 0, 3_334)  # one unit left now
        assert verdict(await limiter.peek("ip:1", 2)) == (False, 1, 3_334, 3_334)


async def test_min_interval_keeps_requests_apart(store_url: str, prefix: str) -> None:
    """MinInterval(0.25): a second request waits 0.25 s from the first, to the microsecond."""
    clock = ManualClock(start=START)
    async with Limiter(store_url, [MinInterval(0.25)], prefix=prefix, clock=clock) as limiter:
        assert verdict(await limiter.try_acquire("ip:1")) == (True, 0, 0, 250_000)
        assert verdict(await limiter.try_acquire("ip:1")) == (False, 0, 250_000, 250_000)
        clock.advance(0.249_999)
        assert verdict(await limiter.try_acquire("ip:1")) == (False, 0, 1, 1)
        clock.advance(0.000_001)
        assert verdict(await limiter.try_acquire("ip:1")) == (True, 0, 0, 250_000)
        clock.advance(10)  # idle: still only one at a time
        assert (await limiter.try_acquire("ip:1")).allowed
        assert not (await limiter.try_acquire("ip:1")).allowed
        with pytest.raises(WeightNeverFits):
            await limiter.try_acquire("ip:1", 2)


# --- time standing still ----------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FIVE))
async def test_clock_standing_still_refuses_identically(
    store_url: str, prefix: str, name: str
) -> None:
    """With time standing still nothing refills: repeated refusals and peeks are identical."""
    clock = ManualClock(start=START + 0.5)
    async with Limiter(store_url, [FIVE[name]], prefix=prefix, clock=clock) as limiter:
        held = [await limiter.try_acquire("ip:1", 2), await limiter.try_acquire("ip:1", 3)]
        assert all(d.allowed for d in held)
        first = await limiter.try_acquire("ip:1")
        assert not first.allowed
        assert first.retry_after > 0
        peeked = await limiter.peek("ip:1")
        for _ in range(5):
            assert verdict(await limiter.try_acquire("ip:1")) == verdict(first)
        assert verdict(await limiter.peek("ip:1")) == verdict(peeked) == verdict(first)
        await release_all(held)


# --- several algorithms in one call -----------------------------------------------------------

# The refusing limit: capacity 2 (MinInterval 1), beside roomy limits of every algorithm.
REFUSERS: dict[str, Any] = {
    "sliding-window": Limit(2, per=30, precision=5),
    "fixed-window": FixedWindow(2, per=30),
    "sliding-log": SlidingLog(2, per=30),
    "token-bucket": TokenBucket(1, per=30, burst=2),
    "min-interval": MinInterval(30),
    "concurrency": Concurrency(2, lease_ttl=60),
}
ROOMY = [
    Limit(10, per=60, precision=10),
    FixedWindow(10, per=60),
    SlidingLog(10, per=60),
    TokenBucket(1, per=60, burst=10),
    Concurrency(10, lease_ttl=60),
]


@pytest.mark.parametrize("name", sorted(REFUSERS))
async def test_mixed_algorithms_refused_by_one_charge_none(
    store_url: str, prefix: str, name: str
) -> None:
    """Every algorithm in one call: when one refuses, no other pair of any identifier is charged."""
    refuser = REFUSERS[name]
    roomy = [limit for limit in ROOMY if limit.storage != refuser.storage]
    clock = ManualClock(start=START)
    async with Limiter(store_url, [refuser, *roomy], prefix=prefix, clock=clock) as limiter:
        held = []
        while (decision := await limiter.try_acquire("u:1")).allowed:
            held.append(decision)
        assert len(held) == refuser.amount
        before = await limiter.peek(["u:1", "u:2"])
        refused = await limiter.try_acquire(["u:2", "u:1"])
        assert not refused.allowed
        assert [(p.identifier, p.limit) for p in refused.details if not p.allowed] == [
            ("u:1", refuser)
        ]
        after = await limiter.peek(["u:1", "u:2"])
        assert pairs(after) == pairs(before)
        # u:2 was untouched: each of its limits still has all its room
        fresh = [p for p in after.details if p.identifier == "u:2"]
        assert [p.remaining for p in fresh] == [limit.amount for limit in [refuser, *roomy]]
        await release_all(held)


# --- concurrency invariant --------------------------------------------------------------------

CAPACITY_25: dict[str, Any] = {
    "sliding-window": [Limit(25, per=60, precision=1)],
    "fixed-window": [FixedWindow(25, per=60)],
    "sliding-log": [SlidingLog(25, per=60)],
    "token-bucket": [TokenBucket(1, per=60, burst=25)],
    "concurrency": [Concurrency(25, lease_ttl=60)],
    "all-at-once": [
        Limit(25, per=60, precision=1),
        FixedWindow(30, per=60),
        SlidingLog(40, per=60),
        TokenBucket(1, per=60, burst=50),
        Concurrency(60, lease_ttl=60),
    ],
}


@pytest.mark.parametrize("name", sorted(CAPACITY_25))
async def test_100_concurrent_acquirers_get_exactly_the_capacity(
    store_url: str, prefix: str, name: str
) -> None:
    """100 concurrent try_acquire against a capacity of 25 admit exactly 25, then none."""
    clock = ManualClock(start=START)
    limits = CAPACITY_25[name]
    async with Limiter(store_url, limits, prefix=prefix, clock=clock) as limiter:
        await limiter.peek("ip:1")  # connect and load the script before the race
        decisions = await asyncio.gather(*(limiter.try_acquire("ip:1") for _ in range(100)))
        admitted = [d for d in decisions if d.allowed]
        assert len(admitted) == 25
        assert sorted(d.remaining for d in admitted) == list(range(25))
        assert not (await limiter.peek("ip:1")).allowed
        await release_all(admitted)


async def test_concurrent_acquirers_of_a_min_interval_get_one(store_url: str, prefix: str) -> None:
    """100 concurrent try_acquire under MinInterval admit exactly one."""
    clock = ManualClock(start=START)
    async with Limiter(store_url, [MinInterval(1)], prefix=prefix, clock=clock) as limiter:
        decisions = await asyncio.gather(*(limiter.try_acquire("ip:1") for _ in range(100)))
        assert sum(d.allowed for d in decisions) == 1
