"""A ``Concurrency`` limit through the web layers counts requests in flight.

An admission under a ``Concurrency`` limit holds a lease. The web layer that judged the request
releases it when the request is over (answered, raised, or refused by a later layer), so the
limit means "at most ``max`` requests at once", not "``max`` requests per ``lease_ttl``".
Real uvicorn and aiohttp servers, real Redis.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest
from aiohttp import ClientSession, web
from fastapi import Depends, FastAPI
from starlette.applications import Starlette
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
POOL = Concurrency(2, lease_ttl=60)


@pytest.fixture
async def limiter(redis_url: str, prefix: str) -> AsyncIterator[Limiter]:
    made = Limiter(redis_url, {"ip": [POOL]}, prefix=prefix)
    yield made
    await made.aclose()


class Gate:
    """Holds the requests that reach the handler until opened; counts them."""

    def __init__(self) -> None:
        self.open = asyncio.Event()
        self.two_inside = asyncio.Event()
        self.entered = asyncio.Event()
        self.inside = 0

    async def wait(self, hold: object) -> None:
        if hold:
            self.inside += 1
            self.entered.set()
            if self.inside == 2:
                self.two_inside.set()
            await self.open.wait()


async def partitioned_mid_request(
    client: httpx.AsyncClient, gate: Gate, proxy: Proxy
) -> tuple[httpx.Response, float]:
    """One request; the store stops answering once it is in its handler, then the handler
    returns: the response, and how long after that it ended."""
    pending = asyncio.ensure_future(client.get("/"))
    async with asyncio.timeout(5):
        await gate.entered.wait()
    proxy.partition()
    started = time.monotonic()
    gate.open.set()
    response = await pending
    return response, time.monotonic() - started


async def three_at_once_then_more(
    get: Callable[[str], Awaitable[int]], gate: Gate, limiter: Limiter, identifier: str
) -> None:
    """Five requests one after another all pass; three at once while two are held: the third
    is refused (429); once the two are answered, the slots are free again."""
    assert [await get("/") for _ in range(5)] == [200] * 5
    assert (await limiter.peek(identifier)).remaining == POOL.amount
    held = [asyncio.ensure_future(get("/?hold=1")) for _ in range(2)]
    async with asyncio.timeout(5):
        await gate.two_inside.wait()
    assert await get("/") == 429
    assert (await limiter.peek(identifier)).remaining == 0
    gate.open.set()
    assert await asyncio.gather(*held) == [200, 200]
    assert (await limiter.peek(identifier)).remaining == POOL.amount
    assert [await get("/") for _ in range(3)] == [200] * 3


async def test_the_starlette_middleware_releases_each_requests_slot(limiter: Limiter) -> None:
    gate = Gate()

    async def hello(request: Request) -> PlainTextResponse:
        await gate.wait(request.query_params.get("hold"))
        return PlainTextResponse("hi")

    app = Starlette(routes=[Route("/", hello)])
    app.add_middleware(RateLimitMiddleware, limiter=limiter)
    async with serve(app) as client:

        async def get(path: str) -> int:
            return (await client.get(path)).status_code

        await three_at_once_then_more(get, gate, limiter, f"ip:{IP}")


async def test_a_fastapi_dependency_alone_releases_its_own_pool(
    redis_url: str, prefix: str
) -> None:
    """The route's own ``Concurrency`` through ``Depends(RateLimit(...))``, no middleware; a
    handler that raises gives its slot back too."""
    gate = Gate()
    limiter = Limiter(redis_url, [Limit(1000, per=60)], prefix=prefix)
    app = FastAPI()

    @app.get("/", dependencies=[Depends(RateLimit(limiter, [POOL], name="pool"))])
    async def root(request: Request) -> dict[str, str]:
        await gate.wait(request.query_params.get("hold"))
        if request.query_params.get("fail"):
            raise RuntimeError("the handler failed")
        return {}

    try:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False, client=(IP, 1))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:

            async def get(path: str) -> int:
                return (await client.get(path)).status_code

            assert [await get("/?fail=1") for _ in range(3)] == [500] * 3
            await three_at_once_then_more(get, gate, limiter, f"pool:ip:{IP}")
    finally:
        await limiter.aclose()


@pytest.mark.parametrize("where", ["middleware", "decorator"])
async def test_aiohttp_releases_each_requests_slot(
    limiter: Limiter, redis_url: str, prefix: str, where: str
) -> None:
    gate = Gate()

    async def hello(request: web.Request) -> web.Response:
        await gate.wait(request.query.get("hold"))
        return web.Response(text="hi")

    if where == "middleware":
        app = web.Application(middlewares=[aio.rate_limit_middleware(limiter)])
        app.router.add_get("/", hello)
        identifier, checked = f"ip:{IP}", limiter
    else:
        own = Limiter(redis_url, [Limit(1000, per=60)], prefix=prefix + "own")
        app = web.Application()
        app.router.add_get("/", aio.limit(own, [POOL], name="pool")(hello))
        identifier, checked = f"pool:ip:{IP}", own
    async with running(app) as base, ClientSession(base) as session:

        async def get(path: str) -> int:
            async with session.get(path) as response:
                return response.status

        await three_at_once_then_more(get, gate, checked, identifier)
    if checked is not limiter:
        await checked.aclose()


async def test_a_refusal_by_a_later_layer_releases_the_slot_taken_before(
    limiter: Limiter, redis_url: str, prefix: str
) -> None:
    """The middleware's limiter takes a slot, the route's own limit (another limiter) refuses:
    the request is refused and holds nothing, its slot included."""
    other = Limiter(redis_url, [Limit(1000, per=60)], prefix=prefix + "route")
    app = FastAPI()

    @app.get("/", dependencies=[Depends(RateLimit(other, [Limit(1, per=3600, precision=60)]))])
    async def root() -> dict[str, str]:
        return {}

    app.add_middleware(RateLimitMiddleware, limiter=limiter)
    try:
        async with serve(app) as client:
            assert [(await client.get("/")).status_code for _ in range(3)] == [200, 429, 429]
        assert (await limiter.peek(f"ip:{IP}")).remaining == POOL.amount
    finally:
        await other.aclose()


async def test_a_store_that_stops_answering_delays_no_response_past_the_deadline(
    redis_url: str, prefix: str
) -> None:
    """Redis stops answering while a request is in its handler: the response still ends,
    whole, within about the limiter's deadline (the release goes on in the background); the
    release's own 5 s budget used to hold the last body message, then break it."""
    host, port = redis_url.split("//")[1].split("/")[0].split(":")
    proxy = await Proxy(host, int(port)).start()
    limiter = Limiter(
        proxy.url, {"ip": [Concurrency(10)]}, prefix=prefix, deadline=0.25, on_error="open"
    )
    gate = Gate()

    async def hello(request: Request) -> PlainTextResponse:
        await gate.wait(True)
        return PlainTextResponse("hi" * 1000)

    app = Starlette(routes=[Route("/", hello)])
    app.add_middleware(RateLimitMiddleware, limiter=limiter)
    try:
        async with serve(app) as client:
            response, took = await partitioned_mid_request(client, gate, proxy)
        assert response.status_code == 200 and response.text == "hi" * 1000
        assert took < 2.0, f"the response ended {took:.2f} s after the handler"
    finally:
        proxy.heal()
        await limiter.aclose()
        await proxy.aclose()


