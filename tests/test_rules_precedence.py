"""Which rule decides an identifier: "a deny wins, then allow / exempt, then its exact
override, then the most specific network, then its kind, then '*'" (README, Rules as data).

Each document is decided twice on a real server: given to the limiter directly, and pushed
and followed from Redis (where exact overrides live in a hash looked up per identifier). The
two must decide alike.
"""

from __future__ import annotations

from typing import Any

import pytest

from aiolimit import Limiter, RuleSet

KINDS = {"ip": "3/minute"}
A = "ip:10.1.1.1"

CASES: dict[str, tuple[dict[str, Any], list[str]]] = {
    # A network deny wins over an exact override of an address inside it.
    "network deny > exact override": (
        {"deny": ["ip:10.0.0.0/8"], "overrides": {A: {"scale": 10}}},
        ["denied"] * 4,
    ),
    "network deny > exact exempt": (
        {"deny": ["ip:10.0.0.0/8"], "overrides": {A: {"exempt": True}}},
        ["denied"] * 4,
    ),
    "network deny > exact allow": ({"deny": ["ip:10.0.0.0/8"], "allow": [A]}, ["denied"] * 4),
    "network deny > more specific network allow": (
        {"deny": ["ip:10.0.0.0/8"], "allow": ["ip:10.1.0.0/16"]},
        ["denied"] * 4,
    ),
    "exact deny > network exempt": (
        {"deny": [A], "overrides": {"ip:10.0.0.0/8": {"exempt": True}}},
        ["denied"] * 4,
    ),
    # Then allow / exempt, from the identifier itself or any network holding it.
    "network exempt > exact override": (
        {"overrides": {"ip:10.0.0.0/8": {"exempt": True}, A: {"limits": "1/hour"}}},
        ["exempt"] * 4,
    ),
    "exact exempt > network override": (
        {"overrides": {"ip:10.0.0.0/8": {"scale": 2}, A: {"exempt": True}}},
        ["exempt"] * 4,
    ),
    "network allow > more specific network override": (
        {"allow": ["ip:10.0.0.0/8"], "overrides": {"ip:10.1.0.0/16": {"limits": "1/hour"}}},
        ["exempt"] * 4,
    ),
    # Then the exact override, then the most specific network.
    "exact override > network override": (
        {"overrides": {"ip:10.0.0.0/8": {"scale": 2}, A: {"limits": "1/hour"}}},
        ["yes", "no", "no", "no"],
    ),
    "most specific network override": (
        {"overrides": {"ip:10.0.0.0/8": {"scale": 2}, "ip:10.1.0.0/16": {"limits": "2/hour"}}},
        ["yes", "yes", "no", "no"],
    ),
    "the kind's rule": ({"overrides": {"ip:11.0.0.0/8": {"scale": 2}}}, ["yes"] * 3 + ["no"]),
}


async def outcomes(limiter: Limiter, identifier: str, count: int) -> list[str]:
    seen = []
    for _ in range(count):
        decision = await limiter.try_acquire(identifier)
        if decision.denied:
            seen.append("denied")
        elif decision.allowed and not decision.details:
            seen.append("exempt")  # left out of the decision: never limited
        else:
            seen.append("yes" if decision.allowed else "no")
    return seen


@pytest.mark.parametrize("case", list(CASES))
def test_the_rule_that_decides_follows_the_documented_precedence(case: str) -> None:
    document, expected = CASES[case]
    rules = RuleSet.from_mapping({"kinds": KINDS, **document})
    found = rules.override_for(A)
    first = expected[0]
    assert (found is not None and found.deny) is (first == "denied")
    assert (found is not None and found.exempt and not found.deny) is (first == "exempt")


@pytest.mark.parametrize("case", list(CASES))
async def test_a_file_and_the_followed_document_decide_alike(
    case: str, redis_url: str, prefix: str
) -> None:
    document, expected = CASES[case]
    rules = RuleSet.from_mapping({"kinds": KINDS, **document})
    async with Limiter(redis_url, rules, prefix=f"{prefix}-file") as local:
        assert await outcomes(local, A, len(expected)) == expected
    # Followed: the exact overrides are in a Redis hash, the rest in the document.
    async with Limiter(
        redis_url, {"ip": "100/minute"}, prefix=f"{prefix}-redis", follow_rules=True
    ) as fleet:
        assert await fleet.push_rules(rules)
        assert await outcomes(fleet, A, len(expected)) == expected
