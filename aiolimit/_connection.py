"""Talking to Redis: URL schemes, redaction, client construction, and the one error map.

Every place that turns a URL into a redis-py client (the stores, the TIME authority) comes
here, so every client gets aiolimit's settings (bounded timeouts, no silent retries) and every
address that reaches a message or a ``repr`` has its password blanked.

``map_errors`` is the only place where redis-py's exceptions become aiolimit's; messages say
what went wrong in words ("Connection refused", "DB index is out of range"), and the
original exception stays as ``__cause__``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import SplitResult, unquote, urlsplit

from redis import exceptions as redis_errors
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from aiolimit._errors import BackendError, BackendUnavailable, ConfigurationError

REDIS_SCHEMES = ("redis", "rediss", "unix")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
MEMORY_SCHEME = "memory"
SCHEMES = (*REDIS_SCHEMES, *CLUSTER_SCHEMES, MEMORY_SCHEME)

#: Connections one client opens to one server at most (see ``redis_client``).
MAX_CONNECTIONS = 100


def scheme_of(url: str) -> str:
    return urlsplit(url).scheme.lower()


def is_cluster_url(url: str) -> bool:
    return scheme_of(url) in CLUSTER_SCHEMES


def redact(url: str) -> str:
    """The URL without its password, for messages and reprs."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<invalid URL>"
    if "@" not in parts.netloc:
        return url
    userinfo, _, hosts = parts.netloc.rpartition("@")
    user = userinfo.split(":", 1)[0] if ":" in userinfo else ""
    # A lone userinfo without ':' is redis-py's "password only" form (redis://secret@host).
    netloc = f"{user}:***@{hosts}" if ":" in userinfo else f"***@{hosts}"
    return parts._replace(netloc=netloc).geturl()


# --- clients ----------------------------------------------------------------------------------


def redis_client(url: str, socket_timeout: float, *, io_timeout: float | None) -> Redis:
    """A standalone client with aiolimit's settings: bounded timeouts, and no silent retries.

    redis-py resends a command whose connection dropped by default; for a script that charges
    a counter that would charge twice when only the reply was lost. Retries are the limiter's
    business (with operation ids), never the client's.

    redis-py's default pool raises ``MaxConnectionsError`` once 100 commands are in flight; a
    blocking pool makes the 101st concurrent decision wait for a free connection instead.
    ``io_timeout`` bounds each read and write; None when a per-decision deadline bounds the
    call anyway (redis-py's write timeout costs a task per command).
    """
    try:
        pool = BlockingConnectionPool.from_url(
            url,
            max_connections=MAX_CONNECTIONS,
            timeout=socket_timeout,
            socket_timeout=io_timeout,
            socket_connect_timeout=socket_timeout,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
        )
    except ValueError as exc:
        raise ConfigurationError(f"invalid Redis URL {redact(url)!r}: {exc}") from exc
    return Redis.from_pool(pool)


def _seed_nodes(parts: SplitResult, url: str) -> list[ClusterNode]:
    hosts = parts.netloc.rpartition("@")[2]
    seeds = []
    for item in hosts.split(","):
        try:
            seed = urlsplit(f"//{item}")
            host, port = seed.hostname, seed.port
        except ValueError as exc:
            raise ConfigurationError(f"invalid seed {item!r} in {redact(url)!r}: {exc}") from exc
        if not host:
            raise ConfigurationError(
                f"a cluster URL needs seed host:port[,host:port...], got {redact(url)!r}"
            )
        seeds.append(ClusterNode(host, port or 6379))
    return seeds


