"""The embedded store runs Redis scripts as Redis 7 does: most tests run the same script on a
real server and on EmbeddedStore and compare the replies, the errors and the keys left behind.

The real client speaks RESP2 (redis-py 8 defaults to RESP3): the store answers with the values
redis-py returns over RESP2. The store implements only the commands the scripts call, so every
script here sticks to those.
Error messages are compared as redis-py shows them (it drops known codes such as "ERR ").
"""

from __future__ import annotations

import hashlib
import itertools
import shlex
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis._parsers.base import BaseParser

from aiolimit._embedded.store import EmbeddedStore, NoScriptError, ScriptError

Outcome = tuple[str, Any]

RUN_COMMANDS = """
local out, i = {}, 1
while i <= #ARGV do
  local n = tonumber(ARGV[i])
  out[#out + 1] = redis.pcall(unpack(ARGV, i + 1, i + n))
  i = i + n + 1
end
return out
"""

# What each key holds, told apart without TYPE (not an engine command): a read of the wrong
# kind fails with WRONGTYPE, so try a string, then a hash, then a sorted set.
SNAPSHOT = """
local out = {}
for i, key in ipairs(KEYS) do
  local kind, value = 'string', redis.pcall('GET', key)
  if type(value) == 'table' then kind, value = 'hash', redis.pcall('HGETALL', key) end
  if type(value) == 'table' and value.err then
    kind, value = 'zset', redis.call('ZRANGE', key, 0, -1, 'WITHSCORES')
  end
  local ttl = redis.call('PTTL', key)
  if ttl == -2 then kind = 'none' end
  out[i] = {kind, value, ttl >= 0 and 'volatile' or ttl}
end
return out
"""


