"""Review of the parse memos (lua/sliding_window.lua's PARSED, lua/decide.lua's LEDGERS).

1. What the memos keep alive: they hold up to 2048 filed states whatever their size, and a
   state holds its text twice (the key, and the parse's own `rest`/`entries`). A window of
   MAX_BUCKETS buckets (~130 KB of text) or a ledger behind a stuck op (up to OP_KEEP_BYTES)
   writes a new text on every call, so a hot identifier alone filled the FUNCTION VM with
   hundreds of MB that, before the memos, were garbage at the end of each call.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis

from aiolimit import Limit, Limiter
from aiolimit._calls import Call, Mode, decide_library, encode
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
