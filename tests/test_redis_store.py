"""The standalone store pipelines concurrent decisions and survives a lost script."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as redis
from _workers import bucket_counts

from aiolimit import Limit, Limiter
from aiolimit._keys import main_key


async def _stored(redis_url: str, key: str) -> dict[bytes, bytes]:
    client = redis.Redis.from_url(redis_url)
    try:
        return await client.hgetall(key)  # type: ignore[no-any-return,misc]
    finally:
        await client.aclose()


@pytest.mark.parametrize("server", ["redis", "valkey"])
@pytest.mark.parametrize("flush", ["script", "function"])
async def test_a_flush_mid_load_costs_no_error_and_no_double_charge(
    request: pytest.FixtureRequest, prefix: str, flush: str, server: str
) -> None:
    """SCRIPT FLUSH or FUNCTION FLUSH (the code is gone, as on a fresh node) between batches,
    on Redis and on Valkey: every call loads it again and runs once; counts stay exact."""
    redis_url: str = request.getfixturevalue(
        "redis_url" if server == "redis" else "valkey_server_url"
    )
    admin = redis.Redis.from_url(redis_url)
    async with Limiter(redis_url, [Limit(1000, per=3600)], prefix=prefix) as limiter:
        try:
            await limiter.peek("ip:flush")
            libraries = await admin.execute_command("FUNCTION", "LIST", "LIBRARYNAME", "aiolimit_*")
            assert libraries, "Redis 7 and Valkey run the decision as a FUNCTION library"
            for _ in range(5):
                await (admin.script_flush() if flush == "script" else admin.function_flush())
                decisions = await asyncio.gather(
                    *(limiter.try_acquire("ip:flush") for _ in range(40))
                )
                assert all(d.allowed for d in decisions)
            final = await limiter.peek("ip:flush")
            assert final.remaining == 1000 - 200
        finally:
            await admin.aclose()


async def test_a_user_without_function_rights_falls_back_to_evalsha(
    redis_url: str, prefix: str
) -> None:
    """An ACL user who may not run FUNCTION (NOPERM) still gets exact decisions: the store
    falls back to EVALSHA of the same code."""
    admin = redis.Redis.from_url(redis_url)
    user = f"nofunc-{prefix}"
    await admin.acl_setuser(
        user, enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-function"]
    )
    limited = redis.Redis.from_url(redis_url, username=user, password="pw")
    try:
        async with Limiter(limited, [Limit(3, per=3600)], prefix=prefix) as limiter:
            decisions = [await limiter.try_acquire("ip:acl") for _ in range(5)]
            assert [d.allowed for d in decisions] == [True, True, True, False, False]
            assert limiter.store._words[0] == "EVALSHA"  # type: ignore[attr-defined]
    finally:
        await limited.aclose()
        await admin.acl_deluser(user)
        await admin.aclose()


async def test_many_concurrent_decisions_share_pipelines_exactly(
    redis_url: str, prefix: str
) -> None:
    """500 concurrent calls (several pipelines per tick) admit exactly the capacity of 120."""
    async with Limiter(redis_url, [Limit(120, per=3600)], prefix=prefix) as limiter:
        decisions = await asyncio.gather(*(limiter.try_acquire("ip:burst") for _ in range(500)))
        assert sum(d.allowed for d in decisions) == 120
    stored = await _stored(redis_url, main_key(prefix, "ip:burst"))
    counts = bucket_counts({k.decode(): v.decode() for k, v in stored.items()})
    assert sum(counts.values()) == 120


async def test_a_cancelled_caller_does_not_disturb_its_batch(redis_url: str, prefix: str) -> None:
    """Cancelling one decision in flight leaves the others in its pipeline correct."""
    async with Limiter(redis_url, [Limit(1000, per=3600)], prefix=prefix) as limiter:
        tasks = [asyncio.ensure_future(limiter.try_acquire(f"ip:{i % 3}")) for i in range(30)]
        await asyncio.sleep(0)
        tasks[7].cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert isinstance(results[7], asyncio.CancelledError)
        assert all(getattr(r, "allowed", False) for i, r in enumerate(results) if i != 7)
        follow_up = await limiter.try_acquire("ip:0")
        assert follow_up.allowed
