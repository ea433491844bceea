"""The EVALSHA path (servers without FUNCTION): a lone call decides exactly as the FUNCTION
does, including the refusals of a malformed block count or key count."""

from __future__ import annotations

from redis.asyncio import Redis
from redis.exceptions import ResponseError
from test_decide_many import T0, _one_by_one, _state, _value

from aiolimit import Concurrency, Limit, Limiter, SlidingLog, TokenBucket
from aiolimit._calls import Call, Mode, decide_script, encode


async def _evalsha(client: Redis, calls: list[Call]) -> list[object]:
    script = decide_script()
    await client.script_load(script.source)
    out = []
    for call in calls:
        try:
            out.append(await client.evalsha(script.sha, len(call.keys), *call.keys, *call.args))
        except ResponseError as error:
            out.append(error)
    return [_value(r) for r in out]


def _program(prefix: str) -> list[Call]:
    limits = [
        Limit(6, per=1),
        TokenBucket(3, per=1, burst=4),
        SlidingLog(8, per=2),
        Concurrency(5, lease_ttl=30),
    ]
    limiter = Limiter("memory://", limits, prefix=prefix)
    two = limiter._rules.plans(["ip:a", "user:b"])
    one = limiter._rules.plans("ip:a")
    calls = [encode(Mode.ACQUIRE, two, 1, T0 + i * 1000, 0, f"c:{i + 1}:") for i in range(8)]
    calls += [
        encode(Mode.PEEK, one, 1, T0 + 9000, 0),
        encode(Mode.UNDO, two, 1, T0 + 9000, 0, "c:2:"),
        encode(Mode.RELEASE, two, 1, T0 + 9000, 0, "c:3:"),
        encode(Mode.RENEW, two, 1, T0 + 9000, 0, "c:4:"),
        encode(Mode.REFUND, one, 1, T0 + 9000, 0, "c:20:3,5"),
        encode(Mode.CHECK, two, 2, T0 + 9000, 0),
    ]
    short = encode(Mode.ACQUIRE, one, 1, T0, 0, "c:30:")
    calls.append(Call(short.mode, short.keys, [*short.args[:6], 2, *short.args[7:]], one))
    calls.append(Call(short.mode, short.keys[:1], short.args, one))  # block wants 3 keys
    calls.append(Call(short.mode, short.keys, short.args[:7], one))  # 1 block, none given
    return calls


async def test_evalsha_decides_as_the_function(server: Redis, prefix: str) -> None:
    by_function = await _one_by_one(server, _program(f"{prefix}a"))
    by_script = await _evalsha(server, _program(f"{prefix}b"))
    strip = lambda r: r if isinstance(r, list) else (r[0], r[1].split(" script:")[0])  # noqa: E731
    assert [strip(r) for r in by_script] == [strip(r) for r in by_function]
    assert sum(1 for r in by_function if isinstance(r, list) and r[0] == 1) >= 5
    assert [r[0] for r in by_function[-3:]] == ["error"] * 3
    assert "bad block count" in by_function[-3][1] and "more keys" in by_function[-2][1]
    assert await _state(server, f"{prefix}a") == await _state(server, f"{prefix}b")
