"""Lifecycle and errors as a new user meets them: closing, event loops, messages, URLs."""

from __future__ import annotations

import asyncio
import socket

import pytest
import redis.asyncio as redis_asyncio

import cluster
from aiolimit import (
    AuthorityClock,
    BackendUnavailable,
    ConfigurationError,
    Limit,
    Limiter,
    UsageError,
)
from aiolimit._connection import redact

LIMITS = [Limit(5, per=60)]


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_a_closed_limiter_raises_usage_error(store_url: str, prefix: str) -> None:
    """After aclose() every call raises UsageError (it never reconnects); aclose is idempotent."""
    limiter = Limiter(store_url, LIMITS, prefix=prefix, on_error="open")
    assert (await limiter.try_acquire("ip:1")).allowed
    await limiter.aclose()
    await limiter.aclose()
    for call in (
        limiter.try_acquire("ip:1"),
        limiter.acquire("ip:1"),
        limiter.peek("ip:1"),
        limiter.refund("ip:1"),
        limiter.reset("ip:1"),
    ):
        with pytest.raises(UsageError, match="closed"):
            await call
    assert isinstance(UsageError("x"), RuntimeError)


def test_a_second_event_loop_is_a_usage_error(redis_url: str, prefix: str) -> None:
    """A limiter used on a second event loop raises UsageError, even with on_error='open'."""
    limiter = Limiter(redis_url, LIMITS, prefix=prefix, on_error="open")

    async def first() -> bool:
        allowed = (await limiter.try_acquire("ip:1")).allowed
        await limiter.store.client.connection_pool.disconnect()  # type: ignore[attr-defined]
        return allowed

    async def second() -> None:
        with pytest.raises(UsageError, match="another event loop"):
            await limiter.try_acquire("ip:1")
        assert limiter.statistics().errors == 0  # not a store failure: the policy stays out

    assert asyncio.run(first())
    asyncio.run(second())


def test_memory_store_works_on_any_loop(prefix: str) -> None:
    """memory:// holds no connections: one limiter serves successive event loops."""
    limiter = Limiter("memory://", LIMITS, prefix=prefix)

    async def once() -> bool:
        return (await limiter.try_acquire("ip:1")).allowed

    assert asyncio.run(once()) and asyncio.run(once())


async def test_store_errors_say_why_in_their_message(prefix: str) -> None:
    """A refused connection says so in the BackendUnavailable message itself."""
    url = f"redis://127.0.0.1:{closed_port()}/0"
    async with Limiter(url, LIMITS, prefix=prefix, deadline=2.0) as limiter:
        with pytest.raises(BackendUnavailable) as caught:
            await limiter.try_acquire("ip:1")
    text = str(caught.value)
    assert "refused" in text.lower() or "connecting" in text.lower(), text
    assert "ConnectionError" in text


async def test_a_bad_database_index_is_named(redis_url: str, prefix: str) -> None:
    """'DB index is out of range' reaches the message, not only __cause__."""
    url = redis_url.rsplit("/", 1)[0] + "/999"
    async with Limiter(url, LIMITS, prefix=prefix) as limiter:
        with pytest.raises(Exception, match="DB index is out of range"):
            await limiter.try_acquire("ip:1")


@pytest.mark.cluster
async def test_redis_url_at_a_cluster_node_says_to_use_the_cluster_scheme(
    local_cluster: cluster.Cluster, prefix: str
) -> None:
    """redis:// pointed at a cluster node: a ConfigurationError naming redis+cluster://."""
    node = local_cluster.primaries()[0]
    url = f"redis://127.0.0.1:{node.port}/0"
    async with Limiter(url, LIMITS, prefix=prefix) as limiter:
        with pytest.raises(ConfigurationError, match=r"redis\+cluster://"):
            for index in range(50):  # some identifiers hash to this node's own slots
                await limiter.try_acquire(f"ip:{index}")


