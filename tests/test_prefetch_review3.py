"""Third adversarial review of prefetched allowances (``aiolimit/_prefetch.py``): waiting for
other calls' refills (``Allowances.pending``/``refill``), the one deadline of a decision
(``_refilled``, ``_decide_within``) and refusals kept out by this process's own units
(``Allowances.refused``); real servers only."""

from __future__ import annotations

import asyncio
import time

import pytest

from aiolimit import Limit, Limiter
from tests._nodes import stored
from tests._proxy import Proxy

pytestmark = pytest.mark.asyncio


async def _burst(limiter: Limiter, ident: str, n: int) -> list[object]:
    return await asyncio.gather(
        *(limiter.try_acquire(ident) for _ in range(n)), return_exceptions=True
    )


@pytest.mark.parametrize("prefetch", [0, 2])
async def test_a_slow_but_healthy_store_answers_every_waiter_within_the_deadline(
    standalone_proxy: Proxy, redis_url: str, prefix: str, prefetch: int
) -> None:
    """The store answers every call in 0.12 s, well within the deadline of 0.4 s: without
    prefetch a burst of 24 calls on one identifier is admitted whole. With prefetch each
    waiter waits for another call's refill, then (its units all taken by earlier waiters)
    for the next one: a chain of round trips that runs past the deadline, so calls the
    store would have answered in time fail (DeadlineExceeded), and the breaker opens on a
    store that never failed."""
    limits = [Limit(10_000, per=60, precision=1)]
    limiter = Limiter(
        standalone_proxy.url, limits, prefix=prefix, prefetch=prefetch, deadline=0.4,
        on_error="raise", failure_threshold=5,
    )  # fmt: skip
    admitted = 0
    try:
        await _burst(limiter, "ip:warm", 24)  # (connections opened: no handshake delayed)
        assert (await limiter.try_acquire("ip:s")).allowed  # (busy: the next takes ahead)
        admitted += 1
        standalone_proxy.delay = 0.12
        results = await _burst(limiter, "ip:s", 24)
        standalone_proxy.delay = 0
        errors = [r for r in results if isinstance(r, BaseException)]
        admitted += sum(1 for r in results if not isinstance(r, BaseException) and r.allowed)
        assert not errors, f"{len(errors)} of 24 failed: {errors[:1]!r}"
        assert limiter._failure.breaker.state == "closed"
    finally:
        standalone_proxy.delay = 0
        await limiter.aclose()
    assert await stored(redis_url, prefix, "ip:s", limits) == admitted


@pytest.mark.parametrize("on_error", ["raise", "open", "closed"])
async def test_calls_cut_by_what_is_left_of_their_deadline_are_undone(
    standalone_proxy: Proxy, redis_url: str, prefix: str, on_error: str
) -> None:
    """Waiters woken by a slow refill with no units left for them ask the store with what is
    left of their deadline; the store applies those calls but their replies come too late:
    each is cut (the failure policy answers) and undone in the background. After close the
    store counts exactly the calls admitted (a degraded admission charged nothing); every
    call was decided within its deadline (plus slack)."""
    limits = [Limit(10_000, per=60, precision=1)]
    limiter = Limiter(
        standalone_proxy.url, limits, prefix=prefix, prefetch=2, deadline=0.3,
        on_error=on_error, failure_threshold=1000,
    )  # fmt: skip
    admitted = 0
    took: list[float] = []

    async def one() -> object:
        start = time.monotonic()
        try:
            return await limiter.try_acquire("ip:u")
        finally:
            took.append(time.monotonic() - start)

    try:
        await _burst(limiter, "ip:warm", 16)
        assert (await limiter.try_acquire("ip:u")).allowed
        admitted += 1
        standalone_proxy.delay = 0.2
        results = await asyncio.gather(*(one() for _ in range(16)), return_exceptions=True)
        standalone_proxy.delay = 0
        for result in results:
            if isinstance(result, BaseException):
                assert on_error == "raise", result
                continue
            if result.allowed and not result.degraded:
                admitted += 1
        assert max(took) < 0.3 + 0.15, took
    finally:
        standalone_proxy.delay = 0
        await limiter.aclose()
    assert await stored(redis_url, prefix, "ip:u", limits) == admitted


async def test_a_slow_store_does_not_turn_a_refused_prefetch_into_a_failure(
    standalone_proxy: Proxy, redis_url: str, prefix: str
) -> None:
    """Once the store is known to take more than half the deadline to answer, a call must not
    take units ahead: refused for them it would have no time left to be sent again for its
    own weight, and a call the store answers in time (0.12 s of 0.2) came back as the failure
    policy's answer (DeadlineExceeded under on_error="raise"), counted against the breaker."""
    limits = [Limit(10, per=3600, precision=60)]
    async with (
        Limiter(
            standalone_proxy.url, limits, prefix=prefix, prefetch=8, deadline=0.2,
            on_error="raise",
        ) as limiter,
        Limiter(redis_url, limits, prefix=prefix) as other,
    ):  # fmt: skip
        assert (await limiter.try_acquire("ip:x")).allowed  # (busy; 9 remain)
        assert (await other.try_acquire("ip:x", 8)).allowed  # (1 remains)
        standalone_proxy.delay = 0.12
        assert (await limiter.try_acquire("ip:m")).allowed  # (a round trip of 0.12 s seen)
        started = time.monotonic()
        decision = await limiter.try_acquire("ip:x")  # (asked 1 + 2: refused; then 1: late)
        took = time.monotonic() - started
        standalone_proxy.delay = 0
        assert decision.allowed and not decision.degraded, decision
        assert took < 0.2 + 0.1, took
        assert limiter._failure.breaker.failures == 0
    assert await stored(redis_url, prefix, "ip:x", limits) == 10


async def test_acquire_loops_near_the_limit_with_units_held_never_over_admit(
    redis_url: str, prefix: str
) -> None:
    """Two prefetching limiters, callers looping on ``acquire(timeout=...)`` on one identifier
    past its limit: refusals kept out by a limiter's own held units come back with short
    retries (their units given back); never more admitted than the limit, the store counts
    exactly what was admitted, nothing hangs."""
    limits = [Limit(60, per=3600, precision=60)]
    limiters = [
        Limiter(redis_url, limits, prefix=prefix, prefetch=8, cache_refusals=cache)
        for cache in (False, True)
    ]
    admitted = 0

    async def caller(limiter: Limiter) -> None:
        nonlocal admitted
        for _ in range(12):
            try:
                decision = await limiter.acquire("ip:a", timeout=0.3)
            except Exception:  # (RateLimited once the limit is reached)
                continue
            assert decision.allowed
            admitted += 1

    try:
        async with asyncio.timeout(30):
            await asyncio.gather(*(caller(limiters[i % 2]) for i in range(8)))
    finally:
        for limiter in limiters:
            await limiter.aclose()
    assert admitted == 60
    assert await stored(redis_url, prefix, "ip:a", limits) == 60
