"""Refunds through a decision, cross-slot bursts on a hot identifier, huge integers in rules,
and stale counters on a key two rules versions share (from an adversarial review). Real
redis-server processes (conftest); each test names the one invariant it checks."""

from __future__ import annotations

import asyncio
import json
import random
import socket
from typing import Any

import pytest
import redis.asyncio as redis_asyncio

from aiolimit import InvalidRequestError, Limit, Limiter, RuleSet
from aiolimit.testing import ManualClock

START = 1_700_000_040.0  # on a minute boundary


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- change 2: refund(ids, weight, decision=) ------------------------------------------------


async def test_refund_of_a_real_degraded_decision_is_returned_as_is() -> None:
    """README/docstring: 'A degraded decision charged nothing: it is returned as is, and nothing
    is sent.' A real fail-open decision (store down) has no details, so plans_charged raises
    'identifier ... was not charged' before the degraded check (_limiter.py refund)."""
    url = f"redis://127.0.0.1:{_closed_port()}"
    async with Limiter(url, "5/minute", on_error="open", deadline=0.5) as limiter:
        degraded = await limiter.try_acquire("user:1")
        assert degraded.allowed and degraded.degraded
        assert await limiter.refund("user:1", decision=degraded) is degraded


async def test_refund_with_another_limiters_decision_credits_nothing_here(
    redis_url: str, prefix: str
) -> None:
    """refund(decision=) 'credits only the pairs that decision charged'. A decision admitted by
    limiter A (prefix p:a) charged nothing under limiter B (prefix p:b); B.refund(ids,
    decision=a_decision) must not credit B's counters (or must be an InvalidRequestError).
    Observed: it credits B's 2/minute pair, and B admits a 3rd request within a minute."""
    clock = ManualClock(START)
    async with (
        Limiter(redis_url, "2/minute", prefix=prefix + ":a", clock=clock) as a,
        Limiter(redis_url, "2/minute", prefix=prefix + ":b", clock=clock) as b,
    ):
        from_a = await a.try_acquire("user:1")
        assert from_a.allowed
        assert [(await b.try_acquire("user:1")).allowed for _ in range(2)] == [True, True]
        try:
            await b.refund("user:1", decision=from_a)
        except InvalidRequestError:
            pass
        admitted = (await b.try_acquire("user:1")).allowed
        assert not admitted, "B admitted 3 within one minute under 2/minute"


async def test_refund_twice_with_one_decision_does_not_over_admit(
    redis_url: str, prefix: str
) -> None:
    """refund(decision=d) credits 'only the pairs that decision charged': d charged 1 unit, so
    refunding it twice must not give back a unit another request was charged. Observed: the
    second refund credits the other request's unit; 3 admitted within a minute under 2/minute."""
    clock = ManualClock(START)
    async with Limiter(redis_url, "2/minute", prefix=prefix, clock=clock) as limiter:
        d = await limiter.try_acquire("user:1")
        assert d.allowed
        assert (await limiter.try_acquire("user:1")).allowed  # another request
        await limiter.refund("user:1", decision=d)
        try:
            await limiter.refund("user:1", decision=d)
        except InvalidRequestError:
            pass
        admitted = [(await limiter.try_acquire("user:1")).allowed for _ in range(2)]
        assert admitted == [True, False], "3 admitted within one minute under 2/minute"


async def test_refund_of_a_decision_never_gives_back_more_than_it_charged(
    redis_url: str, prefix: str
) -> None:
    """d charged weight 1; refund(ids, 5, decision=d) must credit at most 1 (or be an
    InvalidRequestError). Observed: 5 are credited, other requests' charges included."""
    clock = ManualClock(START)
    async with Limiter(redis_url, "5/minute", prefix=prefix, clock=clock) as limiter:
        d = await limiter.try_acquire("user:1")
        assert d.allowed
        assert (await limiter.try_acquire("user:1", 4)).allowed  # another request: full
        try:
            await limiter.refund("user:1", 5, decision=d)
        except InvalidRequestError:
            pass
        remaining = (await limiter.peek("user:1")).remaining
        assert remaining <= 1, f"{remaining} left after refunding a decision that charged 1"


