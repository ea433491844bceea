"""The embedded backend: aiolimit's Redis Lua scripts run in-process on an in-memory keyspace.

It is not a mock. Scripts run on real Lua 5.1 (lupa), the version Redis embeds, inside a copy
of Redis 7.0's scripting environment: the same globals (read-only, and reading an undefined one
is an error), ``redis.call``/``pcall``/``error_reply``/``status_reply``/``sha1hex``/``log``,
the same reply conversions both ways (Lua numbers are truncated to integers, a table stops at
its first nil, ``{ok=}`` and ``{err=}`` tables) and the same error messages. The commands and
their number rules live in ``_embedded_commands``; ``tests/test_embedded_store.py`` runs the
same scripts on a real server to keep both honest.

Every call runs to completion under a lock, so a script is atomic for asyncio tasks and for
threads alike. As in Redis 7.0, expiry is judged by the time the script started, while TTL
arithmetic (PTTL, PEXPIRE's base) reads the live clock.
"""

from __future__ import annotations

import hashlib
import heapq
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lupa.lua51 import LuaRuntime

from aiolimit._embedded_commands import (
    COMMANDS,
    WRONGTYPE,
    CommandError,
    Reply,
    SortedSet,
    Status,
    text,
)

__all__ = ["EmbeddedStore", "NoScriptError", "ScriptError"]

_log = logging.getLogger("aiolimit.embedded")
_LOG_LEVELS = (logging.DEBUG, logging.DEBUG, logging.INFO, logging.WARNING)
_SHEBANG_FLAGS = {
    b"no-writes",
    b"allow-oom",
    b"allow-stale",
    b"no-cluster",
    b"allow-cross-slot-keys",
}
Value = bytes | dict[bytes, bytes] | SortedSet
Arg = str | bytes | memoryview | int | float


class ScriptError(Exception):
    """A script or command failed; the message is the error line Redis would send."""


class NoScriptError(ScriptError):
    """EVALSHA of a script this store has not loaded (Redis' NOSCRIPT)."""


