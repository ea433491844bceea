"""``reset`` and ``Lease.renew`` under the failure policy's deadline (from an adversarial review).

A stopped (SIGSTOP) Redis accepts TCP and never answers. A limiter with a deadline opens its
standalone connections without a socket timeout (the deadline bounds each decision instead),
so anything it sends outside a deadline waits for good.
"""

from __future__ import annotations

import asyncio
import time

from aiolimit import BackendUnavailable, Concurrency, Limit, Limiter
from cluster import Standalone

DEADLINE = 0.3


async def test_reset_on_a_stopped_server_fails_within_the_deadline(
    fresh_standalone: Standalone, prefix: str
) -> None:
    """reset() against a stopped server raises BackendUnavailable within about the
    limiter's deadline, instead of hanging until the server comes back."""
    limiter = Limiter(fresh_standalone.url, [Limit(5, per=60)], prefix=prefix, deadline=DEADLINE)
    try:
        await limiter.try_acquire("ip:203.0.113.7")
        fresh_standalone.pause()
        started = time.monotonic()
        try:
            outcome: object = await asyncio.wait_for(limiter.reset("ip:203.0.113.7"), 3)
        except (BackendUnavailable, TimeoutError) as error:
            outcome = error
        took = time.monotonic() - started
    finally:
        fresh_standalone.resume()
        await limiter.aclose()
    assert isinstance(outcome, BackendUnavailable), (took, outcome)
    assert took < DEADLINE + 0.25, took


async def test_lease_renew_on_a_stopped_server_fails_within_the_deadline(
    fresh_standalone: Standalone, prefix: str
) -> None:
    """lease.renew() against a stopped server raises BackendUnavailable within about the
    limiter's deadline, instead of hanging until the server comes back."""
    limiter = Limiter(fresh_standalone.url, [Concurrency(2)], prefix=prefix, deadline=DEADLINE)
    try:
        decision = await limiter.try_acquire("job:7")
        assert decision.lease is not None
        fresh_standalone.pause()
        started = time.monotonic()
        try:
            outcome: object = await asyncio.wait_for(decision.lease.renew(), 3)
        except (BackendUnavailable, TimeoutError) as error:
            outcome = error
        took = time.monotonic() - started
    finally:
        fresh_standalone.resume()
        await limiter.aclose()
    assert isinstance(outcome, BackendUnavailable), (took, outcome)
    assert took < DEADLINE + 0.25, took


async def test_push_rules_on_a_stopped_server_fails_within_the_deadline(
    fresh_standalone: Standalone, prefix: str
) -> None:
    """push_rules() (an operator publishing rules) against a stopped server raises
    BackendUnavailable within about the limiter's deadline, instead of hanging (what was sent
    may still land when the server resumes: the operator reads the document again)."""
    from aiolimit import RuleSet

    limiter = Limiter(fresh_standalone.url, [Limit(5, per=60)], prefix=prefix, deadline=DEADLINE)
    rules = RuleSet.from_mapping({"kinds": {"ip": "3/minute"}})
    try:
        await limiter.try_acquire("ip:203.0.113.7")
        fresh_standalone.pause()
        started = time.monotonic()
        try:
            outcome: object = await asyncio.wait_for(limiter.push_rules(rules), 3)
        except (BackendUnavailable, TimeoutError) as error:
            outcome = error
        took = time.monotonic() - started
    finally:
        fresh_standalone.resume()
        await limiter.aclose()
    assert isinstance(outcome, BackendUnavailable), (took, outcome)
    assert took < DEADLINE + 0.25, took
