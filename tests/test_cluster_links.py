"""The cluster store's links (``aiolimit/_stores/link.py``): one connection per node kept open,
written from the tick's callback, one reader answering the pipelines in order.

Each test puts one fault on a link of a real cluster (3 primaries, no replicas, node timeout
15 s: a frozen primary is never failed over meanwhile) and checks what the store promises
around it: the calls are answered, a charge is stored exactly when its caller was told
"admitted" (no charge lost or doubled by a link that died with replies in flight), a node's
fault stays on that node, and the link comes back.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Any

import pytest

import cluster
from aiolimit import BackendError, Limit, Limiter
from tests._nodes import (
    before_bucket_edge,
    kill_clients_repeatedly,
    on_node,
    settle,
    store_of,
    stored,
)

pytestmark = [pytest.mark.cluster]


async def test_decisions_go_through_one_link_per_node(calm: cluster.Cluster, prefix: str) -> None:
    """After the first pipelines (which load the library), each node's calls go on its link:
    two links for identifiers on two primaries, none failed; every charge is stored."""
    primaries = calm.primaries()
    a, b = on_node(calm, prefix, "a", primaries[0]), on_node(calm, prefix, "b", primaries[1])
    limits = [Limit(10_000, per=3600)]
    limiter = Limiter(calm.url, limits, prefix=prefix)
    try:
        for _ in range(5):
            told = await asyncio.gather(*(limiter.try_acquire([a, b]) for _ in range(20)))
            assert all(decision.allowed for decision in told)
        stats = store_of(limiter).statistics()
        assert stats.links_opened == 2, stats
        assert stats.links_failed == 0, stats
        assert set(store_of(limiter)._links) == {
            f"127.0.0.1:{primaries[0].port}",
            f"127.0.0.1:{primaries[1].port}",
        }
    finally:
        await limiter.aclose()
    assert store_of(limiter)._links == {}
    assert await stored(calm.url, prefix, a, limits) == 100
    assert await stored(calm.url, prefix, b, limits) == 100


async def test_links_killed_with_replies_in_flight_lose_and_double_no_charge(
    calm: cluster.Cluster, prefix: str
) -> None:
    """30 tasks decide on [a, b] (a cross-slot decision: check, then commit on each node)
    while every 40 ms the server kills its normal clients (the links among them), some of
    them during a 30 ms DEBUG SLEEP, so that calls are queued or ran with their reply lost.
    Retries go through the cluster client with the same op ids: once the undos settle, each
    identifier's stored charge is exactly the number of decisions told "admitted"."""
    primaries = calm.primaries()
    a, b = on_node(calm, prefix, "k", primaries[0]), on_node(calm, prefix, "k", primaries[1])
    limits = [Limit(1_000_000, per=3600)]
    limiter = Limiter(calm.url, limits, prefix=prefix, deadline=2.0)
    admitted = 0
    stop = threading.Event()

    def killer() -> None:
        kill_clients_repeatedly(primaries[:2], stop, rounds=12, every=0.04)

    async def decide(count: int) -> None:
        nonlocal admitted
        for _ in range(count):
            try:
                decision = await limiter.try_acquire([a, b])
            except BackendError:
                continue
            admitted += decision.allowed

    try:
        await asyncio.gather(*(limiter.try_acquire([a, b]) for _ in range(10)))  # links open
        admitted = 10
        before = store_of(limiter).statistics().links_opened
        thread = threading.Thread(target=killer)
        thread.start()
        try:
            await asyncio.gather(*(decide(25) for _ in range(30)))
        finally:
            stop.set()
            await asyncio.to_thread(thread.join)
        for _ in range(20):  # the links come back after LINK_RETRY
            await asyncio.gather(*(decide(1) for _ in range(10)))
            await asyncio.sleep(0.05)
        await settle(limiter)
        stats = store_of(limiter).statistics()
        assert stats.links_failed >= 1, stats
        assert stats.links_opened > before, stats
    finally:
        await limiter.aclose()
    assert admitted > 0
    assert await stored(calm.url, prefix, a, limits) == admitted
    assert await stored(calm.url, prefix, b, limits) == admitted


async def test_a_frozen_node_closes_its_link_and_spares_the_others(
    calm: cluster.Cluster, prefix: str
) -> None:
    """A primary frozen with calls on its link: those calls fail at their deadline (not
    later), the link is closed (no link keeps piling writes on a silent node), decisions on
    the other node answer at once meanwhile, and once the node resumes it gets a link again."""
    primaries = calm.primaries()
    frozen, healthy = primaries[0], primaries[1]
    stuck, free = on_node(calm, prefix, "f", frozen), on_node(calm, prefix, "f", healthy)
    limiter = Limiter(calm.url, [Limit(1000, per=60)], prefix=prefix, deadline=0.3)
    try:
        for _ in range(3):
            await asyncio.gather(limiter.try_acquire(stuck), limiter.try_acquire(free))
        assert store_of(limiter).statistics().links_opened == 2
        frozen.pause()
        try:
            started = time.monotonic()
            outcomes = await asyncio.gather(
                *(limiter.try_acquire(stuck) for _ in range(5)), return_exceptions=True
            )
            took = time.monotonic() - started
            assert all(isinstance(outcome, BackendError) for outcome in outcomes), outcomes
            assert took < 0.6, f"calls on the frozen node took {took:.2f} s (deadline 0.3)"
            assert f"127.0.0.1:{frozen.port}" not in store_of(limiter)._links
            for _ in range(5):
                started = time.monotonic()
                decision = await limiter.try_acquire(free)
                assert decision.allowed and time.monotonic() - started < 0.1
        finally:
            frozen.resume()
        assert store_of(limiter).statistics().links_failed >= 1
        deadline = time.monotonic() + 5  # (its breaker opened: it probes after 1 s)
        while f"127.0.0.1:{frozen.port}" not in store_of(limiter)._links:
            assert time.monotonic() < deadline, "the resumed node never got a link again"
            with contextlib.suppress(BackendError):
                assert (await limiter.try_acquire(stuck)).allowed
            await asyncio.sleep(0.05)
    finally:
        await limiter.aclose()


