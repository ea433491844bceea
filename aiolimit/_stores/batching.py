"""Script calls made in one event-loop tick leave together: one pipeline per node, in parallel.

Under load many decisions run at once. Sending each decision's calls on their own costs a
write, a read and a task per node per decision; collecting the calls of one tick (the first
call schedules the flush with ``loop.call_soon``, like the standalone store) and sending one
pipeline per node cuts that work by the number of decisions in the tick. A lone call still
leaves at the next tick.

Only the first attempt of a call is batched. Each call keeps its own deadline and its own
outcome: a pipeline carries no MULTI, so each script stays atomic on its own and a MOVED, ASK,
TRYAGAIN or NOSCRIPT answer concerns that command only. The caller (the cluster store) retries
a failed call on its own, through the cluster client, within its own deadline. A call whose
caller gave up before the flush (deadline, cancellation) is not sent at all.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio.cluster import ClusterNode, PipelineCommand, RedisCluster

from aiolimit._stores.base import Arg, Reply

Result = Reply | BaseException


@dataclass(slots=True)
class _Call:
    keys: Sequence[str]
    args: Sequence[Arg]
    #: Absolute ``time.monotonic()`` after which nobody waits for the reply.
    deadline: float
    #: Always gets a result, never an exception: an error is the result (nobody may be left
    #: to retrieve it).
    future: asyncio.Future[Result]


def loop_time(deadline: float) -> float:
    """A ``time.monotonic()`` deadline on the running loop's clock (asyncio.timeout_at)."""
    return asyncio.get_running_loop().time() + (deadline - time.monotonic())


class TickBatcher:
    """Sends the calls submitted in one tick as one EVALSHA pipeline per node."""

    #: Calls per pipeline at most; a larger group is split into several pipelines in flight.
    MAX_BATCH = 128

    def __init__(self, client: RedisCluster, sha: str) -> None:
        self.client = client
        self.sha = sha
        #: Pipelines sent (each one request and its replies).
        self.round_trips = 0
        self._queue: list[_Call] = []
        self._sending: set[asyncio.Task[None]] = set()

    def submit(
        self, keys: Sequence[str], args: Sequence[Arg], deadline: float
    ) -> asyncio.Future[Result]:
        """Queues a call for this tick's pipelines; the future's result is a reply or an error.

        Cancel the future to give up: a call not sent yet is then dropped.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Result] = loop.create_future()
        if not self._queue:
            loop.call_soon(self._flush)
        self._queue.append(_Call(keys, args, deadline, future))
        return future

    def _flush(self) -> None:
        queue, self._queue = self._queue, []
        calls = [call for call in queue if not call.future.done()]  # (done: its caller gave up)
        if calls:
            self._spawn(self._send_tick(calls))

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coroutine)
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send_tick(self, calls: list[_Call]) -> None:
        """Groups the tick's calls by node and sends each group, nodes concurrently."""
        client = self.client
        try:
            # A no-op once the slot map is loaded. Before that (or after a connection error
            # made redis-py drop it), the whole tick waits for one load.
            async with asyncio.timeout_at(loop_time(max(call.deadline for call in calls))):
                await client.initialize()
        except Exception as exc:
            for call in calls:
                if not call.future.done():
                    call.future.set_result(exc)
            return
        by_node: dict[str, tuple[ClusterNode, list[_Call]]] = {}
        for call in calls:
            try:
                node = client.get_node_from_key(call.keys[0])
                if node is None:  # pragma: no cover - only with replica=True
                    raise LookupError(f"no node serves {call.keys[0]!r}")
            except Exception as exc:  # a slot not covered right now: that call's retry path
                if not call.future.done():
                    call.future.set_result(exc)
                continue
            by_node.setdefault(node.name, (node, []))[1].append(call)
        size = self.MAX_BATCH
        groups = [
            (node, group[start : start + size])
            for node, group in by_node.values()
            for start in range(0, len(group), size)
        ]
        for group in groups[1:]:
            self._spawn(self._send(*group))
        if groups:
            await self._send(*groups[0])

    async def _send(self, node: ClusterNode, calls: list[_Call]) -> None:
        """One pipeline to one node, given until the latest deadline among its calls."""
        sha = self.sha
        commands = [
            PipelineCommand(index, "EVALSHA", sha, len(call.keys), *call.keys, *call.args)
            for index, call in enumerate(calls)
        ]
        self.round_trips += 1
        try:
            async with asyncio.timeout_at(loop_time(max(call.deadline for call in calls))):
                await node.execute_pipeline(commands)
        except Exception as exc:  # the connection failed or timed out: calls without a reply
            for command in commands:
                if command.result is None:
                    command.result = exc
        finally:
            for call, command in zip(calls, commands, strict=True):
                if not call.future.done():
                    result = command.result
                    if result is None:  # cut short (cancelled): it may or may not have run
                        result = TimeoutError("the pipeline was cut short")
                    call.future.set_result(result)

    async def aclose(self) -> None:
        """Sends what is queued and waits for every pipeline in flight."""
        if self._queue:
            self._flush()
        while self._sending:  # a tick's task may spawn more while it is awaited
            await asyncio.gather(*self._sending, return_exceptions=True)
