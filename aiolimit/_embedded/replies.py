"""Replies of the embedded backend, and how they cross the Lua boundary both ways.

A command answers with a ``Reply`` (``Status`` for ``+OK``, ``CommandError`` for an error line).
Redis -> Lua is ``to_lua`` (nil is false, a status is ``{ok = ...}``) and ``error_table``; the
Lua -> Redis direction is written out as RESP2 by the sandbox's Lua and read back here by
``parse_reply``, as redis-py (bytes mode) would. ``to_arg`` and ``plain`` are the Python side:
arguments as redis-py sends them, replies as it returns them.
"""

from __future__ import annotations

from typing import Any, TypeAlias

Reply: TypeAlias = "int | bytes | list[Reply] | None"

WRONGTYPE = "WRONGTYPE Operation against a key holding the wrong kind of value"
NOT_INTEGER = "ERR value is not an integer or out of range"
NOT_FLOAT = "ERR value is not a valid float"
SYNTAX = "ERR syntax error"


class ScriptError(Exception):
    """A script or command failed; the message is the error line Redis would send."""


class CommandError(Exception):
    """A command failed; the message is Redis' error line, for example ``ERR syntax error``."""


class Status(bytes):
    """A status reply (``+OK``), which scripts see as ``{ok = ...}`` rather than a string."""


def text(raw: bytes) -> str:
    """User bytes inside an error message, reversibly (surrogateescape)."""
    return raw.decode("utf-8", "surrogateescape")


def error_text(raw: bytes) -> bytes:
    """Redis' luaPushErrorBuff: "-CODE message" or "message" becomes "CODE message"."""
    raw = raw.split(b"\0", 1)[0]
    code, message = b"ERR", raw
    if raw.startswith(b"-"):
        code, space, message = raw[1:].partition(b" ")
        if not space:
            code, message = b"ERR", raw[1:]
    return code + b" " + message.strip(b"\r\n")


def to_arg(value: object) -> bytes:
    """KEYS/ARGV items as redis-py sends them (str as UTF-8, numbers via repr)."""
    if isinstance(value, bytes | memoryview | bytearray):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, int | float) and not isinstance(value, bool):
        return repr(value).encode()
    raise TypeError(f"Invalid input of type {type(value).__name__!r}: use bytes, str, int or float")


def parse_reply(data: bytes, position: int = 0) -> tuple[Any, int]:
    """Decode the RESP2 reply the Lua side encoded, the way redis-py (bytes mode) would."""
    kind, end = data[position : position + 1], data.index(b"\r\n", position)
    line, position = data[position + 1 : end], end + 2
    if kind == b"+":
        return line, position
    if kind == b"-":
        return ScriptError(line.decode("utf-8", "replace")), position
    if kind == b":":
        return int(line), position
    if kind == b"$":
        size = int(line)
        return (
            (None, position)
            if size < 0
            else (data[position : position + size], position + size + 2)
        )
    items = []
    for _ in range(int(line)):
        item, position = parse_reply(data, position)
        items.append(item)
    return items, position


def plain(reply: Reply) -> Any:
    """A command's reply as redis-py returns it (a status is plain bytes)."""
    if isinstance(reply, list):
        return [plain(item) for item in reply]
    return bytes(reply) if isinstance(reply, bytes) else reply


def to_lua(lua: Any, reply: Reply) -> Any:
    """Redis -> Lua: nil is false, arrays are tables, a status is {ok = ...}."""
    if reply is None:
        return False
    if isinstance(reply, Status):
        return lua.table_from({b"ok": bytes(reply)})
    if isinstance(reply, list):
        return lua.table_from(
            [item if type(item) in (bytes, int) else to_lua(lua, item) for item in reply]
        )
    return reply


def error_table(lua: Any, raw: bytes, *, from_command: bool = False) -> Any:
    """The Lua error table ``{err = "CODE message"}`` that redis.call raises."""
    fields: dict[bytes, object] = {b"err": error_text(raw)}
    if from_command:
        fields[b"ignore_error_stats_update"] = True
    return lua.table_from(fields)
