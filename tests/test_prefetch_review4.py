"""Review of refills ahead (``Allowances.low`` -> ``Limiter._refill_ahead``): a busy
identifier's next units taken in a background task of their own.

The commit says: "A refill ahead is not a decision (nothing counted); its failure is logged at
debug and the next call asks the store itself." These tests hold it to that, and to the
prefetch invariants (never past the limit; once settled, stored == admitted)."""

from __future__ import annotations

import asyncio
import logging
import random
import time

import pytest

from aiolimit import Limit, Limiter
from tests._nodes import held, settle, stored
from tests._proxy import Proxy

pytestmark = pytest.mark.asyncio


async def _local_until_a_refill_is_sent(limiter: Limiter, ident: str) -> int:
    """Takes the allowance down (local admissions only) until a refill ahead is spawned."""
    admitted = 0
    before = limiter.statistics().prefetched
    while not limiter._ahead:
        decision = await limiter.try_acquire(ident)
        assert decision.allowed and not decision.degraded
        admitted += 1
    # (every one of them from the allowance: no decision went to the store)
    assert limiter.statistics().prefetched - before == admitted
    return admitted


async def alternately(limiter: Limiter, other: Limiter, ident: str, rounds: int) -> int:
    """``rounds`` calls on ``ident`` through each limiter in turn: how many were admitted
    (``limiter``'s background work settled after)."""
    admitted = 0
    for _ in range(rounds):
        admitted += (await limiter.try_acquire(ident)).allowed
        admitted += (await other.try_acquire(ident)).allowed
    await settle(limiter)
    return admitted


async def test_a_failed_refill_ahead_is_not_counted_as_a_failed_decision(
    redis_url: str, prefix: str, standalone_proxy: Proxy, caplog: pytest.LogCaptureFixture
) -> None:
    """Every decision here is admitted (two by the store, the rest from the allowance), none
    met the store's slowness; only the background refill did, past the deadline. Yet the
    limiter reports a failed decision: ``statistics().errors``, the breaker's ``degraded``
    and ``timeouts`` go up, and a WARNING says "1 decision(s) admitted without the store"
    (``_refill_ahead`` goes through ``_decide``, whose failure path counts and logs as for a
    caller's decision)."""
    caplog.set_level(logging.DEBUG, logger="aiolimit")
    limits = [Limit(1000, per=3600, precision=60)]
    async with Limiter(
        standalone_proxy.url, limits, prefix=prefix, prefetch=50, deadline=0.1, on_error="open"
    ) as limiter:
        for _ in range(2):  # (the second takes units ahead)
            assert (await limiter.try_acquire("ip:s")).allowed
        standalone_proxy.delay = 0.3
        await _local_until_a_refill_is_sent(limiter, "ip:s")
        await asyncio.wait(list(limiter._ahead))  # (the refill, cut by the deadline)
        statistics = limiter.statistics()
        degraded_logged = [r for r in caplog.records if "aiolimit degraded" in r.getMessage()]
        found = {
            "decisions degraded": statistics.breaker.degraded,
            "errors": statistics.errors,
            "timeouts": statistics.breaker.timeouts,
            "degraded warnings": len(degraded_logged),
        }
        standalone_proxy.delay = 0.0
        await asyncio.sleep(0.35)  # (the late reply is in)
        await settle(limiter)
        assert statistics.refused == 0
        assert statistics.allowed == statistics.decisions
        assert found == {
            "decisions degraded": 0,
            "errors": 0,
            "timeouts": 0,
            "degraded warnings": 0,
        }, found


