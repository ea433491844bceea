"""Script calls written as RESP by hand (the bytes redis-py's ``pack_command`` would make),
and a pipeline's replies read in one go.

redis-py's general encoder (type dispatch per argument, a list of chunks per command) is
about half of a decision's client CPU. A script call has a fixed shape: the command head
(``EVALSHA <sha>``), the number of keys, the keys, and arguments that are already ``str``,
``int`` or ``bytes``. Packing that shape directly, into one buffer per pipeline, costs a few
microseconds a call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from aiolimit._stores.base import Arg, ScriptCall

HIREDIS_PARSER: type | None = None
NOT_ENOUGH_DATA: object = None
try:  # redis-py's hiredis parser and its "no complete reply yet" marker (redis-py 5-8)
    from redis._parsers import _AsyncHiredisParser as HIREDIS_PARSER
    from redis._parsers.hiredis import NOT_ENOUGH_DATA
except ImportError:  # pragma: no cover - another redis-py layout: replies are read one by one
    pass


def bulk(value: bytes) -> bytes:
    """One RESP bulk string."""
    return b"$%d\r\n%b\r\n" % (len(value), value)


def command_head(*words: str) -> bytes:
    """The packed leading words of a command, e.g. ``command_head("EVALSHA", sha)``."""
    return b"".join(bulk(word.encode()) for word in words)


#: Packed values that repeat from call to call: keys, identifier blocks, modes, flags and small
#: numbers (bounded; cleared when full). Op ids and times are packed each time.
_PACKED: dict[str | bytes | int, bytes] = {}
_PACKED_MAX = 10_000


def _repeated(value: str | bytes) -> bytes:
    packed = _PACKED.get(value)
    if packed is None:
        data = value.encode() if isinstance(value, str) else value
        packed = b"$%d\r\n%b\r\n" % (len(data), data)
        if len(_PACKED) >= _PACKED_MAX:
            _PACKED.clear()
        _PACKED[value] = packed
    return packed


def _packed(value: Arg) -> bytes:
    """A value not cached yet: packed, and cached when it is one that repeats."""
    if isinstance(value, bytes):
        return _repeated(value)
    if isinstance(value, str):
        if ":" not in value:  # op ids ("<client>:<stamp>:...") are the strings that never repeat
            return _repeated(value)
        data = value.encode()
    elif isinstance(value, int):
        data = b"%d" % value
        if 0 <= value < 4096:
            packed = b"$%d\r\n%b\r\n" % (len(data), data)
            if len(_PACKED) >= _PACKED_MAX:
                _PACKED.clear()
            _PACKED[value] = packed
            return packed
    else:
        raise TypeError(f"a script argument must be str, int or bytes, not {value!r}")
    return b"$%d\r\n%b\r\n" % (len(data), data)


def pack_call(head: bytes, head_words: int, keys: Sequence[str], args: Sequence[Arg]) -> bytes:
    """One script call: ``head`` (``head_words`` words), the key count, the keys, the args."""
    cached = _PACKED.get
    parts = [b"*%d\r\n" % (head_words + 1 + len(keys) + len(args)), head]
    append = parts.append
    append(cached(len(keys)) or _packed(len(keys)))
    for key in keys:
        append(cached(key) or _repeated(key))
    for value in args:
        append(cached(value) or _packed(value))
    return b"".join(parts)


def pack_calls(head: bytes, head_words: int, calls: Iterable[ScriptCall]) -> bytes:
    """Several calls in one buffer, for one write."""
    return b"".join(pack_call(head, head_words, call.keys, call.args) for call in calls)


_NO_KEYS = b"$1\r\n0\r\n"


def pack_many(head: bytes, calls: Sequence[ScriptCall], *, spread: bool = False) -> bytes:
    """Several calls as one call of ``decide_many`` (``lua/decide.lua``): ``head`` (two words,
    FCALL and the function), the key count, every call's keys, then the number of calls and,
    per call, its key count, its argument count and its arguments.

    With ``spread`` (``decide_node``: calls on several slots of one cluster node), no key is
    declared: the key count and the keys lead the arguments instead."""
    cached = _PACKED.get
    keys: list[bytes] = []
    add_key = keys.append
    args: list[bytes] = []
    add_arg = args.append
    for call in calls:
        call_keys = call.keys
        call_args = call.args
        for key in call_keys:
            add_key(cached(key) or _repeated(key))
        add_arg(cached(len(call_keys)) or _packed(len(call_keys)))
        add_arg(cached(len(call_args)) or _packed(len(call_args)))
        for value in call_args:
            add_arg(cached(value) or _packed(value))
    words = 2 + 1 + len(keys) + 1 + len(args) + (1 if spread else 0)
    return b"".join(
        (
            b"*%d\r\n" % words,
            head,
            *((_NO_KEYS,) if spread else ()),
            cached(len(keys)) or _packed(len(keys)),
            *keys,
            cached(len(calls)) or _packed(len(calls)),
            *args,
        )
    )


def write_now(connection: Any, packed: bytes) -> None:
    """Writes ``packed`` on a redis-py asyncio connection's transport, with no drain: for
    one small call on a connection with nothing else pending (``RedisStore._run_direct``).
    A module function so that ``bench/`` can count these writes as it counts redis-py's."""
    connection._writer.write(packed)


