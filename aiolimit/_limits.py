"""Limits: what each (identifier, limit) pair allows.

A limit is a frozen value. It knows how to describe itself to the Lua scripts (`wire`), which
algorithm code in ``lua/`` judges it, and the largest weight it could ever admit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from aiolimit._errors import ConfigurationError
from aiolimit._validation import MAX_AMOUNT, MAX_SECONDS, check_int, check_seconds

# Units of a limit string. Weeks, months and years are fixed lengths, not calendar ones: a
# month is 30 days and a year 365 days (as `limits` counts them), and "m" is a minute.
_UNITS = {
    "s": 1, "sec": 1, "secs": 1, "second": 1, "seconds": 1,
    "m": 60, "min": 60, "mins": 60, "minute": 60, "minutes": 60,
    "h": 3600, "hr": 3600, "hrs": 3600, "hour": 3600, "hours": 3600,
    "d": 86400, "day": 86400, "days": 86400,
    "w": 604800, "wk": 604800, "week": 604800, "weeks": 604800,
    "mo": 2592000, "month": 2592000, "months": 2592000,
    "y": 31536000, "yr": 31536000, "year": 31536000, "years": 31536000,
}  # fmt: skip
GRAMMAR = (
    "'<amount>/<unit>', '<amount>/<n><unit>' or '<amount> per [<n>] <unit>', several joined by "
    "';' or ',' (e.g. '10/second;100/minute'); units: second, minute, hour, day, week (7 days), "
    "month (30 days), year (365 days), also s, sec, m, min, h, hr, d, w, mo, y and plurals"
)
_PARSE = re.compile(
    r"^\s*(?P<amount>\d+)\s*(?:/|per)\s*(?P<count>\d+(?:\.\d+)?)?\s*(?P<unit>[a-z]+)\s*$",
    re.IGNORECASE,
)
MAX_PERIOD = MAX_SECONDS  # ten years
MIN_PERIOD = 0.001
# A sliding window's buckets per window. Each call searches them in O(log n), but its field
# (~10-25 bytes a bucket) is still read and written whole: this keeps one call well under 1 ms.
MAX_BUCKETS = 10_000


def _seconds_text(seconds: float) -> str:
    for name, size in (("day", 86400), ("hour", 3600), ("minute", 60), ("second", 1)):
        if seconds == size:
            return name
        if seconds % size == 0:
            return f"{int(seconds // size)} {name}s"
    return f"{seconds:g} seconds"


def _check_amount(kind: str, amount: object) -> int:
    return check_int(f"{kind} amount", amount, 1, MAX_AMOUNT)


def _check_seconds(kind: str, name: str, value: object, *, upper: float = MAX_PERIOD) -> float:
    return check_seconds(f"{kind} {name}", value, MIN_PERIOD, upper)


def _us(seconds: float) -> int:
    return round(seconds * 1_000_000)


class BaseLimit:
    """What every limit type shares; ``Decision.limit`` and ``PairDecision.limit`` are one.

    Every limit says how much it admits (``amount``) per how many seconds (``per``): the
    ``RateLimit-Policy`` header's quota and window. Its ``wire`` form is what the Lua scripts
    judge it by, ``storage`` what it stores under (two limits of one rule may not share it),
    and ``aux_suffix`` names the key of its own for algorithms that keep a structure apart
    from the identifier's hash (None for the others). The limit types are the ones aiolimit
    ships, each judged by a file in ``lua/``; this base is for typing and ``isinstance``.
    """

    __slots__ = ()
    _wire: tuple[str, int, int, int]

    if TYPE_CHECKING:

        @property
        def amount(self) -> int:
            """The most it admits within ``per`` seconds (a bucket's burst, a pool's size)."""

        @property
        def per(self) -> float:
            """Its window in seconds."""

        @property
        def storage(self) -> tuple[str | int, ...]:
            """What it stores under."""

    @property
    def wire(self) -> tuple[str, int, int, int]:
        """(algorithm code, amount, period µs, parameter) as the Lua scripts take them."""
        return self._wire

    @property
    def max_weight(self) -> int:
        """The largest weight this limit could ever admit in one call."""
        return self._wire[1]

    @property
    def aux_suffix(self) -> str | None:
        """The suffix of its aux key, for algorithms with a structure of their own."""
        return None


@dataclass(frozen=True, slots=True)
class Limit(BaseLimit):
    """At most ``amount`` units per ``per`` seconds: a sliding window counter.

    The window is made of buckets ``precision`` seconds wide (default: ``per``, which makes it
    a calendar-aligned fixed window). ``Limit(240, per=3600, precision=60)`` counts the last 60
    one-minute buckets, so a burst at the end of one hour cannot be repeated at the start of the
    next. Finer precision is more exact and stores more buckets: at most ``MAX_BUCKETS``
    (10,000) per window, so one call's cost stays bounded.
    """

    amount: int
    per: float
    precision: float | None = None
    _wire: tuple[str, int, int, int] = field(init=False, repr=False, compare=False)

    algorithm: ClassVar[str] = "sw"

    def __post_init__(self) -> None:
        _check_amount("Limit", self.amount)
        per = _check_seconds("Limit", "per", self.per)
        precision = per
        if self.precision is not None:
            precision = _check_seconds("Limit", "precision", self.precision, upper=per)
        buckets = -(-_us(per) // _us(precision))  # ceil, as lua/sliding_window.lua counts them
        if buckets > MAX_BUCKETS:
            raise ConfigurationError(
                f"Limit precision {precision:g}s makes {buckets} buckets of per={per:g}s; at most "
                f"{MAX_BUCKETS} are allowed (precision >= per / {MAX_BUCKETS}), so that one call's "
                "cost stays bounded (use SlidingLog for an exact window)"
            )
        object.__setattr__(self, "per", per)
        object.__setattr__(self, "precision", precision)
        object.__setattr__(self, "_wire", ("sw", self.amount, _us(per), _us(precision)))

    @classmethod
    def parse(cls, text: str) -> Limit:
        """One limit: ``"10/second"``, ``"120/minute"``, ``"240 per hour"``, ``"5/10s"``,
        ``"1000/day"``, ``"10000/week"``. For several in one string see ``parse_limits``."""
        match = _PARSE.match(text) if isinstance(text, str) else None
        unit = _UNITS.get(match["unit"].lower()) if match else None
        if match is None or unit is None:
            raise ConfigurationError(f"cannot parse limit {text!r}; expected {GRAMMAR}")
        try:
            count = float(match["count"]) if match["count"] else 1.0
            amount = int(match["amount"])
        except ValueError as exc:  # past int()'s 4300 digits
            raise ConfigurationError(f"cannot parse limit {text[:60]!r}...: {exc}") from exc
        return cls(amount, per=count * unit)

    @property
    def storage(self) -> tuple[str, int, int]:
        """What it stores under; two limits of one rule may not share it."""
        return ("w", self._wire[2], self._wire[3])

    def __str__(self) -> str:
        text = f"{self.amount}/{_seconds_text(self.per)}"
        if self.precision != self.per:
            text += f" (precision {self.precision:g}s)"
        return text


def parse_limits(text: str) -> tuple[Limit, ...]:
    """Several limits in one string, as users of other limiters write them:
    ``"10/second;100/minute"``, ``"5 per second, 1000 per day"``. Each part is read by
    ``Limit.parse``; an empty part or a bad one fails with the grammar in the message."""
    if not isinstance(text, str):
        raise ConfigurationError(f"a limit string must be text, got {text!r}; expected {GRAMMAR}")
    parts = re.split(r"[;,]", text)
    if not text.strip() or any(not part.strip() for part in parts):
        raise ConfigurationError(f"cannot parse limits {text!r}: an empty part; expected {GRAMMAR}")
    return tuple(Limit.parse(part) for part in parts)
