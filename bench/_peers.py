"""One adapter per rate limiter: aiolimit and its peers, each reduced to ``decide(ids) -> bool``.

Every adapter does what a user of that library would write to admit a request only if every
(identifier, limit) pair allows it:

- aiolimit: one ``try_acquire(ids)`` (all or nothing, one script call on a standalone server);
- limits (async, redis-py client): one ``hit`` per (identifier, limit), stopping at the first
  refusal (limits has no multi-limit call; the pairs hit before the refusal stay charged);
- pyrate-limiter: one bucket per identifier holding every rate (pyrate checks all rates of a
  bucket in one script), one ``try_acquire_async(id, blocking=False)`` per identifier;
- throttled-py: one ``Throttled`` per limit (it takes one quota each), one ``limit(id)`` per
  (identifier, limit), stopping at the first refusal.

Algorithms (``--algorithm``) map to each library's nearest implementation; ``impl`` says which.
``Unsupported`` means the library has no such algorithm (or cannot run in that mode).

Keys: each adapter gets a prefix; every key it writes starts with it, so ``<prefix>*`` finds
(and cleans up) exactly its keys:
- aiolimit ``<prefix>:{<id>}`` (+ ``:<suffix>`` aux keys for some algorithms);
- limits ``<prefix>:LIMITER/<id>/<amount>/<multiples>/<unit>`` (fixed, moving window) and
  ``<prefix>:{LIMITER/...}`` plus ``<prefix>:{LIMITER/...}/-1`` (sliding window counter);
- pyrate ``<prefix>:<id>`` (a ZSET log, or a HASH for GCRA);
- throttled ``<prefix>-l<i>:v1:<algorithm>:<id>`` (+ ``:period:<n>`` for its sliding window).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from bench._measure import Decide

ALGORITHMS = ("sliding", "fixed", "log", "gcra")
CONTENDERS = ("aiolimit", "limits", "pyrate", "throttled")
#: Available by name, not run by default: pyrate without its limiter-wide asyncio.Lock.
EXTRA_CONTENDERS = (
    "pyrate-direct", "aiolimit-cache", "aiolimit-prefetch", "aiolimit-otel", "aiolimit-prom",
    "ceiling",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Window:
    """``amount`` per ``per`` whole seconds, the one limit shape every library can express."""

    amount: int
    per: int

    def __str__(self) -> str:
        return f"{self.amount}/{self.per}s"


#: Limits so large no identifier ever reaches them: every decision is admitted. Strictly
#: growing amounts with non-increasing density (pyrate refuses other rate lists); every GCRA
#: emission interval stays >= 1 µs (pyrate and aiolimit count in integer µs).
ADMIT_LADDER = (
    Window(10**6, 1),
    Window(10**7, 60),
    Window(10**8, 3600),
    Window(10**9, 86400),
)
#: Limits so small that after the warm-up nearly every decision is refused (each identifier
#: sees a few dozen decisions per second), which measures the refusal path.
SATURATED_LADDER = (Window(1, 1), Window(2, 60), Window(3, 3600), Window(4, 86400))


def windows(count: int, *, saturated: bool) -> tuple[Window, ...]:
    """The first ``count`` limits of the ladder (shortest window first)."""
    ladder = SATURATED_LADDER if saturated else ADMIT_LADDER
    if not 1 <= count <= len(ladder):
        raise ValueError(f"limits per identifier must be 1..{len(ladder)}, got {count}")
    return ladder[:count]


class Unsupported(Exception):
    """The contender has no such algorithm, or cannot run against this server."""


def _redis_url(url: str) -> str:
    """The seed as redis-py's ``redis://`` URL (a cluster URL loses its ``+cluster``)."""
    return url.replace("+cluster://", "://", 1)


def _is_cluster(url: str) -> bool:
    return url.split("://", 1)[0].endswith("+cluster")


class Contender(ABC):
    """A limiter under test: ``open`` returns the ``decide`` coroutine function to load."""

    name: str
    impl: str

    def __init__(self, url: str, algorithm: str, limits: Sequence[Window], prefix: str) -> None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        self.url = url
        self.algorithm = algorithm
        self.limits = tuple(limits)
        self.prefix = prefix

    @property
    def key_pattern(self) -> str:
        """A SCAN MATCH glob for every key this contender writes."""
        return f"{self.prefix}*"

    @abstractmethod
    async def open(self, identifiers: Sequence[str]) -> Decide:
        """Connects (lazily, as the library does) and returns ``decide(ids) -> bool``."""

    @abstractmethod
    async def aclose(self) -> None:
        """Releases connections and background tasks."""


