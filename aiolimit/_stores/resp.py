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


def _arg(value: Arg) -> bytes:
    if isinstance(value, bytes):
        return b"$%d\r\n%b\r\n" % (len(value), value)
    if isinstance(value, str):
        data = value.encode()
        return b"$%d\r\n%b\r\n" % (len(data), data)
    if isinstance(value, int) and not isinstance(value, bool):
        data = b"%d" % value
        return b"$%d\r\n%b\r\n" % (len(data), data)
    raise TypeError(f"a script argument must be str, int or bytes, got {type(value).__name__}")


def pack_call(head: bytes, head_words: int, keys: Sequence[str], args: Sequence[Arg]) -> bytes:
    """One script call: ``head`` (``head_words`` words), the key count, the keys, the args."""
    count = b"%d" % len(keys)
    parts = [
        b"*%d\r\n" % (head_words + 1 + len(keys) + len(args)),
        head,
        b"$%d\r\n%b\r\n" % (len(count), count),
    ]
    parts.extend(_arg(key) for key in keys)
    parts.extend(_arg(arg) for arg in args)
    return b"".join(parts)


def pack_calls(head: bytes, head_words: int, calls: Iterable[ScriptCall]) -> bytes:
    """Several calls in one buffer, for one write."""
    return b"".join(pack_call(head, head_words, call.keys, call.args) for call in calls)
