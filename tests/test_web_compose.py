"""Layers that compose: middleware, dependencies and decorators judge a request once.

Real uvicorn and aiohttp servers, real HTTP. Every test checks what the store holds
afterwards (``peek``: the state now), so a double or a leftover charge cannot hide behind a
well-formed response. Global limits are 60 s sliding logs and route limits are hourly sliding
windows (``hourly``), so the values are exact whatever the timing: a calendar-aligned window
("2/hour", "5/minute") starts afresh on the hour or the minute, which a test can straddle.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

import httpx
import pytest
from aiohttp import web
from fastapi import Depends, FastAPI, HTTPException
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Mount, Route

from aiolimit import ConfigurationError, Decision, Limit, Limiter, SlidingLog
from aiolimit import aiohttp as aio
from aiolimit.starlette import RateLimit, RateLimitMiddleware, exempt, header_key
from tests.test_web_aiohttp import running
from tests.test_web_starlette import items, serve

Factory = Callable[..., Limiter]
IP = "127.0.0.1"


def hourly(amount: int) -> list[Limit]:
    """``amount`` per hour as a route's own limit, sliding in one-minute buckets: a charge stays
    counted for 59 minutes at least (the string "2/hour" would forget it on the hour)."""
    return [Limit(amount, per=3600, precision=60)]


@pytest.fixture
async def limiter_factory(redis_url: str, prefix: str) -> AsyncIterator[Factory]:
    made: list[Limiter] = []

    def make(limits: object, *, name: str = "", **options: object) -> Limiter:
        limiter = Limiter(redis_url, limits, prefix=prefix + name, **options)  # type: ignore[arg-type]
        made.append(limiter)
        return limiter

    yield make
    for limiter in made:
        await limiter.aclose()


async def left(limiter: Limiter, identifier: str) -> int:
    """What the store holds for the identifier now (no hypothetical charge)."""
    return (await limiter.peek(identifier)).remaining


def one_field_set(
    response: httpx.Response,
) -> tuple[dict[str, dict[str, int]], dict[str, dict[str, int]]]:
    """The response's single RateLimit-Policy and RateLimit fields, each name listed once."""
    policies = response.headers.get_list("ratelimit-policy")
    limits = response.headers.get_list("ratelimit")
    assert len(policies) == 1, policies
    assert len(limits) == 1, limits
    names = [item.split(";")[0].strip() for item in policies[0].split(",")]
    assert len(names) == len(set(names)), names
    return items(policies[0]), items(limits[0])


def remaining(response: httpx.Response) -> dict[str, int]:
    """Each policy's ``r`` (``t`` depends on where the window stands)."""
    return {name: params["r"] for name, params in one_field_set(response)[1].items()}


# -- FastAPI ---------------------------------------------------------------------------------


def readme_shape(limiter: Limiter, route_guard: RateLimit) -> FastAPI:
    """The README's shape: a middleware for every request, a dependency on one route."""
    app = FastAPI()
    app.add_middleware(
        RateLimitMiddleware,
        limiter=limiter,
        keys={"ip": lambda r: IP, "user": header_key("x-user")},
    )

    @app.get("/report", dependencies=[Depends(route_guard)])
    async def report() -> dict[str, str]:
        return {"report": "ready"}

    @app.get("/plain")
    async def plain() -> dict[str, str]:
        return {"plain": "yes"}

    @app.get("/health")
    @exempt
    async def health() -> dict[str, str]:
        return {"ok": "yes"}

    return app


