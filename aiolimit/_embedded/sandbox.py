"""The Lua side of the embedded engine: Redis 7.0's scripting environment on real Lua 5.1.

Scripts run on lupa's Lua 5.1, the version Redis embeds, inside a copy of Redis 7.0's sandbox:
the same globals (read-only, and reading an undefined one is an error, so no script can leak
state into the next), ``redis.call``, ``redis.pcall`` and ``redis.error_reply``, the same error
messages, and the same reply conversions both ways: a command's nil is ``false``, a status is
``{ok = ...}``; a script's Lua number is truncated to an integer, ``true`` is 1, ``false`` and
nil are nil, a table is an array that stops at its first nil, or an ``{err = }`` / ``{ok = }``
reply. ``redis.call`` reaches the keyspace through ``commands.execute``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lupa.lua51 import LuaRuntime, lua_type

from .commands import execute
from .keyspace import CommandError, Reply, Status
from .numbers import LLONG_MAX, LLONG_MIN

if TYPE_CHECKING:
    from .keyspace import Keyspace

_MAX_DEPTH = 200  # nesting of a script's reply (a table holding itself would never end)


class ScriptError(Exception):
    """A script or command failed; the message is the error line Redis would send."""


def _deny_attribute(obj: object, name: object, is_setting: bool) -> object:
    raise AttributeError("scripts cannot reach Python attributes")


def _clean(raw: bytes) -> bytes:
    """A status or error line as Redis writes it: cut at NUL, newlines become spaces."""
    return raw.split(b"\0", 1)[0].replace(b"\r", b" ").replace(b"\n", b" ")


def _error(raw: bytes) -> ScriptError:
    return ScriptError(_clean(raw).decode("utf-8", "replace"))


class Sandbox:
    """One Lua state set up as Redis' scripting environment, its redis.* calls on a keyspace."""

    def __init__(self, keyspace: Keyspace) -> None:
        self._keyspace = keyspace
        self._internal_error: BaseException | None = None
        self._lua = LuaRuntime(
            encoding=None,
            register_eval=False,
            register_builtins=False,
            unpack_returned_tuples=True,
            attribute_filter=_deny_attribute,
        )
        self._compile, self._run = self._lua.execute(_SANDBOX_LUA, self._dispatch)

    def compile(self, source: bytes) -> Any:
        """The script as a Lua function; a syntax error raises Redis' message."""
        function, error = self._compile(source)
        if function is None:
            message = _clean(error).decode("utf-8", "surrogateescape")
            raise ScriptError(f"ERR Error compiling script (new function): {message}")
        return function

    def run(self, function: Any, keys: list[bytes], args: list[bytes], sha: str) -> Any:
        """Run a compiled script: its reply as redis-py returns it, or ScriptError.

        An exception raised inside the bridge (a bug here, not in the script) is re-raised.
        """
        self._internal_error = None
        ok, result = self._run(
            function, self._lua.table_from(keys), self._lua.table_from(args), sha.encode()
        )
        if self._internal_error is not None:
            raise self._internal_error
        if not ok:
            raise _error(result)
        reply = _from_lua(result, 0)
        if isinstance(reply, ScriptError):
            raise reply
        return reply

    def _dispatch(self, *args: bytes) -> tuple[bool, Any]:
        """redis.call and redis.pcall, after the Lua side turned numbers to text."""
        try:
            return True, self._to_lua(execute(self._keyspace, args, from_script=True))
        except CommandError as error:
            return False, str(error).encode("utf-8", "surrogateescape")
        except Exception as error:  # a bug in this package: abort the script, surface it
            self._internal_error = error
            return False, b"ERR internal error in the embedded store"

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


