"""What a following limiter does with state under the rules in Redis: reset and refund judge
by the rules in force (an identifier's override included, looked up if this process has not
met it yet), and every override of one call applies. Real servers."""

from __future__ import annotations

import asyncio

from aiolimit import Limiter, RuleSet

KIND = {"user": "100/hour"}
RULES = RuleSet.from_mapping(
    {
        "kinds": KIND,
        "overrides": {
            "user:trial": {"limits": [{"type": "sliding_log", "amount": 1, "per": 3600}]},
            "user:small": {"limits": "2/hour"},
            "user:a": {"limits": "1/hour"},
            "user:b": {"limits": "50/hour"},
        },
    }
)


async def test_reset_forgets_an_override_this_process_never_met(
    redis_url: str, prefix: str
) -> None:
    async with Limiter(redis_url, KIND, prefix=prefix, follow_rules=True) as a:
        assert await a.push_rules(RULES)
        assert [(await a.try_acquire("user:trial")).allowed for _ in range(2)] == [True, False]
        async with Limiter(redis_url, KIND, prefix=prefix, follow_rules=True) as b:
            await b.reset("user:trial")  # b never decided for user:trial
        assert (await a.try_acquire("user:trial")).allowed


async def test_reset_forgets_keys_of_the_limiters_own_rules_too(
    redis_url: str, prefix: str
) -> None:
    """State charged under the limiter's own rules (before the document came) goes too."""
    own = {"user": [{"type": "sliding_log", "amount": 1, "per": 60}]}
    async with Limiter(redis_url, RuleSet.from_mapping({"kinds": own}), prefix=prefix) as plain:
        assert (await plain.try_acquire("user:x")).allowed
        log_key = plain.storage_keys("user:x")[-1]
    assert ":log:" in log_key
    async with Limiter(
        redis_url, RuleSet.from_mapping({"kinds": own}), prefix=prefix, follow_rules=True
    ) as follower:
        assert await follower.push_rules(RuleSet.from_mapping({"kinds": KIND}))
        await follower.reset("user:x")
        assert await follower.store.command("EXISTS", log_key) == 0


async def test_refund_gives_back_under_the_override(redis_url: str, prefix: str) -> None:
    async with Limiter(redis_url, KIND, prefix=prefix, follow_rules=True) as a:
        assert await a.push_rules(RULES)
        assert [(await a.try_acquire("user:small")).allowed for _ in range(3)] == [
            True,
            True,
            False,
        ]
        async with Limiter(redis_url, KIND, prefix=prefix, follow_rules=True) as b:
            refunded = await b.refund("user:small")
            assert [str(pair.limit) for pair in refunded.details] == ["2/hour"]
        assert (await a.try_acquire("user:small")).allowed


async def test_every_override_of_one_call_applies_past_the_cache_size(
    redis_url: str, prefix: str
) -> None:
    async with Limiter(
        redis_url, KIND, prefix=prefix, follow_rules=True, override_cache_size=1
    ) as limiter:
        assert await limiter.push_rules(RULES)
        decision = await limiter.try_acquire(["user:a", "user:b"])
        used = {pair.identifier: str(pair.limit) for pair in decision.details}
        assert used == {"user:a": "1/hour", "user:b": "50/hour"}
        again = await limiter.try_acquire(["user:b", "user:a"])  # user:b cached, user:a not
        assert {p.identifier: str(p.limit) for p in again.details} == used


async def test_a_push_before_any_decision_starts_following(redis_url: str, prefix: str) -> None:
    async with (
        Limiter(redis_url, KIND, prefix=prefix) as other,
        Limiter(redis_url, KIND, prefix=prefix, follow_rules=True, rules_interval=0.1) as limiter,
    ):
        assert await limiter.push_rules(RULES)
        assert limiter.statistics().rules_version == RULES.version
        later = RuleSet.from_mapping({"kinds": {"user": "7/hour"}})
        assert await other.push_rules(later)
        async with asyncio.timeout(3):
            while limiter.statistics().rules_version != later.version:  # noqa: ASYNC110
                await asyncio.sleep(0.02)
