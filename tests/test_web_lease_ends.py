"""``Concurrency`` slots through the web layers are held exactly while a request
is in flight, whichever layer judged it.

README: "``Concurrency`` limits count requests in flight: the layer that judged a request
releases its slots as the response ends (or the handler fails ...)". Real uvicorn and
aiohttp servers, real Redis.
"""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from fastapi import BackgroundTasks, Depends, FastAPI
from starlette.responses import PlainTextResponse, StreamingResponse

from aiolimit import Concurrency, Limit, Limiter
from aiolimit import aiohttp as aio
from aiolimit.starlette import CLIENT_IP, RateLimit, RateLimitMiddleware
from tests.test_web_aiohttp import running
from tests.test_web_starlette import serve

IP = "127.0.0.1"
POOL = [Concurrency(1, lease_ttl=60)]


@pytest.fixture
async def limiter(redis_url: str, prefix: str) -> AsyncIterator[Limiter]:
    made = Limiter(redis_url, {"ip": POOL, "*": [Limit(1000, per=60)]}, prefix=prefix)
    yield made
    await made.aclose()


@pytest.mark.parametrize("layer", ["middleware", "dependency alone"])
async def test_slot_is_free_once_the_response_has_ended_despite_a_background_task(
    limiter: Limiter, layer: str
) -> None:
    """Concurrency(1): a response whose background task (an email, a cache warm-up) runs for
    2 s after the response. The client has the whole response; a second request is not in
    flight beside any other, and is admitted under the middleware. A dependency alone
    releases when FastAPI closes it, after the background tasks (README): refused until
    then, admitted after (the slot is not leaked)."""
    done = asyncio.Event()

    async def slow_job() -> None:
        await asyncio.sleep(2)
        done.set()

    app = FastAPI()
    guards = [Depends(RateLimit(limiter, POOL, name="pool"))] if layer != "middleware" else []

    @app.get("/", dependencies=guards)
    async def root(tasks: BackgroundTasks) -> dict[str, bool]:
        if not done.is_set():
            tasks.add_task(slow_job)
        return {"ok": True}

    if layer == "middleware":
        app.add_middleware(RateLimitMiddleware, limiter=limiter)
    async with serve(app) as client:
        first = await client.get("/")
        assert first.status_code == 200 and first.json() == {"ok": True}
        await asyncio.sleep(0.2)
        second = await client.get("/")
        assert not done.is_set()  # (still within the background task)
        async with asyncio.timeout(5):
            await done.wait()
        third = await client.get("/")
    assert second.status_code == (200 if layer == "middleware" else 429), (
        f"the first response had ended; its slot: {second.status_code}"
    )
    assert third.status_code == 200


async def test_dependency_alone_releases_the_slot_of_a_client_that_hangs_up_mid_stream(
    limiter: Limiter,
) -> None:
    streaming = asyncio.Event()

    async def chunks() -> AsyncIterator[bytes]:
        yield b"first"
        streaming.set()
        await asyncio.Event().wait()
        yield b"never"

    app = FastAPI()

    @app.get("/", dependencies=[Depends(RateLimit(limiter, POOL, name="pool"))])
    async def root() -> StreamingResponse:
        return StreamingResponse(chunks())

    identifier = f"pool:ip:{IP}"
    async with serve(app) as client:
        async with client.stream("GET", "/") as response:
            assert response.status_code == 200
            async with asyncio.timeout(5):
                await streaming.wait()
            assert (await limiter.peek(identifier)).remaining == 0
        for _ in range(50):
            if (await limiter.peek(identifier)).remaining == 1:
                break
            await asyncio.sleep(0.1)
    assert (await limiter.peek(identifier)).remaining == 1


