"""The algorithms beside the default sliding window counter (``Limit``).

Each is a frozen value judged by a file in ``lua/``; any mix of them can govern one identifier
kind, and one call decides over all of them at once, all or nothing. Like ``Limit`` each knows
its wire form for the scripts, the largest weight it could ever admit, its storage identity
(two limits of one rule may not share storage), and, for those with a structure of their own,
the suffix of its aux key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from aiolimit._errors import ConfigurationError
from aiolimit._limits import BaseLimit, _check_amount, _check_seconds, _seconds_text, _us
from aiolimit._validation import check_int

#: The largest Concurrency max (one sorted-set entry per unit in flight; see Concurrency).
MAX_CONCURRENCY = 1_000
#: The largest SlidingLog amount (one sorted-set entry per admitted request).
MAX_LOG_AMOUNT = 1_000_000
# GCRA compares values scaled by the rate; (burst + weight) * period must stay exact in a double.
_EXACT = 2**52


def max_exact_burst(period_us: int) -> int:
    """The largest TokenBucket burst whose sums stay exact with a period of ``period_us``."""
    return (_EXACT // 2 - 1) // period_us  # 2 * burst * period < _EXACT


@dataclass(frozen=True, slots=True)
class FixedWindow(BaseLimit):
    """At most ``amount`` per calendar-aligned window of ``per`` seconds.

    Windows start at multiples of ``per`` since the epoch (a minute window starts on the
    minute). Unlike ``limits``, envoy or express-rate-limit, refused requests are not counted.
    A burst at the end of one window and the start of the next can pass twice the amount in a
    short time; use ``Limit(..., precision=...)`` or ``SlidingLog`` where that matters.
    """

    amount: int
    per: float
    _wire: tuple[str, int, int, int] = field(init=False, repr=False, compare=False)

    algorithm: ClassVar[str] = "fw"

    def __post_init__(self) -> None:
        _check_amount("FixedWindow", self.amount)
        per = _check_seconds("FixedWindow", "per", self.per)
        object.__setattr__(self, "per", per)
        object.__setattr__(self, "_wire", ("fw", self.amount, _us(per), _us(per)))

    @property
    def storage(self) -> tuple[str, int]:
        return ("f", self._wire[2])

    def __str__(self) -> str:
        return f"{self.amount}/{_seconds_text(self.per)} (fixed window)"


@dataclass(frozen=True, slots=True)
class SlidingLog(BaseLimit):
    """At most ``amount`` in any ``per`` seconds, exactly: every admitted request is logged.

    An admitted request is one ZSET entry whatever its weight, holding the running total, so
    at most ``amount`` entries per identifier hold counted units and every call costs
    O(log n), late undos and large refunds included (what they credit is kept as ranges of
    unit numbers; the entries they empty are deleted at most 128 per call); entries older
    than ``per`` are dropped as calls come. The most exact algorithm, and the most
    memory: prefer ``Limit`` with a fine precision for large amounts.
    """

    amount: int
    per: float
    _wire: tuple[str, int, int, int] = field(init=False, repr=False, compare=False)

    algorithm: ClassVar[str] = "log"

    def __post_init__(self) -> None:
        _check_amount("SlidingLog", self.amount)
        if self.amount > MAX_LOG_AMOUNT:
            raise ConfigurationError(
                f"SlidingLog stores up to one entry per unit: amount must be <= {MAX_LOG_AMOUNT}, "
                f"got {self.amount} (use Limit with a precision for large amounts)"
            )
        per = _check_seconds("SlidingLog", "per", self.per)
        object.__setattr__(self, "per", per)
        object.__setattr__(self, "_wire", ("log", self.amount, _us(per), 0))

    @property
    def aux_suffix(self) -> str:
        return f"log:{self._wire[2]}"

    @property
    def storage(self) -> tuple[str, int]:
        return ("log", self._wire[2])

    def __str__(self) -> str:
        return f"{self.amount}/{_seconds_text(self.per)} (sliding log)"


@dataclass(frozen=True, slots=True)
class TokenBucket(BaseLimit):
    """``rate`` units refill every ``per`` seconds, up to ``burst`` (default: ``rate``).

    Implemented as GCRA: one stored timestamp per identifier, refill exact over any run (kept
    as a rational, never rounded), ``retry_after`` exact to the microsecond. With
    ``acquire(..., timeout=...)`` waiters reserve their turn in arrival order instead of all
    retrying at once.
    """

    rate: int
    per: float = 1.0
    burst: int | None = None
    _wire: tuple[str, int, int, int] = field(init=False, repr=False, compare=False)

    algorithm: ClassVar[str] = "gcra"

    def __post_init__(self) -> None:
        _check_amount("TokenBucket rate", self.rate)
        per = _check_seconds("TokenBucket", "per", self.per)
        burst = self.rate if self.burst is None else self.burst
        _check_amount("TokenBucket burst", burst)
        period = _us(per)
        if burst > max_exact_burst(period):
            raise ConfigurationError(
                f"TokenBucket burst x per is too large to be exact: burst={burst}, per={per}s "
                f"(keep burst * per below {_EXACT // 2 // 1_000_000} unit-seconds)"
            )
        object.__setattr__(self, "per", per)
        object.__setattr__(self, "burst", burst)
        object.__setattr__(self, "_wire", ("gcra", burst, period, self.rate))

    @property
    def amount(self) -> int:
        """The bucket's capacity (its burst), for headers and messages."""
        return self._wire[1]

    @property
    def storage(self) -> tuple[str, int, int, int]:
        return ("g", self._wire[2], self._wire[3], self._wire[1])

    def __str__(self) -> str:
        return f"{self.rate}/{_seconds_text(self.per)} (token bucket, burst {self.burst})"