# -- aiolimit -------------------------------------------------------------------------------


class AiolimitContender(Contender):
    name = "aiolimit"

    def __init__(
        self, url: str, algorithm: str, limits: Sequence[Window], prefix: str, *,
        sliding_buckets: int = 10, clock: Any = None,
    ) -> None:  # fmt: skip
        super().__init__(url, algorithm, limits, prefix)
        import aiolimit

        self._aiolimit = aiolimit
        self._clock = clock
        self._sliding_buckets = sliding_buckets
        self._limits = [self._limit(window) for window in self.limits]
        self._limiter: Any = None

    def _limit(self, window: Window) -> Any:
        aiolimit = self._aiolimit
        amount, per = window.amount, window.per
        if self.algorithm == "sliding":
            buckets = self._sliding_buckets
            self.impl = f"Limit(precision=per/{buckets}): sliding counter, {buckets} buckets"
            return aiolimit.Limit(amount, per=per, precision=per / buckets)
        if self.algorithm == "fixed":
            if hasattr(aiolimit, "FixedWindow"):
                self.impl = "FixedWindow"
                return aiolimit.FixedWindow(amount, per=per)
            # Until FixedWindow lands: a Limit whose precision is its period is a
            # calendar-aligned fixed window (lua/sliding_window.lua).
            self.impl = "Limit(precision=per) = fixed window"
            return aiolimit.Limit(amount, per=per)
        if self.algorithm == "log":
            if not hasattr(aiolimit, "SlidingLog"):
                raise Unsupported("aiolimit.SlidingLog is not there yet")
            self.impl = "SlidingLog"
            return aiolimit.SlidingLog(amount, per=per)
        if not hasattr(aiolimit, "TokenBucket"):
            raise Unsupported("aiolimit.TokenBucket is not there yet")
        self.impl = "TokenBucket (GCRA), burst=amount"
        try:
            return aiolimit.TokenBucket(amount, per=per, burst=amount)
        except TypeError as exc:
            raise Unsupported(f"aiolimit.TokenBucket(rate, per=, burst=) failed: {exc}") from exc

    #: Extra keyword arguments for the Limiter (a variant contender sets them).
    options: dict[str, Any] = {}  # noqa: RUF012 - read only; subclasses replace it

    async def open(self, identifiers: Sequence[str]) -> Decide:
        extra = {} if self._clock is None else {"clock": self._clock}
        try:
            self._limiter = self._aiolimit.Limiter(
                self.url, self._limits, prefix=self.prefix, **extra, **self.options
            )
        except self._aiolimit.ConfigurationError as exc:
            raise Unsupported(str(exc)) from exc
        try_acquire = self._limiter.try_acquire

        async def decide(ids: tuple[str, ...]) -> bool:
            decision = await try_acquire(ids)
            return bool(decision.allowed)

        return decide

    async def aclose(self) -> None:
        if self._limiter is not None:
            await self._limiter.aclose()


class AiolimitCacheContender(AiolimitContender):
    """aiolimit with its local refusal cache (``cache_refusals=True``): see ``--saturated``."""

    name = "aiolimit-cache"
    options = {"cache_refusals": True}  # noqa: RUF012


class AiolimitPrefetchContender(AiolimitContender):
    """aiolimit taking units ahead on busy identifiers (``prefetch=256``): most admissions are
    made in the process. Not a like-for-like peer comparison: no peer admits locally."""

    name = "aiolimit-prefetch"
    options = {"prefetch": 256}  # noqa: RUF012


class AiolimitOtelContender(AiolimitContender):
    """aiolimit recording every decision on an OpenTelemetry SDK meter (the cost of metrics)."""

    name = "aiolimit-otel"

    async def open(self, identifiers: Sequence[str]) -> Decide:
        try:
            from opentelemetry.sdk.metrics import MeterProvider
            from opentelemetry.sdk.metrics.export import InMemoryMetricReader

            from aiolimit.metrics import OpenTelemetryMetrics
        except ImportError as exc:
            raise Unsupported(f"OpenTelemetry SDK missing: {exc}") from exc
        provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
        self.options = {"metrics": OpenTelemetryMetrics(provider)}
        return await super().open(identifiers)


