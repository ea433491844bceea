"""The parse memos at their edges (lua/sliding_window.lua's PARSED, lua/decide.lua's LEDGERS).

1. What the memos keep alive: they hold up to 2048 filed states whatever their size, and a
   state holds its text twice (the key, and the parse's own `rest`/`entries`). A window of
   MAX_BUCKETS buckets (~130 KB of text) or a ledger behind a stuck op (up to OP_KEEP_BYTES)
   writes a new text on every call, so a hot identifier alone filled the FUNCTION VM with
   hundreds of MB that, before the memos, were garbage at the end of each call.
2. Texts the script writes but cannot read back (a negative `now`, a window field edited to a
   bucket ahead of the clock, a record past the 64 bytes the tail parse looks at): a fresh
   parse fails or reads something else, while the filed state was used as if it were the
   text's parse.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from aiolimit import Concurrency, Limit, Limiter
from aiolimit._calls import Call, Mode, decide_library, decide_script, encode
from cluster import Standalone

T0 = 1_700_000_000_000_000
SLACK = 3_600_000


@pytest.fixture
async def own(fresh_standalone: Standalone) -> AsyncIterator[Redis]:
    """A client of a server of this test's own, the library loaded: its FUNCTION VM holds
    nothing but what this test's calls leave."""
    client = Redis.from_url(fresh_standalone.url)
    await client.execute_command("FUNCTION", "LOAD", "REPLACE", decide_library().code)
    yield client
    await client.aclose()


async def _vm_bytes(server: Redis) -> int:
    info = await server.info("memory")
    return int(info["used_memory_vm_functions"])


async def _pipelined(server: Redis, function: str, calls: list[Call]) -> list[Any]:
    replies: list[Any] = []
    for at in range(0, len(calls), 100):
        pipe = server.pipeline(transaction=False)
        for call in calls[at : at + 100]:
            pipe.execute_command("FCALL", function, len(call.keys), *call.keys, *call.args)
        replies += await pipe.execute()
    return replies


async def test_a_hot_wide_window_does_not_fill_the_function_vm(own: Redis) -> None:
    # 10,000 one-second buckets (MAX_BUCKETS), all but the newest ones charged: ~130 KB.
    limit = Limit(10**9, per=10_000, precision=1)
    plans = Limiter("memory://", [limit], prefix="m")._rules.plans("hot")
    key, field = plans[0].keys[0], "w10000000000/1000000"
    base = T0 // 1_000_000 - 9_998
    records = ",".join(f"{i}:{(i + 1) * 1000}" for i in range(9_997))
    await own.hset(key, mapping={field: f"{base}|0|{records}", "t": T0})
    calls = [encode(Mode.ACQUIRE, plans, 1, T0 + 1 + i, SLACK) for i in range(300)]
    replies = await _pipelined(own, decide_library().function, calls)
    assert all(reply[0] == 1 for reply in replies)
    held = await _vm_bytes(own)
    # Unbounded: ~300 x 2 x 130 KB = ~78 MB kept (8ec941a: about nothing).
    assert held < 24 * 2**20, f"the FUNCTION VM holds {held / 2**20:.0f} MB"


async def test_a_stuck_ops_ledger_does_not_fill_the_function_vm(own: Redis) -> None:
    # Client c1's op 1 stays open (its undo pending): every later op keeps its entry, up to
    # OP_KEEP_BYTES. The ledger starts at ~60 KB.
    plans = Limiter("memory://", [Limit(10**9, per=1)], prefix="m")._rules.plans("hot")
    key = plans[0].keys[0]
    entries = ",".join(f"{stamp}@{T0}" for stamp in range(2, 2_800))
    await own.hset(key, mapping={"o:c1": f"{T0};0;{entries}", "t": T0})
    calls = [
        encode(Mode.ACQUIRE, plans, 1, T0 + 1 + i, SLACK, f"c1:{3_000 + i}:1") for i in range(500)
    ]
    replies = await _pipelined(own, decide_library().function, calls)
    assert all(reply[0] == 1 for reply in replies)
    held = await _vm_bytes(own)
    assert held < 24 * 2**20, f"the FUNCTION VM holds {held / 2**20:.0f} MB"


async def _both(server: Redis, prefix: str, steps: list[tuple[str, Any]]) -> None:
    """Runs ``steps`` twice, under ``<prefix>e`` with EVAL (a fresh parse of every text) and
    under ``<prefix>f`` with FCALL of the library (the memos), and compares every reply and
    the stored fields. A step is ("call", (mode, weight, now, op)) on identifier "i" under
    one sliding window, or ("set", {field: text}) on its main key."""
    limiter = {side: Limiter("memory://", [WINDOW], prefix=f"{prefix}{side}") for side in "ef"}
    got: dict[str, list[Any]] = {"e": [], "f": []}
    for side in "ef":
        plans = limiter[side]._rules.plans("i")
        key = plans[0].keys[0]
        for kind, what in steps:
            if kind == "set":
                await server.hset(key, mapping=what)
                continue
            mode, weight, now, op = what
            call = encode(mode, plans, weight, now, SLACK, op)
            try:
                if side == "e":
                    source = decide_script().source
                    reply = await server.eval(source, len(call.keys), *call.keys, *call.args)
                else:
                    function = decide_library().function
                    reply = await server.execute_command(
                        "FCALL", function, len(call.keys), *call.keys, *call.args
                    )
            except ResponseError:
                reply = "error"
            got[side].append((reply, await server.hgetall(key)))
    for at, (fresh, memo) in enumerate(zip(got["e"], got["f"], strict=True)):
        assert memo == fresh, (at, "fresh:", fresh, "memo:", memo)