def spread_many(reply: Any, count: int) -> list[Any]:
    """``decide_many``'s reply as one result per call: its replies, or one error for them all
    (the function is missing, a redirection, the server refused the call: then none of them
    ran)."""
    if isinstance(reply, BaseException):
        return [reply] * count
    if not isinstance(reply, list) or len(reply) != count:
        error = ResponseError(f"aiolimit: a batch of {count} calls had the reply {reply!r:.200}")
        return [error] * count
    return reply


async def read_replies(connection: Any, count: int, into: list[Any] | None = None) -> list[Any]:
    """The next ``count`` replies on ``connection``, in order, appended to ``into`` (a new
    list if None) as they come; an error reply (NOSCRIPT, MOVED, ...) is that call's result,
    a ``ResponseError``. A connection failure is raised: ``into`` then holds the replies read
    before it.

    With redis-py's hiredis parser the replies are taken from the parser's reader directly,
    with a socket read only when it holds no complete reply, and RESP3 push messages handed
    to the parser as redis-py would. redis-py's ``read_response`` costs a few layers (and,
    with a socket timeout, a timer) per reply; here one bound covers the whole read. Any
    other parser goes through ``read_response`` one reply at a time.
    """
    results: list[Any] = [] if into is None else into
    parser: Any = getattr(connection, "_parser", None)
    if (
        HIREDIS_PARSER is None
        or type(parser) is not HIREDIS_PARSER
        or not getattr(parser, "_connected", False)
    ):
        return await _one_by_one(connection, count, results)
    timeout = getattr(connection, "socket_timeout", None)
    if not timeout:
        return await from_reader(parser, count, results)
    try:  # one bound for the whole read where redis-py would bound each reply
        async with asyncio.timeout(timeout):
            return await from_reader(parser, count, results)
    except TimeoutError:
        raise RedisTimeoutError(f"no reply within {timeout} s") from None


async def from_reader(parser: Any, count: int, results: list[Any]) -> list[Any]:
    gets = parser._reader.gets
    push = getattr(parser, "_hiredis_PushNotificationType", None) or ()
    append = results.append
    end = len(results) + count
    while len(results) < end:
        reply = gets()
        if reply is NOT_ENOUGH_DATA:
            try:
                await parser.read_from_socket()
            except OSError as error:  # as redis-py reports it (its retry policies catch this)
                raise RedisConnectionError(f"error while reading a reply: {error}") from error
        elif isinstance(reply, RedisConnectionError):  # e.g. LOADING: the node is not ready
            raise reply
        elif push and isinstance(reply, push):  # RESP3: not a reply; redis-py's handlers
            await parser.handle_push_response(reply)
        else:
            append(reply)
    return results


async def _one_by_one(connection: Any, count: int, results: list[Any]) -> list[Any]:
    for _ in range(count):
        try:
            results.append(await connection.read_response())
        except ResponseError as error:  # an error reply answers that call only
            results.append(error)
    return results