class AiolimitPromContender(AiolimitContender):
    """aiolimit recording every decision with prometheus_client (the cost of metrics)."""

    name = "aiolimit-prom"

    async def open(self, identifiers: Sequence[str]) -> Decide:
        try:
            import prometheus_client

            from aiolimit.metrics import PrometheusMetrics
        except ImportError as exc:
            raise Unsupported(f"prometheus_client missing: {exc}") from exc
        self.options = {"metrics": PrometheusMetrics(prometheus_client.CollectorRegistry())}
        return await super().open(identifiers)


async def _read_replies(
    reader: asyncio.StreamReader, parser: Any, waiting: collections.deque[asyncio.Future[Any]]
) -> None:
    """A ceiling client's reader: each reply, as hiredis parses it, answers the oldest call
    still waiting on that connection (replies come in the order the calls went)."""
    while True:
        data = await reader.read(1 << 16)
        if not data:
            break
        parser.feed(data)
        while (reply := parser.gets()) is not False:
            waiting.popleft().set_result(reply)


class CeilingContender(Contender):
    """The ceiling for any client of aiolimit's script: the same calls (same script, keys and
    arguments as aiolimit sends for each identifier tuple, packed once in advance) from a
    minimal client with no limiter logic: one connection, the calls of one event-loop tick in
    one write, replies parsed by hiredis as they arrive. No validation, op ids, decoding,
    deadlines or failure handling. Standalone only."""

    name = "ceiling"
    impl = "aiolimit's script, pre-packed FCALL/EVALSHA, one connection, hiredis"
    # (On a cluster ``make_contender`` gives ``ClusterCeilingContender`` instead.)

    def __init__(self, url: str, algorithm: str, limits: Sequence[Window], prefix: str) -> None:
        super().__init__(url, algorithm, limits, prefix)
        if _is_cluster(url):
            raise Unsupported("the ceiling client speaks to one standalone server")
        self._inner = AiolimitContender(url, algorithm, limits, prefix)
        self.impl = f"{self.impl}; limits as aiolimit: {self._inner.impl}"
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task[None] | None = None

    async def open(self, identifiers: Sequence[str]) -> Decide:
        import hiredis
        from redis.asyncio import Redis
        from redis.exceptions import ResponseError

        from aiolimit._calls import ACQUIRE, decide_library, decide_script, encode
        from aiolimit._rules import Rules
        from aiolimit._stores.resp import command_head, pack_call

        script, library = decide_script(), decide_library()
        client = Redis.from_url(_redis_url(self.url))
        try:
            # As aiolimit calls it: FCALL where the server has FUNCTION, else EVALSHA.
            try:
                await client.execute_command("FUNCTION", "LOAD", "REPLACE", library.code)
                head = command_head("FCALL", library.function)
            except ResponseError:
                await client.script_load(script.source)
                head = command_head("EVALSHA", script.sha)
            host = client.connection_pool.connection_kwargs.get("host", "127.0.0.1")
            port = client.connection_pool.connection_kwargs.get("port", 6379)
        finally:
            await client.aclose()
        rules = Rules(self._inner._limits, self.prefix)
        packed: dict[tuple[str, ...], bytes] = {}

        def packed_for(ids: tuple[str, ...]) -> bytes:
            call = encode(ACQUIRE, rules.plans(list(ids)), 1, None, 0)
            return pack_call(head, 2, call.keys, call.args)

        reader, writer = await asyncio.open_connection(host, port)
        self._writer = writer
        loop = asyncio.get_running_loop()
        waiting: collections.deque[asyncio.Future[Any]] = collections.deque()
        outgoing: list[bytes] = []
        parser = hiredis.Reader()

        self._reading = asyncio.ensure_future(_read_replies(reader, parser, waiting))

        def flush() -> None:
            writer.write(b"".join(outgoing))
            outgoing.clear()

        async def decide(ids: tuple[str, ...]) -> bool:
            data = packed.get(ids)
            if data is None:
                data = packed[ids] = packed_for(ids)
            if not outgoing:
                loop.call_soon(flush)
            outgoing.append(data)
            future = loop.create_future()
            waiting.append(future)
            reply = await future
            return bool(reply[0] == 1)

        return decide

    async def aclose(self) -> None:
        if self._reading is not None:
            self._reading.cancel()
        if self._writer is not None:
            self._writer.close()


class _Link:
    """One connection of the cluster ceiling client to one primary: the calls queued in this
    event-loop tick (written at once by ``flush``), and the futures waiting for replies."""

    __slots__ = ("outgoing", "reading", "waiting", "writer")

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.outgoing: list[bytes] = []
        self.waiting: collections.deque[asyncio.Future[Any]] = collections.deque()
        self.reading: asyncio.Task[None] | None = None

    def flush(self) -> None:
        self.writer.write(b"".join(self.outgoing))
        self.outgoing.clear()


