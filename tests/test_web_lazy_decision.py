"""A web request admitted from prefetched units makes its ``Decision`` only when something
asks for it (``Allowances.admit`` / ``decision_of``, ``flow.Charge``): its ``RateLimit``
fields are made from the admission itself. What it says must not depend on when it is made,
and must be what the fields said.

Also here: the middleware's identifiers kept per peer (``RateLimitMiddleware._ids_of``) and the
limiter's loop check that asks asyncio only when its own loop is not the one running in this
thread (``Limiter._check_usable``)."""

from __future__ import annotations

import asyncio
import itertools
import random

import httpx
import pytest
from _nodes import settle, stored
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

import aiolimit.starlette as aiolimit_starlette
from aiolimit import FixedWindow, Limit, Limiter, UsageError
from aiolimit._clock import ServerClock
from aiolimit._decision import PairDecision
from aiolimit._prefetch import Admitted, Allowances
from aiolimit._web.flow import judge_ids
from aiolimit._web.headers import admitted_fields, rate_limit_headers
from aiolimit.starlette import RateLimitMiddleware

LIMITS = [Limit(100_000, per=3600, precision=60)]


def test_the_fields_of_an_admission_are_those_of_its_decision() -> None:
    """``admitted_fields`` (made with no ``Decision``) says what ``rate_limit_headers`` says of
    the decision ``decision_of`` makes from the same admission, resets past their end
    included (they read 0, as the decision's own reset does)."""
    allowances = Allowances(8, None, ServerClock())  # type: ignore[arg-type]
    rng = random.Random(7)
    limits = [Limit(100, per=60), Limit(5000, per=3600, precision=60), FixedWindow(10, per=1)]
    for _ in range(3000):
        limit = rng.choice(limits)
        identifier = rng.choice(["ip:1", "user:42", "plain"])
        plans = ()  # (only the decision's charge holds them)
        reset_after = rng.choice([0.0, 0.0004, 0.5, 1.0, 59.9999, rng.uniform(0, 60)])
        pair = PairDecision(identifier, limit, True, rng.randrange(0, 100), 0.0, reset_after)
        elapsed = rng.choice([0.0, reset_after, reset_after + 0.001, rng.uniform(0, 70)])
        admitted = Admitted((pair,), plans, 1, rng.randrange(0, 50), elapsed)
        decision = allowances.decision_of(admitted)
        assert admitted_fields(pair, admitted.left, elapsed) == rate_limit_headers(decision)


async def test_a_decision_made_late_says_what_it_said_when_admitted(
    redis_url: str, prefix: str
) -> None:
    """The allowance an admission came from goes on being taken from, refilled and given
    back; the decision made later from the admission is the one made at once, the verdict
    makes it once, and the fields the request sent were that decision's."""
    async with Limiter(redis_url, LIMITS, prefix=prefix, prefetch=32) as limiter:
        assert limiter._prefetch is not None
        ids = ("ip:1",)
        lazy = []
        for _ in range(400):
            verdict = await judge_ids(limiter, ids, 1, refund=False, legacy=False)
            charge = verdict.charges[0]
            if charge._decision is None:  # admitted from the allowance, decision not made
                assert charge._admitted is not None
                lazy.append((verdict, limiter._prefetch.decision_of(charge._admitted)))
            await asyncio.sleep(0)  # (the refills ahead run)
        assert len(lazy) > 300, len(lazy)
        assert limiter._prefetch.taken > 5  # the allowance was refilled meanwhile
        for verdict, at_once in lazy:
            assert verdict.decision == at_once
            assert verdict.decision is verdict.charges[0].decision is verdict.decision_for(limiter)
            assert verdict.headers == rate_limit_headers(at_once)
            assert not verdict.charges[0].holds_lease
        # Each admission from one allowance (the same store's pairs) left one unit less.
        steps = [
            (a.remaining - b.remaining)
            for (va, a), (vb, b) in itertools.pairwise(lazy)
            if va.charges[0]._admitted[0] is vb.charges[0]._admitted[0]  # type: ignore[index]
        ]
        assert len(steps) > 250 and set(steps) == {1}, sorted(set(steps))
        await settle(limiter)


