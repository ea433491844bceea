"""Prefetched allowances (``Limiter(..., prefetch=N)``, ``aiolimit/_prefetch.py``) on real
servers: busy identifiers are admitted in the process, the store ends up counting exactly what
was admitted (units left are given back), nothing is ever admitted past a limit across several
limiters, and an allowance is never used past the bucket its units were charged in.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from aiolimit import (
    Concurrency,
    ConfigurationError,
    FixedWindow,
    Limit,
    Limiter,
    SlidingLog,
    TokenBucket,
)
from aiolimit.testing import ManualClock
from tests._nodes import settle, stored
from tests._proxy import Proxy

pytestmark = pytest.mark.asyncio


async def test_a_busy_identifier_is_admitted_here_and_stored_exactly(
    redis_url: str, prefix: str
) -> None:
    limits = [Limit(1000, per=10, precision=1)]
    async with Limiter(redis_url, limits, prefix=prefix, prefetch=64) as limiter:
        admitted = 0
        for _ in range(300):
            admitted += (await limiter.try_acquire("ip:1")).allowed
        local = limiter.statistics().prefetched
        assert admitted == 300
        assert local >= 250, local  # (a few calls go to the store: the first, and refills)
        # While it holds units, the store counts them too (never fewer than admitted).
        assert await stored(redis_url, prefix, "ip:1", limits) >= admitted
    # Closed: what was left is given back, the store counts what was admitted.
    assert await stored(redis_url, prefix, "ip:1", limits) == admitted


async def test_a_local_admission_reports_what_is_left_for_this_process(
    redis_url: str, prefix: str
) -> None:
    async with Limiter(redis_url, [Limit(100, per=60)], prefix=prefix, prefetch=8) as limiter:
        seen = [await limiter.try_acquire("ip:r") for _ in range(6)]
        assert all(d.allowed for d in seen)
        assert limiter.statistics().prefetched >= 2
        # Whether admitted here or by the store, remaining counts down by one per call.
        assert [d.remaining for d in seen] == [99, 98, 97, 96, 95, 94]
        for d in seen:
            assert d.retry_after == 0.0
            assert 0 < d.reset_after <= 60
            assert d.details[0].remaining == d.remaining


async def test_several_limiters_never_admit_past_the_limit_and_store_what_they_admit(
    redis_url: str, prefix: str
) -> None:
    """Four limiters (processes) hammer one identifier with prefetch on: the total admitted
    never passes the limit, and once they close the store holds exactly what they admitted."""
    limits = [Limit(200, per=3600, precision=60)]
    limiters = [Limiter(redis_url, limits, prefix=prefix, prefetch=16) for _ in range(4)]
    admitted = 0
    attempts = 0

    async def hammer(limiter: Limiter) -> None:
        nonlocal admitted, attempts
        for _ in range(150):
            attempts += 1
            decision = await limiter.try_acquire("ip:shared")
            admitted += decision.allowed
            if random.random() < 0.2:
                await asyncio.sleep(0)

    try:
        await asyncio.wait_for(
            asyncio.gather(*(hammer(limiter) for limiter in limiters for _ in range(4))), 30
        )
        assert attempts == 2400
        assert admitted <= 200
        assert sum(limiter.statistics().prefetched for limiter in limiters) > 0
    finally:
        for limiter in limiters:
            await limiter.aclose()
    assert await stored(redis_url, prefix, "ip:shared", limits) == admitted
    # Units held were given back: what the others were refused for is free again.
    assert admitted >= 150, admitted


async def test_an_allowance_ends_with_the_bucket_its_units_were_charged_in(
    redis_url: str, prefix: str
) -> None:
    """Buckets of 100 ms (manual time): units taken in one bucket are admitted here until just
    before it ends, never after; the next call goes to the store, and the units left are
    credited to the bucket they were charged in."""
    clock = ManualClock(start=1_700_000_000.0)
    limits = [Limit(100, per=1, precision=0.1)]
    async with (
        Limiter(redis_url, limits, prefix=prefix, prefetch=20, clock=clock) as limiter,
        Limiter(redis_url, limits, prefix=prefix, clock=clock) as reference,
    ):
        clock.advance(0.01)
        for _ in range(3):  # (the second takes units ahead, the third is admitted here)
            assert (await limiter.try_acquire("ip:b")).allowed
        local = limiter.statistics().prefetched
        assert local >= 1
        clock.advance(0.085)  # 0.095 into the bucket: 1.1 ms before its end in the store
        assert (await limiter.try_acquire("ip:b")).allowed
        assert limiter.statistics().prefetched == local + 1
        # (the two units taken ahead are used up, and the next ones were taken ahead in the
        # background: the store counts the four admissions and the units still held here;
        # the timer of an allowance runs in real time, so they may be back already)
        await settle(limiter)
        held = limiter._prefetch._by_ids["ip:b"].left
        assert 100 - (await reference.peek("ip:b")).remaining == 4 + held
        clock.advance(0.0045)  # 0.0995: within the margin: to the store (bucket 0 still)
        assert (await limiter.try_acquire("ip:b")).allowed
        assert limiter.statistics().prefetched == local + 1
        await settle(limiter)
        # The allowance that ended gave its units back to bucket 0 (the call at 0.0995 had
        # too little of its bucket left to keep any): the store counts the five admissions.
        assert 100 - (await reference.peek("ip:b")).remaining == 5
        clock.advance(0.01)  # bucket 1
        assert (await limiter.try_acquire("ip:b")).allowed
        await settle(limiter)
        clock.advance(0.95)  # 1.0595: bucket 0 has left the window, bucket 1 has not
        assert 100 - (await reference.peek("ip:b")).remaining == 1
    async with Limiter(redis_url, limits, prefix=prefix, clock=clock) as reference:
        assert 100 - (await reference.peek("ip:b")).remaining == 1


async def test_a_reset_drops_what_this_process_holds(redis_url: str, prefix: str) -> None:
    limits = [Limit(50, per=3600, precision=60)]
    async with Limiter(redis_url, limits, prefix=prefix, prefetch=10) as limiter:
        for _ in range(4):
            assert (await limiter.try_acquire("ip:x")).allowed
        assert limiter.statistics().prefetched >= 1
        await limiter.reset("ip:x")
        local = limiter.statistics().prefetched
        assert (await limiter.try_acquire("ip:x")).allowed
        assert limiter.statistics().prefetched == local  # (asked the store)
        await settle(limiter)
    assert await stored(redis_url, prefix, "ip:x", limits) == 1


async def test_a_local_admission_refunds_like_any_other(redis_url: str, prefix: str) -> None:
    limits = [Limit(50, per=3600, precision=60)]
    async with Limiter(redis_url, limits, prefix=prefix, prefetch=10) as limiter:
        decisions = [await limiter.try_acquire("ip:f") for _ in range(5)]
        assert limiter.statistics().prefetched >= 2
        await limiter.refund("ip:f", decision=decisions[-1])
        await limiter.refund("ip:f", decision=decisions[-2])
        with pytest.raises(Exception, match="gives back more"):
            await limiter.refund("ip:f", decision=decisions[-1])
    assert await stored(redis_url, prefix, "ip:f", limits) == 3


async def test_near_the_limit_allowances_shrink_and_nothing_is_over_admitted(
    redis_url: str, prefix: str
) -> None:
    limits = [Limit(10, per=3600, precision=60)]
    async with Limiter(redis_url, limits, prefix=prefix, prefetch=100) as limiter:
        outcomes = [(await limiter.try_acquire("ip:n")).allowed for _ in range(20)]
    assert outcomes == [True] * 10 + [False] * 10
    assert await stored(redis_url, prefix, "ip:n", limits) == 10


async def test_several_identifiers_and_limits_take_units_ahead_together(
    redis_url: str, prefix: str
) -> None:
    rules = {
        "ip": [Limit(500, per=10, precision=1), FixedWindow(800, per=60)],
        "user": [Limit(400, per=3600, precision=60)],
    }
    async with Limiter(redis_url, rules, prefix=prefix, prefetch=32) as limiter:
        for _ in range(100):
            assert (await limiter.try_acquire(["ip:m", "user:m"])).allowed
        assert limiter.statistics().prefetched >= 50
    assert await stored(redis_url, prefix, "ip:m", rules["ip"]) == 100
    assert await stored(redis_url, prefix, "ip:m", rules["ip"][1:]) == 100
    assert await stored(redis_url, prefix, "user:m", rules["user"]) == 100


@pytest.mark.parametrize(
    "limit",
    [TokenBucket(100, per=1, burst=100), SlidingLog(100, per=10), Concurrency(100)],
    ids=["gcra", "log", "lease"],
)
async def test_other_algorithms_never_take_units_ahead(
    redis_url: str, prefix: str, limit: object
) -> None:
    async with Limiter(redis_url, [limit], prefix=prefix, prefetch=10) as limiter:
        for _ in range(20):
            decision = await limiter.try_acquire("ip:o")
            assert decision.allowed
            if decision.lease is not None:
                await decision.lease.release()
        assert limiter.statistics().prefetched == 0


@pytest.mark.parametrize("bad", [-1, 1_000_001, 2.5, "8", True])
async def test_a_bad_prefetch_is_refused(redis_url: str, bad: object) -> None:
    with pytest.raises(ConfigurationError, match="prefetch"):
        Limiter(redis_url, [Limit(10, per=1)], prefetch=bad)  # type: ignore[arg-type]


async def test_prefetch_with_count_refused_is_refused(redis_url: str) -> None:
    with pytest.raises(ConfigurationError, match="count_refused"):
        Limiter(redis_url, [Limit(10, per=1)], prefetch=8, count_refused=True)


async def test_on_a_cluster_one_identifier_takes_units_ahead(
    redis_cluster_url: str, prefix: str
) -> None:
    limits = [Limit(1000, per=10, precision=1)]
    async with Limiter(redis_cluster_url, limits, prefix=prefix, prefetch=32) as limiter:
        for _ in range(100):
            assert (await limiter.try_acquire("ip:c")).allowed
        assert limiter.statistics().prefetched >= 50
    assert await stored(redis_cluster_url, prefix, "ip:c", limits) == 100


async def test_units_given_back_while_the_store_is_away_arrive_once_it_answers(
    standalone_proxy: Proxy, redis_url: str, prefix: str
) -> None:
    """The give-back (an undo of the op) is retried until the store answers: while it is
    away the store counts the held units (refusing early, never over-admitting), and after
    it heals it counts what was admitted, exactly."""
    limits = [Limit(100, per=3600, precision=60)]
    limiter = Limiter(standalone_proxy.url, limits, prefix=prefix, prefetch=20, deadline=0.5)
    try:
        for _ in range(3):  # (the second takes 2 ahead, the third is admitted here)
            assert (await limiter.try_acquire("ip:p")).allowed
        assert limiter.statistics().prefetched == 1
        held = await stored(redis_url, prefix, "ip:p", limits)
        assert held == 4
        standalone_proxy.partition()
        close = asyncio.create_task(limiter.aclose())
        await asyncio.sleep(0.3)
        assert await stored(redis_url, prefix, "ip:p", limits) == held
        standalone_proxy.heal()
        await asyncio.wait_for(close, 10)
    finally:
        standalone_proxy.heal()
        await limiter.aclose()
    assert await stored(redis_url, prefix, "ip:p", limits) == 3


async def test_cancelled_callers_leave_no_charge_behind(redis_url: str, prefix: str) -> None:
    """Callers cancelled at random points, some while their call takes units ahead: what the
    store counts in the end is what was admitted to callers who got their answer."""
    limits = [Limit(10_000, per=3600, precision=60)]
    admitted = 0
    async with Limiter(redis_url, limits, prefix=prefix, prefetch=16) as limiter:

        async def one() -> None:
            nonlocal admitted
            decision = await limiter.try_acquire("ip:k")
            admitted += decision.allowed

        rng = random.Random(7)
        for _ in range(60):
            tasks = [asyncio.create_task(one()) for _ in range(8)]
            await asyncio.sleep(0)
            for task in tasks:
                if rng.random() < 0.4:
                    task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await settle(limiter)
    assert await stored(redis_url, prefix, "ip:k", limits) == admitted


async def test_an_admission_that_came_as_a_replay_keeps_no_units(
    standalone_proxy: Proxy, redis_url: str, prefix: str
) -> None:
    """The reply to a call taking units ahead is lost (the server ran it) and the store sends
    it again: the copy replays, and its pairs tell the bucket of the replay's time, which may
    be later than the one the op charged in. So no units are kept from it: they are given back
    at once, and the store ends up counting the admissions alone."""
    from tests._proxy import drop_first_script_reply

    limits = [Limit(1000, per=60)]
    async with Limiter(standalone_proxy.url, limits, prefix=prefix, prefetch=8) as limiter:
        assert (await limiter.try_acquire("ip:rp")).allowed  # (plain: the first this bucket)
        dropped = drop_first_script_reply(standalone_proxy)
        assert (await limiter.try_acquire("ip:rp")).allowed  # (takes 2 ahead; lost; replayed)
        assert dropped == [1]
        allowances = limiter._prefetch
        assert allowances is not None
        assert allowances.taken == 0
        assert allowances.returned == 1
        await settle(limiter)
        assert await stored(redis_url, prefix, "ip:rp", limits) == 2


async def test_what_is_remembered_for_sizing_stays_bounded(
    redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every identifier the store decides is remembered (to size its next allowance), up to a
    bound: past it, those not busy lately are forgotten, and a busy one keeps its allowance."""
    import aiolimit._prefetch as prefetch_module

    monkeypatch.setattr(prefetch_module, "MAX_HINTS", 40)
    limits = [Limit(1000, per=3600, precision=60)]
    async with Limiter(redis_url, limits, prefix=prefix, prefetch=16) as limiter:
        allowances = limiter._prefetch
        assert allowances is not None
        for _ in range(4):
            assert (await limiter.try_acquire("ip:busy")).allowed
        busy = allowances._by_ids["ip:busy"]
        assert busy.turn is not None  # (it holds units)
        for i in range(200):
            assert (await limiter.try_acquire(["ip:busy", f"user:{i}"])).allowed
            assert len(allowances._by_ids) <= 40
        assert allowances._by_ids.get("ip:busy") is busy or busy.turn is None
        # Resetting an identifier that only sets of several name finds them through the index.
        assert (await limiter.try_acquire(["ip:busy", "user:199"])).allowed
        assert (await limiter.try_acquire(["ip:busy", "user:199"])).allowed
        await limiter.reset("user:199")
        assert ("ip:busy", "user:199") not in allowances._by_ids
        assert all("user:199" not in key for key in allowances._tuples)
        await settle(limiter)
    stored_busy = await stored(redis_url, prefix, "ip:busy", limits)
    assert stored_busy == 4 + 200 + 2