@pytest.mark.parametrize("where", ["middleware", "dependency"])
async def test_a_stream_longer_than_lease_ttl_keeps_its_slot(
    redis_url: str, prefix: str, where: str
) -> None:
    """Concurrency(1, lease_ttl=0.6): a streamed response that lasts twice the TTL still holds
    its slot (the layer renews its lease while the request runs), and gives it back at the end.
    Before, the lease ran out mid-stream and a second request was admitted beside it."""
    from starlette.responses import StreamingResponse

    pool = [Concurrency(1, lease_ttl=0.6)]
    limiter = Limiter(redis_url, {"ip": pool} if where == "middleware" else [Limit(1000, per=60)],
                      prefix=prefix)  # fmt: skip
    streaming, finish = asyncio.Event(), asyncio.Event()

    async def chunks() -> AsyncIterator[bytes]:
        yield b"first"
        streaming.set()
        await finish.wait()
        yield b"last"

    app = FastAPI()
    guards = [] if where == "middleware" else [Depends(RateLimit(limiter, pool, name="pool"))]

    calls = []

    @app.get("/", dependencies=guards)
    async def root() -> StreamingResponse | PlainTextResponse:
        calls.append(1)
        return StreamingResponse(chunks()) if len(calls) == 1 else PlainTextResponse("ok")

    if where == "middleware":
        app.add_middleware(RateLimitMiddleware, limiter=limiter)
    try:
        async with serve(app) as client:
            first = asyncio.ensure_future(client.get("/"))
            async with asyncio.timeout(5):
                await streaming.wait()
            await asyncio.sleep(1.2)  # twice the lease's TTL
            assert (await client.get("/")).status_code == 429
            finish.set()
            response = await first
            assert response.status_code == 200 and response.content == b"firstlast"
            await asyncio.sleep(0.05)  # (the dependency lets go as FastAPI closes it)
            assert (await client.get("/")).status_code == 200
    finally:
        finish.set()
        await limiter.aclose()


