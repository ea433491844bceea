"""Requests per second through a real uvicorn app: bare, behind aiolimit, behind slowapi.

    .venv/bin/python bench/web_bench.py [--seconds 4] [--rounds 2] [--concurrency 32]

Each variant is the same Starlette app ("GET /" answers a short text) in its own uvicorn process
on a free loopback port, against one local redis-server started here. This process is the load
generator (aiohttp client, ``concurrency`` keep-alive connections). Limits are set so high that
nothing is refused: what is measured is the cost of an admitted request. Variants run
interleaved for ``rounds`` rounds; the table shows the median. Bounded: about
3 x rounds x (seconds + 2) seconds.

- bare: the app alone.
- aiolimit: ``RateLimitMiddleware``, one identifier (the client IP) under one limit, headers on.
- aiolimit-prefetch: the same with ``Limiter(..., prefetch=256)``: a busy identifier takes
  units ahead and most requests are admitted in the process, with no round trip.
- aiolimit-3: three identifiers (ip, user, route) x two limits each, one script call.
- slowapi: ``SlowAPIASGIMiddleware`` with the same one limit on the same Redis (``limits``'
  synchronous Redis storage, as slowapi uses it), headers on.
- headers-only: no limiter, a pure ASGI middleware that only adds two ``RateLimit`` fields of
  the same shape to every response (a counter in ``r``): the floor any limiter that sends the
  fields pays in this server, whatever its decision costs.
- fastapi, fastapi-aiolimit-prefetch: the same endpoint as a FastAPI app, bare and behind the
  prefetching middleware (compared with ``fastapi``: issue 10 states its web goal against a
  bare FastAPI request).

``--variants a,b,...`` runs some of them (``bare`` and, for the FastAPI ones, ``fastapi`` are
added when missing: the shares are computed against them).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import signal
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = (
    "bare", "aiolimit", "aiolimit-prefetch", "aiolimit-3", "slowapi", "headers-only", "fastapi",
    "fastapi-aiolimit-prefetch",
)  # fmt: skip
HUGE = 1_000_000_000
#: requests/s, p50 latency ms, non-200 responses, server process CPU µs per request (or NaN)
Result = tuple[float, float, int, float]


def build_app(variant: str, redis_url: str) -> object:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    async def hello(request: Request) -> PlainTextResponse:
        return PlainTextResponse("hello")

    app: Any = Starlette(routes=[Route("/", hello)])
    if variant.startswith("fastapi"):
        from fastapi import FastAPI

        app = FastAPI()
        app.get("/", response_class=PlainTextResponse)(_fastapi_hello)
        variant = variant.removeprefix("fastapi").removeprefix("-") or "bare"
    if variant == "headers-only":
        return _with_fields(app)
    if variant.startswith("aiolimit"):
        from aiolimit import Limit, Limiter
        from aiolimit.starlette import CLIENT_IP, RateLimitMiddleware, header_key, path_key

        if variant in ("aiolimit", "aiolimit-prefetch"):
            limiter = Limiter(
                redis_url, {"ip": [Limit(HUGE, per=60)]}, prefix=f"web{variant}",
                prefetch=256 if variant == "aiolimit-prefetch" else 0,
            )  # fmt: skip
            keys = None
        else:
            two = [Limit(HUGE, per=60), Limit(HUGE, per=3600, precision=60)]
            limiter = Limiter(redis_url, {"ip": two, "user": two, "route": two}, prefix="webbench3")
            keys = {"ip": CLIENT_IP, "user": header_key("x-user"), "route": path_key}
        app.add_middleware(RateLimitMiddleware, limiter=limiter, keys=keys)
    elif variant == "slowapi":
        from slowapi import Limiter as SlowLimiter
        from slowapi.middleware import SlowAPIASGIMiddleware
        from slowapi.util import get_remote_address

        slow = SlowLimiter(
            key_func=get_remote_address,
            default_limits=[f"{HUGE}/minute"],
            storage_uri=redis_url,
            headers_enabled=True,
        )
        app.state.limiter = slow
        app.add_middleware(SlowAPIASGIMiddleware)
    return app


async def _fastapi_hello() -> str:
    return "hello"


def _with_fields(app: Any) -> Any:
    """``app`` behind a middleware that only adds two RateLimit fields (see headers-only)."""
    left = [HUGE]
    policy = (b"ratelimit-policy", b'"ip-%d-per-60s";q=%d;w=60' % (HUGE, HUGE))

    async def fields_only(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        left[0] -= 1
        remaining = left[0]

        async def send_with_fields(message: Any) -> None:
            if message["type"] == "http.response.start":
                fields = [policy, (b"ratelimit", b'"ip-%d-per-60s";r=%d;t=60' % (HUGE, remaining))]
                message = {**message, "headers": [*message.get("headers", ()), *fields]}
            await send(message)

        await app(scope, receive, send_with_fields)

    return fields_only


def serve(variant: str, port: int, redis_url: str) -> None:
    import uvicorn

    uvicorn.run(
        build_app(variant, redis_url),  # type: ignore[arg-type]
        host="127.0.0.1",
        port=port,
        log_level="warning",
        access_log=False,
        proxy_headers=False,
        lifespan="off",
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def wait_ready(port: int, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            await writer.wait_closed()
            return
        except OSError:
            await asyncio.sleep(0.05)
    raise RuntimeError(f"server on port {port} did not start")


def process_cpu(pid: int) -> float | None:
    """CPU seconds (user + system) process ``pid`` has used so far, from /proc (Linux); else
    None."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def load(port: int, seconds: float, concurrency: int, pid: int) -> Result:
    """(requests/s, p50 latency ms, non-200 count, the server process's CPU µs per request or
    NaN) over ``seconds`` after a 1 s warm-up."""
    import aiohttp

    url = f"http://127.0.0.1:{port}/"
    latencies: list[float] = []
    bad = 0
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker(until: float, record: bool) -> None:
            nonlocal bad
            while (now := time.perf_counter()) < until:
                async with session.get(url, headers={"x-user": "42"}) as response:
                    await response.read()
                    if response.status != 200:
                        bad += 1
                if record:
                    latencies.append(time.perf_counter() - now)

        warm = time.perf_counter() + 1.0
        await asyncio.gather(*(worker(warm, False) for _ in range(concurrency)))
        cpu_before = process_cpu(pid)
        started = time.perf_counter()
        await asyncio.gather(*(worker(started + seconds, True) for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
        cpu_after = process_cpu(pid)
    cpu = math.nan
    if cpu_before is not None and cpu_after is not None and latencies:
        cpu = (cpu_after - cpu_before) / len(latencies) * 1e6
    return len(latencies) / elapsed, statistics.median(latencies) * 1000, bad, cpu


async def run_variant(variant: str, redis_url: str, seconds: float, concurrency: int) -> Result:
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--serve", variant, "--port", str(port), "--redis", redis_url,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    try:
        await wait_ready(port)
        return await load(port, seconds, concurrency, process.pid)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            await asyncio.wait_for(process.wait(), 10)
        except TimeoutError:
            process.kill()
            await process.wait()


def _base(variant: str) -> str:
    """The bare app a variant is compared with."""
    return "fastapi" if variant.startswith("fastapi") else "bare"


async def bench(seconds: float, rounds: int, concurrency: int, variants: list[str]) -> None:
    sys.path.insert(0, str(ROOT))
    import cluster

    wanted = list(dict.fromkeys([_base(v) for v in variants] + variants))
    chosen = [v for v in VARIANTS if v in wanted]
    with cluster.start_standalone() as server:
        results: dict[str, list[Result]] = {v: [] for v in chosen}
        for _ in range(rounds):
            for variant in chosen:
                results[variant].append(
                    await run_variant(variant, server.url, seconds, concurrency)
                )
    print(
        f"\nuvicorn + Starlette (FastAPI where named), 1 worker; {concurrency} connections; "
        f"{seconds:g} s x {rounds} round(s), median; redis-server {server.url}\n"
    )
    print(
        f"{'variant':<26} {'req/s':>9} {'p50 ms':>8} {'vs bare':>9} {'non-200':>8} "
        f"{'cpu µs/req':>11} {'limiter µs/req':>15} {'of bare':>8}"
    )
    for variant in chosen:
        rps = statistics.median(r[0] for r in results[variant])
        p50 = statistics.median(r[1] for r in results[variant])
        bad = sum(r[2] for r in results[variant])
        cpu = statistics.median(r[3] for r in results[variant])
        bare = statistics.median(r[0] for r in results[_base(variant)])
        bare_cpu = statistics.median(r[3] for r in results[_base(variant)])
        change = share = added = ""
        if variant != _base(variant):
            change = f"{(rps / bare - 1) * 100:+.1f}%"
            if not math.isnan(cpu) and not math.isnan(bare_cpu):
                added = f"{cpu - bare_cpu:.1f}"
                share = f"{(cpu - bare_cpu) / bare_cpu * 100:.0f}%"
        print(
            f"{variant:<26} {rps:>9.0f} {p50:>8.2f} {change:>9} {bad:>8} {cpu:>11.1f} "
            f"{added:>15} {share:>8}"
        )
    print(
        "\ncpu µs/req: the uvicorn process's CPU time (user + system, /proc) per request over "
        "the measured phase; limiter µs/req: that less bare's (fastapi's for the fastapi "
        "variants): the web layer's and the limiter's own work, redis-py's included; of bare: "
        "that as a share of a bare request's CPU. headers-only adds the two RateLimit fields "
        "alone: the floor of sending them in this server."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated, of: " + ", ".join(VARIANTS))  # fmt: skip
    parser.add_argument("--serve", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--redis", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.port, args.redis)
    else:
        variants = [v for v in args.variants.split(",") if v]
        unknown = sorted(set(variants) - set(VARIANTS))
        if unknown:
            parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
        asyncio.run(bench(args.seconds, args.rounds, args.concurrency, variants))


if __name__ == "__main__":
    main()
