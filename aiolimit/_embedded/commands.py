"""Redis commands for the embedded backend: the command table, its dispatch and the handlers.

Each handler keeps Redis 7.0's replies and errors, because the same Lua must behave the same on
both backends; ``tests/test_embedded_store.py`` checks this against a real server. Number rules
live in ``numbers``, the keys and their deadlines in ``keyspace``, and the
sorted set handlers (registered here with the rest) in ``sorted_sets``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import TYPE_CHECKING, TypeAlias

from . import sorted_sets as sorted_sets
from .numbers import (
    LLONG_MAX,
    LLONG_MIN,
    format_long_double,
    int_arg,
    long_double_add,
    parse_long_double,
)
from .replies import (
    NOT_FLOAT,
    NOT_INTEGER,
    SYNTAX,
    CommandError,
    Reply,
    Status,
    text,
)

if TYPE_CHECKING:
    from .keyspace import Keyspace

Handler: TypeAlias = "Callable[[Keyspace, Sequence[bytes]], Reply]"

COMMANDS: dict[bytes, tuple[Handler, int, bool, str]] = {}


def command(name: str, arity: int, *, writes: bool = False) -> Callable[[Handler], Handler]:
    """Register a handler under its Redis name and arity (negative: at least that many)."""

    def register(handler: Handler) -> Handler:
        COMMANDS[name.encode()] = (handler, arity, writes, name)
        return handler

    return register


def execute(
    ks: Keyspace, args: Sequence[bytes], *, from_script: bool, read_only: bool = False
) -> Reply:
    """Run one command; raise CommandError with Redis' message when it fails."""
    entry = COMMANDS.get(args[0].lower())
    if entry is None:
        if from_script:
            raise CommandError("ERR Unknown Redis command called from script")
        shown = "".join(f"'{text(arg)[:128]}' " for arg in args[1:])[:128]
        raise CommandError(
            f"ERR unknown command '{text(args[0])[:128]}', with args beginning with: {shown}"
        )
    handler, arity, writes, name = entry
    if (arity > 0 and len(args) != arity) or len(args) < -arity:
        if from_script:
            raise CommandError("ERR Wrong number of args calling Redis command from script")
        raise CommandError(f"ERR wrong number of arguments for '{name}' command")
    if writes and read_only:
        raise CommandError("ERR Write commands are not allowed from read-only scripts.")
    ks.read_clocks()
    return handler(ks, args)


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

command("zadd", -4, writes=True)(lambda ks, args: sorted_sets.zadd(ks, args, set()))
command("zincrby", 4, writes=True)(lambda ks, args: sorted_sets.zadd(ks, args, {b"incr"}))
command("zrem", -3, writes=True)(sorted_sets.zrem)
command("zcard", 2)(sorted_sets.zcard)
command("zcount", 4)(sorted_sets.zcount)
command("zscore", 3)(sorted_sets.zscore)
command("zrank", 3)(lambda ks, args: sorted_sets.zrank(ks, args, False))
command("zrevrank", 3)(lambda ks, args: sorted_sets.zrank(ks, args, True))
command("zrange", -4)(lambda ks, args: sorted_sets.zrange(ks, args, None, None))
command("zrevrange", -4)(lambda ks, args: sorted_sets.zrange(ks, args, False, True))
command("zrangebyscore", -4)(lambda ks, args: sorted_sets.zrange(ks, args, True, False))
command("zrevrangebyscore", -4)(lambda ks, args: sorted_sets.zrange(ks, args, True, True))
command("zremrangebyscore", 4, writes=True)(lambda ks, args: sorted_sets.zremrange(ks, args, True))
command("zremrangebyrank", 4, writes=True)(lambda ks, args: sorted_sets.zremrange(ks, args, False))
