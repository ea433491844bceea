"""OpLedger.open's one-key path names the same open stamps as the general path did."""

from __future__ import annotations

import random
from itertools import islice

import pytest

from aiolimit._ops import MAX_OPEN, Op, OpLedger


def general_open(ledger: OpLedger, keys: list[str]) -> Op:
    """The pre-0f7b4a8 OpLedger.open, verbatim but for the names."""
    ledger._next += 1
    stamp = ledger._next
    book = ledger._open
    older: list[int] = []
    for key in keys:
        stamps = book.get(key)
        if stamps is None:
            book[key] = {stamp: None}
        else:
            older.extend(islice(stamps, MAX_OPEN))
            stamps[stamp] = None
    if not older:
        return Op(ledger.client, stamp)
    return Op(ledger.client, stamp, tuple(sorted(set(older))[:MAX_OPEN]))


@pytest.mark.parametrize("seed", range(10))
def test_one_key_open_matches_the_general_path(seed: int) -> None:
    rng = random.Random(seed)
    new, old = OpLedger(), OpLedger()
    old.client = new.client
    live: list[tuple[list[str], Op]] = []
    for _ in range(3000):
        if live and rng.random() < 0.45:
            keys, op = live.pop(rng.randrange(len(live)))
            new.settle(keys, op)
            old.settle(keys, op)
            continue
        keys = rng.sample(["a", "b", "c"], rng.choice([1, 1, 1, 2, 3]))
        a, b = new.open(keys), general_open(old, keys)
        assert a == b and a.wire == b.wire
        assert list(a.open) == sorted(set(a.open)) and len(a.open) <= MAX_OPEN
        assert new._open == old._open
        live.append((keys, a))
    for keys, op in live:
        new.settle(keys, op)
    assert new.unsettled() == 0
