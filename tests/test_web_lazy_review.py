"""Adversarial review of the lazy web decisions, the per-peer identifiers and the cheaper loop
check (``judge_local``, ``Charge.decision``, ``RateLimitMiddleware._ids_of``,
``Limiter._check_usable``)."""

from __future__ import annotations

import asyncio
import itertools
import os
from typing import Any

import httpx
import pytest
from _nodes import settle, stored
from fastapi import Depends, FastAPI
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

import aiolimit.starlette as aiolimit_starlette
from aiolimit import Concurrency, Decision, FixedWindow, Limit, Limiter, UsageError
from aiolimit._web.headers import rate_limit_headers
from aiolimit._web.keys import CLIENT_IP
from aiolimit.starlette import RateLimit, RateLimitMiddleware

LIMITS = [Limit(100_000, per=3600, precision=60)]
IP = "203.0.113.77"


async def test_a_child_forked_while_the_limiters_loop_ran_is_refused_on_its_own_loop(
    redis_url: str, prefix: str
) -> None:
    """A process forked from inside the limiter's running loop (a ``ProcessPoolExecutor``
    worker forked by ``run_in_executor``) that uses the limiter on a loop of its own gets the
    ``UsageError`` any other loop gets: the connections are the parent's (their sockets are
    shared with it). The thread that forked keeps its id in the child, and the parent's loop
    object says it runs in it; asyncio itself knows it does not (its running loop is per
    process). A limiter the child makes is its own, and works there."""
    async with Limiter(redis_url, LIMITS, prefix=prefix, prefetch=16) as limiter:
        for _ in range(3):  # (the second takes units ahead)
            assert (await limiter.try_acquire("ip:f")).allowed
        assert limiter._take_prefetched(("ip:f",), 1) is not None  # served locally here
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: nothing of pytest's runs here (os._exit)
            code = 1
            try:
                os.close(read)

                async def probe() -> str:
                    try:
                        limiter._take_prefetched(("ip:f",), 1)
                    except UsageError as exc:
                        refused = str(exc)
                    else:
                        return "admitted"
                    # A limiter of the child's own works on the child's loop, time and again.
                    async with Limiter(redis_url, LIMITS, prefix=prefix) as own:
                        for _ in range(3):
                            assert (await own.try_acquire("ip:child")).allowed
                    return refused

                os.write(write, asyncio.run(probe()).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(write)

        def child_said() -> tuple[str, int]:
            with os.fdopen(read, "rb") as pipe:
                said = pipe.read().decode()
            return said, os.waitpid(pid, 0)[1]

        said, status = await asyncio.to_thread(child_said)
        assert os.waitstatus_to_exitcode(status) == 0
        assert "another event loop" in said, said
        assert (await limiter.peek("ip:child")).remaining == 100_000 - 3


async def test_a_pool_the_route_index_missed_joins_a_lazy_verdict_and_is_released(
    redis_url: str, prefix: str
) -> None:
    """A route's ``RateLimit`` overridden by another (``dependency_overrides``): the middleware
    leaves the overridden one out and judges the request on its fast path, from prefetched
    units (its decision not made); the replacement, a ``Concurrency`` pool of another limiter,
    joins that verdict. Its slot is held while the handler runs and free once the response is
    out, both limits' fields are sent, and a failing request (500, ``refund_on_error``) gives
    back the fast path's charge, through the decision made for it then, exactly once."""
    pool = Concurrency(1, lease_ttl=60)
    rates = Limiter(redis_url, LIMITS, prefix=prefix, prefetch=16)
    slots = Limiter(redis_url, {"ip": [pool]}, prefix=prefix + "pool:")
    seen: list[int] = []
    listed = RateLimit(rates, "5/minute", name="never")  # (overridden: never judged)
    joining = RateLimit(slots, refund_on_error=True)
    app = FastAPI()

    @app.get("/", dependencies=[Depends(listed)])
    async def root(fail: int = 0) -> PlainTextResponse:
        seen.append((await slots.peek(f"ip:{IP}")).remaining)  # (its own slot: held)
        return PlainTextResponse("no" if fail else "ok", status_code=500 if fail else 200)

    app.dependency_overrides[listed] = joining
    app.add_middleware(RateLimitMiddleware, limiter=rates, refund_on_error=True)
    transport = httpx.ASGITransport(app=app, client=(IP, 1))
    async with rates, slots, httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        responses = []
        for path in ["/"] * 20 + ["/?fail=1"] * 10 + ["/"] * 5:
            responses.append(await client.get(path))
            assert (await slots.peek(f"ip:{IP}")).remaining == 1  # released after each
            await asyncio.sleep(0)  # (the refills ahead run)
        await settle(rates)
        assert rates.statistics().prefetched >= 20  # the fast path's lazy decisions
        assert [r.status_code for r in responses] == [200] * 20 + [500] * 10 + [200] * 5
        assert seen == [0] * 35
        for response in responses:
            policy = response.headers["ratelimit-policy"]
            assert '"ip-100000-per-3600s"' in policy and '"ip-1-per-60s"' in policy, policy
    assert await stored(redis_url, prefix, f"ip:{IP}", LIMITS) == 25


async def test_an_inner_middleware_joins_a_lazy_verdict_and_both_give_back_once(
    redis_url: str, prefix: str
) -> None:
    """Two nested middlewares, each with its limiter: the outer judges on its fast path from
    prefetched units, the inner joins its request. The headers name both limits with what
    each store counts, and a 500 gives back each charge once: the stores count the requests
    that succeeded."""
    other = [Limit(50_000, per=3600, precision=60)]
    outer = Limiter(redis_url, LIMITS, prefix=prefix, prefetch=16)
    inner = Limiter(redis_url, other, prefix=prefix + "inner:")

    async def ok(request: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    async def boom(request: Request) -> PlainTextResponse:
        raise RuntimeError("boom")

    app = Starlette(routes=[Route("/", ok), Route("/boom", boom)])
    app.add_middleware(RateLimitMiddleware, limiter=inner, refund_on_error=True)
    app.add_middleware(RateLimitMiddleware, limiter=outer, refund_on_error=True)
    transport = httpx.ASGITransport(app=app, client=(IP, 1), raise_app_exceptions=False)
    async with outer, inner, httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        statuses = []
        for n, path in enumerate(["/"] * 20 + ["/boom"] * 10 + ["/"] * 5):
            response = await client.get(path)
            statuses.append(response.status_code)
            if response.status_code == 200:
                fields = response.headers["ratelimit"]
                assert '"ip-100000-per-3600s";r=' in fields and '"ip-50000-per-3600s";r=' in fields
                # (the inner store's count is exact: each request is charged there)
                assert f'"ip-50000-per-3600s";r={50_000 - (n + 1 if n < 20 else n - 9)};' in fields
            await asyncio.sleep(0)
        await settle(outer)
        assert outer.statistics().prefetched >= 20
    assert statuses == [200] * 20 + [500] * 10 + [200] * 5
    assert await stored(redis_url, prefix, f"ip:{IP}", LIMITS) == 25
    assert await stored(redis_url, prefix + "inner:", f"ip:{IP}", other) == 25


async def status_of(app: Any, scope: dict[str, Any]) -> int:
    """The status an ASGI app answers a GET with no body with."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return int(sent[0]["status"])


async def test_identifiers_kept_per_peer_are_those_made_afresh_for_every_kind_of_peer(
    redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The identifiers the middleware keeps per peer (``_ids_of``) are those it makes afresh
    (``_ids_for(_client_of(scope))``) for every peer a server may give: IPv4, IPv4-mapped IPv6,
    IPv6 in one /64 and in two (and with ``ipv6_prefix=128``), no client at all, an empty
    host, a Unix socket's path; while the kept ones are cleared over and over (a bound of 3),
    and each request is charged on its own identifier, as the store counts."""
    monkeypatch.setattr(aiolimit_starlette, "PEER_CACHE_SIZE", 3)
    peers: list[list[object] | None] = [
        ["192.0.2.1", 1], ["::ffff:192.0.2.1", 2], ["2001:db8:0:1::1", 3],
        ["2001:db8:0:1::2", 4], ["2001:db8:0:2::1", 5], None, ["", 0], ["/run/app.sock", 0],
    ]  # fmt: skip

    async def app(scope: dict, receive: object, send: object) -> None:  # type: ignore[type-arg]
        await PlainTextResponse("ok")(scope, receive, send)  # type: ignore[arg-type]

    async with Limiter(redis_url, LIMITS, prefix=prefix) as limiter:
        for prefix_bits in (64, 128):
            cached = RateLimitMiddleware(app, limiter, ipv6_prefix=prefix_bits)
            fresh = RateLimitMiddleware(app, limiter, ipv6_prefix=prefix_bits)
            expected: dict[str, int] = {}
            for round_ in range(3):
                for client in peers:
                    scope = {
                        "type": "http", "method": "GET", "path": "/", "raw_path": b"/",
                        "query_string": b"", "headers": [], "client": client,
                        "server": ("t", 80), "scheme": "http", "http_version": "1.1",
                        "root_path": "",
                    }  # fmt: skip
                    want = fresh._ids_for(fresh._client_of(scope))
                    assert cached._ids_of(dict(scope)) == want, (client, round_)
                    assert want is not None and len(want) == 1
                    assert await status_of(cached, scope) == 200
                    expected[want[0]] = expected.get(want[0], 0) + 1
                assert len(cached._ids_by_peer) <= 3
            v6 = (
                {"ip:2001:db8:0:1::/64": 6, "ip:2001:db8:0:2::/64": 3}
                if prefix_bits == 64
                else {"ip:2001:db8:0:1::1": 3, "ip:2001:db8:0:1::2": 3, "ip:2001:db8:0:2::1": 3}
            )
            # (no client and an empty host: one "unknown" client; a socket path as it is)
            assert expected == {
                "ip:192.0.2.1": 6, "ip:unknown": 6, "ip:/run/app.sock": 3, **v6
            }  # fmt: skip
            for identifier, times in expected.items():
                assert (await limiter.peek(identifier)).remaining == 100_000 - times, identifier
            await limiter.reset(list(expected))


async def test_a_handler_refund_through_a_lazy_decision_is_not_given_back_again(
    redis_url: str, prefix: str
) -> None:
    """The decision a dependency yields for a request the middleware admitted from prefetched
    units is made on demand; the handler gives it back (``refund(decision=)``) and fails
    (500, ``refund_on_error``). The middleware's give-back goes through the same decision (its
    charge records the refund), so nothing is given back twice: the earlier requests' charges
    stay counted."""
    limiter = Limiter(redis_url, LIMITS, prefix=prefix, prefetch=16)
    listed = RateLimit(limiter, "5/minute", name="never")  # (overridden: never judged)
    joining = RateLimit(limiter)  # the middleware's identifier: charged already
    decisions = []
    app = FastAPI()

    @app.get("/")
    async def root(
        fail: int = 0,
        decision: Decision = Depends(listed),  # noqa: B008 (a local: FastAPI reads it so)
    ) -> PlainTextResponse:
        decisions.append(decision)
        if fail:
            await limiter.refund(f"ip:{IP}", decision=decision)
            return PlainTextResponse("no", status_code=500)
        return PlainTextResponse("ok")

    app.dependency_overrides[listed] = joining
    app.add_middleware(RateLimitMiddleware, limiter=limiter, refund_on_error=True)
    transport = httpx.ASGITransport(app=app, client=(IP, 1))
    async with limiter, httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        statuses = []
        for path in ["/"] * 20 + ["/?fail=1"] * 10:
            statuses.append((await client.get(path)).status_code)
            await asyncio.sleep(0)
        await settle(limiter)
        assert limiter.statistics().prefetched >= 20
    assert statuses == [200] * 20 + [500] * 10
    assert all(d is not None and d.allowed for d in decisions)
    assert await stored(redis_url, prefix, f"ip:{IP}", LIMITS) == 20


async def test_a_pool_joining_a_lazy_verdict_is_renewed_while_the_request_runs(
    redis_url: str, prefix: str
) -> None:
    """A ``Concurrency`` lease that joined a verdict admitted from prefetched units (the
    middleware's fast path, its decision not made) is renewed while the request runs past
    the lease's TTL: a second request meanwhile is refused all along, and the slot is free
    once the first is answered."""
    pool = Concurrency(1, lease_ttl=0.3)
    rates = Limiter(redis_url, LIMITS, prefix=prefix, prefetch=16)
    slots = Limiter(redis_url, {"ip": [pool]}, prefix=prefix + "pool:")
    listed = RateLimit(rates, "5/minute", name="never")  # (overridden: never judged)
    inside = asyncio.Event()
    app = FastAPI()

    @app.get("/", dependencies=[Depends(listed)])
    async def root(hold: float = 0.0) -> PlainTextResponse:
        if hold:
            inside.set()
            await asyncio.sleep(hold)
        return PlainTextResponse("ok")

    app.dependency_overrides[listed] = RateLimit(slots)
    app.add_middleware(RateLimitMiddleware, limiter=rates)
    transport = httpx.ASGITransport(app=app, client=(IP, 1))
    async with rates, slots, httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        for _ in range(5):  # (units taken ahead: the next requests are admitted locally)
            assert (await client.get("/")).status_code == 200
            await asyncio.sleep(0)
        admitted_locally = rates.statistics().prefetched
        assert admitted_locally >= 3
        held = asyncio.ensure_future(client.get("/?hold=1.0"))
        async with asyncio.timeout(5):
            await inside.wait()
        others = []
        for _ in range(8):  # over three lease TTLs
            others.append((await client.get("/")).status_code)
            await asyncio.sleep(0.1)
        assert (await held).status_code == 200
        assert rates.statistics().prefetched > admitted_locally  # (the held one, at least)
        assert others == [429] * 8, others
        assert (await slots.peek(f"ip:{IP}")).remaining == 1
        assert (await client.get("/")).status_code == 200
        await settle(rates)


@pytest.mark.parametrize(
    ("limits", "kind"),
    [
        ([Limit(100_000, per=3600, precision=60)], "ip"),
        ([FixedWindow(100_000, per=3600)], "client.addr*x"),
        ([Limit(100_000, per=60, precision=1)], "ip"),
    ],
)
async def test_the_fields_sent_from_a_lazy_admission_are_its_decisions(
    redis_url: str, prefix: str, limits: list[Any], kind: str
) -> None:
    """Through the middleware's fast path, for each limit kind that can be prefetched: the
    ``RateLimit`` fields a response carries (made with no ``Decision``) are what
    ``rate_limit_headers`` says of the decision a dependency is given for the same request
    (made later, on demand); the store counts each request once."""
    limiter = Limiter(redis_url, {kind: limits}, prefix=prefix, prefetch=16)
    listed = RateLimit(limiter, "5/minute", name="never")  # (overridden: never judged)
    app = FastAPI()

    @app.get("/")
    async def root(
        decision: Decision = Depends(listed),  # noqa: B008 (a local: FastAPI reads it so)
    ) -> PlainTextResponse:
        await asyncio.sleep(0.002)  # (the decision is asked for later than it was made)
        return PlainTextResponse(dict(rate_limit_headers(decision))["RateLimit"])

    app.dependency_overrides[listed] = RateLimit(limiter, keys={kind: CLIENT_IP})
    app.add_middleware(RateLimitMiddleware, limiter=limiter, keys={kind: CLIENT_IP})
    transport = httpx.ASGITransport(app=app, client=(IP, 1))
    async with limiter, httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        remaining = []
        for _ in range(40):
            response = await client.get("/")
            assert response.status_code == 200
            assert response.headers["ratelimit"] == response.text
            remaining.append(int(response.text.split(";r=")[1].split(";")[0]))
            await asyncio.sleep(0)
        assert limiter.statistics().prefetched >= 30
        # Never more than is left (less while units an allowance holds are counted in the
        # store's reply, until given back), and one less per request from one allowance.
        assert all(r <= 100_000 - n for n, r in enumerate(remaining, 1)), str(remaining)
        assert sum(a - b == 1 for a, b in itertools.pairwise(remaining)) >= 25, str(remaining)
        await settle(limiter)
    assert await stored(redis_url, prefix, f"{kind}:{IP}", limits) == 40


def test_a_stopped_loop_names_no_thread_and_another_loop_is_refused(
    redis_url: str, prefix: str
) -> None:
    """The limiter's loop, stopped (``run_until_complete`` returned) but not closed: another
    loop in the same thread is refused (prefetched path and store's), and the limiter's own
    loop, run again, is served again, from its prefetched units too."""
    limiter = Limiter(redis_url, LIMITS, prefix=prefix, prefetch=16)
    own = asyncio.new_event_loop()
    other = asyncio.new_event_loop()

    async def warm() -> None:
        for _ in range(3):  # (the second takes units ahead)
            assert (await limiter.try_acquire("ip:s")).allowed

    async def elsewhere() -> list[str]:
        errors = []
        try:
            limiter._take_prefetched(("ip:s",), 1)
        except UsageError as exc:
            errors.append(str(exc))
        try:
            await limiter.try_acquire("ip:s")
        except UsageError as exc:
            errors.append(str(exc))
        return errors

    async def again() -> int:
        served = 0
        for _ in range(3):
            served += limiter._take_prefetched(("ip:s",), 1) is not None
        assert (await limiter.try_acquire("ip:s")).allowed
        await settle(limiter)
        await limiter.aclose()
        return served

    try:
        own.run_until_complete(warm())
        errors = other.run_until_complete(elsewhere())
        assert len(errors) == 2 and all("another event loop" in e for e in errors), errors
        assert own.run_until_complete(again()) >= 1  # (the units the warm-up left)
    finally:
        other.close()
        own.close()