class Keyspace:
    """Keys, values and deadlines, with Redis' lazy expiry plus a bounded sweep of due keys."""

    def __init__(self, monotonic: Callable[[], float], wall: Callable[[], float]) -> None:
        self._monotonic = monotonic
        self._wall = wall
        self.data: dict[bytes, Value] = {}
        self.expires: dict[bytes, int] = {}  # key -> deadline on the monotonic clock, in ms
        self._deadlines: list[tuple[int, bytes]] = []  # a heap; refreshed TTLs leave stale rows
        # Redis 7.0 judges expiry by the time its script started (frozen_ms), but computes
        # TTLs from the live clock, read once per command (mono_ms, wall_ms).
        self.frozen_ms = self.mono_ms = self.wall_ms = 0

    def _read_clocks(self) -> None:
        self.mono_ms = round(self._monotonic() * 1000)  # round: 1000.029 s is 1000029 ms
        self.wall_ms = round(self._wall() * 1000)

    def begin(self) -> None:
        """Freeze the clock for one script or command, then drop a few keys that are due."""
        self._read_clocks()
        self.frozen_ms = self.mono_ms
        heap = self._deadlines
        for _ in range(64):
            if not heap or heap[0][0] >= self.frozen_ms:
                break
            deadline, key = heapq.heappop(heap)
            if self.expires.get(key) == deadline:
                self.remove(key)
        if len(heap) > 2 * len(self.expires) + 64:
            self._deadlines = [(deadline, key) for key, deadline in self.expires.items()]
            heapq.heapify(self._deadlines)

    def wall_time(self) -> float:
        return self._wall()

    def get(self, key: bytes) -> Value | None:
        value = self.data.get(key)
        if value is not None:
            deadline = self.expires.get(key)
            if deadline is not None and self.frozen_ms > deadline:
                self.remove(key)
                return None
        return value

    def _typed(self, key: bytes, kind: type[Value]) -> Any:
        value = self.get(key)
        if value is not None and type(value) is not kind:
            raise CommandError(WRONGTYPE)
        return value

    def get_string(self, key: bytes) -> bytes | None:
        value: bytes | None = self._typed(key, bytes)
        return value

    def get_hash(self, key: bytes, *, create: bool = False) -> dict[bytes, bytes]:
        """The hash at key; a missing one reads as empty (and is stored when create is set)."""
        value: dict[bytes, bytes] | None = self._typed(key, dict)
        if value is None:
            value = {}
            if create:
                self.data[bytes(key)] = value
        return value

    def get_zset(self, key: bytes) -> SortedSet | None:
        value: SortedSet | None = self._typed(key, SortedSet)
        return value

    def type_name(self, key: bytes) -> str:
        value = self.get(key)
        names = {bytes: "string", dict: "hash", SortedSet: "zset"}
        return "none" if value is None else names[type(value)]

    def clear(self) -> None:
        self.data.clear()
        self.expires.clear()
        self._deadlines.clear()

    def remove(self, key: bytes) -> bool:
        self.expires.pop(key, None)
        return self.data.pop(key, None) is not None

    def drop_if_empty(self, key: bytes) -> None:
        """Redis deletes a hash or sorted set when its last element goes."""
        value = self.data.get(key)
        if isinstance(value, (dict, SortedSet)) and not (
            value.scores if isinstance(value, SortedSet) else value
        ):
            self.remove(key)

    def pttl(self, key: bytes) -> int:
        if self.get(key) is None:
            return -2
        deadline = self.expires.get(key)
        return -1 if deadline is None else max(0, deadline - self.mono_ms)

    def deadline_wall(self, key: bytes) -> int | None:
        deadline = self.expires.get(key)
        return None if deadline is None else deadline - self.mono_ms + self.wall_ms

    def expire_at_wall(self, key: bytes, when_ms: int) -> None:
        deadline = when_ms - self.wall_ms + self.mono_ms
        self.expires[bytes(key)] = deadline
        heapq.heappush(self._deadlines, (deadline, bytes(key)))

    def execute(
        self, args: Sequence[bytes], *, from_script: bool, read_only: bool = False
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
        self._read_clocks()
        return handler(self, args)


class _ErrorReply(Exception):
    """Raised by redis.call and friends: carries the Lua error table Redis would raise."""

    def __init__(self, table: Any) -> None:
        super().__init__("redis error reply")
        self.table = table


@dataclass(frozen=True)
class _Script:
    sha: str
    function: Any
    read_only: bool


class _SandboxError(AttributeError):
    """A script reached for an attribute of a Python object (redis.call.__globals__...)."""


def _deny_attribute(obj: object, name: object, is_setting: bool) -> object:
    raise _SandboxError("scripts cannot reach Python attributes")


def _error_text(raw: bytes) -> bytes:
    """Redis' luaPushErrorBuff: "-CODE message" or "message" becomes "CODE message"."""
    raw = raw.split(b"\0", 1)[0]
    code, message = b"ERR", raw
    if raw.startswith(b"-"):
        code, space, message = raw[1:].partition(b" ")
        if not space:
            code, message = b"ERR", raw[1:]
    return code + b" " + message.strip(b"\r\n")


def _lua_number_text(value: int | float) -> bytes:
    """What lua_tostring gives for a number ("%.14g")."""
    return b"%.14g" % value


def _to_arg(value: object) -> bytes:
    """KEYS/ARGV items as redis-py sends them (str as UTF-8, numbers via repr)."""
    if isinstance(value, bytes | memoryview | bytearray):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, int | float) and not isinstance(value, bool):
        return repr(value).encode()
    raise TypeError(f"Invalid input of type {type(value).__name__!r}: use bytes, str, int or float")


def _parse_reply(data: bytes, position: int = 0) -> tuple[Any, int]:
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
        item, position = _parse_reply(data, position)
        items.append(item)
    return items, position


