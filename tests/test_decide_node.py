"""decide_node (lua/decide.lua): one cluster node's calls, on several slots, in one script run.

The cluster store sends the calls a tick holds for one node as one FCALL. Their keys cannot be
declared (a declared key routes the call, and all of them must share its slot), so the
function is flagged ``allow-cross-slot-keys`` and takes its keys as arguments. Its promises:
the replies and the stored state are those of the same calls sent one by one with their keys
declared; a call whose keys the node cannot serve now (a stale slot map, a slot half
migrated) is refused alone and writes nothing, where a declared key would have been refused
at the command's entry; and the store sends such a call again through the cluster's
redirections, charged once.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.crc import key_slot
from redis.exceptions import AskError
from test_decide_many import T0, _state, _value, _workload
from test_decide_many import _one_by_one as _alone

import cluster
from aiolimit import Limit, Limiter, SlidingLog
from aiolimit._calls import Call, Mode, decide_library, encode
from aiolimit._keys import main_key
from aiolimit._stores.cluster import ClusterStore
from aiolimit._stores.resp import command_head, pack_many

pytestmark = pytest.mark.cluster


def _slot_of(prefix: str, identifier: str) -> int:
    return key_slot(main_key(prefix, identifier).encode())


def _owned(nodes: cluster.Cluster, node: cluster.Node, prefix: str, count: int) -> list[str]:
    """``count`` identifiers on ``node``, each on a slot of its own."""
    found: dict[int, str] = {}
    for i in range(20_000):
        identifier = f"ip:{i}"
        slot = _slot_of(prefix, identifier)
        if slot not in found and nodes.node_for_slot(slot).port == node.port:
            found[slot] = identifier
            if len(found) == count:
                return list(found.values())
    raise AssertionError(f"not {count} identifiers on {node!r}")


def _sharing_a_slot(nodes: cluster.Cluster, node: cluster.Node, prefix: str) -> list[str]:
    """Two identifiers on ``node`` whose keys hash to the same slot."""
    seen: dict[int, str] = {}
    for i in range(200_000):
        identifier = f"user:{i}"
        slot = _slot_of(prefix, identifier)
        if nodes.node_for_slot(slot).port != node.port:
            continue
        if slot in seen:
            return [seen[slot], identifier]
        seen[slot] = identifier
    raise AssertionError("no two identifiers share a slot")


@pytest.fixture
async def primary(local_cluster: cluster.Cluster) -> AsyncIterator[tuple[cluster.Node, Redis]]:
    """The cluster's first primary and a plain client of that one node, the library loaded."""
    node = local_cluster.primaries()[0]
    client = Redis(host=node.host, port=node.port)
    await client.execute_command("FUNCTION", "LOAD", "REPLACE", decide_library().code)
    yield node, client
    await client.aclose()


async def _on_node(client: Redis, calls: Sequence[Call]) -> list[Any]:
    """The calls as one FCALL of decide_node, packed as the cluster store packs them: their
    replies as comparable data."""
    return [_value(item) for item in await _node_replies(client, calls)]


async def _node_replies(client: Redis, calls: Sequence[Call]) -> list[Any]:
    """The calls as one FCALL of decide_node: their replies as redis-py reads them."""
    connection = await client.connection_pool.get_connection()
    try:
        head = command_head("FCALL", decide_library().node)
        await connection.send_packed_command(pack_many(head, calls, spread=True))
        reply = await connection.read_response()
    finally:
        await client.connection_pool.release(connection)
    assert isinstance(reply, list) and len(reply) == len(calls)
    return reply


async def _held(client: Redis, key: str) -> bytes | str:
    """A key's serialized value on this node, or "gone" (a migrating slot answers ASK for a
    key it does not hold)."""
    try:
        value = await client.dump(key)
    except AskError:
        return "gone"
    return value if value is not None else "gone"


@pytest.mark.parametrize(("seed", "idle"), [(11, False), (12, False), (13, True)])
async def test_a_node_batch_decides_and_writes_exactly_as_its_calls_one_by_one(
    local_cluster: cluster.Cluster,
    primary: tuple[cluster.Node, Redis],
    prefix: str,
    seed: int,
    idle: bool,
) -> None:
    """decide_many's random programs (every algorithm, aux keys, ops, undos, errors), on
    identifiers spread over five slots of one node, two of them sharing a slot (so a call may
    name both): batches of 1-12 calls across slots answer and store exactly as alone."""
    node, client = primary
    groups = [
        _sharing_a_slot(local_cluster, node, prefix),
        *([identifier] for identifier in _owned(local_cluster, node, prefix, 4)),
    ]
    alone = _workload(f"{prefix}a", seed, 240, idle=idle, groups=groups)
    batched = _workload(f"{prefix}b", seed, 240, idle=idle, groups=groups)
    expected = await _alone(client, alone)
    rng = random.Random(seed)
    got: list[Any] = []
    at = 0
    while at < len(batched):
        size = rng.randrange(1, 13)
        got += await _on_node(client, batched[at : at + size])
        at += size
    assert got == expected
    admitted = sum(1 for reply in expected if isinstance(reply, list) and reply[0] == 1)
    errors = sum(1 for reply in expected if isinstance(reply, tuple))
    assert admitted > 40 and errors > 3, (admitted, errors)
    # One identifier (its hash and two aux keys) and two sharing a slot (six keys) both ran.
    assert {len(call.keys) for call in batched} == {3, 6}
    assert await _state(client, f"{prefix}b") == await _state(client, f"{prefix}a")


