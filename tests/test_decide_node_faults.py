"""decide_node under faults: a call cut short part way, a migration, a cluster down, Valkey.

Found by an adversarial review of the first decide_node: a call can fail after it wrote (a
slot migrating while the call deletes a sorted set and touches it again: the node answers
"non local key"), and the servers word that error differently (Redis 7.0: "Script attempted
to access a non local key ...", Valkey: "Attempted to access ..."). So the script, not the
client, says which failed calls may be sent again: those that failed before their first
write, tagged "aiolimit: unserved: ". Each test starts a private 2-primary cluster
(redis-server, or Valkey where a binary is found) and stops it at the end.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import ResponseError
from test_decide_node import _node_replies as _on_node
from test_decide_node import _owned, _slot_of

import cluster
from aiolimit import Limit, Limiter, SlidingLog
from aiolimit._calls import Mode, decide_library, encode
from aiolimit._stores.cluster import ClusterStore, _unserved
from aiolimit.testing import ManualClock

pytestmark = pytest.mark.cluster

T0 = 1_700_000_000_000_000
VALKEY = cluster.find_valkey_binary()


def _start(kind: str) -> cluster.Cluster:
    if kind == "valkey" and VALKEY is None:
        pytest.skip("no valkey-server")
    return cluster.start_cluster(
        primaries=2, replicas_per_primary=0, binary=VALKEY if kind == "valkey" else None
    )


@pytest.fixture(params=["redis", "valkey"])
def nodes(request: pytest.FixtureRequest) -> Iterator[cluster.Cluster]:
    with _start(request.param) as started:
        yield started


@pytest.fixture
def redis_nodes() -> Iterator[cluster.Cluster]:
    with _start("redis") as started:
        yield started


@pytest.fixture
def valkey_nodes() -> Iterator[cluster.Cluster]:
    with _start("valkey") as started:
        yield started


def _start_migrating(source: cluster.Node, target: cluster.Node, slot: int) -> None:
    target.execute("CLUSTER", "SETSLOT", slot, "IMPORTING", source.node_id)
    source.execute("CLUSTER", "SETSLOT", slot, "MIGRATING", target.node_id)


# --- a call that failed after writing is not sent again ---------------------------------


async def _run_while_migrating(
    nodes: cluster.Cluster, slot: int, target: cluster.Node, *aws: Any
) -> list[Any]:
    """Runs ``aws`` together (one tick: one node batch); the first time the store resends a
    call, the slot's migration completes first (as it does during the store's deadline)."""
    original = ClusterStore._finish
    moved: list[bool] = []

    async def finish(self: ClusterStore, call: Any, first: BaseException, deadline: float) -> Any:
        if not moved:
            moved.append(True)
            nodes.migrate_slots([slot], target)
        return await original(self, call, first, deadline)

    ClusterStore._finish = finish  # type: ignore[method-assign]
    try:
        return await asyncio.gather(*aws, return_exceptions=True)
    finally:
        ClusterStore._finish = original  # type: ignore[method-assign]
        if not moved:
            nodes.migrate_slots([slot], target)


@pytest.mark.parametrize("batched", [True, False])
async def test_a_refund_cut_short_by_a_migration_is_not_given_twice(
    nodes: cluster.Cluster, batched: bool
) -> None:
    """SlidingLog(2/h) and SlidingLog(10/min): two admissions two minutes apart fill the hour
    log. Refund 1 while the slot is MIGRATING: the hour log is credited, then the minute log.
    The minute log used to be emptied there (its first entry had been trimmed) and its
    PEXPIRE met the missing key ("non local key", after a write); sent again once the slot
    had moved, the refund would have credited a second unit, and two requests would be
    admitted where one fits. Since the algorithms keep or skip what they empty (see
    tests/test_migrating_slot_writes.py) the refund runs whole, in a node batch or alone (one
    FCALL, keys declared), and is applied once: exactly one request fits."""
    prefix = "r2"
    source, target = nodes.primaries()[:2]
    identifier, bystander = _owned(nodes, source, prefix, 2)
    clock = ManualClock()
    url = f"redis+cluster://{source.host}:{source.port}"
    limits = [SlidingLog(2, per=3600), SlidingLog(10, per=60)]
    async with Limiter(url, limits, prefix=prefix, clock=clock, deadline=5.0) as limiter:
        assert (await limiter.try_acquire(identifier)).allowed
        assert (await limiter.try_acquire(bystander)).allowed
        clock.advance(120)
        assert (await limiter.try_acquire(identifier)).allowed  # the hour log is full
        _start_migrating(source, target, _slot_of(prefix, identifier))
        clock.advance(1)
        refunded, *_ = await _run_while_migrating(
            nodes, _slot_of(prefix, identifier), target,
            limiter.refund(identifier), *([limiter.try_acquire(bystander)] if batched else []),
        )  # fmt: skip
        admitted = [(await limiter.try_acquire(identifier)).allowed for _ in range(3)]
    assert not isinstance(refunded, BaseException), refunded
    # The invariant: never over-admit. One unit was given back, so one request fits.
    assert admitted == [True, False, False], admitted


# --- a call refused before writing is recognised on every server -----------------------


async def test_valkey_the_store_resends_a_call_its_stale_slot_map_misplaced(
    valkey_nodes: cluster.Cluster,
) -> None:
    """tests/test_decide_node.py's stale-slot-map test, on Valkey: its node words the refusal
    "Attempted to access a non local key in a cluster node" (no "Script "); the call is sent
    again all the same, and every decision is admitted."""
    nodes = valkey_nodes
    prefix = "r4"
    source, target = nodes.primaries()[:2]
    moving, *staying = _owned(nodes, source, prefix, 4)
    url = f"redis+cluster://{source.host}:{source.port}"
    async with Limiter(
        url, [Limit(100, per=60, precision=1)], prefix=prefix, deadline=5.0
    ) as limiter:
        for identifier in (moving, *staying):
            assert (await limiter.try_acquire(identifier)).allowed
        nodes.migrate_slots([_slot_of(prefix, moving)], target)
        wanted = [moving] * 6 + staying * 3
        decisions = await asyncio.gather(
            *(limiter.try_acquire(i) for i in wanted), return_exceptions=True
        )
    assert all(getattr(d, "allowed", False) for d in decisions), decisions


async def test_a_node_batch_refused_while_the_cluster_is_down_is_recognised(
    nodes: cluster.Cluster,
) -> None:
    """Cluster down (a slot unassigned): a node batch's calls fail at their first read, worded
    "Script attempted to execute a command while the cluster is down" by Redis 7.0 and "Can
    not execute a command 'hgetall' while the cluster is down" by Valkey. Both are tagged as
    failed before writing, so the store sends them again (through the cluster client, which
    meets CLUSTERDOWN and backs off)."""
    prefix = "r5"
    source, other = nodes.primaries()[:2]
    first, second = _owned(nodes, source, prefix, 2)
    (gone,) = _owned(nodes, other, prefix, 1)
    limiter = Limiter("memory://", [Limit(10, per=60)], prefix=prefix)
    client = Redis(host=source.host, port=source.port)
    try:
        await client.execute_command("FUNCTION", "LOAD", "REPLACE", decide_library().code)
        for node in nodes.primaries():  # unassigned everywhere: the cluster goes down
            node.execute("CLUSTER", "DELSLOTS", _slot_of(prefix, gone))
        calls = [
            encode(Mode.ACQUIRE, limiter._rules.plans(i), 1, T0, 0, f"c:{n}:")
            for n, i in enumerate([first, second], 1)
        ]
        for _ in range(50):
            replies = await _on_node(client, calls)
            if all(isinstance(r, ResponseError) for r in replies):
                break
            await asyncio.sleep(0.1)
        assert all(isinstance(r, ResponseError) for r in replies), replies
        assert all(_unserved(r) for r in replies), [str(r) for r in replies]
    finally:
        await client.aclose()