class ClusterCeilingContender(Contender):
    """The ceiling on a Redis Cluster: the calls aiolimit's protocol makes, from a minimal
    client. Identifiers in one slot: one acquire. Across slots: a check per slot, then (all
    allowing) an acquire per slot, as the two phases do, each packed once in advance (no op
    id, so no exactly-once bookkeeping on the server either). One connection per primary; the
    calls of one event-loop tick to a node in one write; replies parsed by hiredis as they
    arrive. No validation, decoding, deadlines, retries, redirections or compensation: what
    any client of this protocol pays at the least, in the same process on the same cluster.
    """

    name = "ceiling"
    impl = (
        "aiolimit's script, pre-packed FCALLs (a check per slot, then an acquire per slot), "
        "one connection per primary, hiredis"
    )

    def __init__(self, url: str, algorithm: str, limits: Sequence[Window], prefix: str) -> None:
        super().__init__(url, algorithm, limits, prefix)
        self._inner = AiolimitContender(url, algorithm, limits, prefix)
        self.impl = f"{self.impl}; limits as aiolimit: {self._inner.impl}"
        self._links: list[_Link] = []

    async def open(self, identifiers: Sequence[str]) -> Decide:
        import hiredis
        from redis.asyncio.cluster import RedisCluster
        from redis.crc import key_slot

        from aiolimit._calls import ACQUIRE, CHECK, decide_library, encode
        from aiolimit._rules import Rules
        from aiolimit._stores.resp import command_head, pack_call

        library = decide_library()
        client = RedisCluster.from_url(_redis_url(self.url))
        try:
            await client.initialize()
            owner = {
                slot: (nodes[0].host, int(nodes[0].port))
                for slot, nodes in client.nodes_manager.slots_cache.items()
            }
            for node in client.get_primaries():
                await node.execute_command("FUNCTION", "LOAD", "REPLACE", library.code)
        finally:
            await client.aclose()
        head = command_head("FCALL", library.function)
        loop = asyncio.get_running_loop()
        links: dict[tuple[str, int], _Link] = {}
        for host, port in sorted(set(owner.values())):
            reader, writer = await asyncio.open_connection(host, port)
            link = links[host, port] = _Link(writer)
            link.reading = asyncio.ensure_future(
                _read_replies(reader, hiredis.Reader(), link.waiting)
            )
            self._links.append(link)
        rules = Rules(self._inner._limits, self.prefix)
        Steps = list[tuple[_Link, bytes, bytes]]  # per slot: its node, its check, its acquire
        packed: dict[tuple[str, ...], Steps] = {}

        def steps_for(ids: tuple[str, ...]) -> Steps:
            by_slot: dict[int, list[Any]] = {}
            for plan in rules.plans(list(ids)):
                by_slot.setdefault(key_slot(plan.keys[0].encode()), []).append(plan)
            steps = []
            for slot, plans in by_slot.items():
                check, charge = encode(CHECK, plans, 1, None, 0), encode(ACQUIRE, plans, 1, None, 0)
                steps.append(
                    (
                        links[owner[slot]],
                        pack_call(head, 2, check.keys, check.args),
                        pack_call(head, 2, charge.keys, charge.args),
                    )
                )
            return steps

        def send(link: _Link, data: bytes) -> asyncio.Future[Any]:
            if not link.outgoing:
                loop.call_soon(link.flush)
            link.outgoing.append(data)
            future = loop.create_future()
            link.waiting.append(future)
            return future

        async def allowed(futures: list[asyncio.Future[Any]]) -> bool:
            verdict = True
            for future in futures:
                reply = await future
                if isinstance(reply, Exception):
                    raise reply
                verdict = verdict and reply[0] == 1
            return verdict

        async def decide(ids: tuple[str, ...]) -> bool:
            steps = packed.get(ids)
            if steps is None:
                steps = packed[ids] = steps_for(ids)
            if len(steps) == 1:
                link, _, charge = steps[0]
                return await allowed([send(link, charge)])
            if not await allowed([send(link, check) for link, check, _ in steps]):
                return False
            return await allowed([send(link, charge) for link, _, charge in steps])

        return decide

    async def aclose(self) -> None:
        for link in self._links:
            if link.reading is not None:
                link.reading.cancel()
            link.writer.close()
        self._links = []


