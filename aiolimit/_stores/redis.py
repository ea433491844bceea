"""The standalone Redis store (redis-py asyncio; hiredis parses replies when installed)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
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
from aiolimit._stores import resp
from aiolimit._stores.base import (
    Arg,
    Result,
    ScriptCall,
    Store,
    clear_unsent,
    mark_unsent,
    was_unsent,
)
from aiolimit._stores.batching import Pending, TickBatcher
from aiolimit._stores.resp import (
    HIREDIS_PARSER,
    command_head,
    from_reader,
    pack_call,
    pack_calls,
    pack_many,
    read_replies,
    spread_many,
)


class RedisStore(Store):
    """Runs the decision code on one Redis server: FCALL of aiolimit's FUNCTION library where
    the server has FUNCTION (Redis 7+, Valkey), else EVALSHA; loaded again when missing.

    Concurrent decisions are pipelined (``batching.py``): calls made in the same event-loop
    tick leave in one pipeline. One write and one read for many decisions cut the client's
    work per decision by more than half under load. Where the server has FUNCTION, a
    pipeline goes as one FCALL of ``decide_many`` (``lua/decide.lua``): one script run that
    decides each call in turn exactly as alone, but reads each main key and TIME once for
    the lot, which cuts the server's time per decision. A call made while nothing else is in
    flight leaves at once from its caller's task, with no tick to wait for: a lone caller
    pays no batching delay.

    Calls are packed as RESP here (``resp.py``) and written on a connection from the
    client's pool, one write per pipeline; hiredis parses the replies. redis-py keeps what it
    is good at: the pool, connecting, AUTH, TLS, health checks. (Its per-command retry is
    bypassed on purpose: a resent script call after a lost reply could charge twice.)
    """

    #: Calls per pipeline at most; a larger tick is split into several pipelines in flight.
    MAX_BATCH = 32
    #: Connections kept between pipelines (the rest go back to the client's pool).
    KEEP_CONNECTIONS = 4

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
        self._many_head = b""  # FCALL of decide_many: a pipeline's calls in one call
        # A client pinned to one connection (single_connection_client=True) goes through
        # redis-py's own command path, which serialises the use of that connection.
        self._raw = getattr(client, "connection", None) is None and not getattr(
            client, "single_connection_client", False
        )
        self._direct_in_flight = 0
        self._idle: list[Any] = []  # connections kept from the pool between pipelines
        self._keep = owns_client  # (see ``_connection``)

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

    def run_one(self, call: ScriptCall) -> Awaitable[Result]:
        # ``run`` for one call, without a coroutine of its own on the batched path: the
        # caller awaits the batcher's future itself (its cancellation cancels the future,
        # which drops the call if it has not left yet).
        if self._direct_in_flight == 0 and self._batcher.idle:
            return self._run_direct(call)
        return self._batcher.submit(call.keys, call.args, 0.0)

    async def _run_direct(self, call: ScriptCall) -> Result:
        self._direct_in_flight += 1
        try:
            connection = self._ready_connection()
            if connection is None:
                return (await self._execute((call,)))[0]
            # A lone call on a kept connection, written out (``_execute`` through
            # ``_pipeline_on`` is about ten coroutines, a third of a lone call's client CPU):
            # one write, one reply. Anything else goes the general way: a connection error
            # (the call is sent again there, which is safe, see ``_pipeline_raw``), or a
            # missing function (it ran nothing).
            try:
                resp.write_now(connection, pack_call(self._head, 2, call.keys, call.args))
                reply = (await from_reader(connection._parser, 1, []))[0]
            except BaseException as error:
                # Replies may still be on their way: the connection cannot be reused.
                await connection.disconnect(nowait=True)
                await self._give_back(connection)
                if not isinstance(error, Exception):
                    raise  # cancelled
                if not isinstance(error, RedisConnectionError):
                    return mapped(error, self.address)  # (what ``_execute`` makes of it)
                result = (await self._execute((call,)))[0]
                if isinstance(result, BaseException):  # (the first write may have gone out)
                    clear_unsent(result)
                return result
            if self._keep and len(self._idle) < self.KEEP_CONNECTIONS:
                self._idle.append(connection)
            else:
                await self._give_back(connection)
            if not isinstance(reply, BaseException):
                return reply  # type: ignore[no-any-return]
            if not is_noscript(reply):
                return mapped(reply, self.address)
            return (await self._execute((call,)))[0]
        finally:
            self._direct_in_flight -= 1

    def _ready_connection(self) -> Any:
        """A kept connection a lone call can use as is (see ``_run_direct``): connected, its
        replies read by redis-py's hiredis parser, nothing waiting on it, no socket timeout
        or retry policy to apply, the library loaded. None: take the general way."""
        idle = self._idle
        if not idle or self._words is None:
            return None
        connection = idle[-1]
        parser: Any = getattr(connection, "_parser", None)
        hiredis = type(parser) is HIREDIS_PARSER
        if (
            not hiredis
            or not getattr(parser, "_connected", False)
            or connection.socket_timeout
            or (connection.retry is not None and connection.retry.get_retries() != 0)
            or not connection.is_connected
            or connection._writer.transport.is_closing()
            or parser._reader.has_data()
            or parser._stream._buffer
            or parser._stream.at_eof()
        ):
            return None
        return idle.pop()

    async def _send_tick(self, calls: list[Pending]) -> None:
        for call, result in zip(calls, await self._execute(calls), strict=True):
            call.resolve(result)

    async def _execute(self, calls: Sequence[ScriptCall]) -> list[Result]:
        """Every call's reply or error (mapped); a cancellation is raised."""
        try:
            if self._words is None:
                try:
                    await self._load()
                except Exception as error:  # (before any of these calls was written)
                    mark_unsent(error)
                    raise
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
            if was_unsent(error):  # (no connection could be made: none of them ran)
                mark_unsent(failure)
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
        self._many_head = command_head("FCALL", self._library.many) if command == "FCALL" else b""

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

    async def _connection(self) -> Any:
        """A connection for one pipeline: one this store kept from an earlier pipeline (it
        was left clean: every reply read), else one from the client's pool.

        The pool's checkout and release (a lock, a condition, a timer, a health probe and
        observability hooks) cost about as much client CPU as a lone decision's own work.
        Only a client aiolimit made keeps connections (``KEEP_CONNECTIONS`` of its pool's
        ``MAX_CONNECTIONS``): a client passed in may have a small pool shared with the
        application, whose other users must not wait for connections held idle here.
        """
        idle = self._idle
        while idle:
            connection = idle.pop()
            # The pool's own check: something to read on an idle connection means the server
            # closed it (or it is out of step); it goes back to the pool, which reconnects it.
            if connection.is_connected and not await connection.can_read():
                return connection
            await self._give_back(connection, disconnect=True)
        return await self.client.connection_pool.get_connection()  # type: ignore[no-untyped-call]

    async def _give_back(self, connection: Any, *, disconnect: bool = False) -> None:
        if disconnect:
            await connection.disconnect(nowait=True)
        with contextlib.suppress(KeyError, ValueError):  # the pool forgot it (it was reset)
            await self.client.connection_pool.release(connection)

    async def _pipeline_raw(self, calls: Sequence[ScriptCall]) -> list[Any]:
        """One write of every call, then their replies in order, on one connection.

        A connection that the server closed while it was idle (CLIENT KILL, its idle
        timeout, a restart) passes the idle check (ours or the pool's) when the close has
        not reached this process yet: the pipeline then fails before any reply. It is sent
        once more on a connection from the pool. That is safe: every charging call carries an
        op, which the script applies once (a copy replays), and the other calls write nothing.
        """
        count = len(calls)
        many = False
        if count == 1:
            call = calls[0]
            packed = pack_call(self._head, 2, call.keys, call.args)
        elif self._many_head:
            # One FCALL of decide_many: one script run for the whole pipeline, which reads
            # each main key and the server's TIME once (see lua/decide.lua).
            packed = pack_many(self._many_head, calls)
            many = True
            count = 1
        else:
            packed = pack_calls(self._head, 2, calls)
        try:
            connection = await self._connection()
        except Exception as error:  # (nothing written yet: these calls cannot have run)
            mark_unsent(error)
            raise
        replies: list[Any] = []
        try:
            replies = await self._pipeline_on(connection, packed, count, replies)
        except RedisConnectionError:
            if replies:
                raise
            connection = await self.client.connection_pool.get_connection()  # type: ignore[no-untyped-call]
            replies = await self._pipeline_on(connection, packed, count, [])
        return spread_many(replies[0], len(calls)) if many else replies

    async def _pipeline_on(
        self, connection: Any, packed: bytes, count: int, replies: list[Any]
    ) -> list[Any]:
        """Sends ``packed`` on ``connection`` and reads ``count`` replies into ``replies``;
        then keeps the connection or gives it back."""
        clean = False
        try:

            async def attempt() -> list[Any]:
                replies.clear()
                await connection.send_packed_command(packed)
                return await read_replies(connection, count, replies)

            async def failed(error: Exception) -> None:
                await connection.disconnect()

            # The client's own retry policy, as redis-py would apply it: none for a client
            # aiolimit made; for one passed in, the store reports `retries_calls` and the
            # protocol gives every charging call an op id, so a resent call applies once.
            retry = connection.retry
            if retry is None or retry.get_retries() == 0:
                results = await attempt()
            else:
                results = await retry.call_with_retry(attempt, failed)
            clean = True
            return results
        except BaseException:
            # Replies may still be on their way: the connection cannot be reused.
            await connection.disconnect(nowait=True)
            raise
        finally:
            if clean and self._keep and len(self._idle) < self.KEEP_CONNECTIONS:
                self._idle.append(connection)
            else:
                await self._give_back(connection)

    async def delete(self, keys: Sequence[str]) -> None:
        with map_errors(self.address):
            if keys:
                await self.client.unlink(*keys)  # a large log is freed off Redis' main thread

    def default_clock(self) -> Clock:
        return ServerClock()

    async def aclose(self) -> None:
        await self._batcher.aclose()
        self._keep = False
        idle, self._idle = self._idle, []
        for connection in idle:
            await self._give_back(connection)
        if self._owns:
            await self.client.aclose()

    async def command(self, *args: Arg) -> Any:
        with map_errors(self.address):
            return await self.client.execute_command(*args)  # type: ignore[no-untyped-call]

    async def subscribe(self, channel: str) -> AsyncIterator[bytes]:
        async for message in messages(self.client, channel, self.address):
            yield message
