"""The script's fast path (``fast_acquire``/``sw_fast``) against its general way, on hand-made
states and edge cases (from an adversarial review).

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


# --- Held: what was tried and answered as the general way does ----------------------------


async def _pair_runs(
    server: Redis,
    prefix: str,
    states: dict[str, dict[str, str]],
    calls: list[tuple[list[str], list[Any]]],
) -> None:
    """`calls` (keys as suffixes) as one decide_many batch on each prefix, fast and general."""
    fast, general = f"{prefix}f", f"{prefix}g"
    for side in (fast, general):
        for key, state in states.items():
            await _seed(server, [f"{side}:{key}"], state)
    got = await _batch(
        server, [Call(Mode.ACQUIRE, [f"{fast}:{k}" for k in keys], a, ()) for keys, a in calls]
    )
    want = await _batch(
        server,
        [
            Call(Mode.ACQUIRE, [f"{general}:{k}" for k in keys], _general(a), ())
            for keys, a in calls
        ],
    )
    assert [_kind(x) for x in got] == [_kind(x) for x in want]
    assert await _state(server, fast) == await _state(server, general)


async def test_held_a_batch_with_a_failing_call_between_fast_and_general_calls(
    server: Redis, prefix: str
) -> None:
    """Fast, then general (refund), then a malformed call (loaded reset), then fast again on
    the same key, and the same on a second key whose window text is the first's (PARSED is
    keyed by text)."""
    window = f"{NOW // 100_000 - 2}|0|0:1,2:3"
    state = _live_state(window)
    a = lambda mode, stamp, now, flags="": [mode, now, 1, 0, f"c1:{stamp}:", flags, 1, ROOMY]  # noqa: E731
    calls = [
        (["{a}"], a("acquire", 5, NOW)),
        (["{b}"], a("acquire", 5, NOW)),
        (["{a}"], a("refund", 6, NOW + 10)),
        (["{a}"], ["acquire", NOW, 1, 0, "c1:x:", "", 1, ROOMY]),
        (["{a}"], a("acquire", 7, NOW + 20)),
        (["{b}"], a("acquire", 6, NOW + 20)),
        (["{a}", "{b}"], ["acquire", NOW + 30, 2, 0, "c1:8:", "", 2, ROOMY, ROOMY]),
        (["{a}"], a("undo", 7, NOW + 40)),
        (["{a}"], a("acquire", 7, NOW + 50)),  # (undone: settled, refused)
        (["{b}"], a("acquire", 9, NOW + 60, "p")),
    ]
    await _pair_runs(server, prefix, {"{a}": state, "{b}": state}, calls)


async def test_held_several_blocks_refusing_duplicate_and_nine(server: Redis, prefix: str) -> None:
    """One block refusing while another allows; a duplicate key; nine blocks (past
    FAST_BLOCKS); a block on a new key after fast ones."""
    full = f"{NOW // 100_000}|0|0:5"
    room = f"{NOW // 100_000 - 1}|0|0:1"
    states = {f"{{k{i}}}": _live_state(room) for i in range(9)}
    states["{full}"] = _live_state(full)
    nine = [f"{{k{i}}}" for i in range(9)]
    calls = [
        (["{k0}", "{full}"], ["acquire", NOW, 1, 0, "c1:5:", "", 2, BLOCK, BLOCK]),
        (["{k0}", "{k0}"], ["acquire", NOW, 1, 0, "c1:6:", "", 2, BLOCK, BLOCK]),
        (nine, ["acquire", NOW, 1, 0, "c1:7:", "", 9] + [BLOCK] * 9),
        (["{k1}", "{new}"], ["acquire", NOW, 1, 0, "c1:8:", "", 2, BLOCK, BLOCK]),
        (["{k2}", "{k3}"], ["acquire", NOW, 3, 0, "c1:9:5,6", "", 2, BLOCK, ROOMY]),
    ]
    await _pair_runs(server, prefix, states, calls)


async def test_held_stamps_with_leading_zeros_and_many_digits(server: Redis, prefix: str) -> None:
    """The op's stamp as "0009", and 17 digits (past 2^53): its entry and a replay of it."""
    for stamp, later in (("0009", "9"), ("90071992547409930", "90071992547409931")):
        state = _live_state(f"{NOW // 100_000 - 1}|0|0:1")
        calls = [
            (["{a}"], ["acquire", NOW, 1, 0, f"c1:{stamp}:", "", 1, ROOMY]),
            (["{a}"], ["acquire", NOW + 5, 1, 0, f"c1:{later}:", "", 1, ROOMY]),
        ]
        await _pair_runs(server, f"{prefix}{len(stamp)}", {"{a}": state}, calls)


