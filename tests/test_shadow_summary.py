"""A decision's summary (remaining, retry_after, reset_after, the binding pair) describes the
enforced rules only: shadow rules never refuse, so they must not shorten what a caller is told
it has left, nor make ``acquire`` wait (or give up) for them. The shadow pairs stay in
``details`` (charged as usual) and, when they would refuse, in ``shadow_refusals``."""

from __future__ import annotations

import time

import pytest

from aiolimit import Limiter, RateLimited, RuleSet


def _rules() -> RuleSet:
    # ip: enforced, 3 per minute; user: in shadow, 1 per hour.
    return RuleSet.from_mapping(
        {"kinds": {"ip": "3/minute", "user": {"limits": "1/hour", "shadow": True}}}
    )


@pytest.fixture(params=["redis", "memory"])
async def limiter(request: pytest.FixtureRequest, redis_url: str, prefix: str) -> Limiter:
    url = redis_url if request.param == "redis" else "memory://"
    limiter = Limiter(url, _rules(), prefix=prefix)
    yield limiter  # type: ignore[misc]
    await limiter.aclose()


async def test_an_admission_reports_what_the_enforced_rules_leave(limiter: Limiter) -> None:
    first = await limiter.try_acquire(["ip:1.2.3.4", "user:7"])
    assert first.allowed and not first.shadow_refusals
    # The shadow pair has 0 left; the enforced one 2: the caller has 2 left.
    assert first.remaining == 2
    assert first.identifier == "ip:1.2.3.4"
    assert first.reset_after <= 60
    assert {pair.identifier for pair in first.details} == {"ip:1.2.3.4", "user:7"}
    second = await limiter.try_acquire(["ip:1.2.3.4", "user:7"])
    assert second.allowed and [p.identifier for p in second.shadow_refusals] == ["user:7"]
    assert second.remaining == 1 and second.identifier == "ip:1.2.3.4"


async def test_a_refusal_waits_for_the_enforced_rule_not_the_shadow_one(limiter: Limiter) -> None:
    for _ in range(3):
        assert (await limiter.try_acquire(["ip:5.6.7.8", "user:8"])).allowed
    refused = await limiter.try_acquire(["ip:5.6.7.8", "user:8"])
    assert not refused.allowed
    # The enforced 3/minute refuses (back within a minute); the shadow 1/hour would say an hour.
    assert 0 < refused.retry_after <= 60
    assert refused.identifier == "ip:5.6.7.8"
    assert refused.reset_after <= 60
    # acquire with a 2-minute timeout would wait, not give up at once for the shadow's hour.
    started = time.monotonic()
    with pytest.raises(RateLimited) as caught:
        await limiter.acquire(["ip:5.6.7.8", "user:8"], timeout=0.05)
    assert time.monotonic() - started < 1
    assert 0 < caught.value.decision.retry_after <= 60
