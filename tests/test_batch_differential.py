"""decide_many vs one by one, harder: identifiers of 1, 2 and 3 keys (GCRA alone; a sliding
log; a concurrency limit; window + log + leases) side by side in one call, 1 to 3 of them,
batches of 1 to 32, every mode, malformed neighbours, 40 seeds."""

from __future__ import annotations

import random
from typing import Any

import pytest
from redis.asyncio import Redis
from test_decide_many import T0, _many, _one_by_one, _state

from aiolimit import Concurrency, FixedWindow, Limit, Limiter, SlidingLog, TokenBucket
from aiolimit._calls import Call, Mode, encode

SETS = [
    ("g", [TokenBucket(3, per=1, burst=4)]),  # 1 key
    ("l", [SlidingLog(5, per=1)]),  # 2 keys
    ("c", [Concurrency(3, lease_ttl=2)]),  # 2 keys
    ("m", [Limit(6, per=1, precision=0.1), SlidingLog(8, per=2), Concurrency(4, lease_ttl=5)]),
    ("f", [FixedWindow(5, per=1), TokenBucket(2, per=1, burst=2)]),  # 1 key, 2 pairs
]


def _workload(prefix: str, seed: int, count: int) -> list[Call]:
    rng = random.Random(seed)
    limiters = {tag: Limiter("memory://", limits, prefix=prefix) for tag, limits in SETS}
    idents = [(tag, f"{tag}:{i}") for tag, _ in SETS for i in range(2)]
    clients = ("c1", "c2")
    stamps = dict.fromkeys(clients, 0)
    done: list[str] = []
    now = T0
    calls: list[Call] = []
    for _ in range(count):
        now += rng.randrange(-50_000, 200_000)
        chosen = rng.sample(idents, rng.choice((1, 2, 2, 3)))
        plans = [limiters[tag]._rules.plans(ident)[0] for tag, ident in chosen]
        has_lease = any(tag in "cm" for tag, _ in chosen)
        client = rng.choice(clients)
        roll = rng.random()
        weight = rng.randrange(0, 4)
        if roll < 0.03:
            call = encode(Mode.CHECK, plans, weight, now, 0)
            kind = rng.randrange(5)
            if kind == 0:
                call.args[6] = rng.choice(["0", "-1", "1.5", "x", str(len(plans) + 1), "nan"])
            elif kind == 1:
                call = Call(call.mode, call.keys[:-1], call.args, plans)
            elif kind == 2:
                call = Call(call.mode, call.keys, call.args[: rng.randrange(0, 7)], plans)
            elif kind == 3:
                call.args[0] = "bogus"
            else:
                call.args[4] = "bad op"
            calls.append(call)
            continue
        if roll < 0.15 and done:
            op = rng.choice(done)
            mode = rng.choice((Mode.UNDO, Mode.RELEASE, Mode.RENEW))
            calls.append(encode(mode, plans, max(weight, 1), now, 0, op + ":"))
            continue
        if roll < 0.3:
            calls.append(encode(rng.choice((Mode.CHECK, Mode.PEEK)), plans, weight, now, 0))
            continue
        stamps[client] += 1
        stamp = stamps[client]
        opened = sorted(rng.sample(range(max(1, stamp - 6), stamp), min(stamp - 1, 2)))
        op = f"{client}:{stamp}:{','.join(map(str, opened))}"
        mode = Mode.REFUND if roll < 0.4 else Mode.ACQUIRE
        penalty = rng.random() < 0.1 and not has_lease
        wait = rng.choice((0, 0, 0, 300_000))
        calls.append(encode(mode, plans, weight, now, 0, op, penalty=penalty, max_wait_us=wait))
        if mode is Mode.ACQUIRE:
            done.append(f"{client}:{stamp}")
    return calls


def _norm(reply: Any) -> Any:
    # A raised error's text differs between a lone FCALL and a batch (pre-existing): compare
    # that it is an error and its first words.
    if isinstance(reply, tuple):
        return "error"  # (a call with < 7 args: its text may name the next call's values)
    return reply


@pytest.mark.parametrize("seed", range(100, 140))
async def test_batches_match_one_by_one(server: Redis, prefix: str, seed: int) -> None:
    alone = _workload(f"{prefix}a", seed, 250)
    batched = _workload(f"{prefix}b", seed, 250)
    expected = await _one_by_one(server, alone)
    rng = random.Random(-seed)
    got: list[Any] = []
    at = 0
    while at < len(batched):
        size = rng.randrange(1, 33)
        got += await _many(server, batched[at : at + size])
        at += size
    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert _norm(g) == _norm(e), (i, alone[i].args, g, e)
    assert sum(1 for r in expected if isinstance(r, list) and r[0] == 1) > 30
    assert await _state(server, f"{prefix}b") == await _state(server, f"{prefix}a")
