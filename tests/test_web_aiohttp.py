"""The aiohttp integration through a real aiohttp.web server and a real aiohttp client.

Limits are sliding windows (60 s in 1 s buckets), so the counts asserted are exact however the
test falls on the clock: a calendar-aligned minute (no ``precision``) could start afresh mid-test.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import AsyncIterator, Callable

import aiohttp
import httpx
import pytest
from aiohttp import web

from aiolimit import Limit, Limiter
from aiolimit.aiohttp import (
    CLIENT_IP,
    RouteLimit,
    header_key,
    limit,
    path_key,
    rate_limit_middleware,
)

Factory = Callable[..., Limiter]


@contextlib.asynccontextmanager
async def running(app: web.Application) -> AsyncIterator[str]:
    """Runs ``app`` on a free loopback port; yields its base URL."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def serve(app: web.Application) -> AsyncIterator[Callable[..., object]]:
    """Runs ``app`` on a free loopback port; yields ``get(path, **kwargs)``."""
    async with running(app) as base, aiohttp.ClientSession(base) as session:

        async def get(path: str, **kwargs: object) -> tuple[int, dict[str, str], bytes]:
            async with session.get(path, **kwargs) as response:  # type: ignore[arg-type]
                return response.status, dict(response.headers), await response.read()

        yield get


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


async def hello(request: web.Request) -> web.Response:
    return web.Response(text="hello")


async def boom(request: web.Request) -> web.Response:
    raise RuntimeError("handler failed")


async def bad_gateway(request: web.Request) -> web.Response:
    raise web.HTTPBadGateway()


def app_with(middlewares: list[object], extra: dict[str, object] | None = None) -> web.Application:
    app = web.Application(middlewares=middlewares)  # type: ignore[arg-type]
    app.router.add_get("/", hello)
    app.router.add_get("/health", hello)
    app.router.add_get("/items/{id}", hello)
    app.router.add_get("/boom", boom)
    app.router.add_get("/bad-gateway", bad_gateway)
    for path, handler in (extra or {}).items():
        app.router.add_get(path, handler)  # type: ignore[arg-type]
    return app


def items(field: str) -> dict[str, dict[str, int]]:
    parsed = {}
    for item in field.split(","):
        name, *params = item.strip().split(";")
        parsed[name.strip('"')] = {k: int(v) for k, v in (p.split("=") for p in params)}
    return parsed


async def test_middleware_headers_and_problem_body(limiter_factory: Factory) -> None:
    """Allowed and refused responses carry exact RateLimit fields; a 429 is problem+json."""
    limiter = limiter_factory({"ip": [Limit(2, per=60, precision=1)]})
    async with serve(app_with([rate_limit_middleware(limiter, legacy_headers=True)])) as get:
        seen = [await get("/") for _ in range(3)]
    assert [status for status, _, _ in seen] == [200, 200, 429]
    assert [items(h["RateLimit"])["ip-2-per-60s"]["r"] for _, h, _ in seen] == [1, 0, 0]
    assert all(h["RateLimit-Policy"] == '"ip-2-per-60s";q=2;w=60' for _, h, _ in seen)
    _, headers, body = seen[2]
    assert headers["Content-Type"] == "application/problem+json"
    assert json.loads(body)["violated-policies"] == ["ip-2-per-60s"]
    assert int(headers["Retry-After"]) == items(headers["RateLimit"])["ip-2-per-60s"]["t"]
    assert headers["X-RateLimit-Limit"] == "2" and headers["X-RateLimit-Remaining"] == "0"


async def test_decorator_per_handler_keys_and_weight(limiter_factory: Factory) -> None:
    """@limit gives one handler its own keys and weight; several keys decide together."""
    limiter = limiter_factory(
        {"user": [Limit(10, per=60, precision=1)], "route": [Limit(100, per=60, precision=1)]}
    )

    @limit(limiter, keys={"user": header_key("x-user"), "route": path_key}, weight=4)
    async def search(request: web.Request) -> web.Response:
        return web.Response(text="results")

    async with serve(app_with([], {"/search/{q}": search})) as get:
        first = await get("/search/a", headers={"X-User": "42"})
        second = await get("/search/b", headers={"X-User": "42"})
        third = await get("/search/c", headers={"X-User": "42"})
        other_user = await get("/search/d", headers={"X-User": "7"})
        unlimited = await get("/")
    assert [r[0] for r in (first, second, third, other_user)] == [200, 200, 429, 200]
    assert items(second[1]["RateLimit"]) == {
        "user-10-per-60s": {"r": 2, "t": items(second[1]["RateLimit"])["user-10-per-60s"]["t"]},
        "route-100-per-60s": {
            "r": 92,
            "t": items(second[1]["RateLimit"])["route-100-per-60s"]["t"],
        },
    }
    # The refused call charged nothing: the shared route budget went 96, 92, (refused), 88.
    assert items(other_user[1]["RateLimit"])["route-100-per-60s"]["r"] == 88
    assert "RateLimit" not in unlimited[1]


