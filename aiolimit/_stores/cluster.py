"""The Redis Cluster store: one script call per slot, pipelined per node, nodes in parallel.

Built on redis-py's asyncio ``RedisCluster``. When aiolimit builds the client itself it turns
off what is unsafe for a counter (see ../shared/FACTS.md): ``reinitialize_steps=0`` (every
n-th MOVED would otherwise close connections with commands in flight), and redis-py's own
retries (they ignore the backoff and burn out in milliseconds against a dead node). aiolimit
retries instead (``_retry.py``), with backoff, within the decision's deadline. That is safe
because ``retries_calls`` is true: the protocol gives every charging call an operation id and
the script applies an op once, so a call resent after a lost reply never charges twice.

The calls of every decision made in the same event-loop tick (``run_many``, and ``run``, a batch
of one) leave together (``batching.py``): grouped by the node that owns their slot in the
client's slot cache, one pipeline per node, all nodes concurrently. Each call keeps its own
deadline and its own retries; an error on one command of a pipeline concerns that call only.
A command that comes back NOSCRIPT (after SCRIPT FLUSH, a restart or a failover: a promoted
replica has no scripts) is sent again as EVAL, which also caches the script on that node;
redirections (MOVED, ASK, TRYAGAIN) are resent at once through the cluster client, which
follows them and updates its slot cache; other retryable errors are resent after a backoff.

Every attempt runs under the decision's deadline (less a small margin, so that a commit that
cannot finish fails with ``BackendUnavailable`` and is compensated, rather than being cancelled
by the limiter's timeout). Compensation (``undo``) runs as a task of its own with a budget of
its own, so a decision cancelled at its deadline still leaves no charges behind.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any
from urllib.parse import urlsplit

import anyio
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.exceptions import AskError, NoScriptError, TryAgainError

from aiolimit._clock import Clock, ServerClock
from aiolimit._errors import ConfigurationError
from aiolimit._retry import (
    RetryStatistics,
    call_with_retries,
    check_deadline_seconds,
    current_deadline,
    is_retryable,
)
from aiolimit._scripts import decide_script
from aiolimit._stores.base import Arg, Reply, Store, translate_errors
from aiolimit._stores.batching import TickBatcher, loop_time
from aiolimit._wire import UNDO

#: Seconds a store call may take, retries included, when no decision deadline is set.
DEFAULT_DEADLINE = 5.0
#: Seconds before the decision's deadline at which the store gives up (at most a tenth of it).
DEADLINE_MARGIN = 0.05


@lru_cache(maxsize=65536)
def _slot(key: str) -> int:
    return key_slot(key.encode("utf-8"))


def client_from_url(url: str, socket_timeout: float) -> RedisCluster:
    """A cluster client with aiolimit's settings from ``redis+cluster://`` / ``rediss+cluster://``."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("redis+cluster", "rediss+cluster"):
        raise ConfigurationError(f"not a cluster URL: {url!r}")
    if parts.path not in ("", "/", "/0"):
        raise ConfigurationError(f"Redis Cluster has only database 0, got path {parts.path!r}")
    if not parts.hostname:
        raise ConfigurationError(f"a cluster URL needs a seed host:port, got {url!r}")
    seed = parts._replace(scheme=scheme.removesuffix("+cluster"), path="").geturl()
    try:
        return RedisCluster.from_url(
            seed,
            reinitialize_steps=0,
            retry=Retry(NoBackoff(), 0),
            # Every attempt runs under the decision's deadline (asyncio.timeout), so reads and
            # writes need no timeout of their own, which redis-py implements with a task per
            # command (asyncio.wait_for).
            socket_timeout=None,
            socket_connect_timeout=socket_timeout,
            health_check_interval=0,
        )
    except ValueError as exc:
        raise ConfigurationError(f"invalid cluster URL {url!r}: {exc}") from exc


async def close_client(client: RedisCluster) -> None:
    """Closes every connection of a cluster client.

    ``RedisCluster.aclose`` does nothing while the client is marked for re-initialisation,
    which any connection error does; its nodes' connections would then stay open.
    """
    await client.aclose()
    await client.nodes_manager.aclose()
    await client.nodes_manager.aclose("startup_nodes")


