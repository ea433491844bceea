"""limiter.limited(...): any coroutine function, e.g. calls to a third-party API, under limits."""

from __future__ import annotations

import asyncio

import pytest

from aiolimit import Concurrency, ConfigurationError, InvalidRequestError, Limiter, RateLimited
from aiolimit.testing import ManualClock

START = 1_700_000_000.0


async def test_calls_wait_for_their_turn_and_all_run(store_url: str, prefix: str) -> None:
    """5 calls under 2/second with a waiting decorator: all run, two per second of clock."""
    clock = ManualClock(start=START, autojump=True)
    limiter = Limiter(store_url, "2/second", prefix=prefix, clock=clock)
    ran: list[float] = []

    @limiter.limited("api:github")
    async def fetch(n: int) -> int:
        ran.append(clock.time() - START)
        return n * 10

    try:
        assert [await fetch(n) for n in range(5)] == [0, 10, 20, 30, 40]
        assert [int(t) for t in ran] == [0, 0, 1, 1, 2]
    finally:
        await limiter.aclose()


async def test_timeout_zero_refuses_at_once_without_running(store_url: str, prefix: str) -> None:
    """With timeout=0 a call over the limit raises RateLimited and the function never runs."""
    limiter = Limiter(store_url, "1/minute", prefix=prefix, clock=ManualClock(start=START))
    runs = 0

    @limiter.limited("api:x", timeout=0)
    async def call() -> None:
        nonlocal runs
        runs += 1

    try:
        await call()
        with pytest.raises(RateLimited) as refused:
            await call()
        assert refused.value.decision.retry_after > 0
        assert runs == 1
    finally:
        await limiter.aclose()


async def test_keys_and_weight_from_the_arguments_on_a_method(store_url: str, prefix: str) -> None:
    """ids and weight may be functions of the arguments (self included on a method)."""
    limiter = Limiter(store_url, {"user": ["10/minute"]}, prefix=prefix,
                      clock=ManualClock(start=START))  # fmt: skip

    class Client:
        @limiter.limited(lambda self, user, cost: f"user:{user}", lambda self, user, cost: cost,
                         timeout=0)  # fmt: skip
        async def search(self, user: str, cost: int) -> str:
            return f"{user}:{cost}"

    client = Client()
    try:
        assert await client.search("ada", 7) == "ada:7"
        assert await client.search("bob", 10) == "bob:10"
        with pytest.raises(RateLimited):
            await client.search("ada", 4)  # 7 + 4 > 10
        assert (await limiter.peek("user:ada")).remaining == 3
    finally:
        await limiter.aclose()


async def test_a_concurrency_lease_is_held_for_the_call_and_released(
    store_url: str, prefix: str
) -> None:
    """Under Concurrency(1) a second overlapping call waits for the first to finish; an error
    in the body still gives the lease back."""
    limiter = Limiter(store_url, [Concurrency(1)], prefix=prefix)
    gate = asyncio.Event()

    @limiter.limited("job:1", timeout=5)
    async def work(fail: bool) -> str:
        await gate.wait()
        if fail:
            raise ValueError("boom")
        return "done"

    try:
        first = asyncio.ensure_future(work(True))
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(work(False))
        await asyncio.sleep(0.05)
        assert not second.done()
        gate.set()
        with pytest.raises(ValueError, match="boom"):
            await first
        assert await second == "done"
        assert (await limiter.peek("job:1")).remaining == 1
    finally:
        await limiter.aclose()


def test_bad_uses_fail_at_decoration() -> None:
    """A plain function, a bad identifier or a bad weight fail when decorating."""
    limiter = Limiter("memory://", "1/s")
    with pytest.raises(ConfigurationError, match="coroutine functions"):
        limiter.limited("api:x")(lambda: None)  # type: ignore[arg-type, return-value]
    with pytest.raises(InvalidRequestError):
        limiter.limited("")
    with pytest.raises(InvalidRequestError):
        limiter.limited("api:x", 0)
