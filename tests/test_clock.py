"""Clocks: ManualClock moves only when told (or by autojump); local and server clocks basics."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import pytest

from aiolimit import Clock, ConfigurationError, Limit, Limiter, LocalClock, ServerClock
from aiolimit.testing import ManualClock

START = 1_700_000_000.25


async def _settle() -> None:
    """Lets every ready task run a few steps."""
    for _ in range(10):
        await asyncio.sleep(0)


def test_manual_clock_starts_where_told_and_moves_only_by_advance() -> None:
    """time() is the start until advance; advance adds exactly, in whole microseconds."""
    clock = ManualClock(start=START)
    assert clock.time() == START
    assert clock.monotonic() == START
    time.sleep(0.01)
    assert clock.time() == START
    clock.advance(0.75)
    assert clock.time() == 1_700_000_001.0
    clock.advance(0)
    clock.advance(0.000_000_4)  # below a microsecond: rounds to nothing
    assert clock.time() == 1_700_000_001.0
    assert ManualClock().time() == 1_700_000_000.0  # the documented default start


async def test_manual_clock_reports_integer_microseconds() -> None:
    """now_us() is the manual time as an int of microseconds, as the scripts take it."""
    clock = ManualClock(start=START)
    now = await clock.now_us()
    assert now == 1_700_000_000_250_000
    assert isinstance(now, int)
    clock.advance(1.5)
    assert await clock.now_us() == 1_700_000_001_750_000


@pytest.mark.parametrize("seconds", [-1, -0.001, math.nan, math.inf])
def test_manual_clock_never_goes_backwards(seconds: float) -> None:
    """advance refuses negative, NaN and infinite steps and leaves the time alone."""
    clock = ManualClock(start=START)
    with pytest.raises(ConfigurationError, match="advance"):
        clock.advance(seconds)
    assert clock.time() == START


@pytest.mark.parametrize("start", [-1, math.nan, math.inf, True, "0", None, 1e10])
def test_manual_clock_rejects_a_bad_start(start: Any) -> None:
    """ManualClock's start must be seconds in [0, 9e9] (past 2**53 µs no time is exact)."""
    with pytest.raises(ConfigurationError, match="ManualClock start"):
        ManualClock(start=start)


async def test_manual_sleep_waits_until_the_clock_is_advanced_past_its_wake_time() -> None:
    """Without autojump, sleep returns only once advance reaches its wake time."""
    clock = ManualClock(start=START)
    sleeper = asyncio.create_task(clock.sleep(2))
    await _settle()
    assert not sleeper.done()
    clock.advance(1.999_999)
    await _settle()
    assert not sleeper.done()
    clock.advance(0.000_001)
    await asyncio.wait_for(sleeper, 1)
    assert clock.time() == START + 2


async def test_manual_sleepers_wake_in_order_of_their_wake_times() -> None:
    """Several sleepers each wake when the clock passes their own time, not before."""
    clock = ManualClock(start=START)
    woke: list[float] = []

    async def sleep_then_note(seconds: float) -> None:
        await clock.sleep(seconds)
        woke.append(seconds)

    tasks = [asyncio.create_task(sleep_then_note(s)) for s in (3, 1, 2)]
    await _settle()
    for expected in ([1], [1, 2], [1, 2, 3]):
        clock.advance(1)
        await _settle()
        assert woke == expected
    await asyncio.gather(*tasks)


async def test_autojump_sleep_moves_the_clock_to_its_wake_time_at_once() -> None:
    """With autojump, sleep(s) advances the clock by s (rounded up to a µs) and returns."""
    clock = ManualClock(start=START, autojump=True)
    started = time.monotonic()
    await clock.sleep(3600)
    assert clock.time() == START + 3600
    await clock.sleep(0.000_000_1)
    assert clock.time() == START + 3600.000_001
    await clock.sleep(0)
    await clock.sleep(-5)
    assert clock.time() == START + 3600.000_001
    assert time.monotonic() - started < 0.5


async def test_autojump_sleep_also_wakes_other_sleepers() -> None:
    """A jump by one sleeper wakes another whose wake time it passed."""
    clock = ManualClock(start=START, autojump=False)
    waiting = asyncio.create_task(clock.sleep(1))
    await _settle()
    clock.autojump = True
    await clock.sleep(5)
    await asyncio.wait_for(waiting, 1)
    assert clock.time() == START + 5


def test_every_clock_is_a_clock() -> None:
    """ManualClock, LocalClock and ServerClock satisfy the Clock protocol."""
    for clock in (ManualClock(), LocalClock(), ServerClock()):
        assert isinstance(clock, Clock)


def test_ttl_slack_per_clock() -> None:
    """Server time needs no TTL slack; a local clock a second; a manual clock an hour."""
    assert ServerClock.ttl_slack_ms == 0
    assert LocalClock.ttl_slack_ms == 1000
    assert ManualClock.ttl_slack_ms == 3_600_000


async def test_local_clock_reads_this_process_wall_clock() -> None:
    """LocalClock.now_us() is time.time() in integer microseconds; sleep really sleeps."""
    clock = LocalClock()
    before = time.time_ns() // 1000
    now = await clock.now_us()
    after = time.time_ns() // 1000
    assert isinstance(now, int)
    assert before <= now <= after
    started = clock.monotonic()
    await clock.sleep(0.02)
    assert 0.015 <= clock.monotonic() - started < 1


async def test_server_clock_defers_to_the_script() -> None:
    """ServerClock.now_us() is None: the script reads its own server's TIME."""
    clock = ServerClock()
    assert await clock.now_us() is None
    started = clock.monotonic()
    await clock.sleep(0.02)
    assert 0.015 <= clock.monotonic() - started < 1


async def test_default_clocks_server_on_redis_local_on_memory() -> None:
    """A limiter without a clock uses ServerClock on redis:// and LocalClock on memory://."""
    limits = [Limit(1, per=1)]
    async with Limiter("redis://127.0.0.1:1/0", limits) as on_redis:  # never connects
        assert isinstance(on_redis.clock, ServerClock)
    async with Limiter("memory://", limits) as on_memory:
        assert isinstance(on_memory.clock, LocalClock)
        assert (await on_memory.try_acquire("ip:1")).allowed


async def test_a_limiter_refuses_an_object_that_is_not_a_clock() -> None:
    """clock= must implement aiolimit.Clock."""
    with pytest.raises(ConfigurationError, match="clock"):
        Limiter("memory://", [Limit(1, per=1)], clock=object())  # type: ignore[arg-type]
