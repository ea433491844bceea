"""An aiohttp app behind the limiter: one middleware, per-route weights, an exempt route.

``await run_aiohttp_demo("redis://127.0.0.1:6379/0")`` serves the app on a free loopback
port, sends requests with aiohttp's client, prints what clients receive (statuses and the
RateLimit fields), and shuts down. Each request is decided once, all or nothing, over its
client IP and its ``X-User`` (10 per 10 s each, sliding in 1 s buckets); ``/search`` costs 5
units and ``/health`` is never limited. Run: ``python examples/aiohttp_app.py [REDIS_URL]``
(default ``memory://``).
"""

from __future__ import annotations

import asyncio
import sys
import uuid

from aiohttp import ClientSession, web

from aiolimit import Limit, Limiter
from aiolimit.aiohttp import CLIENT_IP, RouteLimit, header_key, rate_limit_middleware


async def hello(request: web.Request) -> web.Response:
    return web.Response(text="hello")


async def search(request: web.Request) -> web.Response:
    return web.json_response({"results": []})


async def health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


def make_app(limiter: Limiter) -> web.Application:
    middleware = rate_limit_middleware(
        limiter,
        keys={"ip": CLIENT_IP, "user": header_key("x-user")},
        routes={"/health": None, "/search": RouteLimit(weight=5)},
    )
    app = web.Application(middlewares=[middleware])
    app.router.add_get("/", hello)
    app.router.add_get("/search", search)
    app.router.add_get("/health", health)
    return app


async def run_aiohttp_demo(store: str = "memory://") -> list[tuple[str, int]]:
    """Serves the app, makes requests, prints them; returns (path, status) in order."""
    limiter = Limiter(
        store, {"ip": [Limit(10, per=10, precision=1)], "user": [Limit(10, per=10, precision=1)]},
        prefix=f"demo-{uuid.uuid4().hex[:6]}",
    )  # fmt: skip
    runner = web.AppRunner(make_app(limiter))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    seen: list[tuple[str, int]] = []
    try:
        async with ClientSession(f"http://127.0.0.1:{port}") as http:
            for path in ["/search", "/", "/", "/", "/", "/", "/", "/health"]:
                async with http.get(path, headers={"x-user": "ada"}) as response:
                    seen.append((path, response.status))
                    print(response.status, path)
                    for name in ("RateLimit-Policy", "RateLimit", "Retry-After"):
                        for value in response.headers.getall(name, []):
                            print(f"    {name}: {value}")
    finally:
        await runner.cleanup()
        await limiter.aclose()
    return seen


if __name__ == "__main__":
    asyncio.run(run_aiohttp_demo(sys.argv[1] if len(sys.argv) > 1 else "memory://"))
