"""The script's fast path (``fast_acquire`` in lua/decide.lua) against its general way.

An acquire with an op id and no flags, on identifiers whose limits are all sliding or fixed
windows (one key each), takes the fast path when nothing unusual is met; every other call, and any
call sent with a flag the script ignores ("g"), takes the general way. The same random
programs run twice on a real server, once as the limiter sends them and once with "g" on
every call, on two prefixes: every reply and every stored field must be the same, call by
call, alone and in decide_many batches. The programs mix what makes the fast path step
aside (new keys, first ledgers, records leaving windows, refusals, TTL renewals, replays,
undos, refunds, open ops, several clients) with long runs of the common case.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from aiolimit import FixedWindow, Limit, Limiter
from aiolimit._calls import Call, Mode, decide_library, encode
from aiolimit._stores.resp import pack_many

T0 = 1_700_000_000_000_000
SLACK_MS = 3_600_000  # (keys outlive the test whatever the programs' clocks say)
SHAPES = {  # (the programs' calls come at ~50 a second, weights 2 on average)
    "one window": [Limit(60, per=1, precision=0.1)],
    "three windows": [
        Limit(50, per=1, precision=0.3),  # (a precision that does not divide the period)
        Limit(400, per=10),
        FixedWindow(250, per=5),
    ],
    "tight": [Limit(5, per=1, precision=0.25), FixedWindow(12, per=4)],  # refusals mostly
}


def _program(prefix: str, shape: str, seed: int, count: int) -> list[Call]:
    rng = random.Random(seed)
    limiter = Limiter("memory://", SHAPES[shape], prefix=prefix)
    stamps = {"c1": 0, "c2": 0}
    sent: list[tuple[str, int, str]] = []  # (client, stamp, open) of acquires sent
    now = T0
    calls = []
    for _ in range(count):
        roll = rng.random()
        if roll < 0.02:
            now += 12_000_000  # every window empties
        elif roll < 0.05:
            now += rng.randrange(1_000_000, 3_000_000)  # past the TTL step
        else:
            now += rng.choice((0, 0, 1, 900, 20_000, 90_000))
        ids = rng.choice((["ip:a"], ["ip:a"], ["ip:b"], ["ip:a", "ip:b"], ["ip:b", "user:c"]))
        plans = limiter._rules.plans(ids)
        weight = rng.choice((1, 1, 1, 2, 3, 5))
        client = rng.choice(("c1", "c1", "c1", "c2"))
        kind = rng.random()
        if kind < 0.05 and sent:  # a resent copy of an earlier acquire: it replays
            old_client, stamp, opened = rng.choice(sent[-8:])
            calls.append(
                encode(Mode.ACQUIRE, plans, weight, now, SLACK_MS, f"{old_client}:{stamp}:{opened}")
            )
            continue
        if kind < 0.09 and sent:
            old_client, stamp, _ = rng.choice(sent[-8:])
            calls.append(encode(Mode.UNDO, plans, weight, now, SLACK_MS, f"{old_client}:{stamp}:"))
            continue
        if kind < 0.11:
            calls.append(encode(Mode.ACQUIRE, plans, weight, now, SLACK_MS))  # no op
            continue
        stamps[client] += 1
        stamp = stamps[client]
        opened = ""
        if rng.random() < 0.15 and stamp > 1:  # older ops still open: the ledger keeps more
            low = max(1, stamp - rng.choice((3, 40)))
            opened = ",".join(map(str, sorted(rng.sample(range(low, stamp), min(2, stamp - low)))))
        mode = Mode.REFUND if kind < 0.16 else Mode.ACQUIRE
        calls.append(encode(mode, plans, weight, now, SLACK_MS, f"{client}:{stamp}:{opened}"))
        if mode is Mode.ACQUIRE:
            sent.append((client, stamp, opened))
    return calls


def _general(calls: Sequence[Call]) -> list[Call]:
    """The same calls with the flag "g", which the script ignores but for the fast path."""
    out = []
    for call in calls:
        args = list(call.args)
        args[5] = (args[5] or "") + "g"
        out.append(Call(call.mode, call.keys, args, call.plans))
    return out


def _value(reply: Any) -> Any:
    if isinstance(reply, ResponseError):
        return ("error", str(reply))
    if isinstance(reply, list):
        return [_value(item) for item in reply]
    return reply


async def _alone(client: Redis, call: Call) -> Any:
    try:
        reply = await client.execute_command(
            "FCALL", decide_library().function, len(call.keys), *call.keys, *call.args
        )
    except ResponseError as error:
        reply = error
    return _value(reply)


async def _batch(client: Redis, calls: Sequence[Call]) -> list[Any]:
    connection = await client.connection_pool.get_connection()
    try:
        name = decide_library().many.encode()
        head = b"$5\r\nFCALL\r\n$%d\r\n%b\r\n" % (len(name), name)
        await connection.send_packed_command(pack_many(head, calls))
        reply = await connection.read_response()
    finally:
        await client.connection_pool.release(connection)
    return [_value(item) for item in reply]


async def _state(client: Redis, prefix: str) -> dict[str, Any]:
    state = {}
    async for key in client.scan_iter(match=f"{prefix}:*"):
        state[key.decode()[len(prefix) :]] = await client.hgetall(key)
    return state


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("seed", range(3))
async def test_the_fast_path_answers_and_writes_as_the_general_way(
    server: Redis, prefix: str, shape: str, seed: int
) -> None:
    fast_prefix, general_prefix = f"{prefix}f", f"{prefix}g"
    fast = _program(fast_prefix, shape, seed, 700)
    general = _general(_program(general_prefix, shape, seed, 700))
    for index, (one, other) in enumerate(zip(fast, general, strict=True)):
        got, want = await _alone(server, one), await _alone(server, other)
        assert got == want, (index, one.args)
        if index % 7 == 0 or got != want:
            assert await _state(server, fast_prefix) == await _state(server, general_prefix), (
                index,
                one.args,
            )
    assert await _state(server, fast_prefix) == await _state(server, general_prefix)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("seed", range(3))
async def test_the_fast_path_in_batches_answers_and_writes_as_the_general_way(
    server: Redis, prefix: str, shape: str, seed: int
) -> None:
    """decide_many: a call takes the fast path unless an earlier call of its batch loaded its
    key (the general way then goes on from that state)."""
    fast_prefix, general_prefix = f"{prefix}f", f"{prefix}g"
    fast = _program(fast_prefix, shape, 100 + seed, 960)
    general = _general(_program(general_prefix, shape, 100 + seed, 960))
    rng = random.Random(seed)
    at = 0
    while at < len(fast):
        size = rng.choice((1, 2, 5, 16))
        got = await _batch(server, fast[at : at + size])
        want = await _batch(server, general[at : at + size])
        assert got == want, at
        assert await _state(server, fast_prefix) == await _state(server, general_prefix), at
        at += size


async def _hset_fields(server: Redis, call: Call) -> list[str]:
    """The fields the call's HSET writes, in the order it names them (seen with MONITOR)."""
    async with server.monitor() as monitor:
        await _alone(server, call)
        while True:
            command = await monitor.next_command()
            if command["command"].startswith("HSET "):
                return command["command"].split()[2::2]


