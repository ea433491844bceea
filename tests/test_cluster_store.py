"""The cluster store on the real local 3+3 cluster: routing, all or nothing across primaries,
pipelines per node (shared by concurrent decisions), NOSCRIPT, and typed errors for bad or
broken clusters.

Stored state is read back raw (HGETALL of each identifier's main key) and compared exactly.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator

import pytest
from _workers import bucket_counts
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

import cluster
from aiolimit import BackendUnavailable, ConfigurationError, Limit, Limiter
from aiolimit._keys import main_key
from aiolimit._stores.cluster import ClusterStore

pytestmark = pytest.mark.cluster

LIMITS = [Limit(3, per=600, precision=10), Limit(5, per=3600, precision=60)]


def wire(limit: Limit) -> str:
    """The ``<period µs>/<precision µs>:`` part of a limit's bucket fields."""
    return f"{round(limit.per * 1e6)}/{round((limit.precision or limit.per) * 1e6)}:"


def charged(fields: dict[str, str], limit: Limit) -> int:
    """Total weight stored in ``limit``'s buckets (fields ``<code><P>/<p>:<index>``)."""
    tail = wire(limit)
    counts = bucket_counts(fields)
    return sum(weight for name, weight in counts.items() if name[1:].startswith(tail))


def owners(nodes: cluster.Cluster, prefix: str, identifiers: list[str]) -> list[int]:
    """The port of the primary owning each identifier's slot."""
    return [
        nodes.node_for_slot(key_slot(main_key(prefix, ident).encode())).port
        for ident in identifiers
    ]


def on_distinct_primaries(nodes: cluster.Cluster, prefix: str, count: int) -> list[str]:
    """``count`` identifiers whose slots are owned by ``count`` different primaries."""
    found: dict[int, str] = {}
    for i in range(10_000):
        ident = f"user:{i}"
        (port,) = owners(nodes, prefix, [ident])
        found.setdefault(port, ident)
        if len(found) == count:
            return list(found.values())
    raise AssertionError("could not spread identifiers over the primaries")


def same_slot_pair(prefix: str) -> list[str]:
    """Two distinct identifiers whose main keys hash to the same slot."""
    seen: dict[int, str] = {}
    for i in range(200_000):
        ident = f"ip:{i}"
        slot = key_slot(main_key(prefix, ident).encode())
        if slot in seen:
            return [seen[slot], ident]
        seen[slot] = ident
    raise AssertionError("no slot collision found")


@pytest.fixture(params=["redis", "valkey"])
def any_cluster(request: pytest.FixtureRequest) -> cluster.Cluster:
    """The session's Redis cluster, or a Valkey one: these tests run on both."""
    name = "local_cluster" if request.param == "redis" else "valkey_cluster"
    nodes: cluster.Cluster = request.getfixturevalue(name)
    return nodes


@pytest.fixture
async def raw(any_cluster: cluster.Cluster) -> AsyncIterator[RedisCluster]:
    client = RedisCluster.from_url(any_cluster.seed_url, decode_responses=True)
    yield client
    await client.aclose()


@pytest.fixture
async def limiter(any_cluster: cluster.Cluster, prefix: str) -> AsyncIterator[Limiter]:
    async with Limiter(any_cluster.url, LIMITS, prefix=prefix, deadline=5.0) as limiter:
        yield limiter


async def snapshot(raw: RedisCluster, prefix: str, identifiers: list[str]) -> dict[str, dict]:
    return {ident: await raw.hgetall(main_key(prefix, ident)) for ident in identifiers}


async def test_cross_primary_admission_charges_every_pair_once(
    limiter: Limiter, raw: RedisCluster, any_cluster: cluster.Cluster, prefix: str
) -> None:
    """Identifiers on three primaries: an admitted weight is stored once on every pair."""
    ids = on_distinct_primaries(any_cluster, prefix, 3)
    assert len(set(owners(any_cluster, prefix, ids))) == 3
    decision = await limiter.try_acquire(ids, 2)
    assert decision.allowed
    for fields in (await snapshot(raw, prefix, ids)).values():
        assert [charged(fields, limit) for limit in LIMITS] == [2, 2]
    assert limiter.statistics().multi_slot_decisions == 1


