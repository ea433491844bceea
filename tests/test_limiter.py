"""The limiter's behaviour on real Redis and on the embedded store (memory://), side by side.

Time comes from a ManualClock, so every remaining / retry_after / reset_after is exact; the
stored state is read back raw (HGETALL of ``<prefix>:{<id>}``) to show what was charged.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as redis_asyncio
from _workers import Backend

from aiolimit import Limit, Limiter, RateLimited, ServerClock
from aiolimit.testing import ManualClock

START = 1_700_000_000.25  # a quarter second into a second: the next bucket is 0.75 s away
HOUR = 1_699_999_200  # an hour boundary (also a minute boundary)
MINUTE = 1_699_999_980  # a minute boundary


def field(limit: Limit, at: float) -> str:
    """The stored HASH field of ``limit``'s bucket holding time ``at`` (lua/sliding_window.lua)."""
    per_us = round(limit.per * 1_000_000)
    precision_us = round((limit.precision or limit.per) * 1_000_000)
    return f"w{per_us}/{precision_us}:{round(at * 1_000_000) // precision_us}"


async def test_admits_amount_then_refuses_until_next_bucket(backend: Backend) -> None:
    """3/second admits 3 with exact remaining, then refuses until the next second's bucket."""
    per_second = Limit(3, per=1)
    clock = ManualClock(start=START)
    limiter = backend.limiter([per_second], clock=clock)
    remaining = [(await limiter.try_acquire("ip:1")).remaining for _ in range(3)]
    assert remaining == [2, 1, 0]
    refused = await limiter.try_acquire("ip:1")
    assert not refused.allowed
    assert (refused.remaining, refused.retry_after, refused.reset_after) == (0, 0.75, 0.75)
    assert (refused.identifier, refused.limit) == ("ip:1", per_second)
    assert await backend.counts("ip:1") == {field(per_second, START): 3}
    clock.advance(0.75)
    admitted = await limiter.try_acquire("ip:1")
    assert (admitted.allowed, admitted.remaining, admitted.retry_after) == (True, 2, 0.0)
    assert admitted.reset_after == 1.0


async def test_refusal_by_one_identifier_charges_no_other(backend: Backend) -> None:
    """A request refused by one identifier's limit charges nothing on any identifier."""
    user_limit = Limit(2, per=1)
    limits = {"ip": [Limit(5, per=1), Limit(100, per=3600, precision=60)], "user": [user_limit]}
    limiter = backend.limiter(limits, clock=ManualClock(start=START))
    assert (await limiter.try_acquire("ip:1")).allowed
    for _ in range(2):
        assert (await limiter.try_acquire("user:2")).allowed
    before = await backend.snapshot()
    refused = await limiter.try_acquire(["ip:1", "user:2"], weight=1)
    assert not refused.allowed
    assert (refused.identifier, refused.limit, refused.retry_after) == ("user:2", user_limit, 0.75)
    assert [(d.identifier, d.allowed) for d in refused.details] == [
        ("ip:1", True),
        ("ip:1", True),
        ("user:2", False),
    ]
    assert await backend.snapshot() == before
    assert await backend.counts("ip:1") == {
        field(Limit(5, per=1), START): 1,
        field(Limit(100, per=3600, precision=60), START): 1,
    }


async def test_a_refused_decision_describes_the_unchanged_state(backend: Backend) -> None:
    """A refusal charged nothing, so remaining and reset_after describe the state as it is."""
    rules = {"ip": [Limit(100, per=3600, precision=60)], "user": [Limit(2, per=1)]}
    limiter = backend.limiter(rules, clock=ManualClock(start=START))
    await limiter.try_acquire("user:2", weight=2)
    refused = await limiter.try_acquire(["ip:1", "user:2"])  # ip:1 was never charged
    assert (refused.allowed, refused.retry_after, refused.reset_after) == (False, 0.75, 0.75)
    hourly = Limit(10, per=3600)
    limiter = backend.limiter({"ip": [hourly], "user": [hourly]}, clock=ManualClock(start=START))
    await limiter.try_acquire("ip:3", weight=8)
    await limiter.try_acquire("user:4", weight=9)
    refused = await limiter.try_acquire(["ip:3", "user:4"], weight=2)
    assert (refused.allowed, refused.remaining) == (False, 1)  # min(10 - 8, 10 - 9)


