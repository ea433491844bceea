"""The standalone store pipelines concurrent decisions and survives a lost script."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as redis
from _proxy import Link, Proxy, script_calls
from _workers import bucket_counts
from test_edges_charging import ROOMY, charged, settle, told_admitted

from aiolimit import BackendError, Decision, Limit, Limiter
from aiolimit._keys import main_key


async def _stored(redis_url: str, key: str) -> dict[bytes, bytes]:
    client = redis.Redis.from_url(redis_url)
    try:
        return await client.hgetall(key)  # type: ignore[no-any-return,misc]
    finally:
        await client.aclose()


@pytest.mark.parametrize("on_error", ["raise", "open"])
async def test_a_reply_that_is_no_resp_is_a_store_failure_on_the_lone_path(
    standalone_proxy: Proxy, prefix: str, on_error: str
) -> None:
    """A lone call's reply that redis-py cannot parse (a protocol error, not a connection
    error) is a ``BackendError``, which the failure policy answers (``on_error="open"``: a
    degraded admission), as on the pipelined path; not redis-py's own exception. The next
    call works on a fresh connection."""
    limiter = Limiter(
        standalone_proxy.url, [Limit(1000, per=3600, precision=60)], prefix=prefix,
        on_error=on_error,  # type: ignore[arg-type]
    )  # fmt: skip
    armed = False

    def garble(link: Link, data: bytes) -> bytes | None:
        nonlocal armed
        if armed:
            armed = False
            return b"@not-resp\r\n"
        return None

    try:
        assert (await limiter.try_acquire("ip:garbled")).allowed  # (a connection kept)
        assert limiter.store._idle  # type: ignore[attr-defined]
        standalone_proxy.on_reply = garble
        armed = True
        try:
            outcome: object = await limiter.try_acquire("ip:garbled")
        except Exception as error:
            outcome = error
        assert not armed
        if on_error == "raise":
            assert isinstance(outcome, BackendError), repr(outcome)
        else:
            assert isinstance(outcome, Decision) and outcome.degraded, repr(outcome)
        assert (await limiter.try_acquire("ip:garbled")).allowed
    finally:
        standalone_proxy.on_reply = None
        await limiter.aclose()


async def test_a_lone_call_after_a_flush_loads_the_code_and_charges_once(
    redis_url: str, prefix: str
) -> None:
    """A lone call (nothing else in flight) leaves on a kept connection without the general
    pipeline path; after FUNCTION FLUSH its reply says the function is missing: it ran nothing, so
    the call goes again after a load, and counts once."""
    admin = redis.Redis.from_url(redis_url)
    async with Limiter(redis_url, [Limit(1000, per=3600, precision=60)], prefix=prefix) as limiter:
        try:
            await limiter.try_acquire("ip:lone-flush")
            assert limiter.store._idle  # type: ignore[attr-defined]
            for _ in range(3):
                await admin.function_flush()
                decision = await limiter.try_acquire("ip:lone-flush", weight=2)
                assert decision.allowed and not decision.degraded
            assert (await limiter.peek("ip:lone-flush")).remaining == 1000 - 1 - 3 * 2
        finally:
            await admin.aclose()


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
    async with Limiter(redis_url, [Limit(1000, per=3600, precision=60)], prefix=prefix) as limiter:
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
        async with Limiter(limited, [Limit(3, per=3600, precision=60)], prefix=prefix) as limiter:
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
    async with Limiter(redis_url, [Limit(120, per=3600, precision=60)], prefix=prefix) as limiter:
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


async def test_connections_the_server_closed_between_decisions_are_replaced(
    redis_url: str, prefix: str
) -> None:
    """The store keeps its connections between pipelines (no pool checkout per call). When
    the server closes them meanwhile (CLIENT KILL, a restart, an idle timeout), the next
    decisions take fresh ones: no error, nothing degraded, nothing charged twice. Also when
    the close has not reached this process yet (no pause after the kill): the pipeline that
    meets the closed connection is sent again on a fresh one."""
    admin = redis.Redis.from_url(redis_url)
    async with Limiter(redis_url, [Limit(1000, per=3600, precision=60)], prefix=prefix) as limiter:
        try:
            for pause in (0.05, 0, 0.05, 0, 0):
                first = await asyncio.gather(*(limiter.try_acquire("ip:kept") for _ in range(20)))
                assert limiter.store._idle  # type: ignore[attr-defined]
                killed = await admin.execute_command(
                    "CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"
                )
                assert killed >= 1
                await asyncio.sleep(pause)  # (0: the closes may not have reached us yet)
                alone = await limiter.try_acquire("ip:kept")
                then = await asyncio.gather(*(limiter.try_acquire("ip:kept") for _ in range(20)))
                decisions = [*first, alone, *then]
                assert all(d.allowed and not d.degraded for d in decisions)
            final = await limiter.peek("ip:kept")
            assert final.remaining == 1000 - 5 * 41
        finally:
            await admin.aclose()


async def test_a_users_small_pool_is_never_held_idle_by_the_store(
    redis_url: str, prefix: str
) -> None:
    """A client passed in keeps its connections in its own pool: with a pool of 2 shared with
    the application, the application's own commands and many concurrent decisions all get
    one, during the load and after ``aclose``."""
    pool = redis.BlockingConnectionPool.from_url(redis_url, max_connections=2, timeout=2)
    client = redis.Redis(connection_pool=pool)
    try:
        async with Limiter(client, [Limit(1000, per=3600)], prefix=prefix) as limiter:
            for _ in range(3):
                decisions = await asyncio.gather(
                    *(limiter.try_acquire(f"ip:{i % 7}") for i in range(60)),
                    *(client.ping() for _ in range(10)),
                )
                assert all(decisions)
                assert not limiter.store._idle  # type: ignore[attr-defined]
        first, second = await pool.get_connection(), await pool.get_connection()
        await pool.release(first)
        await pool.release(second)
    finally:
        await client.aclose()
        await pool.disconnect()


async def test_a_closed_limiter_gives_its_kept_connections_back(
    redis_url: str, prefix: str
) -> None:
    """A limiter that made its client keeps a few connections between pipelines and closes
    them all at ``aclose``: the server sees none of its connections afterwards."""
    admin = redis.Redis.from_url(redis_url)
    name = f"aiolimit-{prefix}"
    try:
        limiter = Limiter(redis_url, [Limit(1000, per=3600)], prefix=prefix)
        async with limiter:
            await limiter.store.client.client_setname(name)  # type: ignore[attr-defined]
            await asyncio.gather(*(limiter.try_acquire(f"ip:{i}") for i in range(40)))
            assert limiter.store._idle  # type: ignore[attr-defined]
        await asyncio.sleep(0.05)
        clients = await admin.client_list()
        assert not [c for c in clients if c.get("name") == name]
    finally:
        await admin.aclose()


@pytest.mark.parametrize("protocol", [2, 3])
@pytest.mark.parametrize("parser", ["hiredis", "python"])
async def test_replies_are_read_exactly_with_either_parser_and_protocol(
    redis_url: str, prefix: str, protocol: int, parser: str
) -> None:
    """A client passed in may speak RESP2 or RESP3, with hiredis or redis-py's own parser:
    pipelined replies are read in order either way (error replies included: a flush
    makes the next calls come back NOSCRIPT / function not found, and they are run again)."""
    from redis._parsers import _AsyncHiredisParser, _AsyncRESP2Parser, _AsyncRESP3Parser

    parser_class = {
        "hiredis": _AsyncHiredisParser,
        "python": _AsyncRESP2Parser if protocol == 2 else _AsyncRESP3Parser,
    }[parser]
    client = redis.Redis.from_url(redis_url, protocol=protocol, parser_class=parser_class)
    admin = redis.Redis.from_url(redis_url)
    try:
        async with Limiter(client, [Limit(50, per=3600, precision=60)], prefix=prefix) as limiter:
            first = await asyncio.gather(*(limiter.try_acquire("ip:p") for _ in range(30)))
            await admin.function_flush()
            await admin.script_flush()
            then = await asyncio.gather(*(limiter.try_acquire("ip:p") for _ in range(30)))
            assert all(d.allowed for d in first)
            # (the two pipelines of the second batch may run in either order after the reload)
            assert sum(d.allowed for d in then) == 20
            assert not any(d.degraded for d in (*first, *then))
            assert (await limiter.peek("ip:p")).remaining == 0
    finally:
        await client.aclose()
        await admin.aclose()


# --- the written-out lone path (``RedisStore._run_direct``): its connection stays in step ----

LONE = "ip:203.0.113.7"


async def test_lone_calls_cancelled_once_sent_leave_no_reply_for_the_next(
    standalone_proxy: Proxy, redis_url: str, prefix: str
) -> None:
    """Lone calls cancelled the moment their FCALL passes the proxy, or while their reply is
    late: the lone call right after reads its own reply (weight 7 on another identifier:
    its ``remaining`` could not be the cancelled call's), and what is stored converges to
    what was admitted."""
    limiter = Limiter(standalone_proxy.url, [ROOMY], prefix=prefix, deadline=1.0)
    current: list[asyncio.Future[Any]] = []

    def cancel(link: Link, data: bytes) -> None:
        if script_calls(data):
            for call in current:
                call.cancel()

    admitted = cancelled = 0
    try:
        await limiter.peek(LONE)
        for round_ in range(30):
            standalone_proxy.on_request = cancel if round_ % 3 == 0 else None
            standalone_proxy.delay = 0.01 if round_ % 3 == 1 else 0.0
            current[:] = [asyncio.ensure_future(limiter.try_acquire(LONE))]
            if round_ % 3 == 1:
                await asyncio.sleep(0.005)
                current[0].cancel()
            outcome = (await asyncio.gather(*current, return_exceptions=True))[0]
            admitted += told_admitted(outcome)
            cancelled += isinstance(outcome, asyncio.CancelledError)
            standalone_proxy.on_request = None
            standalone_proxy.delay = 0.0
            other = await limiter.try_acquire(f"{LONE}-other", 7)
            assert other.allowed and other.remaining == ROOMY.amount - 7 * (round_ + 1), other
    finally:
        standalone_proxy.on_request = None
        standalone_proxy.delay = 0.0
        await limiter.aclose()
    assert cancelled > 0
    converged, stored = await settle(lambda: charged(redis_url, prefix, LONE), admitted)
    assert converged, f"stored {stored} for {admitted} admitted ({cancelled} cancelled)"


async def test_an_error_reply_on_the_lone_path_keeps_the_connection_in_step(
    redis_url: str, prefix: str
) -> None:
    """WRONGTYPE (the main key holds a list) is a ``BackendError``; the lone calls after it,
    on another identifier, get their own replies and are charged once."""
    admin = redis.Redis.from_url(redis_url)
    limiter = Limiter(redis_url, [ROOMY], prefix=prefix, deadline=1.0)
    try:
        assert (await limiter.try_acquire("ip:1")).allowed
        for key in limiter.storage_keys("ip:bad"):
            await admin.rpush(key, "x")  # type: ignore[misc]
        for i in range(5):
            with pytest.raises(BackendError, match="WRONGTYPE"):
                await limiter.try_acquire("ip:bad")
            decision = await limiter.try_acquire("ip:1")
            assert decision.allowed and decision.remaining == ROOMY.amount - 2 - i
        assert await charged(redis_url, prefix, "ip:1") == 6
    finally:
        await limiter.aclose()
        await admin.aclose()


async def test_lone_calls_and_bursts_interleaved_over_resp3_count_exactly(
    redis_url: str, prefix: str
) -> None:
    """``protocol=3``: lone calls (the written-out path) between bursts (pipelines)."""
    limiter = Limiter(redis_url + "?protocol=3", [ROOMY], prefix=prefix, deadline=2.0)
    admitted = 0
    try:
        for round_ in range(20):
            admitted += told_admitted(await limiter.try_acquire(LONE))
            burst = await asyncio.gather(*(limiter.try_acquire(LONE) for _ in range(round_)))
            admitted += sum(map(told_admitted, burst))
            admitted += told_admitted(await limiter.try_acquire(LONE))
        assert admitted == 20 * 2 + sum(range(20))
    finally:
        await limiter.aclose()
    assert await charged(redis_url, prefix, LONE) == admitted