async def test_middleware_and_dependency_on_one_limiter_are_one_decision(
    limiter_factory: Factory,
) -> None:
    limiter = limiter_factory({"ip": [SlidingLog(100, per=60)], "user": [SlidingLog(100, per=60)]})
    guard = RateLimit(limiter, keys={"user": header_key("x-user")}, weight=10)
    async with serve(readme_shape(limiter, guard)) as client:
        report = await client.get("/report", headers={"x-user": "ann"})
        plain = await client.get("/plain", headers={"x-user": "ann"})
    assert report.status_code == 200
    policy, state = one_field_set(report)
    assert set(policy) == {"ip-100-per-60s", "user-100-per-60s"}
    # One decision at the route's weight, values after that charge (not a stale middleware's).
    assert state["ip-100-per-60s"]["r"] == 90
    assert state["user-100-per-60s"]["r"] == 90
    _, state = one_field_set(plain)
    assert state["user-100-per-60s"]["r"] == 89
    assert await left(limiter, "user:ann") == 89
    assert await left(limiter, f"ip:{IP}") == 89


async def test_a_refusal_by_the_route_limit_charges_nothing_anywhere(
    limiter_factory: Factory,
) -> None:
    limiter = limiter_factory({"ip": [SlidingLog(100, per=60)], "user": [SlidingLog(100, per=60)]})
    guard = RateLimit(limiter, hourly(2), key=header_key("x-user"))
    async with serve(readme_shape(limiter, guard)) as client:
        statuses = [
            (await client.get("/report", headers={"x-user": "bo"})).status_code for _ in range(4)
        ]
        refused = await client.get("/report", headers={"x-user": "bo"})
    assert statuses == [200, 200, 429, 429]
    assert refused.headers["content-type"] == "application/problem+json"
    problem = json.loads(refused.content)
    assert problem["status"] == 429
    assert problem["violated-policies"] == ["GET__report-2-per-3600s"]
    # Only the two admitted requests were charged, on every limit.
    assert await left(limiter, f"ip:{IP}") == 98
    assert await left(limiter, "user:bo") == 98
    assert await left(limiter, "GET /report:key:bo") == 0


async def test_dependency_alone_answers_problem_json_without_registration(
    limiter_factory: Factory,
) -> None:
    limiter = limiter_factory({"ip": [SlidingLog(100, per=60)]})
    app = FastAPI()  # no exception handler registered, no middleware

    @app.get("/one", dependencies=[Depends(RateLimit(limiter, hourly(1)))])
    async def one() -> dict[str, str]:
        return {"one": "ok"}

    async with serve(app) as client:
        first = await client.get("/one")
        refused = await client.get("/one")
    assert first.status_code == 200
    policy, _ = one_field_set(first)
    assert policy == {"GET__one-1-per-3600s": {"q": 1, "w": 3600}}
    assert refused.status_code == 429
    assert refused.headers["content-type"] == "application/problem+json"
    assert json.loads(refused.content)["violated-policies"] == ["GET__one-1-per-3600s"]
    assert int(refused.headers["retry-after"]) >= 1
    one_field_set(refused)
    # The route's own limit did not touch the limiter's rules for "ip".
    assert limiter.limits["ip"] == (SlidingLog(100, per=60),)


async def test_per_route_limits_are_per_route_unless_named(limiter_factory: Factory) -> None:
    limiter = limiter_factory({"ip": [SlidingLog(100, per=60)]})
    app = FastAPI()
    per_route = RateLimit(limiter, hourly(2))
    shared = RateLimit(limiter, hourly(2), name="exports")

    @app.get("/a", dependencies=[Depends(per_route)])
    async def a() -> str:
        return "a"

    @app.get("/b", dependencies=[Depends(per_route)])
    async def b() -> str:
        return "b"

    @app.get("/c", dependencies=[Depends(shared)])
    async def c() -> str:
        return "c"

    @app.get("/d", dependencies=[Depends(shared)])
    async def d() -> str:
        return "d"

    async with serve(app) as client:
        own = [(await client.get(path)).status_code for path in ("/a", "/a", "/a", "/b")]
        named = [(await client.get(path)).status_code for path in ("/c", "/d", "/c", "/d")]
    assert own == [200, 200, 429, 200]
    assert named == [200, 200, 429, 429]