async def test_refusal_by_one_limit_charges_no_other_limit(backend: Backend) -> None:
    """A request refused by 3/second is not charged to the same identifier's hourly limit."""
    per_second, per_hour = Limit(3, per=1), Limit(240, per=3600, precision=60)
    clock = ManualClock(start=START)
    limiter = backend.limiter([per_second, per_hour], clock=clock)
    for _ in range(3):
        assert (await limiter.try_acquire("ip:1")).allowed
    for _ in range(10):
        refused = await limiter.try_acquire("ip:1")
        assert (refused.allowed, refused.limit) == (False, per_second)
    assert await backend.counts("ip:1") == {field(per_second, START): 3, field(per_hour, START): 3}
    clock.advance(1)
    admitted = await limiter.try_acquire("ip:1")
    hourly = [d for d in admitted.details if d.limit == per_hour]
    assert hourly[0].remaining == 240 - 4
    assert (await backend.counts("ip:1"))[field(per_hour, START)] == 4


async def test_precision_buckets_stop_the_double_burst_at_a_window_edge(backend: Backend) -> None:
    """240/hour with 60 s precision refuses a second burst just after the hour turns."""
    fine, fixed = Limit(240, per=3600, precision=60), Limit(240, per=3600)
    clock = ManualClock(start=HOUR - 30)
    limiter = backend.limiter({"fine": [fine], "fixed": [fixed]}, clock=clock)
    assert (await limiter.try_acquire("fine:a", weight=240)).allowed
    assert (await limiter.try_acquire("fixed:a", weight=240)).allowed
    clock.advance(31)  # one second into the next hour
    assert (await limiter.try_acquire("fixed:a", weight=240)).allowed  # the fixed window's flaw
    refused = await limiter.try_acquire("fine:a")
    assert not refused.allowed
    # The 12:59 bucket leaves the window at 13:59:00, 3539 s after 13:00:01.
    assert (refused.retry_after, refused.reset_after) == (3539.0, 3539.0)
    clock.advance(3538.999)
    assert not (await limiter.try_acquire("fine:a")).allowed
    clock.advance(0.001)
    assert (await limiter.try_acquire("fine:a", weight=240)).remaining == 0


async def test_retry_after_waits_for_enough_oldest_buckets(backend: Backend) -> None:
    """retry_after is the time until enough of the oldest buckets leave for the weight to fit."""
    limit = Limit(10, per=60, precision=10)
    clock = ManualClock(start=MINUTE)
    limiter = backend.limiter([limit], clock=clock)
    assert (await limiter.try_acquire("k", weight=4)).allowed
    clock.advance(20)
    assert (await limiter.try_acquire("k", weight=5)).allowed
    clock.advance(5)
    light = await limiter.try_acquire("k", weight=2)  # the first bucket (4) must leave
    assert (light.allowed, light.remaining, light.retry_after, light.reset_after) == (
        False,
        1,
        35.0,
        55.0,
    )
    heavy = await limiter.try_acquire("k", weight=7)  # both buckets (4 and 5) must leave
    assert (heavy.allowed, heavy.retry_after) == (False, 55.0)
    fits = await limiter.try_acquire("k", weight=1)
    assert (fits.allowed, fits.remaining, fits.reset_after) == (True, 0, 55.0)
    clock.advance(35)
    assert (await limiter.try_acquire("k", weight=4)).allowed
    assert await backend.counts("k") == {
        field(limit, MINUTE + 20): 6,
        field(limit, MINUTE + 60): 4,
    }


async def test_awkward_identifiers_are_counted_apart(backend: Backend) -> None:
    """Braces, '%', NUL, unicode and long identifiers each get a counter of their own."""
    ids = ["a", "{a}", "a}", "{a", "%7Ba%7D", "a\x00b", "a\x00", "ünï", "用户:42"]
    ids += ["x" * 300, "x" * 299 + "y"]
    limiter = backend.limiter([Limit(1, per=60)], clock=ManualClock(start=MINUTE))
    assert (await limiter.try_acquire(ids)).allowed
    assert len(await backend.keys()) == len(ids)
    for identifier in ids:
        refused = await limiter.try_acquire(identifier)
        assert (refused.allowed, refused.identifier) == (False, identifier)
    await limiter.reset(ids[1:])
    assert await backend.keys() == [backend.key("a")]


