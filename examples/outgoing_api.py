"""Calling a third-party API within its quota: ``@limiter.limited`` on the client function.

A stand-in for the third party runs locally (aiohttp, a free loopback port) and answers 429
to any caller that sends more than 5 requests within a second. The client decorates its
call with the same quota (as an exact sliding log), so all 12 calls succeed: the limiter
makes them wait for their turn instead of collecting 429s.
Run: ``python examples/outgoing_api.py [REDIS_URL]`` (without a URL: ``memory://``).
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid

from aiohttp import ClientSession, web

from aiolimit import Limiter, SlidingLog

QUOTA_PER_SECOND = 5


async def third_party_api() -> tuple[web.AppRunner, str]:
    """A server that enforces its own quota: more than 5 requests within 1 s gets 429."""
    seen: list[float] = []

    async def search(request: web.Request) -> web.Response:
        now = time.monotonic()
        seen[:] = [t for t in seen if now - t < 1.0]
        if len(seen) >= QUOTA_PER_SECOND:
            return web.json_response({"error": "quota exceeded"}, status=429)
        seen.append(now)
        return web.json_response({"q": request.query.get("q", "")})

    app = web.Application()
    app.router.add_get("/search", search)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


async def run(store: str = "memory://", calls: int = 12) -> list[int]:
    """Makes ``calls`` searches through the limited client; returns the HTTP statuses."""
    runner, base = await third_party_api()
    # The third party counts a sliding second, so the client must too: a "5/second" string is
    # a fixed window, which allows 5 at the end of one second and 5 more at the start of the
    # next (429s). An exact sliding log of 5 per 1.1 s leaves a margin for the time a
    # request takes to arrive.
    limiter = Limiter(
        store, [SlidingLog(QUOTA_PER_SECOND, per=1.1)], prefix=f"demo-{uuid.uuid4().hex[:6]}"
    )
    try:
        async with ClientSession(base) as http:

            @limiter.limited("api:search")  # waits for a turn (timeout=None)
            async def search(q: str) -> int:
                async with http.get("/search", params={"q": q}) as response:
                    return response.status

            started = time.monotonic()
            statuses = [await search(f"term {n}") for n in range(calls)]
            print(f"{calls} calls in {time.monotonic() - started:.1f} s: {statuses}")
            return statuses
    finally:
        await limiter.aclose()
        await runner.cleanup()


if __name__ == "__main__":
    asyncio.run(run(sys.argv[1] if len(sys.argv) > 1 else "memory://"))