@pytest.mark.parametrize("where", ["middleware", "decorator"])
async def test_aiohttp_handler_cancelled_on_hang_up_releases_its_slot(
    limiter: Limiter, where: str
) -> None:
    """aiohttp with ``handler_cancellation=True``: the client hangs up while the handler
    waits; the handler is cancelled and its slot comes back at once."""
    entered = asyncio.Event()
    cancelled = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        entered.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return web.Response(text="late")

    if where == "middleware":
        app = web.Application(middlewares=[aio.rate_limit_middleware(limiter)])
        app.router.add_get("/", slow)
        identifier = f"ip:{IP}"
    else:
        app = web.Application()
        app.router.add_get("/", aio.limit(limiter, POOL, name="pool")(slow))
        identifier = f"pool:ip:{IP}"
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        async with aiohttp.ClientSession(f"http://{host}:{port}") as session:
            pending = asyncio.ensure_future(session.get("/"))
            async with asyncio.timeout(5):
                await entered.wait()
            assert (await limiter.peek(identifier)).remaining == 0
            pending.cancel()
            async with asyncio.timeout(5):
                await cancelled.wait()
        for _ in range(30):
            if (await limiter.peek(identifier)).remaining == 1:
                break
            await asyncio.sleep(0.1)
        assert (await limiter.peek(identifier)).remaining == 1
    finally:
        await runner.cleanup()


async def test_a_slot_taken_by_a_dependency_the_first_did_not_see_is_released(
    limiter: Limiter,
) -> None:
    """Dependency alone: the route's first ``RateLimit`` finds no key for the request (no
    ``x-user``), and a ``RateLimit`` it could not see (put in by ``dependency_overrides``)
    takes the request's ``Concurrency`` slot. The slot goes back when the request ends:
    the next request is admitted (not refused until the process exits, its lease renewed
    for ever)."""
    from aiolimit.starlette import header_key

    app = FastAPI()
    by_user = RateLimit(limiter, [Limit(1000, per=60)], keys={"user": header_key("x-user")})
    pool = RateLimit(limiter, POOL, name="pool")

    def placeholder() -> None:
        return None

    app.dependency_overrides[placeholder] = pool

    @app.get("/", dependencies=[Depends(by_user), Depends(placeholder)])
    async def root() -> dict[str, bool]:
        return {"ok": True}

    async with serve(app) as client:
        codes = [(await client.get("/")).status_code for _ in range(3)]
    assert codes == [200, 200, 200], codes


async def _slow_chunks(started: asyncio.Event, finish: asyncio.Event) -> AsyncIterator[bytes]:
    yield b"first "
    started.set()
    await finish.wait()
    yield b"last"


@pytest.mark.parametrize("where", ["middleware", "decorator"])
async def test_aiohttp_holds_the_slot_while_a_body_streams_after_the_handler(
    limiter: Limiter, where: str
) -> None:
    """aiohttp writes a returned response's body after the handler (and the middleware) have
    returned: a body from an async iterator, a ``FileResponse``. A download that is still
    being sent is a request in flight: under Concurrency(1) a second request is refused
    while the first body streams, and admitted once it has ended."""
    started, finish = asyncio.Event(), asyncio.Event()

    async def download(request: web.Request) -> web.Response:
        if started.is_set():  # (only the first body is held back)
            return web.Response(text="quick")
        return web.Response(body=_slow_chunks(started, finish))

    if where == "middleware":
        app = web.Application(middlewares=[aio.rate_limit_middleware(limiter)])
        app.router.add_get("/", download)
        identifier = f"ip:{IP}"
    else:
        app = web.Application()
        app.router.add_get("/", aio.limit(limiter, POOL, name="pool")(download))
        identifier = f"pool:ip:{IP}"
    async with running(app) as base, aiohttp.ClientSession(base) as session:

        async def read(path: str) -> tuple[int, bytes]:
            async with session.get(path) as response:
                return response.status, await response.read()

        first = asyncio.ensure_future(read("/"))
        async with asyncio.timeout(5):
            await started.wait()
        during = await limiter.peek(identifier)
        second, _ = await read("/")
        finish.set()
        assert await first == (200, b"first last")
        after, _ = await read("/")
    assert (during.remaining, second) == (0, 429), "the slot was free while the body streamed"
    assert after == 200
    assert (await limiter.peek(identifier)).remaining == 1


