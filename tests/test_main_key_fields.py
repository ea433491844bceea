"""A call reads only the fields of an identifier's hash that it needs.

An identifier's main key holds "t", "x", one field per limit set on it, and one op ledger per
limiter instance (process) that wrote it, up to OP_CLIENTS: on a busy identifier, a whole
fleet's. A call fetches "t", "x", its own client's ledger and its own limits' fields with one
HMGET; only the ledger pruning (a client's first write in the key, and about once a second
with the TTL) reads the whole hash. Before, every call HGETALLed it, so its server time grew
with the fleet: 20 µs per decision with one writer, 46 µs with 64 (a pipelined probe of
FCALLs, standalone Redis 7.0.15).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from redis.asyncio import Redis

from aiolimit import Limit, Limiter
from aiolimit._calls import lua_dir
from aiolimit._embedded.store import EmbeddedStore
from aiolimit._keys import main_key

HOUR = Limit(1_000_000, per=3600, precision=60)
MINUTE = Limit(1_000_000, per=60)


async def test_a_decision_on_a_busy_key_fetches_only_its_own_fields(
    redis_url: str, prefix: str
) -> None:
    """40 other limiter instances and another limit wrote the identifier's hash. 50 decisions
    by one more limiter read it with one HMGET each and no HGETALL (at most one, should the
    TTL step fall inside the run), keep every other field, and count exactly."""
    client = Redis.from_url(redis_url)
    identifier = "key:busy"
    key = main_key(prefix, identifier)
    try:
        for _ in range(40):
            other = Limiter(client, [HOUR], prefix=prefix)
            assert (await other.try_acquire(identifier)).allowed
            await other.aclose()
        async with Limiter(client, [MINUTE], prefix=prefix) as minute:
            assert (await minute.try_acquire(identifier)).allowed
        stored = await client.hgetall(key)
        async with Limiter(redis_url, [HOUR], prefix=prefix) as limiter:
            assert (await limiter.try_acquire(identifier)).allowed  # its first ledger here
            await client.config_resetstat()
            for _ in range(50):
                decision = await limiter.try_acquire(identifier)
                assert decision.allowed and not decision.degraded
            stats = await client.info("commandstats")
            assert (await limiter.peek(identifier)).remaining == HOUR.amount - 40 - 1 - 50
        after = await client.hgetall(key)
    finally:
        await client.aclose()
    assert stats.get("cmdstat_hgetall", {"calls": 0})["calls"] <= 1, stats
    assert stats["cmdstat_hmget"]["calls"] >= 50, stats
    ledgers = [name for name in stored if name.startswith(b"o:")]
    assert len(ledgers) == 41  # 40 instances and the minute's limiter
    assert {name: after[name] for name in ledgers} == {name: stored[name] for name in ledgers}
    assert len(after) == len(stored) + 1  # and the new limiter's own ledger


# The prelude's field access, run as a script of its own on Redis and on the embedded engine.
FIELD_ACCESS = """
local s = load_main(KEYS[1])
fetch(s, ARGV, 1, #ARGV)
local out = {s.existed and 1 or 0, s.t}
local function show(name)
  local value = read_field(s, name)
  out[#out + 1] = value == nil and '(nil)' or value
end
show('a')        -- fetched: its value
show('zz')       -- fetched, absent: nil, and no second read
show('b')        -- not fetched: read now
stage_set(s, 'c', 'new')
show('c')        -- staged: what the call wrote, not what is stored
stage_del(s, 'a')
show('a')        -- deleted by the call: nil, although Redis still has it
stage_del(s, 'd')  -- never fetched: deleted all the same
out[#out + 1] = s.del['d'] and 'd deleted' or 'd kept'
return out
"""


@pytest.fixture
def real(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, protocol=2)
    yield client
    client.close()


@pytest.mark.parametrize("engine", ["redis", "embedded"])
def test_fields_are_fetched_once_and_staged_writes_win(
    real: redis.Redis, prefix: str, engine: str
) -> None:
    """fetch() asks for what is not fetched yet ("t" and "x" first), read_field() reads a
    field no fetch named on its own, and what the call staged or deleted wins over Redis."""
    source = (lua_dir() / "prelude.lua").read_text(encoding="utf-8") + FIELD_ACCESS
    key = f"{prefix}:{{fields}}"
    stored = {"t": "1700000000000000", "a": "1", "b": "2", "c": "3", "d": "4"}
    args = ["a", "zz", "a"]
    expected = [1, 1700000000000000, "1", "(nil)", "2", "new", "(nil)", "d deleted"]
    if engine == "redis":
        real.hset(key, mapping=stored)
        real.config_resetstat()
        reply = real.eval(source, 1, key, *args)
        # One HMGET for t, x, a and zz (a asked once), one for b; none for zz again or for c.
        assert real.info("commandstats")["cmdstat_hmget"]["calls"] == 2
        assert real.hgetall(key) == {k.encode(): v.encode() for k, v in stored.items()}
    else:
        store = EmbeddedStore()
        store.eval("redis.call('HSET', KEYS[1], unpack(ARGV))", [key], sum(stored.items(), ()))
        reply = store.eval(source, [key], args)
    assert [item.decode() if isinstance(item, bytes) else item for item in reply] == expected


@pytest.mark.parametrize("engine", ["redis", "embedded"])
@pytest.mark.parametrize(
    "held", [(), ("zz", "1"), ("o:other", "1;0;")], ids=["none", "fetched", "other"]
)
def test_a_key_without_t_exists_if_it_holds_anything(
    real: redis.Redis, prefix: str, engine: str, held: tuple[str, ...]
) -> None:
    """A main key without "t" (every write sets it: a new key, or one edited by hand) exists
    if it holds any field, fetched or not (a refund records its op only in a key that exists:
    one that credits and does not record would credit again when resent); time 0."""
    source = (lua_dir() / "prelude.lua").read_text(encoding="utf-8") + FIELD_ACCESS
    key = f"{prefix}:{{nothing}}"
    zz = held[1] if held and held[0] == "zz" else "(nil)"
    expected = [1 if held else 0, 0, "(nil)", zz, "(nil)", "new", "(nil)", "d deleted"]
    if engine == "redis":
        if held:
            real.hset(key, held[0], held[1])
        reply = real.eval(source, 1, key, "a", "zz")
        assert real.exists(key) == (1 if held else 0)  # (staged writes are flushed elsewhere)
    else:
        store = EmbeddedStore()
        if held:
            store.eval("redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])", [key], list(held))
        reply = store.eval(source, [key], ["a", "zz"])
    assert [item.decode() if isinstance(item, bytes) else item for item in reply] == expected
