"""Numbers as Redis reads and writes them, for the embedded backend's commands.

Redis 7.0's own rules, because the same Lua must behave the same on both backends: strict
integers (``string2ll``), C ``strtod`` floats, ``long double`` INCRBYFLOAT (``string2ld`` and
``ld2string``) and ``%.17g`` scores. ``tests/test_embedded_store.py`` checks them against a
real server.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

from .replies import NOT_INTEGER, CommandError

LLONG_MAX = 2**63 - 1
LLONG_MIN = -(2**63)
_C_SPACE = b" \t\n\v\f\r"
_INTEGER = re.compile(rb"0|-?[1-9][0-9]{0,18}")
# What C's strtod accepts: hex floats, decimals, inf/infinity, nan(...), case-insensitive.
_NUMBER = re.compile(
    rb"([+-]?)(?:0x(?P<hex>[0-9a-f]+\.?[0-9a-f]*|\.[0-9a-f]+)(?:p(?P<bexp>[+-]?[0-9]+))?"
    rb"|(?P<dec>[0-9]+\.?[0-9]*|\.[0-9]+)(?:e(?P<dexp>[+-]?[0-9]+))?"
    rb"|(?P<inf>inf(?:inity)?)|(?P<nan>nan(?:\([0-9a-z_]*\))?))",
    re.IGNORECASE,
)
_LONG_DOUBLE_BITS = 64  # x86-64 long double: 64-bit significand, as Redis is usually built
_LONG_DOUBLE_QUANTUM = 16445  # the smallest subnormal is 2**-16445
_LONG_DOUBLE_LIMIT = Fraction(2) ** 16384


def parse_int(raw: bytes) -> int | None:
    """Redis' string2ll: canonical decimals only ("01", "+1", " 1" and "-0" are refused)."""
    if _INTEGER.fullmatch(raw) is None:
        return None
    value = int(raw)
    return value if LLONG_MIN <= value <= LLONG_MAX else None


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


def _nonzero_mantissa(match: re.Match[bytes]) -> bool:
    return bool((match["hex"] or match["dec"] or b"").strip(b"0."))


def parse_double(raw: bytes) -> float | None:
    """Redis' getDoubleFromObject: the whole string, no NaN, no overflow or underflow to 0."""
    match = _NUMBER.fullmatch(raw)
    if match is None:
        return None
    value = _to_float(match)
    out_of_range = (math.isinf(value) and not match["inf"]) or (
        value == 0 and _nonzero_mantissa(match)
    )
    return None if math.isnan(value) or out_of_range else value


def parse_range_bound(raw: bytes) -> tuple[float, bool] | None:
    """A ZRANGEBYSCORE bound: "(" means exclusive; bare strtod on a C string ("" is 0)."""
    exclusive = raw.startswith(b"(")
    body = (raw[1:] if exclusive else raw).split(b"\0", 1)[0]
    if not body:
        return 0.0, exclusive
    match = _NUMBER.fullmatch(body.lstrip(_C_SPACE))
    value = math.nan if match is None else _to_float(match)
    return None if math.isnan(value) else (value, exclusive)


def _round_long_double(value: Fraction) -> Fraction | None:
    """Round to the nearest long double (ties to even); None when it overflows."""
    if value == 0:
        return value
    numerator, denominator = abs(value.numerator), value.denominator
    exponent = numerator.bit_length() - denominator.bit_length()
    if numerator << max(-exponent, 0) >= denominator << max(exponent, 0):
        exponent += 1  # now 2**(exponent-1) <= |value| < 2**exponent
    shift = min(_LONG_DOUBLE_BITS - exponent, _LONG_DOUBLE_QUANTUM)
    scale = Fraction(2) ** shift
    rounded = Fraction(round(abs(value) * scale)) / scale
    if rounded >= _LONG_DOUBLE_LIMIT:
        return None
    return rounded if value > 0 else -rounded


def parse_long_double(raw: bytes) -> Fraction | float | None:
    """Redis' string2ld (strtold on the whole string): an exact long double, or +-inf."""
    match = _NUMBER.fullmatch(raw) if len(raw) < 5120 else None
    if match is None or match["nan"]:
        return None
    if match["inf"]:
        return _to_float(match)
    if match["dec"] is not None:
        whole, _, fraction = match["dec"].partition(b".")
        digits, base = (whole + fraction).lstrip(b"0"), 10
        exponent = int(match["dexp"] or 0) - len(fraction)
        if len(digits) > 1000:  # far past the 64 bits that matter; keep a sticky digit
            exponent += len(digits) - 1001
            digits = digits[:1000] + (b"1" if digits[1000:].strip(b"0") else b"0")
        magnitude, limits = len(digits) + exponent, (-4960, 4940)
        mantissa = int(digits or b"0")
    else:
        whole, _, fraction = match["hex"].partition(b".")
        mantissa, base = int(whole + fraction, 16), 2
        exponent = int(match["bexp"] or 0) - 4 * len(fraction)
        magnitude, limits = mantissa.bit_length() + exponent, (-16500, 16400)
    if magnitude > limits[1]:
        return None
    exact = (
        Fraction(0)
        if mantissa == 0 or magnitude < limits[0]
        else mantissa * Fraction(base) ** exponent
    )
    value = _round_long_double(exact)
    if value is None or (value == 0 and _nonzero_mantissa(match)):
        return None
    return -value if match[1] == b"-" else value


def long_double_add(left: Fraction | float, right: Fraction | float) -> Fraction | None:
    """The long double sum, or None when it is NaN or infinite."""
    if isinstance(left, float) or isinstance(right, float):
        return None
    return _round_long_double(left + right)


def _digits(number: int) -> str:
    if number < 10**4000:  # str() refuses more than 4300 digits
        return str(number)
    high, low = divmod(number, 10**2000)
    return _digits(high) + str(low).rjust(2000, "0")


def format_long_double(value: Fraction) -> bytes:
    """Redis' ld2string(LD_STR_HUMAN): "%.17Lf" without trailing zeros, and never "-0"."""
    scaled = round(value * 10**17)
    digits = _digits(abs(scaled)).rjust(18, "0")
    whole, fraction = digits[:-17], digits[-17:].rstrip("0")
    result = ("-" if scaled < 0 else "") + whole + ("." + fraction if fraction else "")
    return result.encode()


def format_double(value: float) -> bytes:
    """Redis 7.0's addReplyDouble: "%.17g" (so 0.1 reads 0.10000000000000001)."""
    if math.isinf(value):
        return b"inf" if value > 0 else b"-inf"
    return b"%.17g" % value


def int_arg(raw: bytes, error: str = NOT_INTEGER) -> int:
    """A command's integer argument, or the command fails with ``error``."""
    value = parse_int(raw)
    if value is None:
        raise CommandError(error)
    return value