async def test_refusal_on_one_primary_leaves_every_slot_unchanged(
    limiter: Limiter, raw: RedisCluster, any_cluster: cluster.Cluster, prefix: str
) -> None:
    """One identifier full: the cross-slot request is refused and no slot changes at all."""
    ids = on_distinct_primaries(any_cluster, prefix, 3)
    await limiter.try_acquire(ids, 1)
    assert (await limiter.try_acquire(ids[1], 2)).allowed  # ids[1] is now at 3 of 3
    before = await snapshot(raw, prefix, ids)
    ops_before = sorted(await raw.keys(f"{prefix}:*:op:*", target_nodes=RedisCluster.PRIMARIES))
    decision = await limiter.try_acquire(ids, 1)
    assert not decision.allowed
    assert decision.identifier == ids[1]
    assert await snapshot(raw, prefix, ids) == before
    # A refusal at check writes no op record either.
    ops_after = sorted(await raw.keys(f"{prefix}:*:op:*", target_nodes=RedisCluster.PRIMARIES))
    assert ops_after == ops_before


async def test_shared_slot_is_one_call(limiter: Limiter, raw: RedisCluster, prefix: str) -> None:
    """Identifiers whose keys share a slot are decided by one atomic call, no two phases."""
    ids = same_slot_pair(prefix)
    store = limiter.store
    assert isinstance(store, ClusterStore)
    before = store.statistics().round_trips
    assert (await limiter.try_acquire(ids, 1)).allowed
    assert store.statistics().round_trips - before == 1
    assert limiter.statistics().multi_slot_decisions == 0
    for fields in (await snapshot(raw, prefix, ids)).values():
        assert [charged(fields, limit) for limit in LIMITS] == [1, 1]


async def test_calls_for_one_node_share_a_pipeline(
    limiter: Limiter, any_cluster: cluster.Cluster, prefix: str
) -> None:
    """Six slots on three primaries cost three pipelines per phase: six round trips in all."""
    ids: list[str] = []
    per_node: dict[int, int] = {}
    for i in range(10_000):
        ident = f"user:{i}"
        (port,) = owners(any_cluster, prefix, [ident])
        if per_node.get(port, 0) < 2:
            per_node[port] = per_node.get(port, 0) + 1
            ids.append(ident)
        if len(ids) == 6:
            break
    store = limiter.store
    assert isinstance(store, ClusterStore)
    before = store.statistics()
    assert (await limiter.try_acquire(ids, 1)).allowed
    after = store.statistics()
    assert after.calls - before.calls == 12  # a check and a commit per slot
    assert after.round_trips - before.round_trips == 6  # one pipeline per node per phase


def two_per_primary(nodes: cluster.Cluster, prefix: str, start: int = 0) -> list[str]:
    """Six identifiers in six distinct slots, two on each primary."""
    ids: list[str] = []
    per_node: dict[int, int] = {}
    slots: set[int] = set()
    for i in range(start, start + 10_000):
        ident = f"user:{i}"
        slot = key_slot(main_key(prefix, ident).encode())
        (port,) = owners(nodes, prefix, [ident])
        if per_node.get(port, 0) < 2 and slot not in slots:
            per_node[port] = per_node.get(port, 0) + 1
            slots.add(slot)
            ids.append(ident)
        if len(ids) == 6:
            return ids
    raise AssertionError("could not spread identifiers over the primaries")


async def test_concurrent_decisions_share_pipelines_and_admit_exactly(
    limiter: Limiter, raw: RedisCluster, any_cluster: cluster.Cluster, prefix: str
) -> None:
    """200 concurrent decisions on six slots make far fewer round trips than decisions;
    admitted == capacity, and stored == admitted for every identifier and limit."""
    singles = two_per_primary(any_cluster, prefix)[:4]
    pair = on_distinct_primaries(any_cluster, prefix, 2)  # two phases, cross-slot
    requests = [[singles[i % 4]] for i in range(150)] + [pair for _ in range(50)]
    store = limiter.store
    assert isinstance(store, ClusterStore)
    before = store.statistics()
    decisions = await asyncio.gather(*(limiter.try_acquire(ids, 1) for ids in requests))
    after = store.statistics()
    admitted = {ident: 0 for ident in [*singles, *pair]}
    for ids, decision in zip(requests, decisions, strict=True):
        if decision.allowed:
            for ident in ids:
                admitted[ident] += 1
    capacity = LIMITS[0].amount
    assert [admitted[ident] for ident in singles] == [capacity] * 4
    assert 0 < admitted[pair[0]] == admitted[pair[1]] <= capacity  # races may undo a winner
    stored = await snapshot(raw, prefix, [*singles, *pair])
    for ident, fields in stored.items():
        assert [charged(fields, limit) for limit in LIMITS] == [admitted[ident]] * 2, ident
    assert after.calls - before.calls >= 150 + 2 * 50  # a call per slot per phase
    assert after.round_trips - before.round_trips <= len(requests) // 10
    assert after.retries == before.retries and after.gave_up == before.gave_up