async def test_concurrent_callers_wait_for_a_refill_instead_of_asking_the_store(
    redis_url: str, prefix: str
) -> None:
    """32 tasks on one identifier: when its units run out, one call takes more ahead and the
    others wait for them (each asking the store for its own would cost a round trip apiece):
    nearly every admission is local, and the store counts exactly what was admitted."""
    limits = [Limit(10**6, per=3600, precision=60)]
    admitted = 0
    async with Limiter(redis_url, limits, prefix=prefix, prefetch=64) as limiter:

        async def task() -> None:
            nonlocal admitted
            for _ in range(100):
                decision = await limiter.try_acquire("ip:w")
                admitted += decision.allowed

        await asyncio.wait_for(asyncio.gather(*(task() for _ in range(32))), 30)
        assert admitted == 3200
        local = limiter.statistics().prefetched
        assert local >= 0.9 * 3200, local
    assert await stored(redis_url, prefix, "ip:w", limits) == admitted


async def test_callers_waiting_for_refills_of_a_frozen_store_answer_within_their_deadline(
    standalone_proxy: Proxy, prefix: str
) -> None:
    """The store stops answering while callers on a busy identifier wait for each other's
    refills: each waits within its own one deadline (the failure policy then answers), never
    for a chain of other callers' deadlines."""
    limits = [Limit(10**6, per=3600, precision=60)]
    limiter = Limiter(
        standalone_proxy.url, limits, prefix=prefix, prefetch=4, deadline=0.2,
        on_error="open", failure_threshold=10_000,
    )  # fmt: skip
    try:
        for _ in range(20):
            assert (await limiter.try_acquire("ip:z")).allowed
        assert limiter.statistics().prefetched >= 5
        standalone_proxy.partition()
        longest = 0.0

        async def caller() -> None:
            nonlocal longest
            for _ in range(6):
                began = asyncio.get_running_loop().time()
                await limiter.try_acquire("ip:z")
                longest = max(longest, asyncio.get_running_loop().time() - began)

        await asyncio.wait_for(asyncio.gather(*(caller() for _ in range(12))), 60)
        assert longest < 0.5, longest  # (a chain of other callers' deadlines: 0.8 s and more)
    finally:
        standalone_proxy.heal()
        await limiter.aclose()


async def test_weights_up_to_the_limit_take_nothing_ahead_past_it(
    redis_url: str, prefix: str
) -> None:
    """A call of the whole amount leaves no room for units ahead; one above it is refused at
    the boundary with a typed error, and nothing is stored for it."""
    from aiolimit import WeightNeverFits

    limits = [Limit(10, per=3600, precision=60)]
    async with Limiter(redis_url, limits, prefix=prefix, prefetch=100) as limiter:
        assert (await limiter.try_acquire("ip:h", 1)).allowed
        assert (await limiter.try_acquire("ip:h", 1)).allowed  # (takes units ahead: busy)
        assert not (await limiter.try_acquire("ip:h", 10)).allowed
        with pytest.raises(WeightNeverFits):
            await limiter.try_acquire("ip:h", 11)
        await limiter.reset("ip:h")
        assert (await limiter.try_acquire("ip:h", 10)).allowed
        assert not (await limiter.try_acquire("ip:h", 1)).allowed
        await settle(limiter)
    assert await stored(redis_url, prefix, "ip:h", limits) == 10
