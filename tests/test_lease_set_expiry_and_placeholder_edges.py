"""Lease sets (9c62cb0, b733b08, 4efda5a): the placeholder, the mirrored TTL, and their cost.

``drop`` in ``lua/concurrency.lua`` keeps the lease ZSET non-empty with a member ``"~"``
scored ``-inf``; ``mirror_leases`` in ``lua/decide.lua`` raises each lease set's TTL to its
main key's on every write of a call with a lease pair (never lowers it); a renew writes its
main key. Checked here:

- the embedded engine (``memory://``) and Redis give the same replies, the same lease
  scores (placeholder included) and the same TTL relation on one program (manual time);
- a placeholder next to a live lease (a release sent twice) is never counted: peek,
  refusals' ``retry_after``/``reset_after``, and the next charge trims it;
- the lease set never expires after its main key (exact, by PEXPIRETIME, read atomically);
- calls without a ``Concurrency`` limit pay nothing for any of it (no PTTL at all).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as redis_asyncio

from aiolimit import Concurrency, Limit, Limiter, SlidingLog, TokenBucket
from aiolimit._calls import RELEASE, RENEW
from aiolimit._keys import main_key
from aiolimit.testing import ManualClock

PLACEHOLDER = b"~"
START = 1_700_000_000.0

#: Both keys' absolute expiry (ms), read in one script: no time passes between them.
EXPIRE_TIMES = "return {redis.call('PEXPIRETIME', KEYS[1]), redis.call('PEXPIRETIME', KEYS[2])}"


class Raw:
    """Raw reads of a limiter's store: Redis through a client, memory:// through its engine."""

    def __init__(self, limiter: Limiter, url: str) -> None:
        self.limiter = limiter
        self.client: Any = None if url == "memory://" else redis_asyncio.Redis.from_url(url)

    async def command(self, *args: Any) -> Any:
        if self.client is None:
            return self.limiter.store.engine.execute_command(*args)  # type: ignore[attr-defined]
        return await self.client.execute_command(*args)

    async def scores(self, key: str) -> list[tuple[bool, float]]:
        """The set's members as (is the placeholder, score), in order: op ids differ per
        limiter, so only the placeholder is named."""
        reply = await self.command("ZRANGE", key, 0, -1, "WITHSCORES")
        if reply and isinstance(reply[0], (list, tuple)):  # (redis-py pairs them up)
            pairs = [(bytes(m), float(s)) for m, s in reply]
        else:
            pairs = [(bytes(reply[i]), float(reply[i + 1])) for i in range(0, len(reply), 2)]
        return [(member == PLACEHOLDER, score) for member, score in pairs]

    async def ttls(self, main: str, aux: str) -> tuple[int, int]:
        return int(await self.command("PTTL", main)), int(await self.command("PTTL", aux))

    async def aclose(self) -> None:
        if self.client is not None:
            await self.client.aclose()


@pytest.fixture(params=["redis", "memory"])
def url(request: pytest.FixtureRequest) -> str:
    if request.param == "memory":
        return "memory://"
    value: str = request.getfixturevalue("redis_url")
    return value


@pytest.fixture
async def raws() -> AsyncIterator[list[Raw]]:
    opened: list[Raw] = []
    yield opened
    for raw in opened:
        await raw.aclose()


def _decision_text(decision: Any) -> tuple[Any, ...]:
    return (
        decision.allowed,
        decision.remaining,
        decision.retry_after,
        decision.reset_after,
        decision.identifier,
        decision.limit,
        decision.details,
        decision.degraded,
        decision.lease is None,
    )


