"""Client identity behind a trusted proxy, with a route's own limit under the
middleware, set up as ``aiolimit.starlette``'s module docstring shows::

    app.add_middleware(RateLimitMiddleware, limiter=limiter, keys=...,
                       trusted_proxies=["10.0.0.0/8"])

    @app.get("/report", dependencies=[Depends(RateLimit(limiter, "5/minute"))])

The uvicorn server here only sees 127.0.0.1 (the "proxy"); two clients behind it are told
apart by ``X-Forwarded-For``. Real uvicorn / aiohttp, real Redis.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from aiohttp import web
from fastapi import Depends, FastAPI

from aiolimit import Limit, Limiter
from aiolimit import aiohttp as aio
from aiolimit.starlette import RateLimit, RateLimitMiddleware
from tests.test_web_aiohttp import running
from tests.test_web_starlette import serve

PROXY = "127.0.0.1"
ALICE = {"X-Forwarded-For": "203.0.113.7"}
BOB = {"X-Forwarded-For": "198.51.100.1"}


@pytest.fixture
async def limiter(redis_url: str, prefix: str) -> AsyncIterator[Limiter]:
    made = Limiter(redis_url, {"ip": [Limit(100, per=3600, precision=60)]}, prefix=prefix)
    yield made
    await made.aclose()


async def test_starlette_route_limit_under_a_middleware_trusting_the_proxy_is_per_client(
    limiter: Limiter,
) -> None:
    """Alice uses up /report's 2 an hour; Bob, another client behind the same proxy, must
    still get his own 2. The middleware's own limit is per client (ip:203.0.113.7), but the
    route's is kept per proxy ("GET /report:ip:127.0.0.1"): Alice has used up everyone's."""
    app = FastAPI()
    app.add_middleware(RateLimitMiddleware, limiter=limiter, trusted_proxies=[PROXY])

    @app.get("/report", dependencies=[Depends(RateLimit(limiter, "2/hour"))])
    async def report() -> str:
        return "ok"

    async with serve(app) as client:
        alice = [(await client.get("/report", headers=ALICE)).status_code for _ in range(3)]
        bob = await client.get("/report", headers=BOB)
    # The middleware's own limit: per client (the 429 charged nothing).
    assert (await limiter.peek("ip:203.0.113.7")).remaining == 98
    assert alice == [200, 200, 429]
    assert bob.status_code == 200, (
        f"Bob refused by Alice's use of the route's limit: {bob.status_code} {bob.text}; "
        f"kept under GET /report:ip:{PROXY}: "
        f"{(await limiter.peek(f'GET /report:ip:{PROXY}')).remaining} left"
    )


async def test_aiohttp_route_limit_under_a_middleware_trusting_the_proxy_is_per_client(
    limiter: Limiter,
) -> None:
    @aio.limit(limiter, "2/hour")
    async def report(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(middlewares=[aio.rate_limit_middleware(limiter, trusted_proxies=[PROXY])])
    app.router.add_get("/report", report)
    async with running(app) as base, httpx.AsyncClient(base_url=base) as client:
        alice = [(await client.get("/report", headers=ALICE)).status_code for _ in range(3)]
        bob = await client.get("/report", headers=BOB)
    assert (await limiter.peek("ip:203.0.113.7")).remaining == 98
    assert alice == [200, 200, 429]
    assert bob.status_code == 200, f"Bob refused by Alice's use of the route's limit: {bob.text}"
