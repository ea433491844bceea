"""Numbers as Redis reads and writes them, for the embedded engine's commands.

Redis 7.0's own rules, because the same Lua must behave the same on both backends: strict
integers (``string2ll``), C ``strtod`` floats for scores and score bounds, and ``%.17g``
scores in replies.
"""

from __future__ import annotations

import math
import re

from .keyspace import CommandError

LLONG_MAX = 2**63 - 1
LLONG_MIN = -(2**63)
NOT_INTEGER = "ERR value is not an integer or out of range"
_C_SPACE = b" \t\n\v\f\r"
_INTEGER = re.compile(rb"0|-?[1-9][0-9]{0,18}")
# What C's strtod accepts: hex floats, decimals, inf/infinity, nan(...), case-insensitive.
_NUMBER = re.compile(
    rb"([+-]?)(?:0x(?P<hex>[0-9a-f]+\.?[0-9a-f]*|\.[0-9a-f]+)(?:p[+-]?[0-9]+)?"
    rb"|(?P<dec>[0-9]+\.?[0-9]*|\.[0-9]+)(?:e[+-]?[0-9]+)?"
    rb"|(?P<inf>inf(?:inity)?)|(?P<nan>nan(?:\([0-9a-z_]*\))?))",
    re.IGNORECASE,
)


def int_arg(raw: bytes, error: str = NOT_INTEGER) -> int:
    """A command's integer argument (``string2ll``: "01", "+1", " 1" and "-0" are refused)."""
    if _INTEGER.fullmatch(raw) is None or not LLONG_MIN <= (value := int(raw)) <= LLONG_MAX:
        raise CommandError(error)
    return value


def _to_float(match: re.Match[bytes]) -> float:
    if match["inf"]:
        return -math.inf if match[1] == b"-" else math.inf
    if match["nan"]:
        return math.nan
    if match["dec"] is not None:
        return float(match[0])
    try:
        return float.fromhex(match[0].decode())
    except OverflowError:
        return -math.inf if match[1] == b"-" else math.inf


def parse_double(raw: bytes) -> float | None:
    """Redis' getDoubleFromObject: the whole string, no NaN, no overflow or underflow to 0."""
    match = _NUMBER.fullmatch(raw)
    if match is None:
        return None
    value = _to_float(match)
    underflow = value == 0 and bool((match["hex"] or match["dec"] or b"").strip(b"0."))
    out_of_range = (math.isinf(value) and not match["inf"]) or underflow
    return None if math.isnan(value) or out_of_range else value


def parse_range_bound(raw: bytes) -> tuple[float, bool] | None:
    """A score bound: "(" means exclusive; bare strtod on a C string ("" is 0)."""
    exclusive = raw.startswith(b"(")
    body = (raw[1:] if exclusive else raw).split(b"\0", 1)[0]
    if not body:
        return 0.0, exclusive
    match = _NUMBER.fullmatch(body.lstrip(_C_SPACE))
    value = math.nan if match is None else _to_float(match)
    return None if math.isnan(value) else (value, exclusive)


def format_double(value: float) -> bytes:
    """Redis 7.0's addReplyDouble: "%.17g" (so 0.1 reads 0.10000000000000001)."""
    if math.isinf(value):
        return b"inf" if value > 0 else b"-inf"
    return b"%.17g" % value
