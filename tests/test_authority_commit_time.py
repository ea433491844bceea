"""The time a cross-slot decision's commit is judged at, under a TIME authority (from an
adversarial review).

Across slots the check phase reads the authority's TIME and the commit reuses it, saving a
round trip. When the check phase is slow (a node busy or failing over, its call retried),
the commit would charge at a time seconds in the past: the charge then leaves its window
that much early, and the identifier admits again too soon.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

import cluster
from aiolimit import AuthorityClock, Limit, Limiter
from tests._nodes import before_bucket_edge, on_node, settle

pytestmark = [pytest.mark.cluster]

#: Seconds node B is busy (DEBUG SLEEP) while the decision's check waits for it.
BUSY = 1.3


async def test_a_slow_check_phase_does_not_date_the_commit_back(
    calm: cluster.Cluster, prefix: str
) -> None:
    """Limit(1, per=2, precision=0.5) on identifiers a and b (two nodes, neither of them
    busy with the authority's TIME). b's node sleeps 1.3 s while the decision's check waits
    on it. The decision is admitted when the commit runs; a request on a alone must then be
    refused for the next 1.5 s (per less one bucket): a charge judged at the time read
    before the check would leave the window 1.3 s early."""
    authority = calm.node_for_slot(0)
    busy = next(node for node in calm.primaries() if node.port != authority.port)
    other = next(node for node in calm.primaries() if node.port != busy.port)
    a, b = on_node(calm, prefix, "a", other), on_node(calm, prefix, "b", busy)
    clock = AuthorityClock(calm.url)
    limiter = Limiter(calm.url, [Limit(1, per=2, precision=0.5)], prefix=prefix, clock=clock)
    try:
        await limiter.peek([a, b])  # connections and scripts ready
        sleeping = asyncio.create_task(asyncio.to_thread(busy.execute, "DEBUG", "SLEEP", BUSY))
        await asyncio.sleep(0.05)
        first = await limiter.try_acquire([a, b])
        admitted_at = time.monotonic()
        await sleeping
        assert first.allowed, first
        again = []
        while time.monotonic() - admitted_at < 1.0:
            decision = await limiter.try_acquire(a)
            if decision.allowed:
                again.append(round(time.monotonic() - admitted_at, 3))
            await asyncio.sleep(0.05)
    finally:
        await limiter.aclose()
        await clock.aclose()
    assert again == [], f"a admitted again {again} s after the decision on [a, b]"


async def remaining(url: str, prefix: str, ident: str, limits: list[Limit]) -> int:
    """A fresh limiter's peek (server time, no ledger, no cache): what is stored now."""
    async with Limiter(url, limits, prefix=prefix, deadline=2.0) as fresh:
        decision = await fresh.peek(ident)
        return min(pair.remaining for pair in decision.details)


@pytest.mark.parametrize("max_age", [None, 30.0])
@pytest.mark.parametrize("frozen", ["data", "authority"])
async def test_racing_acquirers_judged_by_an_authority_across_a_freeze(
    calm: cluster.Cluster, prefix: str, frozen: str, max_age: float | None
) -> None:
    """Three limiters with a TIME authority each (exact, or a cached offset) race 150 tasks
    on [a, b], [a] and [b] under a limit of 5, while b's primary (or the authority, which
    serves neither) is frozen for 0.6 s (deadline 0.3 s, on_error="open"). Admitted weight
    per identifier is never above 5, and once the undos settle stored == admitted.

    The limit is a sliding window of 1 s buckets, and the race starts just before a bucket
    edge (by the authority's TIME), so every run crosses one as it races: a charge
    stays counted for 3599 s at least. As a fixed window (precision=per) it emptied on the
    hour, and a run crossing the hour admitted a 5 more times: {a: 10, b: 5}."""
    limits = [Limit(5, per=3600, precision=1)]
    authority = calm.node_for_slot(0)
    others = [node for node in calm.primaries() if node.port != authority.port]
    a, b = on_node(calm, prefix, "a", others[0]), on_node(calm, prefix, "b", others[1])
    stopped = others[1] if frozen == "data" else authority
    clocks = [AuthorityClock(calm.url, max_age=max_age) for _ in range(3)]
    limiters = [
        Limiter(calm.url, limits, prefix=prefix, clock=clock, deadline=0.3, on_error="open")
        for clock in clocks
    ]
    counts = {a: 0, b: 0}
    both = asyncio.Event()  # (each identifier admitted once)

    async def one(n: int) -> None:
        await asyncio.sleep(0.004 * n)
        ids = [[a, b], [a], [b]][n % 3]
        decision = await limiters[(n // 3) % 3].try_acquire(ids)
        if decision.allowed and not decision.degraded:
            for ident in ids:
                counts[ident] += 1
            if counts[a] and counts[b]:
                both.set()

    async def freeze() -> None:
        await asyncio.sleep(0.05)
        # Under load the first decisions may not be made by then: the freeze waits for an
        # admission of each identifier (2 s at most), so that the race before it is not empty.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(both.wait(), 2.0)
        stopped.pause()
        await asyncio.sleep(0.6)
        stopped.resume()

    try:
        await asyncio.gather(*(limiter.peek([a, b]) for limiter in limiters))
        await before_bucket_edge(authority, 1.0, lead=0.15)
        await asyncio.wait_for(asyncio.gather(freeze(), *(one(n) for n in range(150))), 20)
        for limiter in limiters:
            await settle(limiter)
    finally:
        calm.heal()
        for limiter in limiters:
            await asyncio.wait_for(limiter.aclose(), 15)
        for clock in clocks:
            await clock.aclose()
    stored = {ident: 5 - await remaining(calm.url, prefix, ident, limits) for ident in (a, b)}
    assert 0 < counts[a] <= 5 and 0 < counts[b] <= 5, counts
    assert stored == counts, f"admitted {counts}, stored {stored}"