async def test_limits_follow_the_identifier_kind_with_star_as_default(backend: Backend) -> None:
    """ip:, user: and other kinds get their own rule; kinds without one fall back to "*"."""
    rules = {"ip": [Limit(2, per=60)], "user": [Limit(5, per=60)], "*": [Limit(1, per=60)]}
    limiter = backend.limiter(rules, clock=ManualClock(start=MINUTE))
    cases = [("ip:1", 2, "ip"), ("ip:2:x", 2, "ip"), ("user:1", 5, "user"), ("anon", 1, "*")]
    cases.append(("key:9", 1, "*"))
    for identifier, amount, kind in cases:
        admitted = [(await limiter.try_acquire(identifier)).allowed for _ in range(amount + 1)]
        assert admitted == [True] * amount + [False], identifier
        assert (await limiter.peek(identifier)).limit == rules[kind][0], identifier


async def test_peek_charges_nothing(backend: Backend) -> None:
    """peek says whether the weight would pass and what is left now, and stores nothing."""
    limiter = backend.limiter([Limit(3, per=1)], clock=ManualClock(start=START))
    empty = await limiter.peek("ip:1", weight=2)
    assert (empty.allowed, empty.remaining, empty.retry_after, empty.reset_after) == (
        True,
        3,
        0.0,
        0.0,
    )
    assert await backend.keys() == []
    for _ in range(3):
        await limiter.try_acquire("ip:1")
    before = await backend.snapshot()
    full = await limiter.peek("ip:1")
    assert (full.allowed, full.remaining, full.retry_after) == (False, 0, 0.75)
    assert await backend.snapshot() == before
    assert limiter.statistics().decisions == 3


async def test_refund_gives_back_newest_first_and_never_below_zero(backend: Backend) -> None:
    """refund credits the newest buckets first and stops at zero."""
    limit = Limit(10, per=3600, precision=60)
    clock = ManualClock(start=MINUTE)
    limiter = backend.limiter([limit], clock=clock)
    await limiter.try_acquire("ip:1", weight=3)
    clock.advance(60)
    await limiter.try_acquire("ip:1", weight=2)
    refunded = await limiter.refund("ip:1", weight=3)
    assert (refunded.allowed, refunded.remaining) == (True, 8)
    assert refunded.reset_after == 3540.0  # the older bucket is now the newest non-empty one
    assert await backend.counts("ip:1") == {field(limit, MINUTE): 2}
    everything = await limiter.refund("ip:1", weight=100)
    assert (everything.remaining, everything.reset_after) == (10, 0.0)
    assert await backend.counts("ip:1") == {}
    assert (await limiter.try_acquire("ip:1", weight=10)).allowed


async def test_refund_to_empty_reports_nothing_to_reset(backend: Backend) -> None:
    """After refunding everything the window is full again: reset_after is 0."""
    limiter = backend.limiter([Limit(3, per=1)], clock=ManualClock(start=START))
    await limiter.try_acquire("ip:1", weight=2)
    refunded = await limiter.refund("ip:1", weight=2)
    assert (refunded.remaining, refunded.retry_after, refunded.reset_after) == (3, 0.0, 0.0)


async def test_refund_of_an_unknown_identifier_stores_nothing(backend: Backend) -> None:
    """refund on an identifier never charged creates no key."""
    limiter = backend.limiter([Limit(3, per=1)], clock=ManualClock(start=START))
    refunded = await limiter.refund("ip:never", weight=2)
    assert (refunded.allowed, refunded.remaining) == (True, 3)
    assert await backend.keys() == []