async def test_several_dependencies_without_middleware_are_one_decision(
    limiter_factory: Factory,
) -> None:
    limiter = limiter_factory({"user": [SlidingLog(100, per=60)]})
    app = FastAPI()
    burst = RateLimit(limiter, hourly(3), name="burst")
    users = RateLimit(limiter, keys={"user": header_key("x-user")})

    @app.get("/x", dependencies=[Depends(burst), Depends(users)])
    async def x() -> str:
        return "x"

    async with serve(app) as client:
        responses = [await client.get("/x", headers={"x-user": "cy"}) for _ in range(4)]
    assert [r.status_code for r in responses] == [200, 200, 200, 429]
    state = remaining(responses[0])
    assert state == {"burst-3-per-3600s": 2, "user-100-per-60s": 99}
    # The refusal by "burst" charged the user nothing.
    assert await left(limiter, "user:cy") == 97


@pytest.mark.parametrize(
    "shape", ["route twice", "route + app", "route + router", "route + include_router"]
)
async def test_guards_of_one_route_from_several_levels_charge_once_without_middleware(
    limiter_factory: Factory, shape: str
) -> None:
    """Two ``RateLimit(limiter)`` guards on the same identifier, one of them declared on the
    app, a router, or an include_router(dependencies=...): one decision, charged once, and
    both described by the response's one set of fields. (With an inclusion's guard, the route
    was judged twice: 98 left, and a header saying 99.)"""
    from fastapi import APIRouter

    limiter = limiter_factory({"ip": [SlidingLog(100, per=60)]})
    first, second = RateLimit(limiter), RateLimit(limiter)

    async def x() -> dict[str, str]:
        return {}

    app = FastAPI(dependencies=[Depends(first)] if shape == "route + app" else None)
    if shape in ("route twice", "route + app"):
        guards = [Depends(first), Depends(second)] if shape == "route twice" else [Depends(second)]
        app.get("/p/x", dependencies=guards)(x)
    else:
        router = APIRouter(dependencies=[Depends(first)] if shape == "route + router" else None)
        router.get("/x", dependencies=[Depends(second)])(x)
        inclusion = [Depends(first)] if shape == "route + include_router" else None
        app.include_router(router, prefix="/p", dependencies=inclusion)
    async with serve(app) as client:
        response = await client.get("/p/x")
    assert response.status_code == 200
    assert remaining(response) == {"ip-100-per-60s": 99}
    assert await left(limiter, f"ip:{IP}") == 99


async def test_layers_on_two_limiters_give_back_when_the_inner_refuses(
    limiter_factory: Factory,
) -> None:
    outer = limiter_factory({"ip": [SlidingLog(100, per=60)]}, name="-outer")
    inner = limiter_factory({"user": [SlidingLog(1, per=60)]}, name="-inner")
    app = FastAPI()
    app.add_middleware(RateLimitMiddleware, limiter=outer, keys={"ip": lambda r: IP})

    @app.get("/x", dependencies=[Depends(RateLimit(inner, keys={"user": header_key("x-user")}))])
    async def x() -> str:
        return "x"

    async with serve(app) as client:
        first = await client.get("/x", headers={"x-user": "di"})
        refused = await client.get("/x", headers={"x-user": "di"})
    assert first.status_code == 200
    state = remaining(first)
    assert state == {"ip-100-per-60s": 99, "user-1-per-60s": 0}
    assert refused.status_code == 429
    assert refused.headers["content-type"] == "application/problem+json"
    assert await left(outer, f"ip:{IP}") == 99  # the refused request's charge was given back


