"""Rules as data: the format, its errors, and what overrides, lists and shadow rules decide.

The format tests are pure; the decisions run against a real Redis server.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as redis_asyncio

import aiolimit._limiter as _limiter_module
from aiolimit import (
    Concurrency,
    FixedWindow,
    Limit,
    Limiter,
    MinInterval,
    RateLimited,
    RulesError,
    RuleSet,
    SlidingLog,
    TokenBucket,
)
from aiolimit._follow import rules_keys
from aiolimit._ruleset import scale_limit

TOML = """
shadow = false
allow = ["ip:127.0.0.1"]
deny = ["ip:203.0.113.0/24"]

[kinds]
ip = ["10/second", "120/minute"]
"*" = "50/minute"

[kinds.user]
limits = ["100/minute", { type = "token_bucket", rate = 5, per = 1, burst = 20 }]
shadow = true

[overrides]
"user:42" = { scale = 10 }
"user:7" = { limits = "1/minute" }
"ip:10.0.0.0/8" = { exempt = true }
"""

JSON = """{
  "kinds": {
    "ip": ["10/second", "120/minute"],
    "*": "50/minute",
    "user": {"limits": ["100/minute", {"type": "token_bucket", "rate": 5, "per": 1,
                                        "burst": 20}], "shadow": true}
  },
  "overrides": {"user:42": {"scale": 10}, "user:7": {"limits": "1/minute"},
                "ip:10.0.0.0/8": {"exempt": true}},
  "allow": ["ip:127.0.0.1"],
  "deny": ["ip:203.0.113.0/24"]
}"""


def test_toml_and_json_read_to_the_same_rules() -> None:
    toml, json_rules = RuleSet.from_text(TOML), RuleSet.from_text(JSON, "json")
    assert toml.version == json_rules.version
    assert toml.kinds["user"] == (Limit(100, per=60), TokenBucket(5, per=1, burst=20))
    assert toml.shadow_kinds == {"user"}
    scaled = toml.override_for("user:42")
    assert scaled is not None and scaled.apply(toml.kinds["user"])[0] == Limit(1000, per=60)
    assert toml.override_for("ip:10.200.0.1") == toml.override_for("ip:10.0.0.0/8")
    assert toml.override_for("ip:10.200.0.1").exempt  # type: ignore[union-attr]
    assert toml.override_for("ip:11.0.0.1") is None
    assert toml.override_for("ip:203.0.113.9").deny  # type: ignore[union-attr]
    # A document read back from its canonical form is the same rules.
    assert RuleSet.from_text(toml.document, "json").version == toml.version


@pytest.mark.parametrize(
    ("text", "fmt", "where", "says"),
    [
        ('[kinds]\nuser = "10/sec0nd"', "toml", "kinds.user", "cannot parse limit"),
        (
            '[kinds.user]\nlimits = ["1/s", { type = "token_bucket", rate = "x" }]',
            "toml",
            "kinds.user.limits[1].rate",
            "must be a number",
        ),
        (
            '[kinds]\nip = "1/s"\n[overrides]\n"user:1" = { scale = -2 }',
            "toml",
            'overrides."user:1".scale',
            "must be a number in",
        ),
        (
            '[kinds]\nip = "1/s"\n[overrides]\n"user:1" = { sclae = 2 }',
            "toml",
            'overrides."user:1".sclae',
            "unknown key",
        ),
        ('[kinds]\nip = "1/s"\nlimts = 3', "toml", "kinds.limts", "a limit is a string"),
        ("[kinds]\n", "toml", "kinds", "at least one kind"),
        ('[kinds]\n"a:b" = "1/s"', "toml", 'kinds."a:b"', "without ':'"),
        ('kinds = {ip = "1/s"}\nshadow = "yes"', "toml", "shadow", "true or false"),
        ('kinds = {ip = "1/s"}\ndeny = "ip:1.2.3.4"', "toml", "deny", "a list"),
        ('kinds = {ip = "1/s"}\nextra = 1', "toml", "extra", "unknown key"),
        ('{"kinds": {"ip": "1/s"},\n "deny": [1]}', "json", "deny[0]", "non-empty text"),
        ('{"kinds": {"ip": "1/s"},\n "deny": [}', "json", "line 2", "not valid JSON"),
        # JSON keeps the last of a duplicated key; TOML refuses it, and so does the JSON form.
        ('{"kinds": {"ip": "10/second", "ip": "100000/second"}}', "json", "kinds.ip", "twice"),
        ('{"kinds": {"ip": "1/s"}, "kinds": {"ip": "9/s"}}', "json", "kinds", "twice"),
        (
            '{"kinds": {"ip": "1/s"}, "overrides": {"user:1": {"scale": 2, "scale": 3}}}',
            "json",
            'overrides."user:1".scale',
            "twice",
        ),
        (
            '{"kinds": {"u": [{"type": "window", "amount": 1, "per": 1, "amount": 9}]}}',
            "json",
            "kinds.u[0].amount",
            "twice",
        ),
        ("[kinds\nip = 1", "toml", "", "line 1"),
        ('kinds = {ip = "1/s"}\ndeny = ["ip:10.0.0.0/33"]', "toml", "deny[0]", "valid network"),
        (
            'kinds = {ip = "1/s"}\n[overrides]\n"ip:::1/200" = { exempt = true }',
            "toml",
            'overrides."ip:::1/200"',
            "valid network",
        ),
    ],
)
def test_errors_name_the_key_at_fault(text: str, fmt: str, where: str, says: str) -> None:
    with pytest.raises(RulesError) as caught:
        RuleSet.from_text(text, fmt)
    assert caught.value.where.startswith(where) if where else True
    assert says in str(caught.value)


USER_KINDS = {"user": ["100/minute", {"type": "concurrency", "max": 200}]}


@pytest.mark.parametrize(
    ("kinds", "override", "says"),
    [
        (USER_KINDS, {"user:42": {"scale": 10}}, "Concurrency max must be an int in 1..1000"),
        (
            {"user": [{"type": "sliding_log", "amount": 200_000, "per": 60}]},
            {"user:42": {"scale": 10}},
            "SlidingLog stores up to one entry per unit",
        ),
        (
            {"user": [{"type": "min_interval", "seconds": 0.005}]},
            {"user:42": {"scale": 10}},
            "MinInterval seconds must be between",
        ),
        (
            {"user": [{"type": "min_interval", "seconds": 1e8}]},
            {"user:42": {"scale": 0.1}},
            "MinInterval seconds must be between",
        ),
        ({"user": "100000000000/day"}, {"user:42": {"scale": 100}}, "Limit amount must be"),
        (
            {"user": [{"type": "fixed_window", "amount": 10**11, "per": 60}]},
            {"user:42": {"scale": 11}},
            "FixedWindow amount must be",
        ),
        (
            {"user": [{"type": "token_bucket", "rate": 1, "per": 3600, "burst": 100_000}]},
            {"user:42": {"scale": 10}},
            "TokenBucket burst x per is too large",
        ),
        # No rule of its own kind: scaled from "*".
        ({"*": [{"type": "concurrency", "max": 500}]}, {"user:42": {"scale": 3}}, "1..1000"),
    ],
)
def test_a_scale_whose_limits_cannot_be_built_refuses_the_document(
    kinds: dict[str, object], override: dict[str, object], says: str
) -> None:
    with pytest.raises(RulesError) as caught:
        RuleSet.from_mapping({"kinds": kinds, "overrides": override})
    assert caught.value.where == 'overrides."user:42".scale'
    assert says in str(caught.value)


def test_a_network_scale_whose_limits_cannot_be_built_refuses_the_document() -> None:
    with pytest.raises(RulesError) as caught:
        RuleSet.from_text(
            'kinds = { ip = [{ type = "concurrency", max = 10 }] }\n'
            '[overrides]\n"ip:10.0.0.0/8" = { scale = 1000 }'
        )
    assert caught.value.where == 'overrides."ip:10.0.0.0/8".scale'
    assert "Concurrency max" in str(caught.value)


def test_scaling_at_decision_time_clamps_to_what_the_type_can_hold() -> None:
    """Defence in depth (a document is checked first): the nearest limit the type allows."""
    assert scale_limit(Concurrency(200), 10) == Concurrency(1000)
    assert scale_limit(SlidingLog(200_000, per=60), 10) == SlidingLog(1_000_000, per=60)
    assert scale_limit(MinInterval(0.005), 10) == MinInterval(0.001)
    assert scale_limit(MinInterval(1e8), 0.1).seconds == 10 * 366 * 86400
    assert scale_limit(Limit(10**11, per=60), 100) == Limit(10**12, per=60)
    assert scale_limit(FixedWindow(10**11, per=60), 100) == FixedWindow(10**12, per=60)
    bucket = scale_limit(TokenBucket(1, per=3600, burst=100_000), 10)
    assert isinstance(bucket, TokenBucket) and bucket.rate == 10
    assert 2 * bucket.amount * 3600 * 10**6 < 2**52 <= 2 * (bucket.amount + 1) * 3600 * 10**6
    assert scale_limit(Limit(10, per=60), 0.01) == Limit(1, per=60)  # at least 1 of anything
    assert scale_limit(Concurrency(10, lease_ttl=5), 2.5) == Concurrency(25, lease_ttl=5)


async def test_a_stored_override_that_cannot_be_scaled_never_makes_decisions_raise(
    redis_url: str, prefix: str
) -> None:
    """An override in Redis that no push checked against the kind (written by hand, or the
    kind's limits changed since): decisions use the clamped limits and never raise."""
    rules = RuleSet.from_mapping({"kinds": USER_KINDS, "overrides": {"user:1": {"scale": 2}}})
    raw = redis_asyncio.Redis.from_url(redis_url)
    async with Limiter(redis_url, {"user": "5/minute"}, prefix=prefix, follow_rules=True) as fleet:
        try:
            assert await fleet.push_rules(rules)
            await raw.hset(rules_keys(prefix).overrides, "user:42", '{"scale":10}')
            decision = await fleet.try_acquire("user:42")
            assert decision.allowed and decision.lease is not None
            assert {pair.limit for pair in decision.details} == {
                Limit(1000, per=60),
                Concurrency(1000),
            }
            await decision.lease.release()
        finally:
            await raw.aclose()


@pytest.fixture
async def limiter(redis_url: str, prefix: str) -> AsyncIterator[Limiter]:
    rules = RuleSet.from_mapping(
        {
            "kinds": {"ip": [SlidingLog(2, per=60)], "user": "3/hour", "beta": "1/hour"},
            "overrides": {
                "user:42": {"scale": 10},
                "user:7": {"limits": "1/hour"},
                "ip:10.0.0.0/8": {"exempt": True},
                "user:trial": {"shadow": True},
            },
            "allow": ["ip:127.0.0.1"],
            "deny": ["ip:203.0.113.0/24", "user:banned"],
        }
    )
    made = Limiter(redis_url, rules, prefix=prefix)
    yield made
    await made.aclose()


async def admitted(limiter: Limiter, ids: list[str] | str, n: int) -> list[bool]:
    return [(await limiter.try_acquire(ids)).allowed for _ in range(n)]


async def test_overrides_scale_replace_and_exempt(limiter: Limiter) -> None:
    assert await admitted(limiter, "user:1", 4) == [True] * 3 + [False]
    assert await admitted(limiter, "user:42", 31) == [True] * 30 + [False]
    assert await admitted(limiter, "user:7", 2) == [True, False]
    assert await admitted(limiter, "ip:10.9.8.7", 50) == [True] * 50
    assert await admitted(limiter, "ip:127.0.0.1", 50) == [True] * 50
    # An exempt identifier is left out; the others in the call are decided as usual.
    assert await admitted(limiter, ["ip:10.9.8.7", "user:2"], 4) == [True] * 3 + [False]
    assert (await limiter.peek("ip:10.9.8.7")).details == ()


async def test_deny_refuses_at_once_and_charges_nothing(limiter: Limiter) -> None:
    decision = await limiter.try_acquire(["user:5", "ip:203.0.113.77"])
    assert not decision.allowed and decision.denied
    assert decision.identifier == "ip:203.0.113.77"
    with pytest.raises(RateLimited) as caught:
        await limiter.acquire(["user:banned"], timeout=None)  # never waits
    assert caught.value.decision.denied
    assert (await limiter.peek("user:5")).remaining == 3
    assert limiter.statistics().denied == 2


async def test_shadow_rules_never_refuse_and_are_counted(
    limiter: Limiter, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.WARNING, logger="aiolimit")
    # The report is once per SHADOW_LOG_INTERVAL per process: an earlier test's may be recent.
    monkeypatch.setitem(_limiter_module._shadow_log, "at", -math.inf)
    # user:trial is in shadow; ip:1.2.3.4 (2 per minute) is enforced.
    outcomes = []
    for _ in range(3):
        decision = await limiter.try_acquire(["user:trial", "ip:1.2.3.4"])
        outcomes.append((decision.allowed, bool(decision.shadow_refusals)))
    assert outcomes == [(True, False), (True, False), (False, False)]
    outcomes = [
        ((d := await limiter.try_acquire("user:trial")).allowed, bool(d.shadow_refusals))
        for _ in range(3)
    ]
    # 3 per hour, 2 used above: one more fits, then the shadow rule would refuse.
    assert outcomes == [(True, False), (True, True), (True, True)]
    decision = await limiter.try_acquire(["user:trial", "ip:5.6.7.8"])
    assert decision.allowed and decision.shadow_refusals[0].identifier == "user:trial"
    # The enforced identifier was charged exactly once for the admitted request.
    assert (await limiter.peek("ip:5.6.7.8")).remaining == 1
    assert (await limiter.peek("user:trial")).remaining == 0
    stats = limiter.statistics()
    assert stats.shadow_refusals == 3 and stats.refused == 1
    assert any("aiolimit shadow" in r.getMessage() for r in caplog.records)


async def test_a_shadow_limiter_admits_everything(redis_url: str, prefix: str) -> None:
    rules = RuleSet.from_mapping({"kinds": {"*": "1/hour"}, "shadow": True})
    async with Limiter(redis_url, rules, prefix=prefix) as limiter:
        decisions = [await limiter.try_acquire("k:1") for _ in range(3)]
        assert [d.allowed for d in decisions] == [True] * 3
        assert [bool(d.shadow_refusals) for d in decisions] == [False, True, True]
        assert (await limiter.peek("k:1")).remaining == 0  # charged as enforcement would


async def test_set_rules_applies_to_new_decisions_and_keeps_route_kinds(
    redis_url: str, prefix: str
) -> None:
    async with Limiter(redis_url, {"user": "1/hour"}, prefix=prefix) as limiter:
        limiter.add_rule("GET /x", "5/hour")
        assert await admitted(limiter, "user:1", 2) == [True, False]
        limiter.set_rules(RuleSet.from_mapping({"kinds": {"user": "3/hour"}}))
        assert await admitted(limiter, "user:1", 3) == [True, True, False]
        assert limiter.limits["GET /x"] == (Limit(5, per=3600),)
        limiter.set_rules(None)  # back to the rules it was made with
        assert limiter.limits["user"] == (Limit(1, per=3600),)
        assert limiter.rules.kinds["user"] == (Limit(1, per=3600),)


async def test_shadow_rules_under_concurrency_never_over_admit(redis_url: str, prefix: str) -> None:
    rules = RuleSet.from_mapping(
        {"kinds": {"user": "10/hour", "beta": {"limits": "1/hour", "shadow": True}}}
    )
    async with Limiter(redis_url, rules, prefix=prefix) as limiter:
        decisions = await asyncio.gather(
            *[limiter.try_acquire(["beta:1", "user:1"]) for _ in range(50)]
        )
        assert sum(d.allowed for d in decisions) == 10  # the enforced limit, exactly
        assert (await limiter.peek("user:1")).remaining == 0
        # Counted only for requests admitted because the shadow rule could not refuse them.
        admitted_over_shadow = sum(bool(d.shadow_refusals) for d in decisions)
        assert admitted_over_shadow == 9
        assert limiter.statistics().shadow_refusals == 9
        assert all(not d.shadow_refusals for d in decisions if not d.allowed)
