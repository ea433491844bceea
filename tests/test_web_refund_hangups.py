"""``refund_on_error`` must never give a charge back to a client that hangs up.

README: "With ``refund_on_error=True`` (middleware or route) a request that raises or answers
5xx gets its weight back on that layer's limits ...; a client that hangs up does not."
``RateLimitMiddleware``'s docstring: "(never when the client hangs up: that would make
requests free)".

Real uvicorn / aiohttp servers and real Redis, except the ASGI 2.4 case, which drives the
app directly with a server-side ``send`` that raises ``OSError`` once the client is gone (as
ASGI spec 2.4 requires of servers).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from fastapi import Depends, FastAPI
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route

from aiolimit import Limit, Limiter
from aiolimit import aiohttp as aio
from aiolimit.starlette import RateLimit, RateLimitMiddleware
from tests.test_web_aiohttp import running
from tests.test_web_starlette import serve

IP = "127.0.0.1"
HOURLY = [Limit(10, per=3600, precision=60)]


@pytest.fixture
async def limiter(redis_url: str, prefix: str) -> AsyncIterator[Limiter]:
    made = Limiter(redis_url, {"ip": HOURLY}, prefix=prefix)
    yield made
    await made.aclose()


async def left(limiter: Limiter, identifier: str) -> int:
    return (await limiter.peek(identifier)).remaining


async def settle(limiter: Limiter, identifier: str, expected: int) -> int:
    """Polls (2 s at most) until ``remaining`` is ``expected``; returns the last value seen."""
    value = await left(limiter, identifier)
    for _ in range(20):
        if value == expected:
            break
        await asyncio.sleep(0.1)
        value = await left(limiter, identifier)
    return value


# -- aiohttp: a client that hangs up mid-stream ----------------------------------------------


@pytest.mark.parametrize("refund", [False, True], ids=["no refund_on_error", "refund_on_error"])
@pytest.mark.parametrize("where", ["middleware", "decorator"])
async def test_aiohttp_client_hanging_up_mid_stream_is_still_charged(
    limiter: Limiter, redis_url: str, prefix: str, where: str, refund: bool
) -> None:
    """A streamed download; the client reads the first chunk and hangs up. The handler's next
    write raises (ConnectionResetError), as any streaming handler's does. The request was
    admitted and ran: it must stay charged (10 -> 9), refund_on_error or not."""
    first_sent = asyncio.Event()
    ended: list[str] = []
    handler_ended = asyncio.Event()

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"first")
        first_sent.set()
        try:
            for _ in range(200):  # 10 s at most
                await asyncio.sleep(0.05)
                await response.write(b"x" * 1024)
        except BaseException as exc:
            ended.append(type(exc).__name__)
            handler_ended.set()
            raise
        return response

    checked, identifier = limiter, f"ip:{IP}"
    if where == "middleware":
        app = web.Application(
            middlewares=[aio.rate_limit_middleware(limiter, refund_on_error=refund)]
        )
        app.router.add_get("/", stream)
    else:
        app = web.Application()
        limited = aio.limit(limiter, HOURLY, name="dl", refund_on_error=refund)
        app.router.add_get("/", limited(stream))
        identifier = f"dl:ip:{IP}"
    async with running(app) as base:
        session = aiohttp.ClientSession(base)
        try:
            response = await session.get("/")
            assert response.status == 200
            async with asyncio.timeout(5):
                await first_sent.wait()
                await response.content.readexactly(5)
            assert await left(checked, identifier) == 9
            response.close()  # hang up mid-body
        finally:
            await session.close()
        async with asyncio.timeout(5):
            await handler_ended.wait()
        # (the handler saw the hang-up; give any refund time to land)
        remaining = await settle(checked, identifier, 10)
    assert ended and ended[0] != "CancelledError", ended
    assert remaining == 9, (
        f"a client that hung up mid-stream got its charge back ({ended[0]} in the handler): "
        f"remaining {remaining}"
    )


# -- Starlette under uvicorn: a client that hangs up mid-upload -----------------------------


async def raw_partial_upload(port: int, path: str) -> None:
    """Sends a POST announcing 100000 bytes, sends 10 of them, and hangs up."""
    _reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Length: 100000\r\n"
        "Content-Type: application/octet-stream\r\n\r\n0123456789".encode()
    )
    await writer.drain()
    await asyncio.sleep(0.3)  # the app is reading the body
    writer.close()
    with contextlib.suppress(Exception):
        await writer.wait_closed()


async def remaining_after_hang_up(
    app: Any, limiter: Limiter, identifier: str, failed: asyncio.Event
) -> int:
    """Serves ``app``, hangs up mid-upload to /upload, waits for the endpoint to fail, and
    returns what ``identifier`` has left once any refund had time to land."""
    async with serve(app) as client:
        port = int(str(client.base_url).rsplit(":", 1)[1].rstrip("/"))
        await raw_partial_upload(port, "/upload")
        async with asyncio.timeout(5):
            await failed.wait()
        return await settle(limiter, identifier, 10)


@pytest.mark.parametrize("refund", [False, True], ids=["no refund_on_error", "refund_on_error"])
async def test_starlette_client_hanging_up_mid_upload_is_still_charged(
    limiter: Limiter, refund: bool
) -> None:
    """A Starlette endpoint reading its body; the client sends part of it and hangs up. The
    endpoint's ``await request.body()`` raises ``ClientDisconnect`` (uvicorn answers
    ``http.disconnect``). The request must stay charged (10 -> 9)."""
    seen: list[str] = []
    failed = asyncio.Event()
    reading = asyncio.Event()

    async def upload(request: Request) -> PlainTextResponse:
        reading.set()
        try:
            body = await request.body()
        except BaseException as exc:
            seen.append(type(exc).__name__)
            failed.set()
            raise
        return PlainTextResponse(str(len(body)))

    app = Starlette(routes=[Route("/upload", upload, methods=["POST"])])
    app.add_middleware(RateLimitMiddleware, limiter=limiter, refund_on_error=refund)
    remaining = await remaining_after_hang_up(app, limiter, f"ip:{IP}", failed)
    assert seen == ["ClientDisconnect"], seen
    assert remaining == 9, f"a client that hung up mid-upload got its charge back: {remaining}"


# -- Starlette under an ASGI 2.4 server: a client that hangs up mid-stream ------------------


class ClientGone(OSError):
    """What an ASGI 2.4 server raises from ``send`` once the client has gone."""


async def call_asgi_24(app: Any, path: str, *, chunks_before_hangup: int) -> list[dict]:
    """Runs one GET through ``app`` as an ASGI spec 2.4 server would: ``send`` raises an
    ``OSError`` once ``chunks_before_hangup`` body messages have been sent."""
    sent: list[dict] = []
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"host", b"test")],
        "client": (IP, 50000),
        "server": ("127.0.0.1", 80),
        "extensions": {},
    }
    never = asyncio.Event()

    async def receive() -> dict:
        if not sent:
            return {"type": "http.request", "body": b"", "more_body": False}
        await never.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        bodies = [m for m in sent if m["type"] == "http.response.body"]
        if message["type"] == "http.response.body" and len(bodies) >= chunks_before_hangup:
            raise ClientGone("client disconnected")
        sent.append(message)

    with contextlib.suppress(Exception):
        async with asyncio.timeout(5):
            await app(scope, receive, send)
    return sent


@pytest.mark.parametrize("refund", [False, True], ids=["no refund_on_error", "refund_on_error"])
async def test_starlette_asgi_24_hang_up_mid_stream_is_still_charged(
    limiter: Limiter, refund: bool
) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(100):
            yield b"chunk"
            await asyncio.sleep(0.01)

    async def stream(request: Request) -> StreamingResponse:
        return StreamingResponse(chunks())

    app = Starlette(routes=[Route("/", stream)])
    app.add_middleware(RateLimitMiddleware, limiter=limiter, refund_on_error=refund)
    sent = await call_asgi_24(app, "/", chunks_before_hangup=2)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    remaining = await settle(limiter, f"ip:{IP}", 10)
    assert remaining == 9, f"a client that hung up mid-stream got its charge back: {remaining}"


# -- FastAPI dependency alone: a 422 (the client's own bad input) -----------------------------


@pytest.mark.parametrize("layer", ["dependency alone", "middleware"])
async def test_fastapi_requests_answered_422_are_limited(
    redis_url: str, prefix: str, layer: str
) -> None:
    """A route limited to 3 an hour (refund_on_error=True) whose query parameter the client
    gets wrong: every request is a 422 (the client's error, not the server's). The 4th on
    must be refused with 429, as under the middleware; with the dependency alone each 422 is
    given back, so the client is never limited."""
    limiter = Limiter(redis_url, {"ip": [Limit(1000, per=3600, precision=60)]}, prefix=prefix)
    tight = [Limit(3, per=3600, precision=60)]
    mw = Limiter(redis_url, {"ip": tight}, prefix=prefix + "mw")
    app = FastAPI()
    if layer == "dependency alone":
        guards = [Depends(RateLimit(limiter, tight, name="items", refund_on_error=True))]
    else:
        guards = []
        app.add_middleware(RateLimitMiddleware, limiter=mw, refund_on_error=True)

    @app.get("/items", dependencies=guards)
    async def items(limit: int) -> dict[str, int]:
        return {"limit": limit}

    try:
        async with serve(app) as client:
            codes = [(await client.get("/items?limit=abc")).status_code for _ in range(6)]
    finally:
        await limiter.aclose()
        await mw.aclose()
    assert codes == [422, 422, 422, 429, 429, 429], codes


async def test_fastapi_dependency_client_hanging_up_mid_upload_is_still_charged(
    limiter: Limiter,
) -> None:
    """The same hang-up mid-upload, judged by ``Depends(RateLimit(..., refund_on_error=True))``
    alone: the endpoint's ``await request.body()`` raises ``ClientDisconnect`` through the
    dependency, which gives the charge back."""
    seen: list[str] = []
    failed = asyncio.Event()
    app = FastAPI()
    guard = RateLimit(limiter, HOURLY, name="up", refund_on_error=True)

    @app.post("/upload", dependencies=[Depends(guard)])
    async def upload(request: Request) -> dict[str, int]:
        try:
            body = await request.body()
        except BaseException as exc:
            seen.append(type(exc).__name__)
            failed.set()
            raise
        return {"size": len(body)}

    remaining = await remaining_after_hang_up(app, limiter, f"up:ip:{IP}", failed)
    assert seen == ["ClientDisconnect"], seen
    assert remaining == 9, f"a client that hung up mid-upload got its charge back: {remaining}"