async def test_held_the_limiter_admits_what_it_stores_under_concurrency(
    redis_url: str, prefix: str
) -> None:
    """64 tasks at once on two identifiers, a third of the admissions refunded: what stays
    charged is what was admitted and kept."""
    limit = Limit(40, per=60)
    async with Limiter(redis_url, [limit], prefix=prefix) as limiter:
        await limiter.try_acquire(["ip:a", "ip:b"])  # (the ledgers exist: the fast path)
        kept = 1

        async def one(i: int) -> int:
            decision = await limiter.try_acquire(["ip:a", "ip:b"])
            if not decision.allowed:
                return 0
            if i % 3 == 0:
                await limiter.refund(["ip:a", "ip:b"], decision=decision)
                return 0
            return 1

        tasks = [asyncio.create_task(one(i)) for i in range(64)]
        await asyncio.sleep(0)
        results = await asyncio.gather(*tasks)
        kept += sum(results)
        for ident in ("ip:a", "ip:b"):
            peek = await limiter.peek(ident)
            assert peek.remaining == 40 - kept, (ident, peek.remaining, kept)


# --- A ledger at its size bound (OP_KEEP_BYTES) ----------------------------------------------

OP_KEEP_BYTES = 65_536  # lua/prelude.lua


def _long_ledger(size: int) -> tuple[str, int]:
    """A ledger of client c1 held open by its stamp 5 (never settled: the horizon stays 4),
    whose entries take ``size`` bytes or a few less; and the next stamp after them."""
    entries: list[str] = []
    length = -1
    stamp = 10
    while True:
        entry = f"{stamp}@{NOW - 500}"
        if length + 1 + len(entry) > size:
            break
        entries.append(entry)
        length += 1 + len(entry)
        stamp += 1
    return f"{NOW - 1000};4;" + ",".join(entries), stamp


async def test_a_ledger_pushed_past_its_bound_is_trimmed_as_the_general_way_trims_it(
    server: Redis, prefix: str
) -> None:
    """An op stuck open (stamp 5) with much traffic behind it: the next op's entry takes the
    ledger past OP_KEEP_BYTES. The fast path must step aside (it never trims) so that the
    general way keeps the newest half, the open op and the new entry, as it does alone."""
    for size, trimmed in ((OP_KEEP_BYTES, True), (OP_KEEP_BYTES - 40, False)):
        ledger, stamp = _long_ledger(size)
        state = {**_live_state(f"{NOW // 100_000 - 1}|0|0:1"), "o:c1": ledger}
        args = ["acquire", NOW, 1, 0, f"c1:{stamp}:5", "", 1, ROOMY]
        side = f"{prefix}{size}"
        got, want, fast_state, general_state = await _both(server, side, state, args)
        assert got == want and got[0] == 1, (got, want)
        assert fast_state == general_state
        (fields,) = fast_state.values()
        written = fields[b"o:c1"].decode()
        entries = written.split(";", 2)[2]
        assert entries.endswith(f",{stamp}@{NOW}")  # the new op's entry
        if trimmed:  # the newest half kept (the open stamp 5 has no entry to keep)
            assert OP_KEEP_BYTES // 2 <= len(entries) < OP_KEEP_BYTES // 2 + 64, len(entries)
            assert not entries.startswith("10@")
        else:  # it fits: nothing dropped
            assert len(entries) <= OP_KEEP_BYTES and entries.startswith("10@"), len(entries)
