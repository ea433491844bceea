"""Review of the middleware's fast path (``RateLimitMiddleware`` judging a request with no
``Request`` made, from prefetched units: ``judge_ids`` / ``Limiter._take_prefetched``).

Each test states what the slow path (``try_acquire``) did before the fast path existed, and
checks the fast path does the same."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from aiolimit import Limit, Limiter, UsageError
from aiolimit.starlette import RateLimitMiddleware

IP = "203.0.113.9"
LIMITS = [Limit(1000, per=3600, precision=60)]


def app_for(limiter: Limiter) -> Starlette:
    async def home(request: object) -> PlainTextResponse:
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/", home)])
    app.add_middleware(RateLimitMiddleware, limiter=limiter)
    return app


def test_a_second_event_loop_is_a_usage_error_in_the_middleware_too(
    redis_url: str, prefix: str
) -> None:
    """A limiter first used on one loop raises ``UsageError`` on another (``try_acquire``
    does, ``test_lifecycle``), and a middleware request through it did too (it went through
    ``try_acquire``). With prefetch on, the fast path (``_take_prefetched``) admits the
    request from the units the first loop took, with no loop check: the request is served
    (200) on a loop whose connections are not the limiter's."""
    limiter = Limiter(redis_url, LIMITS, prefix=prefix, prefetch=16)
    app = app_for(limiter)

    async def first() -> None:
        transport = httpx.ASGITransport(app=app, client=(IP, 1))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            for _ in range(2):  # (the second takes units ahead)
                assert (await client.get("/")).status_code == 200
        assert limiter._prefetch is not None
        assert limiter._prefetch._by_ids[f"ip:{IP}"].left > 0  # units held for the next
        await limiter.store.client.connection_pool.disconnect()  # type: ignore[attr-defined]

    async def second() -> None:
        # The plain call says so:
        with pytest.raises(UsageError, match="another event loop"):
            await limiter.try_acquire(f"ip:{IP}")
        # The middleware must too (as it did before the fast path).
        transport = httpx.ASGITransport(app=app, client=(IP, 1))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            with pytest.raises(UsageError, match="another event loop"):
                response = await client.get("/")
                pytest.fail(f"served on another loop: {response.status_code}")

    asyncio.run(first())
    asyncio.run(second())
