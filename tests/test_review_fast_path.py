"""Review h4: the script's fast path (``fast_acquire``/``sw_fast``) against its general way.

Each test seeds the same stored state under two prefixes, runs the same call on both, once as
sent (the fast path may take it) and once with the flag "g" (the general way only), and
compares the replies and every stored field.
"""

from __future__ import annotations

import asyncio
from typing import Any

from redis.asyncio import Redis
from test_fast_path import _alone, _batch, _state

from aiolimit import Limit, Limiter
from aiolimit._calls import Call, Mode

T0 = 1_700_000_000_000_000
BLOCK = "1,1,0,sw,5,1000000,100000"  # 5 per second, 10 buckets of 0.1 s: field w1000000/100000
FIELD = "w1000000/100000"
ROOMY = "1,1,0,sw,1000,1000000,100000"  # the same window, 1000 per second
NOW = T0 + 123_456  # bucket 17_000_000_001


def _general(args: list[Any]) -> list[Any]:
    args = list(args)
    args[5] = (args[5] or "") + "g"
    return args


async def _seed(server: Redis, keys: list[str], state: dict[str, str]) -> None:
    for key in keys:
        await server.delete(key)
        await server.hset(key, mapping=state)
        await server.pexpire(key, 100_000_000)


async def _both(
    server: Redis, prefix: str, state: dict[str, str], args: list[Any]
) -> tuple[Any, Any, dict[str, Any], dict[str, Any]]:
    fast_key, general_key = f"{prefix}f:{{a}}", f"{prefix}g:{{a}}"
    await _seed(server, [fast_key, general_key], state)
    got = await _alone(server, Call(Mode.ACQUIRE, [fast_key], args, ()))
    want = await _alone(server, Call(Mode.ACQUIRE, [general_key], _general(args), ()))
    return got, want, await _state(server, f"{prefix}f"), await _state(server, f"{prefix}g")


def _kind(reply: Any) -> Any:
    """An error reply as just "error" (its text names a line of the script), else the reply."""
    return "error" if isinstance(reply, tuple) and reply[0] == "error" else reply


def _live_state(window: str) -> dict[str, str]:
    return {
        "t": str(NOW - 1000),
        "x": str(NOW + 10**12),  # (no TTL renewal due)
        "o:c1": f"{NOW - 1000};4;",
        FIELD: window,
    }


# --- Finding: a window field whose first record is not "<offset>:<total>" ------------------


async def test_a_window_whose_first_record_is_malformed_is_judged_as_the_general_way_does(
    server: Redis, prefix: str
) -> None:
    """The general way reads the first record with rec() ('^(%d+):(%d+)') and fails on
    "<base>|<c0>|3x,5:7" (nothing written); sw_fast reads only its offset ('^(%d+)') and goes
    on: it answers allowed, and rewrites the field and the ledger."""
    cur = NOW // 100_000
    window = f"{cur - 5}|0|3x,5:7"  # the newest record (bucket cur) is in the window
    args = ["acquire", NOW, 1, 0, "c1:5:", "", 1, ROOMY]
    got, want, fast_state, general_state = await _both(server, prefix, _live_state(window), args)
    assert _kind(got) == _kind(want) == "error", (got, want)
    assert fast_state == general_state


async def test_a_window_whose_first_record_is_malformed_and_has_left_the_window(
    server: Redis, prefix: str
) -> None:
    """The same with every record out of the window: the fast path starts the window again
    (writes "<cur>|0|0:1"), where the general way's charge fails in sw_trim's first_rec."""
    window = "7|0|3x,5:7"
    args = ["acquire", NOW, 1, 0, "c1:5:", "", 1, BLOCK]
    got, want, fast_state, general_state = await _both(server, prefix, _live_state(window), args)
    assert _kind(got) == _kind(want) == "error", (got, want)
    assert fast_state == general_state
