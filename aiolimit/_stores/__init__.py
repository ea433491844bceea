"""Stores: the transports that run the decision script (``base.Store``), and opening one.

- ``redis.py``: one Redis (or Valkey) server, EVALSHA pipelined per event-loop tick;
- ``cluster.py``: Redis Cluster, one pipeline per node per tick, retries within the deadline;
- ``memory.py``: ``memory://``, the same scripts in-process (``aiolimit._embedded``);
- ``batching.py``: the tick batcher both Redis stores share.
"""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from aiolimit._connection import (
    CLUSTER_SCHEMES,
    MEMORY_SCHEME,
    REDIS_SCHEMES,
    SCHEMES,
    redact,
    redis_client,
    scheme_of,
)
from aiolimit._errors import ConfigurationError
from aiolimit._stores.base import Store
from aiolimit._validation import check_seconds

#: Seconds per decision when the limiter is not told: a cluster rides through a failover
#: (2-3 s with cluster-node-timeout 1000 ms) within its deadline; a single server answers
#: fast or not at all.
DEFAULT_DEADLINE = 1.0
CLUSTER_DEFAULT_DEADLINE = 5.0


def default_deadline(store: object) -> float:
    """The deadline ``Limiter(..., deadline="auto")`` gives decisions on ``store``."""
    clustered = isinstance(store, RedisCluster) or (
        isinstance(store, Store) and not store.single_slot
    )
    if isinstance(store, str):
        clustered = scheme_of(store) in CLUSTER_SCHEMES
    return CLUSTER_DEFAULT_DEADLINE if clustered else DEFAULT_DEADLINE


def open_store(
    store: str | Any, *, socket_timeout: float, bounded_by_deadline: bool = False
) -> Store:
    """The store for what the user passed: a URL, a redis-py client, or a ``Store``."""
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
    socket_timeout = check_seconds("socket_timeout", socket_timeout, 0, 300, open_low=True)
    scheme = scheme_of(store)
    if scheme in REDIS_SCHEMES:
        from aiolimit._stores.redis import RedisStore

        io_timeout = None if bounded_by_deadline else socket_timeout
        client = redis_client(store, socket_timeout, io_timeout=io_timeout)
        return RedisStore(client, owns_client=True, address=redact(store))
    if scheme in CLUSTER_SCHEMES:
        from aiolimit._stores.cluster import ClusterStore

        return ClusterStore.from_url(store, socket_timeout=socket_timeout)
    if scheme == MEMORY_SCHEME:
        from aiolimit._stores.memory import MemoryStore

        return MemoryStore()
    raise ConfigurationError(
        f"unknown store URL scheme {scheme!r} in {redact(store)!r}; "
        f"expected one of {', '.join(s + '://' for s in SCHEMES)}"
    )
