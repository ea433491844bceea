"""Cross-slot decisions with ``Concurrency`` leases, with and without ``count_refused``.

Across cluster slots an acquire checks every slot first (read-only, before it takes its
in-flight places and opens its op), then commits on every slot with one op, and undoes the
slots that charged if a commit is refused. Under ``count_refused`` (penalty mode) the check
is skipped: every slot commits, and a refused request is counted on every rate pair, as in
one slot's call, where a refused call takes no concurrency lease (``penalty_free`` in
``lua/concurrency.lua``: "the penalty is for rate limits, not slots").

The invariants: leases held never exceed a ``Concurrency`` max, each released lease frees
exactly one place and every place comes back once its holders are gone, a refused call
holds nothing, and rate pairs store exactly what was admitted (or, under penalty, one
charge per call that was decided).
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from typing import Any

import pytest
from redis.crc import key_slot

from aiolimit import Concurrency, Limit, Limiter, RateLimited
from aiolimit._keys import main_key

pytestmark = pytest.mark.cluster


def _apart(nodes: Any, prefix: str, kinds: str) -> list[str]:
    """One identifier per kind, each on a different primary where there are enough (else on
    a slot of its own)."""
    found: list[str] = []
    ports: set[int] = set()
    slots: set[int] = set()
    for kind in kinds:
        for i in range(10_000):
            identifier = f"{kind}:{i}"
            slot = key_slot(main_key(prefix, identifier).encode())
            port = nodes.node_for_slot(slot).port
            if slot not in slots and (port not in ports or len(ports) >= 3):
                found.append(identifier)
                ports.add(port)
                slots.add(slot)
                break
    return found


async def test_a_refusal_counted_across_slots_takes_no_lease(
    local_cluster: Any, prefix: str
) -> None:
    """Penalty mode, two slots: ``c`` under ``Concurrency(2)`` and ``Limit(100)``, ``r``
    under ``Limit(1)``. After one admitted request (its lease released), ``r`` refuses every
    request; each refusal is counted on ``c``'s rate limit (as one slot's call counts it),
    but must take no lease on ``c``: a refused call holds nothing, exactly as when both
    limits are on one identifier.

    Observed on the code this test was written against: ``_two_phase`` commits on every
    slot without a check (penalty mode) and, when a slot refuses, returns the refusal as is
    (``if all(...) or self._penalty: return _merge(replies)``). ``c``'s slot saw its own
    pairs allow, so it took a lease for the op; the caller gets no ``Lease`` (refused), so
    nobody releases it: two refusals fill ``c`` until ``lease_ttl`` and every later request
    on ``c`` is refused by a concurrency limit nobody holds."""
    c, r = _apart(local_cluster, prefix, "cr")
    rules = {"c": [Concurrency(2, lease_ttl=60), Limit(100, per=3600)], "r": [Limit(1, per=3600)]}
    async with Limiter(
        local_cluster.url, rules, prefix=prefix, count_refused=True, deadline=5.0
    ) as limiter:
        admitted = await limiter.try_acquire([c, r])
        assert admitted.allowed and admitted.lease is not None
        await admitted.lease.release()
        for _ in range(3):
            refused = await limiter.try_acquire([c, r])
            assert not refused.allowed and refused.lease is None
        seen = {
            (p.identifier, type(p.limit).__name__): p.remaining
            for p in (await limiter.peek(c)).details
        }
        # Counted once per request on the rate limit (1 admitted + 3 refused) ...
        assert seen[(c, "Limit")] == 100 - 4
        # ... and no lease held: both places free.
        assert seen[(c, "Concurrency")] == 2, seen
        # The same requests on one identifier (one slot) hold no lease either.
        single = {"s": [Concurrency(2, lease_ttl=60), Limit(100, per=3600), Limit(1, per=60)]}
    async with Limiter(
        local_cluster.url, single, prefix=prefix + "s", count_refused=True
    ) as one_slot:
        admitted = await one_slot.try_acquire("s:0")
        assert admitted.lease is not None
        await admitted.lease.release()
        for _ in range(3):
            assert not (await one_slot.try_acquire("s:0")).allowed
        details = (await one_slot.peek("s:0")).details
        assert [p.remaining for p in details[:2]] == [2, 100 - 4]


@pytest.mark.parametrize("penalty", [False, True])
async def test_cross_slot_leases_under_a_racing_crowd_never_exceed_max_nor_leak(
    local_cluster: Any, prefix: str, penalty: bool
) -> None:
    """Two limiters, 24 tasks: each takes ``async with limiter.limit([c, r, t])`` (three
    slots: ``c`` under ``Concurrency(3)``, ``r`` under a small rate limit, ``t`` under a large
    one that never refuses), or ``[c, t]``, with ``timeout`` 0 or a short wait, holds it a
    moment and leaves; a third of the tasks are cancelled at random moments. Never more than
    3 inside at once (counted by the tasks themselves); afterwards every place of ``c`` is
    free, and ``r`` and ``t`` store exactly the admissions (under penalty, refused requests
    are counted too: more).

    The penalty variant fails on the code it was written against, for the defect of the
    test above: a request refused by ``r`` still takes (and leaks) a lease on ``c``, so
    ``c`` ends full with no holder."""
    c, r, t = _apart(local_cluster, prefix, "crt")
    rules = {
        "c": [Concurrency(3, lease_ttl=60)],
        "r": [Limit(40, per=3600, precision=60)],
        "t": [Limit(100_000, per=3600, precision=60)],
    }
    inside = peak = 0
    admitted: Counter[str] = Counter()
    errors: list[BaseException] = []
    url = local_cluster.url
    limiters = [
        Limiter(url, rules, prefix=prefix, count_refused=penalty, deadline=5.0) for _ in range(2)
    ]
    try:

        async def one(limiter: Limiter, number: int) -> None:
            nonlocal inside, peak
            rng = random.Random(number)
            for _ in range(12):
                ids = [c, r, t] if rng.random() < 0.6 else [c, t]
                try:
                    async with limiter.limit(ids, timeout=rng.choice([0, 0.05])):
                        inside += 1
                        peak = max(peak, inside)
                        admitted.update(ids)
                        try:
                            await asyncio.sleep(rng.random() / 100)
                        finally:
                            inside -= 1
                except RateLimited:
                    await asyncio.sleep(0)
                except Exception as error:  # collected: the test's verdict
                    errors.append(error)

        tasks = [asyncio.create_task(one(limiters[n % 2], n)) for n in range(24)]
        rng = random.Random(5)
        for _ in range(8):
            await asyncio.sleep(rng.random() / 20)
            rng.choice(tasks).cancel()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
        for limiter in limiters:
            await asyncio.wait_for(limiter._protocol.aclose(), 10)
    finally:
        for limiter in limiters:
            await limiter.aclose()
    assert errors == [], errors[:3]
    assert peak <= 3, peak
    async with Limiter(url, rules, prefix=prefix) as fresh:
        assert (await fresh.peek(c)).remaining == 3  # every lease released, none leaked
        used_r = 40 - (await fresh.peek(r)).remaining
        used_t = 100_000 - (await fresh.peek(t)).remaining
    assert admitted[c] > 10
    if not penalty:
        assert (used_r, used_t) == (admitted[r], admitted[t])
    else:  # (refused requests counted too: exactness is the test above's)
        assert used_t > admitted[t] and used_r >= admitted[r]


async def test_penalty_across_slots_counts_every_request_once_on_every_pair(
    local_cluster: Any, prefix: str
) -> None:
    """Penalty mode, no check phase: two limiters send 160 concurrent requests of weight 1-3
    over three slots (``r`` under ``Limit(20)``, which soon refuses; ``t`` and ``u`` under
    limits that never refuse), some naming all three, some only ``t`` and ``u``. Every
    request, admitted or refused, is counted exactly once on ``t`` and on ``u`` (one slot's
    call counts a refusal on every rate pair, allowing ones included): their stored totals
    equal the weight of every request sent; ``r`` never admits more than 20."""
    r, t, u = _apart(local_cluster, prefix, "rtu")
    rules = {
        "r": [Limit(20, per=3600, precision=60)],
        "t": [Limit(100_000, per=3600, precision=60)],
        "u": [Limit(100_000, per=3600, precision=60), Limit(50_000, per=7200, precision=600)],
    }
    url = local_cluster.url
    sent = admitted_r = refused = 0
    limiters = [Limiter(url, rules, prefix=prefix, count_refused=True) for _ in range(2)]
    try:

        async def one(limiter: Limiter, ids: list[str], weight: int) -> None:
            nonlocal sent, admitted_r, refused
            decision = await limiter.try_acquire(ids, weight)
            sent += weight
            if decision.allowed and r in ids:
                admitted_r += weight
            refused += not decision.allowed

        rng = random.Random(3)
        jobs = [
            one(limiters[n % 2], [r, t, u] if rng.random() < 0.7 else [t, u], rng.randint(1, 3))
            for n in range(160)
        ]
        await asyncio.wait_for(asyncio.gather(*jobs), 30)
    finally:
        for limiter in limiters:
            await limiter.aclose()
    assert admitted_r <= 20 and refused > 20
    async with Limiter(url, rules, prefix=prefix) as fresh:
        details = (await fresh.peek([t, u])).details
    assert [100_000 - details[0].remaining, 100_000 - details[1].remaining] == [sent, sent]
    assert 50_000 - details[2].remaining == sent
