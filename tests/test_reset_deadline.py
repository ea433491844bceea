"""``reset``, ``Lease.renew`` and ``push_rules`` under the failure policy's deadline (from an
adversarial review).

A stopped (SIGSTOP) Redis accepts TCP and never answers. A limiter with a deadline opens its
standalone connections without a socket timeout (the deadline bounds each decision instead),
so anything it sends outside a deadline waits for good.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from aiolimit import BackendUnavailable, Concurrency, Limit, Limiter, RuleSet
from cluster import Standalone

DEADLINE = 0.3


async def _on_a_stopped_server(
    server: Standalone, limiter: Limiter, call: Callable[[], Awaitable[object]]
) -> None:
    """Runs ``call`` with ``server`` stopped (SIGSTOP): it must raise BackendUnavailable
    within about the limiter's deadline (the test gives up at 3 s), not hang until the
    server comes back."""
    server.pause()
    started = time.monotonic()
    try:
        try:
            outcome: object = await asyncio.wait_for(call(), 3)
        except (BackendUnavailable, TimeoutError) as error:
            outcome = error
        took = time.monotonic() - started
    finally:
        server.resume()
        await limiter.aclose()
    assert isinstance(outcome, BackendUnavailable), (took, outcome)
    assert took < DEADLINE + 0.25, took


async def test_reset_on_a_stopped_server_fails_within_the_deadline(
    fresh_standalone: Standalone, prefix: str
) -> None:
    limiter = Limiter(fresh_standalone.url, [Limit(5, per=60)], prefix=prefix, deadline=DEADLINE)
    await limiter.try_acquire("ip:203.0.113.7")
    await _on_a_stopped_server(fresh_standalone, limiter, lambda: limiter.reset("ip:203.0.113.7"))


async def test_lease_renew_on_a_stopped_server_fails_within_the_deadline(
    fresh_standalone: Standalone, prefix: str
) -> None:
    limiter = Limiter(fresh_standalone.url, [Concurrency(2)], prefix=prefix, deadline=DEADLINE)
    decision = await limiter.try_acquire("job:7")
    lease = decision.lease
    assert lease is not None
    await _on_a_stopped_server(fresh_standalone, limiter, lease.renew)


async def test_push_rules_on_a_stopped_server_fails_within_the_deadline(
    fresh_standalone: Standalone, prefix: str
) -> None:
    """(An operator publishing rules: what was sent may still land when the server resumes;
    the operator reads the document again.)"""
    limiter = Limiter(fresh_standalone.url, [Limit(5, per=60)], prefix=prefix, deadline=DEADLINE)
    rules = RuleSet.from_mapping({"kinds": {"ip": "3/minute"}})
    await limiter.try_acquire("ip:203.0.113.7")
    await _on_a_stopped_server(fresh_standalone, limiter, lambda: limiter.push_rules(rules))