@pytest.mark.cluster
async def test_several_cluster_seeds_are_accepted(redis_cluster_url: str, prefix: str) -> None:
    """redis+cluster://dead:port,live:port works while the first seed is down."""
    live = redis_cluster_url.split("://", 1)[1]
    url = f"redis+cluster://127.0.0.1:{closed_port()},{live}"
    async with Limiter(url, LIMITS, prefix=prefix) as limiter:
        assert (await limiter.try_acquire("ip:1")).allowed
        assert "127.0.0.1" in repr(limiter)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:s3cret@127.0.0.1:1/0", "redis://:***@127.0.0.1:1/0"),
        ("redis://user:s3cret@127.0.0.1:1/0", "redis://user:***@127.0.0.1:1/0"),
        ("redis://s3cret@127.0.0.1:1/0", "redis://***@127.0.0.1:1/0"),
        ("redis+cluster://:s3cret@h1:1,h2:2", "redis+cluster://:***@h1:1,h2:2"),
        ("rediss://u:s3cret@h:1", "rediss://u:***@h:1"),
        ("redis://127.0.0.1:1/0", "redis://127.0.0.1:1/0"),
    ],
)
def test_redaction_blanks_every_password(url: str, shown: str) -> None:
    """redact() keeps user, hosts and path, never the password."""
    assert redact(url) == shown


@pytest.mark.parametrize(
    "url",
    [
        "redis://:s3cret@127.0.0.1:1/0",
        "redis://user:s3cret@127.0.0.1:1/0",
        "redis+cluster://:s3cret@127.0.0.1:1,127.0.0.1:2",
    ],
)
async def test_no_public_object_shows_a_password(url: str) -> None:
    """repr() of a Limiter, its store and an AuthorityClock, and their errors, hide passwords."""
    limiter = Limiter(url, LIMITS, deadline=0.3)
    clock = AuthorityClock(url)
    try:
        texts = [repr(limiter), repr(limiter.store.describe()), repr(clock), str(limiter)]
        with pytest.raises(BackendUnavailable) as caught:
            await limiter.try_acquire("ip:1")
        texts.append(str(caught.value))
    finally:
        await limiter.aclose()
        await clock.aclose()
    for text in texts:
        assert "s3cret" not in text, text
        assert "***" in text or "127.0.0.1" in text


async def test_a_password_protected_server_works_and_stays_hidden(
    fresh_standalone: cluster.Standalone, prefix: str
) -> None:
    """With requirepass set, the URL's password authenticates and never shows."""
    admin = redis_asyncio.Redis(host="127.0.0.1", port=fresh_standalone.port)
    await admin.config_set("requirepass", "s3cret")
    await admin.aclose()
    url = f"redis://:s3cret@127.0.0.1:{fresh_standalone.port}/0"
    async with Limiter(url, LIMITS, prefix=prefix) as limiter:
        assert (await limiter.try_acquire("ip:1")).allowed
        assert "s3cret" not in repr(limiter)
    wrong = f"redis://:wrong-s3cret@127.0.0.1:{fresh_standalone.port}/0"
    async with Limiter(wrong, LIMITS, prefix=prefix) as limiter:
        with pytest.raises(Exception) as caught:
            await limiter.try_acquire("ip:1")
        assert "wrong-s3cret" not in str(caught.value)


async def test_aclose_returns_while_the_server_is_frozen(
    fresh_standalone: cluster.Standalone,
) -> None:
    """Degraded decisions left pipelines waiting on a SIGSTOPped server: aclose waited for them
    with no bound (until the server resumed). Now: the undos' grace, then the pipelines'."""
    import time

    from aiolimit._protocol import UNDO_BUDGET
    from aiolimit._stores.batching import CLOSE_GRACE

    fresh_standalone.pause()
    try:
        limiter = Limiter(fresh_standalone.url, {"user": "5/hour"}, deadline=0.2, on_error="open")
        for n in range(3):
            assert (await limiter.try_acquire(f"user:{n}")).degraded
        started = time.monotonic()
        async with asyncio.timeout(UNDO_BUDGET + CLOSE_GRACE + 5):
            await limiter.aclose()
        assert time.monotonic() - started < UNDO_BUDGET + CLOSE_GRACE + 1
    finally:
        fresh_standalone.resume()
