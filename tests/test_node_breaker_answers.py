"""What a cluster limiter answers while one node's breaker is open (from an adversarial
review of the failure policy).

A private cluster without replicas (node timeout 15 s: a SIGSTOPped primary is never failed
over while a test runs); one primary is frozen until its breaker opens.
"""

from __future__ import annotations

import time

import pytest

import cluster
from aiolimit import BackendError, Limit, Limiter, RateLimited
from tests._nodes import on_node

pytestmark = [pytest.mark.cluster]

RECOVERY = 2.0


async def test_closed_policy_tells_when_a_frozen_nodes_breaker_will_probe(
    calm: cluster.Cluster, prefix: str
) -> None:
    """on_error="closed": while a node's breaker is open, a decision that needs that node is
    refused with retry_after = the time left before the breaker's probe (about
    recovery_time), not 1 ms; so acquire(timeout) shorter than that raises RateLimited at
    once instead of asking the breaker a thousand times a second."""
    frozen = calm.primaries()[0]
    ident = on_node(calm, prefix, "n", frozen)
    limiter = Limiter(
        calm.url,
        [Limit(10, per=60)],
        prefix=prefix,
        deadline=0.3,
        on_error="closed",
        failure_threshold=1,
        recovery_time=RECOVERY,
    )
    try:
        await limiter.peek(ident)
        frozen.pause()
        failed = await limiter.try_acquire(ident)  # the deadline: the node's breaker opens
        assert failed.degraded and not failed.allowed
        short = await limiter.try_acquire(ident)
        assert short.degraded and not short.allowed
        assert short.retry_after > RECOVERY / 2, short
        before = limiter.statistics()
        started = time.monotonic()
        with pytest.raises(RateLimited):
            await limiter.acquire(ident, timeout=0.5)
        took = time.monotonic() - started
        after = limiter.statistics()
    finally:
        calm.heal()
        await limiter.aclose()
    assert took < 0.25, took  # (polling until the timeout: 0.5 s)
    assert after.decisions - before.decisions == 1, (before, after)


async def test_reset_on_a_healthy_node_while_another_is_frozen(
    calm: cluster.Cluster, prefix: str
) -> None:
    """A decision on the frozen slot-0 primary fails at its deadline (the client then
    reloads its slot map before its next call); a reset and a decision on another node
    still answer at once: the reload skips the frozen node, and asks no one for COMMAND."""
    frozen = calm.node_for_slot(0)
    healthy = next(node for node in calm.primaries() if node.port != frozen.port)
    stuck, free = on_node(calm, prefix, "n", frozen), on_node(calm, prefix, "n", healthy)
    limiter = Limiter(calm.url, [Limit(10, per=60)], prefix=prefix, deadline=0.5)
    took: list[float] = []
    try:
        await limiter.try_acquire([stuck])
        await limiter.try_acquire([free])
        frozen.pause()
        with pytest.raises(BackendError):
            await limiter.try_acquire(stuck)
        for _ in range(5):
            started = time.monotonic()
            await limiter.reset(free)
            took.append(time.monotonic() - started)
            assert (await limiter.try_acquire(free)).allowed
    finally:
        calm.heal()
        await limiter.aclose()
    assert max(took) < 0.3, took
