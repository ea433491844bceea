"""An independent reference model of aiolimit's decisions, in plain Python.

Written from the semantics stated in the algorithms issue, not from the Lua: the property test
(tests/test_property.py) compares every decision of the real limiter with this model. Times are
integer microseconds; the token bucket keeps its theoretical arrival time as an exact Fraction.

Every algorithm answers ``check(now, weight)`` with a ``Verdict`` (``weight`` 0 is the state as
it stands, which is what a refund replies), and has ``charge`` and ``refund``. ``Model`` applies
the rules of a limiter: identifier kinds, all or nothing (a refused call charges nothing, so
its pairs that had room report their state as it is), duplicates counted once, and each
identifier judged by max(now, its last write).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Protocol

from aiolimit import FixedWindow, Limit, MinInterval, SlidingLog, TokenBucket

US = 1_000_000


def to_us(seconds: float) -> int:
    return round(seconds * US)


@dataclass(frozen=True)
class Verdict:
    """One (identifier, limit) pair's answer, times in µs."""

    allowed: bool
    remaining: int
    retry_us: int
    reset_us: int


class Algorithm(Protocol):
    def check(self, now: int, weight: int) -> Verdict: ...
    def charge(self, now: int, weight: int) -> None: ...
    def refund(self, now: int, weight: int) -> None: ...


