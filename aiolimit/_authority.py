"""A TIME authority: one designated Redis node's clock is ``now`` for every decision.

With the default server clock each script reads the TIME of the shard it runs on, so on a
cluster the slots of one decision may be judged by different clocks, and clients never agree
with each other's local clocks. An ``AuthorityClock`` asks one node for ``TIME`` and passes that
``now`` to every slot of the decision, so all shards and all clients judge by one clock.

- ``AuthorityClock(url_or_client)``: one ``TIME`` round trip per decision (exact, costs a round
  trip: about 0.12 ms on loopback).
- ``AuthorityClock(url_or_client, max_age=30)``: samples ``TIME`` a few times NTP-style, keeps
  the sample with the shortest round trip, and from then on serves ``now`` from the local
  monotonic clock plus the measured offset, with no round trip, until ``max_age`` seconds have
  passed. ``error_bound`` says how far off it may be: half that round trip, plus the drift the
  local clock may have accumulated since (``drift_ppm``).

On a cluster the designated node is the primary that owns slot 0 (after a failover, its
successor), so every client picks the same node without being told.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from aiolimit._connection import (
    REDIS_SCHEMES,
    client_address,
    close_cluster_client,
    cluster_client,
    is_cluster_url,
    redact,
    redis_client,
    scheme_of,
)
from aiolimit._deadline import current_deadline
from aiolimit._errors import ConfigurationError
from aiolimit._retry import call_with_retries
from aiolimit._validation import check_int, check_number, check_optional_seconds, check_seconds

DEFAULT_SAMPLES = 5
DEFAULT_DRIFT_PPM = 100.0
#: Seconds a TIME request may take, retries included, outside a decision's deadline.
DEFAULT_DEADLINE = 5.0
#: Seconds one reload of a cluster's slot map (CLUSTER SLOTS to one startup node) may take
#: before the next try asks another node: a frozen one would hold the reload until the
#: deadline. A healthy node answers in well under a millisecond.
REFRESH_TIMEOUT = 0.05


def _open(authority: object, socket_timeout: float) -> tuple[Redis | RedisCluster, bool, str]:
    if isinstance(authority, (Redis, RedisCluster)):
        return authority, False, client_address(authority)
    if not isinstance(authority, str):
        raise ConfigurationError(
            "AuthorityClock needs a Redis URL or a redis.asyncio Redis / RedisCluster client, "
            f"got {type(authority).__name__}"
        )
    if is_cluster_url(authority):
        return cluster_client(authority, socket_timeout), True, redact(authority)
    if scheme_of(authority) in REDIS_SCHEMES:
        client = redis_client(authority, socket_timeout, io_timeout=socket_timeout)
        return client, True, redact(authority)
    raise ConfigurationError(
        f"AuthorityClock URL must be redis://, rediss://, unix://, redis+cluster:// or "
        f"rediss+cluster://, got {redact(authority)!r}"
    )


def _time_us(reply: Any) -> int:
    """TIME's reply (raw [seconds, µs] or redis-py's parsed tuple) as µs since the epoch."""
    if isinstance(reply, dict):  # a cluster reply keyed by node name
        (reply,) = reply.values()
    seconds, micros = reply
    return int(seconds) * 1_000_000 + int(micros)


class AuthorityClock:
    """``now`` from one Redis node's TIME, for every slot of every decision of every client.

    ``time_source`` is the local clock the cached mode extrapolates with (seconds; default
    ``time.monotonic``); tests pass a skewed one. Close the clock (``aclose`` or ``async
    with``) when it opened its own client from a URL.
    """

    #: Keys are judged by the authority's clock but expire by each shard's own; a little slack
    #: (with ``max_age``, more: twice the drift a cached offset may gather).
    ttl_slack_ms = 1000
    sleep_margin = 0.000_5

    def __init__(
        self,
        authority: str | Redis | RedisCluster,
        max_age: float | None = None,
        *,
        samples: int = DEFAULT_SAMPLES,
        drift_ppm: float = DEFAULT_DRIFT_PPM,
        time_source: Callable[[], float] = time.monotonic,
        socket_timeout: float = 2.0,
    ) -> None:
        max_age = check_optional_seconds("max_age", max_age, 0, 86400, open_low=True)
        samples = check_int("samples", samples, 1, 100)
        drift_ppm = check_number("drift_ppm", drift_ppm, 0, 10_000)
        socket_timeout = check_seconds("socket_timeout", socket_timeout, 0, 300, open_low=True)
        if not callable(time_source):
            raise ConfigurationError(f"time_source must be callable, got {time_source!r}")
        self.max_age = max_age
        self.samples = samples
        self.drift_ppm = float(drift_ppm)
        if max_age is not None:
            # A cached ``now`` may drift this far before it is resampled, ahead on one client
            # and behind on another: a key written by the first must outlive what the second
            # still counts in its window.
            self.ttl_slack_ms = AuthorityClock.ttl_slack_ms + math.ceil(
                2 * max_age * self.drift_ppm / 1000
            )
        self._time_source = time_source
        self._client, self._owns, self._address = _open(authority, socket_timeout)
        self._offset_us: int | None = None  # server µs - local µs, from the best sample
        self._rtt = 0.0
        self._sampled_at = 0.0
        self._lock: asyncio.Lock | None = None
        self._set_up = False  # a cluster client has loaded its command table once
        #: TIME requests sent (each sample and each uncached ``now_us`` is one round trip).
        self.round_trips = 0

    # --- the Clock protocol ----------------------------------------------------------------

    async def now_us(self) -> int | None:
        if self.max_age is None:
            return await self._server_time()
        if self._offset_us is None or self._time_source() - self._sampled_at > self.max_age:
            await self._resample_once()
        assert self._offset_us is not None
        return round(self._time_source() * 1_000_000) + self._offset_us

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    # --- the cached offset -----------------------------------------------------------------

    @property
    def offset(self) -> float | None:
        """Seconds to add to the local ``time_source`` to get the authority's time (cached
        mode, once sampled); ``None`` before the first sample or without ``max_age``."""
        return None if self._offset_us is None else self._offset_us / 1_000_000

    @property
    def error_bound(self) -> float:
        """Seconds by which a cached ``now`` may differ from the authority's TIME: half the
        best sample's round trip, plus local drift since it, plus TIME's 1 µs resolution.
        0 without ``max_age``, where every ``now`` is a fresh TIME (its own staleness aside)."""
        if self.max_age is None or self._offset_us is None:
            return 0.0
        age = max(self._time_source() - self._sampled_at, 0.0)
        return self._rtt / 2 + age * self.drift_ppm / 1_000_000 + 0.000_001

    async def synchronize(self) -> None:
        """Samples the authority now (cached mode), whatever the age of the last sample.

        The best sample so far is kept as it comes: a slow authority whose samples do not
        all fit the running decision's deadline still leaves an offset (``error_bound`` says
        how good), and later decisions use it rather than each starting over and failing at
        the deadline. No sample is begun that the deadline would cut anyway.
        """
        best_rtt = math.inf
        for taken in range(self.samples):
            deadline = current_deadline()
            if taken and deadline is not None and time.monotonic() + best_rtt > deadline:
                break
            sent = self._time_source()
            server = await self._server_time()
            received = self._time_source()
            rtt = max(received - sent, 0.0)
            middle = (sent + received) / 2
            if taken == 0 or rtt < best_rtt:
                best_rtt = rtt
                self._rtt, self._sampled_at = rtt, received
                self._offset_us = server - round(middle * 1_000_000)

    async def _resample_once(self) -> None:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            # Another task may have sampled while this one waited for the lock.
            stale = self._offset_us is None or (
                self.max_age is not None and self._time_source() - self._sampled_at > self.max_age
            )
            if stale:
                await self.synchronize()

    async def _server_time(self) -> int:
        deadline = current_deadline()
        if deadline is None:
            deadline = time.monotonic() + DEFAULT_DEADLINE
        self.round_trips += 1
        return await call_with_retries(self._ask, deadline=deadline, address=self._address)

    async def _ask(self) -> int:
        client = self._client
        if isinstance(client, RedisCluster):
            await self._load_slot_map(client)
            node = client.get_node_from_key(_SLOT_ZERO_KEY)
            try:
                reply: Sequence[Any] = await client.execute_command("TIME", target_nodes=node)
            except asyncio.CancelledError:
                # Cut at the deadline: the node may be frozen (it accepts TCP and never
                # answers, so redis-py sees no error and keeps its map). Reloaded before the
                # next TIME, the map names slot 0's new owner once a replica has taken over.
                client._initialize = True
                raise
        else:
            reply = await client.execute_command("TIME")  # type: ignore[no-untyped-call]
        return _time_us(reply)

    async def _load_slot_map(self, client: RedisCluster) -> None:
        """Sets the client up once (slot map and command table, within the attempt's
        deadline), then reloads the slot map whenever it was dropped, each try cut at
        ``REFRESH_TIMEOUT`` (the next asks the startup nodes in a new random order) until the
        attempt's deadline cuts it. A reload asks for the slot map alone:
        ``RedisCluster.initialize`` also asks the first primary for ``COMMAND``, and a frozen
        first primary would hold every TIME up."""
        if not self._set_up:
            await client.initialize()
            self._set_up = True
        while client._initialize:
            try:
                async with asyncio.timeout(REFRESH_TIMEOUT):
                    await client.nodes_manager.initialize()
                    client._initialize = False
            except TimeoutError:
                continue

    # --- lifecycle ---------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Closes the client the clock opened from a URL (not one passed in)."""
        if not self._owns:
            return
        if isinstance(self._client, RedisCluster):
            await close_cluster_client(self._client)
        else:
            await self._client.aclose()

    async def __aenter__(self) -> AuthorityClock:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"AuthorityClock({self._address!r}, max_age={self.max_age!r})"


#: A key in slot 0 ("{06S}" hashes to 0): its owner is the designated node on a cluster.
_SLOT_ZERO_KEY = "{06S}"