async def test_reset_forgets_only_the_given_identifiers(backend: Backend) -> None:
    """reset deletes the identifiers' keys; others keep their counts."""
    limiter = backend.limiter([Limit(3, per=60)], clock=ManualClock(start=MINUTE))
    for _ in range(3):
        await limiter.try_acquire(["ip:1", "user:2"])
    await limiter.reset(["ip:1"])
    assert await backend.keys() == [backend.key("user:2")]
    assert (await limiter.try_acquire("ip:1")).remaining == 2
    assert not (await limiter.try_acquire("user:2")).allowed


async def test_acquire_waits_exactly_retry_after(backend: Backend) -> None:
    """acquire sleeps the refusal's retry_after (plus a sub-ms margin) once, then is admitted."""
    clock = ManualClock(start=START, autojump=True)
    limiter = backend.limiter([Limit(2, per=1)], clock=clock)
    await limiter.acquire("ip:1")
    await limiter.acquire("ip:1")
    assert clock.time() == START
    admitted = await limiter.acquire("ip:1", timeout=None)
    assert (admitted.allowed, admitted.remaining) == (True, 1)
    assert 0.75 <= clock.time() - START <= 0.751
    assert limiter.statistics().waits == 1


async def test_acquire_sleeps_until_the_clock_reaches_retry_after(backend: Backend) -> None:
    """Without autojump, acquire stays blocked until the clock passes retry_after."""
    clock = ManualClock(start=START)
    limiter = backend.limiter([Limit(1, per=1)], clock=clock)
    await limiter.acquire("ip:1")
    waiter = asyncio.create_task(limiter.acquire("ip:1"))
    for _ in range(1000):
        if limiter.statistics().waits:
            break
        await asyncio.sleep(0.001)
    clock.advance(0.5)
    await asyncio.sleep(0.02)
    assert not waiter.done()
    clock.advance(0.3)
    decision = await asyncio.wait_for(waiter, 5)
    assert (decision.allowed, decision.remaining) == (True, 0)


async def test_acquire_raises_rate_limited_at_timeout(backend: Backend) -> None:
    """acquire raises RateLimited(decision) at once when the next chance is after the timeout."""
    clock = ManualClock(start=START, autojump=True)
    limit = Limit(2, per=1)
    limiter = backend.limiter([limit], clock=clock)
    await limiter.try_acquire("ip:1", weight=2)
    with pytest.raises(RateLimited) as caught:
        await limiter.acquire("ip:1", timeout=0.5)
    refused = caught.value.decision
    assert (refused.allowed, refused.retry_after, refused.limit) == (False, 0.75, limit)
    assert "'ip:1'" in str(caught.value)
    assert clock.time() == START  # it did not sleep in vain
    admitted = await limiter.acquire("ip:1", timeout=1.0)
    assert admitted.allowed


async def test_acquire_with_timeout_zero_never_waits(backend: Backend) -> None:
    """timeout=0 admits when there is room and raises at once otherwise."""
    clock = ManualClock(start=START, autojump=True)
    limiter = backend.limiter([Limit(1, per=1)], clock=clock)
    assert (await limiter.acquire("ip:1", timeout=0)).allowed
    with pytest.raises(RateLimited):
        await limiter.acquire("ip:1", timeout=0)
    assert clock.time() == START
    assert limiter.statistics().waits == 0


async def test_limit_is_an_async_context_manager_and_awaitable(backend: Backend) -> None:
    """async with limiter.limit(ids) and await limiter.limit(ids) both acquire."""
    limiter = backend.limiter([Limit(2, per=1)], clock=ManualClock(start=START))
    async with limiter.limit(["ip:1", "user:2"]) as entered:
        assert (entered.allowed, entered.remaining) == (True, 1)
    awaited = await limiter.limit(["ip:1", "user:2"])
    assert (awaited.allowed, awaited.remaining) == (True, 0)
    body_ran = False
    with pytest.raises(RateLimited):
        async with limiter.limit("ip:1", timeout=0):
            body_ran = True
    assert not body_ran
    assert await backend.counts("ip:1") == {field(Limit(2, per=1), START): 2}