class Window:
    """Sliding window counter: ``n = ceil(per / p)`` epoch-aligned buckets of width ``p``."""

    def __init__(self, amount: int, per_us: int, precision_us: int) -> None:
        self.amount = amount
        self.p = precision_us
        self.n = -(-per_us // precision_us)
        self.buckets: dict[int, int] = {}

    def _live(self, now: int) -> list[tuple[int, int]]:
        """(bucket index, count) of the non-empty buckets in the window, oldest first."""
        current = now // self.p
        return sorted(
            (i, c) for i, c in self.buckets.items() if current - self.n < i <= current and c > 0
        )

    def _leaves(self, index: int) -> int:
        return (index + self.n) * self.p

    def check(self, now: int, weight: int) -> Verdict:
        live = self._live(now)
        count = sum(c for _, c in live)
        if count + weight <= self.amount:
            if weight > 0:
                reset = self._leaves(now // self.p) - now
            else:
                reset = self._leaves(live[-1][0]) - now if live else 0
            return Verdict(True, self.amount - count - weight, 0, reset)
        freed = 0
        retry = None
        for index, c in live:
            freed += c
            if count - freed + weight <= self.amount:
                retry = self._leaves(index) - now
                break
        assert retry is not None, "a weight above the amount is refused before any call"
        reset = self._leaves(live[-1][0]) - now
        return Verdict(False, max(self.amount - count, 0), retry, reset)

    def charge(self, now: int, weight: int) -> None:
        current = now // self.p
        self.buckets[current] = self.buckets.get(current, 0) + weight

    def refund(self, now: int, weight: int) -> None:
        for index, c in reversed(self._live(now)):
            take = min(c, weight)
            self.buckets[index] = c - take
            weight -= take
            if weight == 0:
                break


class Log:
    """Sliding log: every admitted unit logged at its time; the window is (now - per, now]."""

    def __init__(self, amount: int, per_us: int) -> None:
        self.amount = amount
        self.per = per_us
        self.units: list[int] = []  # admission times, oldest first

    def _window(self, now: int) -> list[int]:
        return [t for t in self.units if now - self.per < t <= now]

    def check(self, now: int, weight: int) -> Verdict:
        window = self._window(now)
        count = len(window)
        if count + weight <= self.amount:
            if weight > 0:
                reset = self.per
            else:
                reset = window[-1] + self.per - now if window else 0
            return Verdict(True, self.amount - count - weight, 0, reset)
        retry = window[count + weight - self.amount - 1] + self.per - now
        reset = window[-1] + self.per - now
        return Verdict(False, max(self.amount - count, 0), retry, reset)

    def charge(self, now: int, weight: int) -> None:
        self.units.extend([now] * weight)

    def refund(self, now: int, weight: int) -> None:
        del self.units[max(len(self.units) - weight, 0) :]


class Bucket:
    """GCRA: emission interval T = per / rate, tolerance tau = burst * T, exact rationals."""

    def __init__(self, rate: int, per_us: int, burst: int) -> None:
        self.interval = Fraction(per_us, rate)
        self.tau = burst * self.interval
        self.tat: Fraction | None = None  # theoretical arrival time; None: never charged

    def _base(self, now: int) -> Fraction:
        return max(self.tat, Fraction(now)) if self.tat is not None else Fraction(now)

    def check(self, now: int, weight: int) -> Verdict:
        base = self._base(now)
        new_tat = base + weight * self.interval
        if new_tat - now <= self.tau:
            remaining = math.floor((self.tau - (new_tat - now)) / self.interval)
            return Verdict(True, remaining, 0, math.ceil(new_tat - now))
        retry = math.ceil(new_tat - self.tau - now)
        remaining = max(math.floor((self.tau - (base - now)) / self.interval), 0)
        return Verdict(False, remaining, retry, math.ceil(base - now))

    def charge(self, now: int, weight: int) -> None:
        self.tat = self._base(now) + weight * self.interval

    def refund(self, now: int, weight: int) -> None:
        self.tat = max(self._base(now) - weight * self.interval, Fraction(now))


def algorithm_for(limit: Any) -> Algorithm:
    """A fresh model of one limit, from its public attributes."""
    if isinstance(limit, Limit):
        return Window(limit.amount, to_us(limit.per), to_us(limit.precision or limit.per))
    if isinstance(limit, FixedWindow):
        return Window(limit.amount, to_us(limit.per), to_us(limit.per))
    if isinstance(limit, SlidingLog):
        return Log(limit.amount, to_us(limit.per))
    if isinstance(limit, TokenBucket):
        burst = limit.rate if limit.burst is None else limit.burst
        return Bucket(limit.rate, to_us(limit.per), burst)
    if isinstance(limit, MinInterval):
        return Bucket(1, to_us(limit.seconds), 1)
    raise TypeError(f"no reference model for {limit!r}")


@dataclass(frozen=True)
class Outcome:
    """A whole call: all or nothing, and every pair's verdict in call order."""

    allowed: bool
    pairs: tuple[tuple[str, Verdict], ...]


class Model:
    """The reference limiter: rules per identifier kind (``"*"`` the default)."""

    def __init__(self, rules: Mapping[str, Sequence[Any]]) -> None:
        self.rules = {kind: tuple(limits) for kind, limits in rules.items()}
        self.state: dict[str, list[Algorithm]] = {}
        self.written: dict[str, int] = {}  # identifier -> the last time it was written

    def limits_for(self, identifier: str) -> tuple[Any, ...]:
        kind = identifier.partition(":")[0]
        return self.rules[kind] if kind in self.rules else self.rules["*"]

    def _pairs(self, ids: Sequence[str]) -> list[tuple[str, int, Algorithm]]:
        pairs = []
        for identifier in dict.fromkeys(ids):  # duplicates count once, order kept
            algorithms = self.state.get(identifier)
            if algorithms is None:
                algorithms = [algorithm_for(limit) for limit in self.limits_for(identifier)]
                self.state[identifier] = algorithms
            now = self.written.get(identifier, 0)
            pairs += [(identifier, now, algorithm) for algorithm in algorithms]
        return pairs

    def max_weight(self, ids: Sequence[str]) -> int:
        """The largest weight a call on ``ids`` may ask for."""
        return min(
            getattr(limit, "burst", None) or getattr(limit, "amount", 1)
            for identifier in ids
            for limit in self.limits_for(identifier)
        )

    def _verdicts(self, ids: Sequence[str], now: int, weight: int) -> Outcome:
        pairs = self._pairs(ids)
        verdicts = [algorithm.check(max(now, written), weight) for _, written, algorithm in pairs]
        allowed = all(v.allowed for v in verdicts)
        if not allowed:
            # Nothing is charged, so the pairs that had room report their state as it is.
            verdicts = [
                v if not v.allowed else algorithm.check(max(now, written), 0)
                for v, (_, written, algorithm) in zip(verdicts, pairs, strict=True)
            ]
        return Outcome(allowed, tuple((p[0], v) for p, v in zip(pairs, verdicts, strict=True)))

    def peek(self, ids: Sequence[str], weight: int, now: int) -> Outcome:
        """Whether ``weight`` would pass, with every pair's state now (nothing charged)."""
        outcome = self._verdicts(ids, now, weight)
        if not outcome.allowed or weight == 0:
            return outcome  # a refusal already reports the state as it is
        pairs = self._pairs(ids)
        verdicts = [algorithm.check(max(now, written), 0) for _, written, algorithm in pairs]
        return Outcome(True, tuple((p[0], v) for p, v in zip(pairs, verdicts, strict=True)))

    def acquire(self, ids: Sequence[str], weight: int, now: int) -> Outcome:
        outcome = self._verdicts(ids, now, weight)
        if outcome.allowed:
            for _, written, algorithm in self._pairs(ids):
                algorithm.charge(max(now, written), weight)
            self._touch(ids, now)
        return outcome

    def refund(self, ids: Sequence[str], weight: int, now: int) -> Outcome:
        """Gives ``weight`` back on every pair; answers with the state after it."""
        for _, written, algorithm in self._pairs(ids):
            algorithm.refund(max(now, written), weight)
        self._touch(ids, now)
        return self._verdicts(ids, now, 0)

    def _touch(self, ids: Sequence[str], now: int) -> None:
        for identifier in ids:
            self.written[identifier] = max(now, self.written.get(identifier, 0))