async def test_the_fast_path_is_taken_in_the_common_case(server: Redis, prefix: str) -> None:
    """The common case does take it: the fast path's HSET names "t", the ledger, then the
    windows in the limits' order (the general way names them in its tables' order); and 200
    acquires in a row read their key with one HMGET each, so none stepped aside (that reads
    the key again), and no EXISTS, HGETALL or PEXPIRE is made after the first."""
    roomy = [Limit(10**6, per=1, precision=0.3), Limit(10**7, per=10), FixedWindow(10**7, per=5)]
    limiter = Limiter("memory://", roomy, prefix=prefix)
    plans = limiter._rules.plans("ip:a")
    calls = [
        encode(Mode.ACQUIRE, plans, 1, T0 + 1000 * i, SLACK_MS, f"c1:{i + 1}:") for i in range(202)
    ]
    await _alone(server, calls[0])
    fields = ["t", "o:c1", "w1000000/300000", "w10000000/10000000", "f5000000/5000000"]
    assert await _hset_fields(server, calls[1]) == fields
    assert await _hset_fields(server, _general(calls[2:3])[0]) != fields
    await server.config_resetstat()
    for call in calls[3:]:
        assert (await _alone(server, call))[0] == 1
    stats = await server.info("commandstats")
    assert stats["cmdstat_hmget"]["calls"] == 199
    assert stats["cmdstat_hset"]["calls"] == 199
    assert not {"cmdstat_hgetall", "cmdstat_pexpire", "cmdstat_exists"} & set(stats)


async def test_a_refusal_takes_the_fast_path_too(server: Redis, prefix: str) -> None:
    """Refused calls on a full window read their key once each and write nothing."""
    limiter = Limiter("memory://", [Limit(3, per=10, precision=1)], prefix=prefix)
    plans = limiter._rules.plans("ip:a")
    calls = [
        encode(Mode.ACQUIRE, plans, 1, T0 + 1000 * i, SLACK_MS, f"c1:{i + 1}:") for i in range(50)
    ]
    for call in calls[:3]:
        assert (await _alone(server, call))[0] == 1
    await server.config_resetstat()
    for call in calls[3:]:
        reply = await _alone(server, call)
        assert reply[0] == 0 and reply[4] == 0 and reply[5] > 0  # (retry_after, after 10 s)
    stats = await server.info("commandstats")
    assert stats["cmdstat_hmget"]["calls"] == 47
    assert "cmdstat_hset" not in stats
