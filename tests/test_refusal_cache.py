"""The local refusal cache (``Limiter(..., cache_refusals=True)``) against the store itself.

The differential test replays one random workload on two limiters, cache on and cache off, on
the same backend and the same manual clock: the cache must never refuse what the store admits.
The other tests pin each rule of aiolimit/_refusals.py, and the one documented exception (a
refund made by another process).
"""

from __future__ import annotations

import random

import pytest
from redis.asyncio import Redis

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

RULES = {
    "ip": [Limit(5, per=1), FixedWindow(20, per=10)],
    "user": [SlidingLog(8, per=3), TokenBucket(2, per=1, burst=3)],
    "job": [Concurrency(3), Limit(10, per=2)],
}
IDS = ["ip:1", "ip:2", "user:a", "user:b", "job:x"]


@pytest.mark.parametrize("seed", [1, 2])
async def test_cache_never_refuses_what_the_store_admits(
    store_url: str, prefix: str, seed: int
) -> None:
    """600 random steps (acquires, leases released, refunds, resets, time moving) on two
    limiters, one caching refusals: every decision agrees, and a cached refusal never says
    to wait longer than the store does."""
    await _differential(store_url, prefix, seed)


@pytest.mark.cluster
async def test_cache_never_refuses_what_the_cluster_admits(
    redis_cluster_url: str, prefix: str
) -> None:
    """The same replay on the cluster, where calls spanning slots go through check and commit
    (a refusal there comes from either phase)."""
    await _differential(redis_cluster_url, prefix, 3)


async def _differential(store_url: str, prefix: str, seed: int) -> None:
    rng = random.Random(seed)
    clock = ManualClock()
    cached = Limiter(store_url, RULES, prefix=prefix + "-c", clock=clock, cache_refusals=True)
    plain = Limiter(store_url, RULES, prefix=prefix + "-p", clock=clock)
    leases: list[tuple[object, object]] = []
    try:
        for step in range(600):
            roll = rng.random()
            if roll < 0.2:
                clock.advance(rng.choice([0.001, 0.05, 0.2, 0.5, 1.3]))
                continue
            ids = rng.sample(IDS, rng.choice([1, 1, 2]))
            if roll < 0.25:
                weight = rng.randint(1, 3)
                await cached.refund(ids, weight)
                await plain.refund(ids, weight)
                continue
            if roll < 0.27:
                await cached.reset(ids)
                await plain.reset(ids)
                continue
            if roll < 0.33 and leases:
                a, b = leases.pop(rng.randrange(len(leases)))
                await a.release()  # type: ignore[attr-defined]
                await b.release()  # type: ignore[attr-defined]
                continue
            weight = rng.choice([1, 1, 1, 2, 3])
            with_cache = await cached.try_acquire(ids, weight)
            without = await plain.try_acquire(ids, weight)
            assert with_cache.allowed == without.allowed, (
                f"step {step}: {ids} weight {weight}: cache says {with_cache}, store {without}"
            )
            if not without.allowed:
                assert with_cache.retry_after <= without.retry_after + 1e-6, (step, ids)
            if with_cache.lease is not None:
                leases.append((with_cache.lease, without.lease))
        hits = cached.statistics().cached_refusals
        assert hits >= 30, f"the workload should exercise the cache, it answered {hits}"
        assert plain.statistics().cached_refusals == 0
    finally:
        for a, b in leases:
            await a.release()  # type: ignore[attr-defined]
            await b.release()  # type: ignore[attr-defined]
        await cached.aclose()
        await plain.aclose()