async def test_statistics_count_decisions_outcomes_and_waits(backend: Backend) -> None:
    """statistics() counts decisions, admitted, refused and waits (peek is not a decision)."""
    clock = ManualClock(start=START, autojump=True)
    limiter = backend.limiter([Limit(2, per=1)], clock=clock)
    for _ in range(3):
        await limiter.try_acquire("ip:1")
    await limiter.peek("ip:1")
    await limiter.acquire("ip:1")  # refused once, waits, then admitted
    stats = limiter.statistics()
    assert (stats.decisions, stats.allowed, stats.refused, stats.waits) == (5, 3, 2, 1)
    assert (stats.errors, stats.multi_slot_decisions, stats.compensations) == (0, 0, 0)


async def test_a_keys_time_never_runs_backwards(backend: Backend) -> None:
    """A clock 10 s behind a key's last write is judged at that write; the past is not rewritten."""
    limit = Limit(3, per=1)
    ahead = ManualClock(start=START)
    limiter = backend.limiter([limit], clock=ahead)
    for _ in range(3):
        await limiter.try_acquire("ip:1")
    ahead.advance(10)
    await limiter.try_acquire("ip:1")
    behind = backend.limiter([limit], clock=ManualClock(start=START))
    decision = await behind.try_acquire("ip:1")
    # Judged at START + 10: one already in that second's bucket; at START it would be 2 left.
    assert (decision.allowed, decision.remaining, decision.reset_after) == (True, 1, 0.75)
    stored = await backend.hgetall("ip:1")
    assert stored["t"] == str(round((START + 10) * 1_000_000))
    assert await backend.counts("ip:1") == {field(limit, START + 10): 2}
    fields = {name for name in stored if not name.startswith("o:")}  # (op ledgers)
    assert fields == {"t", "x", field(limit, START + 10).partition(":")[0]}
    assert (await behind.peek("ip:1")).remaining == 1  # left now, at START + 10


async def test_every_key_gets_a_bounded_ttl(backend: Backend) -> None:
    """Each identifier's key expires: 0 < PTTL <= its longest window's life + slack + 1 s."""
    limits = [Limit(10, per=1), Limit(120, per=60), Limit(240, per=3600, precision=60)]
    limiter = backend.limiter(limits, clock=ManualClock(start=START))
    await limiter.try_acquire(["ip:1", "user:2"])
    keys = await backend.keys()
    assert keys == [backend.key("ip:1"), backend.key("user:2")]
    # The newest hourly bucket (minute 28333333) leaves the window 3579.75 s after START; TTLs
    # are set 1 s (lua/prelude.lua TTL_STEP_MS) longer so a busy key refreshes them rarely.
    longest = 3_579_750 + ManualClock.ttl_slack_ms + 1_000
    for key in keys:
        ttl = await backend.pttl(key)
        assert longest - 10_000 < ttl <= longest, key


@pytest.mark.parametrize("backend_url", ["redis"], indirect=True)
async def test_server_clock_is_the_default_on_redis(backend: Backend) -> None:
    """With no clock given, Redis' own TIME judges, and keys get no TTL slack."""
    limit = Limit(3, per=86400)
    limiter = backend.limiter([limit])
    assert isinstance(limiter.clock, ServerClock)
    assert [(await limiter.try_acquire("ip:1")).allowed for _ in range(4)] == [True] * 3 + [False]
    refused = await limiter.peek("ip:1")
    assert 0 < refused.retry_after <= 86400
    async with redis_asyncio.Redis.from_url(backend.url) as raw:
        server_seconds, server_us = await raw.time()
    stored_us = int((await backend.hgetall("ip:1"))["t"])
    assert 0 <= server_seconds * 1_000_000 + server_us - stored_us < 5_000_000
    ttl = await backend.pttl(backend.key("ip:1"))
    assert 0 < ttl <= 86_400_000
    assert abs(ttl - refused.reset_after * 1000) < 5_000


async def test_limiter_closes_as_an_async_context_manager(backend: Backend) -> None:
    """async with Limiter(...) closes the limiter on exit and answers inside."""
    started = time.monotonic()
    async with Limiter(backend.url, [Limit(1, per=1)], prefix=backend.prefix) as limiter:
        assert (await limiter.try_acquire("ip:1")).allowed
    assert time.monotonic() - started < 5
