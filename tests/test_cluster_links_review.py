"""Adversarial checks of the cluster store's links (``aiolimit/_stores/link.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from redis.asyncio.cluster import RedisCluster

import cluster
from aiolimit import BackendError, Limit, Limiter
from tests._nodes import kill_clients_repeatedly, on_node, settle, store_of, stored

pytestmark = [pytest.mark.cluster]


@pytest.mark.parametrize("pool", [1, 2])
async def test_a_user_client_with_a_small_pool_keeps_serving(
    calm: cluster.Cluster, prefix: str, pool: int
) -> None:
    """A user's ``RedisCluster(max_connections=1)``: a link must not hold the node's only
    connection for good (every retry, and the app's own commands, would then meet
    MaxConnectionsError until the deadline)."""
    client = RedisCluster.from_url(
        calm.url.replace("redis+cluster://", "redis://"), max_connections=pool
    )
    node = calm.primaries()[0]
    ident = on_node(calm, prefix, "m", node)
    limits = [Limit(1000, per=60)]
    limiter = Limiter(client, limits, prefix=prefix, deadline=1.0)
    admitted = 0
    try:
        for _ in range(10):
            admitted += (await limiter.try_acquire(ident)).allowed
            await asyncio.sleep(0.01)
        await client.set(f"{prefix}:{ident}:x", "1")  # the user's own use of its client
        assert admitted == 10
    finally:
        await limiter.aclose()
        await client.aclose()
    assert await stored(calm.url, prefix, ident, limits) == 10


async def test_a_resumed_node_answers_stale_pipelines_on_no_live_link(
    calm: cluster.Cluster, prefix: str
) -> None:
    """A node frozen with pipelines on its link, resumed at once: whatever it then runs of
    the old pipelines, new calls get their own replies, and what is stored is what the
    callers were told; the user's client (its pool had the link's connection back) reads
    its own replies."""
    client = RedisCluster.from_url(calm.url.replace("redis+cluster://", "redis://"))
    node = calm.primaries()[0]
    ident = on_node(calm, prefix, "s", node)
    limits = [Limit(100_000, per=3600)]
    limiter = Limiter(client, limits, prefix=prefix, deadline=0.3, failure_threshold=1_000_000)
    admitted = 0

    async def decide() -> None:
        nonlocal admitted
        try:
            decision = await limiter.try_acquire(ident)
        except BackendError:
            return
        assert not decision.degraded
        admitted += decision.allowed

    try:
        for _ in range(3):
            await asyncio.gather(*(decide() for _ in range(5)))
        assert f"127.0.0.1:{node.port}" in store_of(limiter)._links
        name = f"127.0.0.1:{node.port}"
        for _ in range(3):
            give_up = time.monotonic() + 5
            while name not in store_of(limiter)._links:  # (a new link after LINK_RETRY)
                assert time.monotonic() < give_up, "no link again"
                await asyncio.gather(*(decide() for _ in range(3)))
                await asyncio.sleep(0.05)
            node.pause()
            try:
                await asyncio.gather(*(decide() for _ in range(20)))
            finally:
                node.resume()
            for _ in range(10):
                await asyncio.gather(*(decide() for _ in range(10)))
                for i in range(5):
                    key = f"{{{prefix}}}:user:{i}"
                    await client.set(key, i)
                    assert await client.get(key) == str(i).encode()
        await settle(limiter)
        stats = store_of(limiter).statistics()
        assert stats.links_failed >= 3 and stats.links_opened >= 3, stats
    finally:
        await limiter.aclose()
        await client.aclose()
    assert admitted > 0
    assert await stored(calm.url, prefix, ident, limits) == admitted


async def test_resp3_user_client_goes_through_links(calm: cluster.Cluster, prefix: str) -> None:
    client = RedisCluster.from_url(calm.url.replace("redis+cluster://", "redis://"), protocol=3)
    primaries = calm.primaries()
    a, b = on_node(calm, prefix, "r", primaries[0]), on_node(calm, prefix, "r", primaries[1])
    limits = [Limit(10, per=3600)]
    limiter = Limiter(client, limits, prefix=prefix, deadline=1.0)
    try:
        told = []
        for _ in range(3):
            told += await asyncio.gather(*(limiter.try_acquire([a, b]) for _ in range(5)))
        assert sum(d.allowed for d in told) == 10
        assert store_of(limiter).statistics().links_opened == 2
        await settle(limiter)
    finally:
        await limiter.aclose()
        await client.aclose()
    assert await stored(calm.url, prefix, a, limits) == 10
    assert await stored(calm.url, prefix, b, limits) == 10


def _role(node: cluster.Node) -> str:
    role = node.execute("ROLE")[0]
    return role.decode() if isinstance(role, bytes) else str(role)


async def test_a_demoted_primarys_link_sends_no_decision_to_error(
    fresh_cluster: cluster.Cluster, prefix: str
) -> None:
    """A manual CLUSTER FAILOVER: the old primary, now a replica, still has a link and the
    client's slot map still names it. Decisions on its slots (one on two of its slots: a
    ``decide_node`` batch with no declared keys) must follow the new primary, not fail."""
    old = fresh_cluster.primaries()[0]
    a = on_node(fresh_cluster, prefix, "a", old)
    b = on_node(fresh_cluster, prefix, "b", old)
    limits = [Limit(100_000, per=3600)]
    limiter = Limiter(fresh_cluster.url, limits, prefix=prefix, deadline=2.0)
    admitted = 0
    try:
        for _ in range(3):
            told = await asyncio.gather(*(limiter.try_acquire([a, b]) for _ in range(5)))
            admitted += sum(decision.allowed for decision in told)
        assert f"127.0.0.1:{old.port}" in store_of(limiter)._links
        replica = next(
            node for node in fresh_cluster.replicas() if int(node.execute("ROLE")[2]) == old.port
        )
        replica.execute("CLUSTER", "FAILOVER")
        give_up = time.monotonic() + 10
        while _role(old) != "slave" or _role(replica) != "master":
            assert time.monotonic() < give_up, "no failover"
            await asyncio.sleep(0.05)
        errors = []
        for _ in range(10):
            outcomes = await asyncio.gather(
                *(limiter.try_acquire([a, b]) for _ in range(5)), return_exceptions=True
            )
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    errors.append(outcome)
                else:
                    assert not outcome.degraded
                    admitted += outcome.allowed
        await settle(limiter)
        assert errors == []
    finally:
        await limiter.aclose()
    assert await stored(fresh_cluster.url, prefix, a, limits) == admitted
    assert await stored(fresh_cluster.url, prefix, b, limits) == admitted


async def test_aclose_with_calls_on_a_frozen_nodes_link(calm: cluster.Cluster, prefix: str) -> None:
    """``aclose`` while calls wait on the link of a frozen node (deadline longer than the
    close grace): it returns within the grace, each call answers by its deadline, nothing is
    left running, and what is stored is what the callers were told."""
    client = RedisCluster.from_url(calm.url.replace("redis+cluster://", "redis://"))
    node = calm.primaries()[0]
    ident = on_node(calm, prefix, "z", node)
    limits = [Limit(1000, per=3600)]
    limiter = Limiter(client, limits, prefix=prefix, deadline=4.0, failure_threshold=10**6)
    for _ in range(3):
        assert (await limiter.try_acquire(ident)).allowed
    assert f"127.0.0.1:{node.port}" in store_of(limiter)._links
    before = asyncio.all_tasks()
    node.pause()
    try:
        calls = [asyncio.ensure_future(limiter.try_acquire(ident)) for _ in range(5)]
        await asyncio.sleep(0.1)
        started = time.monotonic()
        await limiter.aclose()
        took = time.monotonic() - started
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        answered = time.monotonic() - started
    finally:
        node.resume()
    assert took < 2.6, took
    assert answered < 4.2, answered
    await asyncio.sleep(0.2)
    left = [task for task in asyncio.all_tasks() - before if task is not asyncio.current_task()]
    await client.aclose()
    admitted = 3 + sum(
        1 for outcome in outcomes if not isinstance(outcome, BaseException) and outcome.allowed
    )
    assert left == [], left
    assert await stored(calm.url, prefix, ident, limits) == admitted


async def test_a_link_failing_while_aclose_cancels_an_opening_is_given_back(
    calm: cluster.Cluster, prefix: str
) -> None:
    """``aclose`` cancels a link still opening (to a frozen node) and awaits it; a link on
    another node that fails meanwhile (its connection killed) must still have its connection
    given back to the user's pool, not left checked out of it for the client's lifetime."""
    client = RedisCluster.from_url(calm.url.replace("redis+cluster://", "redis://"))
    frozen, other = calm.primaries()[0], calm.primaries()[1]
    a, b = on_node(calm, prefix, "a", frozen), on_node(calm, prefix, "b", other)
    limiter = Limiter(client, [Limit(1000, per=60)], prefix=prefix, deadline=0.3)
    store = store_of(limiter)
    try:
        await limiter.try_acquire(a)  # (loads the library on the node: no link yet)
        for _ in range(3):
            await limiter.try_acquire(b)
        link = store._links[f"127.0.0.1:{other.port}"]
        held = asyncio.ensure_future(client.blpop([f"{{{a}}}:nothing"], timeout=1))
        await asyncio.sleep(0.1)  # (the node's one free connection is taken)
        frozen.pause()
        try:
            with contextlib.suppress(BackendError):
                await limiter.try_acquire(a)  # (a link opens: its connect hangs)
            assert f"127.0.0.1:{frozen.port}" in store._opening
            host, port = link.connection._writer.get_extra_info("sockname")[:2]
            other.execute("CLIENT", "KILL", "ADDR", f"{host}:{port}")
            await store.aclose()
        finally:
            frozen.resume()
        pool = client.get_node(host="127.0.0.1", port=other.port)
        in_use = [c for c in pool._connections if c not in pool._free]
        assert link.connection not in in_use, "the failed link's connection was never given back"
        with contextlib.suppress(Exception):
            await held
    finally:
        await limiter.aclose()
        await client.aclose()


@pytest.mark.parametrize("amount", [40, 1_000_000])
async def test_silent_links_under_load_never_over_admit_nor_double_charge(
    calm: cluster.Cluster, prefix: str, amount: int
) -> None:
    """30 tasks decide on [a, b] (cross-slot) with a 0.3 s deadline while a's node sleeps
    0.4 s every 0.6 s: its links fail as NodeSilent with pipelines of many decisions on
    them, which the node runs late. Once settled, each identifier's stored charge is the
    number of decisions told "admitted", never above the limit."""
    primaries = calm.primaries()
    a, b = on_node(calm, prefix, "k", primaries[0]), on_node(calm, prefix, "k", primaries[1])
    limits = [Limit(amount, per=3600)]
    limiter = Limiter(calm.url, limits, prefix=prefix, deadline=0.3, failure_threshold=1_000_000)
    admitted = 0
    stop = asyncio.Event()

    async def decide() -> None:
        nonlocal admitted
        while not stop.is_set():
            try:
                decision = await limiter.try_acquire([a, b])
            except BackendError:
                await asyncio.sleep(0.01)
                continue
            assert not decision.degraded
            admitted += decision.allowed
            await asyncio.sleep(0.005)

    def sleeper() -> None:
        with contextlib.suppress(Exception):
            primaries[0].execute("DEBUG", "SLEEP", "0.4")

    try:
        await limiter.try_acquire([a, b])
        admitted = 1
        workers = [asyncio.ensure_future(decide()) for _ in range(30)]
        for _ in range(4):
            await asyncio.sleep(0.2)
            await asyncio.to_thread(sleeper)
        await asyncio.sleep(0.3)
        stop.set()
        await asyncio.gather(*workers)
        await settle(limiter)
        assert store_of(limiter).statistics().links_failed >= 2
    finally:
        await limiter.aclose()
    assert 0 < admitted <= amount
    assert await stored(calm.url, prefix, a, limits) == admitted
    assert await stored(calm.url, prefix, b, limits) == admitted


async def test_a_restarted_node_gets_a_link_again_and_charges_stay_exact(
    calm: cluster.Cluster, prefix: str
) -> None:
    """A primary restarted (same port, no persistence: its keys are gone) while decisions
    run on its link: calls answer by their deadline, the link comes back, and from then on
    what is stored is what the callers were told."""
    node = calm.primaries()[2]
    ident = on_node(calm, prefix, "t", node)
    limits = [Limit(1_000_000, per=3600)]
    limiter = Limiter(calm.url, limits, prefix=prefix, deadline=1.0, failure_threshold=10**6)
    name = f"127.0.0.1:{node.port}"
    admitted = 0
    stop = asyncio.Event()
    slowest = 0.0

    async def decide() -> None:
        nonlocal admitted, slowest
        while not stop.is_set():
            started = time.monotonic()
            try:
                decision = await limiter.try_acquire(ident)
            except BackendError:
                await asyncio.sleep(0.01)
                continue
            finally:
                slowest = max(slowest, time.monotonic() - started)
            admitted += decision.allowed

    try:
        for _ in range(3):
            await limiter.try_acquire(ident)
        assert name in store_of(limiter)._links
        workers = [asyncio.ensure_future(decide()) for _ in range(10)]
        await asyncio.sleep(0.2)
        await asyncio.to_thread(node.restart)
        await asyncio.sleep(0.3)
        stop.set()
        await asyncio.gather(*workers)
        await settle(limiter)
        assert slowest < 1.5, slowest
        before, admitted = await stored(calm.url, prefix, ident, limits), 0
        stop.clear()
        workers = [asyncio.ensure_future(decide()) for _ in range(10)]
        give_up = time.monotonic() + 5
        while name not in store_of(limiter)._links:
            assert time.monotonic() < give_up, "no link again"
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        stop.set()
        await asyncio.gather(*workers)
        await settle(limiter)
    finally:
        await limiter.aclose()
    assert admitted > 0
    assert await stored(calm.url, prefix, ident, limits) - before == admitted


@pytest.mark.parametrize("amount", [25, 1_000_000])
async def test_callers_cancelled_at_random_points_on_links(
    calm: cluster.Cluster, prefix: str, amount: int
) -> None:
    """Cross-slot decisions on links, their callers cancelled at random points (before the
    check is written, with it in flight, between check and commit, with the commit in
    flight): once the undos settle, the stored charge is what the callers were told, and
    never above the limit."""
    import random

    primaries = calm.primaries()
    a, b = on_node(calm, prefix, "c", primaries[0]), on_node(calm, prefix, "c", primaries[1])
    limits = [Limit(amount, per=3600)]
    limiter = Limiter(calm.url, limits, prefix=prefix, deadline=2.0)
    rng = random.Random(7)
    admitted = 0

    async def decide() -> None:
        nonlocal admitted
        decision = await limiter.try_acquire([a, b])
        admitted += decision.allowed

    try:
        await decide()
        for _ in range(40):
            tasks = [asyncio.ensure_future(decide()) for _ in range(10)]
            await asyncio.sleep(rng.random() * 0.002)
            for task in tasks:
                if rng.random() < 0.5:
                    task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await settle(limiter)
        assert store_of(limiter).statistics().links_opened == 2
    finally:
        await limiter.aclose()
    assert 0 < admitted <= amount
    assert await stored(calm.url, prefix, a, limits) == admitted
    assert await stored(calm.url, prefix, b, limits) == admitted


async def test_refunds_retried_after_links_die_apply_once(
    calm: cluster.Cluster, prefix: str
) -> None:
    """Refunds in flight on links killed under them (some while the node sleeps): each is
    retried with its op id, so each applies once: stored == charged - refunded."""
    import threading

    primaries = calm.primaries()
    a, b = on_node(calm, prefix, "r", primaries[0]), on_node(calm, prefix, "r", primaries[1])
    limits = [Limit(1_000_000, per=3600)]
    limiter = Limiter(calm.url, limits, prefix=prefix, deadline=3.0)
    stop = threading.Event()

    def killer() -> None:
        kill_clients_repeatedly(primaries[:2], stop, rounds=10, every=0.03)

    try:
        await asyncio.gather(*(limiter.try_acquire([a, b], 3) for _ in range(100)))
        thread = threading.Thread(target=killer)
        thread.start()
        try:
            for _ in range(20):
                await asyncio.gather(*(limiter.refund([a, b], 2) for _ in range(5)))
                await asyncio.sleep(0.02)
        finally:
            stop.set()
            await asyncio.to_thread(thread.join)
        await settle(limiter)
        assert store_of(limiter).statistics().links_failed >= 1
    finally:
        await limiter.aclose()
    assert await stored(calm.url, prefix, a, limits) == 300 - 200
    assert await stored(calm.url, prefix, b, limits) == 300 - 200
