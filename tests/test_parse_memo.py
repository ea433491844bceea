"""The parse memos (lua/sliding_window.lua's PARSED, lua/decide.lua's LEDGERS): as a FUNCTION
library the script files each window state and op ledger it writes under the text it wrote,
and a call that reads that exact text copies the parse. Its promise: nothing a call decides or
stores differs from a fresh parse of the text it read.

The reference is the same code run with EVAL, one call at a time: there the functions (and the
memo) are built anew for every call, so every field is parsed from its text. The memo side runs
as FCALL batches of decide_many on the same server, and runs the workload twice under two
prefixes, so each text is filed once and met again. Both sides now and then get a field set
back to a text it held earlier (a replica promoted without the last writes, a RESTORE): that
text may still be filed, under a state that later calls changed.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import ResponseError
from test_decide_many import T0, _many, _state, _value

from aiolimit import FixedWindow, Limit, Limiter
from aiolimit._calls import Call, Mode, decide_script, encode

LIMITS = [
    Limit(7, per=1, precision=0.1),
    Limit(12, per=3, precision=0.5),
    FixedWindow(9, per=2),
]
IDENTIFIERS = ("ip:a", "ip:b", "user:c")


def _workload(prefix: str, seed: int, count: int) -> list[Call | tuple[str, int, int]]:
    """Calls over one or two identifiers (every mode that writes a window, weights 0 to 4,
    two clients' ops, some naming older ones open, undos of earlier ops, times moving -50 to
    +300 ms), and ("restore", i, j): set identifier
    i's main key back to the text it held after step j (recorded as the workload runs)."""
    rng = random.Random(seed)
    limiter = Limiter("memory://", LIMITS, prefix=prefix)
    stamps = {"c1": 0, "c2": 0}
    done: list[str] = []
    now = T0
    steps: list[Call | tuple[str, int, int]] = []
    for step in range(count):
        now += rng.randrange(-50_000, 300_000)
        roll = rng.random()
        if roll < 0.06 and step > 3:
            steps.append(("restore", rng.randrange(len(IDENTIFIERS)), rng.randrange(step)))
            continue
        chosen = rng.sample(IDENTIFIERS, rng.choice((1, 1, 2)))
        plans = limiter._rules.plans(chosen)
        weight = rng.randrange(0, 5)
        if roll < 0.15 and done:
            steps.append(encode(Mode.UNDO, plans, max(weight, 1), now, 0, rng.choice(done) + ":"))
        elif roll < 0.3:
            steps.append(encode(rng.choice((Mode.CHECK, Mode.PEEK)), plans, weight, now, 0))
        else:
            client = rng.choice(("c1", "c1", "c2"))
            stamps[client] += 1
            stamp = stamps[client]
            # (now and then older ops named open: the ledger then keeps several entries)
            opened = sorted(rng.sample(range(max(1, stamp - 5), stamp), min(stamp - 1, 2)))
            if rng.random() < 0.7:
                opened = []
            op = f"{client}:{stamp}:{','.join(map(str, opened))}"
            mode = Mode.REFUND if roll < 0.42 else Mode.ACQUIRE
            steps.append(encode(mode, plans, weight, now, 0, op, penalty=rng.random() < 0.1))
            if mode is Mode.ACQUIRE:
                done.append(f"{client}:{stamp}")
    return steps


async def _run(
    server: Redis,
    prefix: str,
    steps: list[Call | tuple[str, int, int]],
    seed: int,
    held: list[list[dict[bytes, bytes]]] | None = None,
) -> tuple[list[Any], list[list[dict[bytes, bytes]]]]:
    """Runs the steps: without ``held``, lone EVALs, recording each main key's hash after
    every step in ``held``; with it, decide_many batches of 1 to 12 calls between restores,
    restoring the texts the EVAL run recorded. Returns every call's reply, and ``held``."""
    source = decide_script().source
    rng = random.Random(-seed)
    keys = [f"{prefix}:{{{ident}}}" for ident in IDENTIFIERS]
    fresh = held is None
    record: list[list[dict[bytes, bytes]]] = [] if held is None else held
    replies: list[Any] = []
    pending: list[Call] = []

    async def drain() -> None:
        while pending:
            chunk = pending[: rng.randrange(1, 13)]
            del pending[: len(chunk)]
            replies.extend(await _many(server, chunk))

    for step in steps:
        if isinstance(step, tuple):
            await drain()
            _, i, j = step
            await server.delete(keys[i])
            if record[j][i]:
                await server.hset(keys[i], mapping=record[j][i])  # type: ignore[arg-type]
        elif fresh:
            try:
                reply = await server.eval(source, len(step.keys), *step.keys, *step.args)
            except ResponseError as error:
                reply = error
            replies.append(_value(reply))
        else:
            pending.append(step)
        if fresh:
            record.append([await server.hgetall(key) for key in keys])
    await drain()
    return replies, record


@pytest.mark.parametrize("seed", range(12))
async def test_a_filed_parse_decides_as_a_fresh_one(
    server: Redis, prefix: str, seed: int
) -> None:  # fmt: skip
    fresh, held = await _run(server, f"{prefix}e", _workload(f"{prefix}e", seed, 220), seed)
    # The memo side runs twice: the second run meets every text the first one filed.
    for run in "ab":
        steps = _workload(f"{prefix}{run}", seed, 220)
        got, _ = await _run(server, f"{prefix}{run}", steps, seed, held)
        assert len(got) == len(fresh)
        for i, (g, e) in enumerate(zip(got, fresh, strict=True)):
            assert g == e, (run, i, g, e)
        assert await _state(server, f"{prefix}{run}") == await _state(server, f"{prefix}e")
    assert sum(1 for r in fresh if isinstance(r, list) and r[0] == 1) > 20
