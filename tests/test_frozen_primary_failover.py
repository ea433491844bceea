"""A primary frozen (SIGSTOP) for good and failed over (from an adversarial review).

A frozen node accepts TCP and never answers, so redis-py never learns from an error that its
slot map is stale: decisions cut at their deadline must make the client reload it, or every
decision on that node's slots (and, through the TIME authority, on every slot) keeps asking
the frozen node after its replica took over. Each test has a private 3+3 cluster (node
timeout 1 s: the replica is promoted in 2-3 s).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from redis.crc import key_slot

import cluster
from aiolimit import AuthorityClock, BackendError, Limit, Limiter
from aiolimit._keys import main_key

pytestmark = [pytest.mark.cluster]


def served_by(nodes: cluster.Cluster, prefix: str, node: cluster.Node, *, on: bool) -> str:
    """An identifier whose slot ``node`` serves (``on``), or another primary does."""
    return next(
        f"e:{i}"
        for i in range(10_000)
        if (nodes.node_for_slot(key_slot(main_key(prefix, f"e:{i}").encode())).port == node.port)
        is on
    )


async def decide_until(limiter: Limiter, ident: str, within: float) -> tuple[float, list[Any]]:
    """Tries ``ident`` until a decision comes back: (seconds it took, errors met)."""
    started = time.monotonic()
    errors: list[Any] = []
    while time.monotonic() - started < within:
        try:
            await limiter.try_acquire(ident)
            return time.monotonic() - started, errors
        except BackendError as error:
            errors.append(error)
            await asyncio.sleep(0.05)
    return float("inf"), errors


@pytest.mark.parametrize("role", ["authority", "data"])
async def test_decisions_follow_a_frozen_primarys_slots_to_its_promoted_replica(
    fresh_cluster: cluster.Cluster, prefix: str, role: str
) -> None:
    """The slot-0 primary is frozen for good and its replica promoted. Decisions that need
    it (as the TIME authority, or as the owner of the identifier's slot) work again within
    a few seconds of the promotion: the deadline's cut made the client reload its slot map."""
    nodes = fresh_cluster
    frozen = nodes.node_for_slot(0)
    seed = next(node for node in nodes.primaries() if node.port != frozen.port)
    url = f"redis+cluster://{seed.host}:{seed.port}"
    ident = served_by(nodes, prefix, frozen, on=role == "data")
    clock = AuthorityClock(url) if role == "authority" else None
    limiter = Limiter(
        url, [Limit(1000, per=60)], prefix=prefix, clock=clock, deadline=1.0, recovery_time=0.2
    )
    try:
        await limiter.try_acquire(ident)
        frozen.pause()
        with pytest.raises(BackendError):
            await limiter.try_acquire(ident)  # cut at the deadline
        await asyncio.to_thread(nodes.wait_for_failover, frozen)
        took, errors = await decide_until(limiter, ident, within=6.0)
    finally:
        await limiter.aclose()
        if clock is not None:
            await clock.aclose()
    assert took < 3.0, (took, errors[-3:])


async def test_the_breaker_of_a_node_that_left_the_cluster_does_not_stay_open(
    fresh_cluster: cluster.Cluster, prefix: str
) -> None:
    """A frozen primary's breaker opens; its replica takes over and decisions go through
    again. ``statistics().breaker`` (and the metrics' breaker state) then report closed:
    the frozen node no longer serves any slot, so no decision will ever probe its breaker,
    and an open breaker there would report the store as down for good."""
    nodes = fresh_cluster
    frozen = nodes.node_for_slot(0)
    seed = next(node for node in nodes.primaries() if node.port != frozen.port)
    url = f"redis+cluster://{seed.host}:{seed.port}"
    ident = served_by(nodes, prefix, frozen, on=True)
    limiter = Limiter(url, [Limit(1000, per=60)], prefix=prefix, deadline=0.5, failure_threshold=1)
    try:
        await limiter.try_acquire(ident)
        frozen.pause()
        with pytest.raises(BackendError):
            await limiter.try_acquire(ident)
        assert limiter.statistics().breaker.state == "open"
        await asyncio.to_thread(nodes.wait_for_failover, frozen)
        took, errors = await decide_until(limiter, ident, within=6.0)
        assert took < 3.0, (took, errors[-3:])
        stats = limiter.statistics().breaker
    finally:
        await limiter.aclose()
    assert stats.state == "closed", stats
    assert stats.opened >= 1 and stats.failures >= 1, stats  # (totals never go back)