class EmbeddedStore:
    """An in-process Redis for aiolimit's scripts: EVALSHA semantics over a Python keyspace."""

    def __init__(
        self,
        *,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._lock = threading.Lock()
        self._keyspace = Keyspace(monotonic, wall)
        self._scripts: dict[str, _Script] = {}
        self._read_only = False
        self._internal_error: BaseException | None = None
        self._lua = LuaRuntime(
            encoding=None,
            register_eval=False,
            register_builtins=False,
            unpack_returned_tuples=True,
            attribute_filter=_deny_attribute,
        )
        api = self._lua.table_from(
            {
                b"error_reply": self._error_reply,
                b"status_reply": self._status_reply,
                b"sha1hex": self._sha1hex,
                b"log": self._redis_log,
                b"setresp": self._setresp,
                b"set_repl": self._set_repl,
                b"replicate_commands": lambda *args: True,
                b"breakpoint": lambda *args: False,
                b"debug": lambda *args: (),  # () is "no value" in Lua, as in Redis
            }
        )
        self._compile, self._run = self._lua.execute(
            _SANDBOX_LUA, api, self._dispatch, self._unwrap
        )

    # ------------------------------------------------------------------------- scripts

    def script_load(self, source: str | bytes) -> str:
        """Compile and cache a script; return its SHA1 (the key EVALSHA takes)."""
        with self._lock:
            return self._load(source.encode() if isinstance(source, str) else bytes(source))

    def evalsha(self, sha: str | bytes, keys: Sequence[Arg], args: Sequence[Arg]) -> Any:
        """Run a loaded script; raise NoScriptError if this store has not seen it."""
        name = (sha.decode("latin-1") if isinstance(sha, bytes) else sha).lower()
        with self._lock:
            script = self._scripts.get(name)
            if script is None:
                raise NoScriptError("NOSCRIPT No matching script. Please use EVAL.")
            return self._execute(script, keys, args)

    def eval(self, source: str | bytes, keys: Sequence[Arg], args: Sequence[Arg]) -> Any:
        """Load (if needed) and run a script, like EVAL."""
        with self._lock:
            sha = self._load(source.encode() if isinstance(source, str) else bytes(source))
            return self._execute(self._scripts[sha], keys, args)

    def script_exists(self, *shas: str) -> list[bool]:
        with self._lock:
            return [sha.lower() in self._scripts for sha in shas]

    def script_flush(self) -> None:
        with self._lock:
            self._scripts.clear()

    # ------------------------------------------------------------------ direct helpers

    def execute_command(self, *args: Arg) -> Any:
        """Run one command outside any script, with the reply redis-py would return."""
        with self._lock:
            self._keyspace.begin()
            try:
                reply = self._keyspace.execute([_to_arg(arg) for arg in args], from_script=False)
            except CommandError as error:
                raise ScriptError(str(error)) from None
            return _plain(reply)

    def delete(self, *keys: str | bytes) -> int:
        result: int = self.execute_command("DEL", *keys) if keys else 0
        return result

    def exists(self, key: str | bytes) -> bool:
        return bool(self.execute_command("EXISTS", key))

    def pttl(self, key: str | bytes) -> int:
        result: int = self.execute_command("PTTL", key)
        return result

    def type(self, key: str | bytes) -> str:
        result: bytes = self.execute_command("TYPE", key)
        return result.decode()

    def hgetall(self, key: str | bytes) -> dict[bytes, bytes]:
        flat: list[bytes] = self.execute_command("HGETALL", key)
        return dict(zip(flat[::2], flat[1::2], strict=True))

    def keys(self) -> list[bytes]:
        """Every live key (expired ones are purged on the way)."""
        with self._lock:
            self._keyspace.begin()
            return [key for key in list(self._keyspace.data) if self._keyspace.get(key) is not None]

    def flushall(self) -> None:
        with self._lock:
            self._keyspace.clear()

    # ---------------------------------------------------------------------- internals

    def _load(self, source: bytes) -> str:
        sha = hashlib.sha1(source).hexdigest()
        if sha not in self._scripts:
            body, read_only = _split_shebang(source)
            function, error = self._compile(body)
            if function is None:
                message = text(error).replace("\r", " ").replace("\n", " ")
                raise ScriptError(f"ERR Error compiling script (new function): {message}")
            self._scripts[sha] = _Script(sha, function, read_only)
        return sha

    def _execute(self, script: _Script, keys: Sequence[Arg], args: Sequence[Arg]) -> Any:
        keys_table = self._lua.table_from([_to_arg(key) for key in keys])
        args_table = self._lua.table_from([_to_arg(arg) for arg in args])
        self._keyspace.begin()
        self._read_only, self._internal_error = script.read_only, None
        try:
            ok, payload = self._run(script.function, keys_table, args_table, script.sha.encode())
        finally:
            self._read_only = False
        if self._internal_error is not None:
            raise self._internal_error
        if not ok:
            raise ScriptError(payload.decode("utf-8", "replace"))
        reply, _ = _parse_reply(payload)
        if isinstance(reply, ScriptError):
            raise reply
        return reply

    def _to_lua(self, reply: Reply) -> Any:
        """Redis -> Lua: nil is false, arrays are tables, a status is {ok = ...}."""
        if reply is None:
            return False
        if isinstance(reply, Status):
            return self._lua.table_from({b"ok": bytes(reply)})
        if isinstance(reply, list):
            return self._lua.table_from(
                [item if type(item) in (bytes, int) else self._to_lua(item) for item in reply]
            )
        return reply

    def _error_table(self, raw: bytes, *, from_command: bool = False) -> Any:
        fields: dict[bytes, object] = {b"err": _error_text(raw)}
        if from_command:
            fields[b"ignore_error_stats_update"] = True
        return self._lua.table_from(fields)

    def _dispatch(self, raise_error: bool, *args: bytes) -> Any:
        """redis.call (raise_error) and redis.pcall, after the Lua side turned numbers to text."""
        try:
            reply = self._keyspace.execute(args, from_script=True, read_only=self._read_only)
        except CommandError as error:
            raw = str(error).encode("utf-8", "surrogateescape")
            table = self._error_table(b"-" + raw, from_command=True)
        except Exception as error:  # a bug in this module: abort the script, surface it
            self._internal_error = error
            table = self._error_table(b"ERR internal error in the embedded store")
        else:
            return self._to_lua(reply)
        if raise_error:
            raise _ErrorReply(table)
        return table

    def _unwrap(self, error: object) -> Any:
        """Lua sees a Python exception raised from redis.call; give back the error table."""
        if isinstance(error, _ErrorReply):
            return error.table
        if isinstance(error, _SandboxError):
            return self._error_table(str(error).encode())
        if isinstance(error, BaseException):
            self._internal_error = error
        return None

    def _error_reply(self, *args: object) -> Any:
        if len(args) != 1 or not isinstance(args[0], bytes):
            return self._error_table(b"wrong number or type of arguments")
        raw = args[0].split(b"\0", 1)[0]
        return self._error_table(raw if raw.startswith(b"-") else b"-" + raw)

    def _status_reply(self, *args: object) -> Any:
        if len(args) != 1 or not isinstance(args[0], bytes):
            return self._error_table(b"wrong number or type of arguments")
        return self._lua.table_from({b"ok": args[0]})

    def _sha1hex(self, *args: object) -> bytes:
        if len(args) != 1:
            raise _ErrorReply(self._error_table(b"wrong number of arguments"))
        value = args[0]
        data = _lua_number_text(value) if isinstance(value, int | float) else value
        return hashlib.sha1(data if isinstance(data, bytes) else b"").hexdigest().encode()

    def _redis_log(self, *args: object) -> tuple[()]:
        if len(args) < 2:
            raise _ErrorReply(self._error_table(b"redis.log() requires two arguments or more."))
        level = _lua_to_number(args[0])
        if level is None:
            raise _ErrorReply(self._error_table(b"First argument must be a number (log level)."))
        if not 0 <= level <= 3:
            raise _ErrorReply(self._error_table(b"Invalid debug level."))
        parts = [
            _lua_number_text(part) if isinstance(part, int | float) else part
            for part in args[1:]
            if isinstance(part, bytes | int | float) and not isinstance(part, bool)
        ]
        _log.log(_LOG_LEVELS[int(level)], "%s", b" ".join(parts).decode("utf-8", "replace"))
        return ()

    def _setresp(self, *args: object) -> tuple[()]:
        if len(args) != 1:
            raise _ErrorReply(self._error_table(b"redis.setresp() requires one argument."))
        version = _lua_to_number(args[0])
        if version is None or int(version) not in (2, 3):
            raise _ErrorReply(self._error_table(b"RESP version must be 2 or 3."))
        if int(version) == 3:
            raise _ErrorReply(self._error_table(b"RESP3 is not supported by the embedded store"))
        return ()

    def _set_repl(self, *args: object) -> tuple[()]:
        if len(args) != 1:
            raise _ErrorReply(self._error_table(b"redis.set_repl() requires two arguments."))
        return ()


def _lua_to_number(value: object) -> float | None:
    """lua_tonumber: numbers, and strings that read as numbers."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bytes):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _plain(reply: Reply) -> Any:
    if isinstance(reply, list):
        return [_plain(item) for item in reply]
    return bytes(reply) if isinstance(reply, bytes) else reply


def _split_shebang(source: bytes) -> tuple[bytes, bool]:
    """Redis 7's "#!lua flags=..." line: validate it, blank it (keeping line numbers)."""
    if not source.startswith(b"#!"):
        return source, False
    line, newline, rest = source.partition(b"\n")
    if not newline:
        raise ScriptError("ERR Invalid script shebang")
    parts = line.split()
    if parts[0] != b"#!lua":
        raise ScriptError(f"ERR Unexpected engine in script shebang: {text(parts[0])}")
    flags: set[bytes] = set()
    for part in parts[1:]:
        if not part.startswith(b"flags="):
            raise ScriptError(f"ERR Unknown lua shebang option: {text(part)}")
        for flag in filter(None, part[6:].split(b",")):
            if flag not in _SHEBANG_FLAGS:
                raise ScriptError(f"ERR Unexpected flag in script shebang: {text(flag)}")
            flags.add(flag)
    return b"\n" + rest, b"no-writes" in flags


_SANDBOX_LUA = r"""
local api, dispatch, unwrap = ...
local G = _G
local type, tostring, error, select, unpack, next = type, tostring, error, select, unpack, next
local rawget, rawset, setmetatable, setfenv = rawget, rawset, setmetatable, setfenv
local xpcall, pcall, loadstring, load, getinfo = xpcall, pcall, loadstring, load, debug.getinfo
local format, gsub, sub, match, concat = string.format, string.gsub, string.sub, string.match,
  table.concat
local INTERNAL = getinfo(1, 'S').source
local protected = setmetatable({}, {__mode = 'k'})

local function readonly_error() error('Attempt to modify a readonly table', 2) end
local function readonly(t)
  local proxy = setmetatable({}, {__index = t, __newindex = readonly_error, __metatable = false})
  protected[proxy] = true
  return proxy
end

-- The globals Redis 7.0 leaves to scripts; everything else (os, io, debug, require, print,
-- loadfile, dofile, setfenv, python, ...) is removed.
local allowed = {}
for name in string.gmatch('string math table coroutine xpcall tostring setmetatable next ' ..
    'assert tonumber rawequal collectgarbage getmetatable rawset pcall type _G select unpack ' ..
    'gcinfo pairs rawget loadstring ipairs _VERSION load error', '%S+') do
  allowed[name] = true
end
for name in pairs(G) do
  if not allowed[name] then G[name] = nil end
end

-- Scripts see this read-only view: a new global or an undefined read is an error, as in Redis.
local env = setmetatable({}, {
  __index = function(_, name)
    local value = rawget(G, name)
    if value == nil then
      error("Script attempted to access nonexistent global variable '" .. tostring(name) .. "'", 2)
    end
    return value
  end,
  __newindex = readonly_error,
  __metatable = false,
})
protected[env] = true

local function unwrap_error(e)
  if type(e) == 'userdata' then return unwrap(e) or e end
  return e
end
local function pack(...) return {n = select('#', ...), ...} end

-- Redis' pcall: an error table {err = "..."} arrives as its message string.
G.pcall = function(...)
  local result = pack(pcall(...))
  if not result[1] then
    local e = unwrap_error(result[2])
    if type(e) == 'table' then
      local message = rawget(e, 'err')
      if type(message) == 'string' or type(message) == 'number' then e = message end
    end
    return false, e
  end
  return unpack(result, 1, result.n)
end
G.xpcall = function(f, handler)
  return xpcall(f, function(e) return handler(unwrap_error(e)) end)
end
G.rawset = function(t, k, v)
  if protected[t] then error('Attempt to modify a readonly table', 0) end
  return rawset(t, k, v)
end
G.loadstring = function(source, name)
  local f, e = loadstring(source, name)
  if f then setfenv(f, env) end
  return f, e
end
G.load = function(source, name)
  local f, e = load(source, name)
  if f then setfenv(f, env) end
  return f, e
end
-- redis.call and redis.pcall: Lua numbers become "%.17g" text here, with C's own formatting
-- (so -0 stays "-0"), then the keyspace runs the command.
local function command_args(...)
  local count, argv = select('#', ...), {...}
  if count == 0 then
    return nil, {err = 'ERR Please specify at least one argument for this redis lib call'}
  end
  for i = 1, count do
    local kind = type(argv[i])
    if kind == 'number' then
      argv[i] = format('%.17g', argv[i])
    elseif kind ~= 'string' then
      return nil, {err = 'ERR Lua redis lib command arguments must be strings or integers'}
    end
  end
  return argv, count
end
api.call = function(...)
  local argv, count = command_args(...)
  if argv == nil then error(count) end
  return dispatch(true, unpack(argv, 1, count))
end
api.pcall = function(...)
  local argv, count = command_args(...)
  if argv == nil then return count end
  return dispatch(false, unpack(argv, 1, count))
end
api.LOG_DEBUG, api.LOG_VERBOSE, api.LOG_NOTICE, api.LOG_WARNING = 0, 1, 2, 3
api.REPL_NONE, api.REPL_AOF, api.REPL_SLAVE, api.REPL_REPLICA, api.REPL_ALL = 0, 1, 2, 2, 3
api.REDIS_VERSION, api.REDIS_VERSION_NUM = '7.0.0', 0x070000
G.redis = readonly(api)
for _, name in ipairs({'string', 'math', 'table', 'coroutine'}) do G[name] = readonly(G[name]) end
local string_meta = getmetatable('')
string_meta.__index, string_meta.__metatable = G.string, false
G._G = env

-- Redis' error handler: the error becomes {err = "CODE message", source = , line = } from the
-- script's frame (the frames of this sandbox and of C functions are skipped). A script that
-- tail-called redis.call ("return redis.call(...)") has no frame left: no source, no line.
local function handler(e)
  local level = 2
  local info = getinfo(level, 'nSl')
  while info and (info.what == 'C' or info.source == INTERNAL) do
    level = level + 1
    info = getinfo(level, 'nSl')
  end
  if info and info.what == 'tail' then info = nil end
  e = unwrap_error(e)
  if type(e) ~= 'table' then e = {err = 'ERR ' .. tostring(e)} end
  if info then e.source, e.line = info.source, info.currentline end
  return e
end

local function describe(e, sha)
  if type(e) ~= 'table' then
    return 'ERR Error running script ' .. sha .. ', ' .. sub(tostring(e), 1, 100)
  end
  local message, source, line = rawget(e, 'err'), rawget(e, 'source'), rawget(e, 'line')
  if type(message) == 'number' then message = tostring(message) end
  if type(message) ~= 'string' then message = 'ERR unknown error' end -- Redis 7.0 crashes here
  message = match(message, '^[^%z]*')
  local t1, t2 = type(source), type(line)
  if (t1 == 'string' or t1 == 'number') and (t2 == 'string' or t2 == 'number') then
    message = message .. ' script: ' .. sha .. ', on ' .. match(tostring(source), '^[^%z]*') ..
      ':' .. tostring(line) .. '.'
  end
  return (gsub(message, '[\r\n]', ' '))
end

local function clean(s) return (gsub(match(s, '^[^%z]*'), '[\r\n]', ' ')) end
local function bulk(s) return '$' .. #s .. '\r\n' .. s .. '\r\n' end
local function double(n)
  if n == 1/0 then return bulk('inf') elseif n == -1/0 then return bulk('-inf') end
  return bulk(format('%.17g', n))
end

-- Lua -> Redis, as luaReplyToRedisReply does, written out as RESP2.
local function encode(v, out, depth)
  if depth > 200 then error('too deep') end
  local t = type(v)
  if t == 'string' then out[#out + 1] = bulk(v)
  elseif t == 'number' then out[#out + 1] = format(':%d\r\n', v) -- a C cast: truncation
  elseif t == 'boolean' then out[#out + 1] = v and ':1\r\n' or '$-1\r\n'
  elseif t ~= 'table' then out[#out + 1] = '$-1\r\n'
  else
    local f = rawget(v, 'err')
    if type(f) == 'string' then out[#out + 1] = '-' .. clean(f) .. '\r\n'; return end
    f = rawget(v, 'ok')
    if type(f) == 'string' then out[#out + 1] = '+' .. clean(f) .. '\r\n'; return end
    f = rawget(v, 'double')
    if type(f) == 'number' then out[#out + 1] = double(f); return end
    f = rawget(v, 'big_number')
    if type(f) == 'string' then out[#out + 1] = bulk((gsub(f, '[\r\n]', ' '))); return end
    f = rawget(v, 'verbatim_string')
    if type(f) == 'table' and type(rawget(f, 'format')) == 'string' and
        type(rawget(f, 'string')) == 'string' then
      out[#out + 1] = bulk(rawget(f, 'string')); return
    end
    local slot, count = #out + 1, 0
    out[slot] = false
    local map, set = rawget(v, 'map'), rawget(v, 'set')
    if type(map) == 'table' then
      for key, value in next, map do
        encode(key, out, depth + 1); encode(value, out, depth + 1); count = count + 2
      end
    elseif type(set) == 'table' then
      for key in next, set do encode(key, out, depth + 1); count = count + 1 end
    else
      while true do
        local item = rawget(v, count + 1)
        if item == nil then break end
        encode(item, out, depth + 1)
        count = count + 1
      end
    end
    out[slot] = '*' .. count .. '\r\n'
  end
end

local function compile(source)
  local f, e = loadstring(source, '@user_script')
  if f then setfenv(f, env) end
  return f, e
end

local function run(f, keys, argv, sha)
  rawset(G, 'KEYS', keys)
  rawset(G, 'ARGV', argv)
  local ok, result = xpcall(f, handler)
  if not ok then return false, describe(result, sha) end
  local out = {}
  if pcall(encode, result, out, 0) then return true, concat(out) end
  return false, 'ERR reached lua stack limit'
end

return compile, run
"""
