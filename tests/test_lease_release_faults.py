"""Concurrency leases held by limit()/limited(), released on exit: cancelled exits, a store
that does not answer, an anyio cancel scope."""

from __future__ import annotations

import asyncio
import contextlib
import time

import anyio
import pytest

import aiolimit._protocol as protocol_module
from aiolimit import BackendError, Concurrency, Limiter
from tests._proxy import Proxy


async def _held_until_cancelled(limiter: Limiter, entered: asyncio.Event) -> None:
    async with limiter.limit("job:1", timeout=0):
        entered.set()
        await asyncio.sleep(3600)


async def _free_within(url: str, prefix: str, seconds: float) -> bool:
    """Whether job:1's slot is free (checked with a limiter of its own) within ``seconds``."""
    async with Limiter(url, [Concurrency(1, lease_ttl=60)], prefix=prefix) as other:
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            decision = await other.try_acquire("job:1")
            if decision.allowed:
                assert decision.lease is not None
                await decision.lease.release()
                return True
            await asyncio.sleep(0.1)
    return False


@pytest.mark.parametrize("cancels", [1, 2])
async def test_release_on_cancelled_exit_is_retried_after_outage(
    standalone_proxy: Proxy,
    redis_url: str,
    prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    cancels: int,
) -> None:
    """README: a lease goes back on cancellation, and a release the store did not answer is
    retried in the background. A holder cancelled while the store is unreachable; with a
    second cancellation during the release (anyio cancel scopes, TaskGroup teardown, a
    timeout and a shutdown both firing) the release is given up silently: the slot stays held
    until lease_ttl (60 s) though the store is back within a second."""
    monkeypatch.setattr(protocol_module, "UNDO_BUDGET", 0.5)  # the release attempt's budget
    limits = [Concurrency(1, lease_ttl=60)]
    async with Limiter(standalone_proxy.url, limits, prefix=prefix, deadline=0.3) as limiter:
        entered = asyncio.Event()
        holder = asyncio.create_task(_held_until_cancelled(limiter, entered))
        with anyio.fail_after(5):
            await entered.wait()
        standalone_proxy.partition()
        holder.cancel()
        await asyncio.sleep(0.05)  # the holder is in __aexit__, awaiting the release
        if cancels == 2:
            holder.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            with anyio.fail_after(5):
                await holder
        await asyncio.sleep(0.7)  # the release attempt times out meanwhile
        standalone_proxy.heal()
        assert await _free_within(redis_url, prefix, 6.0), (
            f"with {cancels} cancellation(s) the slot was not released after the store came "
            "back (held until lease_ttl)"
        )


async def test_release_wakes_waiter_after_outage(
    standalone_proxy: Proxy, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A release retried in the background, once it lands, wakes a waiter in this process."""
    monkeypatch.setattr(protocol_module, "UNDO_BUDGET", 0.5)
    limits = [Concurrency(1, lease_ttl=60)]
    async with Limiter(standalone_proxy.url, limits, prefix=prefix, deadline=2.0) as limiter:
        decision = await limiter.try_acquire("job:1")
        assert decision.allowed and decision.lease is not None
        standalone_proxy.partition()
        with pytest.raises(BackendError):
            await decision.lease.release()
        standalone_proxy.heal()
        with anyio.fail_after(10):
            got = await limiter.acquire("job:1", timeout=8)
        assert got.allowed and got.lease is not None
        await got.lease.release()


async def test_exit_of_limit_on_unreachable_store_is_bounded(
    standalone_proxy: Proxy, prefix: str
) -> None:
    """``async with limiter.limit()`` waits at most the limiter's deadline (0.25 s) on exit
    when the store stops answering (it waited the release's own 5 s budget); the release
    goes on in the background."""
    limits = [Concurrency(1, lease_ttl=60)]
    async with Limiter(standalone_proxy.url, limits, prefix=prefix, deadline=0.25) as limiter:
        started = 0.0
        with anyio.fail_after(10):
            async with limiter.limit("job:1", timeout=0):
                standalone_proxy.partition()
                started = time.monotonic()
        took = time.monotonic() - started
        standalone_proxy.heal()
        assert took < 1.0, f"exit blocked {took:.2f}s with deadline=0.25"


async def test_release_under_anyio_cancel_scope_is_retried_after_outage(
    standalone_proxy: Proxy, redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One anyio cancel scope (as Starlette/FastAPI code uses) suffices: its cancellation is
    re-delivered at every await inside the scope, so the release awaited by __aexit__ is
    cancelled too, and a release the store did not answer is never retried."""
    monkeypatch.setattr(protocol_module, "UNDO_BUDGET", 0.5)
    limits = [Concurrency(1, lease_ttl=60)]
    async with Limiter(standalone_proxy.url, limits, prefix=prefix, deadline=0.3) as limiter:
        await limiter.peek("job:1")
        with anyio.move_on_after(0.3):
            async with limiter.limit("job:1", timeout=0):
                standalone_proxy.partition()
                await asyncio.sleep(3600)
        await asyncio.sleep(0.7)
        standalone_proxy.heal()
        assert await _free_within(redis_url, prefix, 6.0), (
            "slot not released after the store came back (held until lease_ttl)"
        )