async def test_a_shorter_lease_a_later_layer_adds_is_renewed_on_its_own_ttl(
    redis_url: str, prefix: str
) -> None:
    """Two middlewares: the outer's pool has a 60 s lease TTL, the inner's 0.6 s; the inner's
    lease joins the outer's verdict. It is renewed every 0.2 s, not the outer's 20 s: a
    second stream is still refused after 1.5 s."""
    from starlette.middleware import Middleware
    from starlette.responses import StreamingResponse

    outer = Limiter(redis_url, {"ip": [Concurrency(10, lease_ttl=60)]}, prefix=prefix + "o")
    inner = Limiter(redis_url, {"ip": [Concurrency(1, lease_ttl=0.6)]}, prefix=prefix + "i")
    streaming, finish = asyncio.Event(), asyncio.Event()
    calls = []

    async def chunks() -> AsyncIterator[bytes]:
        yield b"first"
        streaming.set()
        await finish.wait()
        yield b"last"

    async def root(request: Request) -> StreamingResponse | PlainTextResponse:
        calls.append(1)
        return StreamingResponse(chunks()) if len(calls) == 1 else PlainTextResponse("ok")

    app = Starlette(
        routes=[Route("/", root)],
        middleware=[
            Middleware(RateLimitMiddleware, limiter=outer),
            Middleware(RateLimitMiddleware, limiter=inner),
        ],
    )
    try:
        async with serve(app) as client:
            first = asyncio.ensure_future(client.get("/"))
            async with asyncio.timeout(5):
                await streaming.wait()
            await asyncio.sleep(1.5)  # 2.5 times the inner lease's TTL
            assert (await client.get("/")).status_code == 429
            finish.set()
            assert (await first).status_code == 200
    finally:
        finish.set()
        await outer.aclose()
        await inner.aclose()


def test_failed_renewals_are_logged_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    """A store outage fails every in-flight request's renewal each third of a TTL: one line
    per RENEWAL_LOG_INTERVAL with the count and the last error, not one per renewal."""
    from aiolimit._web import flow

    flow._renewals.update(failed=0, logged_at=-flow.RENEWAL_LOG_INTERVAL)
    with caplog.at_level("WARNING", logger="aiolimit"):
        for _ in range(80):
            flow._renewal_failed(TimeoutError())
    lines = [r.getMessage() for r in caplog.records if "renewal" in r.getMessage()]
    assert len(lines) == 1 and "TimeoutError()" in lines[0], lines
    assert flow._renewals["failed"] == 79  # counted for the next line


