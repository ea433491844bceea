"""Shadow rules never show in the web layers' headers.

README: shadow rules "are decided and charged as usual, but never refuse". A client that
follows the ``RateLimit`` fields (the draft's point) must not slow down for them: a shadow
policy is never advertised (not its ``r=0`` while it still has room, nor its wait on a 429
that an enforced limit made), or rolling out a limit in shadow mode would throttle every
well-behaved client. Real Redis, the Starlette middleware over httpx's ASGI transport.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from aiolimit import Limiter, RuleSet
from aiolimit.starlette import CLIENT_IP, RateLimitMiddleware, header_key

IP = "203.0.113.7"
RULES = """
[kinds]
ip = [{ type = "window", amount = 3, per = 60, precision = 1 }]

[kinds.user]
limits = [{ type = "window", amount = 1, per = 3600, precision = 60 }]
shadow = true
"""
ENFORCED = '"ip-3-per-60s";q=3;w=60'


@pytest.fixture
async def client(redis_url: str, prefix: str) -> AsyncIterator[httpx.AsyncClient]:
    limiter = Limiter(redis_url, RuleSet.from_text(RULES), prefix=prefix)

    async def hello(request: Request) -> PlainTextResponse:
        return PlainTextResponse("hi")

    app = Starlette(routes=[Route("/", hello)])
    app.add_middleware(
        RateLimitMiddleware,
        limiter=limiter,
        keys={"ip": CLIENT_IP, "user": header_key("x-user")},
        legacy_headers=True,
    )
    transport = httpx.ASGITransport(app=app, client=(IP, 1))
    try:
        async with httpx.AsyncClient(
            transport=transport, base_url="http://test", headers={"x-user": "7"}
        ) as made:
            yield made
    finally:
        await limiter.aclose()


async def test_a_shadow_policy_is_never_advertised(client: httpx.AsyncClient) -> None:
    """user:7 has a shadow 1/hour, ip a real 3/minute. The first request leaves the shadow
    rule at 0, which must not be announced (the next request is admitted); the 429 that the
    ip limit makes carries the ip limit's wait, not the shadow rule's hour."""
    responses = [await client.get("/") for _ in range(4)]
    assert [r.status_code for r in responses] == [200, 200, 200, 429]
    assert [r.headers["RateLimit-Policy"] for r in responses] == [ENFORCED] * 4
    assert [r.headers["RateLimit"].partition(";t=")[0] for r in responses] == [
        '"ip-3-per-60s";r=2',
        '"ip-3-per-60s";r=1',
        '"ip-3-per-60s";r=0',
        '"ip-3-per-60s";r=0',
    ]
    assert [r.headers["X-RateLimit-Remaining"] for r in responses] == ["2", "1", "0", "0"]
    refused = responses[3]
    assert 1 <= int(refused.headers["Retry-After"]) <= 60, refused.headers["Retry-After"]
    assert refused.json()["violated-policies"] == ["ip-3-per-60s"]
