"""The web layers when the store stops answering at judging time.

README: "With ``on_error="closed"`` and the store down: 503"; a degraded admission passes
without RateLimit fields; no response waits past about the limiter's deadline; a refused
request (503 included) is charged nothing anywhere. Real servers, real Redis behind the
fault-injecting proxy.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from aiohttp import web
from fastapi import Depends, FastAPI
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from aiolimit import Concurrency, Limit, Limiter
from aiolimit import aiohttp as aio
from aiolimit.starlette import RateLimit, RateLimitMiddleware
from tests._proxy import Proxy
from tests.test_web_aiohttp import running
from tests.test_web_starlette import serve

IP = "127.0.0.1"
DEADLINE = 0.25


async def hello(request: Request) -> PlainTextResponse:
    return PlainTextResponse("hi")


async def aio_hello(request: web.Request) -> web.Response:
    return web.Response(text="hi")


def build(framework: str, layer: str, limiter: Limiter) -> object:
    if framework == "starlette":
        if layer == "middleware":
            app = Starlette(routes=[Route("/", hello)])
            app.add_middleware(RateLimitMiddleware, limiter=limiter)
            return app
        api = FastAPI()

        @api.get("/", dependencies=[Depends(RateLimit(limiter))])
        async def root() -> str:
            return "hi"

        return api
    if layer == "middleware":
        aapp = web.Application(middlewares=[aio.rate_limit_middleware(limiter)])
        aapp.router.add_get("/", aio_hello)
    else:
        aapp = web.Application()
        aapp.router.add_get("/", aio.limit(limiter)(aio_hello))
    return aapp


async def get_once(framework: str, app: object) -> httpx.Response:
    if framework == "starlette":
        async with serve(app) as client:  # type: ignore[arg-type]
            return await client.get("/")
    async with running(app) as base, httpx.AsyncClient(base_url=base, timeout=10) as client:  # type: ignore[arg-type]
        return await client.get("/")


@pytest.mark.parametrize("on_error", ["open", "closed"])
@pytest.mark.parametrize("layer", ["middleware", "route"])
@pytest.mark.parametrize("framework", ["starlette", "aiohttp"])
async def test_store_partitioned_at_judging_time(
    standalone_proxy: Proxy, prefix: str, framework: str, layer: str, on_error: str
) -> None:
    limiter = Limiter(
        standalone_proxy.url,
        {"ip": [Limit(10, per=60, precision=1)]},
        prefix=prefix,
        deadline=DEADLINE,
        on_error=on_error,  # type: ignore[arg-type]
    )
    try:
        assert (await limiter.try_acquire(f"ip:{IP}")).allowed  # connected, warm
        app = build(framework, layer, limiter)
        standalone_proxy.partition()
        started = time.monotonic()
        response = await get_once(framework, app)
        took = time.monotonic() - started
    finally:
        standalone_proxy.heal()
        await limiter.aclose()
    assert took < 2.0, took
    assert "ratelimit" not in {k.lower() for k in response.headers}, dict(response.headers)
    if on_error == "open":
        assert response.status_code == 200, (response.status_code, response.text)
    else:
        assert response.status_code == 503, (response.status_code, response.text)
        assert response.headers["content-type"].startswith("application/problem+json")
        retry = response.headers["retry-after"]
        assert retry.isdigit() and int(retry) >= 1, retry
        assert json.loads(response.content)["status"] == 503


@pytest.mark.parametrize("framework", ["starlette", "aiohttp"])
async def test_a_closed_503_from_a_second_limiter_gives_back_the_firsts_slot(
    standalone_proxy: Proxy, redis_url: str, prefix: str, framework: str
) -> None:
    """Two middlewares: the outer limiter (healthy Redis) takes a Concurrency slot, the inner
    one (behind a partitioned proxy, on_error="closed") refuses with 503: the request is
    refused and holds nothing."""
    pool = Limiter(redis_url, {"ip": [Concurrency(2, lease_ttl=60)]}, prefix=prefix + "p")
    down = Limiter(
        standalone_proxy.url, {"ip": [Limit(10, per=60, precision=1)]}, prefix=prefix + "d",
        deadline=DEADLINE, on_error="closed",
    )  # fmt: skip
    try:
        assert (await down.try_acquire(f"ip:{IP}")).allowed
        if framework == "starlette":
            app: object = Starlette(
                routes=[Route("/", hello)],
                middleware=[
                    Middleware(RateLimitMiddleware, limiter=pool),
                    Middleware(RateLimitMiddleware, limiter=down),
                ],
            )
        else:
            app = web.Application(
                middlewares=[aio.rate_limit_middleware(pool), aio.rate_limit_middleware(down)]
            )
            app.router.add_get("/", aio_hello)
        standalone_proxy.partition()
        codes = [(await get_once(framework, app)).status_code for _ in range(3)]
    finally:
        standalone_proxy.heal()
        await asyncio.sleep(0.1)
        remaining = (await pool.peek(f"ip:{IP}")).remaining
        await pool.aclose()
        await down.aclose()
    assert codes == [503, 503, 503], codes
    assert remaining == 2, f"slots left after three refused requests: {remaining}"
