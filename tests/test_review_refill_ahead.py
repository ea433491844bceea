"""Review of refills ahead (``Allowances.low`` -> ``Limiter._refill_ahead``): a busy
identifier's next units taken in a background task of their own.

The commit says: "A refill ahead is not a decision (nothing counted); its failure is logged at
debug and the next call asks the store itself." These tests hold it to that, and to the
prefetch invariants (never past the limit; once settled, stored == admitted)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from aiolimit import Limit, Limiter
from tests._nodes import settle
from tests._proxy import Proxy

pytestmark = pytest.mark.asyncio


def held(limiter: Limiter, ident: str) -> int:
    assert limiter._prefetch is not None
    entry = limiter._prefetch._by_ids.get(ident)
    return 0 if entry is None or entry.turn is None else entry.left


async def _local_until_a_refill_is_sent(limiter: Limiter, ident: str) -> int:
    """Takes the allowance down (local admissions only) until a refill ahead is spawned."""
    admitted = 0
    before = limiter.statistics().prefetched
    while not limiter._ahead:
        decision = await limiter.try_acquire(ident)
        assert decision.allowed and not decision.degraded
        admitted += 1
    # (every one of them from the allowance: no decision went to the store)
    assert limiter.statistics().prefetched - before == admitted
    return admitted


async def test_a_failed_refill_ahead_is_not_counted_as_a_failed_decision(
    redis_url: str, prefix: str, standalone_proxy: Proxy, caplog: pytest.LogCaptureFixture
) -> None:
    """Every decision here is admitted (two by the store, the rest from the allowance), none
    met the store's slowness; only the background refill did, past the deadline. Yet the
    limiter reports a failed decision: ``statistics().errors``, the breaker's ``degraded``
    and ``timeouts`` go up, and a WARNING says "1 decision(s) admitted without the store"
    (``_refill_ahead`` goes through ``_decide``, whose failure path counts and logs as for a
    caller's decision)."""
    caplog.set_level(logging.DEBUG, logger="aiolimit")
    limits = [Limit(1000, per=3600, precision=60)]
    async with Limiter(
        standalone_proxy.url, limits, prefix=prefix, prefetch=50, deadline=0.1, on_error="open"
    ) as limiter:
        for _ in range(2):  # (the second takes units ahead)
            assert (await limiter.try_acquire("ip:s")).allowed
        standalone_proxy.delay = 0.3
        await _local_until_a_refill_is_sent(limiter, "ip:s")
        await asyncio.wait(list(limiter._ahead))  # (the refill, cut by the deadline)
        statistics = limiter.statistics()
        degraded_logged = [r for r in caplog.records if "aiolimit degraded" in r.getMessage()]
        found = {
            "decisions degraded": statistics.breaker.degraded,
            "errors": statistics.errors,
            "timeouts": statistics.breaker.timeouts,
            "degraded warnings": len(degraded_logged),
        }
        standalone_proxy.delay = 0.0
        await asyncio.sleep(0.35)  # (the late reply is in)
        await settle(limiter)
        assert statistics.refused == 0
        assert statistics.allowed == statistics.decisions
        assert found == {
            "decisions degraded": 0,
            "errors": 0,
            "timeouts": 0,
            "degraded warnings": 0,
        }, found


async def test_a_failed_refill_ahead_does_not_open_the_breaker_on_the_next_caller(
    redis_url: str, prefix: str, standalone_proxy: Proxy
) -> None:
    """``_refill_ahead``'s docstring: "a failure only means the next call asks the store
    itself". With ``failure_threshold=1`` the background refill's timeout opens the breaker
    (``_decide`` records it as a decision's failure), so the next call -- on another
    identifier, the store answering on time again -- is not asked of the store at all: it
    gets the policy's answer (``on_error="closed"``: a degraded refusal, a 503 behind a web
    layer) for ``recovery_time``, although no caller ever saw the store fail."""
    limits = [Limit(1000, per=3600, precision=60)]
    async with Limiter(
        standalone_proxy.url, limits, prefix=prefix, prefetch=50, deadline=0.1,
        on_error="closed", failure_threshold=1, recovery_time=30,
    ) as limiter:  # fmt: skip
        for _ in range(2):  # (the second takes units ahead)
            assert (await limiter.try_acquire("ip:b")).allowed
        standalone_proxy.delay = 0.3
        await _local_until_a_refill_is_sent(limiter, "ip:b")
        await asyncio.wait(list(limiter._ahead))  # (the refill, cut by the deadline)
        standalone_proxy.delay = 0.0
        await asyncio.sleep(0.35)  # (the late reply is in: the store answers on time again)
        decision = await limiter.try_acquire("ip:other")
        state = limiter.statistics().breaker.state
        await settle(limiter)
        assert (decision.allowed, decision.degraded, state) == (True, False, "closed"), (
            decision,
            state,
        )