async def _program(limiter: Limiter, clock: ManualClock, raw: Raw, prefix: str) -> list[Any]:
    """Every reply, lease scores and TTL relation of one fixed program on ``u:1``."""
    main = main_key(prefix, "u:1")
    aux = main + ":lease"
    proto = limiter._protocol
    seen: list[Any] = []

    async def state(step: str) -> None:
        main_ttl, aux_ttl = await raw.ttls(main, aux)
        relation = (
            main_ttl > 0,
            aux_ttl if aux_ttl < 0 else "ttl",
            # (both TTLs run on real time; the slack is an hour: they are equal within 50 ms)
            aux_ttl < 0 or abs(aux_ttl - main_ttl) <= 50,
        )
        seen.append((step, await raw.scores(aux), relation))

    a = await limiter.try_acquire("u:1", 2)
    seen.append(("a", _decision_text(a)))
    await state("a")
    clock.advance(1)
    b = await limiter.try_acquire("u:1")
    seen.append(("b", _decision_text(b)))
    full = await limiter.try_acquire("u:1")
    seen.append(("full", _decision_text(full)))
    await state("b")
    assert a.lease is not None and b.lease is not None
    await a.lease.release()
    await state("release a")
    await proto.lease_call(RELEASE, a.lease._plans, 2, a.lease._op)  # (sent again)
    await state("release a again")
    seen.append(("peek", _decision_text(await limiter.peek("u:1", 3))))
    clock.advance(2)
    renewed = await proto.lease_call(RENEW, b.lease._plans, 1, b.lease._op)
    seen.append(("renew b", _decision_text(renewed)))
    await state("renew b")
    clock.advance(5)  # (b's lease, 5 s, expired)
    late = await proto.lease_call(RENEW, b.lease._plans, 1, b.lease._op)
    seen.append(("renew late", _decision_text(late)))
    await b.lease.release()
    await state("release b")
    seen.append(("peek idle", _decision_text(await limiter.peek("u:1"))))
    c = await limiter.try_acquire("u:1", 3)
    seen.append(("c", _decision_text(c)))
    await state("c")
    assert c.lease is not None
    await limiter.refund("u:1", decision=c)
    await state("refund c")
    await c.lease.release()
    await state("release c")
    clock.advance(120)  # (the window's hour is far; the lease sets' lease long gone)
    seen.append(("peek later", _decision_text(await limiter.peek("u:1"))))
    return seen


async def test_memory_matches_redis_on_a_lease_program(
    redis_url: str, prefix: str, raws: list[Raw]
) -> None:
    """The same program (acquires of several weights, a refusal, a release sent twice, renews
    in time and late, a release after expiry, a refund, peeks) on Redis and on
    ``memory://``, both judged by one manual time: every reply equal, the lease set's scores
    (the placeholder and its ``-inf`` included) equal after every write, and the same TTL
    relation between the set and its main key."""
    limits = [Concurrency(3, lease_ttl=5), Limit(100, per=3600, precision=60)]
    results = []
    for url in (redis_url, "memory://"):
        clock = ManualClock(start=START)
        async with Limiter(url, limits, prefix=prefix, clock=clock) as limiter:
            raw = Raw(limiter, url)
            raws.append(raw)
            results.append(await _program(limiter, clock, raw, prefix))
    on_redis, on_memory = results
    assert len(on_redis) == len(on_memory)
    for got, want in zip(on_memory, on_redis, strict=True):
        assert got == want
    # (and the placeholder is there where expected: after "release a again" it sits
    # beside b's live lease, -inf first)
    by_step = {entry[0]: entry for entry in on_redis if len(entry) == 3}
    assert by_step["release a again"][1][0] == (True, -math.inf)
    assert by_step["release b"][1] == [(True, -math.inf)]


async def test_a_placeholder_beside_a_live_lease_is_never_counted(
    url: str, prefix: str, raws: list[Raw]
) -> None:
    """``Concurrency(2)``: ``a`` and ``b`` hold one place each; ``a`` released twice (a
    background retry of a release does that) leaves ``{"~", b}``: the second drop found a set
    no larger than its op's members and added the placeholder although ``b`` lives. Then
    ``peek`` and a refused weight-2 call count one lease (``b``), the refusal waits for ``b``'s
    expiry and resets then, and a charge trims the placeholder."""
    limits = [Concurrency(2, lease_ttl=30)]
    async with Limiter(url, limits, prefix=prefix) as lim:
        raw = Raw(lim, url)
        raws.append(raw)
        aux = main_key(prefix, "u:1") + ":lease"
        a = await lim.try_acquire("u:1")
        await asyncio.sleep(0.2)
        b = await lim.try_acquire("u:1")
        assert a.lease is not None and b.lease is not None
        await a.lease.release()
        await lim._protocol.lease_call(RELEASE, a.lease._plans, 1, a.lease._op)
        scores = await raw.scores(aux)
        assert [p for p, _ in scores] == [True, False], scores
        peek = await lim.peek("u:1")
        assert peek.remaining == 1 and peek.allowed
        assert 29.5 < peek.reset_after <= 30
        refused = await lim.try_acquire("u:1", 2)
        assert not refused.allowed and refused.remaining == 1
        assert 29.5 < refused.retry_after <= 30 and refused.retry_after == refused.reset_after
        c = await lim.try_acquire("u:1")
        assert c.allowed and c.remaining == 0
        assert [p for p, _ in await raw.scores(aux)] == [False, False]
        assert c.lease is not None
        await c.lease.release()
        await b.lease.release()
        assert await raw.scores(aux) == [(True, -math.inf)]
        assert (await lim.peek("u:1")).remaining == 2