def _from_lua(value: Any, depth: int) -> Any:
    """Lua -> Redis, as luaReplyToRedisReply does, read back as redis-py (bytes mode) would.

    An error reply nested in an array is returned as a ScriptError instance, as redis-py
    returns a ResponseError; the caller raises one found at the top.
    """
    if isinstance(value, bytes):
        return value
    if isinstance(value, bool):
        return 1 if value else None
    if isinstance(value, int | float):
        # C's (long long) cast: truncation toward zero; NaN and out of range give LLONG_MIN.
        return int(value) if LLONG_MIN <= value <= LLONG_MAX else LLONG_MIN
    if lua_type(value) != "table":
        return None
    if depth > _MAX_DEPTH:
        raise ScriptError("ERR reached lua stack limit")
    fields = dict(value.items())  # a raw traversal, as Redis' lua_rawget: no metamethods
    for name in (b"err", b"ok"):
        text = fields.get(name)
        if isinstance(text, bytes):
            return _error(text) if name == b"err" else _clean(text)
    items: list[Any] = []
    while (item := fields.get(len(items) + 1)) is not None:
        items.append(_from_lua(item, depth + 1))
    return items


_SANDBOX_LUA = r"""
local dispatch = ...
local G = _G
local type, tostring, error, select, unpack = type, tostring, error, select, unpack
local rawget, rawset, setmetatable, setfenv = rawget, rawset, setmetatable, setfenv
local xpcall, pcall, loadstring, load, getinfo = xpcall, pcall, loadstring, load, debug.getinfo
local find, format, gsub, sub, match = string.find, string.format, string.gsub, string.sub,
  string.match
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

local function pack(...) return {n = select('#', ...), ...} end

-- Redis' pcall: an error table {err = "..."} arrives as its message string.
G.pcall = function(...)
  local result = pack(pcall(...))
  if not result[1] then
    local e = result[2]
    if type(e) == 'table' then
      local message = rawget(e, 'err')
      if type(message) == 'string' or type(message) == 'number' then e = message end
    end
    return false, e
  end
  return unpack(result, 1, result.n)
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

-- Redis' luaPushErrorBuff: "-CODE message" or "message" becomes {err = "CODE message"}.
local function error_table(raw)
  raw = match(raw, '^[^%z]*')
  local code, message = 'ERR', raw
  if sub(raw, 1, 1) == '-' then
    local space = find(raw, ' ', 1, true)
    if space then code, message = sub(raw, 2, space - 1), sub(raw, space + 1)
    else message = sub(raw, 2) end
  end
  message = gsub(gsub(message, '^[\r\n]+', ''), '[\r\n]+$', '')
  return {err = code .. ' ' .. message}
end

-- One command for redis.call and redis.pcall: Lua numbers become "%.17g" text here, with C's
-- own formatting (so -0 stays "-0"), then the keyspace runs it. No Lua function below is
-- tail-called on the way to an error: a lost frame would hide the script's line number.
local function command(...)
  local count, argv = select('#', ...), {...}
  if count == 0 then
    return false, {err = 'ERR Please specify at least one argument for this redis lib call'}
  end
  for i = 1, count do
    local kind = type(argv[i])
    if kind == 'number' then
      argv[i] = format('%.17g', argv[i])
    elseif kind ~= 'string' then
      return false, {err = 'ERR Lua redis lib command arguments must be strings or integers'}
    end
  end
  local ok, reply = dispatch(unpack(argv, 1, count))
  if ok then return true, reply end
  local e = error_table('-' .. reply)
  e.ignore_error_stats_update = true
  return false, e
end

local api = {}
api.call = function(...)
  local ok, reply = command(...)
  if not ok then error(reply) end
  return reply
end
api.pcall = function(...)
  local _, reply = command(...)
  return reply
end
api.error_reply = function(...)
  local message = ...
  if select('#', ...) ~= 1 or type(message) ~= 'string' then
    return error_table('wrong number or type of arguments')
  end
  if sub(message, 1, 1) ~= '-' then message = '-' .. message end
  return error_table(message)
end
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
  return message
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
  return true, result
end

return compile, run
"""