async def test_exempt_endpoint_skips_the_middleware_only(limiter_factory: Factory) -> None:
    limiter = limiter_factory({"ip": [SlidingLog(100, per=60)]})
    app = FastAPI()
    app.add_middleware(RateLimitMiddleware, limiter=limiter, keys={"ip": lambda r: IP})

    @app.get("/health")
    @exempt
    async def health() -> str:
        return "ok"

    @app.get("/hook", dependencies=[Depends(RateLimit(limiter, hourly(1), name="hook"))])
    @exempt
    async def hook() -> str:
        return "ok"

    async with serve(app) as client:
        health_response = await client.get("/health")
        hooks = [await client.get("/hook") for _ in range(2)]
    assert "ratelimit" not in health_response.headers
    assert [r.status_code for r in hooks] == [200, 429]
    policy, _ = one_field_set(hooks[0])
    assert set(policy) == {"hook-1-per-3600s"}
    assert await left(limiter, f"ip:{IP}") == 100


async def test_dependency_decision_is_yielded_when_the_middleware_judged(
    limiter_factory: Factory,
) -> None:
    limiter = limiter_factory({"ip": [SlidingLog(100, per=60)]})
    guard = RateLimit(limiter, "5/hour", name="seen")
    app = FastAPI()
    app.add_middleware(RateLimitMiddleware, limiter=limiter, keys={"ip": lambda r: IP})

    @app.get("/d")
    async def d(decision: Decision | None = Depends(guard)) -> dict[str, object]:  # noqa: B008
        assert decision is not None
        return {"ids": sorted({p.identifier for p in decision.details})}

    async with serve(app) as client:
        response = await client.get("/d")
    assert response.json() == {"ids": [f"ip:{IP}", f"seen:ip:{IP}"]}


async def test_starlette_exempt_marker_and_mounted_routes(limiter_factory: Factory) -> None:
    limiter = limiter_factory({"ip": [SlidingLog(100, per=60)]})

    async def hello(request: Request) -> PlainTextResponse:
        return PlainTextResponse("hi")

    @exempt
    async def free(request: Request) -> PlainTextResponse:
        return PlainTextResponse("free")

    app = Starlette(
        routes=[
            Route("/hi", hello),
            Mount("/api", routes=[Route("/free", free), Route("/hi", hello)]),
        ]
    )
    app.add_middleware(RateLimitMiddleware, limiter=limiter, keys={"ip": lambda r: IP})
    async with serve(app) as client:
        hi = await client.get("/hi")
        mounted = await client.get("/api/hi")
        frees = [await client.get("/api/free") for _ in range(3)]
    assert remaining(hi) == {"ip-100-per-60s": 99}
    assert remaining(mounted) == {"ip-100-per-60s": 98}
    assert [r.text for r in frees] == ["free"] * 3
    assert all("ratelimit" not in r.headers for r in frees)
    assert await left(limiter, f"ip:{IP}") == 98


def test_conflicting_limits_for_one_scope_are_a_configuration_error(redis_url: str) -> None:
    limiter = Limiter(redis_url, {"ip": [Limit(10, per=1)]})
    limiter.add_rule("exports", "2/hour")
    limiter.add_rule("exports", [Limit(2, per=3600)])  # the same limits again: fine
    with pytest.raises(ConfigurationError, match="already"):
        limiter.add_rule("exports", "3/hour")
    with pytest.raises(ConfigurationError, match="already"):
        limiter.add_rule("ip", "3/hour")
    for bad in ("*", "a:b", ""):
        with pytest.raises(ConfigurationError):
            limiter.add_rule(bad, "1/second")
    with pytest.raises(ConfigurationError, match="key="):
        RateLimit(limiter, key=header_key("x-user"))
    with pytest.raises(ConfigurationError, match="name="):
        aio.limit(limiter, name="x")


# -- aiohttp ---------------------------------------------------------------------------------


async def fetch(base: str, path: str, **headers: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=base, timeout=10) as client:
        return await client.get(path, headers=headers)


