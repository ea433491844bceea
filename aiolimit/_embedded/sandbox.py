"""The Lua side of the embedded backend: Redis 7.0's scripting environment on real Lua 5.1.

Scripts run on lupa's Lua 5.1, the version Redis embeds, inside a copy of Redis 7.0's sandbox:
the same globals (read-only, and reading an undefined one is an error),
``redis.call``/``pcall``/``error_reply``/``status_reply``/``sha1hex``/``log``, the same reply
conversions both ways (Lua numbers are truncated to integers, a table stops at its first nil,
``{ok=}`` and ``{err=}`` tables) and the same error messages. ``redis.call`` reaches the
keyspace through ``_embedded_commands.execute``; ``replies`` converts the replies.
"""

from __future__ import annotations

import hashlib
import logging
from typing import TYPE_CHECKING, Any

from lupa.lua51 import LuaRuntime

from .commands import execute
from .replies import CommandError, error_table, to_lua

if TYPE_CHECKING:
    from .keyspace import Keyspace

_log = logging.getLogger("aiolimit.embedded")
_LOG_LEVELS = (logging.DEBUG, logging.DEBUG, logging.INFO, logging.WARNING)


class _ErrorReply(Exception):
    """Raised by redis.call and friends: carries the Lua error table Redis would raise."""

    def __init__(self, table: Any) -> None:
        super().__init__("redis error reply")
        self.table = table


class _SandboxError(AttributeError):
    """A script reached for an attribute of a Python object (redis.call.__globals__...)."""


def _deny_attribute(obj: object, name: object, is_setting: bool) -> object:
    raise _SandboxError("scripts cannot reach Python attributes")


def _lua_number_text(value: int | float) -> bytes:
    """What lua_tostring gives for a number ("%.14g")."""
    return b"%.14g" % value


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


class Sandbox:
    """One Lua state set up as Redis' scripting environment, its redis.* calls on a keyspace."""

    def __init__(self, keyspace: Keyspace) -> None:
        self._keyspace = keyspace
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

    def compile(self, source: bytes) -> tuple[Any, Any]:
        """The script as a Lua function, or None and the compiler's message."""
        function, error = self._compile(source)
        return function, error

    def run(
        self, function: Any, keys: list[bytes], args: list[bytes], sha: str, *, read_only: bool
    ) -> tuple[bool, bytes]:
        """Run a compiled script: (True, its reply as RESP2) or (False, Redis' error line).

        An exception raised inside the bridge (a bug here, not in the script) is re-raised.
        """
        keys_table = self._lua.table_from(keys)
        args_table = self._lua.table_from(args)
        self._read_only, self._internal_error = read_only, None
        try:
            ok, payload = self._run(function, keys_table, args_table, sha.encode())
        finally:
            self._read_only = False
        if self._internal_error is not None:
            raise self._internal_error
        return ok, payload

    def _dispatch(self, raise_error: bool, *args: bytes) -> Any:
        """redis.call (raise_error) and redis.pcall, after the Lua side turned numbers to text."""
        try:
            reply = execute(self._keyspace, args, from_script=True, read_only=self._read_only)
        except CommandError as error:
            raw = str(error).encode("utf-8", "surrogateescape")
            table = error_table(self._lua, b"-" + raw, from_command=True)
        except Exception as error:  # a bug in this module: abort the script, surface it
            self._internal_error = error
            table = error_table(self._lua, b"ERR internal error in the embedded store")
        else:
            return to_lua(self._lua, reply)
        if raise_error:
            raise _ErrorReply(table)
        return table

    def _unwrap(self, error: object) -> Any:
        """Lua sees a Python exception raised from redis.call; give back the error table."""
        if isinstance(error, _ErrorReply):
            return error.table
        if isinstance(error, _SandboxError):
            return error_table(self._lua, str(error).encode())
        if isinstance(error, BaseException):
            self._internal_error = error
        return None

    def _error_reply(self, *args: object) -> Any:
        if len(args) != 1 or not isinstance(args[0], bytes):
            return error_table(self._lua, b"wrong number or type of arguments")
        raw = args[0].split(b"\0", 1)[0]
        return error_table(self._lua, raw if raw.startswith(b"-") else b"-" + raw)

    def _status_reply(self, *args: object) -> Any:
        if len(args) != 1 or not isinstance(args[0], bytes):
            return error_table(self._lua, b"wrong number or type of arguments")
        return self._lua.table_from({b"ok": args[0]})

    def _sha1hex(self, *args: object) -> bytes:
        if len(args) != 1:
            raise _ErrorReply(error_table(self._lua, b"wrong number of arguments"))
        value = args[0]
        data = _lua_number_text(value) if isinstance(value, int | float) else value
        return hashlib.sha1(data if isinstance(data, bytes) else b"").hexdigest().encode()

    def _redis_log(self, *args: object) -> tuple[()]:
        if len(args) < 2:
            raise _ErrorReply(
                error_table(self._lua, b"redis.log() requires two arguments or more.")
            )
        level = _lua_to_number(args[0])
        if level is None:
            raise _ErrorReply(
                error_table(self._lua, b"First argument must be a number (log level).")
            )
        if not 0 <= level <= 3:
            raise _ErrorReply(error_table(self._lua, b"Invalid debug level."))
        parts = [
            _lua_number_text(part) if isinstance(part, int | float) else part
            for part in args[1:]
            if isinstance(part, bytes | int | float) and not isinstance(part, bool)
        ]
        _log.log(_LOG_LEVELS[int(level)], "%s", b" ".join(parts).decode("utf-8", "replace"))
        return ()

    def _setresp(self, *args: object) -> tuple[()]:
        if len(args) != 1:
            raise _ErrorReply(error_table(self._lua, b"redis.setresp() requires one argument."))
        version = _lua_to_number(args[0])
        if version is None or int(version) not in (2, 3):
            raise _ErrorReply(error_table(self._lua, b"RESP version must be 2 or 3."))
        if int(version) == 3:
            raise _ErrorReply(
                error_table(self._lua, b"RESP3 is not supported by the embedded store")
            )
        return ()

    def _set_repl(self, *args: object) -> tuple[()]:
        if len(args) != 1:
            raise _ErrorReply(error_table(self._lua, b"redis.set_repl() requires two arguments."))
        return ()


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
