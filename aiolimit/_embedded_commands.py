"""Redis command semantics for the embedded backend: numbers, sorted sets and the handlers.

Each handler keeps Redis 7.0's replies and errors, including its number rules (strict
integers, C ``strtod`` floats, ``long double`` INCRBYFLOAT, ``%.17g`` scores), because the
same Lua must behave the same on both backends; ``tests/test_embedded_store.py`` checks this
against a real server. The keys, their values and deadlines live in ``_embedded_store``'s
``Keyspace``; handlers reach them through it.
"""

from __future__ import annotations

import math
import re
from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    from aiolimit._embedded_store import Keyspace

Reply: TypeAlias = "int | bytes | list[Reply] | None"
Handler: TypeAlias = "Callable[[Keyspace, Sequence[bytes]], Reply]"

WRONGTYPE = "WRONGTYPE Operation against a key holding the wrong kind of value"
NOT_INTEGER = "ERR value is not an integer or out of range"
NOT_FLOAT = "ERR value is not a valid float"
SYNTAX = "ERR syntax error"

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


class CommandError(Exception):
    """A command failed; the message is Redis' error line, for example ``ERR syntax error``."""


class Status(bytes):
    """A status reply (``+OK``), which scripts see as ``{ok = ...}`` rather than a string."""


def text(raw: bytes) -> str:
    """User bytes inside an error message, reversibly (surrogateescape)."""
    return raw.decode("utf-8", "surrogateescape")


def int_arg(raw: bytes, error: str = NOT_INTEGER) -> int:
    value = parse_int(raw)
    if value is None:
        raise CommandError(error)
    return value


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


COMMANDS: dict[bytes, tuple[Handler, int, bool, str]] = {}


def command(name: str, arity: int, *, writes: bool = False) -> Callable[[Handler], Handler]:
    """Register a handler under its Redis name and arity (negative: at least that many)."""

    def register(handler: Handler) -> Handler:
        COMMANDS[name.encode()] = (handler, arity, writes, name)
        return handler

    return register


# ---------------------------------------------------------------------------- keyspace


@command("ping", -1)
def _ping(ks: Keyspace, args: Sequence[bytes]) -> Reply:
    if len(args) > 2:
        raise CommandError("ERR wrong number of arguments for 'ping' command")
    return args[1] if len(args) == 2 else Status(b"PONG")


@command("time", 1)
def _time(ks: Keyspace, args: Sequence[bytes]) -> Reply:
    seconds, micros = divmod(round(ks.wall_time() * 1_000_000), 1_000_000)
    return [str(seconds).encode(), str(micros).encode()]


@command("del", -2, writes=True)
def _del(ks: Keyspace, args: Sequence[bytes]) -> Reply:
    return sum(ks.get(key) is not None and ks.remove(key) for key in args[1:])


@command("exists", -2)
def _exists(ks: Keyspace, args: Sequence[bytes]) -> Reply:
    return sum(ks.get(key) is not None for key in args[1:])


@command("type", 2)
def _type(ks: Keyspace, args: Sequence[bytes]) -> Reply:
    return Status(ks.type_name(args[1]).encode())


