"""Issue 9 (item 3): bounded state on a cluster, whatever the request rate.

Every key the limiter writes belongs to an identifier (``<prefix>:{<identifier>}`` and, for
algorithms with a structure of their own, keys after that tag), every key has a TTL, and the
set of keys does not grow with the number of decisions: no key per decision. Keys are
counted raw (SCAN on every primary); nothing but the public API writes them.
"""

from __future__ import annotations

import asyncio
import random

import pytest
from redis.crc import key_slot

import cluster
from aiolimit import FixedWindow, Limit, Limiter, SlidingLog, TokenBucket
from aiolimit._keys import main_key

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

#: Roomy limits of four algorithms, one of them (SlidingLog) with a key of its own.
LIMITS = [
    Limit(100_000, per=3600, precision=60),
    FixedWindow(100_000, per=3600),
    TokenBucket(100_000, per=3600),
    SlidingLog(100_000, per=3600),
]
#: Keys one identifier may hold under LIMITS: its HASH, the log's ZSET, and one key of
#: bookkeeping (exactly-once records) if an implementation needs it, never one per decision.
KEYS_PER_IDENTIFIER = 3
IDENTIFIERS = 32
DECISIONS = 2000
TASKS = 32


def identifiers(prefix: str) -> list[str]:
    """IDENTIFIERS identifiers, each in a slot of its own."""
    chosen: dict[int, str] = {}
    for i in range(100_000):
        identifier = f"user:{i}"
        chosen.setdefault(key_slot(main_key(prefix, identifier).encode()), identifier)
        if len(chosen) == IDENTIFIERS:
            return list(chosen.values())
    raise AssertionError("no identifiers in distinct slots")


def stored_keys(nodes: cluster.Cluster, prefix: str) -> dict[str, int]:
    """Every key under ``prefix`` on every primary, with its PTTL in ms (-1: none)."""
    keys: dict[str, int] = {}
    for node in nodes.primaries():
        for key in node.client.scan_iter(match=f"{prefix}:*", count=1000):
            keys[key] = node.client.pttl(key)
    return keys


async def load(limiter: Limiter, ids: list[str], decisions: int, seed: int) -> int:
    """``decisions`` decisions from TASKS tasks: one identifier, or two in different slots
    (the two-phase path) for about a third of them. Returns how many were admitted."""
    rng = random.Random(seed)
    requests = [
        rng.sample(ids, 2) if rng.random() < 0.35 else [rng.choice(ids)] for _ in range(decisions)
    ]
    admitted = 0

    async def worker(start: int) -> None:
        nonlocal admitted
        for request in requests[start::TASKS]:
            decision = await limiter.try_acquire(request)
            admitted += decision.allowed

    await asyncio.gather(*(worker(start) for start in range(TASKS)))
    return admitted


async def test_keys_are_per_identifier_and_do_not_grow_with_decisions(
    local_cluster: cluster.Cluster, prefix: str
) -> None:
    """After 2,000 decisions over 32 identifiers (single- and two-slot), every key under the
    prefix belongs to one identifier and has a TTL, each identifier holds at most 3 keys,
    and 2,000 more decisions leave exactly the same set of keys."""
    ids = identifiers(prefix)
    tags = {main_key(prefix, identifier): identifier for identifier in ids}
    async with Limiter(local_cluster.url, LIMITS, prefix=prefix, deadline=5.0) as limiter:
        first = await load(limiter, ids, DECISIONS, seed=1)
        after_first = stored_keys(local_cluster, prefix)
        second = await load(limiter, ids, DECISIONS, seed=2)
        after_second = stored_keys(local_cluster, prefix)
    assert first == second == DECISIONS  # roomy limits: everything admitted

    per_identifier: dict[str, int] = dict.fromkeys(ids, 0)
    strangers = []
    for key in after_second:
        owner = next((tags[tag] for tag in tags if key == tag or key.startswith(tag + ":")), None)
        if owner is None:
            strangers.append(key)
        else:
            per_identifier[owner] += 1
    assert not strangers, f"{len(strangers)} keys belong to no identifier: {strangers[:5]}"
    crowded = {ident: n for ident, n in per_identifier.items() if n > KEYS_PER_IDENTIFIER}
    assert not crowded, (
        f"{len(after_second)} keys for {IDENTIFIERS} identifiers; "
        f"{len(crowded)} identifiers hold more than {KEYS_PER_IDENTIFIER}, e.g. "
        f"{sorted(crowded.items())[:3]}"
    )
    assert all(ttl > 0 for ttl in after_second.values()), "every key needs a TTL"
    assert set(after_second) == set(after_first), (
        f"{len(after_first)} keys after {DECISIONS} decisions, "
        f"{len(after_second)} after {2 * DECISIONS}"
    )
