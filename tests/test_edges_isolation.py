"""Issue 9 (item 6): a frozen node delays only the decisions that need it.

One primary of a private cluster is SIGSTOPped (it accepts TCP and never answers). The
cluster has no replicas and Redis' default node timeout (15 s), so nothing is failed over
and the cluster stays up while a test runs (a few seconds): the frozen node is simply
silent. Decisions whose identifiers live on the other primaries must keep their normal
latency and succeed, and the breaker must stay closed, also when the client has to refresh
its view of the cluster (``CLUSTER SLOTS``) while the node is frozen.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from redis.crc import key_slot

import cluster
from aiolimit import BackendError, Decision, Limit, Limiter
from aiolimit._keys import main_key

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

LIMITS = [Limit(1_000_000, per=3600)]
DEADLINE = 1.0
#: A decision on a healthy shard must stay this fast while another primary is frozen.
FAST = 0.5
#: How long healthy decisions are watched while the node is frozen.
WATCH = 2.0


@pytest.fixture(scope="module")
def calm_cluster() -> Iterator[cluster.Cluster]:
    """3 primaries, no replicas, node timeout 15 s: a stopped primary is never failed over
    within a test. Tests resume what they stop (``heal``) before they return."""
    nodes = cluster.start_cluster(replicas_per_primary=0, node_timeout_ms=15000)
    with nodes:
        yield nodes


def by_primary(nodes: cluster.Cluster, prefix: str, per_node: int = 2) -> dict[int, list[str]]:
    """``per_node`` identifiers (distinct slots) on each primary, by the primary's port."""
    found: dict[int, list[str]] = {node.port: [] for node in nodes.primaries()}
    slots: set[int] = set()
    for i in range(100_000):
        identifier = f"user:{i}"
        slot = key_slot(main_key(prefix, identifier).encode())
        port = nodes.node_for_slot(slot).port
        if slot not in slots and len(found[port]) < per_node:
            found[port].append(identifier)
            slots.add(slot)
        if all(len(ids) == per_node for ids in found.values()):
            return found
    raise AssertionError("could not spread identifiers over the primaries")


async def timed(limiter: Limiter, ids: list[str]) -> tuple[float, object]:
    """(seconds, the decision or the BackendError raised)."""
    started = time.monotonic()
    try:
        outcome: object = await limiter.try_acquire(ids)
    except BackendError as error:
        outcome = error
    return time.monotonic() - started, outcome


async def watch_healthy(limiter: Limiter, healthy: list[list[str]]) -> list[tuple[float, object]]:
    """Decisions on healthy shards for WATCH seconds: 4 concurrent streams, one after another
    in each stream (a slow decision cannot hide behind a fast one)."""
    results: list[tuple[float, object]] = []
    stop = time.monotonic() + WATCH

    async def stream(offset: int) -> None:
        n = offset
        while time.monotonic() < stop:
            results.append(await timed(limiter, healthy[n % len(healthy)]))
            n += 1
            await asyncio.sleep(0.01)

    await asyncio.gather(*(stream(offset) for offset in range(4)))
    return results


def check_unaffected(results: list[tuple[float, object]], limiter: Limiter) -> None:
    slow = [seconds for seconds, _ in results if seconds >= FAST]
    failed = [
        outcome
        for _, outcome in results
        if not (isinstance(outcome, Decision) and outcome.allowed and not outcome.degraded)
    ]
    assert len(results) >= 20
    assert not failed, f"{len(failed)} of {len(results)} healthy decisions failed: {failed[:2]}"
    store_statistics = limiter.store.statistics()  # type: ignore[attr-defined]
    assert not slow, (
        f"{len(slow)} of {len(results)} took >= {FAST}s, up to {max(slow):.2f}s; {store_statistics}"
    )
    assert limiter.statistics().breaker.state == "closed"


