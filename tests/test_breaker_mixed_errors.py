"""A decision across nodes may meet two faults at once: a key clobbered by another program on
one node (answered at once: WRONGTYPE) and a node that does not answer at all. The answered
error must not pass for the silent node's success: its breaker has to open, or every decision
that needs it keeps paying the whole deadline."""

from __future__ import annotations

import time

import pytest
from redis.asyncio.cluster import RedisCluster

import cluster
from aiolimit import Limit, Limiter
from tests._nodes import on_node

pytestmark = [pytest.mark.cluster]


@pytest.mark.parametrize("clobbered_first", [True, False])
async def test_a_silent_node_opens_its_breaker_beside_an_answered_error(
    calm: cluster.Cluster, prefix: str, clobbered_first: bool
) -> None:
    node_a, node_b = calm.primaries()[:2]
    bad = on_node(calm, prefix, "bad", node_a)
    dead = on_node(calm, prefix, "dead", node_b)
    other = on_node(calm, prefix, "other", node_b)  # (on the silent node as well)
    limiter = Limiter(
        calm.url, [Limit(10, per=60)], prefix=prefix, deadline=0.3, on_error="closed",
        failure_threshold=3, recovery_time=30,
    )  # fmt: skip
    raw = RedisCluster.from_url(calm.url.replace("redis+cluster://", "redis://"))
    key = limiter._rules.plans(bad)[0].keys[0]
    try:
        await limiter.peek([bad, dead, other])  # (slot map and scripts loaded)
        await raw.set(key, "not aiolimit's")
        node_b.pause()
        try:
            ids = [bad, dead] if clobbered_first else [dead, bad]
            for _ in range(3):
                decision = await limiter.try_acquire(ids)
                assert decision.degraded and not decision.allowed
            # Node B answered none of the three: its breaker is open, and a decision that
            # needs it is answered at once instead of after the deadline.
            assert limiter.statistics().breaker.state == "open"
            started = time.monotonic()
            decision = await limiter.try_acquire(other)
            took = time.monotonic() - started
            assert decision.degraded and not decision.allowed
            assert took < 0.2, f"a decision on the silent node took {took:.2f} s"  # (deadline 0.3)
        finally:
            node_b.resume()
    finally:
        await raw.delete(key)
        await raw.aclose()
        await limiter.aclose()
