"""The Redis Cluster store: one script call per slot, pipelined per node, nodes in parallel.

Built on redis-py's asyncio ``RedisCluster``. When aiolimit builds the client itself it turns
off what is unsafe for a counter: ``reinitialize_steps=0`` (every n-th MOVED would otherwise
close connections with commands in flight), and redis-py's own retries (they ignore the backoff
and burn out in milliseconds against a dead node). aiolimit retries instead
(``aiolimit._retry``), with backoff, within the decision's deadline. That is safe because
``retries_calls`` is true: the protocol gives every charging call an operation id and the script
applies an op once, so a call resent after a lost reply never charges twice.

The calls of every decision made in the same event-loop tick leave together (``batching.py``):
grouped by the node that owns their slot in the client's slot cache, one pipeline per node, all
nodes concurrently. Each call keeps its own deadline and its own retries; an error on one
command of a pipeline concerns that call only. A command that comes back NOSCRIPT (after SCRIPT
FLUSH, a restart or a failover: a promoted replica has no scripts) is sent again as EVAL, which
also caches the script on that node; redirections (MOVED, ASK, TRYAGAIN) are resent at once
through the cluster client, which follows them and updates its slot cache; other retryable
errors are resent after a backoff.

Every attempt runs under the decision's deadline (less a small margin, so that a commit that
cannot finish fails with ``BackendUnavailable`` and is compensated, rather than being cancelled
by the limiter's timeout). Compensation is the protocol's: it runs undo calls in tasks of its
own with a budget of its own, which this store honours like any other deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot
from redis.exceptions import ResponseError, SlotNotCoveredError

from aiolimit._calls import decide_library, decide_script, resend_args
from aiolimit._clock import Clock, ServerClock
from aiolimit._connection import (
    client_address,
    close_cluster_client,
    cluster_client,
    is_noscript,
    is_redirect,
    is_retryable,
    lacks_functions,
    map_errors,
    mapped,
    messages,
    redact,
)
from aiolimit._deadline import current_deadline
from aiolimit._errors import BackendUnavailable, ConfigurationError
from aiolimit._retry import RetryStatistics, call_with_retries, check_deadline_seconds
from aiolimit._stores.base import Arg, Reply, Result, ScriptCall, Store, mark_unsent, was_unsent
from aiolimit._stores.batching import (
    CLOSE_GRACE,
    Pending,
    TickBatcher,
    loop_time,
    wait_results,
)
from aiolimit._stores.link import NodeLink, NodeSilent
from aiolimit._stores.resp import (
    HIREDIS_PARSER,
    command_head,
    pack_calls,
    pack_many,
    read_replies,
    spread_many,
)

#: Seconds a store call may take, retries included, when no decision deadline is set.
DEFAULT_DEADLINE = 5.0
#: Seconds before the decision's deadline at which the store gives up (at most a tenth of it).
DEADLINE_MARGIN = 0.05
#: Seconds one topology refresh (CLUSTER SLOTS to a startup node) may take. redis-py asks the
#: startup nodes in random order and holds a lock meanwhile: a frozen node would hold up every
#: decision until its deadline. Cut short, the next attempt asks another node. A healthy node
#: answers CLUSTER SLOTS in well under a millisecond; a decision may meet several refreshes
#: while connections are being reset, each of which can draw the frozen node first.
REFRESH_TIMEOUT = 0.05
#: Seconds before a node whose link failed (or could not be opened) gets a new one; its calls
#: go through the node's connection pool meanwhile.
LINK_RETRY = 0.5
#: Connections a node's pool must allow for a link to take one of them for good: the rest
#: serve retries, the slot-map loads and the app's own use of a client it gave in.
LINK_MIN_POOL = 2


#: Connection options a subscriber on one node takes from the cluster client's.
_SUBSCRIBER_OPTIONS = frozenset(
    {"username", "password", "ssl", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile",
     "ssl_cert_reqs", "socket_timeout", "socket_connect_timeout", "decode_responses"}
)  # fmt: skip


def _cut_short() -> TimeoutError:
    return TimeoutError("the pipeline was cut short")


def _unserved(error: BaseException) -> bool:
    """A call of a ``decide_node`` batch (keys not declared) that failed before its first write:
    most often a slot its node does not serve now (a stale slot map, a slot migrating), which
    declared keys would have met as MOVED, ASK or TRYAGAIN at the command's entry. The script
    tags it (``lua/decide.lua``: servers word the underlying error differently); nothing of it
    ran, so it is sent again through the cluster client, which follows the redirections. A
    call that failed after writing is not tagged, and not sent again."""
    return isinstance(error, ResponseError) and str(error).startswith("aiolimit: unserved: ")


@lru_cache(maxsize=65536)
def _slot(key: str) -> int:
    return key_slot(key.encode("utf-8"))


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
    #: Topology refreshes cut short because the startup node asked did not answer in time.
    slow_refreshes: int = 0
    #: Links (a connection kept open to a node, ``link.py``) opened, and closed after a
    #: failure: a connection lost, or a node that gave no answer by a pipeline's deadline.
    links_opened: int = 0
    links_failed: int = 0


class ClusterStore(Store):
    """Runs the decision script on a Redis Cluster; ``deadline`` bounds each call's retries."""

    retries_calls = True
    single_slot = False
    #: Calls per pipeline at most; a larger group is split into several pipelines in flight.
    MAX_BATCH = 128

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
        self._library = decide_library()
        self._evalsha = command_head("EVALSHA", self._script.sha)
        self._fcall = command_head("FCALL", self._library.function)
        self._fcall_many = command_head("FCALL", self._library.many)
        self._fcall_node = command_head("FCALL", self._library.node)
        #: Whether the nodes have FUNCTION (None: not known yet), and which have the library.
        self._functions: bool | None = None
        self._loaded: set[str] = set()
        self.deadline = check_deadline_seconds(deadline)
        self.address = address or client_address(client)
        self._retry = RetryStatistics()
        self._stats = ClusterStoreStatistics()
        self._batcher = TickBatcher(
            self._send_tick, self.MAX_BATCH, split=False, send_now=self._send_now
        )
        #: Open links by node name (``link.py``), links being opened, and when a node whose
        #: link failed may have a new one.
        self._links: dict[str, NodeLink] = {}
        self._opening: dict[str, asyncio.Task[None]] = {}
        self._link_after: dict[str, float] = {}
        self._closing = False
        self._set_up = False  # the client has loaded its command table once
        self._reloading: asyncio.Future[None] | None = None  # (``_suspect_slot_map``)

    @classmethod
    def from_url(
        cls, url: str, *, socket_timeout: float = 2.0, deadline: float = DEFAULT_DEADLINE
    ) -> ClusterStore:
        client = cluster_client(url, socket_timeout)
        return cls(client, owns_client=True, address=redact(url), deadline=deadline)

    def statistics(self) -> ClusterStoreStatistics:
        stats = self._stats
        stats.retries, stats.gave_up = self._retry.retries, self._retry.gave_up
        return replace(stats)

    def slot(self, key: str) -> int:
        return _slot(key)

    def _deadline(self) -> float:
        """The running decision's deadline less a margin, or this store's own budget.

        The margin makes a commit that cannot finish fail with ``BackendUnavailable`` (which
        the protocol compensates) rather than be cancelled by the limiter's own timeout.
        """
        now = time.monotonic()
        shared = current_deadline()
        if shared is None:
            return now + self.deadline
        return shared - min(DEADLINE_MARGIN, max(shared - now, 0.0) / 10)

    # --- one call, retried ------------------------------------------------------------------

    async def _refresh(self, deadline: float) -> None:
        """Loads the slot map if redis-py dropped it. Each try is cut at ``REFRESH_TIMEOUT``
        and the next asks the startup nodes in a new random order, until ``deadline``.

        Once the client is set up (here, or by the app before it gave the client in), only
        the slot map is reloaded (``NodesManager``):
        ``RedisCluster.initialize`` would also ask the first primary for ``COMMAND`` every
        time, and hang there for good while that one node is frozen.
        """
        client = self.client
        while client._initialize:  # (false once the map is loaded: nothing to wait for)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the cluster topology refresh did not finish in time")
            try:
                async with asyncio.timeout(min(REFRESH_TIMEOUT, left)):
                    # (a client given in set up already, by the app's own use, loaded its
                    # command table then: it is set up as well)
                    if self._set_up or client.commands_parser.commands:
                        await client.nodes_manager.initialize()
                        client._initialize = False
                    else:
                        await client.initialize()
                        self._set_up = True
            except TimeoutError:
                self._stats.slow_refreshes += 1

    def _suspect_slot_map(self) -> None:
        """A node gave no answer in time: the slot map is reloaded, in the background.

        A frozen (SIGSTOPped) node accepts TCP and never answers, so redis-py meets no
        connection error and never drops its map by itself: after the node's replica took
        over, every call on its slots would still go to it. One bounded reload per silent
        node costs a CLUSTER SLOTS; while the node is only slow, the map comes back the same.

        No call waits for it: the reload asks the nodes in a random order, the silent one
        too (each try at it cut at ``REFRESH_TIMEOUT``), and calls on healthy nodes, for
        which the map in hand is right, would pay that (fault isolation). Calls on the silent
        node's slots go by the map in hand meanwhile, as they would have before the reload.
        """
        client = self.client
        if not (self._set_up or client.commands_parser.commands):
            client._initialize = True  # (not set up yet: the next call sets it up, waiting)
            return
        if self._reloading is None or self._reloading.done():
            self._reloading = asyncio.ensure_future(self._reload_slot_map())

    async def _reload_slot_map(self) -> None:
        """Reloads the slot map, each try cut at ``REFRESH_TIMEOUT``, within the store's
        budget; a map that cannot be had now stays as it is (the next silence asks again)."""
        nodes = self.client.nodes_manager
        give_up = time.monotonic() + self.deadline
        while time.monotonic() < give_up:
            try:
                async with asyncio.timeout(REFRESH_TIMEOUT):
                    await nodes.initialize()
                return
            except TimeoutError:
                self._stats.slow_refreshes += 1
            except Exception:  # no node answered at all: redis-py's own errors take over
                return

    def fault_domain(self, key: str) -> str:
        """The node that serves ``key``'s slot (per the client's slot map), or "" if unknown."""
        try:
            node = self.client.nodes_manager.get_node_from_slot(_slot(key))
        except Exception:  # no slot map yet, or the slot is not covered right now
            return ""
        return node.name if node is not None else ""

    def fault_domains(self) -> frozenset[str] | None:
        """The primaries in the slot map; None before it is loaded."""
        names = frozenset(node.name for node in self.client.get_primaries())
        return names or None

    async def _send(self, command: str, keys: Sequence[str], args: Sequence[Arg]) -> Reply:
        await self._refresh(self._deadline())
        body = self._script.sha if command == "EVALSHA" else self._script.source
        self._stats.round_trips += 1
        reply: Reply = await self.client.execute_command(command, body, len(keys), *keys, *args)
        return reply

    async def _eval(self, keys: Sequence[str], args: Sequence[Arg]) -> Reply:
        try:
            return await self._send("EVALSHA", keys, args)
        except Exception as error:
            if not is_noscript(error):
                raise
            # The failed EVALSHA ran nothing. EVAL runs it and caches it on whichever node
            # answers, the slot's owner or, during a migration, the importing node.
            self._stats.noscript += 1
            return await self._send("EVAL", keys, args)

    async def _finish(self, call: ScriptCall, first: BaseException, deadline: float) -> Result:
        """Retries a call whose first (pipelined) attempt failed, until ``deadline``."""
        keys = call.keys
        unserved = _unserved(first)
        if is_noscript(first):
            self._stats.noscript += 1
        elif is_redirect(first) or unserved:
            self._stats.redirects += 1

        # Whether any try may have written the call: while none has (each failed at the slot
        # map's load, as the first did, ``_send_tick``), the call cannot have run.
        sent = not was_unsent(first)

        async def attempt() -> Reply:
            nonlocal sent
            # Sent again later (after a backoff, through a failover): judged then, not at the
            # time read before the first attempt (``resend_args``).
            args = resend_args(call)
            try:
                await self._refresh(self._deadline())  # (a no-op once the map is loaded)
                sent = True
                if is_noscript(first):
                    return await self._send("EVAL", keys, args)
                return await self._eval(keys, args)
            except asyncio.CancelledError:  # cut at the deadline (or the caller gave up)
                self._suspect_slot_map()
                raise

        try:
            return await call_with_retries(
                attempt,
                deadline=deadline,
                address=self.address,
                statistics=self._retry,
                # A redirection is no failure: follow it at once through the client.
                failed=first if is_retryable(first) and not is_redirect(first) else None,
            )
        except Exception as exc:
            return exc if sent else mark_unsent(exc)

    # --- several calls ----------------------------------------------------------------------

    async def run(self, calls: Sequence[ScriptCall]) -> list[Result]:
        if not calls:
            return []
        self._stats.calls += len(calls)
        deadline = self._deadline()
        submit = self._batcher.submit
        futures = [submit(call.keys, call.args, deadline) for call in calls]
        results = await wait_results(futures)
        for result in results:
            if isinstance(result, BaseException):
                break
        else:
            return results  # (the common case: every call answered)
        redo = [
            index
            for index, result in enumerate(results)
            if isinstance(result, BaseException)
            and (is_noscript(result) or is_retryable(result) or _unserved(result))
        ]
        if redo:
            retried = await asyncio.gather(
                *(self._finish(calls[i], results[i], deadline) for i in redo)  # type: ignore[arg-type]
            )
            for index, result in zip(redo, retried, strict=True):
                results[index] = result
        for index, result in enumerate(results):
            if isinstance(result, BaseException):
                error = mapped(result, self.address, cluster=True)
                if was_unsent(result):
                    mark_unsent(error)
                error.fault_domain = self.fault_domain(calls[index].keys[0])  # type: ignore[attr-defined]
                results[index] = error
        return results

    def _by_node(self, calls: list[Pending]) -> list[tuple[ClusterNode, list[Pending]]]:
        """A tick's calls grouped by the node that owns their slot in the slot map; a call
        on a slot not covered right now is answered at once (its retry path)."""
        by_node: dict[str, tuple[ClusterNode, list[Pending]]] = {}
        slots = self.client.nodes_manager.slots_cache
        for call in calls:
            # (what ``client.get_node_from_key`` does, with the slot computed once per key)
            owners = slots.get(_slot(call.keys[0]))
            if not owners:  # a slot not covered right now: that call's retry path
                slot = _slot(call.keys[0])
                call.resolve(SlotNotCoveredError(f'Slot "{slot}" is not covered by the cluster.'))
                continue
            node = owners[0]
            known = by_node.get(node.name)
            if known is None:
                by_node[node.name] = (node, [call])
            else:
                known[1].append(call)
        return list(by_node.values())

    def _send_now(self, calls: list[Pending]) -> bool:
        """Sends a tick's calls from the tick's callback, once the slot map is loaded: on
        their node's link where it has one (``link.py``), else in a task through the node's
        pool (``_send_pipeline``), which also loads the library where it is missing; a link is
        then opened for the next ticks. False (nothing done) before the map is loaded: the
        tick then goes as a task that loads it (``_send_tick``).

        It runs in the tick's callback, where an error would reach nobody: an unexpected one
        answers the calls not sent yet at once, as a failed send task does."""
        if self.client._initialize or self._closing:
            return False
        try:
            groups = self._by_node(calls)
        except Exception as error:
            for call in calls:
                call.resolve(error)
            return True
        for node, group in groups:
            name = node.name
            link = self._links.get(name)
            if link is not None and link.usable and name in self._loaded:
                try:
                    packed, batched = self._pack(group)
                except Exception as error:
                    for call in group:
                        call.resolve(error)
                    continue
                self._stats.round_trips += 1
                link.send(packed, group, batched)
                continue
            if link is None and name in self._loaded and name not in self._opening:
                if time.monotonic() >= self._link_after.get(name, 0.0):
                    self._opening[name] = asyncio.ensure_future(self._open_link(node))
            self._batcher.spawn(self._send_pipeline(node, group))
        return True

    async def _open_link(self, node: ClusterNode) -> None:
        """Opens a link to ``node`` on a connection of its pool, within the store's budget.
        If it cannot (a node down, silent, or a parser other than hiredis), calls keep
        going through the pool; it is tried again after ``LINK_RETRY``."""
        name = node.name
        connection = None
        if getattr(node, "max_connections", LINK_MIN_POOL) < LINK_MIN_POOL:
            # (a user's client with a pool this small: a link would hold its only
            # connection for good, and every other use of it, the app's or a retry's, would
            # meet MaxConnectionsError)
            self._link_after[name] = float("inf")
            self._opening.pop(name, None)
            return
        try:
            connection = node.acquire_connection()
            async with asyncio.timeout(self.deadline):
                await connection.connect()  # type: ignore[no-untyped-call]
            parser = getattr(connection, "_parser", None)
            if HIREDIS_PARSER is None or type(parser) is not HIREDIS_PARSER:
                self._link_after[name] = float("inf")  # (a link reads through hiredis only)
                return
            self._links[name] = NodeLink(
                node,
                connection,
                closed_by=self._link_closed,
                on_noscript=lambda: self._loaded.discard(name),
            )
            connection = None
            self._stats.links_opened += 1
            # A node no longer a primary (failed over, removed) keeps no link.
            primaries = {primary.name for primary in self.client.get_primaries()}
            for other in list(self._links.values()):
                if other.node.name not in primaries and not other.busy:
                    other.fail(ConnectionError(f"{other.node.name} is no longer a primary"))
        except Exception:
            self._link_after[name] = time.monotonic() + LINK_RETRY
        finally:
            self._opening.pop(name, None)
            if connection is not None:
                with contextlib.suppress(Exception):
                    await connection.disconnect(nowait=True)
                node.release(connection)

    def _link_closed(self, link: NodeLink, error: BaseException) -> None:
        """A link failed (or was closed): its connection is given back, a new link comes
        after ``LINK_RETRY``; a node that gave no answer in time has its slot map suspected,
        as a pipeline that timed out would."""
        name = link.node.name
        if self._links.get(name) is link:
            del self._links[name]
        if self._closing:
            return  # (``aclose`` gives the connections back itself)
        self._stats.links_failed += 1
        self._link_after[name] = time.monotonic() + LINK_RETRY
        if isinstance(error, NodeSilent):
            self._suspect_slot_map()
        self._batcher.spawn(link.release())

    @property
    def idle(self) -> bool:
        """Nothing queued, and no pipeline waiting for its replies."""
        return self._batcher.idle and not any(link.busy for link in self._links.values())

    def _pack(self, calls: list[Pending]) -> tuple[bytes, bool]:
        """One pipeline of FCALLs: the calls as one ``decide_many`` call when they share a
        slot (their keys declared, as a script call's must share one), else as one
        ``decide_node`` call (keys not declared, flagged allow-cross-slot-keys); a lone call
        as itself. True when batched (one reply for them all)."""
        if len(calls) > 1:
            first = _slot(calls[0].keys[0])
            cross = any(_slot(call.keys[0]) != first for call in calls)
            head = self._fcall_node if cross else self._fcall_many
            return pack_many(head, calls, spread=cross), True
        return pack_calls(self._fcall, 2, calls), False

    async def _send_tick(self, calls: list[Pending]) -> None:
        """A tick's calls sent before the slot map was loaded: it is loaded first (a tick
        waits for one bounded load), then one pipeline per node, through the nodes' pools."""
        try:
            await self._refresh(max(call.deadline for call in calls))
        except Exception as exc:  # (no slot map: nothing of these calls was written)
            for call in calls:
                call.resolve(mark_unsent(exc))
            return
        groups = self._by_node(calls)
        for node, group in groups[1:]:
            self._batcher.spawn(self._send_pipeline(node, group))
        if groups:
            await self._send_pipeline(*groups[0])

    async def _send_pipeline(self, node: ClusterNode, calls: list[Pending]) -> None:
        """One pipeline to one node, given until the latest deadline among its calls.

        Packed here (``resp.py``: keys and identifier blocks are packed once and reused) and
        written once on one of the node's connections; hiredis parses the replies. redis-py's
        own pipeline packed every argument through its general encoder, about a third of a
        cross-slot decision's client CPU. With FCALL, the node's calls go as one script run
        (``decide_many``, or ``decide_node`` across slots: ``lua/decide.lua``): one command
        dispatch, one TIME and one read of each main key for them all (a fifth of the server's
        instructions per call on the cross-slot 2 ids x 3 limits shape). An error reply
        (NOSCRIPT, MOVED, ...) answers its call, or every call of its batch, none of which
        ran; a call of a ``decide_node`` batch that failed before it wrote (its slot not served
        here now) comes back tagged (``_unserved``). ``run`` retries those one by one through
        the cluster client (as EVALSHA/EVAL, which run the same code), which follows the
        redirections and updates its slot map.

        Where the nodes have FUNCTION (Redis 7+, Valkey) the calls are FCALLs of aiolimit's
        library, loaded once on each node this store sends to (FUNCTION LOAD is replicated, so
        a promoted replica has it already): the server builds the code once, not on every
        call. A node that answers "Function not found" (FUNCTION FLUSH, a restart without
        persistence) gets the library again before its next pipeline.
        """
        deadline = max(call.deadline for call in calls)
        head = self._evalsha
        if self._functions is not False:
            if node.name not in self._loaded:
                await self._load_library(node, deadline)
            if node.name in self._loaded:
                head = self._fcall
        # With FCALL, the node's calls go as one script run, each main key and TIME read once
        # for them (``_pack``).
        if head is self._fcall:
            packed, batched = self._pack(calls)
        else:
            packed, batched = pack_calls(head, 2, calls), False
        expected = 1 if batched else len(calls)
        self._stats.round_trips += 1
        results: list[Result] = []
        connection = None
        try:
            connection = node.acquire_connection()
            async with asyncio.timeout_at(loop_time(deadline)):
                reconnect = getattr(connection, "should_reconnect", None)  # (redis-py 6+)
                if reconnect is not None and reconnect():
                    await connection.disconnect()
                await connection.send_packed_command(packed)
                await read_replies(connection, expected, results)  # (kept if it fails)
        except Exception as exc:  # the connection failed or timed out: calls without a reply
            results += [exc] * (expected - len(results))
            if connection is not None:  # replies may still be on their way
                await connection.disconnect(nowait=True)
            if isinstance(exc, TimeoutError):
                self._suspect_slot_map()
        except BaseException:  # cancelled: the calls without a reply may or may not have run
            if connection is not None:
                await connection.disconnect(nowait=True)
            raise
        finally:
            if connection is not None:
                node.release(connection)
            if batched and results:  # one result per call again
                results = spread_many(results[0], len(calls))
            if any(isinstance(r, BaseException) and is_noscript(r) for r in results):
                self._loaded.discard(node.name)
            for index, call in enumerate(calls):
                call.resolve(results[index] if index < len(results) else _cut_short())

    async def _load_library(self, node: ClusterNode, deadline: float) -> None:
        """FUNCTION LOAD on ``node``; without FUNCTION there, calls stay EVALSHA for good.
        Any other failure leaves this pipeline on EVALSHA: it meets the same fault."""
        try:
            async with asyncio.timeout_at(loop_time(deadline)):
                await node.execute_command("FUNCTION", "LOAD", self._library.code)
        except ResponseError as error:
            if lacks_functions(error):
                self._functions = False
                return
            if "already exists" not in str(error):
                return
        except Exception:
            return
        self._functions = True
        self._loaded.add(node.name)

    # --- the rest ---------------------------------------------------------------------------

    async def delete(self, keys: Sequence[str]) -> None:
        if not keys:
            return

        deadline = time.monotonic() + self.deadline

        async def attempt() -> None:
            await self._refresh(deadline)  # (a map dropped is reloaded here, cut short)
            await self.client.unlink(*keys)  # a large log is freed off Redis' main thread

        await call_with_retries(attempt, deadline=deadline, address=self.address)

    def default_clock(self) -> Clock:
        return ServerClock()

    async def aclose(self) -> None:
        give_up = time.monotonic() + CLOSE_GRACE
        await self._batcher.aclose()
        # Pipelines on links are waited for as the batcher's are, within the same grace.
        busy = [link.drained() for link in self._links.values() if link.busy]
        if busy:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(give_up - time.monotonic(), 0.0)):
                    await asyncio.gather(*busy)
        self._closing = True
        # The links are taken before the next await: one that fails meanwhile leaves
        # ``_links`` (``_link_closed``, which gives nothing back once closing) and would
        # keep its connection out of the pool for good.
        links, self._links = list(self._links.values()), {}
        opening = list(self._opening.values())
        for task in opening:
            task.cancel()
        await asyncio.gather(*opening, return_exceptions=True)
        links += self._links.values()  # (none: a cancelled opening adds no link)
        self._links = {}
        for link in links:
            link.fail(TimeoutError("the store was closed"))
        await asyncio.gather(*(link.release() for link in links), return_exceptions=True)
        if self._reloading is not None:
            self._reloading.cancel()
            await asyncio.wait([self._reloading])
        if self._owns:
            await close_cluster_client(self.client)

    async def command(self, *args: Arg) -> Any:
        deadline = time.monotonic() + self.deadline

        async def attempt() -> Any:
            # A map dropped (a node gave no answer in time) is reloaded here, cut short:
            # redis-py's own reload would also ask the first primary for COMMAND.
            await self._refresh(deadline)
            return await self.client.execute_command(*args)

        return await call_with_retries(attempt, deadline=deadline, address=self.address)

    async def subscribe(self, channel: str) -> AsyncIterator[bytes]:
        """A plain SUBSCRIBE on one node: PUBLISH reaches every node of a cluster."""
        nodes = self.client.get_primaries() or self.client.get_nodes()
        if not nodes:
            with map_errors(self.address, cluster=True):
                await self.client.initialize()  # nothing asked yet: learn the nodes first
            nodes = self.client.get_primaries() or self.client.get_nodes()
        if not nodes:
            raise BackendUnavailable(f"{self.address}: no cluster node known to subscribe on")
        node = nodes[0]
        kwargs = dict(node.connection_kwargs)
        single = Redis(host=node.host, port=int(node.port), **{
            k: v for k, v in kwargs.items() if k in _SUBSCRIBER_OPTIONS
        })  # fmt: skip
        try:
            async for message in messages(single, channel, self.address):
                yield message
        finally:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await single.aclose()

    def describe(self) -> dict[str, Any]:
        return {"address": self.address, "deadline": self.deadline}
