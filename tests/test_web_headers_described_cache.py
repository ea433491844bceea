"""The web headers' per-(kind, limit) description cache and one-pair path (c2fb58d) write
exactly the headers the plain computation does.

The reference below is the computation before the cache: every pair described anew with
``quota_and_window`` and ``policy_name``, every decision through the general path. Random
decisions over limits equal in value but of different types (``Limit`` and ``FixedWindow``,
``TokenBucket`` and ``MinInterval``), identifiers whose kinds hold odd characters or are
empty, allowed, refused and degraded decisions, legacy headers on and off, and enough
distinct (kind, limit) pairs to clear the 1024-entry cache several times.
"""

from __future__ import annotations

import random

import pytest

from aiolimit import Concurrency, FixedWindow, Limit, MinInterval, SlidingLog, TokenBucket
from aiolimit._decision import Decision, PairDecision
from aiolimit._limits import BaseLimit
from aiolimit._web import headers as web
from aiolimit._web.headers import (
    _effective_window,
    policy_name,
    quota_and_window,
    rate_limit_headers,
    retry_after_seconds,
)


def reference(decision: Decision, *, legacy: bool = False) -> list[tuple[str, str]]:
    if decision.degraded or not decision.details:
        return []
    chosen: dict[str, tuple[str, int, int, PairDecision]] = {}
    for pair in decision.details:
        described = quota_and_window(pair.limit)
        if described is None:
            continue
        name = policy_name(pair.identifier, *described)
        current = chosen.get(name)
        if current is None or (pair.allowed, pair.remaining) < (
            current[3].allowed,
            current[3].remaining,
        ):
            chosen[name] = (name, *described, pair)
    items = list(chosen.values())
    headers: list[tuple[str, str]] = []
    if items:
        policies = ", ".join(f'"{n}";q={q};w={w}' for n, q, w, _ in items)
        limits = ", ".join(
            f'"{n}";r={max(0, p.remaining)};t={_effective_window(p)}' for n, _, _, p in items
        )
        headers += [("RateLimit-Policy", policies), ("RateLimit", limits)]
    if legacy and decision.limit is not None:
        described = quota_and_window(decision.limit)
        binding = next(
            (
                p
                for p in decision.details
                if p.identifier == decision.identifier and p.limit == decision.limit
            ),
            None,
        )
        if described is not None and binding is not None:
            headers += [
                ("X-RateLimit-Limit", str(described[0])),
                ("X-RateLimit-Remaining", str(max(0, decision.remaining))),
                ("X-RateLimit-Reset", str(_effective_window(binding))),
            ]
    if not decision.allowed:
        headers.append(("Retry-After", str(retry_after_seconds(decision))))
    return headers


KINDS = ["ip", "user", "", "a b", 'we"ird', "x;q=1", "ünï", "k" * 40, "a_b", "a-b", "*"]


def limits(rng: random.Random) -> BaseLimit:
    n, per = rng.choice([1, 5, 10, 100]), rng.choice([0.5, 1, 1.0, 60, 3600])
    return rng.choice(
        [
            lambda: Limit(n, per=per),
            lambda: FixedWindow(n, per=per),
            lambda: SlidingLog(n, per=per),
            lambda: TokenBucket(n, per=per, burst=rng.choice([None, 1, 50])),
            lambda: MinInterval(per),
            lambda: TokenBucket(1, per=per, burst=1),  # (MinInterval(per) by value)
            lambda: Concurrency(n, lease_ttl=per),
        ]
    )()


def identifier(rng: random.Random) -> str:
    kind = rng.choice(KINDS)
    if rng.random() < 0.1:
        return f"nocolon{rng.randrange(5)}"
    return f"{kind}:{rng.randrange(5)}"


def random_decision(rng: random.Random) -> Decision:
    pairs = []
    for _ in range(rng.choice([1, 1, 1, 2, 3, 5])):
        allowed = rng.random() < 0.7
        pairs.append(
            PairDecision(
                identifier(rng),
                limits(rng),
                allowed,
                rng.choice([-3, 0, 1, 7, 99]),
                0.0 if allowed else rng.choice([0.0, 0.0001, 0.5, 1.0, 59.9, 3600.0]),
                rng.choice([0.0, 0.2, 1.0, 1.5, 3600.0]),
            )
        )
    decision = Decision.from_pairs(tuple(pairs))
    if rng.random() < 0.05:
        decision = Decision(False, 0, 1.0, 0.0, None, None, (), degraded=True)
    return decision


@pytest.mark.parametrize("seed", range(4))
def test_cached_headers_equal_the_plain_computation(seed: int) -> None:
    rng = random.Random(seed)
    web._DESCRIBED.clear()
    for _ in range(3000):
        decision = random_decision(rng)
        legacy = rng.random() < 0.3
        assert rate_limit_headers(decision, legacy=legacy) == reference(decision, legacy=legacy)


def test_the_cache_is_bounded_and_refilled_correctly() -> None:
    """Past 1024 (kind, limit) entries the cache starts over; every header stays right."""
    web._DESCRIBED.clear()
    for n in range(1, 2600):
        pair = PairDecision(f"k{n % 7}:1", Limit(n, per=1), True, n - 1, 0.0, 1.0)
        decision = Decision.from_pairs((pair,))
        assert rate_limit_headers(decision) == reference(decision)
        assert len(web._DESCRIBED) <= web._DESCRIBED_MAX
        assert len(web._BY_VALUE) <= web._DESCRIBED_MAX
    # Equal by value, different types: described by their own fields each.
    for one, other in ((Limit(5, per=60), FixedWindow(5, per=60)),
                       (MinInterval(2), TokenBucket(1, per=2, burst=1))):  # fmt: skip
        for limit in (one, other, one):
            decision = Decision.from_pairs((PairDecision("ip:1", limit, False, 0, 3.0, 9.0),))
            assert rate_limit_headers(decision) == reference(decision)


def test_equal_limits_that_are_different_objects_share_one_description() -> None:
    """An override applied per identifier makes limit objects of its own: each is described
    once by its value (not once per object), and a limit object that is gone cannot lend its
    description to a later one with its id."""
    web._DESCRIBED.clear()
    web._BY_VALUE.clear()
    for n in range(3000):
        limit = Limit(7 + n % 2, per=60)  # (a fresh object each time; ids get reused)
        decision = Decision.from_pairs((PairDecision(f"ip:{n}", limit, True, 3, 0.0, 9.0),))
        assert rate_limit_headers(decision) == reference(decision)
    assert len(web._BY_VALUE) == 2
