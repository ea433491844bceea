"""A connection to one cluster node kept open for pipelines, with one reader for all of them.

The cluster store's first attempt at each call goes through a link when its node has one
(``ClusterStore._send_now``). A tick's calls for that node are packed and written from the
tick's own callback, with no task, no timeout context and no connection taken from the pool
and given back; the link's reader task takes the replies as hiredis parses them and answers
the pipelines in the order they were written. Per pipeline, that saves the task the send ran
in, redis-py's ``wait_for`` around the write (a task of its own on Python 3.11), two timeout
contexts and the pool's bookkeeping: about a fifth of a cross-slot decision's client CPU.

What a link does not do is left to the store's other paths, which stay as they were: the
library is loaded before a link opens, and a node whose library went missing
(``NOSCRIPT``/"Function not found") is served through ``ClusterStore._send_pipeline`` until it
has it again; every error reply answers its call, which ``ClusterStore.run`` retries through
redis-py's cluster client (redirections, failover, backoff) exactly as before.

A link that fails is closed, never repaired: every pipeline still waiting on it is answered
with the error (a ``ConnectionError``, or a ``TimeoutError`` once a pipeline's deadline has
passed with no reply: the node froze or is overloaded), the connection is dropped (replies
may still be on their way) and given back to the node's pool, and the store opens a new link
later. Those calls may or may not have run: ``run`` retries them as any call whose reply was
lost, and the op ids make a retried charge apply once.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError

from aiolimit._connection import is_noscript
from aiolimit._stores import resp
from aiolimit._stores.batching import Pending, loop_time
from aiolimit._stores.resp import NOT_ENOUGH_DATA, spread_many


class NodeSilent(TimeoutError):
    """A pipeline on a link waited past its deadline with no reply: the node froze, or is
    too slow for the calls' deadlines."""


class NodeLink:
    """One open connection to ``node``: pipelines written by ``send``, answered in order."""

    __slots__ = (
        "_closed_by",
        "_drained",
        "_on_noscript",
        "_parser",
        "_reader",
        "_released",
        "_timer",
        "_timer_at",
        "_transport",
        "_waiting",
        "closed",
        "connection",
        "node",
    )  # fmt: skip

    def __init__(
        self,
        node: Any,
        connection: Any,
        *,
        closed_by: Callable[[NodeLink, BaseException], None],
        on_noscript: Callable[[], None],
    ) -> None:
        self.node = node
        self.connection = connection
        self.closed = False
        self._transport = connection._writer.transport
        self._parser = connection._parser
        #: Pipelines written and not answered yet, oldest first: (calls, batched, deadline).
        self._waiting: collections.deque[tuple[list[Pending], bool, float]] = collections.deque()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._closed_by = closed_by
        self._on_noscript = on_noscript
        self._released = False
        self._drained: asyncio.Future[None] | None = None  # (``drained``)
        self._reader = asyncio.ensure_future(self._read())

    @property
    def usable(self) -> bool:
        return not self.closed and not self._transport.is_closing()

    @property
    def busy(self) -> bool:
        """Pipelines are waiting for their replies."""
        return bool(self._waiting)

    async def drained(self) -> None:
        """Returns once no pipeline waits on this link (answered, or the link failed)."""
        if not self._waiting:
            return
        if self._drained is None:
            self._drained = asyncio.get_running_loop().create_future()
        await asyncio.shield(self._drained)

    def _set_drained(self) -> None:
        drained, self._drained = self._drained, None
        if drained is not None and not drained.done():
            drained.set_result(None)

    def send(self, packed: bytes, calls: list[Pending], batched: bool) -> None:
        """Writes one pipeline: ``calls`` as one ``decide_many``/``decide_node`` call
        (``batched``), or each as a call of its own. They are answered when the replies come,
        or with an error if the link fails first (its deadline: the latest of theirs)."""
        deadline = max(call.deadline for call in calls)
        self._waiting.append((calls, batched, deadline))
        if self._timer is None or deadline < self._timer_at:
            self._arm(deadline)
        try:
            resp.write_now(self.connection, packed)  # (through ``resp``: bench/ counts it)
        except Exception as error:  # (a transport closed under us: the reader may not know)
            self.fail(RedisConnectionError(f"error while writing to {self.node.name}: {error}"))

    def _arm(self, deadline: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = deadline
        self._timer = asyncio.get_running_loop().call_at(loop_time(deadline), self._expire)

    def _expire(self) -> None:
        """At the earliest deadline of the pipelines waiting when it was set: one still
        waiting past its deadline means the node gave no answer in time; else the timer is
        set for the next (answered pipelines never cancel it: that would cost each one)."""
        self._timer = None
        if not self._waiting:
            return
        now = time.monotonic()
        earliest = min(deadline for _, _, deadline in self._waiting)
        if earliest <= now:
            self.fail(NodeSilent(f"{self.node.name} did not answer a pipeline in time"))
        else:
            self._arm(earliest)

    async def _read(self) -> None:
        parser = self._parser
        gets = parser._reader.gets
        push = getattr(parser, "_hiredis_PushNotificationType", None) or ()
        waiting = self._waiting
        replies: list[Any] = []
        try:
            while True:
                reply = gets()
                if reply is NOT_ENOUGH_DATA:
                    try:
                        await parser.read_from_socket()
                    except OSError as error:  # as redis-py reports it
                        raise RedisConnectionError(f"error while reading: {error}") from error
                    continue
                if isinstance(reply, RedisConnectionError):  # e.g. LOADING: not ready
                    raise reply
                if push and isinstance(reply, push):  # RESP3: not a reply
                    await parser.handle_push_response(reply)
                    continue
                if not waiting:
                    raise RedisConnectionError(f"{self.node.name} sent a reply nobody asked for")
                calls, batched, _ = waiting[0]
                replies.append(reply)
                if not batched and len(replies) < len(calls):
                    continue
                waiting.popleft()
                results = spread_many(replies[0], len(calls)) if batched else replies
                replies = []
                self._answer(calls, results)
                if self._drained is not None and not waiting:
                    self._set_drained()
        except asyncio.CancelledError:
            self.fail(TimeoutError("the link was closed"))
            raise
        except Exception as error:
            self.fail(error)

    def _answer(self, calls: list[Pending], results: list[Any]) -> None:
        noscript = False
        for call, result in zip(calls, results, strict=True):
            if isinstance(result, Exception) and not noscript:
                noscript = is_noscript(result)
            call.resolve(result)
        if noscript:  # the node lost the library: the store loads it again first
            self._on_noscript()

    def fail(self, error: BaseException) -> None:
        """Closes the link: every pipeline waiting gets ``error``; the store is told."""
        if self.closed:
            return
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        waiting = list(self._waiting)
        self._waiting.clear()
        for calls, _, _ in waiting:
            for call in calls:
                call.resolve(error)
        self._set_drained()
        if self._reader is not asyncio.current_task():
            self._reader.cancel()
        self._closed_by(self, error)

    async def release(self) -> None:
        """Once closed (``fail``): drops the connection (replies still on their way are lost
        with it) and gives it back to the node's pool, which connects it again when next
        taken. Once only."""
        if self._released:
            return
        self._released = True
        try:
            await self.connection.disconnect(nowait=True)
        finally:
            self.node.release(self.connection)
