"""Rules that change while requests are in flight, and limiters with different rules on
one store. Real redis-server processes (conftest's fixtures); each test names the promise it
checks (from an adversarial review)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import redis.asyncio as redis_asyncio

from aiolimit import Limit, Limiter, RuleSet, TokenBucket
from aiolimit._errors import AiolimitError
from aiolimit._follow import rules_keys
from aiolimit.testing import ManualClock

START = 1_700_000_040.0  # on a minute boundary (and so on a second boundary)


# -- promise 4: bad input is a typed error at the boundary; following keeps good rules ----------

# Each is JSON that a rules document or a stored override may hold; RuleSet.from_mapping
# raises a non-RulesError on it: a TypeError (an unhashable "type"), an OverflowError (an
# integer too large for a float), a RecursionError (deep nesting).
BAD_LIMIT_TABLES = {
    "unhashable_type": '{"type": ["window"], "amount": 1, "per": 60}',
    "huge_integer_per": '{"type": "window", "amount": 1, "per": 1' + "0" * 400 + "}",
}


@pytest.mark.parametrize("name", sorted(BAD_LIMIT_TABLES))
def test_rules_text_with_a_bad_limit_table_is_a_rules_error(name: str) -> None:
    """RuleSet.from_text (a rules file) must answer a bad limit table with RulesError."""
    text = '{"kinds": {"user": [' + BAD_LIMIT_TABLES[name] + "]}}"
    with pytest.raises(AiolimitError):
        RuleSet.from_text(text, "json")


def test_rules_toml_with_a_list_as_type_is_a_rules_error() -> None:
    text = 'kinds = { user = [ { type = ["window"], amount = 1, per = 60 } ] }\n'
    with pytest.raises(AiolimitError):
        RuleSet.from_text(text, "toml")


@pytest.mark.parametrize("name", sorted(BAD_LIMIT_TABLES))
async def test_a_bad_override_in_redis_is_ignored_not_raised(
    redis_url: str, prefix: str, name: str
) -> None:
    """An invalid override in the Redis hash is documented as logged and ignored (the kind's
    rule decides). One whose limit table trips a TypeError/OverflowError must not make every
    decision on that identifier raise an untyped exception."""
    good = RuleSet.from_mapping(
        {"kinds": {"user": "5/minute"}, "overrides": {"user:vip": {"scale": 2}}}
    )
    async with Limiter(redis_url, "100/minute", prefix=prefix, follow_rules=True) as limiter:
        assert await limiter.push_rules(good)
        client = redis_asyncio.from_url(redis_url)
        try:
            await client.hset(
                rules_keys(prefix).overrides,
                "user:bad",
                '{"limits": [' + BAD_LIMIT_TABLES[name] + "]}",
            )
        finally:
            await client.aclose()
        decision = await limiter.try_acquire("user:bad")  # observed: TypeError / OverflowError
        assert decision.allowed
        assert decision.limit == Limit(5, 60)


BAD_DOCUMENTS = {
    "unhashable_type": {"kinds": {"*": [json.loads(BAD_LIMIT_TABLES["unhashable_type"])]}},
    "deep_nesting": None,  # built as text below
}


@pytest.mark.parametrize("name", sorted(BAD_DOCUMENTS))
async def test_a_garbage_rules_document_is_rejected_not_raised(
    redis_url: str, prefix: str, name: str
) -> None:
    """A document that does not validate is rejected as a whole (logged, counted) and the
    rules in force stay (for a new process: its own). It must not reach the caller of a
    decision as an untyped exception."""
    if name == "deep_nesting":
        raw = '{"format": 1, "version": "v-deep", "rules": ' + "[" * 100_000 + "]" * 100_000 + "}"
    else:
        raw = json.dumps({"format": 1, "version": "v-bad", "rules": BAD_DOCUMENTS[name]})
    client = redis_asyncio.from_url(redis_url)
    try:
        await client.set(rules_keys(prefix).doc, raw)
    finally:
        await client.aclose()
    async with Limiter(redis_url, "3/minute", prefix=prefix, follow_rules=True) as limiter:
        decision = await limiter.try_acquire("user:1")  # observed: TypeError / RecursionError
        assert decision.allowed and decision.limit == Limit(3, 60)
        assert limiter.statistics().rules_rejected == 1


# -- promise 3: bounded state per rules version ------------------------------------------------


async def _fields(redis_url: str, key: str) -> list[bytes]:
    client = redis_asyncio.from_url(redis_url)
    try:
        return sorted(await client.hkeys(key))
    finally:
        await client.aclose()


@pytest.mark.parametrize(
    "version",
    [
        pytest.param(lambda v: [Limit(5, per=v + 2)], id="sliding"),
        pytest.param(lambda v: [TokenBucket(v + 1, per=1, burst=5)], id="token-bucket"),
    ],
)
async def test_stale_fields_of_replaced_rules_go_once_their_windows_pass(
    redis_url: str, prefix: str, version: Any
) -> None:
    """Every rules version whose limits store under a new field (another period, precision,
    rate) leaves its field in each busy identifier's hash: the key never idles, so it never
    expires. Once a field holds nothing (its window passed, its bucket refilled) it goes: 40
    versions do not leave 40 fields."""
    clock = ManualClock(START)
    async with Limiter(redis_url, version(0), prefix=prefix, clock=clock) as limiter:
        key = limiter.storage_keys("user:1")[0]
        for v in range(40):
            limiter.set_rules(version(v))
            assert (await limiter.try_acquire("user:1")).allowed
            clock.advance(0.5)
        clock.advance(45)  # past the longest window (41 s), and every bucket refilled
        assert (await limiter.try_acquire("user:1")).allowed
        fields = await _fields(redis_url, key)
    # In force: one limit field, plus "t", "x" and this limiter's op ledger.
    assert len(fields) == 4, fields


async def test_a_live_counter_of_other_rules_on_the_key_is_kept(
    redis_url: str, prefix: str
) -> None:
    """Two limiters on one prefix with different rules (a rolling deploy): the one that prunes
    the key must not drop the other's counter while its window holds charges."""
    clock = ManualClock(START)
    async with (
        Limiter(redis_url, "5/10s", prefix=prefix, clock=clock) as old,
        Limiter(redis_url, "50/20s", prefix=prefix, clock=clock) as new,
    ):
        for _ in range(3):
            assert (await old.try_acquire("user:1")).allowed
        clock.advance(5)
        for _ in range(3):  # its first ledger in the key prunes the key's fields
            assert (await new.try_acquire("user:1")).allowed
        clock.advance(3)  # 8 s after the old limiter's charges: its window holds them
        admitted = [(await old.try_acquire("user:1")).allowed for _ in range(4)]
    assert admitted == [True, True, False, False]


