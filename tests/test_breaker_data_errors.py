"""The circuit breaker measures whether the store answers, not whether one key is sound. A key
clobbered by something else (a string where aiolimit keeps a hash: WRONGTYPE) fails the
decisions of that identifier, every time, in well under a millisecond; it must not open the
breaker and turn every other identifier's decisions into the failure policy's answer."""

from __future__ import annotations

import pytest
import redis.asyncio as redis_asyncio
from redis.asyncio.cluster import RedisCluster

from aiolimit import Limit, Limiter


@pytest.mark.parametrize("topology", ["standalone", "cluster"])
async def test_a_clobbered_key_fails_its_own_decisions_only(
    topology: str, redis_url: str, redis_cluster_url: str, prefix: str
) -> None:
    url = redis_url if topology == "standalone" else redis_cluster_url
    limiter = Limiter(url, [Limit(10, per=60)], prefix=prefix, on_error="closed")
    raw: redis_asyncio.Redis | RedisCluster
    if topology == "standalone":
        raw = redis_asyncio.Redis.from_url(redis_url)
    else:
        raw = RedisCluster.from_url(redis_cluster_url.replace("redis+cluster://", "redis://"))
    bad, good = "ip:203.0.113.9", "ip:203.0.113.10"
    try:
        key = limiter._rules.plans(bad)[0].keys[0]
        await raw.set(key, "not aiolimit's")
        failures = [await limiter.try_acquire(bad) for _ in range(20)]
        assert all(d.degraded and not d.allowed for d in failures)  # (on_error="closed")
        served = await limiter.try_acquire(good)
        assert served.allowed and not served.degraded
        assert served.remaining == 9
        breaker = limiter.statistics().breaker
        assert breaker.state == "closed" and breaker.opened == 0
        assert breaker.short_circuited == 0 and breaker.degraded == 20
        assert await raw.get(key) == b"not aiolimit's"  # (nothing of it was touched)
    finally:
        await raw.delete(limiter._rules.plans(bad)[0].keys[0])
        await raw.aclose()
        await limiter.aclose()
