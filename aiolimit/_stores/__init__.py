"""Opening a store from what the user passed: a URL or a client object."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from aiolimit._errors import ConfigurationError
from aiolimit._stores.base import Store

REDIS_SCHEMES = ("redis", "rediss", "unix")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
SCHEMES = (*REDIS_SCHEMES, *CLUSTER_SCHEMES, "memory")


#: Seconds per decision when the limiter is not told: a cluster rides through a failover
#: (2-3 s) within its deadline; a single server answers fast or not at all.
DEFAULT_DEADLINE = 1.0
CLUSTER_DEFAULT_DEADLINE = 5.0


def default_deadline(store: object) -> float:
    """The deadline ``Limiter(..., deadline="auto")`` gives decisions on ``store``."""
    clustered = isinstance(store, RedisCluster) or (
        isinstance(store, Store) and not store.single_slot
    )
    if isinstance(store, str):
        clustered = urlsplit(store).scheme.lower() in CLUSTER_SCHEMES
    return CLUSTER_DEFAULT_DEADLINE if clustered else DEFAULT_DEADLINE


def open_store(
    store: str | Any, *, socket_timeout: float, bounded_by_deadline: bool = False
) -> Store:
    if isinstance(store, Store):
        return store
    if isinstance(store, Redis):
        from aiolimit._stores.redis import RedisStore

        return RedisStore(store, owns_client=False)
    if isinstance(store, RedisCluster):
        from aiolimit._stores.cluster import ClusterStore

        return ClusterStore(store, owns_client=False)
    if not isinstance(store, str):
        raise ConfigurationError(
            "store must be a URL or a redis.asyncio.Redis / RedisCluster client, "
            f"got {type(store).__name__}"
        )
    if isinstance(socket_timeout, bool) or not (
        isinstance(socket_timeout, (int, float)) and 0 < socket_timeout <= 300
    ):
        raise ConfigurationError(
            f"socket_timeout must be 0 < seconds <= 300, got {socket_timeout!r}"
        )
    scheme = urlsplit(store).scheme.lower()
    if scheme in REDIS_SCHEMES:
        from aiolimit._stores.redis import RedisStore, client_from_url

        try:
            io_timeout = None if bounded_by_deadline else socket_timeout
            client = client_from_url(store, socket_timeout, io_timeout=io_timeout)
        except ValueError as exc:
            raise ConfigurationError(f"invalid Redis URL {store!r}: {exc}") from exc
        return RedisStore(client, owns_client=True, address=_redact(store))
    if scheme in CLUSTER_SCHEMES:
        from aiolimit._stores.cluster import ClusterStore

        return ClusterStore.from_url(store, socket_timeout=socket_timeout)
    if scheme == "memory":
        from aiolimit._stores.memory import MemoryStore

        return MemoryStore()
    raise ConfigurationError(
        f"unknown store URL scheme {scheme!r} in {_redact(store)!r}; "
        f"expected one of {', '.join(s + '://' for s in SCHEMES)}"
    )


def _redact(url: str) -> str:
    """The URL without its password, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return parts._replace(netloc=netloc).geturl()
