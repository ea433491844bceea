"""The standalone Redis store (redis-py asyncio; hiredis parses replies when installed)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError

from aiolimit._clock import Clock, ServerClock
from aiolimit._scripts import decide_script
from aiolimit._store import Arg, Reply, Store, translate_errors

#: Connections one limiter opens to its server at most (see client_from_url).
MAX_CONNECTIONS = 100


def client_from_url(url: str, socket_timeout: float, *, io_timeout: float | None = -1.0) -> Redis:
    """A client with aiolimit's settings: bounded timeouts, and no silent retries.

    redis-py retries a command whose connection dropped by default; for a script that charges
    a counter that would charge twice when only the reply was lost. Retries are the caller's
    (the limiter's) business, with operation ids.

    redis-py's default pool raises ``MaxConnectionsError`` once 100 commands are in flight; a
    blocking pool makes the 101st concurrent decision wait for a free connection instead
    (at most ``socket_timeout``, and never past the decision's deadline).

    ``io_timeout`` bounds each read and write (default: ``socket_timeout``). The limiter
    passes None when it has a per-decision deadline: that deadline already bounds the call,
    and redis-py's write timeout costs a task per command (``asyncio.wait_for``).
    """
    pool = BlockingConnectionPool.from_url(
        url,
        max_connections=MAX_CONNECTIONS,
        timeout=socket_timeout,
        socket_timeout=socket_timeout if io_timeout == -1.0 else io_timeout,
        socket_connect_timeout=socket_timeout,
        retry=Retry(NoBackoff(), 0),
        health_check_interval=0,
    )
    return Redis.from_pool(pool)


class RedisStore(Store):
    """Runs the decision script on one Redis server with EVALSHA, loading it on NOSCRIPT."""

    def __init__(self, client: Redis, *, owns_client: bool, address: str | None = None) -> None:
        self.client = client
        self._owns = owns_client
        self._script = decide_script()
        kwargs: dict[str, Any] = client.connection_pool.connection_kwargs
        self.address = address or f"redis://{kwargs.get('host', '?')}:{kwargs.get('port', '?')}"

    async def run(self, keys: Sequence[str], args: Sequence[Arg]) -> Reply:
        with translate_errors(self.address):
            try:
                reply: Reply = await self.client.execute_command(  # type: ignore[no-untyped-call]
                    "EVALSHA", self._script.sha, len(keys), *keys, *args
                )
            except NoScriptError:
                # After SCRIPT FLUSH, a restart or a failover: load and run once more. The
                # failed EVALSHA ran nothing, so this cannot charge twice.
                await self.client.script_load(self._script.source)
                reply = await self.client.execute_command(  # type: ignore[no-untyped-call]
                    "EVALSHA", self._script.sha, len(keys), *keys, *args
                )
            return reply

    async def delete(self, keys: Sequence[str]) -> None:
        with translate_errors(self.address):
            if keys:
                await self.client.delete(*keys)

    def default_clock(self) -> Clock:
        return ServerClock()

    async def aclose(self) -> None:
        if self._owns:
            await self.client.aclose()