# -- change 3: the cross-slot check before the in-flight cap -----------------------------------


def _cross_slot_users(hot: str, count: int) -> list[str]:
    """`count` identifiers whose main keys are each in a slot other than `hot`'s."""
    from redis.crc import key_slot

    from aiolimit._keys import main_key

    hot_slot = key_slot(main_key("x", hot).encode())
    users = []
    i = 0
    while len(users) < count:
        name = f"user:{i}"
        i += 1
        if key_slot(main_key("x", name).encode()) != hot_slot:
            users.append(name)
    return users


async def test_a_cross_slot_burst_on_a_hot_identifier_compensates_at_most_the_cap(
    redis_cluster_url: str, prefix: str
) -> None:
    """Bounded cost: 2000 calls at once on ["global", "user:<i>"] (distinct users, other slots)
    with 50/minute on "global". With the check inside the cap, at most MAX_IN_FLIGHT checks
    raced: ~78 commits were refused and compensated, the rest refused at their check, reading
    the state the earlier commits wrote. With every check first (and no second check) they all
    passed on the empty state; then each commit past the first ones was refused on "global"
    after its other slot charged, and undone: a commit plus a compensation per call instead of
    one check. Measured: 78-100 compensations whatever the burst (1000 or 3000 calls) with the
    check inside the cap; 270-334 for 1000 calls, 2126 for 3000 without the second check. A
    call that queued for its places now checks again before it commits."""
    from aiolimit._protocol import MAX_IN_FLIGHT

    clock = ManualClock(START)
    users = _cross_slot_users("global", 2000)
    async with Limiter(redis_cluster_url, "50/minute", prefix=prefix, clock=clock) as limiter:
        decisions = await asyncio.wait_for(
            asyncio.gather(*(limiter.try_acquire(["global", u]) for u in users)), 60
        )
        assert sum(d.allowed for d in decisions) == 50
        stats = limiter.statistics()
        assert stats.compensations <= MAX_IN_FLIGHT, (
            f"{stats.compensations} compensations for a burst of {len(users)} "
            f"(at most {MAX_IN_FLIGHT} before the change)"
        )


async def test_a_cross_slot_burst_leaves_every_refused_user_untouched(
    redis_cluster_url: str, prefix: str
) -> None:
    """All or nothing across slots under the same burst: every call refused (at its check or
    compensated after its commit) leaves its user's counter as if it never happened."""
    clock = ManualClock(START)
    users = _cross_slot_users("global", 600)
    async with Limiter(redis_cluster_url, "50/minute", prefix=prefix, clock=clock) as limiter:
        decisions = await asyncio.wait_for(
            asyncio.gather(*(limiter.try_acquire(["global", u]) for u in users)), 60
        )
        await asyncio.sleep(0.5)  # (background undos, if any, finish)
        refused = [u for u, d in zip(users, decisions, strict=True) if not d.allowed]
        assert len(refused) == len(users) - 50
        peeks = await asyncio.gather(*(limiter.peek(u) for u in refused))
        assert [p.remaining for p in peeks] == [50] * len(refused)


# -- change 4: bad rules input is a RulesError -------------------------------------------------

HUGE = "1" * 5000  # an integer past Python's 4300-digit int() limit: int(HUGE) is a ValueError


def test_a_limit_string_with_a_huge_amount_is_a_rules_error() -> None:
    """RuleSet.from_mapping must answer every bad limit with RulesError. A limit string whose
    amount has 5000 digits raises ValueError ('Exceeds the limit (4300 digits)') from
    Limit.parse's int() (_limits.py:152), which parse_limits does not catch."""
    from aiolimit._ruleset import RulesError

    with pytest.raises(RulesError):
        RuleSet.from_mapping({"kinds": {"user": HUGE + "/second"}})


