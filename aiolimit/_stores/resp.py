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


#: Packed keys and identifier blocks, which repeat from call to call (bounded; cleared when
#: full). Other arguments (op ids, times) are packed each time.
_PACKED: dict[str | bytes, bytes] = {}
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


def pack_call(head: bytes, head_words: int, keys: Sequence[str], args: Sequence[Arg]) -> bytes:
    """One script call: ``head`` (``head_words`` words), the key count, the keys, the args."""
    count = b"%d" % len(keys)
    parts = [
        b"*%d\r\n" % (head_words + 1 + len(keys) + len(args)),
        head,
        b"$%d\r\n%b\r\n" % (len(count), count),
    ]
    append = parts.append
    for key in keys:
        append(_repeated(key))
    for value in args:
        if isinstance(value, bytes):
            append(_repeated(value))
            continue
        if isinstance(value, str):
            data = value.encode()
        elif isinstance(value, int):
            data = b"%d" % value
        else:
            raise TypeError(f"a script argument must be str, int or bytes, not {value!r}")
        append(b"$%d\r\n%b\r\n" % (len(data), data))
    return b"".join(parts)


def pack_calls(head: bytes, head_words: int, calls: Iterable[ScriptCall]) -> bytes:
    """Several calls in one buffer, for one write."""
    return b"".join(pack_call(head, head_words, call.keys, call.args) for call in calls)
