"""Test helpers: a clock that only moves when told to."""

from __future__ import annotations

import asyncio
import math

from aiolimit._validation import check_number

__all__ = ["ManualClock"]


class ManualClock:
    """A clock whose time moves only by ``advance`` (or, with ``autojump``, by sleeping).

    ``ManualClock(start=1_700_000_000.0)`` starts at that many seconds since the epoch. Tasks
    that ``sleep`` on it wait until the clock has been advanced past their wake time; with
    ``autojump=True`` a sleep moves the clock forward to its own wake time at once, which makes
    ``acquire(timeout=...)`` run instantly and deterministically.
    """

    #: Keys judged by manual time must not expire by real time while a test runs.
    ttl_slack_ms = 3_600_000
    #: Time moves only when told: a wait of exactly retry_after is enough.
    sleep_margin = 0.0

    def __init__(self, start: float = 1_700_000_000.0, *, autojump: bool = False) -> None:
        # (at most 9e9 s: a time at or past 2**53 µs is not stored exactly; see client_now)
        start = check_number("ManualClock start", start, 0, 9e9)
        self._us = round(start * 1_000_000)
        self.autojump = autojump
        self._moved: asyncio.Event | None = None  # made lazily: it needs a running event loop

    def time(self) -> float:
        """The current manual time, in seconds since the epoch."""
        return self._us / 1_000_000

    def advance(self, seconds: float) -> None:
        """Moves time forward by ``seconds`` (never backwards) and wakes due sleepers."""
        seconds = check_number("advance", seconds, 0, 1e11)
        self._set(self._us + round(seconds * 1_000_000))

    def _set(self, us: int) -> None:
        if us > self._us:
            self._us = us
            if self._moved is not None:
                self._moved.set()
                self._moved = None

    async def now_us(self) -> int | None:
        return self._us

    def monotonic(self) -> float:
        return self.time()

    async def sleep(self, seconds: float) -> None:
        wake = self._us + math.ceil(max(seconds, 0.0) * 1_000_000)
        if self.autojump:
            self._set(wake)
        while self._us < wake:
            if self._moved is None:
                self._moved = asyncio.Event()
            await self._moved.wait()
        await asyncio.sleep(0)

    def __repr__(self) -> str:
        return f"ManualClock(start={self.time()!r}, autojump={self.autojump})"