async def test_lost_script_on_one_primary_resends_only_its_calls(
    limiter: Limiter, raw: RedisCluster, any_cluster: cluster.Cluster, prefix: str
) -> None:
    """SCRIPT FLUSH and FUNCTION FLUSH on one primary: in a tick shared by every primary, only
    the calls routed to that primary are resent (as EVAL); each is admitted and charged once,
    and the next decisions there are FCALLs again (the library was loaded back)."""
    ids = two_per_primary(any_cluster, prefix)
    victim = any_cluster.node_for_slot(key_slot(main_key(prefix, ids[0]).encode()))
    on_victim = [ident for ident in ids if owners(any_cluster, prefix, [ident])[0] == victim.port]
    assert len(on_victim) == 2
    store = limiter.store
    assert isinstance(store, ClusterStore)
    warm = await asyncio.gather(*(limiter.try_acquire(i, 1) for i in ids))
    assert all(decision.allowed for decision in warm)
    victim.client.script_flush()
    victim.client.function_flush()
    before = store.statistics()
    decisions = await asyncio.gather(*(limiter.try_acquire(i, 1) for i in ids))
    after = store.statistics()
    assert all(decision.allowed for decision in decisions)
    assert after.noscript - before.noscript == len(on_victim)
    assert after.retries == before.retries
    again = await asyncio.gather(*(limiter.try_acquire(i, 1) for i in ids))
    assert all(decision.allowed for decision in again)
    assert store.statistics().noscript == after.noscript
    for fields in (await snapshot(raw, prefix, ids)).values():
        assert [charged(fields, limit) for limit in LIMITS] == [3, 3]


async def test_a_client_passed_in_is_used_and_left_open(
    redis_cluster_seed_url: str, prefix: str
) -> None:
    """A RedisCluster the user passes is used as is and not closed by the limiter."""
    client = RedisCluster.from_url(redis_cluster_seed_url)
    try:
        async with Limiter(client, LIMITS, prefix=prefix) as limiter:
            assert isinstance(limiter.store, ClusterStore)
            assert (await limiter.try_acquire(["user:1", "user:2"], 1)).allowed
        assert await client.ping()
    finally:
        await client.aclose()


async def test_lost_scripts_are_reloaded_without_double_charge(
    limiter: Limiter, raw: RedisCluster, any_cluster: cluster.Cluster, prefix: str
) -> None:
    """After SCRIPT FLUSH and FUNCTION FLUSH on every primary, decisions still succeed and
    charge once."""
    ids = on_distinct_primaries(any_cluster, prefix, 3)
    assert (await limiter.try_acquire(ids, 1)).allowed
    any_cluster.flush_scripts()
    store = limiter.store
    assert isinstance(store, ClusterStore)
    before = store.statistics().noscript
    assert (await limiter.try_acquire(ids, 1)).allowed
    assert store.statistics().noscript - before >= 3
    for fields in (await snapshot(raw, prefix, ids)).values():
        assert [charged(fields, limit) for limit in LIMITS] == [2, 2]


# --- bad input and broken clusters ----------------------------------------------------------