async def test_a_node_that_lost_the_library_is_served_and_gets_it_back(
    calm: cluster.Cluster, prefix: str
) -> None:
    """FUNCTION FLUSH on a node whose calls go on a link: its calls are answered (sent
    again as EVAL), the library is loaded again, and the link serves the node again."""
    node = calm.primaries()[0]
    ident = on_node(calm, prefix, "l", node)
    limits = [Limit(1000, per=60)]
    limiter = Limiter(calm.url, limits, prefix=prefix)
    name = f"127.0.0.1:{node.port}"
    try:
        for _ in range(3):
            assert (await limiter.try_acquire(ident)).allowed
        store = store_of(limiter)
        assert name in store._links
        node.execute("FUNCTION", "FLUSH")
        for _ in range(3):
            assert (await limiter.try_acquire(ident)).allowed
        assert name in store._loaded and name in store._links
        rounds_before = store.statistics().round_trips
        assert (await limiter.try_acquire(ident)).allowed
        assert store.statistics().round_trips == rounds_before + 1
        assert store.statistics().links_failed == 0
    finally:
        await limiter.aclose()
    assert await stored(calm.url, prefix, ident, limits) == 7


async def test_aclose_waits_for_pipelines_on_links(calm: cluster.Cluster, prefix: str) -> None:
    """``aclose`` while a slow node (DEBUG SLEEP 0.3) still owes replies on its link: every
    call is answered with its real outcome, none is cut short, and the charges are stored."""
    node = calm.primaries()[0]
    ident = on_node(calm, prefix, "c", node)
    # A sliding window of 1 s buckets: a charge stays counted 59 s at least, whatever edge
    # the test crosses (a fixed window, precision=per, empties on the minute).
    width = 1.0
    limits = [Limit(1000, per=60, precision=width)]
    limiter = Limiter(calm.url, limits, prefix=prefix, deadline=2.0)
    await limiter.peek(ident)  # (connections and library ready; charges nothing)
    # The 2 charges below land before an edge of the limit's buckets and the 10 after it (the
    # node sleeps across it): every run, not once a minute at random.
    await before_bucket_edge(node, width, lead=0.1)
    await limiter.try_acquire(ident)
    await limiter.try_acquire(ident)
    assert f"127.0.0.1:{node.port}" in store_of(limiter)._links
    sleeper = threading.Thread(target=node.execute, args=("DEBUG", "SLEEP", "0.3"))
    sleeper.start()
    await asyncio.sleep(0.05)
    calls = [asyncio.ensure_future(limiter.try_acquire(ident)) for _ in range(10)]
    await asyncio.sleep(0.02)  # (written on the link, not answered yet)
    started = time.monotonic()
    await limiter.aclose()
    took = time.monotonic() - started
    await asyncio.to_thread(sleeper.join)
    told = await asyncio.gather(*calls)
    assert all(decision.allowed for decision in told)
    assert 0.1 < took < 2.0, took
    assert await stored(calm.url, prefix, ident, limits) == 12


async def test_a_failure_while_writing_a_tick_answers_its_calls_at_once(
    calm: cluster.Cluster, prefix: str
) -> None:
    """An unexpected error while a tick's calls are packed for a link (``_send_now`` runs in
    the tick's callback, where nobody would see it) answers those calls with the error at
    once, as a send task's failure does: not at the 5 s deadline. The next tick is served."""
    node = calm.primaries()[0]
    ident = on_node(calm, prefix, "w", node)
    limits = [Limit(1000, per=60)]
    limiter = Limiter(calm.url, limits, prefix=prefix, deadline=5.0)
    store = store_of(limiter)
    try:
        for _ in range(3):
            assert (await limiter.try_acquire(ident)).allowed
        assert f"127.0.0.1:{node.port}" in store._links
        pack = store._pack

        def broken(calls: Any) -> Any:
            store._pack = pack
            raise RuntimeError("packing failed")

        store._pack = broken
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="packing failed"):  # (a bug is not a store fault)
            await limiter.try_acquire(ident)
        assert time.monotonic() - started < 1.0
        assert (await limiter.try_acquire(ident)).allowed
    finally:
        await limiter.aclose()
    assert await stored(calm.url, prefix, ident, limits) == 4
