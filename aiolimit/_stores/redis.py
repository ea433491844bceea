"""The standalone Redis store (redis-py asyncio; hiredis parses replies when installed)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from aiolimit._calls import decide_library, decide_script
from aiolimit._clock import Clock, ServerClock
from aiolimit._connection import (
    client_address,
    is_noscript,
    lacks_functions,
    map_errors,
    mapped,
    messages,
)
from aiolimit._stores.base import Arg, Result, ScriptCall, Store
from aiolimit._stores.batching import Pending, TickBatcher
from aiolimit._stores.resp import command_head, pack_call, pack_calls, read_replies


class RedisStore(Store):
    """Runs the decision code on one Redis server: FCALL of aiolimit's FUNCTION library where
    the server has FUNCTION (Redis 7+, Valkey), else EVALSHA; loaded again when missing.

    Concurrent decisions are pipelined (``batching.py``): calls made in the same event-loop
    tick leave in one pipeline. One write and one read for many decisions cut the client's
    work per decision by more than half under load. A call made while nothing else is in
    flight leaves at once from its caller's task, with no tick to wait for: a lone caller
    pays no batching delay.

    Calls are packed as RESP here (``resp.py``) and written on a connection from the
    client's pool, one write per pipeline; hiredis parses the replies. redis-py keeps what it
    is good at: the pool, connecting, AUTH, TLS, health checks. (Its per-command retry is
    bypassed on purpose: a resent script call after a lost reply could charge twice.)
    """

    #: Calls per pipeline at most; a larger tick is split into several pipelines in flight.
    MAX_BATCH = 32

    def __init__(self, client: Redis, *, owns_client: bool, address: str | None = None) -> None:
        self.client = client
        self._owns = owns_client
        self._script = decide_script()
        self.address = address or client_address(client)
        self._batcher = TickBatcher(self._send_tick, self.MAX_BATCH)
        self._library = decide_library()
        # How calls are made, chosen at the first call: FCALL of the library's function where
        # the server has FUNCTION (Redis 7+, Valkey), else EVALSHA of the script.
        self._words: tuple[str, str] | None = None
        self._head = b""
        # A client pinned to one connection (single_connection_client=True) goes through
        # redis-py's own command path, which serialises the use of that connection.
        self._raw = getattr(client, "connection", None) is None and not getattr(
            client, "single_connection_client", False
        )
        self._direct_in_flight = 0

    async def run(self, calls: Sequence[ScriptCall]) -> list[Result]:
        if len(calls) == 1 and self._direct_in_flight == 0 and self._batcher.idle:
            # Nothing else in flight: no batch can form, so leave now.
            self._direct_in_flight += 1
            try:
                return await self._execute(calls)
            finally:
                self._direct_in_flight -= 1
        # The decision's own timeout bounds the wait; a call still queued when it fires is
        # dropped, one already sent is not waited for.
        submit = self._batcher.submit
        futures = [submit(call.keys, call.args, 0.0) for call in calls]
        try:
            return [await future for future in futures]
        except BaseException:
            for future in futures:
                future.cancel()
            raise

    async def _send_tick(self, calls: list[Pending]) -> None:
        for call, result in zip(calls, await self._execute(calls), strict=True):
            call.resolve(result)

    async def _execute(self, calls: Sequence[ScriptCall]) -> list[Result]:
        """Every call's reply or error (mapped); a cancellation is raised."""
        try:
            if self._words is None:
                await self._load()
            results = await self._pipeline(calls)
            missing = [i for i, result in enumerate(results) if is_noscript(result)]
            if missing:
                # After a flush, a restart or a failover: load it and run those calls again.
                # A call refused for a missing script or function ran nothing, so none is
                # charged twice.
                await self._load()
                again = await self._pipeline([calls[i] for i in missing])
                for i, result in zip(missing, again, strict=True):
                    results[i] = result
        except Exception as error:  # the connection failed: every call in it did
            failure = mapped(error, self.address)
            return [failure for _ in calls]
        return [
            mapped(result, self.address) if isinstance(result, BaseException) else result
            for result in results
        ]

    async def _load(self) -> None:
        """Loads the library (or, where FUNCTION is missing, the script) and sets how calls
        are made. Loading again what is there already is harmless."""
        client = self.client
        if self._words != ("EVALSHA", self._script.sha):
            try:
                await client.execute_command(  # type: ignore[no-untyped-call]
                    "FUNCTION", "LOAD", self._library.code
                )
            except ResponseError as error:
                if lacks_functions(error):
                    self._words = None  # the script below, from now on
                elif "already exists" not in str(error):
                    raise
                else:
                    self._use("FCALL", self._library.function)
                    return
            else:
                self._use("FCALL", self._library.function)
                return
        await client.script_load(self._script.source)
        self._use("EVALSHA", self._script.sha)

    def _use(self, command: str, name: str) -> None:
        self._words = (command, name)
        self._head = command_head(command, name)

    async def _pipeline(self, calls: Sequence[ScriptCall]) -> list[Any]:
        if self._raw:
            return await self._pipeline_raw(calls)
        assert self._words is not None
        if len(calls) == 1:
            call = calls[0]
            try:
                reply = await self.client.execute_command(  # type: ignore[no-untyped-call]
                    *self._words, len(call.keys), *call.keys, *call.args
                )
            except ResponseError as error:
                return [error]
            return [reply]
        pipe = self.client.pipeline(transaction=False)
        for call in calls:
            pipe.execute_command(*self._words, len(call.keys), *call.keys, *call.args)
        return list(await pipe.execute(raise_on_error=False))

    async def _pipeline_raw(self, calls: Sequence[ScriptCall]) -> list[Any]:
        """One write of every call, then their replies in order, on one pooled connection."""
        pool = self.client.connection_pool
        connection = await pool.get_connection()  # type: ignore[no-untyped-call]
        try:
            if len(calls) == 1:
                call = calls[0]
                packed = pack_call(self._head, 2, call.keys, call.args)
            else:
                packed = pack_calls(self._head, 2, calls)

            async def attempt() -> list[Any]:
                await connection.send_packed_command(packed)
                return await read_replies(connection, len(calls))

            async def failed(error: Exception) -> None:
                await connection.disconnect()

            # The client's own retry policy, as redis-py would apply it: none for a client
            # aiolimit made; for one passed in, the store reports `retries_calls` and the
            # protocol gives every charging call an op id, so a resent call applies once.
            retry = connection.retry
            if retry is None:
                return await attempt()
            result: list[Any] = await retry.call_with_retry(attempt, failed)
            return result
        except BaseException:
            # Replies may still be on their way: the connection cannot be reused.
            await connection.disconnect(nowait=True)
            raise
        finally:
            await pool.release(connection)

    async def delete(self, keys: Sequence[str]) -> None:
        with map_errors(self.address):
            if keys:
                await self.client.unlink(*keys)  # a large log is freed off Redis' main thread

    def default_clock(self) -> Clock:
        return ServerClock()

    async def aclose(self) -> None:
        await self._batcher.aclose()
        if self._owns:
            await self.client.aclose()

    async def command(self, *args: Arg) -> Any:
        with map_errors(self.address):
            return await self.client.execute_command(*args)  # type: ignore[no-untyped-call]

    async def subscribe(self, channel: str) -> AsyncIterator[bytes]:
        async for message in messages(self.client, channel, self.address):
            yield message
