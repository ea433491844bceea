"""A ``RedisCluster`` client the user made, already set up, given to the limiter: while its
first primary is frozen, decisions on the other nodes still answer at once.

A call cut at its deadline marks the slot map for a reload (``_suspect_slot_map``). The store
reloads only the map through redis-py's ``NodesManager`` once the client is set up; a client
that came in set up must count as such, or the reload goes through
``RedisCluster.initialize``, which also asks the first primary for ``COMMAND`` (and hangs on a
frozen one), then closes every connection of every node when it is cut."""

from __future__ import annotations

import time

import pytest
from redis.asyncio.cluster import RedisCluster

import cluster
from aiolimit import BackendError, Limit, Limiter
from tests._nodes import on_node

pytestmark = [pytest.mark.cluster]


async def test_a_set_up_user_client_skips_a_frozen_first_primary(
    calm: cluster.Cluster, prefix: str
) -> None:
    client = RedisCluster.from_url(calm.url.replace("redis+cluster://", "redis://"))
    await client.initialize()  # (the user's client has served their app already)
    first = client.get_primaries()[0]  # (the one redis-py asks for COMMAND)
    frozen = next(node for node in calm.primaries() if node.port == first.port)
    healthy = next(node for node in calm.primaries() if node.port != frozen.port)
    stuck, free = on_node(calm, prefix, "n", frozen), on_node(calm, prefix, "n", healthy)
    limiter = Limiter(client, [Limit(100, per=60)], prefix=prefix, deadline=0.5)
    took: list[float] = []
    try:
        await limiter.try_acquire([stuck])
        await limiter.try_acquire([free])
        frozen.pause()
        try:
            with pytest.raises(BackendError):
                await limiter.try_acquire(stuck)  # (cut at the deadline: map marked)
            for _ in range(5):
                started = time.monotonic()
                decision = await limiter.try_acquire(free)
                took.append(time.monotonic() - started)
                assert decision.allowed and not decision.degraded
        finally:
            frozen.resume()
    finally:
        await limiter.aclose()
        await client.aclose()
    assert max(took) < 0.3, took


@pytest.mark.parametrize("call", ["reset", "refund"])
async def test_reset_and_refund_fail_fast_while_their_nodes_breaker_is_open(
    calm: cluster.Cluster, prefix: str, call: str
) -> None:
    """As on a standalone store: while the breaker of the node an identifier lives on is
    open, reset() and refund() raise at once instead of paying the deadline (a cluster keeps
    a breaker per node; the store-wide one, which they asked, never opens there)."""
    frozen = calm.primaries()[1]
    stuck = on_node(calm, prefix, "n", frozen)
    limiter = Limiter(
        calm.url, [Limit(100, per=60)], prefix=prefix, deadline=0.5, on_error="open",
        failure_threshold=1, recovery_time=30,
    )  # fmt: skip
    try:
        await limiter.peek(stuck)
        frozen.pause()
        try:
            assert (await limiter.try_acquire(stuck)).degraded  # (its node's breaker opens)
            assert limiter.statistics().breaker.state == "open"
            started = time.monotonic()
            with pytest.raises(BackendError, match="breaker open"):
                if call == "reset":
                    await limiter.reset(stuck)
                else:
                    await limiter.refund(stuck)
            took = time.monotonic() - started
        finally:
            frozen.resume()
    finally:
        await limiter.aclose()
    assert took < 0.25, f"{call} took {took:.2f} s"  # (the deadline: 0.5 s)


async def test_a_healthy_node_never_waits_for_the_slot_map_reload_a_frozen_node_caused(
    calm: cluster.Cluster, prefix: str
) -> None:
    """Fault isolation. Each decision on a frozen node that times out marks the slot map for
    a reload; the reload asks the nodes in a random order, the frozen one too, and each try
    at it costs REFRESH_TIMEOUT (50 ms). Decisions on healthy nodes must not wait for that
    (under a short deadline they failed, and the healthy node's breaker counted it)."""
    frozen, healthy = calm.primaries()[:2]
    stuck, free = on_node(calm, prefix, "n", frozen), on_node(calm, prefix, "n", healthy)
    limiter = Limiter(
        calm.url, [Limit(1000, per=60)], prefix=prefix, deadline=0.2, on_error="open",
        failure_threshold=100,
    )  # fmt: skip
    took: list[float] = []
    try:
        await limiter.peek([stuck, free])
        frozen.pause()
        try:
            for _ in range(20):
                assert (await limiter.try_acquire(stuck)).degraded  # (cut: map marked)
                started = time.monotonic()
                decision = await limiter.try_acquire(free)
                took.append(time.monotonic() - started)
                assert decision.allowed and not decision.degraded
        finally:
            frozen.resume()
        breakers = limiter._failure._breakers
        assert breakers[f"127.0.0.1:{healthy.port}"].failures == 0
    finally:
        await limiter.aclose()
    # A decision that waited for the reload took a try at the frozen node: REFRESH_TIMEOUT
    # (50 ms) at least, about one in three (the nodes are asked in a random order). One slow
    # decision is left to the machine (a GC pause, a busy core); seven were expected before.
    slow = [round(t, 3) for t in took if t >= 0.05]
    assert len(slow) <= 1, (slow, [round(t, 3) for t in took])
