"""The standalone Redis store (redis-py asyncio; hiredis parses replies when installed)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from aiolimit._calls import decide_script
from aiolimit._clock import Clock, ServerClock
from aiolimit._connection import client_address, is_noscript, map_errors, mapped
from aiolimit._stores.base import Result, ScriptCall, Store
from aiolimit._stores.batching import Pending, TickBatcher


class RedisStore(Store):
    """Runs the decision script on one Redis server with EVALSHA, loading it on NOSCRIPT.

    Concurrent decisions are pipelined (``batching.py``): calls made in the same event-loop
    tick leave in one pipeline. One write and one read for many decisions cut the client's
    work per decision by more than half under load; a lone call still leaves at once, at the
    next tick.
    """

    #: Calls per pipeline at most; a larger tick is split into several pipelines in flight.
    MAX_BATCH = 128

    def __init__(self, client: Redis, *, owns_client: bool, address: str | None = None) -> None:
        self.client = client
        self._owns = owns_client
        self._script = decide_script()
        self.address = address or client_address(client)
        self._batcher = TickBatcher(self._send_tick, self.MAX_BATCH)

    async def run(self, calls: Sequence[ScriptCall]) -> list[Result]:
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
        try:
            results = await self._pipeline(calls)
            missing = [i for i, result in enumerate(results) if is_noscript(result)]
            if missing:
                # After SCRIPT FLUSH, a restart or a failover: load it and run those calls
                # again. A call refused with NOSCRIPT ran nothing, so none is charged twice.
                await self.client.script_load(self._script.source)
                again = await self._pipeline([calls[i] for i in missing])
                for i, result in zip(missing, again, strict=True):
                    results[i] = result
        except Exception as error:  # the connection failed: every call in it did
            failure = mapped(error, self.address)
            for call in calls:
                call.resolve(failure)
            return
        for call, result in zip(calls, results, strict=True):
            if isinstance(result, BaseException):
                result = mapped(result, self.address)
            call.resolve(result)

    async def _pipeline(self, calls: Sequence[Pending]) -> list[Any]:
        sha = self._script.sha
        if len(calls) == 1:
            call = calls[0]
            try:
                reply = await self.client.execute_command(  # type: ignore[no-untyped-call]
                    "EVALSHA", sha, len(call.keys), *call.keys, *call.args
                )
            except ResponseError as error:
                return [error]
            return [reply]
        pipe = self.client.pipeline(transaction=False)
        for call in calls:
            pipe.execute_command("EVALSHA", sha, len(call.keys), *call.keys, *call.args)
        return list(await pipe.execute(raise_on_error=False))

    async def delete(self, keys: Sequence[str]) -> None:
        with map_errors(self.address):
            if keys:
                await self.client.delete(*keys)

    def default_clock(self) -> Clock:
        return ServerClock()

    async def aclose(self) -> None:
        await self._batcher.aclose()
        if self._owns:
            await self.client.aclose()