async def test_a_limiter_closed_mid_stream_opens_no_connection_again(
    redis_url: str, prefix: str
) -> None:
    """aclose() while a stream holds a lease: its renewals and its release stop (the lease
    expires at its TTL) rather than reopen connections on the closed client."""
    from starlette.responses import StreamingResponse

    limiter = Limiter(redis_url, {"ip": [Concurrency(5, lease_ttl=0.6)]}, prefix=prefix)
    streaming, finish = asyncio.Event(), asyncio.Event()

    async def chunks() -> AsyncIterator[bytes]:
        yield b"first"
        streaming.set()
        await finish.wait()
        yield b"last"

    async def root(request: Request) -> StreamingResponse:
        return StreamingResponse(chunks())

    app = Starlette(routes=[Route("/", root)])
    app.add_middleware(RateLimitMiddleware, limiter=limiter)
    async with serve(app) as client:
        first = asyncio.ensure_future(client.get("/"))
        async with asyncio.timeout(5):
            await streaming.wait()
        await limiter.aclose()
        store = limiter._store
        await asyncio.sleep(0.5)  # a few renewal ticks
        finish.set()
        assert (await first).status_code == 200
    pool = store.client.connection_pool  # type: ignore[attr-defined]
    connections = [*pool._in_use_connections, *pool._available_connections]
    assert not [c for c in connections if c.is_connected], connections


async def test_leases_of_several_limiters_are_released_together(
    redis_url: str, prefix: str
) -> None:
    """Three middlewares, one Concurrency limiter each, and the store stops answering while
    the request is in its handler: the three releases are waited for together, one deadline
    (0.6 s), not one after another (1.8 s)."""
    from starlette.middleware import Middleware

    host, port = redis_url.split("//")[1].split("/")[0].split(":")
    proxy = await Proxy(host, int(port)).start()
    pool = {"ip": [Concurrency(10)]}
    limiters = [
        Limiter(proxy.url, pool, prefix=f"{prefix}{i}", deadline=0.6, on_error="open")
        for i in range(3)
    ]
    gate = Gate()

    async def hello(request: Request) -> PlainTextResponse:
        await gate.wait(True)
        return PlainTextResponse("hi")

    app = Starlette(
        routes=[Route("/", hello)],
        middleware=[Middleware(RateLimitMiddleware, limiter=limiter) for limiter in limiters],
    )
    try:
        async with serve(app) as client:
            response, took = await partitioned_mid_request(client, gate, proxy)
        assert response.status_code == 200 and response.text == "hi"
        assert took < 1.3, f"the response ended {took:.2f} s after the handler"
    finally:
        proxy.heal()
        for limiter in limiters:
            await limiter.aclose()
        await proxy.aclose()


async def test_a_client_that_hangs_up_mid_stream_gives_its_slot_back(
    limiter: Limiter,
) -> None:
    """Concurrency(2, lease_ttl=60): a client reads the first chunk of a stream that never
    ends and hangs up; the request is cancelled on the server, and its slot comes back long
    before the lease's TTL (nothing else would free it for a minute)."""
    from starlette.responses import StreamingResponse

    streaming = asyncio.Event()

    async def chunks() -> AsyncIterator[bytes]:
        yield b"first"
        streaming.set()
        await asyncio.Event().wait()  # never ends: only the hang-up stops it
        yield b"never"

    async def root(request: Request) -> StreamingResponse:
        return StreamingResponse(chunks())

    app = Starlette(routes=[Route("/", root)])
    app.add_middleware(RateLimitMiddleware, limiter=limiter)
    async with serve(app) as client:
        async with client.stream("GET", "/") as response:
            assert response.status_code == 200
            async with asyncio.timeout(5):
                await streaming.wait()
            assert (await limiter.peek(f"ip:{IP}")).remaining == POOL.amount - 1
        # (leaving the block closes the connection mid-body)
        for _ in range(50):  # 5 s at most
            if (await limiter.peek(f"ip:{IP}")).remaining == POOL.amount:
                break
            await asyncio.sleep(0.1)
        assert (await limiter.peek(f"ip:{IP}")).remaining == POOL.amount
