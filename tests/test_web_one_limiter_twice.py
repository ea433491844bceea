"""An admitted request is charged exactly once per identifier, however many web
layers of one limiter it goes through.

README: "one all-or-nothing call per limiter (one for everything when they share it)";
"Two middlewares on one app (say, one per limiter) join into the same judgement."
Real uvicorn / aiohttp servers, real Redis.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from aiohttp import web
from fastapi import Depends, FastAPI
from starlette.applications import Starlette
from starlette.middleware.gzip import GZipMiddleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Mount, Route

from aiolimit import Limit, Limiter
from aiolimit import aiohttp as aio
from aiolimit.starlette import RateLimit, RateLimitMiddleware
from tests.test_web_aiohttp import running
from tests.test_web_starlette import serve

IP = "127.0.0.1"


@pytest.fixture
async def limiter(redis_url: str, prefix: str) -> AsyncIterator[Limiter]:
    made = Limiter(redis_url, {"ip": [Limit(100, per=3600, precision=60)]}, prefix=prefix)
    yield made
    await made.aclose()


async def left(limiter: Limiter) -> int:
    return (await limiter.peek(f"ip:{IP}")).remaining


async def hello(request: Request) -> PlainTextResponse:
    return PlainTextResponse("hi")


async def test_starlette_same_limiter_middleware_on_app_and_mounted_sub_app_charges_once(
    limiter: Limiter,
) -> None:
    """The app and a sub-app it mounts both carry ``RateLimitMiddleware(limiter)`` (the
    sub-app is also served on its own): a request to the sub-app is one request for
    ``ip:127.0.0.1``. It is charged twice, and its RateLimit field says so."""
    sub = Starlette(routes=[Route("/x", hello)])
    sub.add_middleware(RateLimitMiddleware, limiter=limiter)
    app = Starlette(routes=[Route("/x", hello), Mount("/v1", app=sub)])
    app.add_middleware(RateLimitMiddleware, limiter=limiter)
    async with serve(app) as client:
        outer = await client.get("/x")
        assert outer.status_code == 200
        assert await left(limiter) == 99
        inner = await client.get("/v1/x")
        assert inner.status_code == 200
    assert await left(limiter) == 98, (
        f"one request through two middlewares of one limiter: remaining {await left(limiter)}, "
        f"RateLimit: {inner.headers.get('RateLimit')}"
    )


async def test_aiohttp_same_limiter_middleware_on_app_and_sub_app_charges_once(
    limiter: Limiter,
) -> None:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(text="hi")

    sub = web.Application(middlewares=[aio.rate_limit_middleware(limiter)])
    sub.router.add_get("/x", handler)
    app = web.Application(middlewares=[aio.rate_limit_middleware(limiter)])
    app.router.add_get("/x", handler)
    app.add_subapp("/v1", sub)
    async with running(app) as base, httpx.AsyncClient(base_url=base) as client:
        assert (await client.get("/x")).status_code == 200
        assert await left(limiter) == 99
        inner = await client.get("/v1/x")
        assert inner.status_code == 200
    assert await left(limiter) == 98, (
        f"one request through two middlewares of one limiter: remaining {await left(limiter)}, "
        f"RateLimit: {inner.headers.get('RateLimit')}"
    )


@pytest.mark.parametrize("wrapped", [False, True], ids=["mounted as is", "mounted wrapped"])
async def test_middleware_and_route_dependency_of_one_limiter_charge_once_under_a_mount(
    limiter: Limiter, wrapped: bool
) -> None:
    """The middleware (keys: the client IP) and ``Depends(RateLimit(limiter))`` (the limiter's
    rules on the client IP: the same identifier) on a route of a mounted FastAPI sub-app.
    Mounted as is, the request is one decision, charged once. Mounted wrapped in an ASGI
    middleware (``GZipMiddleware(sub)``, ``CORSMiddleware(sub)``...), the middleware cannot
    see the route's dependency, which then charges ``ip:127.0.0.1`` a second time - on every
    request, not just the first."""
    sub = FastAPI()

    @sub.get("/x", dependencies=[Depends(RateLimit(limiter))])
    async def x() -> str:
        return "x"

    inner = GZipMiddleware(sub) if wrapped else sub
    app = Starlette(routes=[Mount("/v1", app=inner)])
    app.add_middleware(RateLimitMiddleware, limiter=limiter)
    async with serve(app) as client:
        codes = [(await client.get("/v1/x")).status_code for _ in range(3)]
    assert codes == [200, 200, 200]
    assert await left(limiter) == 97, f"3 requests: remaining {await left(limiter)}"
