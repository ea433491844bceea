"""Many tasks racing cross-slot decisions on two primaries: never over a limit, exact state."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from redis.crc import key_slot

from aiolimit import Concurrency, Limit, Limiter, RateLimited
from aiolimit._keys import main_key
from aiolimit.testing import ManualClock

pytestmark = pytest.mark.cluster


def pair(nodes, prefix, kind="u"):
    def port(ident: str) -> int:
        return nodes.node_for_slot(key_slot(main_key(prefix, ident).encode())).port

    a = f"{kind}:0"
    b = next(f"{kind}:{i}" for i in range(1, 10_000) if port(f"{kind}:{i}") != port(a))
    return a, b


@pytest.mark.parametrize("cache", [False, True])
async def test_cross_slot_race_never_over_admits_and_leaves_exact_state(
    local_cluster: Any, prefix: str, cache: bool
) -> None:
    a, b = pair(local_cluster, prefix)
    clock = ManualClock(start=1_700_000_000.0)
    rules = [Limit(5, per=600, precision=60)]
    counts = {a: 0, b: 0}
    limiters = [
        Limiter(local_cluster.url, rules, prefix=prefix, clock=clock, cache_refusals=cache)
        for _ in range(3)
    ]
    try:

        async def one(lim, ids):
            d = await lim.try_acquire(ids)
            if d.allowed:
                for ident in ids:
                    counts[ident] += 1

        jobs = []
        rnd = random.Random(7)
        for n in range(90):
            ids = [[a, b], [a], [b]][n % 3]
            jobs.append(one(limiters[rnd.randrange(3)], ids))
        rnd.shuffle(jobs)
        await asyncio.wait_for(asyncio.gather(*jobs), 30)
        for lim in limiters:
            await asyncio.wait_for(lim._protocol.aclose(), 10)
    finally:
        for lim in limiters:
            await lim.aclose()
    assert counts[a] <= 5 and counts[b] <= 5, counts
    async with Limiter(local_cluster.url, rules, prefix=prefix, clock=clock) as fresh:
        for ident in (a, b):
            seen = await fresh.peek(ident)
            assert 5 - seen.remaining == counts[ident], (ident, seen, counts)


async def test_cross_slot_concurrency_waiters_never_exceed_max(local_cluster, prefix):
    a, b = pair(local_cluster, prefix, "c")
    rules = [Concurrency(2, lease_ttl=30)]
    inside = {a: 0, b: 0}
    peak = {a: 0, b: 0}
    admitted = 0
    async with Limiter(local_cluster.url, rules, prefix=prefix, deadline=5.0) as lim:

        async def one(ids, n):
            nonlocal admitted
            try:
                async with lim.limit(ids, timeout=3):
                    admitted += 1
                    for i in ids:
                        inside[i] += 1
                        peak[i] = max(peak[i], inside[i])
                    try:
                        await asyncio.sleep(0.01 * (n % 3))
                    finally:
                        # (a task cancelled here leaves: its slot is released on the way out)
                        for i in ids:
                            inside[i] -= 1
            except RateLimited:
                pass

        tasks = [asyncio.create_task(one([[a, b], [a], [b]][n % 3], n)) for n in range(45)]
        # cancel a few waiters in flight
        await asyncio.sleep(0.02)
        for t in tasks[::7]:
            t.cancel()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 20)
        await asyncio.wait_for(lim._protocol.aclose(), 10)
    assert peak[a] <= 2 and peak[b] <= 2, peak
    async with Limiter(local_cluster.url, rules, prefix=prefix) as fresh:
        for ident in (a, b):
            seen = await fresh.peek(ident)
            assert seen.remaining == 2, (ident, seen)  # every lease released, none leaked
    assert admitted > 10