async def test_routes_exempt_and_refunds(limiter_factory: Factory) -> None:
    """None exempts a route; refund_on_error gives the weight back on raise and on 5xx."""
    limiter = limiter_factory([Limit(2, per=60, precision=1)])
    middleware = rate_limit_middleware(
        limiter, routes={"/health": None, "/items/*": RouteLimit(weight=2)}, refund_on_error=True
    )
    async with serve(app_with([middleware])) as get:
        health = await get("/health")
        failures = [(await get(p))[0] for p in ["/boom", "/bad-gateway"] * 3]
        item = await get("/items/1")
        refused = await get("/")
    assert health[0] == 200 and "RateLimit" not in health[1]
    assert failures == [500, 502] * 3
    assert item[0] == 200 and items(item[1]["RateLimit"])["ip-2-per-60s"]["r"] == 0
    assert refused[0] == 429


async def test_forwarded_for_trusted_and_spoofed(limiter_factory: Factory) -> None:
    """X-Forwarded-For counts only from trusted proxies, and only its rightmost untrusted hop."""
    limiter = limiter_factory({"ip": [Limit(1, per=60, precision=1)]})
    trusting = rate_limit_middleware(limiter, trusted_proxies=["127.0.0.1"])
    async with serve(app_with([trusting])) as get:
        a = await get("/", headers={"X-Forwarded-For": "203.0.113.1"})
        b = await get("/", headers={"X-Forwarded-For": "203.0.113.2"})
        spoof = await get("/", headers={"X-Forwarded-For": "6.6.6.6, 203.0.113.2"})
    assert (a[0], b[0], spoof[0]) == (200, 200, 429)
    # 127.0.0.1 itself was never charged above: every request there counted as a 203.0.113.x.
    untrusted = rate_limit_middleware(limiter, trusted_proxies=["10.0.0.0/8"])
    async with serve(app_with([untrusted])) as get:
        c = await get("/", headers={"X-Forwarded-For": "203.0.113.3"})
        d = await get("/", headers={"X-Forwarded-For": "203.0.113.4"})
    assert (c[0], d[0]) == (200, 429)


@pytest.mark.parametrize(
    "headers",
    [
        {"X-Forwarded-For": "[[[, 1.2.3.4:99999, \t"},
        {"X-Forwarded-For": ", ".join(["10.1.1.1"] * 800)},
        {"X-User": "ключ-🔑"},
        {"X-User": "z" * 7000},
    ],
)
async def test_bad_input_never_500(limiter_factory: Factory, headers: dict[str, str]) -> None:
    """Malformed forwarded headers, huge or non-ASCII keys: limited normally, never a 500."""
    limiter = limiter_factory(
        {"ip": [Limit(5, per=60, precision=1)], "user": [Limit(5, per=60, precision=1)]}
    )
    middleware = rate_limit_middleware(
        limiter,
        keys={"ip": CLIENT_IP, "user": header_key("x-user")},
        trusted_proxies=["127.0.0.0/8", "10.0.0.0/8"],
    )
    raw = {k: v.encode("utf-8").decode("latin-1") for k, v in headers.items()}
    async with serve(app_with([middleware])) as get:
        status, response_headers, _ = await get("/", headers=raw)
    assert status == 200
    assert "RateLimit" in response_headers


LONG = b"z" * 300


@pytest.mark.parametrize(
    ("first", "second"),
    [
        # aiohttp decodes b"\xff" to "\udcff"; escaping that once gave the second's text.
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
    middleware = rate_limit_middleware(limiter, keys={"user": header_key("x-user")})
    async with running(app_with([middleware])) as base, httpx.AsyncClient(base_url=base) as client:
        statuses = [
            (await client.get("/", headers={"x-user": value})).status_code  # type: ignore[dict-item]
            for value in (first, second, first, second)
        ]
    assert statuses == [200, 200, 429, 429]


async def test_header_key_of_utf8_bytes_is_their_text(limiter_factory: Factory) -> None:
    """A UTF-8 header value is its text: the identifier the application would write itself."""
    limiter = limiter_factory({"user": [Limit(5, per=60, precision=1)]})
    middleware = rate_limit_middleware(limiter, keys={"user": header_key("x-user")})
    async with running(app_with([middleware])) as base, httpx.AsyncClient(base_url=base) as client:
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
    middleware = rate_limit_middleware(limiter, trusted_proxies=["127.0.0.1"], **options)  # type: ignore[arg-type]
    async with serve(app_with([middleware])) as get:
        a = await get("/", headers={"X-Forwarded-For": "2001:db8:1:2::a"})
        b = await get("/", headers={"X-Forwarded-For": "2001:db8:1:2:ffff:ffff:ffff:b"})
        v4 = [await get("/", headers={"X-Forwarded-For": f"203.0.113.{n}"}) for n in (1, 2)]
        mapped = await get("/", headers={"X-Forwarded-For": "::ffff:203.0.113.1"})
    assert a[0] == 200 and b[0] == (429 if shared else 200)
    assert [r[0] for r in v4] == [200, 200]  # IPv4 stays per address
    assert mapped[0] == 429  # an IPv4-mapped address is that IPv4 address
