"""An app served on a Unix socket behind a reverse proxy (nginx ``proxy_pass
http://unix:/run/app.sock``, gunicorn ``--bind unix:...``): a common deployment.

The server gives no client address for such a connection, so without the proxy's
``X-Forwarded-For`` every request is the same client: one budget for the whole site, the
first client to spend it refusing everyone. ``trusted_proxies=["unix"]`` trusts the peer on
a Unix socket (only processes on the host can reach it) and reads the chain as it does for
an IP proxy. Real uvicorn and aiohttp servers on a Unix socket, real Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import httpx
import pytest
import uvicorn
from aiohttp import web
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from aiolimit import ConfigurationError, Limit, Limiter
from aiolimit import aiohttp as aio
from aiolimit._web.client_ip import ClientIPResolver
from aiolimit.starlette import RateLimitMiddleware

Get = Callable[[str | None], Awaitable[int]]
A, B = "198.51.100.1", "198.51.100.2"


@pytest.fixture
async def limiter(redis_url: str, prefix: str) -> AsyncIterator[Limiter]:
    made = Limiter(redis_url, {"ip": [Limit(2, per=60, precision=1)]}, prefix=prefix)
    yield made
    await made.aclose()


@contextlib.asynccontextmanager
async def starlette_on(path: str, limiter: Limiter) -> AsyncIterator[Get]:
    async def hello(request: Request) -> PlainTextResponse:
        return PlainTextResponse("hi")

    app = Starlette(routes=[Route("/", hello)])
    app.add_middleware(RateLimitMiddleware, limiter=limiter, trusted_proxies=["unix"])
    config = uvicorn.Config(
        app, uds=path, log_level="critical", lifespan="off", proxy_headers=False
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(10):
            while not server.started:
                if task.done():
                    task.result()
                await asyncio.sleep(0.005)
        transport = httpx.AsyncHTTPTransport(uds=path)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:

            async def get(forwarded: str | None) -> int:
                headers = {} if forwarded is None else {"x-forwarded-for": forwarded}
                return (await client.get("/", headers=headers)).status_code

            yield get
    finally:
        server.should_exit = True
        await task


@contextlib.asynccontextmanager
async def aiohttp_on(path: str, limiter: Limiter) -> AsyncIterator[Get]:
    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="hi")

    app = web.Application(
        middlewares=[aio.rate_limit_middleware(limiter, trusted_proxies=["unix"])]
    )
    app.router.add_get("/", hello)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.UnixSite(runner, path).start()
    try:
        connector = aiohttp.UnixConnector(path=path)
        async with aiohttp.ClientSession("http://app", connector=connector) as session:

            async def get(forwarded: str | None) -> int:
                headers = {} if forwarded is None else {"x-forwarded-for": forwarded}
                async with session.get("/", headers=headers) as response:
                    return response.status

            yield get
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("serve", [starlette_on, aiohttp_on], ids=["starlette", "aiohttp"])
async def test_clients_behind_a_proxy_on_a_unix_socket_have_budgets_of_their_own(
    limiter: Limiter, tmp_path: pathlib.Path, serve: Callable[..., object]
) -> None:
    path = str(tmp_path / "app.sock")
    async with serve(path, limiter) as get:  # type: ignore[attr-defined]
        first = [await get(A), await get(A), await get(A)]
        other = await get(B)
        # A client writes what it likes left of the proxy's hop: its own budget all the same.
        spoofed = await get(f"{B}, {A}")
    assert first == [200, 200, 429]
    assert other == 200, "a second client shared the first one's budget"
    assert spoofed == 429
    assert (await limiter.peek(f"ip:{B}")).remaining == 1
    assert (await limiter.peek(f"ip:{A}")).remaining == 0


def test_unix_is_the_only_name_trusted_proxies_take() -> None:
    """'unix' trusts a peer with no IP address; an IP peer is judged by the networks alone."""
    resolver = ClientIPResolver(["unix"])
    assert resolver.resolve(None, [f"{B}, {A}"]) == A
    assert resolver.resolve("", [A]) == A
    assert resolver.resolve(None, ["garbage"]) == "unknown"
    assert resolver.resolve("10.0.0.1", [A]) == "10.0.0.1"  # (no IP proxy trusted)
    assert ClientIPResolver().resolve(None, [A]) == "unknown"
    with pytest.raises(ConfigurationError, match="'unix'"):
        ClientIPResolver(["unix-socket"])
