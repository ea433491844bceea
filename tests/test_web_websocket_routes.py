"""Websocket routes of an app whose routes share a ``RateLimit`` dependency.

README: "Websockets are not limited by these layers (the middleware passes them through;
``RateLimit`` is for HTTP routes)". A dependency given to the whole app or to a router
(``FastAPI(dependencies=[Depends(RateLimit(...))])``, the natural way to limit every route)
reaches its websocket routes too: the handshake must pass through untouched, not fail.
The websocket session is driven over ASGI directly (no websocket client is installed here);
the HTTP requests go through httpx's ASGI transport; real Redis.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import APIRouter, Depends, FastAPI, WebSocket

from aiolimit import Limit, Limiter
from aiolimit.starlette import RateLimit, RateLimitMiddleware

IP = "203.0.113.9"


@pytest.fixture
async def limiter(redis_url: str, prefix: str) -> AsyncIterator[Limiter]:
    made = Limiter(redis_url, [Limit(100, per=60, precision=1)], prefix=prefix)
    yield made
    await made.aclose()


async def websocket_session(app: Any, path: str) -> list[dict[str, Any]]:
    """Connects, then takes what the app sends until it closes (at most 5 s)."""
    scope = {
        "type": "websocket", "asgi": {"version": "3.0"}, "scheme": "ws", "http_version": "1.1",
        "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
        "headers": [(b"host", b"test")], "client": (IP, 1), "server": ("test", 80),
        "subprotocols": [], "state": {},
    }  # fmt: skip
    inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    inbox.put_nowait({"type": "websocket.connect"})
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return await inbox.get()

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "websocket.close":
            inbox.put_nowait({"type": "websocket.disconnect", "code": 1000})

    async with asyncio.timeout(5):
        await app(scope, receive, send)
    return sent


@pytest.mark.parametrize("where", ["app", "router", "app under the middleware"])
async def test_a_shared_rate_limit_dependency_lets_websocket_routes_through(
    limiter: Limiter, where: str
) -> None:
    guard = [Depends(RateLimit(limiter, "10/minute", name="shared"))]
    app = FastAPI(dependencies=guard if where != "router" else None)
    router = APIRouter(dependencies=guard if where == "router" else None)

    @router.get("/")
    async def root() -> dict[str, bool]:
        return {"ok": True}

    @router.websocket("/ws")
    async def ws(websocket: WebSocket) -> None:
        await websocket.accept()
        await websocket.send_text("hello")
        await websocket.close()

    app.include_router(router)
    if where == "app under the middleware":
        app.add_middleware(RateLimitMiddleware, limiter=limiter)
    sent = await websocket_session(app, "/ws")
    assert [(m["type"], m.get("text")) for m in sent] == [
        ("websocket.accept", None),
        ("websocket.send", "hello"),
        ("websocket.close", None),
    ]
    transport = httpx.ASGITransport(app=app, client=(IP, 1))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        response = await client.get("/")
    assert response.status_code == 200
    assert '"shared-10-per-60s";r=9' in response.headers["RateLimit"]