@dataclass(frozen=True, slots=True)
class MinInterval(BaseLimit):
    """At least ``seconds`` between two admitted requests of an identifier.

    GCRA with a burst of 1 (a token bucket of one token refilled every ``seconds``); its weight
    can only be 1.
    """

    seconds: float
    _wire: tuple[str, int, int, int] = field(init=False, repr=False, compare=False)

    algorithm: ClassVar[str] = "gcra"

    def __post_init__(self) -> None:
        seconds = _check_seconds("MinInterval", "seconds", self.seconds)
        object.__setattr__(self, "seconds", seconds)
        object.__setattr__(self, "_wire", ("gcra", 1, _us(seconds), 1))

    @property
    def amount(self) -> int:
        return 1

    @property
    def per(self) -> float:
        return self.seconds

    @property
    def storage(self) -> tuple[str, int, int, int]:
        return ("g", self._wire[2], 1, 1)

    def __str__(self) -> str:
        return f"at least {self.seconds:g}s apart"


@dataclass(frozen=True, slots=True)
class Concurrency(BaseLimit):
    """At most ``max`` requests in flight per identifier (leases), ``max`` up to 1,000.

    Each unit in flight is one entry of a sorted set, so one call's cost follows its weight;
    the cap keeps any call under a millisecond of Redis time.

    Admission takes a lease that must be released: ``async with limiter.limit(ids)`` does it on
    exit (also on error and cancellation); ``try_acquire``/``acquire`` return the lease as
    ``decision.lease`` for you to ``await lease.release()``. A holder that dies is released
    when its lease expires after ``lease_ttl`` seconds; long holders ``await lease.renew()``.
    """

    max: int
    lease_ttl: float = 60.0
    _wire: tuple[str, int, int, int] = field(init=False, repr=False, compare=False)

    algorithm: ClassVar[str] = "lease"

    def __post_init__(self) -> None:
        check_int("Concurrency max", self.max, 1, MAX_CONCURRENCY)
        ttl = _check_seconds("Concurrency", "lease_ttl", self.lease_ttl)
        object.__setattr__(self, "lease_ttl", ttl)
        object.__setattr__(self, "_wire", ("lease", self.max, _us(ttl), 0))

    @property
    def amount(self) -> int:
        return self.max

    @property
    def per(self) -> float:
        return self.lease_ttl

    @property
    def storage(self) -> tuple[str]:
        return ("lease",)

    @property
    def aux_suffix(self) -> str:
        return "lease"

    def __str__(self) -> str:
        return f"at most {self.max} in flight (lease {self.lease_ttl:g}s)"