async def reset_connections(nodes: list[cluster.Node]) -> int:
    """Resets the clients' connections to ``nodes`` every 0.1 s while healthy decisions are
    watched; returns how many times. Each reset makes the client's next call on those nodes
    fail with a connection error, after which redis-py refreshes its topology from a
    startup node it picks at random (so a frozen one is picked within a few resets)."""
    stop = time.monotonic() + WATCH - 0.2
    times = 0
    while time.monotonic() < stop:
        await asyncio.sleep(0.1)
        for node in nodes:
            node.execute("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        times += 1
    return times


def healthy_requests(ids: dict[int, list[str]], frozen: cluster.Node) -> list[list[str]]:
    """One-slot and two-slot requests touching only the primaries that are not ``frozen``."""
    (p, q) = [port for port in ids if port != frozen.port]
    return [[ids[p][0]], [ids[q][0]], [ids[p][1], ids[q][1]], [ids[p][0], ids[q][1]]]


async def test_frozen_primary_leaves_other_shards_alone(
    calm_cluster: cluster.Cluster, prefix: str
) -> None:
    """A SIGSTOPped (non-seed) primary: decisions on the other primaries stay fast and
    admitted, and the breaker stays closed."""
    nodes = calm_cluster
    ids = by_primary(nodes, prefix)
    frozen = next(node for node in nodes.primaries() if node is not nodes.nodes[0])
    async with Limiter(nodes.url, LIMITS, prefix=prefix, deadline=DEADLINE) as limiter:
        await limiter.peek([identifier for group in ids.values() for identifier in group])
        frozen.pause()
        try:
            results = await watch_healthy(limiter, healthy_requests(ids, frozen))
        finally:
            nodes.heal()
        check_unaffected(results, limiter)


async def test_frozen_seed_does_not_stall_a_topology_refresh(
    calm_cluster: cluster.Cluster, prefix: str
) -> None:
    """The seed primary is SIGSTOPped and the client must refresh its topology (its
    connections to the healthy primaries were reset): healthy decisions stay fast and
    admitted, and the breaker stays closed."""
    nodes = calm_cluster
    ids = by_primary(nodes, prefix)
    frozen = nodes.nodes[0]  # the seed: the first node asked for CLUSTER SLOTS
    healthy_nodes = [node for node in nodes.primaries() if node is not frozen]
    async with Limiter(nodes.url, LIMITS, prefix=prefix, deadline=DEADLINE) as limiter:
        await limiter.peek([identifier for group in ids.values() for identifier in group])
        frozen.pause()
        try:
            results, refreshes = await asyncio.gather(
                watch_healthy(limiter, healthy_requests(ids, frozen)),
                reset_connections(healthy_nodes),
            )
            assert refreshes >= 10
        finally:
            nodes.heal()
        check_unaffected(results, limiter)


async def test_failures_on_a_frozen_shard_do_not_open_the_breaker_for_the_others(
    calm_cluster: cluster.Cluster, prefix: str
) -> None:
    """After a burst of decisions that need the frozen primary failed at their deadline, the
    decisions on the other primaries stay fast and admitted: the breaker does not turn one
    frozen shard's failures into everyone's."""
    nodes = calm_cluster
    ids = by_primary(nodes, prefix)
    frozen = next(node for node in nodes.primaries() if node is not nodes.nodes[0])
    async with Limiter(nodes.url, LIMITS, prefix=prefix, deadline=DEADLINE) as limiter:
        await limiter.peek([identifier for group in ids.values() for identifier in group])
        frozen.pause()
        try:
            # A burst that needs the frozen primary (its failures come at one deadline), then
            # the healthy shards. (Healthy decisions in flight while the breaker opens would
            # close it again with their success, by chance: they are not mixed in.)
            doomed_results = await asyncio.gather(
                *(timed(limiter, [ids[frozen.port][n % 2]]) for n in range(50))
            )
            results = await watch_healthy(limiter, healthy_requests(ids, frozen))
        finally:
            nodes.heal()
        assert all(isinstance(outcome, BackendError) for _, outcome in doomed_results)
        slow = [seconds for seconds, _ in results if seconds >= FAST]
        failed = [
            outcome
            for _, outcome in results
            if not (isinstance(outcome, Decision) and outcome.allowed and not outcome.degraded)
        ]
        assert not failed, f"{len(failed)} of {len(results)} healthy decisions failed"
        assert not slow, f"{len(slow)} of {len(results)} healthy decisions took >= {FAST}s"
