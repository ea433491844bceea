"""Prefetch on a Redis Cluster under short deadlines: the store counts exactly what was
admitted, never past the limit, when a limiter's first call misses its deadline (on a loaded
machine it pays for the slot map and the links: on_error="closed" refuses it and it charges
nothing) and when a node freezes while allowances live, refills are due and calls are cut.

(test_prefetch_cluster_faults.py's frozen-node test once failed with ``301 <= 300`` on the
live node's identifier: it counted its warm-up calls as admitted without looking, and the
first one, always on that identifier, had been refused so. The test here is that case, made
certain; the strongest of the load variants tried in review is a case of that test.)"""

from __future__ import annotations

import asyncio
import threading

import pytest

import cluster
from aiolimit import Limit, Limiter
from tests._nodes import on_node, settle, stored

pytestmark = pytest.mark.asyncio


async def test_a_first_call_cut_by_its_deadline_charges_nothing_under_prefetch(
    calm: cluster.Cluster, prefix: str
) -> None:
    live = calm.primaries()[1]
    b = on_node(calm, prefix, "b", live)
    amount = 300
    limits = [Limit(amount, per=3600, precision=60)]
    limiter = Limiter(calm.url, limits, prefix=prefix, prefetch=8, deadline=0.2, on_error="closed")
    admitted = 0
    try:
        sleeper = threading.Thread(target=live.execute, args=("DEBUG", "SLEEP", "0.4"))
        sleeper.start()
        await asyncio.sleep(0.05)
        first = await limiter.try_acquire(b)  # (sent to a node asleep: cut at 0.2 s)
        await asyncio.to_thread(sleeper.join)
        assert not first.allowed and first.degraded
        for _ in range(amount + 50):
            if (await limiter.try_acquire(b)).allowed:
                admitted += 1
        assert limiter.statistics().prefetched > 0
        await settle(limiter)
    finally:
        await limiter.aclose()
    assert admitted == amount  # (counting the refused first call would make it 301)
    assert await stored(calm.url, prefix, b, limits) == amount
