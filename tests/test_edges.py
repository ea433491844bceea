"""Exactness and resilience at the edges of the scripts, on real Redis and memory://.

Large weights and argument lists, numbers past 1e14, penalties beside leases, refunds beside
reserved turns: each test pins what the caller is told and what stays stored.
"""

from __future__ import annotations

import asyncio
import time
from itertools import pairwise
from typing import Any

import pytest

from aiolimit import (
    Concurrency,
    ConfigurationError,
    Decision,
    FixedWindow,
    Limit,
    Limiter,
    MinInterval,
    SlidingLog,
    TokenBucket,
)
from aiolimit._calls import Call, Mode
from aiolimit._keys import aux_key, main_key
from aiolimit.testing import ManualClock

START = 1_700_000_000.0
US = 1_000_000


def by_limit(decision: Decision) -> dict[str, int]:
    """remaining per limit (its str) of a one-identifier decision."""
    return {str(pair.limit): pair.remaining for pair in decision.details}


# --- item 8: large argument lists, no error after a write ------------------------------------


async def test_a_large_concurrency_weight_beside_a_sliding_log(store_url: str, prefix: str) -> None:
    """Weight 1,000 takes 1,000 leases (the most a Concurrency limit has) beside a sliding
    log; renew and release handle them all."""
    limits = [SlidingLog(2_000, per=60), Concurrency(1_000)]
    async with Limiter(store_url, limits, prefix=prefix) as limiter:
        decision = await limiter.try_acquire("ip:1", 1_000)
        assert decision.allowed
        assert by_limit(decision) == {str(limits[0]): 1_000, str(limits[1]): 0}
        assert decision.lease is not None
        await decision.lease.renew()
        assert by_limit(await limiter.peek("ip:1", 1)) == {  # refused: the state as it is
            str(limits[0]): 1_000,
            str(limits[1]): 0,
        }
        await decision.lease.release()
        assert by_limit(await limiter.peek("ip:1", 1)) == {  # what is left now
            str(limits[0]): 1_000,
            str(limits[1]): 1_000,
        }
        assert (await limiter.try_acquire("ip:1", 1_000)).allowed
        assert not (await limiter.try_acquire("ip:1", 1)).allowed  # the log is full


def test_a_concurrency_limit_too_large_to_bound_is_refused() -> None:
    """Concurrency keeps one lease entry per unit: above 1,000 a call could cost milliseconds
    of Redis time, so a larger max is a ConfigurationError that says what is allowed."""
    with pytest.raises(ConfigurationError, match=r"1\.\.1000"):
        Concurrency(1_001)
    assert Concurrency(1_000).max_weight == 1_000


# --- item 9: count_refused -------------------------------------------------------------------


async def test_penalty_totals_past_1e14_stay_exact(store_url: str, prefix: str) -> None:
    """count_refused: 100 charges of 1e12 make 1e14, stored exactly; call 101 is still refused."""
    clock = ManualClock(start=START)
    limits = [Limit(10**12, per=10, precision=1), FixedWindow(10**12, per=10)]
    for limit in limits:
        async with Limiter(
            store_url, [limit], prefix=prefix + str(limit.algorithm), clock=clock,
            count_refused=True,
        ) as limiter:  # fmt: skip
            assert (await limiter.try_acquire("ip:1", 10**12)).allowed
            for _ in range(99):
                assert not (await limiter.try_acquire("ip:1", 10**12)).allowed
            assert not (await limiter.try_acquire("ip:1", 1)).allowed, limit


async def test_penalty_never_takes_a_lease(store_url: str, prefix: str) -> None:
    """count_refused: a refused call charges the rate limits but takes no concurrency slot."""
    clock = ManualClock(start=START)
    limits = [Limit(10, per=10), Concurrency(1)]
    async with Limiter(
        store_url, limits, prefix=prefix, clock=clock, count_refused=True
    ) as limiter:
        first = await limiter.try_acquire("ip:1")
        assert first.allowed
        refused = await limiter.try_acquire("ip:1")
        assert not refused.allowed
        assert refused.lease is None
        assert first.lease is not None
        await first.lease.release()
        third = await limiter.try_acquire("ip:1")
        assert third.allowed, third  # the slot is free: the refused call took none
        assert by_limit(third)[str(limits[0])] == 7  # three charged: the penalty applies
        assert third.lease is not None
        await third.lease.release()


# --- item 11: a refund beside reserved turns -------------------------------------------------


@pytest.mark.parametrize(
    "limit", [TokenBucket(1, per=1, burst=1), MinInterval(1)], ids=["TokenBucket", "MinInterval"]
)
async def test_a_refund_never_lets_a_newcomer_share_a_reserved_turn(
    store_url: str, prefix: str, limit: TokenBucket | MinInterval
) -> None:
    """1/s burst 1: after a refund, no two admissions (reserved turns included) come < 1 s apart."""
    clock = ManualClock(start=START)
    admitted: list[int] = []
    async with Limiter(store_url, [limit], prefix=prefix, clock=clock) as limiter:

        async def waiter() -> None:
            assert (await limiter.acquire("ip:1", timeout=10)).allowed
            admitted.append(round((clock.time() - START) * US))

        async def decided(count: int) -> None:
            while limiter.statistics().decisions < count:  # noqa: ASYNC110 - a plain counter
                await asyncio.sleep(0.001)

        await waiter()  # the token: admitted at once
        reserved = asyncio.create_task(waiter())  # reserves the turn at 1 s
        await decided(2)
        await limiter.refund("ip:1")
        newcomer = asyncio.create_task(waiter())
        await decided(3)
        for _ in range(40):
            clock.advance(0.1)
            for _ in range(20):
                await asyncio.sleep(0)
        await asyncio.gather(reserved, newcomer)
    admitted.sort()
    assert len(admitted) == 3
    assert all(later - earlier >= US for earlier, later in pairwise(admitted)), admitted


