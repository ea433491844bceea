"""reply_decision(call, raw) == decision(decode(call, raw)), field for field, over many raw
replies and plans (one identifier under one limit: the direct path; anything else: the
general one)."""

from __future__ import annotations

import random

import pytest

from aiolimit import Concurrency, Limit, MinInterval, SlidingLog, TokenBucket
from aiolimit._calls import (
    ACQUIRE,
    CHECK,
    PEEK,
    REFUND,
    REPLY_HEAD,
    REPLY_PER_PAIR,
    decision,
    decode,
    encode,
    replies_decision,
    reply_decision,
)
from aiolimit._decision import Decision
from aiolimit._protocol import _merge
from aiolimit._rules import Rules

LIMITS = {
    "win": [Limit(10, per=1)],
    "gcra": [TokenBucket(10, per=1, burst=4)],
    "log": [SlidingLog(5, per=60)],
    "conc": [Concurrency(3, lease_ttl=30)],
    "mini": [MinInterval(0.5)],
    "two": [Limit(10, per=1), SlidingLog(5, per=60)],
    "three": [
        TokenBucket(4, per=2),
        Concurrency(2, lease_ttl=10),
        Limit(100, per=3600, precision=60),
    ],
}
VALUES = [-(10**7), -1_000_001, -1, 0, 1, 999_999, 1_000_000, 1_500_000, 3_600_000_000, 2**52]


def fields(d: Decision) -> tuple:
    return (
        d.allowed, type(d.allowed), d.remaining, type(d.remaining), d.retry_after,
        type(d.retry_after), d.reset_after, type(d.reset_after), d.identifier, d.limit,
        tuple(tuple(p) for p in d.details), tuple(type(x) for p in d.details for x in p),
        type(d.details), d.degraded, d.lease, d.denied, d.shadow_refusals,
    )  # fmt: skip


def raw_reply(rng: random.Random, pairs: int) -> list[int]:
    head = [rng.choice([0, 1, 2, -1]), rng.choice([0, 1]), rng.choice([0, 1_700_000_000_000_000])]
    body: list[int] = []
    for _ in range(pairs):
        body += [rng.choice([0, 1, 1, 2, -1]), rng.choice(VALUES), rng.choice(VALUES),
                 rng.choice(VALUES)]  # fmt: skip
    return head + body


@pytest.mark.parametrize("seed", range(20))
def test_reply_decision_equals_decision_of_decode(seed: int) -> None:
    rng = random.Random(seed)
    rules = Rules(LIMITS, "p")
    kinds = list(LIMITS)
    for _ in range(500):
        n = rng.choice([1, 1, 1, 2, 3])
        ids = list(dict.fromkeys(f"{rng.choice(kinds)}:{rng.randrange(3)}" for _ in range(n)))
        plans = rules.plans(ids if len(ids) > 1 or rng.random() < 0.5 else ids[0])
        mode = rng.choice([ACQUIRE, CHECK, PEEK, REFUND])
        call = encode(mode, plans, rng.randint(1, 3), None, 0, "c:1:", False, 0)
        pairs = sum(len(plan.limits) for plan in plans)
        raw = raw_reply(rng, pairs)
        assert len(raw) == REPLY_HEAD + REPLY_PER_PAIR * pairs
        assert fields(reply_decision(call, raw)) == fields(decision(decode(call, raw)))
        # a tuple reply (e.g. a store answering with a tuple) decodes alike
        assert fields(reply_decision(call, tuple(raw))) == fields(decision(decode(call, raw)))


def test_replayed_refusal_is_a_refusal() -> None:
    """raw[0] = 0 with the pair allowed (a replay of a cancelled op): refused, retry 0.0."""
    plans = Rules({"ip": [Limit(10, per=1)]}, "p").plans("ip:1")
    call = encode(ACQUIRE, plans, 1, None, 0, "c:1:", False, 0)
    for raw in ([0, 1, 0, 1, 7, 0, 900_000], [0, 1, 0, 1, 7, 5, 900_000],
                [1, 0, 0, 0, 0, 250_000, 1_000_000], [0, 0, 0, 0, -3, -5, -7]):  # fmt: skip
        assert fields(reply_decision(call, raw)) == fields(decision(decode(call, raw)))
    d = reply_decision(call, [0, 1, 0, 1, 7, 5, 900_000])
    assert d.allowed is False and d.retry_after == 0.0 and d.details[0].allowed is True


@pytest.mark.parametrize("seed", range(10))
def test_replies_decision_equals_the_merge_of_each_decoded_reply(seed: int) -> None:
    """Across slots: one decision from each slot's call and reply, as the merge of their
    decoded replies (the all-or-nothing verdict from every reply's own)."""
    rng = random.Random(seed)
    rules = Rules(LIMITS, "p")
    kinds = list(LIMITS)
    for _ in range(300):
        calls, raws = [], []
        for _ in range(rng.choice([1, 2, 2, 3])):
            ids = list(dict.fromkeys(f"{rng.choice(kinds)}:{rng.randrange(9)}" for _ in range(2)))
            plans = rules.plans(ids)
            calls.append(encode(rng.choice([ACQUIRE, CHECK]), plans, 1, None, 0, "c:1:", False, 0))
            raws.append(raw_reply(rng, sum(len(plan.limits) for plan in plans)))
        want = _merge([decode(call, raw) for call, raw in zip(calls, raws, strict=True)])
        assert fields(replies_decision(calls, raws)) == fields(want)
