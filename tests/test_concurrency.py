"""Never over-admit: concurrent callers get exactly the capacity, no more and no less.

In-process: 200 concurrent try_acquire on one event loop, against real Redis and memory://.
Across processes: 4 spawned processes, each with its own event loop and Limiter, racing on one
real Redis. A ManualClock keeps every caller in the same window, so the capacity is exact.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import queue

import pytest
from _workers import Backend, admitted_total, burst_worker, open_backend

from aiolimit import Limit
from aiolimit.testing import ManualClock

START = 1_700_000_000.25


async def test_200_concurrent_callers_on_a_limit_of_50_admit_exactly_50(backend: Backend) -> None:
    """200 concurrent try_acquire on one identifier under 50/hour admit exactly 50."""
    limit = Limit(50, per=3600)
    limiter = backend.limiter([limit], clock=ManualClock(start=START))
    decisions = await asyncio.gather(*(limiter.try_acquire("ip:1") for _ in range(200)))
    admitted = [d for d in decisions if d.allowed]
    assert len(admitted) == 50
    assert sorted(d.remaining for d in admitted) == list(range(50))
    assert await backend.counts("ip:1") == {"w3600000000/3600000000:472222": 50}
    stats = limiter.statistics()
    assert (stats.decisions, stats.allowed, stats.refused) == (200, 50, 150)


async def test_several_identifiers_and_limits_admit_the_smallest_capacity(
    backend: Backend,
) -> None:
    """Concurrent calls over 3 identifiers x 2-3 limits admit exactly the smallest capacity."""
    rules = {
        "ip": [Limit(80, per=1), Limit(60, per=60), Limit(1000, per=3600, precision=60)],
        "user": [Limit(45, per=60, precision=10), Limit(90, per=3600)],
        "*": [Limit(70, per=60), Limit(100, per=86400)],
    }
    limiter = backend.limiter(rules, clock=ManualClock(start=START))
    ids = ["ip:203.0.113.7", "user:42", "key:abc"]
    decisions = await asyncio.gather(*(limiter.try_acquire(ids) for _ in range(200)))
    assert sum(d.allowed for d in decisions) == 45
    refused = [d for d in decisions if not d.allowed]
    assert {(d.identifier, d.limit) for d in refused} == {("user:42", rules["user"][0])}
    for identifier, charged in [("ip:203.0.113.7", 45), ("user:42", 45), ("key:abc", 45)]:
        counts = await backend.counts(identifier)
        assert set(counts.values()) == {charged}, (identifier, counts)


async def test_weighted_concurrent_callers_never_exceed_the_amount(backend: Backend) -> None:
    """Concurrent calls of weight 3 under 50/hour admit floor(50 / 3) = 16, charging 48."""
    limiter = backend.limiter([Limit(50, per=3600)], clock=ManualClock(start=START))
    decisions = await asyncio.gather(*(limiter.try_acquire("ip:1", weight=3) for _ in range(100)))
    assert sum(d.allowed for d in decisions) == 16
    assert await backend.counts("ip:1") == {"w3600000000/3600000000:472222": 48}
    # The 2 left still fit a call of weight 2, and nothing more.
    assert (await limiter.try_acquire("ip:1", weight=2)).remaining == 0
    assert not (await limiter.try_acquire("ip:1")).allowed


async def test_four_processes_racing_on_one_redis_admit_exactly_50(
    redis_url: str, prefix: str
) -> None:
    """4 spawned processes x 50 concurrent try_acquire under 50/hour admit exactly 50 in total."""
    context = multiprocessing.get_context("spawn")
    processes_count, attempts = 4, 50
    barrier = context.Barrier(processes_count)
    results = context.Queue()
    processes = [
        context.Process(
            target=burst_worker,
            args=(redis_url, prefix, "ip:1", 50, START, attempts, barrier, results),
        )
        for _ in range(processes_count)
    ]
    for process in processes:
        process.start()
    try:
        collected = []
        for _ in processes:
            collected.append(await asyncio.to_thread(results.get, True, 60))
    except queue.Empty:
        pytest.fail("a worker process gave no result within 60 s")
    finally:
        for process in processes:
            await asyncio.to_thread(process.join, 30)
            if process.is_alive():
                process.kill()
                process.join()
        results.close()
        results.join_thread()
    assert admitted_total(collected) == 50
    assert [process.exitcode for process in processes] == [0] * processes_count
    async with open_backend("redis", redis_url, prefix) as backend:
        assert await backend.counts("ip:1") == {"w3600000000/3600000000:472222": 50}
