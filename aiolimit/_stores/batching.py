"""Script calls made in one event-loop tick leave together.

Under load many decisions run at once. Sending each call on its own costs a write, a read and
a task per call; collecting the calls of one tick (the first call schedules the flush with
``loop.call_soon``) and sending them as pipelines cuts that work by the number of calls in the
tick. A lone call still leaves at the next tick. Both Redis stores use this batcher: the
standalone store sends a tick as one pipeline, the cluster store as one pipeline per node.

A pipeline carries no MULTI: each script stays atomic on its own, and an error answers that
command only. Each call keeps its own deadline and its own outcome. A call whose caller gave
up before the flush (deadline, cancellation) is not sent at all.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from aiolimit._stores.base import Arg, Result


@dataclass(slots=True)
class Pending:
    """A call waiting for its tick's pipeline."""

    keys: Sequence[str]
    args: Sequence[Arg]
    #: Absolute ``time.monotonic()`` after which nobody waits for the reply (0: no deadline
    #: of its own; the decision's timeout bounds the wait).
    deadline: float
    #: Always gets a result, never an exception: an error is the result (nobody may be left
    #: to retrieve it).
    future: asyncio.Future[Result]
    #: The deadline watch of the flush that took this call, if its calls have deadlines.
    watch: _Watch | None = None

    def resolve(self, result: Result) -> None:
        if not self.future.done():
            self.future.set_result(result)
        watch, self.watch = self.watch, None
        if watch is not None:
            watch.answered()


class _Watch:
    """One timer for the calls of one flush: at the earliest deadline among those still
    unanswered, each call past its deadline gets a ``TimeoutError`` (a reply arriving later
    is dropped), then the timer is set for the next. Cancelled once every call is answered.

    One timer per flush instead of one per waiting caller: under load a flush carries tens
    of calls, and a timer costs a heap push, a cancellation and a context manager.
    """

    __slots__ = ("_calls", "_handle", "_left")

    def __init__(self, calls: list[Pending]) -> None:
        self._calls = calls
        self._left = len(calls)
        self._handle: asyncio.TimerHandle | None = None
        for call in calls:
            call.watch = self
        self._arm()

    def _arm(self) -> None:
        earliest = min(call.deadline for call in self._calls if call.watch is self)
        self._handle = asyncio.get_running_loop().call_at(loop_time(earliest), self._expire)

    def answered(self) -> None:
        self._left -= 1
        if self._left == 0 and self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _expire(self) -> None:
        self._handle = None
        now = time.monotonic()
        for call in self._calls:
            if call.watch is self and call.deadline <= now:
                call.resolve(TimeoutError("no reply by the call's deadline"))
        if self._left > 0:
            self._arm()


def loop_time(deadline: float) -> float:
    """A ``time.monotonic()`` deadline on the running loop's clock (asyncio.timeout_at)."""
    return asyncio.get_running_loop().time() + (deadline - time.monotonic())


#: Sends one tick's calls; must resolve every one of them.
SendTick = Callable[[list[Pending]], Awaitable[None]]
#: Sends one tick's calls at once, from the tick's callback, if it can: then True, and it
#: must resolve every one of them (now or when their replies come); else False, having
#: done nothing, and ``SendTick`` sends them in a task.
SendNow = Callable[[list[Pending]], bool]


#: A tick's calls are split in two pipelines or more once each half has this many calls.
MIN_SPLIT = 8
#: Seconds ``aclose`` waits for pipelines in flight before it cuts them short.
CLOSE_GRACE = 2.0


class TickBatcher:
    """Hands the calls submitted in one tick to ``send``, in chunks of at most ``max_batch``."""

    def __init__(
        self,
        send: SendTick,
        max_batch: int = 32,
        *,
        split: bool = True,
        send_now: SendNow | None = None,
    ) -> None:
        self._send = send
        self._send_now = send_now
        self.max_batch = max_batch
        self._split = split
        self._queue: list[Pending] = []
        self._sending: set[asyncio.Task[None]] = set()

    def submit(
        self, keys: Sequence[str], args: Sequence[Arg], deadline: float
    ) -> asyncio.Future[Result]:
        """Queues a call for this tick; the future's result is a reply or an error.

        Cancel the future to give up: a call not sent yet is then dropped.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Result] = loop.create_future()
        if not self._queue:
            loop.call_soon(self._flush)
        self._queue.append(Pending(keys, args, deadline, future))
        return future

    @property
    def idle(self) -> bool:
        """Nothing queued and nothing in flight."""
        return not self._queue and not self._sending

    def spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        """Runs part of a send as a task of its own, awaited by ``aclose``."""
        task = asyncio.ensure_future(coroutine)
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    def _flush(self) -> None:
        queue, self._queue = self._queue, []
        calls = [call for call in queue if not call.future.done()]  # (done: its caller gave up)
        if calls and calls[0].deadline > 0:
            now = time.monotonic()
            late = [call for call in calls if call.deadline <= now]
            if late:  # out of time before it could leave: not sent
                for call in late:
                    call.resolve(TimeoutError("no time left to send the call"))
                calls = [call for call in calls if call.deadline > now]
            if calls:
                _Watch(calls)
        # At least two pipelines when there are enough calls: the server runs the first while
        # the client packs the next and reads the replies, instead of each waiting in turn.
        size = self.max_batch
        if self._split:
            size = min(size, max(MIN_SPLIT, -(-len(calls) // 2)))
        send_now = self._send_now
        for start in range(0, len(calls), size):
            chunk = calls[start : start + size]
            if send_now is None or not send_now(chunk):
                self.spawn(self._send_all(chunk))

    async def _send_all(self, calls: list[Pending]) -> None:
        try:
            await self._send(calls)
        except BaseException as error:  # a bug or a cancellation: nobody may be left waiting
            failure = error if isinstance(error, Exception) else TimeoutError("cut short")
            for call in calls:
                call.resolve(failure)
            if not isinstance(error, Exception):
                raise

    async def aclose(self, grace: float = CLOSE_GRACE) -> None:
        """Sends what is queued and waits for the pipelines in flight, ``grace`` seconds at
        most: then the ones a silent server never answered are cut short (their calls fail
        with ``TimeoutError``; what the server does with them later is the ops' business)."""
        if self._queue:
            self._flush()
        deadline = asyncio.get_running_loop().time() + grace
        while self._sending:  # a send may spawn more while it is awaited
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                break
            await asyncio.wait(list(self._sending), timeout=left)
        stuck = list(self._sending)
        for task in stuck:
            task.cancel()
        if stuck:
            await asyncio.gather(*stuck, return_exceptions=True)


async def wait_results(futures: Sequence[asyncio.Future[Result]]) -> list[Result]:
    """Each call's result: a reply, or the error that answered it (for a call with a deadline,
    a ``TimeoutError`` once the deadline passed without a reply: see ``_Watch``).

    A cancellation of the caller cancels the futures (so queued calls are dropped; a pipeline
    already sent goes on for the other calls in it) and is raised.
    """
    try:
        return [await future for future in futures]
    except BaseException:
        for future in futures:
            future.cancel()
        raise
