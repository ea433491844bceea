"""The time a cross-slot decision's commit is judged at, under a TIME authority (from an
adversarial review).

Across slots the check phase reads the authority's TIME and the commit reuses it, saving a
round trip. When the check phase is slow (a node busy or failing over, its call retried),
the commit would charge at a time seconds in the past: the charge then leaves its window
that much early, and the identifier admits again too soon.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from redis.crc import key_slot

import cluster
from aiolimit import AuthorityClock, Limit, Limiter
from aiolimit._keys import main_key

pytestmark = [pytest.mark.cluster]

#: Seconds node B is busy (DEBUG SLEEP) while the decision's check waits for it.
BUSY = 1.3


@pytest.fixture(scope="module")
def calm() -> Iterator[cluster.Cluster]:
    nodes = cluster.start_cluster(replicas_per_primary=0, node_timeout_ms=15000)
    with nodes:
        yield nodes


def on_node(nodes: cluster.Cluster, prefix: str, tag: str, node: cluster.Node) -> str:
    return next(
        f"{tag}:{i}"
        for i in range(10_000)
        if nodes.node_for_slot(key_slot(main_key(prefix, f"{tag}:{i}").encode())).port == node.port
    )


async def test_a_slow_check_phase_does_not_date_the_commit_back(
    calm: cluster.Cluster, prefix: str
) -> None:
    """Limit(1, per=2, precision=0.5) on identifiers a and b (two nodes, neither of them
    busy with the authority's TIME). b's node sleeps 1.3 s while the decision's check waits
    on it. The decision is admitted when the commit runs; a request on a alone must then be
    refused for the next 1.5 s (per less one bucket): a charge judged at the time read
    before the check would leave the window 1.3 s early."""
    authority = calm.node_for_slot(0)
    busy = next(node for node in calm.primaries() if node.port != authority.port)
    other = next(node for node in calm.primaries() if node.port != busy.port)
    a, b = on_node(calm, prefix, "a", other), on_node(calm, prefix, "b", busy)
    clock = AuthorityClock(calm.url)
    limiter = Limiter(calm.url, [Limit(1, per=2, precision=0.5)], prefix=prefix, clock=clock)
    try:
        await limiter.peek([a, b])  # connections and scripts ready
        sleeping = asyncio.create_task(asyncio.to_thread(busy.execute, "DEBUG", "SLEEP", BUSY))
        await asyncio.sleep(0.05)
        first = await limiter.try_acquire([a, b])
        admitted_at = time.monotonic()
        await sleeping
        assert first.allowed, first
        again = []
        while time.monotonic() - admitted_at < 1.0:
            decision = await limiter.try_acquire(a)
            if decision.allowed:
                again.append(round(time.monotonic() - admitted_at, 3))
            await asyncio.sleep(0.05)
    finally:
        await limiter.aclose()
        await clock.aclose()
    assert again == [], f"a admitted again {again} s after the decision on [a, b]"
