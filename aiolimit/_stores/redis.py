"""The standalone Redis store (redis-py asyncio; hiredis parses replies when installed)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, ResponseError

from aiolimit._clock import Clock, ServerClock
from aiolimit._scripts import decide_script
from aiolimit._stores.base import Arg, Reply, Store, translate_errors

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
    """Runs the decision script on one Redis server with EVALSHA, loading it on NOSCRIPT.

    Concurrent decisions are pipelined: calls made in the same event-loop tick leave in one
    pipeline (no MULTI; each script stays atomic on its own). One write and one read for many
    decisions cut the client's work per decision by more than half under load, and a lone
    call still leaves at once, at the next tick.
    """

    #: Calls per pipeline at most; a larger tick is split into several pipelines in flight.
    MAX_BATCH = 128

    def __init__(self, client: Redis, *, owns_client: bool, address: str | None = None) -> None:
        self.client = client
        self._owns = owns_client
        self._script = decide_script()
        kwargs: dict[str, Any] = client.connection_pool.connection_kwargs
        self.address = address or f"redis://{kwargs.get('host', '?')}:{kwargs.get('port', '?')}"
        self._queue: list[tuple[Sequence[str], Sequence[Arg], asyncio.Future[Reply]]] = []
        self._flushing: set[asyncio.Task[None]] = set()

    async def run(self, keys: Sequence[str], args: Sequence[Arg]) -> Reply:
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        if not self._queue:
            asyncio.get_running_loop().call_soon(self._flush)
        self._queue.append((keys, args, future))
        with translate_errors(self.address):
            return await future

    def _flush(self) -> None:
        queue, self._queue = self._queue, []
        for start in range(0, len(queue), self.MAX_BATCH):
            task = asyncio.ensure_future(self._send(queue[start : start + self.MAX_BATCH]))
            self._flushing.add(task)
            task.add_done_callback(self._flushing.discard)

    async def _send(
        self, batch: list[tuple[Sequence[str], Sequence[Arg], asyncio.Future[Reply]]]
    ) -> None:
        try:
            results = await self._pipeline(batch)
            missing = [i for i, result in enumerate(results) if isinstance(result, NoScriptError)]
            if missing:
                # After SCRIPT FLUSH, a restart or a failover: load it and run those calls
                # again. A call refused with NOSCRIPT ran nothing, so none is charged twice.
                await self.client.script_load(self._script.source)
                again = await self._pipeline([batch[i] for i in missing])
                for i, result in zip(missing, again, strict=True):
                    results[i] = result
        except BaseException as error:  # the connection failed: every call in it did
            for _, _, future in batch:
                if not future.done():
                    future.set_exception(error)
            if not isinstance(error, Exception):
                raise
            return
        for (_, _, future), result in zip(batch, results, strict=True):
            if future.done():  # its decision gave up (deadline, cancellation)
                continue
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)

    async def _pipeline(
        self, batch: Sequence[tuple[Sequence[str], Sequence[Arg], asyncio.Future[Reply]]]
    ) -> list[Any]:
        sha = self._script.sha
        if len(batch) == 1:
            keys, args, _ = batch[0]
            try:
                reply = await self.client.execute_command(  # type: ignore[no-untyped-call]
                    "EVALSHA", sha, len(keys), *keys, *args
                )
            except ResponseError as error:
                return [error]
            return [reply]
        pipe = self.client.pipeline(transaction=False)
        for keys, args, _ in batch:
            pipe.execute_command("EVALSHA", sha, len(keys), *keys, *args)
        return list(await pipe.execute(raise_on_error=False))

    async def delete(self, keys: Sequence[str]) -> None:
        with translate_errors(self.address):
            if keys:
                await self.client.delete(*keys)

    def default_clock(self) -> Clock:
        return ServerClock()

    async def aclose(self) -> None:
        if self._flushing:
            await asyncio.gather(*self._flushing, return_exceptions=True)
        if self._owns:
            await self.client.aclose()