async def test_the_lease_set_never_expires_after_its_main_key(redis_url: str, prefix: str) -> None:
    """Server time, one identifier under ``Concurrency(5, lease_ttl=1)``: acquire, renew and
    release in a loop for up to 4 s (past several of the main key's TTL steps). After every
    write both keys' absolute expiries are read in one script (``PEXPIRETIME``), so the
    comparison is exact: the set must never expire after its main key.

    ``mirror_leases`` compares two TTLs read one after the other (``PTTL`` of the main key,
    then of the set) and sets the set's relative TTL (``PEXPIRE``) from the first. On Redis
    7.0 time runs on within a script (``PTTL``/``PEXPIRE`` read the live clock, only expiry
    checks are frozen), so when a millisecond passes between those calls the set is given the
    main key's TTL from a millisecond later: it expires 1 ms after its main key, and stays so
    until the main key's TTL is next raised. Probabilistic (a millisecond boundary between two
    adjacent commands), seen within a second or two here.

    Expected: PEXPIRETIME(set) <= PEXPIRETIME(main) after every write. Observed: the set
    expires 1 ms after its main key (the set alone for that millisecond; harmless but for a
    migration of the slot in that window).
    """
    client = redis_asyncio.Redis.from_url(redis_url)
    try:
        async with Limiter(redis_url, [Concurrency(5, lease_ttl=1)], prefix=prefix) as lim:
            main = main_key(prefix, "u:1")
            aux = main + ":lease"
            late: list[tuple[str, int, int]] = []

            async def check(step: str) -> None:
                main_at, aux_at = await client.eval(EXPIRE_TIMES, 2, main, aux)
                if aux_at > main_at:
                    late.append((step, main_at, aux_at))

            end = time.monotonic() + 4
            while time.monotonic() < end and not late:
                decision = await lim.try_acquire("u:1")
                assert decision.lease is not None
                await check("acquire")
                await decision.lease.renew()
                await check("renew")
                await decision.lease.release()
                await check("release")
    finally:
        await client.aclose()
    assert late == []


async def test_calls_without_a_concurrency_limit_pay_nothing_for_lease_sets(
    fresh_standalone: Any, prefix: str
) -> None:
    """On a server of its own (its command statistics are this test's): 100 acquires on two
    identifiers under a window (the fast path), a token bucket and a sliding log (the
    general way), plus their refusals, make no ``PTTL`` call at all (``mirror_leases`` runs
    only for calls with a lease pair), and ``PEXPIRE`` only as their own TTLs need. A call
    with a lease pair does pay: its PTTLs are counted too, as a control."""
    url = fresh_standalone.url
    client = redis_asyncio.Redis.from_url(url)

    async def calls(command: str) -> int:
        stats = await client.info("commandstats")
        return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))

    try:
        for name, limits in (
            ("window", [Limit(150, per=60)]),
            ("bucket", [TokenBucket(150, per=60)]),
            ("log", [SlidingLog(150, per=60)]),
        ):
            async with Limiter(url, limits, prefix=f"{prefix}{name}") as lim:
                for _ in range(3):  # (keys, ledgers and the library in place)
                    await lim.try_acquire(["u:1", "u:2"])
                await client.config_resetstat()
                for _ in range(200):
                    await lim.try_acquire(["u:1", "u:2"])
                assert await calls("pttl") == 0, name
        async with Limiter(url, [Concurrency(500, lease_ttl=60)], prefix=prefix) as lim:
            await client.config_resetstat()
            decision = await lim.try_acquire(["u:1", "u:2"])
            assert decision.lease is not None
            assert await calls("pttl") > 0
            await decision.lease.release()
    finally:
        await client.aclose()