async def test_fields_that_only_look_like_counters_are_left_alone(
    redis_url: str, prefix: str
) -> None:
    """A field named like a counter but not holding one (written by hand) is not judged, and
    the prune reading it raises nothing."""
    clock = ManualClock(START)
    async with Limiter(redis_url, "5/second", prefix=prefix, clock=clock) as limiter:
        assert (await limiter.try_acquire("user:1")).allowed
        key = limiter.storage_keys("user:1")[0]
        client = redis_asyncio.from_url(redis_url)
        try:
            odd = {"w": "1", "wx/y": "1|0|0:1", "w1/0": "1|0|0:1", "g1/x/2": "5:0", "gx": "",
                   "f5/5": "garbage", "w10/1": "1|0|", "g1000000/1/1": "x:0"}  # fmt: skip
            await client.hset(key, mapping=odd)
            clock.advance(60)  # the TTL step passes: this write prunes
            assert (await limiter.try_acquire("user:1")).allowed
            left = {name.decode() for name in await client.hkeys(key)}
        finally:
            await client.aclose()
    assert set(odd) <= left


# -- promises 1 and 2: a refund after a rules change -------------------------------------------


@pytest.mark.parametrize("store", ["redis", "memory"])
async def test_refund_after_a_limit_was_added_does_not_over_admit(
    redis_url: str, prefix: str, store: str
) -> None:
    """A request admitted under v1 (5/minute) is refunded after v2 (5/minute + 2/second) came
    into force. Refunded by identifier, the refund follows the rules in force and credits the
    2/second pair, which that request was never charged (a third request was then admitted in
    that second). Refunded with its decision, only the pairs it charged get it back."""
    clock = ManualClock(START)
    url = redis_url if store == "redis" else "memory://"
    async with Limiter(url, "5/minute", prefix=prefix, clock=clock) as limiter:
        first = await limiter.try_acquire("user:1")  # A, under v1
        assert first.allowed
        limiter.set_rules("5/minute;2/second")
        clock.advance(0.1)
        admitted_this_second = 0
        for _ in range(2):  # B, C under v2: the 2/second pair is full
            admitted_this_second += (await limiter.try_acquire("user:1")).allowed
        assert admitted_this_second == 2
        assert not (await limiter.try_acquire("user:1")).allowed
        after = await limiter.refund("user:1", 1, decision=first)  # A failed: give it back
        assert [(str(p.limit), p.remaining) for p in after.details] == [("5/minute", 3)]
        clock.advance(0.1)  # still the same second
        admitted_this_second += (await limiter.try_acquire("user:1")).allowed  # D
        assert admitted_this_second == 2, "admitted 3 within one second under 2/second"
        clock.advance(1)  # the next second: the 5/minute pair had A's unit back
        assert [(await limiter.try_acquire("user:1")).allowed for _ in range(3)] == [
            True, True, False,
        ]  # fmt: skip


