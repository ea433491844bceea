"""Clocks: where a decision's ``now`` comes from.

Scripts never read the client's wall clock implicitly. A clock either returns ``None`` from
``now_us()``, meaning "use the TIME of the Redis server that runs the script" (the default:
free, and consistent per key), or an integer of microseconds since the epoch that the script
uses instead. Whatever the clock says, a key's time never runs backwards: the scripts judge each
identifier by max(now, its last write).

A clock also owns waiting (``sleep``) and measuring timeouts (``monotonic``), so a manual clock
makes ``acquire`` deterministic in tests.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol, runtime_checkable


@runtime_checkable
class Clock(Protocol):
    """What the limiter needs from a clock."""

    #: Milliseconds added to every key's TTL. Server time needs none; a clock that is not the
    #: server's (a client's, a manual one) gets slack so keys outlive the windows it judges by.
    ttl_slack_ms: int
    #: Seconds added to a wait before trying again: none on a clock that judges exactly when
    #: told to (a manual one); a little on a real one, whose server time ticks on and rounds
    #: to microseconds.
    sleep_margin: float

    async def now_us(self) -> int | None:
        """Microseconds since the epoch (an int in [0, 2**53)), or None to use the script's
        own server TIME."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock that only moves forward, for timeouts."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Waits ``seconds`` on this clock."""
        ...


class ServerClock:
    """Each script reads its own server's TIME (the default on Redis)."""

    ttl_slack_ms = 0
    sleep_margin = 0.000_5

    async def now_us(self) -> int | None:
        return None

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def __repr__(self) -> str:
        return "ServerClock()"


class LocalClock:
    """This process's wall clock (the default on the embedded backend).

    On a shared Redis every client then judges by its own clock; prefer the server clock or an
    authority there.
    """

    ttl_slack_ms = 1000
    sleep_margin = 0.000_5

    async def now_us(self) -> int | None:
        return time.time_ns() // 1000

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def __repr__(self) -> str:
        return "LocalClock()"