async def test_a_failed_refill_ahead_does_not_open_the_breaker_on_the_next_caller(
    redis_url: str, prefix: str, standalone_proxy: Proxy
) -> None:
    """``_refill_ahead``'s docstring: "a failure only means the next call asks the store
    itself". With ``failure_threshold=1`` the background refill's timeout opens the breaker
    (``_decide`` records it as a decision's failure), so the next call -- on another
    identifier, the store answering on time again -- is not asked of the store at all: it
    gets the policy's answer (``on_error="closed"``: a degraded refusal, a 503 behind a web
    layer) for ``recovery_time``, although no caller ever saw the store fail."""
    limits = [Limit(1000, per=3600, precision=60)]
    async with Limiter(
        standalone_proxy.url, limits, prefix=prefix, prefetch=50, deadline=0.1,
        on_error="closed", failure_threshold=1, recovery_time=30,
    ) as limiter:  # fmt: skip
        for _ in range(2):  # (the second takes units ahead)
            assert (await limiter.try_acquire("ip:b")).allowed
        standalone_proxy.delay = 0.3
        await _local_until_a_refill_is_sent(limiter, "ip:b")
        await asyncio.wait(list(limiter._ahead))  # (the refill, cut by the deadline)
        standalone_proxy.delay = 0.0
        await asyncio.sleep(0.35)  # (the late reply is in: the store answers on time again)
        decision = await limiter.try_acquire("ip:other")
        state = limiter.statistics().breaker.state
        await settle(limiter)
        assert (decision.allowed, decision.degraded, state) == (True, False, "closed"), (
            decision,
            state,
        )


@pytest.mark.parametrize("seed", range(3))
async def test_several_limiters_on_short_buckets_never_admit_past_the_limit_in_a_window(
    redis_url: str, prefix: str, seed: int
) -> None:
    """Three limiters (processes), refills ahead on, hammer one identifier under
    ``Limit(50, per=1, precision=0.1)`` for about 2.5 s. Each admission is timed (wall clock,
    the server's: it runs here) from before the call to after it: any ten consecutive 0.1 s
    buckets that surely hold more than 50 admissions are an over-admission. Once all close,
    a second limit of an hour (same calls) stores exactly what was admitted."""
    rng = random.Random(seed)
    short, long = Limit(50, per=1, precision=0.1), Limit(1_000_000, per=3600, precision=60)
    limits = [short, long]
    limiters = [
        Limiter(redis_url, limits, prefix=prefix, prefetch=rng.choice([8, 16, 32]))
        for _ in range(3)
    ]
    times: list[tuple[float, float]] = []
    stop = time.time() + 2.5

    async def hammer(limiter: Limiter) -> None:
        while time.time() < stop:
            began = time.time()
            decision = await limiter.try_acquire("ip:w")
            if decision.allowed:
                times.append((began, time.time()))
            pause = rng.random()
            if pause < 0.3:
                await asyncio.sleep(rng.random() * 0.004)
            elif pause < 0.6:
                await asyncio.sleep(0)

    try:
        await asyncio.wait_for(
            asyncio.gather(*(hammer(limiter) for limiter in limiters for _ in range(3))), 15
        )
        ahead = sum(limiter._prefetch.taken for limiter in limiters)  # type: ignore[union-attr]
        local = sum(limiter.statistics().prefetched for limiter in limiters)
    finally:
        for limiter in limiters:
            await settle(limiter)
            await limiter.aclose()
    assert ahead and local, (ahead, local)
    first = int(min(b for b, _ in times) / 0.1)
    last = int(max(e for _, e in times) / 0.1)
    worst = (0, 0)
    for end in range(first, last + 1):
        lo, hi = (end - 9) * 0.1, (end + 1) * 0.1
        surely = sum(1 for b, e in times if lo <= b and e < hi)
        worst = max(worst, (surely, end))
    assert worst[0] <= 50, (worst, len(times))
    assert await stored(redis_url, prefix, "ip:w", [long]) == len(times)


async def test_a_refill_ahead_whose_reply_is_a_replay_keeps_no_units(
    standalone_proxy: Proxy, redis_url: str, prefix: str
) -> None:
    """The refill's reply is lost (the server ran it) and the store sends it again: the copy
    replays, so the refill keeps nothing (as a caller's call taking units ahead would), and
    the store counts the admissions alone."""
    from tests._proxy import drop_first_script_reply

    limits = [Limit(1000, per=60)]
    async with Limiter(standalone_proxy.url, limits, prefix=prefix, prefetch=8) as limiter:
        admitted = 0
        for _ in range(2):  # (the second takes 2 ahead)
            admitted += (await limiter.try_acquire("ip:rr")).allowed
        assert held(limiter, "ip:rr") == 2
        dropped = drop_first_script_reply(standalone_proxy)
        admitted += await _local_until_a_refill_is_sent(limiter, "ip:rr")
        await settle(limiter)
        assert dropped == [1]
        assert held(limiter, "ip:rr") == 0
        for _ in range(20):
            admitted += (await limiter.try_acquire("ip:rr")).allowed
        await settle(limiter)
        assert await stored(redis_url, prefix, "ip:rr", limits) == admitted + held(limiter, "ip:rr")
    assert await stored(redis_url, prefix, "ip:rr", limits) == admitted