async def test_aiohttp_middleware_and_decorator_are_one_decision(
    limiter_factory: Factory,
) -> None:
    limiter = limiter_factory({"ip": [SlidingLog(100, per=60)], "user": [SlidingLog(100, per=60)]})

    @aio.limit(limiter, keys={"user": aio.header_key("x-user")}, weight=10)
    async def search(request: web.Request) -> web.Response:
        return web.json_response({"results": []})

    @aio.limit(limiter, hourly(2), key=aio.header_key("x-user"))
    async def export(request: web.Request) -> web.Response:
        return web.json_response({"export": "ok"})

    @aio.exempt
    async def health(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application(
        middlewares=[aio.rate_limit_middleware(limiter, keys={"ip": lambda r: IP})]
    )
    app.router.add_get("/search", search)
    app.router.add_get("/export", export)
    app.router.add_get("/health", health)
    async with running(app) as base:
        found = await fetch(base, "/search", **{"x-user": "ed"})
        exports = [await fetch(base, "/export", **{"x-user": "ed"}) for _ in range(3)]
        healthy = await fetch(base, "/health")
    state = remaining(found)
    assert state == {"ip-100-per-60s": 90, "user-100-per-60s": 90}
    assert [r.status_code for r in exports] == [200, 200, 429]
    state = remaining(exports[1])
    assert state == {
        "ip-100-per-60s": 88,
        "GET__export-2-per-3600s": 0,
    }
    assert exports[2].headers["content-type"] == "application/problem+json"
    assert json.loads(exports[2].content)["violated-policies"] == ["GET__export-2-per-3600s"]
    assert "ratelimit" not in healthy.headers
    assert await left(limiter, f"ip:{IP}") == 88  # 10 + 1 + 1: the refusal charged nothing
    assert await left(limiter, "GET /export:key:ed") == 0


async def test_aiohttp_stacked_decorators_alone_are_one_decision(
    limiter_factory: Factory,
) -> None:
    limiter = limiter_factory({"user": [SlidingLog(100, per=60)]})

    @aio.limit(limiter, hourly(2), name="burst")
    @aio.limit(limiter, keys={"user": aio.header_key("x-user")})
    async def handler(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/h", handler)
    async with running(app) as base:
        responses = [await fetch(base, "/h", **{"x-user": "fi"}) for _ in range(3)]
    assert [r.status_code for r in responses] == [200, 200, 429]
    state = remaining(responses[0])
    assert state == {"burst-2-per-3600s": 1, "user-100-per-60s": 99}
    assert await left(limiter, "user:fi") == 98


async def test_aiohttp_two_limiters_give_back_when_the_inner_refuses(
    limiter_factory: Factory,
) -> None:
    outer = limiter_factory({"ip": [SlidingLog(100, per=60)]}, name="-outer")
    inner = limiter_factory({"user": [SlidingLog(1, per=60)]}, name="-inner")

    @aio.limit(inner, keys={"user": aio.header_key("x-user")})
    async def handler(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(middlewares=[aio.rate_limit_middleware(outer, keys={"ip": lambda r: IP})])
    app.router.add_get("/h", handler)
    async with running(app) as base:
        first = await fetch(base, "/h", **{"x-user": "gu"})
        refused = await fetch(base, "/h", **{"x-user": "gu"})
    state = remaining(first)
    assert state == {"ip-100-per-60s": 99, "user-1-per-60s": 0}
    assert refused.status_code == 429
    assert refused.headers["content-type"] == "application/problem+json"
    assert await left(outer, f"ip:{IP}") == 99


async def test_a_route_layer_asking_for_refunds_gets_them_under_the_middleware(
    limiter_factory: Factory,
) -> None:
    limiter = limiter_factory({"ip": [SlidingLog(100, per=60)]})
    app = FastAPI()
    app.add_middleware(RateLimitMiddleware, limiter=limiter, keys={"ip": lambda r: IP})
    guard = RateLimit(limiter, hourly(50), name="upstream", refund_on_error=True)

    @app.get("/fail", dependencies=[Depends(guard)])
    async def fail() -> None:
        raise HTTPException(502, "upstream failed")

    @app.get("/missing", dependencies=[Depends(guard)])
    async def missing() -> None:
        raise HTTPException(404, "no such thing")

    async with serve(app) as client:
        failed = [(await client.get("/fail")).status_code for _ in range(3)]
        absent = await client.get("/missing")
    assert failed == [502] * 3
    assert absent.status_code == 404
    # The route's limit is refunded for the 502s (only the 404 stays charged); the
    # middleware did not ask for refunds, so its limit keeps every request.
    assert await left(limiter, f"upstream:ip:{IP}") == 49
    assert await left(limiter, f"ip:{IP}") == 96


async def test_deny_list_is_403_and_shadow_rules_never_429(redis_url: str, prefix: str) -> None:
    from aiolimit import RuleSet

    rules = RuleSet.from_mapping(
        {
            "kinds": {"ip": hourly(2), "user": {"limits": hourly(1), "shadow": True}},
            "deny": ["user:mallory"],
        }
    )
    async with Limiter(redis_url, rules, prefix=prefix) as limiter:
        app = FastAPI()
        app.add_middleware(
            RateLimitMiddleware,
            limiter=limiter,
            keys={"ip": lambda r: IP, "user": header_key("x-user")},
        )

        @app.get("/x")
        async def x() -> str:
            return "x"

        async with serve(app) as client:
            denied = await client.get("/x", headers={"x-user": "mallory"})
            shadowed = [await client.get("/x", headers={"x-user": "ann"}) for _ in range(2)]
            enforced = await client.get("/x", headers={"x-user": "ann"})
        assert denied.status_code == 403
        assert denied.headers["content-type"] == "application/problem+json"
        assert "retry-after" not in denied.headers and "mallory" not in denied.text
        # The user's shadow limit (1/hour) would refuse the second; the ip limit (2/hour) is
        # enforced and refuses the third.
        assert [r.status_code for r in shadowed] == [200, 200]
        assert enforced.status_code == 429
        assert limiter.statistics().shadow_refusals == 1  # the third was refused anyway
        assert await left(limiter, f"ip:{IP}") == 0


async def test_router_level_dependencies_are_judged_once_and_405_charges_no_route(
    limiter_factory: Factory,
) -> None:
    from fastapi import APIRouter

    limiter = limiter_factory({"ip": [SlidingLog(100, per=60)]})
    app = FastAPI()
    app.add_middleware(RateLimitMiddleware, limiter=limiter, keys={"ip": lambda r: IP})
    for prefix in ("/v1", "/v2"):
        router = APIRouter(prefix=prefix, dependencies=[Depends(RateLimit(limiter, hourly(3)))])

        @router.get("/items/{item_id}")
        async def item(item_id: int) -> dict[str, int]:
            return {"item": item_id}

        app.include_router(router)
    async with serve(app) as client:
        got = [await client.get(f"/v1/items/{n}") for n in range(4)]
        other = await client.get("/v2/items/1")
        wrong_method = await client.post("/v1/items/1")
    assert [r.status_code for r in got] == [200, 200, 200, 429]
    assert remaining(got[0]) == {"ip-100-per-60s": 99, "GET__v1_items__item_id_-3-per-3600s": 2}
    assert other.status_code == 200  # the same relative path under another prefix: its own
    assert wrong_method.status_code == 405
    # One decision per request (the router's limit judged with the middleware's), and the
    # 405 went through the middleware's own limit only.
    assert limiter.statistics().decisions == 6
    assert await left(limiter, "GET /v1/items/{item_id}:ip:" + IP) == 0
    assert await left(limiter, f"ip:{IP}") == 100 - 4 - 1


# -- found by an adversarial review: each failed before its fix -------------------------------


async def test_included_router_scopes_carry_the_prefix_without_middleware(
    limiter_factory: Factory,
) -> None:
    from fastapi import APIRouter

    limiter = limiter_factory({"ip": [SlidingLog(100, per=60)]})
    guard = RateLimit(limiter, hourly(2))
    app = FastAPI()
    router = APIRouter()

    @router.get("/x", dependencies=[Depends(guard)])
    async def x() -> str:
        return "x"

    app.include_router(router, prefix="/v1")
    app.include_router(router, prefix="/v2")
    async with serve(app) as client:
        v1 = [await client.get("/v1/x") for _ in range(3)]
        v2 = await client.get("/v2/x")
    assert [r.status_code for r in v1] == [200, 200, 429]
    assert v2.status_code == 200  # was 429: both prefixes shared "GET /x"
    assert set(remaining(v2)) == {"GET__v2_x-2-per-3600s"}


async def test_two_middlewares_make_one_request_judged_once(limiter_factory: Factory) -> None:
    a = limiter_factory({"ip": [SlidingLog(100, per=60)]}, name="-a")
    b = limiter_factory({"user": [SlidingLog(2, per=60)]}, name="-b")
    guard = RateLimit(a, hourly(10), name="r")
    app = FastAPI()

    @app.get("/x", dependencies=[Depends(guard)])
    async def x() -> str:
        return "x"

    app.add_middleware(RateLimitMiddleware, limiter=b, keys={"user": header_key("x-user")})
    app.add_middleware(RateLimitMiddleware, limiter=a, keys={"ip": lambda r: IP})
    async with serve(app) as client:
        responses = [await client.get("/x", headers={"x-user": "u"}) for _ in range(3)]
    assert [r.status_code for r in responses] == [200, 200, 429]
    assert remaining(responses[1]) == {
        "ip-100-per-60s": 98,
        "r-10-per-3600s": 8,
        "user-2-per-60s": 0,
    }
    # The route's limit was judged once per request, and the inner refusal gave back the
    # outer middleware's charges.
    assert await left(a, f"r:ip:{IP}") == 8
    assert await left(a, f"ip:{IP}") == 98


async def test_aiohttp_two_middlewares_and_head_shares_get_budget(
    limiter_factory: Factory,
) -> None:
    a = limiter_factory({"ip": [SlidingLog(100, per=60)]}, name="-a")
    b = limiter_factory({"user": [SlidingLog(2, per=60)]}, name="-b")

    @aio.limit(a, hourly(10), name="r")
    async def handler(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    @aio.limit(a, hourly(2))
    async def pinged(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(
        middlewares=[
            aio.rate_limit_middleware(a, keys={"ip": lambda r: IP}),
            aio.rate_limit_middleware(b, keys={"user": aio.header_key("x-user")}),
        ]
    )
    app.router.add_get("/h", handler)
    app.router.add_get("/p", pinged)
    async with running(app) as base, httpx.AsyncClient(base_url=base) as client:
        responses = [await client.get("/h", headers={"x-user": "u"}) for _ in range(3)]
        pings = [await client.request(m, "/p") for m in ("GET", "HEAD", "GET")]
    assert [r.status_code for r in responses] == [200, 200, 429]
    one_field_set(responses[0])
    assert await left(a, f"r:ip:{IP}") == 8
    assert [r.status_code for r in pings] == [200, 200, 429]  # HEAD counts as GET


async def test_a_refund_is_given_once_and_only_where_asked(limiter_factory: Factory) -> None:
    """The middleware wraps the app directly; the dependency asks for refunds, the middleware
    does not. A 502 gives back the dependency's charge once, not the middleware's."""
    limiter = limiter_factory({"ip": [SlidingLog(100, per=60)]})
    guard = RateLimit(limiter, hourly(50), name="up", refund_on_error=True)
    inner = FastAPI()

    @inner.get("/ok", dependencies=[Depends(guard)])
    async def ok() -> str:
        return "ok"

    @inner.get("/fail", dependencies=[Depends(guard)])
    async def fail() -> None:
        raise HTTPException(502, "upstream failed")

    app = RateLimitMiddleware(inner, limiter=limiter, keys={"ip": lambda r: IP})
    async with serve(app) as client:
        statuses = [(await client.get(p)).status_code for p in ("/ok", "/ok", "/ok", "/fail")]
    assert statuses == [200, 200, 200, 502]
    assert await left(limiter, f"up:ip:{IP}") == 47
    assert await left(limiter, f"ip:{IP}") == 96
    assert limiter.statistics().decisions == 4  # one decision per request, wrapped or not


async def test_aiohttp_decorator_judged_late_still_refunds(limiter_factory: Factory) -> None:
    limiter = limiter_factory({"ip": [SlidingLog(100, per=60)]})

    @aio.limit(limiter, hourly(50), name="up", refund_on_error=True)
    async def upstream(request: web.Request) -> web.Response:
        raise web.HTTPBadGateway()

    async def plain(request: web.Request) -> web.StreamResponse:  # calls a limited one
        return await upstream(request)

    app = web.Application(
        middlewares=[aio.rate_limit_middleware(limiter, keys={"ip": lambda r: IP})]
    )
    app.router.add_get("/p", plain)
    async with running(app) as base:
        failed = await fetch(base, "/p")
    assert failed.status_code == 502
    assert await left(limiter, f"up:ip:{IP}") == 50


async def test_dependency_overrides_turn_a_route_limit_off(limiter_factory: Factory) -> None:
    limiter = limiter_factory({"ip": [SlidingLog(100, per=60)]})
    guard = RateLimit(limiter, "1/hour")
    app = FastAPI()
    app.add_middleware(RateLimitMiddleware, limiter=limiter, keys={"ip": lambda r: IP})

    @app.get("/x", dependencies=[Depends(guard)])
    async def x() -> str:
        return "x"

    app.dependency_overrides[guard] = lambda: None
    async with serve(app) as client:
        statuses = [(await client.get("/x")).status_code for _ in range(2)]
    assert statuses == [200, 200]


async def test_dependency_overrides_turn_a_route_limit_off_without_middleware(
    limiter_factory: Factory,
) -> None:
    """Two guards on a route, no middleware, one of them overridden (as tests do to turn a
    limit off): the other judges alone. (It judged the route's guards together, the
    overridden one included: its 1 an hour refused the second request.)"""
    limiter = limiter_factory({"ip": [SlidingLog(100, per=60)]})
    tight, plain = RateLimit(limiter, hourly(1)), RateLimit(limiter)
    app = FastAPI()

    @app.get("/x", dependencies=[Depends(tight), Depends(plain)])
    async def x() -> str:
        return "x"

    app.dependency_overrides[tight] = lambda: None
    async with serve(app) as client:
        statuses = [(await client.get("/x")).status_code for _ in range(2)]
    assert statuses == [200, 200]
    assert await left(limiter, f"ip:{IP}") == 98


async def test_a_route_added_late_is_judged_in_one_decision_after_its_first_request(
    limiter_factory: Factory,
) -> None:
    """The middleware indexes the routes once; a route with limits added later is judged on
    its own the first time (two decisions, charges exact), and the index is rebuilt."""
    from fastapi import APIRouter

    limiter = limiter_factory({"ip": [SlidingLog(100, per=60)]})
    guard = RateLimit(limiter, hourly(10), name="late")
    app = FastAPI()
    app.add_middleware(RateLimitMiddleware, limiter=limiter, keys={"ip": lambda r: IP})
    router = APIRouter()

    @router.get("/a")
    async def a() -> str:
        return "a"

    app.include_router(router, prefix="/r")
    async with serve(app) as client:
        await client.get("/r/a")

        @router.get("/late", dependencies=[Depends(guard)])
        async def late() -> str:
            return "late"

        first = await client.get("/r/late")
        before = limiter.statistics().decisions
        second = await client.get("/r/late")
        after = limiter.statistics().decisions
    one_field_set(first)
    assert remaining(second) == {"ip-100-per-60s": 97, "late-10-per-3600s": 8}
    assert after - before == 1
