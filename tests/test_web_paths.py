"""Which path a web layer judges: the one the router routes.

- A route's own limits under a mount with a path parameter (``Mount("/t/{tenant}")``) are kept
  per route template, not per value: a client changing the segment gets no fresh budget, and
  the limiter gains one rule, not one per value sent.
- ``routes=`` is written as the app's routes are; behind a server's root path
  (``uvicorn --root-path /api``) it still applies.
- aiohttp's ``routes=`` table reads the path as the router does (``%2F`` kept encoded), so a
  request cannot look exempt to the table and reach a limited route.
Real uvicorn and aiohttp servers, real Redis.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest
from aiohttp import ClientSession, web
from fastapi import Depends, FastAPI
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Mount, Route
from yarl import URL

from aiolimit import Limit, Limiter
from aiolimit import aiohttp as aio
from aiolimit.starlette import RateLimit, RateLimitMiddleware, RouteLimit
from tests.test_web_aiohttp import running
from tests.test_web_starlette import serve

IP = "127.0.0.1"
Factory = Callable[..., Limiter]


@pytest.fixture
async def make(redis_url: str, prefix: str) -> AsyncIterator[Factory]:
    made: list[Limiter] = []

    def build(limits: object) -> Limiter:
        limiter = Limiter(redis_url, limits, prefix=f"{prefix}{len(made)}")  # type: ignore[arg-type]
        made.append(limiter)
        return limiter

    yield build
    for limiter in made:
        await limiter.aclose()


@pytest.mark.parametrize("middleware", [False, True], ids=["dependency alone", "middleware"])
async def test_a_route_limit_under_a_mount_parameter_is_one_budget(
    make: Factory, middleware: bool
) -> None:
    """2 an hour on /t/{tenant}/report: six tenants in a row get 2 admissions in all, kept
    under the template (not under "/t/x0", "/t/x1", ...)."""
    limiter = make({"ip": [Limit(1000, per=3600, precision=60)]})
    sub = FastAPI()
    own = [Limit(2, per=3600, precision=60)]

    @sub.get("/report", dependencies=[Depends(RateLimit(limiter, own))])
    async def report() -> dict[str, bool]:
        return {"ok": True}

    app = Starlette(routes=[Mount("/t/{tenant}", app=sub)])
    if middleware:
        app.add_middleware(RateLimitMiddleware, limiter=limiter)
    async with serve(app) as client:
        codes = [(await client.get(f"/t/x{i}/report")).status_code for i in range(6)]
    assert codes == [200, 200, 429, 429, 429, 429]
    assert (await limiter.peek(f"GET /t/{{tenant}}/report:ip:{IP}")).remaining == 0
    kinds = [kind for kind in limiter._added_rules if kind.startswith("GET ")]
    assert kinds == ["GET /t/{tenant}/report"], kinds


async def test_routes_apply_behind_a_servers_root_path(make: Factory) -> None:
    """uvicorn --root-path /api: "/search" costs 5 and "/health" is exempt, as written."""
    limiter = make({"ip": [Limit(100, per=3600, precision=60)]})

    async def hello(request: Request) -> PlainTextResponse:
        return PlainTextResponse("hi")

    app = Starlette(routes=[Route("/search", hello), Route("/health", hello)])
    app.add_middleware(
        RateLimitMiddleware,
        limiter=limiter,
        routes={"/search": RouteLimit(weight=5), "/health": None},
    )
    async with serve(app, root_path="/api") as client:
        assert (await client.get("/search")).status_code == 200
        assert (await limiter.peek(f"ip:{IP}")).remaining == 95
        health = await client.get("/health")
        assert health.status_code == 200 and "RateLimit" not in health.headers
        assert (await limiter.peek(f"ip:{IP}")).remaining == 95


async def test_an_encoded_slash_does_not_reach_a_limited_aiohttp_route_as_exempt(
    make: Factory,
) -> None:
    """routes={"/static/*": None} and a limited /{user}: /static%2Fx is /{user}'s, so it
    is limited (3 an hour) like any other request to it."""
    limiter = make({"ip": [Limit(3, per=3600, precision=60)]})

    async def profile(request: web.Request) -> web.Response:
        return web.json_response({"user": request.match_info["user"]})

    app = web.Application(
        middlewares=[aio.rate_limit_middleware(limiter, routes={"/static/*": None})]
    )
    app.router.add_get("/{user}", profile)
    async with running(app) as base, ClientSession(base) as session:
        codes = []
        for i in range(5):
            async with session.get(URL(f"{base}/static%2Fx{i}", encoded=True)) as response:
                codes.append(response.status)
    assert codes == [200, 200, 200, 429, 429]


@pytest.mark.parametrize("middleware", [False, True], ids=["dependency alone", "middleware"])
async def test_a_routers_own_limit_and_its_routes_are_two_budgets(
    make: Factory, middleware: bool
) -> None:
    """An APIRouter's own 100 an hour and one of its routes' own 2 an hour, neither named:
    both apply to the route (each kept under a scope of its own), all or nothing. Before,
    the second declaration's scope clashed with the first's and every request was a 500."""
    from fastapi import APIRouter

    limiter = make({"ip": [Limit(1000, per=3600, precision=60)]})
    wide, tight = [Limit(100, per=3600, precision=60)], [Limit(2, per=3600, precision=60)]
    router = APIRouter(prefix="/v1", dependencies=[Depends(RateLimit(limiter, wide))])

    @router.get("/report", dependencies=[Depends(RateLimit(limiter, tight))])
    async def report() -> dict[str, bool]:
        return {"ok": True}

    @router.get("/other")
    async def other() -> dict[str, bool]:
        return {"ok": True}

    app = FastAPI()
    app.include_router(router)
    if middleware:
        app.add_middleware(RateLimitMiddleware, limiter=limiter)
    async with serve(app) as client:
        codes = [(await client.get("/v1/report")).status_code for _ in range(3)]
        assert (await client.get("/v1/other")).status_code == 200
    assert codes == [200, 200, 429]
    kinds = sorted(kind for kind in limiter._added_rules if kind.startswith("GET /v1/report"))
    assert len(kinds) == 2 and kinds[0] == "GET /v1/report", kinds
    assert (await limiter.peek(f"{kinds[0]}:ip:{IP}")).remaining == 98  # the refusal: nothing
    assert (await limiter.peek(f"{kinds[1]}:ip:{IP}")).remaining == 0


@pytest.mark.parametrize("middleware", [False, True], ids=["dependency alone", "middleware"])
async def test_sub_apps_mounted_apart_keep_their_routes_apart(
    make: Factory, middleware: bool
) -> None:
    """Two sub-apps under Mount("/v1") and Mount("/v2"), each with its own middleware and a
    route "/report" limited to 2 an hour: two budgets, "GET /v1/report" and "GET /v2/report"
    (a sub-app's middleware knew only its own mounts: both were "GET /report")."""
    limiter = make({"ip": [Limit(1000, per=3600, precision=60)]})
    subs = []
    for _ in range(2):
        sub = FastAPI()
        own = [Limit(2, per=3600, precision=60)]

        @sub.get("/report", dependencies=[Depends(RateLimit(limiter, own))])
        async def report() -> dict[str, bool]:
            return {"ok": True}

        if middleware:
            sub.add_middleware(RateLimitMiddleware, limiter=limiter)
        subs.append(sub)
    app = Starlette(routes=[Mount("/v1", app=subs[0]), Mount("/v2", app=subs[1])])
    async with serve(app) as client:
        codes = [
            (await client.get(path)).status_code for path in ["/v1/report"] * 3 + ["/v2/report"] * 3
        ]
    assert codes == [200, 200, 429, 200, 200, 429]
    kinds = sorted(kind for kind in limiter._added_rules if "report" in kind)
    assert kinds == ["GET /v1/report", "GET /v2/report"], kinds


async def test_an_aiohttp_route_limit_reached_without_a_route_is_one_budget(make: Factory) -> None:
    """A ``@limit`` handler called for requests no route matched (from a middleware that
    answers 404s with it): 2 an hour for all of them, not a budget (and a rule kept in memory)
    per path a client makes up."""
    limiter = make({"ip": [Limit(1000, per=3600, precision=60)]})

    @aio.limit(limiter, [Limit(2, per=3600, precision=60)])
    async def not_found(request: web.Request) -> web.Response:
        return web.Response(status=404, text="no such page")

    @web.middleware
    async def pages(request: web.Request, handler: aio.Handler) -> web.StreamResponse:
        if request.match_info.http_exception is not None:
            return await not_found(request)
        return await handler(request)

    app = web.Application(middlewares=[pages])
    async with running(app) as base, ClientSession(base) as client:
        codes = []
        for n in range(4):
            async with client.get(f"/made-up-{n}") as response:
                codes.append(response.status)
    assert codes == [404, 404, 429, 429], codes
