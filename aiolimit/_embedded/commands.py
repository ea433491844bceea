"""The embedded engine's commands: the table scripts reach through ``redis.call``.

Exactly the commands ``lua/`` calls, plus DEL (a limiter's ``reset`` deletes keys); a test
holds the table to that list. Each keeps Redis 7.0's replies and errors for the forms the
scripts use, because the same Lua must behave the same on both backends; an option the scripts
never pass is refused as Redis refuses an unknown one. Keys and deadlines live in
``keyspace``, number rules in ``numbers``, the sorted set handlers in ``sorted_sets``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeAlias

from . import sorted_sets
from .keyspace import CommandError, Keyspace, Reply, Status
from .numbers import LLONG_MAX, int_arg

Handler: TypeAlias = Callable[[Keyspace, Sequence[bytes]], Reply]

#: Lower-case name -> (handler, arity: exact if positive, at least -arity if negative).
COMMANDS: dict[bytes, tuple[Handler, int]] = {}


def _text(raw: bytes) -> str:
    """User bytes inside an error message, reversibly."""
    return raw.decode("utf-8", "surrogateescape")


def execute(ks: Keyspace, args: Sequence[bytes], *, from_script: bool) -> Reply:
    """Run one command; raise CommandError with Redis' message when it fails."""
    name = args[0].lower()
    entry = COMMANDS.get(name)
    if entry is None:
        if from_script:
            raise CommandError("ERR Unknown Redis command called from script")
        shown = "".join(f"'{_text(arg)[:128]}' " for arg in args[1:])[:128]
        raise CommandError(
            f"ERR unknown command '{_text(args[0])[:128]}', with args beginning with: {shown}"
        )
    handler, arity = entry
    if (arity > 0 and len(args) != arity) or len(args) < -arity:
        if from_script:
            raise CommandError("ERR Wrong number of args calling Redis command from script")
        raise CommandError(f"ERR wrong number of arguments for '{_text(name)}' command")
    ks.read_clocks()
    return handler(ks, args)


def _time(ks: Keyspace, args: Sequence[bytes]) -> Reply:
    seconds, micros = divmod(round(ks.wall_time() * 1_000_000), 1_000_000)
    return [str(seconds).encode(), str(micros).encode()]


def _del(ks: Keyspace, args: Sequence[bytes]) -> Reply:
    return sum(ks.get(key) is not None and ks.remove(key) for key in args[1:])


def _ttl_arg(ks: Keyspace, raw: bytes, command: str, *, positive: bool) -> int:
    """A relative TTL in ms, refused as Redis refuses one whose deadline would overflow."""
    milliseconds = int_arg(raw)
    if (positive and milliseconds <= 0) or milliseconds > LLONG_MAX - ks.wall_ms:
        raise CommandError(f"ERR invalid expire time in '{command}' command")
    return milliseconds


def _pexpire(ks: Keyspace, args: Sequence[bytes]) -> Reply:
    """PEXPIRE key milliseconds (no NX/XX/GT/LT); a deadline already past deletes the key."""
    if len(args) > 3:
        raise CommandError(f"ERR Unsupported option {_text(args[3])}")
    milliseconds = _ttl_arg(ks, args[2], "pexpire", positive=False)
    if ks.get(args[1]) is None:
        return 0
    if milliseconds <= 0:
        ks.remove(args[1])
    else:
        ks.expire_in(args[1], milliseconds)
    return 1


def _pexpireat(ks: Keyspace, args: Sequence[bytes]) -> Reply:
    """PEXPIREAT key unix-ms (no NX/XX/GT/LT); a time already past deletes the key."""
    if len(args) > 3:
        raise CommandError(f"ERR Unsupported option {_text(args[3])}")
    at = int_arg(args[2])
    if at > LLONG_MAX - ks.wall_offset or at < -LLONG_MAX:
        raise CommandError("ERR invalid expire time in 'pexpireat' command")
    if ks.get(args[1]) is None:
        return 0
    milliseconds = at - ks.wall_offset - ks.mono_ms
    if milliseconds <= 0:
        ks.remove(args[1])
    else:
        ks.expire_in(args[1], milliseconds)
    return 1


def _set(ks: Keyspace, args: Sequence[bytes]) -> Reply:
    """SET key value [PX milliseconds]: replaces any value and drops any TTL."""
    raw_ttl = None
    for index in range(3, len(args), 2):
        if args[index].lower() != b"px" or index + 1 >= len(args):
            raise CommandError("ERR syntax error")
        raw_ttl = args[index + 1]
    ttl = None if raw_ttl is None else _ttl_arg(ks, raw_ttl, "set", positive=True)
    ks.data[bytes(args[1])] = bytes(args[2])
    ks.expires.pop(args[1], None)
    if ttl is not None:
        ks.expire_in(args[1], ttl)
    return Status(b"OK")


def _hset(ks: Keyspace, args: Sequence[bytes]) -> Reply:
    if len(args) % 2:
        raise CommandError("ERR wrong number of arguments for 'hset' command")
    fields = ks.get_hash(args[1], create=True)
    added = 0
    for field, value in zip(args[2::2], args[3::2], strict=True):
        added += field not in fields
        fields[bytes(field)] = bytes(value)
    return added


def _hdel(ks: Keyspace, args: Sequence[bytes]) -> Reply:
    fields = ks.get_hash(args[1])
    removed = sum(fields.pop(field, None) is not None for field in args[2:])
    ks.drop_if_empty(args[1])
    return removed


def _hgetall(ks: Keyspace, args: Sequence[bytes]) -> Reply:
    return [item for pair in ks.get_hash(args[1]).items() for item in pair]


def _exists(ks: Keyspace, args: Sequence[bytes]) -> Reply:
    """EXISTS key...: how many of the keys exist (a key named twice counts twice)."""
    return sum(ks.get(key) is not None for key in args[1:])


def _hmget(ks: Keyspace, args: Sequence[bytes]) -> Reply:
    """HMGET key field...: each field's value, nil for one the hash does not have."""
    fields = ks.get_hash(args[1])
    return [fields.get(bytes(field)) for field in args[2:]]


COMMANDS.update(
    {
        b"time": (_time, 1),
        b"del": (_del, -2),
        b"unlink": (_del, -2),  # nothing runs in the background here: DEL's effect
        b"pexpire": (_pexpire, -3),
        b"pttl": (lambda ks, args: ks.pttl(args[1]), 2),
        b"pexpireat": (_pexpireat, -3),
        b"pexpiretime": (lambda ks, args: ks.expire_time(args[1]), 2),
        b"get": (lambda ks, args: ks.get_string(args[1]), 2),
        b"set": (_set, -3),
        b"hset": (_hset, -4),
        b"hdel": (_hdel, -3),
        b"hgetall": (_hgetall, 2),
        b"hmget": (_hmget, -3),
        b"exists": (_exists, -2),
        b"zadd": (sorted_sets.zadd, -4),
        b"zcount": (sorted_sets.zcount, 4),
        b"zscore": (sorted_sets.zscore, 3),
        b"zrange": (sorted_sets.zrange, -4),
        b"zrangebyscore": (sorted_sets.zrangebyscore, -4),
        b"zrem": (sorted_sets.zrem, -3),
        b"zremrangebyscore": (sorted_sets.zremrangebyscore, 4),
    }
)