async def test_a_refund_goes_through_a_decision_made_late(redis_url: str, prefix: str) -> None:
    """``refund_on_error`` under prefetch: a request admitted from the allowance that fails
    (500) is given back through the decision made for the refund; the store ends up counting
    the requests that succeeded, no more, no fewer."""
    limiter = Limiter(redis_url, LIMITS, prefix=prefix, prefetch=16)

    async def ok(request: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    async def boom(request: Request) -> PlainTextResponse:
        return PlainTextResponse("no", status_code=500)

    app = Starlette(routes=[Route("/", ok), Route("/boom", boom)])
    app.add_middleware(RateLimitMiddleware, limiter=limiter, refund_on_error=True)
    transport = httpx.ASGITransport(app=app, client=("203.0.113.5", 1))
    statuses = []
    async with limiter, httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        for path in ["/"] * 30 + ["/boom"] * 30 + ["/"] * 10:
            statuses.append((await client.get(path)).status_code)
        await settle(limiter)
    assert statuses.count(200) == 40 and statuses.count(500) == 30
    assert limiter.statistics().prefetched > 30  # the late decisions were exercised
    assert await stored(redis_url, prefix, "ip:203.0.113.5", LIMITS) == 40


async def test_identifiers_are_kept_per_peer_and_never_across_a_forwarded_header(
    redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each peer is charged on its own identifier, the kept identifiers stay bounded, and a
    middleware that reads a forwarded header keeps none (one peer, a proxy, speaks for
    many clients)."""
    monkeypatch.setattr(aiolimit_starlette, "PEER_CACHE_SIZE", 2)

    async def ok(request: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    async with Limiter(redis_url, LIMITS, prefix=prefix) as limiter:
        direct = Starlette(routes=[Route("/", ok)])
        direct.add_middleware(RateLimitMiddleware, limiter=limiter)
        proxied = Starlette(routes=[Route("/", ok)])
        proxied.add_middleware(RateLimitMiddleware, limiter=limiter, trusted_proxies=["10.0.0.1"])
        peers = {"198.51.100.1": 3, "198.51.100.2": 2, "198.51.100.3": 1}
        for peer, times in list(peers.items()) * 2:
            transport = httpx.ASGITransport(app=direct, client=(peer, 1))
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                for _ in range(times):
                    assert (await client.get("/")).status_code == 200
        transport = httpx.ASGITransport(app=proxied, client=("10.0.0.1", 1))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            for client_ip in ("192.0.2.7", "192.0.2.8", "192.0.2.8"):
                response = await client.get("/", headers={"x-forwarded-for": client_ip})
                assert response.status_code == 200
        for peer, times in peers.items():
            assert (await limiter.peek(f"ip:{peer}")).remaining == 100_000 - 2 * times
        assert (await limiter.peek("ip:192.0.2.7")).remaining == 100_000 - 1
        assert (await limiter.peek("ip:192.0.2.8")).remaining == 100_000 - 2
        assert (await limiter.peek("ip:10.0.0.1")).remaining == 100_000  # (the proxy: never)
        stacks = [direct.middleware_stack, proxied.middleware_stack]
        middlewares = []
        for stack in stacks:
            while not isinstance(stack, RateLimitMiddleware):
                stack = stack.app  # type: ignore[union-attr]
            middlewares.append(stack)
        assert 0 < len(middlewares[0]._ids_by_peer) <= 2
        assert middlewares[1]._ids_by_peer == {}


async def test_a_limiter_whose_loop_runs_refuses_a_call_from_another_thread(
    redis_url: str, prefix: str
) -> None:
    """The loop check skips asyncio while the limiter's own loop runs in the calling thread;
    a call from another thread, on its own loop, while the limiter's loop runs, is still a
    ``UsageError``, by the prefetched path and by the store's."""
    async with Limiter(redis_url, LIMITS, prefix=prefix, prefetch=16) as limiter:
        for _ in range(3):  # (the second takes units ahead)
            assert (await limiter.try_acquire("ip:t")).allowed
        assert limiter._take_prefetched(("ip:t",), 1) is not None  # here: served locally

        async def elsewhere() -> list[str]:
            errors = []
            for call in (
                lambda: limiter._take_prefetched(("ip:t",), 1),
                lambda: judge_ids(limiter, ("ip:t",), 1, refund=False, legacy=False),
                lambda: limiter.try_acquire("ip:t"),
            ):
                try:
                    result = call()
                    if asyncio.iscoroutine(result):
                        await result
                except UsageError as exc:
                    errors.append(str(exc))
            return errors

        errors = await asyncio.to_thread(asyncio.run, elsewhere())
        assert len(errors) == 3 and all("another event loop" in e for e in errors), errors
        await settle(limiter)


@pytest.mark.parametrize("shape", ["legacy", "two kinds"])
async def test_an_admission_the_fields_need_a_decision_for_is_judged_locally_too(
    redis_url: str, prefix: str, shape: str
) -> None:
    """Legacy ``X-RateLimit-*`` fields, or two identifiers (two kinds keyed by the client):
    the admission from prefetched units makes its decision at once (``judge_local``): the
    fields give one ``remaining`` (both kinds count the same requests; the legacy field says
    the same), and the store counts every request once the limiter closes."""

    async def ok(request: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    rules = {"ip": LIMITS, "peer": LIMITS}
    limiter = Limiter(redis_url, rules, prefix=prefix, prefetch=16)
    app = Starlette(routes=[Route("/", ok)])
    if shape == "legacy":
        app.add_middleware(RateLimitMiddleware, limiter=limiter, legacy_headers=True)
    else:
        keys = {"ip": aiolimit_starlette.CLIENT_IP, "peer": aiolimit_starlette.CLIENT_IP}
        app.add_middleware(RateLimitMiddleware, limiter=limiter, keys=keys)
    transport = httpx.ASGITransport(app=app, client=("203.0.113.77", 1))
    seen = []
    async with limiter, httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        for _ in range(40):
            response = await client.get("/")
            assert response.status_code == 200
            seen.append(response.headers)
        assert limiter.statistics().prefetched > 20
        await settle(limiter)
    for headers in seen:
        fields = headers["ratelimit"].split(", ")
        assert len(fields) == (1 if shape == "legacy" else 2), fields
        remaining = {int(field.split(";r=")[1].split(";")[0]) for field in fields}
        assert len(remaining) == 1  # (both kinds count the same requests)
        if shape == "legacy":
            assert int(headers["x-ratelimit-remaining"]) in remaining
    for kind in rules if shape == "two kinds" else ["ip"]:
        assert await stored(redis_url, prefix, f"{kind}:203.0.113.77", LIMITS) == 40