WINDOW = Limit(1_000_000, per=10, precision=1)
FIELD = "w10000000/1000000"


async def test_a_ledger_written_at_a_negative_now_is_read_as_a_fresh_parse_reads_it(
    server: Redis, prefix: str
) -> None:
    # The script takes any number for now. At -5 its ledger is "-5;0;1@0", which a fresh
    # parse cannot read (the op is then new), while the memo had filed it: the resent op
    # replays under FCALL but charges again under EVAL.
    await _both(
        server,
        prefix,
        [("call", (Mode.ACQUIRE, 1, -5, "c:1:")), ("call", (Mode.ACQUIRE, 1, 10, "c:1:"))],
    )


BUCKET = T0 // 1_000_000


@pytest.mark.parametrize(
    "text",
    [
        # A field whose base is a bucket the key's clock has not reached (edited by hand, or
        # another window's text): the charge appends a record at a negative offset, a text a
        # fresh parse fails on; the memo used the state it had filed for that text.
        pytest.param(f"{BUCKET + 5}|0|0:1", id="ahead of the clock"),
        # The newest record is read from the last 64 bytes of the text. One written with
        # leading zeros grows past them when its count gains a digit: a fresh parse fails.
        pytest.param(f"{BUCKET - 5}|0|1:1,{'0' * 61}5:9", id="record past 64 bytes"),
    ],
)
async def test_a_window_text_the_script_cannot_parse_back_is_read_as_a_fresh_parse_reads_it(
    server: Redis, prefix: str, text: str
) -> None:
    await _both(
        server,
        prefix,
        [
            ("set", {FIELD: text, "t": T0}),
            ("call", (Mode.ACQUIRE, 1, T0 + 1, "")),
            ("call", (Mode.CHECK, 1, T0 + 2, "")),
        ],
    )


async def test_a_renew_in_a_batch_leaves_no_ttl_to_the_next_call(
    server: Redis, prefix: str
) -> None:
    # (Found on the way, older than the memos.) renew asks for the main key's TTL without
    # writing the key, so flush skips the key and what renew asked for stayed on the loaded
    # key: the next call of the batch that writes it set "x" (and PEXPIRE) from it, which the
    # same calls sent one by one do not.
    from test_decide_many import _many, _one_by_one

    limits = [Limit(5, per=10), Concurrency(2, lease_ttl=30)]
    results = {}
    for side in "ab":
        plans = Limiter("memory://", limits, prefix=f"{prefix}{side}")._rules.plans("i")
        calls = [
            encode(Mode.ACQUIRE, plans, 1, T0, 0, "c:1:"),
            encode(Mode.RENEW, plans, 1, T0 + 1_000_000, 0, "c:1:"),
            # (a refund asks for the window's TTL only: ~9 s, where renew asked for 31 s)
            encode(Mode.REFUND, plans, 1, T0 + 1_500_000, 0),
        ]
        if side == "a":
            replies = await _one_by_one(server, calls)
        else:
            replies = await _many(server, calls[:1]) + await _many(server, calls[1:])
        results[side] = (replies, await server.hget(plans[0].keys[0], "x"))
    assert results["b"] == results["a"]


async def test_a_ledger_set_back_to_an_older_text_is_read_as_that_text(
    server: Redis, prefix: str
) -> None:
    # One batch charges ops 1 and 2 of client c on one key: the ledger text after op 1 (V1)
    # is filed, and the same ledger then records op 2 (filed again, under V2). The key is
    # then set back to V1 (a replica promoted without the last write, a RESTORE), and op 2
    # is sent again: V1 has no op 2, so it charges, as a fresh parse of V1 says. (Read as the
    # ledger filed under V1, which op 2 changed since, it would replay and charge nothing.)
    from test_decide_many import _many

    limiter = Limiter("memory://", [WINDOW], prefix=prefix)
    plans = limiter._rules.plans("i")
    key = plans[0].keys[0]
    first = encode(Mode.ACQUIRE, plans, 1, T0, SLACK, "c:1:")
    second = encode(Mode.ACQUIRE, plans, 1, T0 + 1_000, SLACK, "c:2:")
    # V1 and the window after op 1, as a lone call writes them (on a key of their own)
    other = Limiter("memory://", [WINDOW], prefix=f"{prefix}v")._rules.plans("i")
    function = decide_library().function
    alone = encode(Mode.ACQUIRE, other, 1, T0, SLACK, "c:1:")
    await server.execute_command("FCALL", function, 1, *alone.keys, *alone.args)
    after_first = await server.hgetall(other[0].keys[0])
    assert [reply[0] for reply in await _many(server, [first, second])] == [1, 1]
    await server.delete(key)
    await server.hset(key, mapping=after_first)  # type: ignore[arg-type]
    again = await server.execute_command("FCALL", function, 1, *second.keys, *second.args)
    assert again[:2] == [1, 0]  # applied now, not a replay
    peek = encode(Mode.PEEK, plans, 1, T0 + 2_000, SLACK)
    left = await server.execute_command("FCALL", function, 1, *peek.keys, *peek.args)
    assert left[4] == WINDOW.amount - 2  # ops 1 and 2, each once