async def test_cached_refusals_do_not_reach_the_server(redis_url: str, prefix: str) -> None:
    """After one refusal, a thousand more requests on that pair are answered with no command
    sent to Redis, and the reply says how long is left."""
    limiter = Limiter(redis_url, [Limit(1, per=60)], prefix=prefix, cache_refusals=True)
    redis = Redis.from_url(redis_url)
    try:
        assert (await limiter.try_acquire("ip:9")).allowed
        first = await limiter.try_acquire("ip:9")
        assert not first.allowed
        before = await redis.info("commandstats")
        for _ in range(1000):
            again = await limiter.try_acquire("ip:9")
            assert not again.allowed
            assert 0 < again.retry_after <= first.retry_after
        after = await redis.info("commandstats")
        sent = sum(v["calls"] for v in after.values()) - sum(v["calls"] for v in before.values())
        assert sent <= 1, f"{sent} commands reached Redis (the INFO call itself is 1)"
        assert limiter.statistics().cached_refusals == 1000
        assert limiter.statistics().refused == 1001
    finally:
        await redis.aclose()
        await limiter.aclose()


async def test_a_smaller_weight_is_asked_of_the_store(store_url: str, prefix: str) -> None:
    """A refusal of weight 3 does not refuse weight 1 locally: it may fit, and here it does."""
    clock = ManualClock()
    limiter = Limiter(store_url, [Limit(4, per=60)], prefix=prefix, clock=clock,
                      cache_refusals=True)  # fmt: skip
    try:
        assert (await limiter.try_acquire("ip:1", 2)).allowed
        assert not (await limiter.try_acquire("ip:1", 3)).allowed
        assert not (await limiter.try_acquire("ip:1", 4)).allowed  # cached: 4 >= 3
        assert limiter.statistics().cached_refusals == 1
        assert (await limiter.try_acquire("ip:1", 1)).allowed
    finally:
        await limiter.aclose()


async def test_refund_and_reset_by_this_limiter_drop_the_entry(store_url: str, prefix: str) -> None:
    """A refund or reset made through the caching limiter is seen at once: the next request is
    asked of the store and admitted."""
    clock = ManualClock()
    limiter = Limiter(store_url, [Limit(1, per=60)], prefix=prefix, clock=clock,
                      cache_refusals=True)  # fmt: skip
    try:
        assert (await limiter.try_acquire("user:1")).allowed
        assert not (await limiter.try_acquire("user:1")).allowed
        await limiter.refund("user:1")
        assert (await limiter.try_acquire("user:1")).allowed
        assert not (await limiter.try_acquire("user:1")).allowed
        await limiter.reset("user:1")
        assert (await limiter.try_acquire("user:1")).allowed
        assert limiter.statistics().cached_refusals == 0
    finally:
        await limiter.aclose()


async def test_a_refund_by_another_process_is_seen_when_the_entry_expires(
    store_url: str, prefix: str
) -> None:
    """The documented exception: capacity another limiter gives back is not seen by the
    cache, which keeps refusing until its retry_after; then the store admits again."""
    if store_url == "memory://":
        pytest.skip("two limiters share state only through Redis")
    clock = ManualClock()
    cached = Limiter(store_url, [Limit(1, per=10)], prefix=prefix, clock=clock,
                     cache_refusals=True)  # fmt: skip
    other = Limiter(store_url, [Limit(1, per=10)], prefix=prefix, clock=clock)
    try:
        assert (await cached.try_acquire("ip:5")).allowed
        refused = await cached.try_acquire("ip:5")
        assert not refused.allowed
        await other.refund("ip:5")
        assert (await other.peek("ip:5")).allowed, "the store has room again"
        assert not (await cached.try_acquire("ip:5")).allowed, "the cache still refuses"
        clock.advance(refused.retry_after)
        assert (await cached.try_acquire("ip:5")).allowed
    finally:
        await cached.aclose()
        await other.aclose()