def _expire(ks: Keyspace, args: Sequence[bytes], name: str, unit: int, absolute: bool) -> Reply:
    flags = {option.lower() for option in args[3:]}
    for option in args[3:]:
        if option.lower() not in (b"nx", b"xx", b"gt", b"lt"):
            raise CommandError(f"ERR Unsupported option {text(option)}")
    if b"nx" in flags and len(flags) > 1:
        raise CommandError("ERR NX and XX, GT or LT options at the same time are not compatible")
    if {b"gt", b"lt"} <= flags:
        raise CommandError("ERR GT and LT options at the same time are not compatible")
    when = int_arg(args[2])
    invalid = CommandError(f"ERR invalid expire time in '{name}' command")
    if unit == 1000 and not -(-LLONG_MIN // 1000) <= when <= LLONG_MAX // 1000:
        raise invalid  # (C division truncates toward zero)
    when *= unit
    base = 0 if absolute else ks.wall_ms
    if when > LLONG_MAX - base:
        raise invalid
    when += base
    if ks.get(args[1]) is None:
        return 0
    current = ks.deadline_wall(args[1])
    if (
        (b"nx" in flags and current is not None)
        or (b"xx" in flags and current is None)
        or (b"gt" in flags and (current is None or when <= current))
        or (b"lt" in flags and current is not None and when >= current)
    ):
        return 0
    if when <= ks.wall_ms:
        ks.remove(args[1])
    else:
        ks.expire_at_wall(args[1], when)
    return 1


command("expire", -3, writes=True)(lambda ks, args: _expire(ks, args, "expire", 1000, False))
command("pexpire", -3, writes=True)(lambda ks, args: _expire(ks, args, "pexpire", 1, False))
command("expireat", -3, writes=True)(lambda ks, args: _expire(ks, args, "expireat", 1000, True))
command("pexpireat", -3, writes=True)(lambda ks, args: _expire(ks, args, "pexpireat", 1, True))
command("pttl", 2)(lambda ks, args: ks.pttl(args[1]))


@command("ttl", 2)
def _ttl(ks: Keyspace, args: Sequence[bytes]) -> Reply:
    ttl = ks.pttl(args[1])
    return ttl if ttl < 0 else (ttl + 500) // 1000


@command("persist", 2, writes=True)
def _persist(ks: Keyspace, args: Sequence[bytes]) -> Reply:
    return int(ks.get(args[1]) is not None and ks.expires.pop(args[1], None) is not None)


# ----------------------------------------------------------------------------- strings

_EXPIRY_OPTIONS = {b"ex", b"px", b"exat", b"pxat"}
command("get", 2)(lambda ks, args: ks.get_string(args[1]))


@command("set", -3, writes=True)
def _set(ks: Keyspace, args: Sequence[bytes]) -> Reply:
    flags: set[bytes] = set()
    expiry: bytes | None = None
    index = 3
    while index < len(args):
        option = args[index].lower()
        if (option == b"nx" and b"xx" not in flags) or (option == b"xx" and b"nx" not in flags):
            flags.add(option)
        elif option == b"get" or (option == b"keepttl" and not flags & _EXPIRY_OPTIONS):
            flags.add(option)
        elif option in _EXPIRY_OPTIONS and index + 1 < len(args):
            if flags & (_EXPIRY_OPTIONS | {b"keepttl"}) - {option}:
                raise CommandError(SYNTAX)
            flags.add(option)
            expiry = args[index + 1]
            index += 1
        else:
            raise CommandError(SYNTAX)
        index += 1
    when = None
    if expiry is not None:
        when = int_arg(expiry)
        seconds = bool(flags & {b"ex", b"exat"})
        invalid = CommandError("ERR invalid expire time in 'set' command")
        if when <= 0 or (seconds and when > LLONG_MAX // 1000):
            raise invalid
        when = when * (1000 if seconds else 1) + (ks.wall_ms if flags & {b"ex", b"px"} else 0)
        if when > LLONG_MAX:
            raise invalid
    old = ks.get_string(args[1]) if b"get" in flags else None
    found = ks.get(args[1]) is not None
    if (b"nx" in flags and found) or (b"xx" in flags and not found):
        return old
    ks.data[bytes(args[1])] = bytes(args[2])
    if b"keepttl" not in flags:
        ks.expires.pop(args[1], None)
    if when is not None:
        ks.expire_at_wall(args[1], when)
    return old if b"get" in flags else Status(b"OK")


def _add_integer(current: bytes | None, increment: int, not_integer: str) -> int:
    value = 0 if current is None else int_arg(current, not_integer)
    if (increment < 0 and value < 0 and increment < LLONG_MIN - value) or (
        increment > 0 and value > 0 and increment > LLONG_MAX - value
    ):
        raise CommandError("ERR increment or decrement would overflow")
    return value + increment


def _incr(ks: Keyspace, key: bytes, increment: int) -> Reply:
    value = _add_integer(ks.get_string(key), increment, NOT_INTEGER)
    ks.data[bytes(key)] = str(value).encode()  # keeps the TTL, as in Redis
    return value


def _decrement(raw: bytes) -> int:
    decrement = int_arg(raw)
    if decrement == LLONG_MIN:
        raise CommandError("ERR decrement would overflow")
    return -decrement


command("incr", 2, writes=True)(lambda ks, args: _incr(ks, args[1], 1))
command("decr", 2, writes=True)(lambda ks, args: _incr(ks, args[1], -1))
command("incrby", 3, writes=True)(lambda ks, args: _incr(ks, args[1], int_arg(args[2])))
command("decrby", 3, writes=True)(lambda ks, args: _incr(ks, args[1], _decrement(args[2])))


@command("incrbyfloat", 3, writes=True)
def _incrbyfloat(ks: Keyspace, args: Sequence[bytes]) -> Reply:
    current = ks.get_string(args[1])
    value = Fraction(0) if current is None else parse_long_double(current)
    increment = parse_long_double(args[2])
    if value is None or increment is None:
        raise CommandError(NOT_FLOAT)
    result = long_double_add(value, increment)
    if result is None:
        raise CommandError("ERR increment would produce NaN or Infinity")
    ks.data[bytes(args[1])] = reply = format_long_double(result)
    return reply


# ------------------------------------------------------------------------------ hashes


@command("hset", -4, writes=True)
def _hset(ks: Keyspace, args: Sequence[bytes]) -> Reply:
    name = args[0].lower().decode()
    if len(args) % 2:
        raise CommandError(f"ERR wrong number of arguments for '{name}' command")
    fields = ks.get_hash(args[1], create=True)
    added = 0
    for field, value in zip(args[2::2], args[3::2], strict=True):
        added += field not in fields
        fields[bytes(field)] = bytes(value)
    return Status(b"OK") if name == "hmset" else added


@command("hsetnx", 4, writes=True)
def _hsetnx(ks: Keyspace, args: Sequence[bytes]) -> Reply:
    fields = ks.get_hash(args[1], create=True)
    if args[2] in fields:
        return 0
    fields[bytes(args[2])] = bytes(args[3])
    return 1


command("hmset", -4, writes=True)(_hset)
command("hget", 3)(lambda ks, args: ks.get_hash(args[1]).get(args[2]))
command("hmget", -3)(lambda ks, args: [ks.get_hash(args[1]).get(field) for field in args[2:]])
command("hgetall", 2)(lambda ks, args: [x for pair in ks.get_hash(args[1]).items() for x in pair])
command("hkeys", 2)(lambda ks, args: list(ks.get_hash(args[1])))
command("hvals", 2)(lambda ks, args: list(ks.get_hash(args[1]).values()))
command("hlen", 2)(lambda ks, args: len(ks.get_hash(args[1])))
command("hexists", 3)(lambda ks, args: int(args[2] in ks.get_hash(args[1])))


@command("hdel", -3, writes=True)
def _hdel(ks: Keyspace, args: Sequence[bytes]) -> Reply:
    fields = ks.get_hash(args[1])
    removed = sum(fields.pop(field, None) is not None for field in args[2:])
    ks.drop_if_empty(args[1])
    return removed


@command("hincrby", 4, writes=True)
def _hincrby(ks: Keyspace, args: Sequence[bytes]) -> Reply:
    increment = int_arg(args[3])
    fields = ks.get_hash(args[1], create=True)
    value = _add_integer(fields.get(args[2]), increment, "ERR hash value is not an integer")
    fields[bytes(args[2])] = str(value).encode()
    return value


@command("hincrbyfloat", 4, writes=True)
def _hincrbyfloat(ks: Keyspace, args: Sequence[bytes]) -> Reply:
    increment = parse_long_double(args[3])
    if increment is None:
        raise CommandError(NOT_FLOAT)
    if isinstance(increment, float):
        raise CommandError("ERR value is NaN or Infinity")
    fields = ks.get_hash(args[1], create=True)
    current = fields.get(args[2])
    value = Fraction(0) if current is None else parse_long_double(current)
    if value is None:
        raise CommandError("ERR hash value is not a float")
    result = long_double_add(value, increment)
    if result is None:
        raise CommandError("ERR increment would produce NaN or Infinity")
    fields[bytes(args[2])] = reply = format_long_double(result)
    return reply


# -------------------------------------------------------------------------- sorted sets

_ZADD_OPTIONS = (b"nx", b"xx", b"gt", b"lt", b"incr", b"ch")


def _zadd(ks: Keyspace, args: Sequence[bytes], flags: set[bytes]) -> Reply:
    index = 2
    while index < len(args) and args[index].lower() in _ZADD_OPTIONS:
        flags.add(args[index].lower())
        index += 1
    pairs = args[index:]
    if not pairs or len(pairs) % 2:
        raise CommandError(SYNTAX)
    nx, xx, gt, lt, incr, changed = (option in flags for option in _ZADD_OPTIONS)
    if nx and xx:
        raise CommandError("ERR XX and NX options at the same time are not compatible")
    if (gt and nx) or (lt and nx) or (gt and lt):
        raise CommandError("ERR GT, LT, and/or NX options at the same time are not compatible")
    if incr and len(pairs) > 2:
        raise CommandError("ERR INCR option supports a single increment-element pair")
    scores = [parse_double(raw) for raw in pairs[::2]]
    if None in scores:
        raise CommandError(NOT_FLOAT)
    zset = ks.get_zset(args[1])
    if zset is None and xx:
        return None if incr else 0
    if zset is None:
        zset = ks.data[bytes(args[1])] = SortedSet()
    added = updated = processed = 0
    score = 0.0
    for new, member in zip(scores, pairs[1::2], strict=True):
        assert new is not None
        current = zset.scores.get(member)
        if current is None:
            if not xx:
                zset.insert(bytes(member), new)
                score, added, processed = new, added + 1, processed + 1
            continue
        if nx:
            continue
        if incr:
            new += current
            if math.isnan(new):
                raise CommandError("ERR resulting score is not a number (NaN)")
        if (lt and new >= current) or (gt and new <= current):
            continue
        score, processed = new, processed + 1
        if new != current:
            zset.remove(member)
            zset.insert(bytes(member), new)
            updated += 1
    if incr:
        return format_double(score) if processed else None
    return added + updated if changed else added


@command("zrem", -3, writes=True)
def _zrem(ks: Keyspace, args: Sequence[bytes]) -> Reply:
    zset = ks.get_zset(args[1]) or SortedSet()
    removed = 0
    for member in args[2:]:
        if member in zset.scores:
            zset.remove(member)
            removed += 1
    ks.drop_if_empty(args[1])
    return removed


def _zscore(ks: Keyspace, key: bytes, member: bytes) -> float | None:
    zset = ks.get_zset(key)
    return None if zset is None else zset.scores.get(member)


def _zrank(ks: Keyspace, args: Sequence[bytes], reverse: bool) -> Reply:
    score = _zscore(ks, args[1], args[2])
    if score is None:
        return None
    entries = (ks.get_zset(args[1]) or SortedSet()).entries
    rank = bisect_left(entries, (score, args[2]))
    return len(entries) - 1 - rank if reverse else rank


def _score_bounds(low: bytes, high: bytes) -> tuple[tuple[float, bool], tuple[float, bool]]:
    bounds = parse_range_bound(low), parse_range_bound(high)
    if bounds[0] is None or bounds[1] is None:
        raise CommandError("ERR min or max is not a float")
    return bounds[0], bounds[1]


def _zcount(ks: Keyspace, args: Sequence[bytes]) -> Reply:
    low, high = _score_bounds(args[2], args[3])
    start, stop = (ks.get_zset(args[1]) or SortedSet()).score_slice(low, high)
    return stop - start


command("zadd", -4, writes=True)(lambda ks, args: _zadd(ks, args, set()))
command("zincrby", 4, writes=True)(lambda ks, args: _zadd(ks, args, {b"incr"}))
command("zcard", 2)(lambda ks, args: len((ks.get_zset(args[1]) or SortedSet()).scores))
command("zcount", 4)(_zcount)
command("zrank", 3)(lambda ks, args: _zrank(ks, args, False))
command("zrevrank", 3)(lambda ks, args: _zrank(ks, args, True))


@command("zscore", 3)
def _zscore_command(ks: Keyspace, args: Sequence[bytes]) -> Reply:
    score = _zscore(ks, args[1], args[2])
    return None if score is None else format_double(score)


def _zrange(
    ks: Keyspace, args: Sequence[bytes], by_score: bool | None, reverse: bool | None
) -> Reply:
    with_scores, offset, limit = False, 0, -1
    index = 4
    while index < len(args):
        option = args[index].lower()
        if option == b"withscores":
            with_scores = True
        elif option == b"limit" and len(args) - index - 1 >= 2:
            offset, limit = int_arg(args[index + 1]), int_arg(args[index + 2])
            index += 2
        elif option == b"rev" and reverse is None:
            reverse = True
        elif option == b"byscore" and by_score is None:
            by_score = True
        else:
            raise CommandError(SYNTAX)
        index += 1
    if limit != -1 and not by_score:
        raise CommandError(
            "ERR syntax error, LIMIT is only supported in combination with either BYSCORE or BYLEX"
        )
    low, high = (args[3], args[2]) if reverse and by_score else (args[2], args[3])
    if by_score:
        bounds = _score_bounds(low, high)
    else:
        ranks = int_arg(low), int_arg(high)
    zset = ks.get_zset(args[1]) or SortedSet()
    entries = zset.entries
    if by_score:
        start, stop = zset.score_slice(*bounds)
        chosen = entries[start:stop][::-1] if reverse else entries[start:stop]
        if offset < 0 or (offset > 0 and offset >= len(entries)):
            chosen = []
        chosen = chosen[offset:] if limit < 0 else chosen[offset : offset + limit]
    else:
        start, stop = zset.rank_slice(*ranks)
        size = len(entries)
        chosen = entries[size - stop : size - start][::-1] if reverse else entries[start:stop]
    if with_scores:
        return [item for score, member in chosen for item in (member, format_double(score))]
    return [member for _, member in chosen]


command("zrange", -4)(lambda ks, args: _zrange(ks, args, None, None))
command("zrevrange", -4)(lambda ks, args: _zrange(ks, args, False, True))
command("zrangebyscore", -4)(lambda ks, args: _zrange(ks, args, True, False))
command("zrevrangebyscore", -4)(lambda ks, args: _zrange(ks, args, True, True))


def _zremrange(ks: Keyspace, args: Sequence[bytes], by_score: bool) -> Reply:
    if by_score:
        bounds = _score_bounds(args[2], args[3])
    else:
        ranks = int_arg(args[2]), int_arg(args[3])
    zset = ks.get_zset(args[1]) or SortedSet()
    start, stop = zset.score_slice(*bounds) if by_score else zset.rank_slice(*ranks)
    for _, member in zset.entries[start:stop]:
        del zset.scores[member]
    del zset.entries[start:stop]
    ks.drop_if_empty(args[1])
    return stop - start


command("zremrangebyscore", 4, writes=True)(lambda ks, args: _zremrange(ks, args, True))
command("zremrangebyrank", 4, writes=True)(lambda ks, args: _zremrange(ks, args, False))