# --- item 7: bounded cost, exact all the same -------------------------------------------------


async def _run_script(
    limiter: Limiter, prefix: str, limit: Any, mode: str, now_us: int, weight: int, op: str
) -> list[int]:
    """One raw call of lua/decide.lua for identifier "ip:1" under ``limit`` alone."""
    main = main_key(prefix, "ip:1")
    keys = [main]
    aux = 0
    if getattr(limit, "aux_suffix", None):
        keys.append(aux_key(prefix, "ip:1", limit.aux_suffix))
        aux = 2
    block = ",".join(map(str, (len(keys), 1, aux, *limit.wire)))
    call = Call(Mode(mode), keys, [mode, now_us, weight, 0, f"{op}:1:", "", 1, block], ())
    (reply,) = await limiter.store.run([call])
    assert not isinstance(reply, BaseException), reply
    return reply


@pytest.mark.parametrize(
    "limit", [SlidingLog(10, per=10), Limit(10, per=10, precision=1)], ids=["log", "window"]
)
async def test_undo_credits_exactly_the_op_under_later_charges(
    store_url: str, prefix: str, limit: Any
) -> None:
    """Undoing an op charged before others credits its own time: later charges keep theirs."""
    start_us = round(START * US)
    clock = ManualClock(start=START + 1)
    async with Limiter(store_url, [limit], prefix=prefix, clock=clock) as limiter:
        assert (await _run_script(limiter, prefix, limit, "acquire", start_us, 3, "op1"))[0] == 1
        assert (await limiter.try_acquire("ip:1", 2)).allowed  # at 1 s
        clock.advance(1)
        assert (await limiter.try_acquire("ip:1", 1)).allowed  # at 2 s
        clock.advance(1)
        undone = await _run_script(limiter, prefix, limit, "undo", start_us + 3 * US, 3, "op1")
        assert undone[1] == 0  # applied, not a replay
        # 3 left in the window: 8 more fit once the 2 charged at 1 s leave, at 11 s
        peek = await limiter.peek("ip:1", 8)
        assert (peek.allowed, peek.remaining, round(peek.retry_after * US)) == (False, 7, 8 * US)
        assert (await limiter.peek("ip:1", 7)).allowed
        clock.advance(8)  # 11 s: only the unit charged at 2 s is left
        assert (await limiter.try_acquire("ip:1", 9)).allowed
        assert not (await limiter.peek("ip:1", 1)).allowed


async def test_a_sliding_log_weight_of_a_million_costs_one_entry(
    store_url: str, prefix: str
) -> None:
    """SlidingLog weight 10**6 is one entry: charged and refunded in well under a second."""
    clock = ManualClock(start=START)
    async with Limiter(
        store_url, [SlidingLog(10**6, per=3600)], prefix=prefix, clock=clock
    ) as limiter:
        await limiter.peek("ip:1")  # connected, script loaded
        started = time.perf_counter()
        assert (await limiter.try_acquire("ip:1", 10**6)).allowed
        clock.advance(1)
        refused = await limiter.try_acquire("ip:1", 1)
        assert (refused.allowed, round(refused.retry_after * US)) == (False, 3599 * US)
        assert (await limiter.refund("ip:1", 10**6)).remaining == 10**6
        assert (await limiter.try_acquire("ip:1", 10**6)).allowed
        assert time.perf_counter() - started < 0.5  # one entry per unit took 2 s (Redis), 12 s


def test_a_sliding_window_of_more_than_10000_buckets_is_rejected() -> None:
    """Limit precision may cut a window into 10,000 buckets at most: finer is refused at once."""
    assert Limit(10, per=3600, precision=0.36).precision == 0.36  # 10,000 buckets
    with pytest.raises(ConfigurationError, match=r"36000 buckets.*at most 10000"):
        Limit(10, per=3600, precision=0.1)


async def test_a_full_window_of_3600_buckets_costs_what_a_fresh_one_does(
    store_url: str, prefix: str
) -> None:
    """Limit(3600/h, precision 1 s), full: refusals, refunds and sliding calls stay well < 1 ms."""
    clock = ManualClock(start=START)
    async with Limiter(
        store_url, [Limit(3600, per=3600, precision=1)], prefix=prefix, clock=clock
    ) as limiter:
        for _ in range(3600):  # one unit in every bucket
            assert (await limiter.try_acquire("ip:1")).allowed
            clock.advance(1)
        walls = []
        for _ in range(20):
            for call in (
                limiter.try_acquire("ip:1", 2),
                limiter.refund("ip:1"),
                limiter.peek("ip:1"),
            ):
                started = time.perf_counter()
                await call
                walls.append(time.perf_counter() - started)
            clock.advance(1)  # one bucket leaves, one opens
        walls.sort()
        # Parsing every bucket took ~2.5-4 ms a call, on Redis and on memory://.
        assert walls[len(walls) // 2] < 0.001, walls
