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

The limiter's own code in situ (the second table; ``--no-own`` skips it). The CPU columns above
count everything the server does more per request, the two header lines it writes included,
and move by a few µs from run to run. So each prefetching row runs once more with its
middleware's own parts timed inside the uvicorn process: ``time.perf_counter_ns`` is read as a
request enters the middleware, and the clock stops while the app below it runs (except when
that app calls the middleware's ``send``) and while the server's ``send`` and ``receive`` run.
What is left is the wall time of aiolimit's code in the request (its middleware, the
decision, the fields), in the cache state the server leaves it. A do-nothing middleware
(``pass-through``) timed the same way gives the timing's own cost, subtracted. Units taken
ahead in background tasks are not in it: the table gives the script calls per 1000 requests
(Redis ``INFO commandstats``) for those.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import math
import os
import signal
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = (
    "bare", "aiolimit", "aiolimit-prefetch", "aiolimit-3", "slowapi", "headers-only", "fastapi",
    "fastapi-aiolimit-prefetch",
)  # fmt: skip
SERVED = (*VARIANTS, "pass-through", "fastapi-pass-through")  # (the timed rows' calibration)
#: The rows whose middleware is also timed in situ (``OWN``), and the do-nothing middleware
#: timed the same way for each (the timing's own cost).
OWN_ROWS = {
    "aiolimit-prefetch": "pass-through",
    "fastapi-aiolimit-prefetch": "fastapi-pass-through",
}
OWN = "+own"  # (a variant's name with this: its middleware timed in situ)
HUGE = 1_000_000_000
#: requests/s, p50 latency ms, non-200 responses, server process CPU µs per request (or NaN),
#: Redis script calls per 1000 requests, and for a row timed in situ the median of its middleware's
#: own µs per request (else NaN)
Result = tuple[float, float, int, float, float, float]


def build_app(variant: str, redis_url: str) -> object:
    if variant.endswith(OWN):
        return _timed(build_app(variant.removesuffix(OWN), redis_url))
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
    if variant == "pass-through":
        app.add_middleware(PassThrough)
        return app
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