def test_toml_with_a_huge_integer_is_a_rules_error() -> None:
    """RuleSet.from_text(toml): tomllib raises ValueError (not TOMLDecodeError) for an integer
    of 5000 digits; from_text catches only TOMLDecodeError and RecursionError (the JSON branch
    catches ValueError)."""
    from aiolimit._ruleset import RulesError

    with pytest.raises(RulesError):
        RuleSet.from_text(f"version = {HUGE}\nkinds.user = '5/minute'\n", "toml")


async def test_a_stored_document_with_a_huge_limit_string_is_rejected_not_raised(
    redis_url: str, prefix: str
) -> None:
    """follow_rules=True with a document in Redis whose limit string has a 5000-digit amount:
    it must be rejected (counted, rules in force stay), never reach a decision's caller as an
    untyped ValueError. _follow.py _refresh_locked catches only RulesError/ConfigurationError."""
    from aiolimit._follow import rules_keys

    raw = json.dumps(
        {"format": 1, "version": "v-huge", "rules": {"kinds": {"*": HUGE + "/second"}}}
    )
    client = redis_asyncio.from_url(redis_url)
    try:
        await client.set(rules_keys(prefix).doc, raw)
    finally:
        await client.aclose()
    async with Limiter(redis_url, "3/minute", prefix=prefix, follow_rules=True) as limiter:
        decision = await limiter.try_acquire("user:1")
        assert decision.allowed and decision.limit == Limit(3, 60)
        assert limiter.statistics().rules_rejected == 1


# -- change 1: stale counters dropped with the prune -------------------------------------------


def _verdicts(decision: Any) -> list[tuple[bool, int, float, float]]:
    return [
        (p.allowed, p.remaining, round(p.retry_after, 6), round(p.reset_after, 6))
        for p in decision.details
    ]


@pytest.mark.parametrize("store", ["redis", "memory"])
async def test_a_rolling_deploy_on_one_key_decides_as_two_keys_would(
    redis_url: str, prefix: str, store: str
) -> None:
    """Differential: two limiters with disjoint rules (so no counter is shared) on ONE prefix
    prune each other's fields as they go stale; the same random workload on two separate
    prefixes never has a foreign field. Every decision (allowed, remaining, per-pair retry)
    must be the same (reset_after too): a dropped stale counter reads as an absent one. Rules
    include a precision that does not divide the period, a fixed window and a token bucket;
    refunds included; time jumps past the TTL step so the prune runs often. (Held.)"""
    from aiolimit import FixedWindow, TokenBucket

    url = redis_url if store == "redis" else "memory://"
    rules_1 = [Limit(5, per=7, precision=3), TokenBucket(3, per=2, burst=4)]
    rules_2 = [FixedWindow(4, per=5), Limit(6, per=10, precision=4)]
    rng = random.Random(1234)
    clock = ManualClock(START)
    async with (
        Limiter(url, rules_1, prefix=prefix + ":j", clock=clock) as joint_1,
        Limiter(url, rules_2, prefix=prefix + ":j", clock=clock) as joint_2,
        Limiter(url, rules_1, prefix=prefix + ":s1", clock=clock) as alone_1,
        Limiter(url, rules_2, prefix=prefix + ":s2", clock=clock) as alone_2,
    ):
        pairs = [(joint_1, alone_1), (joint_2, alone_2)]
        for step in range(600):
            joint, alone = pairs[rng.randrange(2)]
            action = rng.random()
            ident = f"user:{rng.randrange(2)}"
            if action < 0.75:
                weight = rng.randint(1, 3)
                got = await joint.try_acquire(ident, weight)
                want = await alone.try_acquire(ident, weight)
            else:
                weight = rng.randint(1, 2)
                got = await joint.refund(ident, weight)
                want = await alone.refund(ident, weight)
            assert (got.allowed, _verdicts(got)) == (want.allowed, _verdicts(want)), f"step {step}"
            clock.advance(rng.choice([0.0, 0.01, 0.3, 1.1, 2.5, 6.0]))