@pytest.mark.parametrize("store", ["redis", "memory"])
async def test_refund_of_a_decision_credits_a_limit_the_rules_dropped_since(
    redis_url: str, prefix: str, store: str
) -> None:
    """v1 is 2/minute + 100/hour; v2 keeps only 100/hour. A decision made under v1, refunded
    with it under v2, gives its unit back to the 2/minute pair too: v1 back in force admits
    two again."""
    clock = ManualClock(START)
    url = redis_url if store == "redis" else "memory://"
    async with Limiter(url, "2/minute;100/hour", prefix=prefix, clock=clock) as limiter:
        decisions = [await limiter.try_acquire("user:1") for _ in range(2)]
        assert all(decisions)
        limiter.set_rules("100/hour")
        after = await limiter.refund("user:1", decision=decisions[1])
        assert [str(p.limit) for p in after.details] == ["2/minute", "100/hour"]
        limiter.set_rules(None)
        assert [(await limiter.try_acquire("user:1")).allowed for _ in range(2)] == [True, False]


async def test_refund_of_a_decision_refuses_what_it_did_not_charge(
    redis_url: str, prefix: str
) -> None:
    """Bad input is a typed error and changes nothing stored: an identifier the decision did
    not charge, a refused decision, something that is not a decision, one that records no
    charge, a weight above what it charged, a second refund of what it charged (through a
    copy of it too). One of its identifiers alone may be given back."""
    from aiolimit import Decision, InvalidRequestError

    clock = ManualClock(START)
    async with Limiter(redis_url, "2/minute", prefix=prefix, clock=clock) as limiter:
        both = await limiter.try_acquire(["user:1", "user:2"])
        assert (await limiter.try_acquire("user:1")).allowed
        refused = await limiter.try_acquire("user:1")
        assert not refused.allowed
        with pytest.raises(InvalidRequestError, match="'user:3' was not charged"):
            await limiter.refund(["user:1", "user:3"], decision=both)
        with pytest.raises(InvalidRequestError, match="refused decision"):
            await limiter.refund("user:1", decision=refused)
        with pytest.raises(InvalidRequestError, match="must be a Decision"):
            await limiter.refund("user:1", decision="user:1")  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError, match="records no charge"):
            await limiter.refund("user:1", decision=Decision.from_pairs(both.details))
        with pytest.raises(InvalidRequestError, match="more than it charged there: 1 of its 1"):
            await limiter.refund("user:1", 2, decision=both)
        copy = dataclasses.replace(both, remaining=99)  # (a copy shares what is left)
        assert [p.remaining for p in (await limiter.peek(["user:1", "user:2"])).details] == [0, 1]
        partial = await limiter.refund("user:2", decision=copy)  # one of its identifiers
        assert [p.identifier for p in partial.details] == ["user:2"]
        assert [p.remaining for p in (await limiter.peek(["user:1", "user:2"])).details] == [0, 2]
        with pytest.raises(InvalidRequestError, match="0 of its 1 are left"):
            await limiter.refund("user:2", decision=both)
        assert [p.remaining for p in (await limiter.peek(["user:1", "user:2"])).details] == [0, 2]


# -- held before the review's fixes too --------------------------------------------------------


async def test_cached_refusal_does_not_outlive_a_larger_limit(redis_url: str, prefix: str) -> None:
    """cache_refusals=True: a pair refused under 1/hour is not refused from the cache once the
    rules say 10/hour (the cache matches entries by limit). Held."""
    clock = ManualClock(START)
    async with Limiter(
        redis_url, "1/hour", prefix=prefix, clock=clock, cache_refusals=True
    ) as limiter:
        assert (await limiter.try_acquire("user:1")).allowed
        assert not (await limiter.try_acquire("user:1")).allowed  # cached for ~1 h
        limiter.set_rules("10/hour")
        assert (await limiter.try_acquire("user:1")).allowed


async def test_lease_taken_under_v1_is_released_after_v2_dropped_concurrency(
    redis_url: str, prefix: str
) -> None:
    """A Concurrency lease taken under v1 is released by its own plans after v2 removed the
    limit; v3 bringing it back finds the slot free. Held."""
    from aiolimit import Concurrency

    async with Limiter(redis_url, [Concurrency(1)], prefix=prefix) as limiter:
        first = await limiter.try_acquire("user:1")
        assert first.allowed and first.lease is not None
        limiter.set_rules("100/minute")
        await first.lease.release()
        limiter.set_rules([Concurrency(1)])
        again = await limiter.try_acquire("user:1")
        assert again.allowed and again.lease is not None
        await again.lease.release()


async def test_a_decision_pickles_and_leaves_its_charge_behind(redis_url: str, prefix: str) -> None:
    """A decision pickles (and deep-copies) as before the charge it records was added; the
    copy reads the same, and a refund through it is refused (it records no charge)."""
    import copy
    import pickle

    from aiolimit import InvalidRequestError

    async with Limiter(redis_url, "2/minute", prefix=prefix) as limiter:
        decision = await limiter.try_acquire("user:1")
        for clone in (pickle.loads(pickle.dumps(decision)), copy.deepcopy(decision)):
            assert clone == decision and clone.details == decision.details
            with pytest.raises(InvalidRequestError, match="records no charge"):
                await limiter.refund("user:1", decision=clone)
        assert (await limiter.refund("user:1", decision=decision)).details[0].remaining == 2