class PassThrough:
    """A pure ASGI middleware that does nothing (the timing's cost in the in-situ table)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)


#: (perf_counter_ns at a request's start, ns of the middleware's own code in it), per request.
_SAMPLES: list[tuple[int, int]] = []


def _timed(app: Any) -> Any:
    """``app`` (a Starlette or FastAPI app) with its first ``RateLimitMiddleware`` (or
    ``PassThrough``) timed in situ: see the module's doc. The samples are written to the file
    named by ``WEB_BENCH_OWN`` when the server exits."""
    clock = time.perf_counter_ns
    app.middleware_stack = app.build_middleware_stack()
    parent = app.middleware_stack
    while type(parent.app).__name__ not in ("RateLimitMiddleware", "PassThrough"):
        parent = parent.app
    middleware = parent.app
    below = middleware.app

    async def entering(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await middleware(scope, receive, send)
            return
        spent = 0
        began = start = clock()

        def pause() -> None:
            nonlocal spent
            spent += clock() - start

        def resume() -> None:
            nonlocal start
            start = clock()

        async def server_send(message: Any) -> None:
            pause()
            await send(message)
            resume()

        async def server_receive() -> Any:
            pause()
            message = await receive()
            resume()
            return message

        scope["web_bench.timing"] = (pause, resume)
        await middleware(scope, server_receive, server_send)
        pause()
        _SAMPLES.append((began, spent))

    async def app_below(scope: Any, receive: Any, send: Any) -> None:
        pause, resume = scope["web_bench.timing"]

        async def middleware_send(message: Any) -> None:
            resume()
            await send(message)
            pause()

        async def middleware_receive() -> Any:
            resume()
            message = await receive()
            pause()
            return message

        pause()
        try:
            await below(scope, middleware_receive, middleware_send)
        finally:
            resume()

    def written() -> None:
        path = os.environ.get("WEB_BENCH_OWN")
        if path:
            with open(path, "w", encoding="ascii") as out:
                out.writelines(f"{began} {spent}\n" for began, spent in _SAMPLES)

    atexit.register(written)
    middleware.app = app_below
    parent.app = entering
    return app


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


#: The commands that run a script (``INFO commandstats`` counts the commands a script runs
#: as well, under their own names).
SCRIPT_CALLS = ("fcall", "fcall_ro", "evalsha", "evalsha_ro", "eval", "eval_ro")


def script_calls(redis_url: str) -> int:
    """Script calls the Redis server has run so far (``INFO commandstats``)."""
    import redis

    with redis.Redis.from_url(redis_url) as client:
        stats = client.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in SCRIPT_CALLS)


async def load(
    port: int, seconds: float, concurrency: int, pid: int, redis_url: str
) -> tuple[Result, tuple[int, int]]:
    """(requests/s, p50 latency ms, non-200 count, the server process's CPU µs per request or
    NaN, Redis script calls per 1000 requests, NaN) over ``seconds`` after a 1 s warm-up, and the
    measured phase's bounds (``perf_counter_ns``, the same clock as the server's)."""
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
        calls_before = script_calls(redis_url)
        cpu_before = process_cpu(pid)
        started = time.perf_counter()
        await asyncio.gather(*(worker(started + seconds, True) for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
        cpu_after = process_cpu(pid)
        calls = script_calls(redis_url) - calls_before
    cpu = math.nan
    if cpu_before is not None and cpu_after is not None and latencies:
        cpu = (cpu_after - cpu_before) / len(latencies) * 1e6
    done = len(latencies)
    result = (done / elapsed, statistics.median(latencies) * 1000, bad, cpu, calls / done * 1000,
              math.nan)  # fmt: skip
    window = (int(started * 1e9), int((started + elapsed) * 1e9))
    return result, window


async def run_variant(variant: str, redis_url: str, seconds: float, concurrency: int) -> Result:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    samples = Path(tempfile.gettempdir()) / f"web-bench-own-{os.getpid()}-{port}.txt"
    if variant.endswith(OWN):
        env["WEB_BENCH_OWN"] = str(samples)
    process = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--serve", variant, "--port", str(port), "--redis", redis_url,
        cwd=ROOT, env=env,
    )  # fmt: skip
    try:
        await wait_ready(port)
        result, (first, last) = await load(port, seconds, concurrency, process.pid, redis_url)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            await asyncio.wait_for(process.wait(), 10)
        except TimeoutError:
            process.kill()
            await process.wait()
    if variant.endswith(OWN):
        try:
            with samples.open(encoding="ascii") as lines:
                own = sorted(
                    int(spent) for began, spent in (line.split() for line in lines)
                    if first <= int(began) <= last
                )  # fmt: skip
        finally:
            samples.unlink(missing_ok=True)
        if own:
            result = (*result[:5], own[len(own) // 2] / 1000)
    return result


def _base(variant: str) -> str:
    """The bare app a variant is compared with."""
    return "fastapi" if variant.startswith("fastapi") else "bare"


async def bench(
    seconds: float, rounds: int, concurrency: int, variants: list[str], own: bool = True
) -> None:
    sys.path.insert(0, str(ROOT))
    import cluster

    wanted = list(dict.fromkeys([_base(v) for v in variants] + variants))
    chosen = [v for v in VARIANTS if v in wanted]
    timed = []
    if own:
        for variant in chosen:
            if variant in OWN_ROWS:
                timed += [variant + OWN, OWN_ROWS[variant] + OWN]
    with cluster.start_standalone() as server:
        results: dict[str, list[Result]] = {v: [] for v in chosen + timed}
        for _ in range(rounds):
            for variant in chosen + timed:
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

    def median(variant: str, field: int) -> float:
        return statistics.median(r[field] for r in results[variant])  # type: ignore[misc]

    for variant in chosen:
        rps, p50, cpu = median(variant, 0), median(variant, 1), median(variant, 3)
        bad = sum(r[2] for r in results[variant])
        bare, bare_cpu = median(_base(variant), 0), median(_base(variant), 3)
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
    if not timed:
        return
    print("\naiolimit's own code in the request, timed in situ (see the module's doc)\n")
    print(
        f"{'variant':<26} {'timed µs':>9} {'timing µs':>10} {'own µs/req':>11} "
        f"{'of bare':>8} {'scripts/1k':>11}"
    )
    for variant in chosen:
        if variant not in OWN_ROWS:
            continue
        measured = median(variant + OWN, 5)
        timing = median(OWN_ROWS[variant] + OWN, 5)
        bare_cpu = median(_base(variant), 3)
        net = measured - timing
        print(
            f"{variant:<26} {measured:>9.2f} {timing:>10.2f} {net:>11.2f} "
            f"{net / bare_cpu * 100:>7.1f}% {median(variant + OWN, 4):>11.1f}"
        )
    print(
        "\ntimed µs: the median request's time in the middleware's own code (the app below it "
        "and the server's send and receive excluded); timing µs: the same for a do-nothing "
        "middleware (the cost of timing); own µs/req: the difference, the limiter's own CPU per "
        "request; of bare: that as a share of the bare app's CPU per request (the first table); "
        "scripts/1k: the limiter's script calls per 1000 requests meanwhile (units taken ahead "
        "and given back, in the background: not in the own time)."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated, of: " + ", ".join(VARIANTS))  # fmt: skip
    parser.add_argument("--no-own", action="store_true",
                        help="skip timing the prefetching rows' middleware in situ")  # fmt: skip
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--redis", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        if args.serve.removesuffix(OWN) not in SERVED:
            parser.error(f"unknown variant to serve: {args.serve}")
        serve(args.serve, args.port, args.redis)
    else:
        variants = [v for v in args.variants.split(",") if v]
        unknown = sorted(set(variants) - set(VARIANTS))
        if unknown:
            parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
        asyncio.run(bench(args.seconds, args.rounds, args.concurrency, variants, not args.no_own))


if __name__ == "__main__":
    main()
