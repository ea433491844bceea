"""Shadow rules never delay acquire: no turn is reserved on a shadow token bucket."""

from __future__ import annotations

import time

import anyio

from aiolimit import Limiter, RuleSet
from aiolimit.testing import ManualClock

START = 1_700_000_000.0


async def test_shadow_token_bucket_never_delays_acquire(redis_url: str, prefix: str) -> None:
    """A shadow rule "never refuses": a request that only shadow rules would stop is admitted
    as if they were not there. On a token bucket, acquire(timeout=...) reserves a turn on the
    shadow bucket and sleeps until it instead, so the shadow rule throttles real traffic."""
    rules = RuleSet.from_mapping(
        {
            "kinds": {
                "api": {
                    "limits": [{"type": "token_bucket", "rate": 1, "per": 2, "burst": 1}],
                    "shadow": True,
                }
            }
        }
    )
    async with Limiter(redis_url, rules, prefix=prefix) as limiter:
        first = await limiter.acquire("api:x", timeout=5)
        assert first.allowed
        started = time.monotonic()
        with anyio.fail_after(10):
            second = await limiter.acquire("api:x", timeout=5)
        waited = time.monotonic() - started
        # timeout=0 (try_acquire) admits at once with shadow_refusals; acquire must not wait
        # either: a shadow rule never changes what happens to a request.
        assert second.allowed
        assert waited < 0.5, f"acquire waited {waited:.2f}s for a shadow rule's turn"


async def test_shadow_token_bucket_acquire_manual_clock(redis_url: str, prefix: str) -> None:
    """Same, measured on a manual clock: acquire(timeout=None) sleeps a shadow bucket's turn."""
    clock = ManualClock(start=START, autojump=True)
    rules = RuleSet.from_mapping(
        {
            "kinds": {
                "api": {
                    "limits": [{"type": "token_bucket", "rate": 1, "per": 3600, "burst": 1}],
                    "shadow": True,
                }
            }
        }
    )
    async with Limiter(redis_url, rules, prefix=prefix, clock=clock) as limiter:
        await limiter.acquire("api:x")
        before = clock.time()
        decision = await limiter.try_acquire("api:x")
        assert decision.allowed and decision.shadow_refusals  # what try_acquire does
        await limiter.acquire("api:x")
        assert clock.time() - before == 0, (
            f"acquire slept {clock.time() - before:.0f}s of manual time for a shadow rule"
        )
