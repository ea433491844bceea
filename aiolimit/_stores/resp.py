"""Script calls written as RESP by hand: the bytes redis-py's ``pack_command`` would make.

redis-py's general encoder (type dispatch per argument, a list of chunks per command) is
about half of a decision's client CPU. A script call has a fixed shape: the command head
(``EVALSHA <sha>``), the number of keys, the keys, and arguments that are already ``str``,
``int`` or ``bytes``. Packing that shape directly, into one buffer per pipeline, costs a few
microseconds a call.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from aiolimit._stores.base import Arg, ScriptCall


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
