"""Input validation at the boundary: one message style, one set of bounds.

Every check names the argument, says what is allowed, and shows what it got::

    Limit amount must be an int, got 2.5
    deadline must be None or more than 0 and at most 3600 seconds, got nan

Configuration (given once, to a constructor) raises ``ConfigurationError``; the arguments of
one call raise ``InvalidRequestError``. Both are ``ValueError`` too, and both mean nothing
was sent or stored.
"""

from __future__ import annotations

import math

from aiolimit._errors import ConfigurationError, InvalidRequestError

#: The largest amount a limit may have, and the largest weight one call may carry: Lua
#: numbers are doubles, exact up to 2**53, and every sum the scripts make stays below that.
MAX_AMOUNT = 10**12
#: The longest window or wait anything is configured with: ten years, in seconds.
MAX_SECONDS = 10 * 366 * 86400.0

ErrorType = type[ConfigurationError] | type[InvalidRequestError]


def _describe(value: object) -> str:
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return text


def _range_text(low: float, high: float, *, open_low: bool) -> str:
    if open_low:
        return f"more than {low:g} and at most {high:g} seconds"
    return f"between {low:g} and {high:g} seconds"


def check_int(
    name: str, value: object, low: int, high: int, *, error: ErrorType = ConfigurationError
) -> int:
    """An int (not a bool) with ``low <= value <= high``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(f"{name} must be an int, got {_describe(value)}")
    if not low <= value <= high:
        raise error(f"{name} must be an int in {low}..{high}, got {value}")
    return value


def check_seconds(
    name: str,
    value: object,
    low: float,
    high: float,
    *,
    open_low: bool = False,
    allow_none: bool = False,
    error: ErrorType = ConfigurationError,
) -> float:
    """A finite number of seconds in ``[low, high]`` (``(low, high]`` with ``open_low``)."""
    prefix = "None or " if allow_none else ""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise error(f"{name} must be {prefix}a number of seconds, got {_describe(value)}")
    # (an int is finite; math.isfinite of one too large for a float raises OverflowError)
    finite = isinstance(value, int) or math.isfinite(value)
    if not (finite and (value > low if open_low else value >= low) and value <= high):
        bounds = _range_text(low, high, open_low=open_low)
        raise error(f"{name} must be {prefix}{bounds}, got {_describe(value)}")
    return float(value)


def check_optional_seconds(
    name: str,
    value: object,
    low: float,
    high: float,
    *,
    open_low: bool = False,
    error: ErrorType = ConfigurationError,
) -> float | None:
    """Like ``check_seconds``, or None."""
    if value is None:
        return None
    return check_seconds(name, value, low, high, open_low=open_low, allow_none=True, error=error)


def check_number(
    name: str, value: object, low: float, high: float, *, error: ErrorType = ConfigurationError
) -> float:
    """A finite number (not a bool) in ``[low, high]``."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not (isinstance(value, int) or math.isfinite(value))
        or not low <= value <= high
    ):
        raise error(f"{name} must be a number in [{low:g}, {high:g}], got {_describe(value)}")
    return float(value)


def check_bool(name: str, value: object, *, error: ErrorType = ConfigurationError) -> bool:
    if not isinstance(value, bool):
        raise error(f"{name} must be True or False, got {_describe(value)}")
    return value


def check_weight(value: object, high: int | None = MAX_AMOUNT) -> int:
    """A call's weight: a positive int, at most ``high`` (None: the caller bounds it)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        bound = "" if high is None else f" <= {high}"
        raise InvalidRequestError(f"weight must be a positive int{bound}, got {_describe(value)}")
    if high is not None and value > high:
        raise InvalidRequestError(f"weight must be a positive int <= {high}, got {value}")
    return value