async def test_a_call_on_a_slot_of_another_node_is_refused_alone_and_writes_nothing(
    local_cluster: cluster.Cluster, primary: tuple[cluster.Node, Redis], prefix: str
) -> None:
    node, client = primary
    here = _owned(local_cluster, node, prefix, 2)
    other = local_cluster.primaries()[1]
    (elsewhere,) = _owned(local_cluster, other, prefix, 1)
    limiter = Limiter("memory://", [Limit(10, per=60, precision=1)], prefix=prefix)
    calls = [
        encode(Mode.ACQUIRE, limiter._rules.plans(ident), 3, T0, 0, f"c:{n}:")
        for n, ident in enumerate([here[0], elsewhere, here[1]], 1)
    ]
    first, misplaced, last = await _on_node(client, calls)
    assert misplaced[0] == "error" and misplaced[1].startswith("aiolimit: unserved: ")
    assert first[0] == 1 and first[4] == 7 and last[0] == 1 and last[4] == 7
    key = main_key(prefix, elsewhere)
    assert other.client.exists(key) == 0  # nothing where it belongs (nor here: not its slot)


async def test_a_call_on_a_half_migrated_slot_writes_nothing(
    fresh_cluster: cluster.Cluster, prefix: str
) -> None:
    """An identifier under two sliding logs has three keys: its hash and one sorted set per
    log. Its slot starts migrating and one sorted set has moved. An undo of its charge, in a
    node batch, would credit the first log and then fail on the second (Redis keeps a failed
    script's writes): it must be refused before it writes, as a declared key would have been
    (TRYAGAIN). The other call of the batch runs."""
    nodes = fresh_cluster
    source, target = nodes.primaries()[:2]
    (identifier,) = _owned(nodes, source, prefix, 1)
    (bystander,) = [i for i in _owned(nodes, source, prefix, 2) if i != identifier][:1]
    limits = [SlidingLog(5, per=60), SlidingLog(10, per=3600)]
    limiter = Limiter("memory://", limits, prefix=prefix)
    (plan,) = limiter._rules.plans(identifier)
    main, first_log, second_log = plan.keys
    client = Redis(host=source.host, port=source.port)
    try:
        await client.execute_command("FUNCTION", "LOAD", "REPLACE", decide_library().code)
        charge = encode(Mode.ACQUIRE, [plan], 2, T0, 0, "c:1:")
        assert (await _alone(client, [charge]))[0][0] == 1
        before = {key: await _held(client, key) for key in (main, first_log)}
        slot = _slot_of(prefix, identifier)
        target.execute("CLUSTER", "SETSLOT", slot, "IMPORTING", source.node_id)
        source.execute("CLUSTER", "SETSLOT", slot, "MIGRATING", target.node_id)
        source.execute("MIGRATE", target.host, target.port, "", 0, 5000, "KEYS", second_log)
        undo = encode(Mode.UNDO, [plan], 2, T0 + 1000, 0, "c:1:")
        other = encode(Mode.ACQUIRE, limiter._rules.plans(bystander), 1, T0, 0, "c:2:")
        refused, ran = await _on_node(client, [undo, other])
        assert refused[0] == "error" and refused[1].startswith("aiolimit: unserved: ")
        assert ran[0] == 1
        assert {key: await _held(client, key) for key in (main, first_log)} == before
    finally:
        await client.aclose()


async def test_the_store_resends_a_call_its_stale_slot_map_misplaced(
    fresh_cluster: cluster.Cluster, prefix: str
) -> None:
    """A limiter's slot map goes stale: one identifier's slot moves to another primary. That
    identifier's calls still go to the old node, in one batch with calls on slots it keeps;
    they are refused there, resent through the cluster client, and charged once where the
    slot now lives. The calls beside them are not disturbed."""
    nodes = fresh_cluster
    source, target = nodes.primaries()[:2]
    moving, *staying = _owned(nodes, source, prefix, 4)
    limit = Limit(100, per=60, precision=1)
    async with Limiter(nodes.url, [limit], prefix=prefix, deadline=5.0) as limiter:
        store = limiter.store
        assert isinstance(store, ClusterStore)
        for identifier in (moving, *staying):  # the slot map and the library, loaded
            assert (await limiter.try_acquire(identifier)).allowed
        nodes.migrate_slots([_slot_of(prefix, moving)], target)
        redirects = store.statistics().redirects
        wanted = [moving] * 6 + staying * 3
        decisions = await asyncio.gather(*(limiter.try_acquire(i) for i in wanted))
        assert all(decision.allowed for decision in decisions)
        assert store.statistics().redirects > redirects
        left = {identifier: (await limiter.peek(identifier)).remaining for identifier in wanted}
    assert left == {moving: 100 - 7, **dict.fromkeys(staying, 100 - 4)}
    slot = _slot_of(prefix, moving)
    assert source.execute("CLUSTER", "COUNTKEYSINSLOT", slot) == 0
    assert target.client.exists(main_key(prefix, moving)) == 1
