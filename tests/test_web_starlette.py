"""The Starlette/FastAPI integration through a real uvicorn server and real HTTP (httpx).

Limits are sliding windows (``precision=`` 1 s for 60 s, 60 s for an hour), so values are exact
however long a request takes: a calendar-aligned window (no ``precision``) would start afresh
whenever a test straddles a multiple of its period.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import Depends, FastAPI, HTTPException
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route
from starlette.types import ASGIApp

from aiolimit import Decision, Limit, Limiter
from aiolimit.starlette import (
    CLIENT_IP,
    RateLimit,
    RateLimitExceeded,
    RateLimitMiddleware,
    RouteLimit,
    header_key,
    path_key,
    rate_limit_exceeded_handler,
)


@contextlib.asynccontextmanager
async def serve(app: ASGIApp, **options: Any) -> AsyncIterator[httpx.AsyncClient]:
    """Runs ``app`` on a free loopback port (more uvicorn ``options`` may be given); yields an
    httpx client pointed at it."""
    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, log_level="critical", lifespan="off", proxy_headers=False,
        **options,
    )  # fmt: skip
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(10):
            while not server.started:
                if task.done():
                    task.result()
                await asyncio.sleep(0.005)
        port = server.servers[0].sockets[0].getsockname()[1]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            yield client
    finally:
        server.should_exit = True
        await task


Factory = Callable[..., Limiter]


@pytest.fixture
async def limiter_factory(redis_url: str, prefix: str) -> AsyncIterator[Factory]:
    made: list[Limiter] = []

    def make(limits: object, **options: object) -> Limiter:
        limiter = Limiter(redis_url, limits, prefix=prefix, **options)  # type: ignore[arg-type]
        made.append(limiter)
        return limiter

    yield make
    for limiter in made:
        await limiter.aclose()


async def hello(request: Request) -> PlainTextResponse:
    return PlainTextResponse("hello")


async def boom(request: Request) -> PlainTextResponse:
    raise RuntimeError("handler failed")


async def unavailable(request: Request) -> PlainTextResponse:
    return PlainTextResponse("down", status_code=503)


def starlette_app(limiter: Limiter, **options: object) -> Starlette:
    app = Starlette(
        routes=[
            Route("/", hello),
            Route("/search", hello),
            Route("/health", hello),
            Route("/boom", boom),
            Route("/unavailable", unavailable),
        ]
    )
    app.add_middleware(RateLimitMiddleware, limiter=limiter, **options)  # type: ignore[arg-type]
    return app


def items(field: str) -> dict[str, dict[str, int]]:
    """Parses a RateLimit / RateLimit-Policy value into {name: {param: int}}."""
    parsed = {}
    for item in field.split(","):
        name, *params = item.strip().split(";")
        parsed[name.strip('"')] = {k: int(v) for k, v in (p.split("=") for p in params)}
    return parsed


async def test_headers_on_allowed_and_refused_responses(limiter_factory: Factory) -> None:
    """Every limited response carries RateLimit-Policy and RateLimit with exact values."""
    limiter = limiter_factory(
        {"ip": [Limit(3, per=60, precision=1), Limit(100, per=3600, precision=60)]}
    )
    async with serve(starlette_app(limiter)) as client:
        seen = [await client.get("/") for _ in range(4)]
    assert [r.status_code for r in seen] == [200, 200, 200, 429]
    for response in seen:
        assert items(response.headers["ratelimit-policy"]) == {
            "ip-3-per-60s": {"q": 3, "w": 60},
            "ip-100-per-3600s": {"q": 100, "w": 3600},
        }
    remaining = [items(r.headers["ratelimit"])["ip-3-per-60s"]["r"] for r in seen]
    assert remaining == [2, 1, 0, 0]
    # The refused 4th request charged nothing: the hourly limit still has 97, not 96 or 98.
    assert [items(r.headers["ratelimit"])["ip-100-per-3600s"]["r"] for r in seen] == [
        99,
        98,
        97,
        97,
    ]
    for response in seen[:3]:
        assert 0 < items(response.headers["ratelimit"])["ip-3-per-60s"]["t"] <= 60
        assert "retry-after" not in response.headers


async def test_refused_body_and_retry_after(limiter_factory: Factory) -> None:
    """A 429 has an RFC 9457 body and an integer Retry-After equal to the refusing t."""
    limiter = limiter_factory([Limit(1, per=60, precision=1)])
    async with serve(starlette_app(limiter)) as client:
        await client.get("/")
        refused = await client.get("/")
    assert refused.status_code == 429
    assert refused.headers["content-type"] == "application/problem+json"
    problem = json.loads(refused.content)
    assert problem["status"] == 429
    assert problem["type"] == "https://iana.org/assignments/http-problem-types#quota-exceeded"
    assert problem["violated-policies"] == ["ip-1-per-60s"]
    retry_after = int(refused.headers["retry-after"])
    assert 1 <= retry_after <= 60
    assert retry_after == items(refused.headers["ratelimit"])["ip-1-per-60s"]["t"]


async def test_several_keys_are_one_all_or_nothing_decision(limiter_factory: Factory) -> None:
    """ip and user keys are decided together: refused by one, charged on neither."""
    limiter = limiter_factory(
        {"ip": [Limit(100, per=60, precision=1)], "user": [Limit(2, per=60, precision=1)]}
    )
    app = starlette_app(limiter, keys={"ip": CLIENT_IP, "user": header_key("x-user")})
    async with serve(app) as client:
        statuses = [
            (await client.get("/", headers={"x-user": "alice"})).status_code for _ in range(3)
        ]
        anonymous = await client.get("/")
    assert statuses == [200, 200, 429]
    # The refused third request was not charged on the ip limit: 2 used, then the anonymous one.
    assert items(anonymous.headers["ratelimit"]) == {
        "ip-100-per-60s": {
            "r": 97,
            "t": items(anonymous.headers["ratelimit"])["ip-100-per-60s"]["t"],
        }
    }
    assert "user" not in anonymous.headers["ratelimit-policy"]


async def test_routes_weights_and_exemptions(limiter_factory: Factory) -> None:
    """A route can weigh more or use another limiter; None exempts it (no headers)."""
    limiter = limiter_factory([Limit(10, per=60, precision=1)])
    strict = limiter_factory({"route": [Limit(1, per=60, precision=1)]})
    app = starlette_app(
        limiter,
        routes={
            "/health": None,
            "/search": RouteLimit(weight=4),
            "/boom*": RouteLimit(limiter=strict, keys={"route": path_key}),
        },
    )
    async with serve(app) as client:
        health = await client.get("/health")
        search = await client.get("/search")
        plain = await client.get("/")
        first = await client.get("/boom")
        second = await client.get("/boom")
    assert health.status_code == 200 and "ratelimit" not in health.headers
    assert items(search.headers["ratelimit"])["ip-10-per-60s"]["r"] == 6
    assert items(plain.headers["ratelimit"])["ip-10-per-60s"]["r"] == 5
    assert first.status_code == 500
    assert second.status_code == 429
    assert "route-1-per-60s" in second.headers["ratelimit-policy"]


async def test_refund_on_exception_and_5xx(limiter_factory: Factory) -> None:
    """With refund_on_error, a raising handler or a 5xx answer gives the weight back."""
    limiter = limiter_factory([Limit(2, per=60, precision=1)])
    async with serve(starlette_app(limiter, refund_on_error=True)) as client:
        failures = [(await client.get(path)).status_code for path in ["/boom", "/unavailable"] * 3]
        ok = await client.get("/")
    assert failures == [500, 503] * 3
    assert items(ok.headers["ratelimit"])["ip-2-per-60s"]["r"] == 1


async def test_refund_on_error_gives_back_only_what_the_request_was_charged(
    limiter_factory: Factory,
) -> None:
    """Rules that change while a request runs (a limit added) do not change what its refund
    gives back: the new pair, filled by others meanwhile, is not credited."""
    limiter = limiter_factory({"ip": [Limit(5, per=60, precision=1)]})

    async def change_then_fail(request: Request) -> PlainTextResponse:
        limiter.set_rules({"ip": [Limit(5, per=60, precision=1), Limit(2, per=30)]})
        for _ in range(2):  # two other requests of this client fill the new 2/30s pair
            assert (await limiter.try_acquire("ip:127.0.0.1")).allowed
        raise RuntimeError("handler failed")

    app = starlette_app(limiter, refund_on_error=True)
    app.add_route("/change", change_then_fail)
    async with serve(app) as client:
        failed = await client.get("/change")
        after = await limiter.peek("ip:127.0.0.1")
    assert failed.status_code == 500
    assert [p.remaining for p in after.details] == [3, 0]


async def test_no_refund_by_default(limiter_factory: Factory) -> None:
    """Without refund_on_error, failed requests count like any other."""
    limiter = limiter_factory([Limit(2, per=60, precision=1)])
    async with serve(starlette_app(limiter)) as client:
        await client.get("/boom")
        ok = await client.get("/")
        refused = await client.get("/")
    assert items(ok.headers["ratelimit"])["ip-2-per-60s"]["r"] == 0
    assert refused.status_code == 429


async def test_spoofed_forwarded_for_from_untrusted_peer_is_ignored(
    limiter_factory: Factory,
) -> None:
    """X-Forwarded-For from a peer that is not a trusted proxy changes nothing."""
    limiter = limiter_factory({"ip": [Limit(1, per=60, precision=1)]})
    app = starlette_app(limiter, trusted_proxies=["10.0.0.0/8"])
    async with serve(app) as client:
        first = await client.get("/", headers={"x-forwarded-for": "203.0.113.1"})
        second = await client.get("/", headers={"x-forwarded-for": "203.0.113.2"})
    assert (first.status_code, second.status_code) == (200, 429)


async def test_forwarded_for_from_trusted_proxy_is_honoured(limiter_factory: Factory) -> None:
    """From a trusted proxy, the rightmost untrusted hop is the client; left hops are ignored."""
    limiter = limiter_factory({"ip": [Limit(1, per=60, precision=1)]})
    app = starlette_app(limiter, trusted_proxies=["127.0.0.0/8", "10.0.0.0/8"])
    async with serve(app) as client:
        a = await client.get("/", headers={"x-forwarded-for": "1.1.1.1, 203.0.113.1, 10.0.0.5"})
        b = await client.get("/", headers={"x-forwarded-for": "203.0.113.2"})
        spoofed_left = await client.get("/", headers={"x-forwarded-for": "9.9.9.9, 203.0.113.1"})
    assert (a.status_code, b.status_code, spoofed_left.status_code) == (200, 200, 429)


@pytest.mark.parametrize(
    "headers",
    [
        {"x-forwarded-for": "not-an-ip, , [::1"},
        {"x-forwarded-for": ", ".join(["1.2.3.4"] * 1_000)},
        {"x-user": "ü" * 10 + "\U0001f600"},
        {"x-user": "é" * 5_000},
        {"x-user": "x" * 10_000},
    ],
)
async def test_bad_input_never_500(limiter_factory: Factory, headers: dict[str, str]) -> None:
    """Malformed forwarded headers, huge and non-ASCII key values: an answer, never a 500."""
    limiter = limiter_factory(
        {"ip": [Limit(5, per=60, precision=1)], "user": [Limit(5, per=60, precision=1)]}
    )
    app = starlette_app(
        limiter,
        keys={"ip": CLIENT_IP, "user": header_key("x-user")},
        trusted_proxies=["127.0.0.0/8"],
    )
    encoded = {k: v.encode("utf-8") for k, v in headers.items()}
    async with serve(app) as client:
        response = await client.get("/", headers=encoded)  # type: ignore[arg-type]
    assert response.status_code == 200
    assert "ratelimit" in response.headers


def fastapi_app(limiter: Limiter, **options: object) -> FastAPI:
    app = FastAPI()
    app.add_exception_handler(RateLimitExceeded, rate_limit_exceeded_handler)
    guard = RateLimit(limiter, **options)  # type: ignore[arg-type]

    @app.get("/who")
    # Depends() as a default (not Annotated): `guard` is local, and string annotations
    # (from __future__ import annotations) cannot see it.
    async def who(decision: Decision | None = Depends(guard)) -> dict[str, object]:  # noqa: B008
        return {"ids": [p.identifier for p in decision.details] if decision else []}

    @app.get("/fail")
    async def fail(_: object = Depends(guard)) -> None:
        raise HTTPException(502, "upstream failed")

    @app.get("/missing")
    async def missing(_: object = Depends(guard)) -> None:
        raise HTTPException(404, "no such thing")

    @app.get("/free")
    async def free() -> JSONResponse:
        return JSONResponse({"free": True})

    return app


async def test_fastapi_dependency_headers_body_and_client_ip(limiter_factory: Factory) -> None:
    """Depends(RateLimit(...)) limits one route, sets headers, and 429s with problem+json."""
    limiter = limiter_factory({"ip": [Limit(2, per=60, precision=1)]})
    app = fastapi_app(limiter, weight=1, trusted_proxies=["127.0.0.1"])
    async with serve(app) as client:
        first = await client.get("/who", headers={"x-forwarded-for": "203.0.113.9"})
        await client.get("/who", headers={"x-forwarded-for": "203.0.113.9"})
        refused = await client.get("/who", headers={"x-forwarded-for": "203.0.113.9"})
        free = await client.get("/free")
    assert first.json() == {"ids": ["ip:203.0.113.9"]}
    assert items(first.headers["ratelimit"])["ip-2-per-60s"]["r"] == 1
    assert refused.status_code == 429
    assert refused.headers["content-type"] == "application/problem+json"
    assert json.loads(refused.content)["violated-policies"] == ["ip-2-per-60s"]
    assert int(refused.headers["retry-after"]) >= 1
    assert "ratelimit" not in free.headers


async def test_fastapi_dependency_refunds_5xx_but_not_4xx(limiter_factory: Factory) -> None:
    """An HTTPException >= 500 is refunded, one below 500 is a normal, charged answer."""
    limiter = limiter_factory({"ip": [Limit(3, per=60, precision=1)]})
    app = fastapi_app(limiter, refund_on_error=True)
    async with serve(app) as client:
        failed = [(await client.get("/fail")).status_code for _ in range(4)]
        missing = await client.get("/missing")
        who = await client.get("/who")
    assert failed == [502] * 4
    assert missing.status_code == 404
    assert items(who.headers["ratelimit"])["ip-3-per-60s"]["r"] == 1


LONG = b"z" * 300


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (b"\xff", rb"\xed\xb3\xbf"),
        (b"\xff", b"\xfe"),
        # A long value was replaced by "sha256:<its hash>", which a client can send itself.
        (LONG, b"sha256:" + hashlib.sha256(LONG).hexdigest().encode()),
        (b"caf\xc3\xa9", b"caf\xe9"),  # UTF-8 and Latin-1 spellings of one word
        (b"~x", b"x"),
    ],
)
async def test_distinct_header_bytes_are_distinct_identifiers(
    limiter_factory: Factory, first: bytes, second: bytes
) -> None:
    """Two different raw header values never share an identifier, whatever their bytes."""
    limiter = limiter_factory({"user": [Limit(1, per=60, precision=1)]})
    app = starlette_app(limiter, keys={"user": header_key("x-user")})
    async with serve(app) as client:
        statuses = [
            (await client.get("/", headers={"x-user": value})).status_code  # type: ignore[dict-item]
            for value in (first, second, first, second)
        ]
    assert statuses == [200, 200, 429, 429]


async def test_header_key_of_utf8_bytes_is_their_text(limiter_factory: Factory) -> None:
    """A UTF-8 header value is its text (as on aiohttp), not its bytes read as Latin-1."""
    limiter = limiter_factory({"user": [Limit(5, per=60, precision=1)]})
    app = starlette_app(limiter, keys={"user": header_key("x-user")})
    async with serve(app) as client:
        await client.get("/", headers={"x-user": "café".encode()})
    # peek reports what is left now: 5, minus the request above.
    assert (await limiter.peek("user:café")).remaining == 4


@pytest.mark.parametrize(("ipv6_prefix", "shared"), [(None, True), (128, False), (48, True)])
async def test_ipv6_clients_are_limited_per_64_by_default(
    limiter_factory: Factory, ipv6_prefix: int | None, shared: bool
) -> None:
    """Two addresses of one /64 share a budget by default; ipv6_prefix=128 keys each alone."""
    limiter = limiter_factory({"ip": [Limit(1, per=60, precision=1)]})
    options: dict[str, object] = {} if ipv6_prefix is None else {"ipv6_prefix": ipv6_prefix}
    app = starlette_app(limiter, trusted_proxies=["127.0.0.1"], **options)
    async with serve(app) as client:

        async def status(forwarded_for: str) -> int:
            response = await client.get("/", headers={"x-forwarded-for": forwarded_for})
            return response.status_code

        a = await status("2001:db8:1:2::a")
        b = await status("2001:db8:1:2:ffff:ffff:ffff:b")
        v4 = [await status(f"203.0.113.{n}") for n in (1, 2)]
        mapped = await status("::ffff:203.0.113.1")
    assert a == 200 and b == (429 if shared else 200)
    assert v4 == [200, 200]  # IPv4 stays per address
    assert mapped == 429  # an IPv4-mapped address is that IPv4 address


async def test_fastapi_dependency_keys_ipv6_per_64(limiter_factory: Factory) -> None:
    """The FastAPI dependency groups IPv6 clients per /64 by default too."""
    limiter = limiter_factory({"ip": [Limit(1, per=60, precision=1)]})
    app = fastapi_app(limiter, trusted_proxies=["127.0.0.1"])
    async with serve(app) as client:
        first = await client.get("/who", headers={"x-forwarded-for": "2001:db8::1"})
        second = await client.get("/who", headers={"x-forwarded-for": "2001:db8::2"})
    assert first.json() == {"ids": ["ip:2001:db8::/64"]}
    assert second.status_code == 429