async def test_a_standalone_server_is_not_a_cluster(redis_url: str, prefix: str) -> None:
    """redis+cluster:// pointing at a standalone server: a ConfigurationError at once."""
    url = redis_url.replace("redis://", "redis+cluster://", 1).removesuffix("/0")
    async with Limiter(url, LIMITS, prefix=prefix, deadline=3.0) as limiter:
        started = time.monotonic()
        with pytest.raises(ConfigurationError, match="not in cluster mode"):
            await limiter.try_acquire("user:1")
        assert time.monotonic() - started < 1.0  # not retried until the deadline


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def test_no_cluster_listening_is_unavailable_within_the_deadline(prefix: str) -> None:
    """Nothing listens at the seed: BackendUnavailable, after retries, within the deadline."""
    url = f"redis+cluster://127.0.0.1:{free_port()}"
    async with Limiter(url, LIMITS, prefix=prefix, deadline=0.6) as limiter:
        started = time.monotonic()
        with pytest.raises(BackendUnavailable, match="attempts"):  # retried, then gave up
            await limiter.try_acquire(["user:1", "user:2"])
        assert time.monotonic() - started < 0.6 + 0.3


@pytest.mark.parametrize(
    "url",
    ["redis+cluster://127.0.0.1:7000/2", "redis+cluster:///", "redis+cluster://h:notaport"],
)
def test_malformed_cluster_urls_are_refused_at_construction(url: str) -> None:
    """A cluster URL with a database, no host or a bad port fails when the limiter is built."""
    with pytest.raises(ConfigurationError):
        Limiter(url, LIMITS)


@pytest.mark.slow
async def test_partially_down_cluster_gives_typed_errors_within_the_deadline(
    fresh_cluster: cluster.Cluster, prefix: str
) -> None:
    """A paused primary, then a primary dead with its replica: decisions that need them fail
    with BackendUnavailable within the deadline; none hangs."""
    nodes = fresh_cluster
    victim = nodes.primaries()[0]
    ids = on_distinct_primaries(nodes, prefix, 3)
    victim_id = ids[owners(nodes, prefix, ids).index(victim.port)]
    healthy = [ident for ident in ids if ident != victim_id]
    async with Limiter(nodes.url, LIMITS, prefix=prefix, deadline=0.8) as limiter:
        assert (await limiter.try_acquire(ids, 1)).allowed
        victim.pause()
        try:
            started = time.monotonic()
            with pytest.raises(BackendUnavailable):
                await limiter.try_acquire(ids, 1)
            assert time.monotonic() - started < 1.3
            # Slots on the other primaries are still served while one primary is paused.
            assert (await limiter.try_acquire(healthy, 1)).allowed
        finally:
            victim.resume()
        nodes.wait_healthy()
        owner = nodes.node_for_slot(key_slot(main_key(prefix, victim_id).encode()))
        its_replicas = [
            node for node in nodes.replicas() if int(node.execute("ROLE")[2]) == owner.port
        ]
        assert its_replicas
        owner.kill()
        for node in its_replicas:
            node.kill()  # its slots now have no node at all
        started = time.monotonic()
        with pytest.raises(BackendUnavailable):
            await limiter.try_acquire(ids, 1)
        assert time.monotonic() - started < 1.3


@pytest.mark.slow
async def test_a_paused_primary_fails_only_its_calls_in_a_shared_tick(
    fresh_cluster: cluster.Cluster, prefix: str
) -> None:
    """Decisions on every primary in one tick, one primary paused: its calls fail with
    BackendUnavailable at their deadline, the others are answered at once."""
    nodes = fresh_cluster
    ids = on_distinct_primaries(nodes, prefix, 3)
    victim = nodes.primaries()[0]
    stuck = ids[owners(nodes, prefix, ids).index(victim.port)]
    deadline = 0.8
    async with Limiter(nodes.url, LIMITS, prefix=prefix, deadline=deadline) as limiter:
        warm = await asyncio.gather(*(limiter.try_acquire(i, 1) for i in ids))
        assert all(decision.allowed for decision in warm)
        answered: dict[str, float] = {}

        async def decide(ident: str) -> object:
            try:
                return await limiter.try_acquire(ident, 1)
            except BackendUnavailable as exc:
                return exc
            finally:
                answered[ident] = time.monotonic() - started

        victim.pause()
        try:
            started = time.monotonic()
            results = dict(zip(ids, await asyncio.gather(*map(decide, ids)), strict=True))
        finally:
            victim.resume()
    assert isinstance(results.pop(stuck), BackendUnavailable)
    assert deadline - 0.2 < answered.pop(stuck) < deadline + 0.3
    assert all(getattr(decision, "allowed", False) for decision in results.values()), results
    assert max(answered.values()) < deadline / 2