def cluster_client(url: str, socket_timeout: float) -> RedisCluster:
    """A cluster client from ``redis+cluster://[user:pass@]host:port[,host:port...]``.

    Several seeds may be given; the client needs any one of them to answer. Its own retry
    loop is off (it ignores backoff and burns out in milliseconds against a dead node): the
    cluster store retries with backoff within the decision's deadline.
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in CLUSTER_SCHEMES:
        raise ConfigurationError(f"not a cluster URL: {redact(url)!r}")
    if parts.path not in ("", "/", "/0"):
        raise ConfigurationError(f"Redis Cluster has only database 0, got path {parts.path!r}")
    seeds = _seed_nodes(parts, url)
    userinfo = parts.netloc.rpartition("@")[0]
    username: str | None = None
    password: str | None = None
    if userinfo:
        name, colon, secret = userinfo.partition(":")
        username, password = (unquote(name) or None, unquote(secret)) if colon else (None, name)
    options: dict[str, Any] = {}
    if scheme == "rediss+cluster":
        options["ssl"] = True
    return RedisCluster(
        startup_nodes=seeds,
        username=username,
        password=password,
        reinitialize_steps=0,
        retry=Retry(NoBackoff(), 0),
        # Every attempt runs under the decision's deadline (asyncio.timeout), so reads and
        # writes need no timeout of their own, which redis-py implements with a task per
        # command (asyncio.wait_for).
        socket_timeout=None,
        socket_connect_timeout=socket_timeout,
        health_check_interval=0,
        **options,
    )


async def close_cluster_client(client: RedisCluster) -> None:
    """Closes every connection of a cluster client.

    ``RedisCluster.aclose`` does nothing while the client is marked for re-initialisation,
    which any connection error does; its nodes' connections would then stay open.
    """
    await client.aclose()
    await client.nodes_manager.aclose()
    await client.nodes_manager.aclose("startup_nodes")


def client_address(client: Redis | RedisCluster) -> str:
    """Where a client the user passed in points, for messages (never with a password)."""
    if isinstance(client, RedisCluster):
        seed = client.startup_nodes[0] if client.startup_nodes else None
        return f"redis+cluster://{seed.host}:{seed.port}" if seed else "redis+cluster://?"
    kwargs: dict[str, Any] = client.connection_pool.connection_kwargs
    if "path" in kwargs:
        return f"unix://{kwargs['path']}"
    return f"redis://{kwargs.get('host', '?')}:{kwargs.get('port', '?')}/{kwargs.get('db', 0)}"


def client_retries(client: Redis) -> int:
    """How many times a user's client resends a command by itself after a lost reply."""
    retry = client.get_retry()
    if retry is None:
        return 0
    return int(getattr(retry, "_retries", 0))


# --- errors -----------------------------------------------------------------------------------

_UNAVAILABLE: tuple[type[BaseException], ...] = (
    redis_errors.ConnectionError,
    redis_errors.TimeoutError,
    redis_errors.ClusterDownError,
    redis_errors.TryAgainError,
    ConnectionError,
    TimeoutError,
    OSError,
)

#: Errors that a moment later, on a healed server or cluster, may not happen again.
_RETRYABLE: tuple[type[BaseException], ...] = (
    redis_errors.ConnectionError,  # also covers redis-py's MaxConnectionsError
    redis_errors.TimeoutError,
    redis_errors.ClusterDownError,  # CLUSTERDOWN, and MASTERDOWN (a subclass)
    redis_errors.TryAgainError,
    redis_errors.SlotNotCoveredError,
    redis_errors.BusyLoadingError,  # a restarted node still loading
    redis_errors.ReadOnlyError,  # a write reached a demoted primary
    redis_errors.AskError,
    redis_errors.MovedError,
    ConnectionError,
    TimeoutError,
    asyncio.TimeoutError,
)


def is_retryable(error: BaseException) -> bool:
    """True for errors that a moment later, on a healed cluster, may not happen again."""
    if isinstance(error, _RETRYABLE):
        return True
    if isinstance(error, redis_errors.ClusterError):
        return "TTL exhausted" in str(error)
    if isinstance(error, redis_errors.RedisClusterException):
        # No startup node reachable right now (all restarting, or a network blip). A seed that
        # answers but is not a cluster is a configuration error and is not retried.
        cause = error.__context__ or error.__cause__
        return "cannot be connected" in str(error) and isinstance(
            cause, (redis_errors.ConnectionError, redis_errors.TimeoutError, OSError)
        )
    return False


def is_redirect(error: BaseException) -> bool:
    """MOVED, ASK or TRYAGAIN: the cluster says where to go; no failure."""
    return isinstance(error, (redis_errors.AskError, redis_errors.TryAgainError))


def is_noscript(error: BaseException) -> bool:
    """The server lacks the script (EVALSHA) or the library's function (FCALL): after a
    flush, a restart without persistence, or on a node that never had it. Nothing ran."""
    if isinstance(error, redis_errors.NoScriptError):
        return True
    return isinstance(error, redis_errors.ResponseError) and str(error).startswith(
        "Function not found"
    )


