"""Waiting under the refusal cache: acquire ends as it does without the cache."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.crc import key_slot

from aiolimit import Limit, Limiter
from aiolimit._keys import main_key
from aiolimit.testing import ManualClock

RULES = {"a": [Limit(1, per=2)], "b": [Limit(1, per=600)]}
START = 1_700_000_000.0


async def _acquire_after_cached_refusal(
    url: str, prefix: str, ids: Any, cache: bool
) -> tuple[str, float]:
    """``ids`` admitted once, refused once (cached), then ``acquire(ids, timeout=5)`` with
    ManualClock(autojump): returns what happened and the manual time it took."""
    clock = ManualClock(start=START, autojump=True)
    async with Limiter(url, RULES, prefix=prefix, clock=clock, cache_refusals=cache) as lim:
        assert (await lim.try_acquire(ids)).allowed
        assert not (await lim.try_acquire(ids)).allowed
        started = clock.monotonic()
        try:
            await asyncio.wait_for(lim.acquire(ids, timeout=5), 5)
            outcome = "admitted"
        except TimeoutError:
            outcome = f"hung ({lim.statistics().cached_refusals} cached refusals)"
        return outcome, clock.monotonic() - started


async def test_a_cached_refusal_never_makes_acquire_spin_on_a_manual_clock(
    redis_url: str, prefix: str
) -> None:
    """Without the cache acquire sleeps 2 s (manual) and is admitted; with it too. The cached
    entry ends ~3 µs before the store's retry_after: acquire woke with < 0.5 µs left on it,
    computed a wait of 0 and, with no sleep margin, the autojump clock never moved again (a
    busy loop of cached refusals). A refusal now waits at least 1 µs."""
    off = await _acquire_after_cached_refusal(redis_url, prefix + "off", "a:1", False)
    on = await _acquire_after_cached_refusal(redis_url, prefix + "on", "a:1", True)
    assert off == ("admitted", 2.0)
    assert on[0] == "admitted", (off, on)


@pytest.mark.cluster
async def test_a_cached_cross_slot_refusal_never_makes_acquire_spin(
    local_cluster: Any, prefix: str
) -> None:
    """The same for two identifiers on two primaries."""

    def port(ident: str) -> int:
        return local_cluster.node_for_slot(key_slot(main_key(prefix, ident).encode())).port

    other = next(f"a:{i}" for i in range(2, 10_000) if port(f"a:{i}") != port("a:1"))
    ids = ["a:1", other]
    off = await _acquire_after_cached_refusal(local_cluster.url, prefix + "off", ids, False)
    on = await _acquire_after_cached_refusal(local_cluster.url, prefix + "on", ids, True)
    assert off == ("admitted", 2.0)
    assert on[0] == "admitted", (off, on)
