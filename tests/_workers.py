"""Helpers for the limiter tests: both backends behind one face, and multi-process workers.

``Backend`` opens limiters on real Redis or on ``memory://`` (every limiter of one backend
shares the same store, as several clients share one Redis) and reads what is stored under the
test's prefix, so a test can assert on the stored state itself, never on a mock.

``burst_worker`` runs in a spawned process: its own event loop, its own Limiter, against the
same real Redis as the other workers.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import redis.asyncio as redis_asyncio

from aiolimit import Limiter

BACKENDS = ("redis", "memory")


def _text(fields: dict[bytes, bytes]) -> dict[str, str]:
    return {name.decode(): value.decode() for name, value in fields.items()}


class Backend:
    """Limiters on one store, and a raw view of what that store holds under ``prefix``."""

    def __init__(self, kind: str, url: str, prefix: str) -> None:
        self.kind = kind
        self.url = url
        self.prefix = prefix
        self._limiters: list[Limiter] = []
        self._raw: redis_asyncio.Redis | None = None
        if kind == "redis":
            self._raw = redis_asyncio.Redis.from_url(url, decode_responses=True)

    def limiter(self, limits: Any, **options: Any) -> Limiter:
        """A limiter on this backend's store (memory://: the first limiter's store)."""
        options.setdefault("prefix", self.prefix)
        store: Any = self.url
        if self.kind == "memory" and self._limiters:
            store = self._limiters[0].store
        limiter = Limiter(store, limits, **options)
        self._limiters.append(limiter)
        return limiter

    def key(self, identifier: str) -> str:
        """The main key of a plain identifier (no braces, short): ``<prefix>:{<id>}``."""
        return f"{self.prefix}:{{{identifier}}}"

    def _engine(self) -> Any:
        assert self._limiters, "open a limiter first: memory:// state lives in its store"
        return self._limiters[0].store.engine  # type: ignore[attr-defined]

    async def keys(self) -> list[str]:
        """Every stored key under this backend's prefix, sorted."""
        pattern = self.prefix + ":*"
        if self._raw is not None:
            return sorted([key async for key in self._raw.scan_iter(match=pattern, count=1000)])
        keys = (key.decode() for key in self._engine().keys())
        return sorted(key for key in keys if key.startswith(self.prefix + ":"))

    async def hgetall(self, identifier: str) -> dict[str, str]:
        """HGETALL of the identifier's main key, as text."""
        key = self.key(identifier)
        if self._raw is not None:
            result: dict[str, str] = await self._raw.hgetall(key)
            return result
        return _text(self._engine().hgetall(key))

    async def pttl(self, key: str) -> int:
        """PTTL of a key: ms left, -1 without a TTL, -2 if missing."""
        if self._raw is not None:
            ttl: int = await self._raw.pttl(key)
            return ttl
        return int(self._engine().pttl(key))

    async def counts(self, identifier: str) -> dict[str, int]:
        """The identifier's window buckets as ``{"w<P>/<p>:<bucket index>": weight}``."""
        return bucket_counts(await self.hgetall(identifier))

    async def snapshot(self) -> dict[str, dict[str, str]]:
        """Every key under the prefix with its HASH fields: the whole stored state."""
        state = {}
        for key in await self.keys():
            if self._raw is not None:
                state[key] = await self._raw.hgetall(key)
            else:
                state[key] = _text(self._engine().hgetall(key))
        return state

    async def aclose(self) -> None:
        for limiter in self._limiters:
            await limiter.aclose()
        if self._raw is not None:
            await self._raw.aclose()


@asynccontextmanager
async def open_backend(kind: str, redis_url: str | None, prefix: str) -> AsyncIterator[Backend]:
    """A Backend of ``kind`` ("redis" needs ``redis_url``), closed on exit."""
    url = redis_url if kind == "redis" else "memory://"
    assert url is not None
    backend = Backend(kind, url, prefix)
    try:
        yield backend
    finally:
        await backend.aclose()


# --- multi-process ------------------------------------------------------------------------


async def _burst(url: str, prefix: str, identifier: str, amount: int, start: float,
                 attempts: int, barrier: Any) -> int:  # fmt: skip
    from aiolimit import Limit
    from aiolimit.testing import ManualClock

    limits = [Limit(amount, per=3600)]
    clock = ManualClock(start=start)
    async with Limiter(url, limits, prefix=prefix, clock=clock) as limiter:
        await limiter.peek(identifier)  # connect and load the script before the race
        await asyncio.get_running_loop().run_in_executor(None, barrier.wait, 30)
        decisions = await asyncio.gather(
            *(limiter.try_acquire(identifier) for _ in range(attempts))
        )
    return sum(1 for decision in decisions if decision.allowed)


def burst_worker(
    url: str, prefix: str, identifier: str, amount: int, start: float, attempts: int,
    barrier: Any, results: Any,
) -> None:  # fmt: skip
    """Process entry point: ``attempts`` concurrent try_acquire; puts how many were admitted."""
    try:
        admitted = asyncio.run(_burst(url, prefix, identifier, amount, start, attempts, barrier))
        results.put(("ok", admitted))
    except BaseException as exc:  # reported to the parent, which fails the test
        results.put(("error", repr(exc)))


def admitted_total(results: Sequence[tuple[str, Any]]) -> int:
    """Sums the workers' admitted counts; a worker's error fails loudly."""
    errors = [value for status, value in results if status != "ok"]
    assert not errors, errors
    return sum(value for _, value in results)


def bucket_counts(fields: dict[str, str]) -> dict[str, int]:
    """Expands the sliding/fixed window fields of a main key (lua/sliding_window.lua stores
    one field per limit, "<base>|<c0>|<offset>:<running total>,...") into one entry per bucket."""
    counts = {}
    for name, value in fields.items():
        if name[:1] not in ("w", "f"):
            continue
        base, previous, rest = value.split("|")
        total = int(previous)
        for item in filter(None, rest.split(",")):
            offset, _, running = item.partition(":")
            counts[f"{name}:{int(base) + int(offset)}"] = int(running) - total
            total = int(running)
    return counts