def lacks_functions(error: BaseException) -> bool:
    """FUNCTION LOAD is not available here (Redis < 7, or an ACL that forbids it)."""
    text = str(error).lower()
    return isinstance(error, redis_errors.ResponseError) and (
        "unknown command" in text or "unknown subcommand" in text or "noperm" in text
        or isinstance(error, redis_errors.NoPermissionError)
    )  # fmt: skip


def reason(error: BaseException) -> str:
    """An exception in words: its type and its message (or its cause's, when it has none)."""
    text = str(error).strip()
    if not text and error.__cause__ is not None:
        return reason(error.__cause__)
    name = type(error).__name__
    return f"{name}: {text}" if text else name


#: Error replies a server gives every write while it is in that state, whatever the keys.
_STORE_WIDE_CODES = ("BUSY ", "MISCONF ", "NOREPLICAS ")


def _store_wide(error: BaseException) -> bool:
    """The server cannot serve any call now (see ``BackendError.store_wide``), as opposed to
    an error about one call's keys or arguments (WRONGTYPE, a script error)."""
    if isinstance(error, (redis_errors.ReadOnlyError, redis_errors.OutOfMemoryError)):
        return True
    return isinstance(error, redis_errors.ResponseError) and str(error).startswith(
        _STORE_WIDE_CODES
    )


@contextmanager
def map_errors(address: str, *, cluster: bool = False) -> Iterator[None]:
    """Turns a redis-py exception into aiolimit's error tree, keeping it as ``__cause__``."""
    try:
        yield
    except BackendError:
        raise
    except (redis_errors.MovedError, redis_errors.ClusterCrossSlotError) as exc:
        if not cluster:
            raise ConfigurationError(
                f"{address} is a Redis Cluster node ({reason(exc)}); "
                "use a redis+cluster:// URL or a RedisCluster client"
            ) from exc
        raise BackendUnavailable(f"store at {address} unavailable: {reason(exc)}") from exc
    except _UNAVAILABLE as exc:
        raise BackendUnavailable(f"store at {address} unavailable: {reason(exc)}") from exc
    except redis_errors.ClusterError as exc:
        # Cluster-level trouble (redirections exhausted): nobody answered for the slot in time.
        raise BackendUnavailable(f"store at {address} unavailable: {reason(exc)}") from exc
    except redis_errors.RedisError as exc:
        failure = BackendError(f"store at {address} failed: {reason(exc)}")
        failure.store_wide = _store_wide(exc)
        raise failure from exc
    except redis_errors.RedisClusterException as exc:
        # redis-py's cluster client raises these outside the RedisError tree.
        if "Cluster mode is not enabled" in str(exc):
            raise ConfigurationError(
                f"{address} is a cluster URL but the server is not in cluster mode; "
                "use redis:// for a standalone server"
            ) from exc
        if "cannot be connected" in str(exc):
            raise BackendUnavailable(f"store at {address} unavailable: {reason(exc)}") from exc
        raise BackendError(f"store at {address} failed: {reason(exc)}") from exc


def mapped(error: BaseException, address: str, *, cluster: bool = False) -> BaseException:
    """``error`` as ``map_errors`` would raise it (for results carried as values)."""
    if not isinstance(error, Exception):
        return error
    try:
        with map_errors(address, cluster=cluster):
            raise error
    except Exception as translated:
        return translated
    raise AssertionError("unreachable")  # pragma: no cover


async def messages(client: Redis, channel: str, address: str) -> AsyncIterator[bytes]:
    """The messages published on ``channel``, through one SUBSCRIBE on ``client``'s server.

    redis-py's errors become aiolimit's; closing the iterator (or cancelling its reader)
    unsubscribes, waiting at most a second for a server that may be frozen.
    """
    pubsub = client.pubsub()
    try:
        with map_errors(address):
            await pubsub.subscribe(channel)
            while True:
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=None)
                if message is not None and message.get("type") == "message":
                    data = message["data"]
                    yield data.encode() if isinstance(data, str) else data
    finally:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(1.0):
                await pubsub.aclose()  # type: ignore[no-untyped-call]
