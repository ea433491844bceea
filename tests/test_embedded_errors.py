"""The embedded engine's errors reach callers as aiolimit's BackendError, as Redis' errors do.

A command's error (WRONGTYPE), a Lua runtime error and ``redis.error_reply`` all leave
``memory://`` as ``BackendError`` with the reason in its message and the engine's error as
``__cause__``, so ``on_error`` ("raise", "open", "closed") applies there exactly as on Redis.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from aiolimit import BackendError, Limit, Limiter
from aiolimit._calls import Call, Mode
from aiolimit._embedded.store import EmbeddedStore, ScriptError
from aiolimit._keys import main_key
from aiolimit._stores.base import Arg
from aiolimit._stores.memory import MemoryStore

GOOD, BAD = "ip:198.51.100.1", "ip:198.51.100.2"
PLANTED = b"not a hash"


def open_limiter(prefix: str, on_error: str) -> Limiter:
    return Limiter(
        "memory://",
        [Limit(5, per=60)],
        prefix=prefix,
        on_error=on_error,  # type: ignore[arg-type]
    )


def engine_of(limiter: Limiter) -> EmbeddedStore:
    engine: EmbeddedStore = limiter.store.engine  # type: ignore[attr-defined]
    return engine


def stored(engine: EmbeddedStore) -> dict[bytes, object]:
    """Every key with what it holds (strings by GET, hashes by HGETALL)."""
    state: dict[bytes, object] = {}
    for key in sorted(engine.keys()):
        try:
            state[key] = engine.hgetall(key)
        except ScriptError:
            state[key] = engine.execute_command("GET", key)
    return state


async def plant_wrong_type(limiter: Limiter, prefix: str) -> dict[bytes, object]:
    """Charge GOOD twice, put a string where BAD's hash belongs; return what is stored."""
    for _ in range(2):
        assert (await limiter.try_acquire(GOOD)).allowed
    engine = engine_of(limiter)
    engine.execute_command("SET", main_key(prefix, BAD), PLANTED)
    before = stored(engine)
    assert before[main_key(prefix, BAD).encode()] == PLANTED
    return before


@pytest.mark.parametrize("ids", [BAD, [GOOD, BAD]], ids=["alone", "with a healthy identifier"])
async def test_a_wrong_type_raises_backend_error(prefix: str, ids: str | list[str]) -> None:
    """on_error="raise": WRONGTYPE surfaces as BackendError, its reason kept, nothing lost."""
    async with open_limiter(prefix, "raise") as limiter:
        before = await plant_wrong_type(limiter, prefix)
        with pytest.raises(BackendError) as caught:
            await limiter.try_acquire(ids)
        assert type(caught.value) is BackendError
        assert "WRONGTYPE Operation against a key holding the wrong kind of value" in str(
            caught.value
        )
        assert isinstance(caught.value.__cause__, ScriptError)
        assert stored(engine_of(limiter)) == before
        assert (await limiter.try_acquire(GOOD)).remaining == 2


async def test_a_wrong_type_fails_open(prefix: str) -> None:
    """on_error="open" admits, marked degraded, and stored state stays as it was."""
    async with open_limiter(prefix, "open") as limiter:
        before = await plant_wrong_type(limiter, prefix)
        decision = await limiter.try_acquire(BAD)
        assert decision.allowed and decision.degraded
        assert stored(engine_of(limiter)) == before
        assert (await limiter.try_acquire(GOOD)).remaining == 2


async def test_a_wrong_type_fails_closed(prefix: str) -> None:
    """on_error="closed" refuses, marked degraded, and stored state stays as it was."""
    async with open_limiter(prefix, "closed") as limiter:
        before = await plant_wrong_type(limiter, prefix)
        decision = await limiter.try_acquire([GOOD, BAD])
        assert not decision.allowed and decision.degraded
        assert stored(engine_of(limiter)) == before
        assert (await limiter.try_acquire(GOOD)).remaining == 2


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (["bogus", "", "1", "0", "", "", "0"], "ERR aiolimit: unknown mode bogus"),
        # (a block whose amount is not a number: the window's comparison raises)
        (
            ["acquire", "", "1", "0", "", "", "1", "1,1,0,sw,x,60000000,6000000"],
            "attempt to compare",
        ),
    ],
    ids=["redis.error_reply", "Lua runtime error"],
)
async def test_script_errors_become_backend_errors(args: Sequence[Arg], reason: str) -> None:
    """An error reply and a Lua runtime error leave the store as BackendError with the reason."""
    store = MemoryStore()
    (result,) = await store.run([Call(Mode.CHECK, ["k"], list(args), ())])
    assert isinstance(result, BackendError), result
    assert reason in str(result)
    assert isinstance(result.__cause__, ScriptError)
