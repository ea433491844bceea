"""Stores: the transport that runs the decision script, apart from any orchestration.

A store runs one script call atomically (``run``) and knows which slot a key belongs to.
Single-node stores put every key in slot 0, so a whole decision is one call. Redis errors are
translated into aiolimit's errors here, and only here (``translate_errors``).
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from redis import exceptions as redis_errors

from aiolimit._clock import Clock
from aiolimit._errors import BackendError, BackendUnavailable, ConfigurationError

Reply = list[int]
#: One script argument (blocks are pre-encoded bytes).
Arg = str | int | bytes


@contextmanager
def translate_errors(address: str) -> Iterator[None]:
    """Turns a store's exception into BackendUnavailable / BackendError, keeping the cause."""
    try:
        yield
    except (
        redis_errors.ConnectionError,
        redis_errors.TimeoutError,
        redis_errors.ClusterDownError,
        redis_errors.TryAgainError,
        ConnectionError,
        TimeoutError,
        OSError,
    ) as exc:
        raise BackendUnavailable(f"store at {address} unavailable: {exc!r}") from exc
    except redis_errors.ClusterError as exc:
        # Cluster-level trouble (CLUSTERDOWN, redirections exhausted): nobody answered for
        # the slot in time.
        raise BackendUnavailable(f"store at {address} unavailable: {exc!r}") from exc
    except redis_errors.RedisError as exc:
        raise BackendError(f"store at {address} failed: {exc!r}") from exc
    except redis_errors.RedisClusterException as exc:
        # redis-py's cluster client raises these outside the RedisError tree.
        if "Cluster mode is not enabled" in str(exc):
            raise ConfigurationError(
                f"{address} is a cluster URL but the server is not in cluster mode; "
                "use redis:// for a standalone server"
            ) from exc
        if "cannot be connected" in str(exc):
            raise BackendUnavailable(f"store at {address} unavailable: {exc!r}") from exc
        raise BackendError(f"store at {address} failed: {exc!r}") from exc


class Store(ABC):
    """Runs the decision script; one call is atomic on the store."""

    #: Where it points, for messages ("redis://127.0.0.1:6379/0", "memory://").
    address: str
    #: True if ``run`` may send a call again after a lost reply; the protocol then gives every
    #: charging call an op id, which the scripts apply once.
    retries_calls: bool = False
    #: True if every key is in one slot (standalone Redis, embedded): one call per decision.
    single_slot: bool = True

    @abstractmethod
    async def run(self, keys: Sequence[str], args: Sequence[Arg]) -> Reply:
        """Runs the decision script once, atomically, over ``keys`` (all in one slot)."""

    async def run_many(
        self, calls: Sequence[tuple[Sequence[str], Sequence[Arg]]]
    ) -> list[Reply | BaseException]:
        """Runs several calls concurrently; each result is a reply or the error it raised."""
        results = await asyncio.gather(*(self.run(k, a) for k, a in calls), return_exceptions=True)
        return list(results)

    def slot(self, key: str) -> int:
        """The slot of a key; keys of one slot can share a call. Single-node stores: 0."""
        return 0

    @abstractmethod
    async def delete(self, keys: Sequence[str]) -> None:
        """Deletes keys (``reset``)."""

    @abstractmethod
    def default_clock(self) -> Clock:
        """The clock used when the limiter is given none."""

    @abstractmethod
    async def aclose(self) -> None:
        """Releases connections the store opened itself."""

    def describe(self) -> dict[str, Any]:
        return {"address": self.address}
