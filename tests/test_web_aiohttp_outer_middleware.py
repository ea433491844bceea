"""An app's own middleware outside aiolimit's sees the response before it is sent, and may
add to it (security headers, a cookie), as aiohttp lets every middleware do. Under a
``Concurrency`` limit aiolimit sent a streamed body (a ``FileResponse``) itself, inside the
chain, to hold the slot while it was sent: the outer middleware then got a response already
sent, and what it added never reached the client. The slots now go back once aiohttp has
sent the response itself."""

from __future__ import annotations

import pathlib
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web

from aiolimit import Concurrency, Limiter
from aiolimit import aiohttp as aio
from tests.test_web_aiohttp import running


@pytest.fixture
async def limiter(redis_url: str, prefix: str) -> AsyncIterator[Limiter]:
    made = Limiter(redis_url, {"ip": [Concurrency(4, lease_ttl=60)]}, prefix=prefix)
    yield made
    await made.aclose()


@web.middleware
async def security_headers(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    response = await handler(request)
    response.headers["X-Frame-Options"] = "DENY"
    return response


async def test_an_outer_middleware_still_sets_headers_on_a_file_response(
    limiter: Limiter, tmp_path: pathlib.Path
) -> None:
    path = tmp_path / "file.txt"
    path.write_text("contents")

    async def file(request: web.Request) -> web.FileResponse:
        return web.FileResponse(path)

    app = web.Application(middlewares=[security_headers, aio.rate_limit_middleware(limiter)])
    app.router.add_get("/", file)
    async with running(app) as base, aiohttp.ClientSession(base) as session:
        async with session.get("/") as response:
            assert response.status == 200
            assert await response.text() == "contents"
            assert response.headers.get("X-Frame-Options") == "DENY"
    assert (await limiter.peek("ip:127.0.0.1")).remaining == 4