class ManualClock:
    """A clock the test moves by hand (seconds, like time.monotonic)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def real(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, protocol=2)
    yield client
    client.close()


@pytest.fixture
def store() -> EmbeddedStore:
    return EmbeddedStore()


def _redis_py_text(message: str) -> str:
    """The text redis-py shows for an error line: known codes ("ERR", "NOSCRIPT") dropped."""
    code, _, rest = message.partition(" ")
    return rest if code in BaseParser.EXCEPTION_CLASSES else message


def _plain(value: Any) -> Any:
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, ScriptError):
        return ("error", _redis_py_text(str(value)))
    if isinstance(value, redis.ResponseError):
        return ("error", str(value))
    return value


def on_redis(client: redis.Redis, source: str, keys: Sequence[Any], args: Sequence[Any]) -> Outcome:
    try:
        return "reply", _plain(client.eval(source, len(keys), *keys, *args))
    except redis.ResponseError as error:
        return "error", str(error)


def on_embedded(
    store: EmbeddedStore, source: str, keys: Sequence[Any], args: Sequence[Any]
) -> Outcome:
    try:
        return "reply", _plain(store.eval(source, keys, args))
    except ScriptError as error:
        return "error", _redis_py_text(str(error))


def assert_same(
    client: redis.Redis,
    store: EmbeddedStore,
    source: str,
    keys: Sequence[Any] = (),
    args: Sequence[Any] = (),
) -> Outcome:
    """Run a script on both, compare the outcome and what the keys hold afterwards."""
    expected, actual = on_redis(client, source, keys, args), on_embedded(store, source, keys, args)
    assert actual == expected
    if keys:
        assert on_embedded(store, SNAPSHOT, keys, ()) == on_redis(client, SNAPSHOT, keys, ())
    return actual


def run_commands(
    client: redis.Redis, store: EmbeddedStore, prefix: str, commands: Sequence[Sequence[str]]
) -> Outcome:
    """Run commands ("{a}" and "{b}" name this test's keys) in one script, on both sides."""
    keys = [f"{prefix}:a", f"{prefix}:b"]
    args: list[str] = []
    for command in commands:
        args.append(str(len(command)))
        args.extend(arg.replace("{a}", keys[0]).replace("{b}", keys[1]) for arg in command)
    return assert_same(client, store, RUN_COMMANDS, keys, args)


# ------------------------------------------------------------------ reply conversion

REPLIES = {
    "float truncated toward zero": "return 3.99",
    "negative float truncated toward zero": "return -3.99",
    "out of range and NaN become LLONG_MIN": "return {1e30, 1/0, -1/0, 0/0, 2^63}",
    "array stops at the first nil": "return {1, 2, nil, 4}",
    "false inside an array is nil": "return {1, false, 3}",
    "true is 1": "return true",
    "false is nil": "return false",
    "nil is nil": "return nil",
    "no value is nil": "return",
    "only the first of several values": "return 1, 2",
    "a function is nil": "return function() end",
    "nested tables": "return {1, {2, {3, 'x'}}, 'y', {}}",
    "binary strings": "return 'a\\0b\\255'",
    "ok table": "return {ok = 'fine'}",
    "status newlines become spaces": "return {ok = 'a\\r\\nb'}",
    "status stops at NUL": "return {ok = 'a\\0b'}",
    "error reply": "return redis.error_reply('My Error')",
    "error reply with a code": "return redis.error_reply('-X bad')",
    "empty error reply": "return redis.error_reply('')",
    "error reply newlines": "return redis.error_reply('a\\r\\nb')",
    "error reply stops at NUL": "return redis.error_reply('a\\0b')",
    "err table": "return {err = 'plain'}",
    "empty err table": "return {err = ''}",
    "err newlines become spaces": "return {err = 'a\\nb'}",
    "err wins over ok": "return {ok = 'x', err = 'y'}",
    "non-string err and ok are ignored": "return {err = 5, ok = 6, 1, 2}",
    "error inside an array": "return {1, redis.error_reply('inner'), 3}",
    "status inside an array": "return {1, {ok = 'S'}, 3}",
    "bad error_reply argument": "return redis.error_reply(5)",
    "KEYS and ARGV are string arrays": "return {KEYS, ARGV}",
    "status reply seen by Lua": (
        "local r = redis.call('SET', KEYS[1], 'v') return {type(r), r.ok}"
    ),
    "nil reply seen by Lua": "local r = redis.call('GET', KEYS[2]) return {type(r), tostring(r)}",
    "integer reply seen by Lua": (
        "local r = redis.call('HSET', KEYS[1], 'f', 'v') return {type(r), r}"
    ),
    "pcall error table": (
        "redis.call('SET', KEYS[1], 'a') local e = redis.pcall('HGETALL', KEYS[1]) "
        "local r = {} for k, v in pairs(e) do r[#r + 1] = k .. '=' .. tostring(v) end "
        "table.sort(r) return r"
    ),
    "pcall of redis.call gives the message": (
        "redis.call('SET', KEYS[1], 'a') local ok, e = pcall(redis.call, 'HGETALL', KEYS[1]) "
        "return {tostring(ok), type(e), e}"
    ),
    "pcall of bad arguments": (
        "local ok, e = pcall(redis.call, 'GET', {}) return {tostring(ok), type(e), e}"
    ),
    "redis.pcall of bad arguments": "return redis.pcall('GET', {})",
    "redis.pcall with no arguments": "return redis.pcall()",
    "redis.pcall of an unknown command": "return redis.pcall('NOPE', 'x')",
    "redis.pcall with the wrong arity": "return redis.pcall('GET')",
    "command syntax errors": "return redis.pcall('SET', KEYS[1], 'v', 'FOO')",
    "Lua's own number formatting": "return tostring(0.1) .. ' ' .. tostring(1/3) .. ' ' .. 1e20",
    "the libraries Redis keeps": (
        "return {type(loadstring), type(load), type(rawset), type(coroutine), type(unpack), "
        "type(_G), type(string.format), type(math.floor), type(table.concat), type(gcinfo), "
        "type(xpcall), type(select), _VERSION}"
    ),
}


@pytest.mark.parametrize("source", REPLIES.values(), ids=REPLIES.keys())
def test_replies_convert_like_redis(
    real: redis.Redis, store: EmbeddedStore, prefix: str, source: str
) -> None:
    """Lua values become the replies Redis sends, and Redis replies the Lua values it gives."""
    assert_same(real, store, source, [f"{prefix}:a", f"{prefix}:b"], ["x", "2"])


def test_lua_number_truncation_examples(store: EmbeddedStore) -> None:
    """The returned numbers are truncated toward zero and arrays stop at nil (spelled out)."""
    assert store.eval("return 3.99", [], []) == 3
    assert store.eval("return -3.99", [], []) == -3
    assert store.eval("return {1, 2, nil, 4}", [], []) == [1, 2]
    assert store.eval("return {1, false, 3}", [], []) == [1, None, 3]
    assert store.eval("return {true, 'x', {2}}", [], []) == [1, b"x", [2]]
    assert store.eval("return {ok = 'OK'}", [], []) == b"OK"
    with pytest.raises(ScriptError, match=r"^My Error$"):
        store.eval("return redis.error_reply('My Error')", [], [])


# ---------------------------------------------------------------------- script errors

ERRORS = {
    "error with a string": "error('boom')",
    "error with a table": "error({err = 'tbl'})",
    "error with a dashed table": "error({err = '-tbl'})",
    "error with a coded table": "error({err = 'WRONGTYPE zz'})",
    "error with a number": "error(5)",
    "error with nothing": "error()",
    "error without position": "error('x', 0)",
    "error with a newline": "error('a\\nb')",
    "runtime error on line 3": "local a = 1\nlocal t = nil\nreturn t.x",
    "arithmetic on a string": "return 'a' + 1",
    "error in a nested function": (
        "local function f() error('deep') end\nlocal function g() f() end\ng()"
    ),
    "undefined global": "return y",
    "new global": "x = 5",
    "overwrite a global": "KEYS = {}",
    "rawset on _G": "rawset(_G, 'zz', 1) return zz",
    "library tables are read-only": "string.foo = 1",
    "os is gone": "return os",
    "io is gone": "return io",
    "debug is gone": "return debug",
    "require is gone": "return require",
    "loadfile is gone": "return loadfile",
    "dofile is gone": "return dofile",
    "print is gone": "return print",
    "setfenv is gone": "return setfenv",
    "loadstring cannot reach os": "return loadstring('return os')()",
    "unknown command": "local r = redis.call('NOPE')\nreturn r",
    "wrong arity": "local r = redis.call('GET')\nreturn r",
    "no arguments": "local r = redis.call()\nreturn r",
    "table argument": "local r = redis.call('GET', {})\nreturn r",
    "nil argument": "local r = redis.call('GET', nil)\nreturn r",
    "wrong type": (
        "redis.call('HSET', KEYS[1], 'f', 'v')\nlocal r = redis.call('GET', KEYS[1])\nreturn r"
    ),
    "command error": (
        "redis.call('SET', KEYS[1], 'a')\nlocal r = redis.call('PEXPIRE', KEYS[1], 'x')\nreturn r"
    ),
    "compile error": "return x +",
}


@pytest.mark.parametrize("source", ERRORS.values(), ids=ERRORS.keys())
def test_errors_read_like_redis(
    real: redis.Redis, store: EmbeddedStore, prefix: str, source: str
) -> None:
    """A failing script raises Redis' exact message, with the script's sha and line."""
    kind, _ = assert_same(real, store, source, [f"{prefix}:a"], [])
    assert kind == "error"


def test_a_tail_called_failing_command_has_no_line(real: redis.Redis, store: EmbeddedStore) -> None:
    """Known difference: `return redis.call(...)` failing lacks Redis' " script: ..." suffix."""
    source = "return redis.call('NOPE')"
    sha = hashlib.sha1(source.encode()).hexdigest()
    assert on_redis(real, source, [], []) == (
        "error",
        f"Unknown Redis command called from script script: {sha}, on @user_script:1.",
    )
    assert on_embedded(store, source, [], []) == (
        "error",
        "Unknown Redis command called from script",
    )


def test_script_error_carries_the_code(store: EmbeddedStore) -> None:
    """ScriptError's message is Redis' whole error line, code included."""
    store.execute_command("HSET", "h", "f", "v")
    with pytest.raises(ScriptError) as caught:
        store.eval("local r = redis.call('GET', KEYS[1]) return r", ["h"], [])
    sha = hashlib.sha1(b"local r = redis.call('GET', KEYS[1]) return r").hexdigest()
    assert str(caught.value) == (
        "WRONGTYPE Operation against a key holding the wrong kind of value "
        f"script: {sha}, on @user_script:1."
    )


# ---------------------------------------------------------------- numbers as arguments

NUMBERS = ["0.1", "1/3", "5", "1e20", "-0", "1/0", "-1/0", "0/0", "2^53 + 1", "2^63"]
NUMBERS += ["123456789012345678", "-1.5e-7", "1e-310", "0.1 + 0.2"]


@pytest.mark.parametrize("number", NUMBERS)
def test_lua_number_arguments_are_written_like_redis(
    real: redis.Redis, store: EmbeddedStore, prefix: str, number: str
) -> None:
    """A Lua number passed to redis.call reaches the command as Redis writes it ("%.17g")."""
    source = f"redis.call('SET', KEYS[1], {number}) return redis.call('GET', KEYS[1])"
    assert_same(real, store, source, [f"{prefix}:a"], [])


def test_negative_zero_is_not_an_integer(
    real: redis.Redis, store: EmbeddedStore, prefix: str
) -> None:
    """-x with x = 0 is "-0", which PEXPIRE refuses: the embedded store must not hide that."""
    source = (
        "local x = 0 "
        "return {redis.pcall('PEXPIRE', KEYS[1], -x), redis.pcall('PEXPIRE', KEYS[1], x)}"
    )
    _, reply = assert_same(real, store, source, [f"{prefix}:a"], [])
    assert reply == [("error", "value is not an integer or out of range"), 0]


# ------------------------------------------------------------------------- commands

COMMANDS = {
    "del counts keys": """
        SET {a} 1; HSET {b} f v; DEL {a} {a} {b}; DEL {a}; DEL; GET {a}
    """,
    "ttl replies": """
        PTTL {a}; SET {a} v; PTTL {a}; PEXPIRE {a} 1700; SET {a} w; PTTL {a}; PEXPIRE {b} 100;
        HSET {b} f v; PEXPIRE {b} 100000
    """,
    "expire errors": """
        SET {a} v; PEXPIRE {a} 10 FOO; PEXPIRE {a} ten; PEXPIRE {a} 9223372036854775807;
        PEXPIRE {a} 1.5; PEXPIRE {a}; PTTL {a}; PEXPIRE {b} 9223372036854775807;
        PEXPIRE {b} ten
    """,
    "expire in the past deletes": """
        SET {a} v; PEXPIRE {a} -1; PTTL {a}; SET {b} v; PEXPIRE {b} 0; GET {b};
        SET {a} v; PEXPIRE {a} -9223372036854775808; GET {a}
    """,
    "set with a ttl": """
        SET {a} v PX 5000; SET {a} v2; PTTL {a}; GET {a}; SET {b} v px 100 PX 200000; GET {b}
    """,
    "set option errors": """
        SET {a} v PX; SET {a} v PX 0; SET {a} v PX -5; SET {a} v PX abc;
        SET {a} v PX 9223372036854775807; SET {a} v FOO; SET {a} v PX 5 FOO; SET {a}; GET {a}
    """,
    "set replaces a hash": """
        HSET {a} f v; SET {a} s; GET {a}
    """,
    "integer parsing is strict": """
        SET {a} v; PEXPIRE {a} 1.5; PEXPIRE {a} ' 1'; PEXPIRE {a} 01; PEXPIRE {a} +1;
        PEXPIRE {a} -0; PEXPIRE {a} ''; PEXPIRE {a} 1e3; PEXPIRE {a} 99999999999999999999;
        PEXPIRE {a} -9223372036854775809; PTTL {a}
    """,
    "hash basics": """
        HSET {a} f1 v1 f2 v2; HSET {a} f1 w f3 v3; HGETALL {a}; HGETALL {b}
    """,
    "hash deletes keep order and drop empty hashes": """
        HSET {a} f1 1 f2 2 f3 3; HDEL {a} f2 f2 zz; HSET {a} f2 x; HGETALL {a};
        HDEL {a} f1 f2 f3; PTTL {a}; HGETALL {a}; HDEL {b} x; HSET {b} g 1; PEXPIRE {b} 5000;
        HSET {b} h 2; HDEL {b} g
    """,
    "hash argument errors": """
        HSET {a} f v g; HSET {a} f; HDEL {a}; HGETALL {a} {b}; HGETALL {a}
    """,
    "exists": """
        EXISTS {a}; HSET {a} f v; EXISTS {a}; EXISTS {a} {a} {b}; SET {b} s; EXISTS {a} {b};
        HDEL {a} f; EXISTS {a} {b}; EXISTS
    """,
    "hmget": """
        HSET {a} f1 v1 f2 v2; HMGET {a} f1; HMGET {a} f2 zz f1 f1; HMGET {b} f1 f2;
        HMGET {a}; HMGET; HDEL {a} f1; HMGET {a} f1 f2; SET {b} s; HMGET {b} f1
    """,
    "wrong types": """
        SET {a} s; HSET {b} f v; HSET {a} f v; HGETALL {a}; HDEL {a} f; GET {b}; ZADD {a} 1 m;
        ZADD {b} XX 1 m; ZRANGE {b} 0 -1; ZRANGEBYSCORE {b} 0 1; ZREM {b} m; ZCOUNT {b} 0 1;
        ZREMRANGEBYSCORE {b} 0 1; PEXPIRE {b} 100000; SET {b} x; GET {b}
    """,
    "unknown commands and arity": """
        NOPE x; GET; GET {a} {b}; ZADD {a} 1; TIME x; PTTL; get {a}; gEt {a}
    """,
    "zadd basics": """
        ZADD {a} 1 m1 2 m2; ZADD {a} 3 m1 4 m3; ZADD {a} 1 m1 1 m1 5 m5;
        ZRANGE {a} 0 -1 WITHSCORES; ZADD {a} XX 8 m1 8 m8; ZADD {a} xx 8 m1;
        ZRANGE {a} 0 -1 WITHSCORES; ZADD {b} XX 1 m; PTTL {b}
    """,
    "zadd errors": """
        ZADD {a} 1 a 2; ZADD {a} x a; ZADD {a} nan a; ZADD {a} 1e400 a; ZADD {a} ' 1' a;
        ZADD {a} '1 ' a; ZADD {a} '' a; ZADD {a} 1e-400 a; ZADD {a} 1 ok bad no; ZADD {a} XX 1;
        ZADD {a} XX 1 a 2; PTTL {a}
    """,
    "zadd scores are formatted like redis": """
        ZADD {a} 0.1 a -0 b inf c -inf d 1e-310 e;
        ZADD {a} 0x10 f +5 g 1E3 h -.5 i 1. j Infinity k 1700000000123456 l 0.30000000000000004 m;
        ZRANGE {a} 0 -1 WITHSCORES
    """,
    "equal scores order by member": """
        ZADD {a} 1 b 1 a 1 c 0 z 2 0; ZRANGE {a} 0 -1; ZRANGE {a} -1 -1 WITHSCORES
    """,
    "zrange by rank": """
        ZADD {a} 1 a 2 b 3 c 4 d; ZRANGE {a} 0 1; ZRANGE {a} -2 -1 WITHSCORES;
        ZRANGE {a} -100 100; ZRANGE {a} 3 1; ZRANGE {a} 4 10; ZRANGE {a} 0 -5; ZRANGE {b} 0 -1;
        ZRANGE {a} a 1; ZRANGE {a} 0.5 1; ZRANGE {a} 0 1 withscores; ZRANGE {a} 0 1 BYLEX2;
        ZRANGE {a} 0 1 WITHSCORES FOO
    """,
    "zrange by score": """
        ZADD {a} 1 a 2 b 3 c 4 d; ZRANGEBYSCORE {a} (1 +inf; ZRANGEBYSCORE {a} -inf (3;
        ZRANGEBYSCORE {a} '' ' 2'; ZRANGEBYSCORE {a} 2 2 WITHSCORES; ZRANGEBYSCORE {a} (2 2;
        ZRANGEBYSCORE {a} 3 1; ZRANGEBYSCORE {a} -inf +inf LIMIT 1 2;
        ZRANGEBYSCORE {a} -inf +inf LIMIT 1 -1 WITHSCORES;
        ZRANGEBYSCORE {a} -inf +inf WITHSCORES LIMIT 2 1;
        ZRANGEBYSCORE {a} -inf +inf LIMIT -1 2; ZRANGEBYSCORE {a} -inf +inf LIMIT 4 2;
        ZRANGEBYSCORE {a} -inf +inf LIMIT 0 0; ZRANGEBYSCORE {a} ( 1e400;
        ZRANGEBYSCORE {a} 0x1 (0x4; ZRANGEBYSCORE {a} a b; ZRANGEBYSCORE {a} 1 nan;
        ZRANGEBYSCORE {a} 1 '2 '; ZRANGEBYSCORE {a} 1 2 LIMIT 1; ZRANGEBYSCORE {a} 1 2 REV;
        ZRANGEBYSCORE {a} 1 2 LIMIT x 1; ZRANGEBYSCORE {b} 0 1
    """,
    "zcount": """
        ZADD {a} 1 a 2 b 3 c; ZCOUNT {a} -inf +inf; ZCOUNT {a} (1 3; ZCOUNT {a} 2 (2;
        ZCOUNT {b} 0 9; ZCOUNT {a} 1 x; ZCOUNT {b} x 1
    """,
    "zrem and empty sorted sets disappear": """
        ZADD {a} 1 a 2 b; ZREM {a} a a zz; ZREM {b} a; ZREM {a} b; ZRANGE {a} 0 -1; PTTL {a}
    """,
    "zremrangebyscore": """
        ZADD {a} 1 a 2 b 3 c 4 d; ZREMRANGEBYSCORE {a} (1 2; ZREMRANGEBYSCORE {a} 5 9;
        ZREMRANGEBYSCORE {a} x 9; ZREMRANGEBYSCORE {b} 0 9; ZRANGE {a} 0 -1;
        ZREMRANGEBYSCORE {a} -inf +inf; PTTL {a}
    """,
}


def parse_commands(script: str) -> list[list[str]]:
    """ "SET {a} v NX; GET {a}" -> [["SET", "{a}", "v", "NX"], ["GET", "{a}"]] (shell quoting)."""
    return [shlex.split(command) for command in script.split(";") if command.strip()]


@pytest.mark.parametrize("commands", COMMANDS.values(), ids=COMMANDS.keys())
def test_commands_behave_like_redis(
    real: redis.Redis, store: EmbeddedStore, prefix: str, commands: str
) -> None:
    """Each command's replies, errors and effects match Redis 7, option by option."""
    run_commands(real, store, prefix, parse_commands(commands))


def test_time_comes_from_the_wall_clock(real: redis.Redis) -> None:
    """TIME is {seconds, microseconds} as strings, read from the injected wall clock."""
    store = EmbeddedStore(wall=lambda: 1_700_000_000.123456)
    assert store.eval("return redis.call('TIME')", [], []) == [b"1700000000", b"123456"]
    seconds, micros = real.eval("return redis.call('TIME')", 0)
    assert seconds.isdigit() and micros.isdigit() and int(micros) < 1_000_000


def test_direct_commands_fail_like_redis(real: redis.Redis, store: EmbeddedStore) -> None:
    """Outside scripts, unknown commands and bad arity read as Redis' own messages."""
    for command in (["NOPE", "a", "b"], ["GET"], ["HSET", "k", "f", "v", "g"]):
        with pytest.raises(redis.ResponseError) as expected:
            real.execute_command(*command)
        with pytest.raises(ScriptError) as actual:
            store.execute_command(*command)
        assert _redis_py_text(str(actual.value)) == str(expected.value)


# --------------------------------------------------------------------------- expiry


def test_a_key_expires_after_its_ttl(real: redis.Redis, prefix: str) -> None:
    """A key with a TTL is gone once its deadline passes: on Redis and on the injected clock."""
    key = f"{prefix}:a"
    real.set(key, "v", px=30)
    assert 0 < real.pttl(key) <= 30
    deadline = time.monotonic() + 5
    while real.exists(key) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert not real.exists(key) and real.type(key) == b"none" and real.pttl(key) == -2

    clock = ManualClock()
    store = EmbeddedStore(monotonic=clock)
    store.eval("redis.call('SET', KEYS[1], 'v', 'PX', 30)", [key], [])
    clock.advance(0.029)
    assert store.pttl(key) == 1 and store.keys() == [key.encode()]
    clock.advance(0.002)
    assert store.pttl(key) == -2 and store.keys() == []


def test_a_key_lives_through_its_last_millisecond() -> None:
    """Like Redis, a key expires when now > deadline: at the deadline itself it still exists."""
    clock = ManualClock()
    store = EmbeddedStore(monotonic=clock)
    store.execute_command("HSET", "h", "f", "v")
    store.execute_command("PEXPIRE", "h", 100)
    clock.advance(0.1)
    assert store.pttl("h") == 0 and store.hgetall("h") == {b"f": b"v"}
    clock.advance(0.001)
    assert store.hgetall("h") == {} and store.pttl("h") == -2


def test_aggregates_expire_and_ttls_survive_writes() -> None:
    """HSET, HDEL, ZADD and ZREM keep a key's TTL; SET drops it."""
    clock = ManualClock()
    store = EmbeddedStore(monotonic=clock)
    script = """
    redis.call('HSET', KEYS[1], 'f', 1, 'g', 1) redis.call('PEXPIRE', KEYS[1], 1000)
    redis.call('HSET', KEYS[1], 'f', 2) redis.call('HDEL', KEYS[1], 'g')
    redis.call('ZADD', KEYS[2], 1, 'm') redis.call('PEXPIRE', KEYS[2], 1000)
    redis.call('ZADD', KEYS[2], 2, 'n') redis.call('ZREM', KEYS[2], 'm')
    redis.call('SET', KEYS[3], 1, 'PX', 1000) redis.call('SET', KEYS[3], 2)
    """
    keys = ["h", "z", "plain"]
    store.eval(script, keys, [])
    assert [store.pttl(key) for key in keys] == [1000, 1000, -1]
    clock.advance(1.001)
    assert store.keys() == [b"plain"]


def test_time_is_frozen_for_a_whole_script(real: redis.Redis, prefix: str) -> None:
    """Within one script expiry is judged at the script's start; TTLs read the live clock."""
    source = """
    redis.call('SET', KEYS[1], 'v', 'PX', 1)
    local start = redis.call('TIME')
    repeat
      local now = redis.call('TIME')
      local waited = (now[1] - start[1]) * 1000000 + (now[2] - start[2])
    until waited > 5000
    return {redis.call('GET', KEYS[1]), redis.call('PTTL', KEYS[1])}
    """
    assert real.eval(source, 1, f"{prefix}:a") == [b"v", 0]
    store = EmbeddedStore()
    assert store.eval(source, [f"{prefix}:a"], []) == [b"v", 0]

    ticks = itertools.count(1000.0, 1.0)  # every script starts one second later
    ticking = EmbeddedStore(monotonic=lambda: next(ticks))
    source = "redis.call('SET', KEYS[1], 'v', 'PX', 500) return redis.call('GET', KEYS[1])"
    assert ticking.eval(source, ["k"], []) == b"v"
    assert ticking.eval("return redis.call('GET', KEYS[1])", ["k"], []) is None


def test_expiry_ignores_wall_clock_jumps() -> None:
    """Deadlines live on the monotonic clock: a wall clock jump neither expires nor revives."""
    clock, wall = ManualClock(), ManualClock(1_700_000_000.0)
    store = EmbeddedStore(monotonic=clock, wall=wall)
    store.execute_command("SET", "k", "v", "PX", 1000)
    store.execute_command("SET", "p", "v")
    store.execute_command("PEXPIRE", "p", 500)
    wall.advance(86_400)
    assert store.pttl("k") == 1000 and store.pttl("p") == 500
    wall.advance(-2 * 86_400)
    clock.advance(0.501)
    assert store.pttl("k") == 499 and store.pttl("p") == -2


def test_expired_keys_are_swept_without_being_read() -> None:
    """Memory stays bounded: due keys go in the background, refreshed TTLs leave no residue."""
    clock = ManualClock()
    store = EmbeddedStore(monotonic=clock)
    store.eval("for i = 1, 1000 do redis.call('SET', 'k' .. i, 1, 'PX', 10) end", [], [])
    clock.advance(0.011)
    for _ in range(20):
        store.eval("return 1", [], [])
    keyspace = store._keyspace  # internals: the point is what is still held in memory
    assert keyspace.data == {} and keyspace.expires == {}

    for _ in range(2000):
        store.eval("redis.call('SET', KEYS[1], 1, 'PX', 60000)", ["hot"], [])
    assert len(keyspace._deadlines) < 200


# ------------------------------------------------------------------ scripts and sandbox


def test_script_load_returns_the_redis_sha(real: redis.Redis, store: EmbeddedStore) -> None:
    """SCRIPT LOAD's SHA1 is the same on both, and EVALSHA takes it in either case."""
    source = "return 'loaded'"
    sha = store.script_load(source)
    assert sha == real.script_load(source) == hashlib.sha1(source.encode()).hexdigest()
    assert store.evalsha(sha, [], []) == store.evalsha(sha.upper(), [], []) == b"loaded"


def test_unknown_scripts_raise_noscript(real: redis.Redis, store: EmbeddedStore) -> None:
    """EVALSHA of an unknown script fails with Redis' NOSCRIPT error."""
    with pytest.raises(redis.exceptions.NoScriptError) as expected:
        real.evalsha("0" * 40, 0)
    with pytest.raises(NoScriptError) as actual:
        store.evalsha("0" * 40, [], [])
    assert isinstance(actual.value, ScriptError)
    assert str(actual.value) == "NOSCRIPT No matching script. Please use EVAL."
    assert _redis_py_text(str(actual.value)) == str(expected.value)


def test_scripts_cannot_reach_python(store: EmbeddedStore) -> None:
    """No Python object or attribute is within a script's reach."""
    for probe in ("return redis.error_reply.__class__", "return redis.call.__globals__"):
        with pytest.raises(ScriptError):
            store.eval(probe, [], [])
    with pytest.raises(ScriptError, match="nonexistent global variable 'python'"):
        store.eval("return python", [], [])
    # Known difference: Redis shows the string metatable read-only; it is hidden here.
    with pytest.raises(ScriptError, match="attempt to index a boolean value"):
        store.eval("getmetatable('').__index.upper = nil", [], [])
    assert store.eval("return ('x'):upper()", [], []) == b"X"


def test_one_script_cannot_break_the_next(store: EmbeddedStore) -> None:
    """Globals, library tables and redis.* are read-only, so no script leaks into another."""
    for attack in (
        "redis.call = nil",
        "tostring = nil",
        "rawset(string, 'format', nil)",
        "KEYS = 1",
    ):
        with pytest.raises(ScriptError, match="readonly table"):
            store.eval(attack, [], [])
    assert store.eval("return {type(redis.call('TIME')), string.format('%d', 7)}", [], []) == [
        b"table",
        b"7",
    ]


def test_binary_keys_and_arguments_round_trip(
    real: redis.Redis, store: EmbeddedStore, prefix: str
) -> None:
    """Bytes reach Lua unchanged; str is UTF-8 and numbers are repr(), as redis-py sends them."""
    binary = prefix.encode() + bytes(range(256))
    args = [bytes(range(255, -1, -1)), "ü", 5, 0.1, -2.5e-7]
    assert_same(
        real, store, "redis.call('SET', KEYS[1], ARGV[1]) return {KEYS, ARGV}", [binary], args
    )
    assert binary in store.keys()
    with pytest.raises(TypeError):
        store.eval("return 1", [True], [])


def test_direct_helpers(store: EmbeddedStore) -> None:
    """delete/pttl/hgetall/keys and ZCARD answer like the commands they stand for."""
    store.eval(
        "redis.call('HSET', 'h', 'f', 'v') redis.call('SET', 's', 1, 'PX', 5000) "
        "redis.call('ZADD', 'z', 1, 'm', 2, 'n')",
        [],
        [],
    )
    assert sorted(store.keys()) == [b"h", b"s", b"z"]
    assert store.hgetall("h") == {b"f": b"v"} and store.hgetall("none") == {}
    # Real time runs on between the SET and the PTTL (the store's clock is not frozen here).
    assert 4_900 < store.pttl("s") <= 5000
    assert (store.pttl("h"), store.pttl("none")) == (-1, -2)
    assert store.execute_command("ZCARD", "z") == 2 and store.execute_command("zcard", "x") == 0
    with pytest.raises(ScriptError, match=r"^WRONGTYPE"):
        store.hgetall("s")
    with pytest.raises(ScriptError, match=r"^WRONGTYPE"):
        store.execute_command("ZCARD", "h")
    with pytest.raises(ScriptError, match="Unknown Redis command called from script"):
        store.eval("return redis.call('ZCARD', 'z')", [], [])
    assert store.delete("h", "s", "none") == 2 and store.delete() == 0
    assert store.keys() == [b"z"]


def test_scripts_are_atomic_across_threads(store: EmbeddedStore) -> None:
    """Concurrent callers never interleave inside a script: no increment is lost."""
    sha = store.script_load(
        "local v = tonumber(redis.call('GET', KEYS[1]) or '0') redis.call('SET', KEYS[1], v + 1)"
    )

    def work() -> None:
        for _ in range(500):
            store.evalsha(sha, ["n"], [])

    threads = [threading.Thread(target=work) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert store.execute_command("GET", "n") == b"4000"


# -------------------------------------------------------------- randomised differential

_FIELDS = st.sampled_from(["f1", "f2", "f3"])
_MEMBERS = st.sampled_from(["m1", "m2", "m3", "m4"])
_VALUES = st.sampled_from(["v", "5", "1.5", "-3", "0", "10"])
_SCORES = st.sampled_from(["0", "1", "-1", "2.5", "0.1", "-0", "inf", "-inf", "1e400", "x", "7"])
_BOUNDS = st.sampled_from(["-inf", "+inf", "0", "1", "(1", "2.5", "(2.5", "", "(", " 1", "x"])
_RANKS = st.sampled_from(["0", "1", "-1", "-2", "2", "10", "-10", "x"])
_KEY = st.sampled_from(["{a}", "{b}"])


def _command() -> st.SearchStrategy[list[str]]:
    def build(*parts: st.SearchStrategy[Any]) -> st.SearchStrategy[list[str]]:
        return st.tuples(*parts).map(
            lambda items: [
                item for part in items for item in (part if isinstance(part, list) else [part])
            ]
        )

    return st.one_of(
        build(st.just("SET"), _KEY, _VALUES, st.sampled_from([[], ["PX", "100000"]])),
        build(st.sampled_from(["GET", "DEL", "HGETALL"]), _KEY),
        build(st.just("DEL"), _KEY, _KEY),
        build(st.just("PEXPIRE"), _KEY, st.sampled_from(["100000", "5000", "-1", "0", "x"])),
        build(st.just("HSET"), _KEY, _FIELDS, _VALUES),
        build(st.just("HDEL"), _KEY, _FIELDS),
        build(st.just("HMGET"), _KEY, _FIELDS),
        build(st.just("ZADD"), _KEY, st.sampled_from([[], ["XX"]]), _SCORES, _MEMBERS),
        build(st.just("ZREM"), _KEY, _MEMBERS),
        build(st.sampled_from(["ZCOUNT", "ZREMRANGEBYSCORE"]), _KEY, _BOUNDS, _BOUNDS),
        build(
            st.just("ZRANGEBYSCORE"),
            _KEY,
            _BOUNDS,
            _BOUNDS,
            st.sampled_from(
                [[], ["WITHSCORES"], ["LIMIT", "1", "2"], ["LIMIT", "0", "-1", "WITHSCORES"]]
            ),
        ),
        build(st.just("ZRANGE"), _KEY, _RANKS, _RANKS, st.sampled_from([[], ["WITHSCORES"]])),
    )


_EXAMPLE = itertools.count()


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(commands=st.lists(_command(), min_size=1, max_size=12))
def test_random_command_sequences_match_redis(
    real: redis.Redis, store: EmbeddedStore, prefix: str, commands: list[list[str]]
) -> None:
    """Random sequences over a small alphabet give Redis' replies and leave Redis' state."""
    run_commands(real, store, f"{prefix}:{next(_EXAMPLE)}", commands)


EXPIRE_TIMES = """
local a, b = KEYS[1], KEYS[2]
local out = {redis.call('PEXPIRETIME', a)}
redis.call('SET', a, 'v')
out[#out + 1] = redis.call('PEXPIRETIME', a)
redis.call('PEXPIRE', a, 5000)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local at = redis.call('PEXPIRETIME', a)
out[#out + 1] = math.abs(at - now - 5000) <= 2 and 'near' or (at - now)
out[#out + 1] = redis.call('PEXPIREAT', b, at)
redis.call('HSET', b, 'f', 'v')
out[#out + 1] = redis.call('PEXPIREAT', b, at)
out[#out + 1] = redis.call('PEXPIRETIME', b) == at and 'same' or 'differs'
out[#out + 1] = redis.call('PTTL', b) == redis.call('PTTL', a) and 'same' or 'differs'
out[#out + 1] = redis.call('PEXPIREAT', a, 1)
out[#out + 1] = redis.call('EXISTS', a)
out[#out + 1] = redis.pcall('PEXPIREAT', b, 'soon')
out[#out + 1] = redis.pcall('PEXPIREAT', b, at, 'FOO')
return out
"""


def test_expire_times_round_trip_like_redis(
    real: redis.Redis, store: EmbeddedStore, prefix: str
) -> None:
    """PEXPIRETIME and PEXPIREAT (mirror_leases copies a main key's expiry to its lease set
    with them): -2 and -1 for a missing key and one without a TTL, a Unix time in ms, the same
    time read back from a key given it, a time in the past deleting the key, bad input."""
    keys = [f"{prefix}:a", f"{prefix}:b"]
    _, reply = assert_same(real, store, EXPIRE_TIMES, keys, [])
    assert reply[:9] == [-2, -1, b"near", 0, 1, b"same", b"same", 1, 0], reply
