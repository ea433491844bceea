"""``count_refused=True`` with shadow rules: a request that only a shadow rule refuses is
admitted, and counted once on the enforced limits, as every request is under count_refused.
The refusal had charged every pair already (the penalty); deciding again under the enforced
rules alone charged the enforced ones a second time, so they ran out at half the rate."""

from __future__ import annotations

import pytest

from aiolimit import Limiter, RuleSet


def _rules() -> RuleSet:
    # ip: enforced, 10 per minute; user: in shadow, 1 per hour.
    return RuleSet.from_mapping(
        {"kinds": {"ip": "10/minute", "user": {"limits": "1/hour", "shadow": True}}}
    )


@pytest.mark.parametrize("store", ["redis", "cluster", "memory"])
async def test_a_shadow_refusal_is_counted_once_on_the_enforced_limits(
    store: str, redis_url: str, redis_cluster_url: str, prefix: str
) -> None:
    url = {"redis": redis_url, "cluster": redis_cluster_url, "memory": "memory://"}[store]
    async with Limiter(url, _rules(), prefix=prefix, count_refused=True) as limiter:
        told = []
        for _ in range(4):
            decision = await limiter.try_acquire(["ip:1", "user:7"])
            told.append((decision.allowed, decision.remaining))
        last = decision
        # Four requests, all admitted (the shadow 1/hour refuses the last three): each is
        # counted once on ip's 10/minute.
        assert told == [(True, 9), (True, 8), (True, 7), (True, 6)]
        assert (await limiter.peek("ip:1")).remaining == 6
        # The shadow pair counts them all (the penalty: refused requests count there).
        assert (await limiter.peek("user:7")).details[0].remaining == 0
        counts = limiter.statistics()
        assert counts.allowed == 4 and counts.refused == 0 and counts.shadow_refusals == 3
        # What the last admission charged on the enforced limit can be given back.
        await limiter.refund("ip:1", decision=last)
        assert (await limiter.peek("ip:1")).remaining == 7
