"""The embedded engine's keyspace: keys, values and deadlines, expired as Redis does.

Values are bytes (strings), dicts (hashes) and ``SortedSet``. Expiry is lazy (a read of a due
key drops it) plus a bounded sweep of due keys at the start of each script or command. As in
Redis 7.0, expiry is judged by the time the script started, while TTL arithmetic (PTTL,
PEXPIRE's base) reads the live clock. Deadlines live on the monotonic clock, so a jump of the
wall clock neither expires nor revives a key. The commands that use it live in ``commands``.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable
from typing import Any, TypeAlias

Reply: TypeAlias = "int | bytes | list[Reply] | None"

WRONGTYPE = "WRONGTYPE Operation against a key holding the wrong kind of value"


class CommandError(Exception):
    """A command failed; the message is Redis' error line, for example ``ERR syntax error``."""


class Status(bytes):
    """A status reply (``+OK``), which scripts see as ``{ok = ...}`` rather than a string."""


class SortedSet:
    """A ZSET: member -> score, plus the (score, member) pairs kept in Redis' order."""

    __slots__ = ("entries", "scores")

    def __init__(self) -> None:
        self.scores: dict[bytes, float] = {}
        self.entries: list[tuple[float, bytes]] = []

    def insert(self, member: bytes, score: float) -> None:
        score += 0.0  # Redis' small-set encoding stores -0 as 0
        self.scores[member] = score
        insort(self.entries, (score, member))

    def remove(self, member: bytes) -> None:
        score = self.scores.pop(member)
        del self.entries[bisect_left(self.entries, (score, member))]

    def score_slice(self, low: tuple[float, bool], high: tuple[float, bool]) -> tuple[int, int]:
        """Index range [start, stop) of the entries whose score lies within the bounds."""
        start = (bisect_right if low[1] else bisect_left)(self.entries, low[0], key=_score)
        stop = (bisect_left if high[1] else bisect_right)(self.entries, high[0], key=_score)
        return start, max(start, stop)

    def rank_slice(self, start: int, end: int) -> tuple[int, int]:
        """Redis' index rules: negative counts from the end, clamped; [start, stop) or empty."""
        size = len(self.entries)
        start, end = start + size if start < 0 else start, end + size if end < 0 else end
        start = max(start, 0)
        if start > end or start >= size:
            return 0, 0
        return start, min(end, size - 1) + 1


def _score(entry: tuple[float, bytes]) -> float:
    return entry[0]


Value = bytes | dict[bytes, bytes] | SortedSet


class Keyspace:
    """Keys, values and deadlines, with Redis' lazy expiry plus a bounded sweep of due keys."""

    def __init__(self, monotonic: Callable[[], float], wall: Callable[[], float]) -> None:
        self._monotonic = monotonic
        self._wall = wall
        self.data: dict[bytes, Value] = {}
        self.expires: dict[bytes, int] = {}  # key -> deadline on the monotonic clock, in ms
        self._deadlines: list[tuple[int, bytes]] = []  # a heap; refreshed TTLs leave stale rows
        # Redis 7.0 judges expiry by the time its script started (frozen_ms), but computes
        # TTLs from the live clock, read once per command (mono_ms, wall_ms).
        self.frozen_ms = self.mono_ms = self.wall_ms = 0
        self._offset: int | None = None  # (see wall_offset)

    def read_clocks(self) -> None:
        """Read the live clocks for one command's TTL arithmetic (expiry stays frozen)."""
        self.mono_ms = round(self._monotonic() * 1000)  # round: 1000.029 s is 1000029 ms
        self.wall_ms = round(self._wall() * 1000)

    def begin(self) -> None:
        """Freeze the clock for one script or command, then drop a few keys that are due."""
        self.read_clocks()
        self.frozen_ms = self.mono_ms
        heap = self._deadlines
        for _ in range(64):
            if not heap or heap[0][0] >= self.frozen_ms:
                break
            deadline, key = heapq.heappop(heap)
            if self.expires.get(key) == deadline:
                self.remove(key)
        if len(heap) > 2 * len(self.expires) + 64:
            self._deadlines = [(deadline, key) for key, deadline in self.expires.items()]
            heapq.heapify(self._deadlines)

    def wall_time(self) -> float:
        return self._wall()

    def get(self, key: bytes) -> Value | None:
        value = self.data.get(key)
        if value is not None:
            deadline = self.expires.get(key)
            if deadline is not None and self.frozen_ms > deadline:
                self.remove(key)
                return None
        return value

    def _typed(self, key: bytes, kind: type[Value]) -> Any:
        value = self.get(key)
        if value is not None and type(value) is not kind:
            raise CommandError(WRONGTYPE)
        return value

    def get_string(self, key: bytes) -> bytes | None:
        value: bytes | None = self._typed(key, bytes)
        return value

    def get_hash(self, key: bytes, *, create: bool = False) -> dict[bytes, bytes]:
        """The hash at key; a missing one reads as empty (and is stored when create is set)."""
        value: dict[bytes, bytes] | None = self._typed(key, dict)
        if value is None:
            value = {}
            if create:
                self.data[bytes(key)] = value
        return value

    def get_zset(self, key: bytes, *, create: bool = False) -> SortedSet:
        """The sorted set at key; a missing one reads as empty (stored when create is set)."""
        value: SortedSet | None = self._typed(key, SortedSet)
        if value is None:
            value = SortedSet()
            if create:
                self.data[bytes(key)] = value
        return value

    def remove(self, key: bytes) -> bool:
        self.expires.pop(key, None)
        return self.data.pop(key, None) is not None

    def drop_if_empty(self, key: bytes) -> None:
        """Redis deletes a hash or sorted set when its last element goes."""
        value = self.data.get(key)
        if isinstance(value, dict | SortedSet) and not (
            value.scores if isinstance(value, SortedSet) else value
        ):
            self.remove(key)

    def pttl(self, key: bytes) -> int:
        if self.get(key) is None:
            return -2
        deadline = self.expires.get(key)
        return -1 if deadline is None else max(0, deadline - self.mono_ms)

    @property
    def wall_offset(self) -> int:
        """Unix ms less monotonic ms, fixed at the first command: PEXPIRETIME and PEXPIREAT
        turn deadlines into Unix times and back with it, so a time one reads, the other
        sets exactly (two clocks read separately would round a millisecond apart)."""
        if self._offset is None:
            self._offset = self.wall_ms - self.mono_ms
        return self._offset

    def expire_time(self, key: bytes) -> int:
        """PEXPIRETIME: the key's deadline as a Unix time in ms; -1 without one, -2 missing."""
        if self.get(key) is None:
            return -2
        deadline = self.expires.get(key)
        return -1 if deadline is None else deadline + self.wall_offset

    def expire_in(self, key: bytes, milliseconds: int) -> None:
        """Set the key's deadline ``milliseconds`` from now (the live clock)."""
        deadline = self.mono_ms + milliseconds
        self.expires[bytes(key)] = deadline
        heapq.heappush(self._deadlines, (deadline, bytes(key)))