async def test_units_taken_ahead_after_a_reset_began_but_before_its_delete_ran_are_not_kept(
    redis_url: str, prefix: str, standalone_proxy: Proxy
) -> None:
    """(The prefetch core, older than refills ahead.) ``reset()`` drops this limiter's
    allowances and moves the epoch *before* it sends UNLINK; a call taking units ahead sent
    after that (same epoch) but run by the server before the UNLINK (another connection of
    the pool; here the UNLINK is held 150 ms on its way) has its units wiped by the reset, yet
    keeps them: once ``reset()`` has returned this process admits them on top of a count
    restarted from zero, and the identifier gets more than the limit after the reset."""
    limits = [Limit(30, per=3600, precision=60)]

    async def hold_unlink(link: object, data: bytes) -> None:
        if b"UNLINK" in data.upper():
            await asyncio.sleep(0.15)

    async with (
        Limiter(standalone_proxy.url, limits, prefix=prefix, prefetch=16, deadline=2) as limiter,
        Limiter(redis_url, limits, prefix=prefix) as other,
    ):
        for _ in range(2):  # (busy: the second takes units ahead)
            assert (await limiter.try_acquire("ip:x")).allowed
        standalone_proxy.on_request = hold_unlink
        resetting = asyncio.create_task(limiter.reset("ip:x"))
        await asyncio.sleep(0.02)  # (dropped here; the UNLINK is on its way)
        assert not resetting.done()
        for _ in range(2):  # (a plain call, then one that takes units ahead: run before it)
            assert (await limiter.try_acquire("ip:x")).allowed
        await resetting
        standalone_proxy.on_request = None
        kept = held(limiter, "ip:x")
        after = await alternately(limiter, other, "ip:x", 40)
        assert (after, kept) == (30, 0), (after, kept)


async def test_a_refill_ahead_sent_after_the_rules_changed_takes_nothing_under_the_old_ones(
    redis_url: str, prefix: str
) -> None:
    """``set_rules``: "Replaces the rules for the decisions that start from now on". The take
    that runs an allowance low spawns a refill for the allowance's (old) plans; the rules
    change before the task runs (nothing awaited in between); the refill then starts, after
    the change, and charges a new allowance under the old limits (``_refill_ahead`` never
    looks at the rules in force). No call can use those units (``take`` compares limits), but
    the store counts them: here both limits share their counter (same period and precision),
    so for up to a second the identifier is refused under the new limit for units nobody
    will admit. Expected: the new limit of 40 admits 40 less what was admitted before."""
    old, new = [Limit(1000, per=3600, precision=60)], [Limit(40, per=3600, precision=60)]
    async with (
        Limiter(redis_url, old, prefix=prefix, prefetch=64) as limiter,
        Limiter(redis_url, new, prefix=prefix) as other,
    ):
        admitted = 0
        for _ in range(6):  # (busy: allowances of a few units, each refilled ahead)
            admitted += (await limiter.try_acquire("ip:c")).allowed
            await settle(limiter)
        assert held(limiter, "ip:c") > 0
        # Down to nothing from the allowance, with nothing awaited (the web layers' take):
        # the refill ahead is spawned on the way, and has not run yet.
        while (decision := limiter._take_prefetched(["ip:c"], 1)) is not None:
            assert decision.allowed
            admitted += 1
        assert len(limiter._ahead) == 1 and held(limiter, "ip:c") == 0
        limiter.set_rules(new)
        await settle(limiter)  # (the refill ran: under the old limits)
        taken_under_old_rules = held(limiter, "ip:c")
        after = await alternately(limiter, other, "ip:c", 30)
        assert (after, taken_under_old_rules) == (40 - admitted, 0), (
            after,
            taken_under_old_rules,
            admitted,
        )
