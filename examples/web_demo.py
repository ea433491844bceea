"""The web part of the demo: a small FastAPI app behind the limiter, driven by real HTTP.

``await run_web_demo("redis://127.0.0.1:6379/0")`` starts uvicorn on a free loopback port,
sends requests with httpx, prints the RateLimit headers and the 429s, and shuts down. Needs
the ``web`` extra plus FastAPI, uvicorn and httpx (the ``dev`` extra has them all).
"""

from __future__ import annotations

import asyncio
import json
import uuid


async def run_web_demo(limiter_url: str) -> None:
    """Serves a FastAPI app limited per IP and per user, and shows what clients receive."""
    import httpx
    import uvicorn
    from fastapi import Depends, FastAPI

    from aiolimit import Limit, Limiter
    from aiolimit.starlette import (
        CLIENT_IP,
        RateLimit,
        RateLimitExceeded,
        RateLimitMiddleware,
        header_key,
        rate_limit_exceeded_handler,
    )

    # Sliding windows in 1 s buckets: a count never starts afresh on a clock boundary mid-demo
    # (without ``precision`` a Limit is a fixed window aligned to the epoch).
    limits = {
        "ip": [Limit(5, per=10, precision=1)],
        "user": [Limit(3, per=60, precision=1)],
        "report": [Limit(2, per=60, precision=1)],
    }
    limiter = Limiter(limiter_url, limits, prefix=f"webdemo-{uuid.uuid4().hex[:6]}")
    app = FastAPI()
    app.add_exception_handler(RateLimitExceeded, rate_limit_exceeded_handler)
    app.add_middleware(
        RateLimitMiddleware,
        limiter=limiter,
        keys={"ip": CLIENT_IP, "user": header_key("x-user")},
        routes={"/health": None, "/report": None},
    )
    report_limit = RateLimit(limiter, keys={"report": header_key("x-user")}, weight=1)

    @app.get("/hello")
    async def hello() -> dict[str, str]:
        return {"hello": "world"}

    @app.get("/health")
    async def health() -> dict[str, bool]:
        return {"ok": True}

    @app.get("/report", dependencies=[Depends(report_limit)])
    async def report() -> dict[str, str]:
        return {"report": "ready"}

    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, log_level="warning", lifespan="off", proxy_headers=False
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        base = f"http://127.0.0.1:{port}"
        print(f"web demo: FastAPI on {base}; limits {limits}")
        async with httpx.AsyncClient(base_url=base) as client:
            print("\n-- GET /hello as user alice (user limit 3/min, ip limit 5/10s)")
            for _ in range(4):
                _show(await client.get("/hello", headers={"x-user": "alice"}))
            print("\n-- GET /hello as bob: his own user budget, but the shared ip budget")
            for _ in range(2):
                _show(await client.get("/hello", headers={"x-user": "bob"}))
            print("\n-- GET /report (a FastAPI dependency, 2/min per user)")
            for _ in range(3):
                _show(await client.get("/report", headers={"x-user": "carol"}))
            print("\n-- GET /health is exempt")
            _show(await client.get("/health"))
    finally:
        server.should_exit = True
        await task
        await limiter.aclose()


def _show(response: object) -> None:
    headers = response.headers  # type: ignore[attr-defined]
    status = response.status_code  # type: ignore[attr-defined]
    line = f"{status} {response.request.url.path}"  # type: ignore[attr-defined]
    for name in ("RateLimit-Policy", "RateLimit", "Retry-After"):
        if name in headers:
            line += f"\n    {name}: {headers[name]}"
    if status == 429:
        problem = json.loads(response.content)  # type: ignore[attr-defined]
        line += f"\n    body: {problem['title']}; violated {problem.get('violated-policies')}"
    print(line)