async def test_concurrency_refusals_are_never_cached(store_url: str, prefix: str) -> None:
    """A full Concurrency limit refuses, the lease comes back, and the very next request is
    admitted: a release returns capacity at any moment, so no such refusal is cached."""
    limiter = Limiter(store_url, [Concurrency(1)], prefix=prefix, cache_refusals=True)
    try:
        held = await limiter.try_acquire("job:1")
        assert held.allowed and held.lease is not None
        assert not (await limiter.try_acquire("job:1")).allowed
        await held.lease.release()
        again = await limiter.try_acquire("job:1")
        assert again.allowed
        assert again.lease is not None
        await again.lease.release()
        assert limiter.statistics().cached_refusals == 0
    finally:
        await limiter.aclose()


async def test_a_waiter_that_may_reserve_its_turn_is_not_refused_by_the_cache(
    store_url: str, prefix: str
) -> None:
    """On a token bucket a cached try_acquire refusal does not stop acquire(timeout=5) from
    reserving the next turn, which the store grants."""
    clock = ManualClock(autojump=True)
    limiter = Limiter(store_url, [TokenBucket(1, per=1, burst=1)], prefix=prefix, clock=clock,
                      cache_refusals=True)  # fmt: skip
    try:
        assert (await limiter.try_acquire("ip:1")).allowed
        assert not (await limiter.try_acquire("ip:1")).allowed
        start = clock.time()
        decision = await limiter.acquire("ip:1", timeout=5)
        assert decision.allowed
        assert 0 < clock.time() - start <= 1.0
        assert limiter.statistics().cached_refusals == 0
    finally:
        await limiter.aclose()


def test_bad_cache_settings_are_refused_at_construction() -> None:
    """cache_refusals with count_refused, a non-bool switch, or a bad size: ConfigurationError
    saying what is allowed."""
    with pytest.raises(ConfigurationError, match="count_refused"):
        Limiter("memory://", [Limit(1, per=1)], cache_refusals=True, count_refused=True)
    with pytest.raises(ConfigurationError, match="cache_refusals must be"):
        Limiter("memory://", [Limit(1, per=1)], cache_refusals="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="refusal_cache_size must be an int in 1"):
        Limiter("memory://", [Limit(1, per=1)], cache_refusals=True, refusal_cache_size=0)


async def test_a_loop_of_cached_refusals_lets_other_tasks_run(store_url: str, prefix: str) -> None:
    """A task that loops on cached refusals (they need no I/O) still lets the event loop run:
    another task's timer fires and its own decision completes meanwhile."""
    import asyncio

    limiter = Limiter(store_url, [Limit(1, per=60)], prefix=prefix, cache_refusals=True)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0)
            ticks += 1

    try:
        assert (await limiter.try_acquire("ip:1")).allowed
        assert not (await limiter.try_acquire("ip:1")).allowed
        other = asyncio.ensure_future(ticker())
        for _ in range(2_000):
            await limiter.try_acquire("ip:1")
        other.cancel()
        assert ticks >= 2_000 // 16 - 1, f"the other task ran {ticks} times in 2,000 refusals"
    finally:
        await limiter.aclose()


async def test_a_degraded_refusal_from_a_stopped_server_is_not_cached(
    fresh_standalone: object, prefix: str
) -> None:
    """on_error="closed" with the server stopped (SIGSTOP): the degraded refusals are not
    remembered, so once the server resumes the next request is asked of it and admitted."""
    server = fresh_standalone
    limiter = Limiter(
        server.url,  # type: ignore[attr-defined]
        [Limit(5, per=60)],
        prefix=prefix,
        cache_refusals=True,
        on_error="closed",
        deadline=0.2,
        failure_threshold=10**6,
    )
    try:
        assert (await limiter.try_acquire("ip:1")).allowed
        server.pause()  # type: ignore[attr-defined]
        try:
            refused = await limiter.try_acquire("ip:1")
            assert not refused.allowed and refused.degraded
        finally:
            server.resume()  # type: ignore[attr-defined]
        again = await limiter.try_acquire("ip:1")
        assert again.allowed and not again.degraded
        assert limiter.statistics().cached_refusals == 0
    finally:
        await limiter.aclose()
