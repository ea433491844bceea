"""The web middleware's own CPU per request, in-process: ASGI calls, no HTTP, no server.

    .venv/bin/python -m bench.middleware_cpu [--requests 4000] [--rounds 3]

The same Starlette app bare and behind ``RateLimitMiddleware`` (one identifier, one limit
nothing reaches; its limiter with and without ``prefetch=256``), called directly as ASGI apps
against a redis-server started here. Reports this process's CPU time per request (the best of
``--rounds``): what the limiter adds to a request, with the network round trip's waiting
excluded but the event loop's work included.

It also reports the limiter's own part of a prefetching request: the decision and its
``RateLimit`` fields (``judge_ids``, what the middleware awaits for it) called alone in a
loop, with no web layer around it.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

import cluster
from aiolimit import Limit, Limiter


async def measure(requests: int, rounds: int) -> dict[str, float]:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    from aiolimit._web.flow import judge_ids
    from aiolimit.starlette import RateLimitMiddleware

    async def hello(request: Request) -> PlainTextResponse:
        return PlainTextResponse("hi")

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        return None

    def scope() -> dict[str, Any]:
        return {
            "type": "http", "method": "GET", "path": "/", "raw_path": b"/", "root_path": "",
            "scheme": "http", "query_string": b"", "headers": [(b"host", b"t")],
            "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 80),
            "asgi": {"version": "3.0"}, "http_version": "1.1", "state": {},
        }  # fmt: skip

    server = cluster.start_standalone()
    with server:
        async with (
            Limiter(server.url, {"ip": [Limit(10**9, per=1)]}) as limiter,
            Limiter(server.url, {"ip": [Limit(10**9, per=1)]}, prefetch=256) as prefetching,
        ):
            limited = Starlette(routes=[Route("/", hello)])
            limited.add_middleware(RateLimitMiddleware, limiter=limiter)
            local = Starlette(routes=[Route("/", hello)])
            local.add_middleware(RateLimitMiddleware, limiter=prefetching)
            bare = Starlette(routes=[Route("/", hello)])
            apps = {"bare": bare, "aiolimit": limited, "aiolimit-prefetch": local}
            for app in apps.values():
                for _ in range(500):
                    await app(scope(), receive, send)
            best = dict.fromkeys(apps, float("inf"))
            for _ in range(rounds):
                for name, app in apps.items():
                    started = time.process_time()
                    for _ in range(requests):
                        await app(scope(), receive, send)
                    spent = (time.process_time() - started) / requests * 1e6
                    best[name] = min(best[name], spent)
            ids = ["ip:127.0.0.1"]
            best["decision"] = float("inf")
            for _ in range(rounds):
                started = time.process_time()
                for _ in range(requests):
                    await judge_ids(prefetching, ids, 1, refund=False, legacy=False)
                spent = (time.process_time() - started) / requests * 1e6
                best["decision"] = min(best["decision"], spent)
            return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.middleware_cpu", description=__doc__)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    best = asyncio.run(measure(args.requests, args.rounds))
    print(f"CPU per request in this process: bare {best['bare']:.1f} µs, "
          f"behind RateLimitMiddleware {best['aiolimit']:.1f} µs, "
          f"with prefetch=256 {best['aiolimit-prefetch']:.1f} µs; the prefetching "
          f"limiter's decision and fields alone {best['decision']:.1f} µs")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
