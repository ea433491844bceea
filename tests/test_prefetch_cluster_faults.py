"""Prefetch on a Redis Cluster whose node freezes (DEBUG SLEEP) while allowances live and
refills are due: the frozen node's identifier is never admitted past its limit, the other
node's keeps being served, and once every limiter has closed each identifier's store counts
exactly what was admitted (calls cut at the deadline are undone, units held are given back)."""

from __future__ import annotations

import asyncio
import threading

import pytest

import cluster
from aiolimit import Limit, Limiter
from tests._nodes import on_node, settle, stored, warm_counted

pytestmark = pytest.mark.asyncio


#: (prefetch, deadline s, workers per limiter and identifier, freeze s, pause between calls s)
GENTLE = (8, 0.2, 3, "0.5", 0.002)
#: The strongest of the load variants tried in review (tests/test_prefetch_load_review.py):
#: more units ahead, calls cut sooner, twice the workers with no pause.
HARSH = (32, 0.05, 6, "0.3", 0.0)


@pytest.mark.parametrize("shape", [GENTLE, HARSH], ids=["gentle", "harsh"])
async def test_a_frozen_node_under_prefetching_limiters_stays_exact(
    calm: cluster.Cluster, prefix: str, shape: tuple[int, float, int, str, float]
) -> None:
    primaries = calm.primaries()
    frozen, live = primaries[0], primaries[1]
    a, b = on_node(calm, prefix, "a", frozen), on_node(calm, prefix, "b", live)
    amount = 300
    limits = [Limit(amount, per=3600, precision=60)]
    prefetch, deadline, per_pair, freeze, pause = shape
    limiters = [
        Limiter(calm.url, limits, prefix=prefix, prefetch=prefetch, deadline=deadline,
                on_error="closed")
        for _ in range(3)
    ]  # fmt: skip
    admitted = {a: 0, b: 0}
    during = {a: 0, b: 0}
    freezing = asyncio.Event()

    async def worker(limiter: Limiter, ident: str) -> None:
        for _ in range(70):
            decision = await limiter.try_acquire(ident)
            if decision.allowed:
                admitted[ident] += 1
                if freezing.is_set():
                    during[ident] += 1
            await asyncio.sleep(pause)

    try:
        await warm_counted(limiters, (b, a), admitted)
        workers = [
            asyncio.ensure_future(worker(limiter, ident))
            for limiter in limiters
            for ident in (a, b)
            for _ in range(per_pair)
        ]
        await asyncio.sleep(0.05)
        sleeper = threading.Thread(target=frozen.execute, args=("DEBUG", "SLEEP", freeze))
        freezing.set()
        sleeper.start()
        await asyncio.wait_for(asyncio.gather(*workers), 60)
        await asyncio.to_thread(sleeper.join)
        if shape is GENTLE:
            assert during[b] > 0  # (the live node's identifier was served meanwhile)
        assert sum(limiter.statistics().errors for limiter in limiters) > 0  # (the freeze hit)
        assert sum(limiter.statistics().prefetched for limiter in limiters) > 0
        for limiter in limiters:
            await settle(limiter)
    finally:
        for limiter in limiters:
            await limiter.aclose()
    assert 0 < admitted[a] <= amount
    assert 0 < admitted[b] <= amount
    assert await stored(calm.url, prefix, a, limits) == admitted[a]
    assert await stored(calm.url, prefix, b, limits) == admitted[b]