@dataclass(slots=True)
class ClusterStoreStatistics:
    """Counters of one cluster store (this process only)."""

    #: Script calls asked for (one per slot per phase).
    calls: int = 0
    #: Requests sent and answered: a pipeline to one node, a single command or a resend.
    round_trips: int = 0
    #: Commands sent again as EVAL because the node had lost the script.
    noscript: int = 0
    #: Calls resent after a retryable error, and calls given up at the deadline.
    retries: int = 0
    gave_up: int = 0
    #: Commands answered MOVED, ASK or TRYAGAIN in a pipeline, then resent through the client.
    redirects: int = 0


class ClusterStore(Store):
    """Runs the decision script on a Redis Cluster; ``deadline`` bounds each call's retries."""

    retries_calls = True
    single_slot = False

    def __init__(
        self,
        client: RedisCluster,
        *,
        owns_client: bool,
        address: str | None = None,
        deadline: float = DEFAULT_DEADLINE,
    ) -> None:
        if not isinstance(client, RedisCluster):
            raise ConfigurationError(
                f"ClusterStore needs a redis.asyncio.cluster.RedisCluster, got {client!r}"
            )
        self.client = client
        self._owns = owns_client
        self._script = decide_script()
        self.deadline = check_deadline_seconds(deadline)
        if address is None:
            seed = client.startup_nodes[0] if client.startup_nodes else None
            address = f"redis+cluster://{seed.host}:{seed.port}" if seed else "redis+cluster://?"
        self.address = address
        self._retry = RetryStatistics()
        self._compensating: set[asyncio.Future[list[Reply | BaseException]]] = set()
        self._stats = ClusterStoreStatistics()
        self._batcher = TickBatcher(client, self._script.sha)

    @classmethod
    def from_url(
        cls, url: str, *, socket_timeout: float = 2.0, deadline: float = DEFAULT_DEADLINE
    ) -> ClusterStore:
        client = client_from_url(url, socket_timeout)
        return cls(client, owns_client=True, address=_redact(url), deadline=deadline)

    def statistics(self) -> ClusterStoreStatistics:
        stats = self._stats
        stats.retries, stats.gave_up = self._retry.retries, self._retry.gave_up
        return replace(stats, round_trips=stats.round_trips + self._batcher.round_trips)

    def slot(self, key: str) -> int:
        return _slot(key)

    def _deadline_for(self, args: Sequence[Arg]) -> float:
        """The decision's deadline; an undo always gets a budget of its own.

        An undo compensates charges already made: giving up on it because the decision ran
        late would leave them behind, so it may finish after the decision's deadline.
        """
        now = time.monotonic()
        own = now + self.deadline
        if _is_undo(args):
            return own
        shared = current_deadline()
        if shared is None:
            return own
        # Give up a little before the limiter's own timeout fires: a commit that fails with
        # BackendUnavailable is compensated by the protocol; one cancelled by the timeout is
        # not.
        return shared - min(DEADLINE_MARGIN, max(shared - now, 0.0) / 10)

    # --- one call ---------------------------------------------------------------------------

    async def _send(self, command: str, keys: Sequence[str], args: Sequence[Arg]) -> Reply:
        body = self._script.sha if command == "EVALSHA" else self._script.source
        self._stats.round_trips += 1
        reply: Reply = await self.client.execute_command(command, body, len(keys), *keys, *args)
        return reply

    async def _eval(self, keys: Sequence[str], args: Sequence[Arg]) -> Reply:
        try:
            return await self._send("EVALSHA", keys, args)
        except NoScriptError:
            # The failed EVALSHA ran nothing. EVAL runs it and caches it on whichever node
            # answers, the slot's owner or, during a migration, the importing node.
            self._stats.noscript += 1
            return await self._send("EVAL", keys, args)

    async def run(self, keys: Sequence[str], args: Sequence[Arg]) -> Reply:
        (result,) = await self.run_many([(keys, args)])
        if isinstance(result, BaseException):
            raise result
        return result

    # --- several calls ----------------------------------------------------------------------

    async def run_many(
        self, calls: Sequence[tuple[Sequence[str], Sequence[Arg]]]
    ) -> list[Reply | BaseException]:
        if not calls:
            return []
        if any(_is_undo(args) for _, args in calls):
            # Compensation must finish even if the decision is cancelled (its deadline) while
            # it runs: it runs as a task of its own, with a budget of its own (_deadline_for),
            # which a cancellation of the caller does not reach. (An anyio shield would not
            # stop asyncio.timeout, which cancels the task natively.)
            task = asyncio.ensure_future(self._run_many(calls))
            self._compensating.add(task)
            task.add_done_callback(self._compensating.discard)
            return await asyncio.shield(task)
        return await self._run_many(calls)

    async def _run_many(
        self, calls: Sequence[tuple[Sequence[str], Sequence[Arg]]]
    ) -> list[Reply | BaseException]:
        self._stats.calls += len(calls)
        deadlines = [self._deadline_for(args) for _, args in calls]
        results = await self._first_attempt(calls, deadlines)

        async def finish(index: int) -> None:
            keys, args = calls[index]
            first = results[index]
            assert isinstance(first, BaseException)
            if isinstance(first, NoScriptError):
                self._stats.noscript += 1
            elif _redirected(first):
                self._stats.redirects += 1

            async def attempt() -> Reply:
                if isinstance(first, NoScriptError):
                    return await self._send("EVAL", keys, args)
                return await self._eval(keys, args)

            try:
                results[index] = await call_with_retries(
                    attempt,
                    deadline=deadlines[index],
                    address=self.address,
                    statistics=self._retry,
                    # A redirection is no failure: follow it at once through the client.
                    failed=first if is_retryable(first) and not _redirected(first) else None,
                )
            except Exception as exc:
                results[index] = exc

        redo = {
            index
            for index, result in enumerate(results)
            if isinstance(result, BaseException) and _resendable(result)
        }
        if redo:
            async with anyio.create_task_group() as group:
                for index in redo:
                    group.start_soon(finish, index)
        for index, result in enumerate(results):
            if isinstance(result, Exception) and index not in redo:
                # Not retryable: translate it like every other store error.
                results[index] = _translated(result, self.address)
        return results

    async def _first_attempt(
        self, calls: Sequence[tuple[Sequence[str], Sequence[Arg]]], deadlines: list[float]
    ) -> list[Reply | BaseException]:
        """One attempt through the tick's pipelines; each reply or its error.

        Only the wait is bounded here: a call whose deadline passes gets a TimeoutError (its
        retry path then gives up with BackendUnavailable), and its pipeline goes on for the
        other calls in it.
        """
        results: list[Reply | BaseException] = []
        futures: list[asyncio.Future[Reply | BaseException]] = []
        try:
            async with asyncio.timeout_at(loop_time(max(deadlines))):
                submit = self._batcher.submit
                futures = [
                    submit(keys, args, deadline)
                    for (keys, args), deadline in zip(calls, deadlines, strict=True)
                ]
                for future in futures:
                    results.append(await future)
        except TimeoutError as exc:  # the deadline: calls not answered in time
            for future in futures[len(results) :]:
                if future.done() and not future.cancelled():
                    results.append(future.result())
                else:
                    future.cancel()  # unanswered; if it is still queued, it is dropped
                    results.append(exc)
            results += [exc] * (len(calls) - len(results))
        except BaseException:  # cancelled: nobody waits for these any more
            for future in futures:
                future.cancel()
            raise
        return results

    # --- the rest ---------------------------------------------------------------------------

    async def delete(self, keys: Sequence[str]) -> None:
        if not keys:
            return

        async def attempt() -> None:
            await self.client.delete(*keys)

        await call_with_retries(
            attempt, deadline=time.monotonic() + self.deadline, address=self.address
        )

    def default_clock(self) -> Clock:
        return ServerClock()

    async def aclose(self) -> None:
        if self._compensating:
            # Let compensation started by cancelled decisions finish (each has its budget).
            await asyncio.wait(list(self._compensating), timeout=self.deadline)
        await self._batcher.aclose()
        if self._owns:
            await close_client(self.client)

    def describe(self) -> dict[str, Any]:
        return {"address": self.address, "deadline": self.deadline}


def _is_undo(args: Sequence[object]) -> bool:
    return bool(args) and args[0] in (UNDO, UNDO.encode())


def _redirected(error: BaseException) -> bool:
    return isinstance(error, (AskError, TryAgainError))  # MovedError is an AskError


def _resendable(error: BaseException) -> bool:
    return isinstance(error, NoScriptError) or is_retryable(error)


def _translated(error: Exception, address: str) -> BaseException:
    try:
        with translate_errors(address):
            raise error
    except Exception as translated:
        return translated


def _redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@")).geturl()
