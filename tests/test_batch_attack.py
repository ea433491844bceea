"""A malformed call in a decide_many batch never reads or writes a neighbour's keys or
arguments, and answers exactly as alone (an error). Found against 66a0113, which had each
call read the batch's KEYS and ARGV in place through offsets: each of these then charged a
neighbour. Each call now gets a copy of its own part, and malformed blocks are refused."""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis
from test_decide_many import T0, _many, _one_by_one, _state

from aiolimit import Limit, Limiter, SlidingLog
from aiolimit._calls import Call, Mode, encode


def _plans(prefix: str, limits: list[Any], ident: str) -> Any:
    return Limiter("memory://", limits, prefix=prefix)._rules.plans(ident)


async def test_zero_key_block_with_a_pair_does_not_take_the_next_calls_key(
    server: Redis,
    prefix: str,
) -> None:
    """Block '0,1,0,sw,...': no key, but one pair. Read in place, the pair's main key was
    the next call's key."""
    plans = _plans(prefix, [Limit(10, per=60)], "ip:victim")
    victim = encode(Mode.PEEK, plans, 0, T0, 0)
    block = plans[0].block.decode() if isinstance(plans[0].block, bytes) else plans[0].block
    bad_block = "0" + block[block.index(",") :]
    bad = Call(Mode.ACQUIRE, [], ["acquire", T0, 7, 0, "", "", 1, bad_block], plans)
    (alone,) = await _one_by_one(server, [bad])
    assert alone[0] == "error"
    batched = await _many(server, [bad, victim])
    assert batched[0][0] == "error", batched[0]
    assert await _state(server, prefix) == {}, await _state(server, prefix)


async def test_aux_beyond_the_blocks_keys_does_not_take_the_next_calls_key(
    server: Redis,
    prefix: str,
) -> None:
    """A sliding log pair with aux = 3 in a block of K = 2: read in place, its third key was
    the next call's second key (its log)."""
    limits = [SlidingLog(8, per=2)]
    mine = _plans(prefix, limits, "ip:mine")
    theirs = _plans(prefix, limits, "ip:theirs")
    block = mine[0].block.decode() if isinstance(mine[0].block, bytes) else mine[0].block
    v = block.split(",")
    assert v[0] == "2" and v[2] == "2", v
    v[2] = "4"
    bad = Call(
        Mode.ACQUIRE, list(mine[0].keys), ["acquire", T0, 3, 0, "", "", 1, ",".join(v)], mine
    )
    victim = encode(Mode.PEEK, theirs, 0, T0, 0)
    (alone,) = await _one_by_one(server, [bad])
    await server.delete(*mine[0].keys)
    assert alone[0] == "error"
    batched = await _many(server, [bad, victim])
    assert batched[0][0] == "error", batched[0]
    assert not await server.exists(theirs[0].keys[1]), await server.zrange(theirs[0].keys[1], 0, -1)


async def test_negative_block_key_count_does_not_take_the_previous_calls_key(
    server: Redis,
    prefix: str,
) -> None:
    """Blocks '-1,0' then a normal one: read in place, the second block's main key was the
    previous call's last key."""
    plans = _plans(prefix, [Limit(10, per=60)], "ip:victim")
    mine = _plans(prefix, [Limit(10, per=60)], "ip:mine")
    block = plans[0].block.decode() if isinstance(plans[0].block, bytes) else plans[0].block
    first = encode(Mode.PEEK, plans, 0, T0, 0)
    bad = Call(
        Mode.ACQUIRE, list(mine[0].keys), ["acquire", T0, 9, 0, "", "", 2, "-1,0", block], mine
    )
    (alone,) = await _one_by_one(server, [bad])
    await server.delete(*mine[0].keys)
    assert alone[0] == "error"
    batched = await _many(server, [first, bad])
    assert batched[1][0] == "error", batched[1]
    assert not await server.exists(plans[0].keys[0]), await server.hgetall(plans[0].keys[0])


async def test_a_call_with_fewer_than_7_args_does_not_read_the_next_calls_args(
    server: Redis,
    prefix: str,
) -> None:
    """A 2-argument call: read in place, its weight, slack, op, flags and block count came
    from the next call's header and arguments, and it was answered {1, 0, now}."""
    plans = _plans(prefix, [Limit(10, per=60)], "ip:x")
    short = Call(Mode.ACQUIRE, [], ["acquire", T0], plans)
    nxt = encode(Mode.ACQUIRE, plans, 1, T0, 0)
    nxt = Call(nxt.mode, nxt.keys, ["", T0, -5, *nxt.args[3:]], plans)
    alone = await _one_by_one(server, [short, nxt])
    batched = await _many(server, [short, nxt])
    assert alone[0][0] == "error"
    assert batched[0][0] == "error", batched
    assert batched[1] == alone[1]