async def test_aiohttp_file_download_cut_short_gives_its_slot_back(
    limiter: Limiter, tmp_path: pathlib.Path
) -> None:
    """A ``FileResponse`` too large for the socket buffers, read by a client that stops
    reading: the slot is held while the file is sent, and comes back when the client
    hangs up (not at the lease's TTL)."""
    path = tmp_path / "big.bin"
    path.write_bytes(b"\0" * (32 << 20))

    async def file(request: web.Request) -> web.FileResponse:
        return web.FileResponse(path)

    app = web.Application(middlewares=[aio.rate_limit_middleware(limiter)])
    app.router.add_get("/", file)
    identifier = f"ip:{IP}"
    async with running(app) as base:
        host, port = base.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        async with asyncio.timeout(5):
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        await asyncio.sleep(0.3)  # (the server is blocked on a full socket)
        during = await limiter.peek(identifier)
        writer.transport.abort()
        for _ in range(50):
            if (await limiter.peek(identifier)).remaining == 1:
                break
            await asyncio.sleep(0.1)
    assert during.remaining == 0, "the slot was free while the file was being sent"
    assert (await limiter.peek(identifier)).remaining == 1


def with_request_timeout(app: Any, seconds: float) -> Any:
    """``app`` behind a request-timeout middleware, the usual way to bound a request: each
    HTTP request runs in ``anyio.move_on_after(seconds)`` and gets a 504 when cut. The
    cancelled request's cleanup then runs inside the cancelled scope, where every ``await``
    is cancelled again."""
    import anyio

    async def timed(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        with anyio.move_on_after(seconds):
            await app(scope, receive, send)
            return
        await PlainTextResponse("timed out", 504)(scope, receive, send)

    return timed


async def test_a_request_timed_out_by_an_outer_cancel_scope_frees_every_limiters_slot(
    redis_url: str, prefix: str
) -> None:
    """A request-timeout middleware around the app (``anyio.move_on_after``, the usual way
    to bound a request) cancels a slow request; the middleware's cleanup then runs inside
    the cancelled scope, where every ``await`` is cancelled again. The request held slots
    on two limiters (the middleware's and the route's own): both come back at once, not at
    their lease TTL (60 s), so the next request is admitted."""

    pools = [
        Limiter(redis_url, {"ip": POOL}, prefix=f"{prefix}{i}", deadline=1.0) for i in range(2)
    ]
    entered = asyncio.Event()

    app = FastAPI()

    @app.get("/", dependencies=[Depends(RateLimit(pools[1], keys={"ip": CLIENT_IP}))])
    async def root(slow: int = 0) -> dict[str, bool]:
        if slow:
            entered.set()
            await asyncio.sleep(30)
        return {"ok": True}

    app.add_middleware(RateLimitMiddleware, limiter=pools[0])

    try:
        async with serve(with_request_timeout(app, 0.5)) as client:
            first = await client.get("/?slow=1")
            async with asyncio.timeout(5):
                await entered.wait()
            for _ in range(20):
                left = [(await pool.peek(f"ip:{IP}")).remaining for pool in pools]
                if left == [1, 1]:
                    break
                await asyncio.sleep(0.1)
            second = await client.get("/")
    finally:
        for pool in pools:
            await pool.aclose()
    assert first.status_code == 504
    assert left == [1, 1], f"slots still held after the request ended: {left}"
    assert second.status_code == 200


async def test_aiohttp_a_streamed_body_that_fails_is_given_back_and_frees_its_slot(
    redis_url: str, prefix: str
) -> None:
    """The layer sends a streamed body itself while it holds a slot (above): a body that
    fails half-way is the app's failure, given back under ``refund_on_error``, and the
    slot comes back; the next request is served."""
    limiter = Limiter(redis_url, {"ip": [*POOL, Limit(100, per=60, precision=1)]}, prefix=prefix)

    async def broken() -> AsyncIterator[bytes]:
        yield b"half"
        raise RuntimeError("the body failed")

    async def download(request: web.Request) -> web.Response:
        if request.query.get("fail"):
            return web.Response(body=broken())
        return web.Response(text="whole")

    app = web.Application(middlewares=[aio.rate_limit_middleware(limiter, refund_on_error=True)])
    app.router.add_get("/", download)
    try:
        async with running(app) as base, aiohttp.ClientSession(base) as session:
            with pytest.raises(aiohttp.ClientError):
                async with session.get("/?fail=1") as response:
                    await response.read()
            async with session.get("/") as response:
                served = response.status, await response.text()
        after = await limiter.peek(f"ip:{IP}")
    finally:
        await limiter.aclose()
    assert served == (200, "whole")
    assert [pair.remaining for pair in after.details] == [1, 99]  # (only the second charged)