# -- limits ---------------------------------------------------------------------------------


class LimitsContender(Contender):
    name = "limits"

    def __init__(self, url: str, algorithm: str, limits: Sequence[Window], prefix: str) -> None:
        super().__init__(url, algorithm, limits, prefix)
        from limits.aio import strategies

        strategy_class, self.impl = {
            "sliding": (strategies.SlidingWindowCounterRateLimiter, "SlidingWindowCounter"),
            "fixed": (strategies.FixedWindowRateLimiter, "FixedWindow"),
            "log": (strategies.MovingWindowRateLimiter, "MovingWindow (list log)"),
        }.get(algorithm, (None, ""))
        if strategy_class is None:
            raise Unsupported("limits has no GCRA / token bucket")
        self._strategy_class = strategy_class
        self._items = [self._item(window) for window in self.limits]
        self._storage: Any = None

    @staticmethod
    def _item(window: Window) -> Any:
        import limits

        for size, item_class in (
            (86400, limits.RateLimitItemPerDay),
            (3600, limits.RateLimitItemPerHour),
            (60, limits.RateLimitItemPerMinute),
        ):
            if window.per % size == 0:
                return item_class(window.amount, window.per // size)
        return limits.RateLimitItemPerSecond(window.amount, window.per)

    async def open(self, identifiers: Sequence[str]) -> Decide:
        from limits.storage import storage_from_string

        # The redis-py implementation (the default is coredis, not installed here).
        self._storage = storage_from_string(
            "async+" + self.url, implementation="redispy", key_prefix=self.prefix
        )
        hit = self._strategy_class(self._storage).hit
        items = self._items

        async def decide(ids: tuple[str, ...]) -> bool:
            for identifier in ids:
                for item in items:
                    if not await hit(item, identifier):
                        return False
            return True

        return decide

    async def aclose(self) -> None:
        if self._storage is not None:
            await self._storage.bridge.get_connection().aclose()


# -- pyrate-limiter -------------------------------------------------------------------------


class PyrateContender(Contender):
    name = "pyrate"
    #: True: ``try_acquire_async`` (documented for asyncio; one asyncio.Lock per Limiter).
    use_async_api = True

    def __init__(self, url: str, algorithm: str, limits: Sequence[Window], prefix: str) -> None:
        super().__init__(url, algorithm, limits, prefix)
        import pyrate_limiter as pyrate

        self._pyrate = pyrate
        self.impl = {
            "sliding": "RedisBucket + SlidingWindowLog (pyrate has no counter)",
            "fixed": "RedisBucket + FixedWindow (a ZSET log)",
            "log": "RedisBucket + SlidingWindowLog (ZSET)",
            "gcra": "StateBucket + GCRA + RedisStateStore",
        }[algorithm]
        if not self.use_async_api:
            self.impl += ", try_acquire (no lock)"
        self._rates = [pyrate.Rate(w.amount, w.per * 1000) for w in self.limits]
        self._client: Any = None
        self._factory: Any = None
        self._limiter: Any = None

    async def _bucket(self, key: str) -> Any:
        pyrate = self._pyrate
        if self.algorithm == "gcra":
            store = pyrate.RedisStateStore(self._client, key)
            return pyrate.StateBucket(self._rates, algorithm=pyrate.GCRA(), store=store)
        algorithm = pyrate.FixedWindow() if self.algorithm == "fixed" else pyrate.SlidingWindowLog()
        return await pyrate.RedisBucket.init(self._rates, self._client, key, algorithm=algorithm)

    async def open(self, identifiers: Sequence[str]) -> Decide:
        pyrate = self._pyrate
        if _is_cluster(self.url):
            from redis.asyncio.cluster import RedisCluster

            self._client = RedisCluster.from_url(_redis_url(self.url))
        else:
            from redis.asyncio import Redis

            self._client = Redis.from_url(self.url)
        buckets = {ident: await self._bucket(f"{self.prefix}:{ident}") for ident in identifiers}

        class PerIdentifier(pyrate.BucketFactory):  # type: ignore[misc, name-defined]
            """The README's custom routing: one bucket per identifier (item name)."""

            def __init__(self) -> None:
                for bucket in buckets.values():
                    self.schedule_leak(bucket)

            def wrap_item(self, name: str, weight: int = 1) -> Any:
                return pyrate.RateItem(name, buckets[name].now(), weight=weight)

            def get(self, item: Any) -> Any:
                return buckets[item.name]

        self._factory = PerIdentifier()
        self._buckets = buckets
        self._limiter = limiter = pyrate.Limiter(self._factory)
        if self.use_async_api:
            acquire = limiter.try_acquire_async

            async def decide(ids: tuple[str, ...]) -> bool:
                for identifier in ids:
                    if not await acquire(identifier, blocking=False):
                        return False
                return True

            return decide
        try_acquire = limiter.try_acquire

        async def decide_direct(ids: tuple[str, ...]) -> bool:
            for identifier in ids:
                if not await try_acquire(identifier, blocking=False):
                    return False
            return True

        return decide_direct

    async def aclose(self) -> None:
        if self._factory is not None:
            # dispose() deregisters each bucket and the last one cancels the async leak task,
            # but does not wait for it: a sweep still in flight would then fail on the closed
            # client ("Task exception was never retrieved"). Wait for it here.
            leaker = getattr(self._factory, "_leaker", None)
            task = getattr(leaker, "aio_leak_task", None)
            for bucket in self._buckets.values():
                self._factory.dispose(bucket)
            self._limiter.close()
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self._client is not None:
            await self._client.aclose()


class PyrateDirectContender(PyrateContender):
    """pyrate through ``try_acquire`` (awaitable with an async bucket), skipping the lock."""

    name = "pyrate-direct"
    use_async_api = False


# -- throttled-py ---------------------------------------------------------------------------


class ThrottledContender(Contender):
    name = "throttled"

    def __init__(self, url: str, algorithm: str, limits: Sequence[Window], prefix: str) -> None:
        super().__init__(url, algorithm, limits, prefix)
        using = {"sliding": "sliding_window", "fixed": "fixed_window", "gcra": "gcra"}
        if algorithm not in using:
            raise Unsupported("throttled-py has no sliding log")
        self._using = using[algorithm]
        self.impl = f"{self._using}, one Throttled per limit"
        self._store: Any = None

    async def open(self, identifiers: Sequence[str]) -> Decide:
        from throttled.asyncio import RedisStore, Throttled, per_duration

        self._store = RedisStore(server=self.url)
        throttles = [
            Throttled(
                using=self._using,
                quota=per_duration(timedelta(seconds=window.per), window.amount),
                store=self._store,
                key_prefix=f"{self.prefix}-l{i}",
            )
            for i, window in enumerate(self.limits)
        ]
        limits = [throttle.limit for throttle in throttles]

        async def decide(ids: tuple[str, ...]) -> bool:
            for identifier in ids:
                for limit in limits:
                    if (await limit(identifier)).limited:
                        return False
            return True

        return decide

    async def aclose(self) -> None:
        if self._store is not None:
            # throttled builds the client around a pool of its own: aclose() leaves the pool.
            client = self._store._backend.get_client()
            await client.aclose()
            pool = getattr(client, "connection_pool", None)  # none on a cluster client
            if pool is not None:
                await pool.disconnect()


_CLASSES: dict[str, type[Contender]] = {
    "aiolimit": AiolimitContender,
    "limits": LimitsContender,
    "pyrate": PyrateContender,
    "pyrate-direct": PyrateDirectContender,
    "throttled": ThrottledContender,
    "aiolimit-cache": AiolimitCacheContender,
    "aiolimit-prefetch": AiolimitPrefetchContender,
    "aiolimit-otel": AiolimitOtelContender,
    "aiolimit-prom": AiolimitPromContender,
    "ceiling": CeilingContender,
}


def make_contender(
    name: str, *, url: str, algorithm: str, limits: Sequence[Window], prefix: str,
    sliding_buckets: int = 10, clock: Any = None,
) -> Contender:  # fmt: skip
    """The adapter called ``name``; raises Unsupported when it cannot run ``algorithm``."""
    if name not in _CLASSES:
        raise ValueError(f"unknown contender {name!r}; known: {', '.join(_CLASSES)}")
    if name == "ceiling" and _is_cluster(url):
        return ClusterCeilingContender(url, algorithm, limits, prefix)
    if name.startswith("aiolimit"):
        return _CLASSES[name](  # type: ignore[call-arg]
            url, algorithm, limits, prefix, sliding_buckets=sliding_buckets, clock=clock
        )
    if clock is not None:
        raise Unsupported(f"{name} cannot take a manual clock")
    return _CLASSES[name](url, algorithm, limits, prefix)


def library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for package in (
        "aiolimit-redis", "limits", "pyrate-limiter", "throttled-py", "redis", "hiredis"
    ):  # fmt: skip
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            out[package] = "-"
    return out
