"""A waiter on two token buckets (cross-slot on the cluster, and on one slot) never makes the
faster bucket admit more than its rate and burst.

It used to reserve a turn on each bucket and be admitted at the slower one's: its unit on the
faster bucket was charged at a turn long before its admission, that bucket refilled
meanwhile, and other requests were admitted there at the same instant (more than ``burst``
at once, more than ``rate`` over time). A call under several limits reserves no turn now.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.crc import key_slot

from aiolimit import Limiter, TokenBucket
from aiolimit._keys import main_key
from aiolimit.testing import ManualClock

RULES = {"a": [TokenBucket(1, per=1, burst=1)], "b": [TokenBucket(1, per=10, burst=1)]}


def distinct_primaries(nodes, prefix: str) -> tuple[str, str]:
    def port(ident: str) -> int:
        return nodes.node_for_slot(key_slot(main_key(prefix, ident).encode())).port

    a = "a:0"
    for i in range(10_000):
        b = f"b:{i}"
        if port(b) != port(a):
            return a, b
    raise AssertionError("no pair on distinct primaries")


async def _until(predicate, rounds: int = 2000) -> None:
    for _ in range(rounds):
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("timed out")


async def _bunching(url: str, a: str, b: str, prefix: str, waiters: int) -> list[tuple[float, str]]:
    """Returns (admission time, who) of every admission on ``a``."""
    clock = ManualClock(start=1_700_000_000.0)
    t0 = clock.time()
    admitted: list[tuple[float, str]] = []
    async with Limiter(url, RULES, prefix=prefix, clock=clock, deadline=5.0) as lim:
        assert (await lim.try_acquire(b)).allowed  # b's next turn is 10 s away
        reserved = 0

        async def both(n: int) -> None:
            nonlocal reserved
            await lim.acquire([a, b], timeout=1000)
            admitted.append((clock.time() - t0, f"both{n}"))

        tasks = []
        for n in range(waiters):
            tasks.append(asyncio.create_task(both(n)))
            # each reserves in turn (a: its slot now-ish, b: 10 s apart)
            before = lim.statistics().waits
            await _until(lambda before=before: lim.statistics().waits > before)
        # Requests on `a` alone, once a second, from t=0 to t=10*waiters.
        for second in range(10 * waiters + 1):
            target = t0 + second
            if clock.time() < target:
                clock.advance(target - clock.time())
            await asyncio.sleep(0.05)  # let due waiters wake and return
            d = await lim.try_acquire(a)
            if d.allowed:
                admitted.append((clock.time() - t0, "alone"))
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
    return sorted(admitted)


def _worst_excess(admitted: list[tuple[float, str]]) -> tuple[int, float, float]:
    """Largest (count - allowed) over intervals [s, e] of admission times: a TokenBucket(1/s,
    burst 1) admits at most (e - s) + 1 in any [s, e]."""
    times = [t for t, _ in admitted]
    worst = (0, 0.0, 0.0)
    for i, s in enumerate(times):
        for j in range(i, len(times)):
            e = times[j]
            excess = (j - i + 1) - (int(e - s + 1e-9) + 1)
            if excess > worst[0]:
                worst = (excess, s, e)
    return worst


@pytest.mark.cluster
async def test_a_cross_slot_waiter_on_two_buckets_never_over_admits_the_faster(
    local_cluster: Any, prefix: str
) -> None:
    a, b = distinct_primaries(local_cluster, prefix)
    admitted = await _bunching(local_cluster.url, a, b, prefix, waiters=3)
    excess, s, e = _worst_excess(admitted)
    assert excess == 0, f"{excess} over TokenBucket(1/s, burst 1) on {a} in [{s}, {e}]: {admitted}"


async def test_a_waiter_on_two_buckets_never_over_admits_the_faster(
    redis_url: str, prefix: str
) -> None:
    admitted = await _bunching(redis_url, "a:0", "b:0", prefix, waiters=3)
    excess, s, e = _worst_excess(admitted)
    assert excess == 0, f"{excess} over TokenBucket(1/s, burst 1) on a:0 in [{s}, {e}]: {admitted}"
