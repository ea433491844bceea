"""Some errors are answered at once yet say the whole store cannot serve: out of memory (OOM),
a replica's READONLY, a script of someone else's running for long (BUSY). Unlike a clobbered
key (see test_breaker_data_errors), they fail every identifier's decisions alike: the breaker
must count them, so it reports the store as down and stops sending it a call per decision,
then closes once a probe succeeds."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as redis_asyncio
from redis.exceptions import ResponseError

import cluster
from aiolimit import Limit, Limiter


async def _busy(raw: redis_asyncio.Redis) -> AsyncIterator[None]:
    await raw.config_set("busy-reply-threshold", 50)
    looper = redis_asyncio.Redis(host=raw.connection_pool.connection_kwargs["host"],
                                 port=raw.connection_pool.connection_kwargs["port"])  # fmt: skip
    task = asyncio.ensure_future(looper.eval("while true do end", 0))
    await asyncio.sleep(0.2)  # (past the threshold: every other client is answered BUSY)
    try:
        yield
    finally:
        await raw.script_kill()
        with pytest.raises(ResponseError):
            await task
        await looper.aclose()


@pytest.mark.parametrize("sickness", ["oom", "readonly", "busy"])
async def test_a_store_that_cannot_serve_opens_the_breaker(
    fresh_standalone: cluster.Standalone, prefix: str, sickness: str
) -> None:
    url = fresh_standalone.url
    limiter = Limiter(
        url, [Limit(10, per=60)], prefix=prefix, deadline=0.5, on_error="closed",
        failure_threshold=3, recovery_time=0.3,
    )  # fmt: skip
    raw = redis_asyncio.Redis.from_url(url)
    # (a separate connection: during BUSY only SCRIPT KILL and a few others are served)
    admin = redis_asyncio.Redis.from_url(url)
    try:
        assert (await limiter.try_acquire("ip:1")).allowed  # (library loaded)
        busy = None
        if sickness == "oom":
            await raw.config_set("maxmemory", 1)
        elif sickness == "readonly":
            await raw.execute_command("REPLICAOF", "127.0.0.1", "1")  # (never reached)
        else:
            busy = _busy(admin)
            await busy.__anext__()
        for i in range(3):
            decision = await limiter.try_acquire(f"ip:{i}")
            assert decision.degraded and not decision.allowed
        breaker = limiter.statistics().breaker
        assert breaker.state == "open" and breaker.opened == 1
        decision = await limiter.try_acquire("ip:9")
        assert decision.degraded and limiter.statistics().breaker.short_circuited == 1
        # Healed: after recovery_time a probe succeeds and the breaker closes.
        if sickness == "oom":
            await raw.config_set("maxmemory", 0)
        elif sickness == "readonly":
            await raw.execute_command("REPLICAOF", "NO", "ONE")
        else:
            assert busy is not None
            await busy.aclose()
        await asyncio.sleep(0.35)
        started = time.monotonic()
        decision = await limiter.try_acquire("ip:10")
        assert decision.allowed and not decision.degraded and decision.remaining == 9
        assert time.monotonic() - started < 0.3
        assert limiter.statistics().breaker.state == "closed"
    finally:
        await raw.aclose()
        await admin.aclose()
        await limiter.aclose()
