"""A decision across nodes may meet two faults at once: a key clobbered by another program on
one node (answered at once: WRONGTYPE) and a node that does not answer at all. The answered
error must not pass for the silent node's success: its breaker has to open, or every decision
that needs it keeps paying the whole deadline."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

import cluster
from aiolimit import Limit, Limiter
from aiolimit._keys import main_key

pytestmark = [pytest.mark.cluster]


@pytest.fixture(scope="module")
def calm() -> Iterator[cluster.Cluster]:
    # No replicas and a long node timeout: a frozen primary stays frozen, never failed over.
    nodes = cluster.start_cluster(replicas_per_primary=0, node_timeout_ms=15000)
    with nodes:
        yield nodes


def on_node(nodes: cluster.Cluster, prefix: str, tag: str, node: cluster.Node) -> str:
    return next(
        f"{tag}:{i}"
        for i in range(10_000)
        if nodes.node_for_slot(key_slot(main_key(prefix, f"{tag}:{i}").encode())).port == node.port
    )


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
