"""Review of the "unsent" marks (``mark_unsent``): a mark must never stand for a call (or an
earlier try of it) that may have been written, nor be read as something it does not say."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from aiolimit import BackendUnavailable, Limit, Limiter
from tests._proxy import Proxy


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def drained(limiter: Limiter, within: float = 8.0) -> None:
    give_up = time.monotonic() + within
    while limiter._protocol._tasks:
        assert time.monotonic() < give_up, "background work did not finish"
        await asyncio.sleep(0.05)


async def test_a_refund_never_written_is_not_given_back_twice(
    standalone_proxy: Proxy, prefix: str
) -> None:
    """A refund by decision whose connection could not be made (the store marks its error
    unsent) goes on in the background, as every failed refund does: the caller must not be
    told it may refund that decision again, or its charge is given back twice."""
    proxy = standalone_proxy
    target = proxy.target
    limiter = Limiter(proxy.url, [Limit(2, per=60)], prefix=prefix)
    try:
        first = await limiter.try_acquire("ip:1")
        second = await limiter.try_acquire("ip:1")
        assert first.allowed and second.allowed
        proxy.target = ("127.0.0.1", closed_port())  # new connections are reset at once
        proxy.abort_all()
        with pytest.raises(BackendUnavailable):
            await limiter.refund("ip:1", decision=first)
        proxy.target = target
        await drained(limiter)  # (a failed refund is sent again in the background)
        try:
            await limiter.refund("ip:1", decision=first)  # may be refused: given back already
        except Exception:
            pass
        await drained(limiter)
        allowed = [(await limiter.try_acquire("ip:1")).allowed for _ in range(3)]
        assert allowed == [True, False, False], f"one charge given back twice: {allowed}"
    finally:
        proxy.target = target
        await limiter.aclose()
