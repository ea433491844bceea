"""Second adversarial review of prefetched allowances (``aiolimit/_prefetch.py``): refunds,
web layers, rules, failures, cluster; real servers only."""

from __future__ import annotations

import asyncio
import time

import pytest

from aiolimit import Limit, Limiter
from tests._nodes import settle, stored
from tests._proxy import Proxy

pytestmark = pytest.mark.asyncio


async def _bucket_start(precision: float, slack: float = 0.02) -> None:
    """Sleeps until just after the next bucket of ``precision`` seconds begins (the server
    runs on this machine: its clock is this one)."""
    now = time.time()
    await asyncio.sleep(precision - now % precision + slack)


async def test_a_refund_of_an_earlier_bucket_while_units_are_held_stores_exactly(
    redis_url: str, prefix: str
) -> None:
    """A refund (no ``at``) credits the newest buckets first: while this process holds units
    in the newest bucket, a refund of an admission made in an earlier bucket takes them
    instead; the give-back of those units then credits only their own bucket (an undo), finds
    it empty, and the store keeps counting the earlier admission that was refunded."""
    limits = [Limit(1000, per=60, precision=0.5)]
    async with Limiter(redis_url, limits, prefix=prefix) as other:
        await _bucket_start(0.5)
        early = await other.try_acquire("ip:r", 5)  # (bucket B0)
        assert early.allowed
        await _bucket_start(0.5)
        admitted = 5
        limiter = Limiter(redis_url, limits, prefix=prefix, prefetch=50)
        try:
            for _ in range(3):  # (bucket B1: the second call takes units ahead)
                admitted += (await limiter.try_acquire("ip:r")).allowed
            assert limiter._prefetch is not None and limiter._prefetch.taken == 1
            await other.refund("ip:r", decision=early)  # (B0's 5, given back during B1)
        finally:
            await limiter.aclose()
    assert await stored(redis_url, prefix, "ip:r", limits) == admitted - 5


async def test_web_layers_with_local_admissions_store_exactly_and_tell_sane_headers(
    redis_url: str, prefix: str
) -> None:
    """A middleware on a prefetching limiter, a route dependency on another limiter that
    refuses after a few, and a route that fails (``refund_on_error``): every refusal by the
    later limiter and every 5xx gives back what the first charged, locally admitted or not;
    the store then counts exactly the requests that passed; the fields stay within the limit."""
    import httpx
    from fastapi import Depends, FastAPI
    from fastapi.responses import PlainTextResponse

    from aiolimit.starlette import RateLimit, RateLimitMiddleware

    limits = [Limit(500, per=3600, precision=60)]
    first = Limiter(redis_url, limits, prefix=prefix, prefetch=20)
    second = Limiter(redis_url, [Limit(1000, per=3600, precision=60)], prefix=prefix + "b")
    guard = RateLimit(second, [Limit(7, per=3600, precision=60)])

    app = FastAPI()

    @app.get("/ok", dependencies=[Depends(guard)])
    async def ok() -> PlainTextResponse:
        return PlainTextResponse("ok")

    @app.get("/boom")
    async def boom() -> PlainTextResponse:
        return PlainTextResponse("no", status_code=500)

    app.add_middleware(RateLimitMiddleware, limiter=first, refund_on_error=True)
    passed = 0
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            for i in range(60):
                path = "/boom" if i % 3 == 0 else "/ok"
                response = await client.get(path)
                assert response.status_code in (200, 429, 500), response.status_code
                if response.status_code == 200:
                    passed += 1
                for field in response.headers.get_list("ratelimit"):
                    for item in field.split(","):
                        params = dict(p.split("=") for p in item.split(";")[1:])
                        assert 0 <= int(params["r"]) <= 500, field
                        assert int(params["t"]) >= 0, field
        assert first._prefetch is not None and first._prefetch.local > 0
    finally:
        await first.aclose()
        await second.aclose()
    assert await stored(redis_url, prefix, "ip:127.0.0.1", limits) == passed


async def test_aclose_against_a_dead_server_with_units_held_and_a_refill_in_flight_is_bounded(
    standalone_proxy: Proxy, prefix: str
) -> None:
    """The server stops answering while units are held on one identifier and a call taking
    units ahead on another is in flight (no deadline): aclose still ends within a bound, and
    leaves no task or timer of the limiter behind."""
    limits = [Limit(100, per=3600, precision=60)]
    limiter = Limiter(standalone_proxy.url, limits, prefix=prefix, prefetch=20)
    for _ in range(3):
        assert (await limiter.try_acquire("ip:d1")).allowed
    for _ in range(1):
        assert (await limiter.try_acquire("ip:d2")).allowed
    allowances = limiter._prefetch
    assert allowances is not None and allowances.taken == 1
    standalone_proxy.partition()
    call = asyncio.create_task(limiter.try_acquire("ip:d2"))  # (takes units ahead: no answer)
    await asyncio.sleep(0.05)
    started = time.monotonic()
    await asyncio.wait_for(limiter.aclose(), 15)
    took = time.monotonic() - started
    assert took < 11, took
    call.cancel()
    await asyncio.gather(call, return_exceptions=True)
    assert not limiter._protocol._tasks
    assert all(entry.timer is None for entry in allowances._by_ids.values())


@pytest.mark.parametrize("change", ["lower", "deny", "shadow", "scale"])
async def test_rules_that_change_while_units_are_held_are_obeyed_at_once(
    redis_url: str, prefix: str, change: str
) -> None:
    """Units held under the old rules are never admitted under new ones (another limit, an
    override that denies, shadows or scales), and what they charged is given back."""
    from aiolimit import RuleSet

    hourly = {"type": "window", "amount": 100, "per": 3600, "precision": 60}
    old = RuleSet.from_mapping({"kinds": {"ip": [hourly]}})
    new = {
        "lower": {"kinds": {"ip": [dict(hourly, amount=6)]}},
        "deny": {"kinds": {"ip": [hourly]}, "deny": ["ip:h"]},
        "shadow": {"kinds": {"ip": [hourly]}, "overrides": {"ip:h": {"shadow": True}}},
        "scale": {"kinds": {"ip": [hourly]}, "overrides": {"ip:h": {"scale": 0.06}}},
    }[change]
    pusher = Limiter(redis_url, "1/hour", prefix=prefix, follow_rules=True)
    limiter = Limiter(redis_url, "1/hour", prefix=prefix, follow_rules=True, prefetch=50)
    admitted = 0
    try:
        assert await pusher.push_rules(old)
        for _ in range(4):
            admitted += (await limiter.try_acquire("ip:h")).allowed
        assert limiter._prefetch is not None and limiter._prefetch.taken >= 1
        version = limiter.statistics().rules_version
        assert await pusher.push_rules(RuleSet.from_mapping(new))
        async with asyncio.timeout(5):
            while limiter.statistics().rules_version == version:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        after = 0
        for _ in range(20):
            decision = await limiter.try_acquire("ip:h")
            after += decision.allowed
            if decision.allowed and change != "shadow":
                assert decision.details[0].limit.amount == 6, decision
        admitted += after
        if change == "deny":
            assert after == 0
        elif change in ("lower", "scale"):
            assert admitted <= 6, admitted  # (the old admissions count under the new limit)
    finally:
        await limiter.aclose()
        await pusher.aclose()
    assert await stored(redis_url, prefix, "ip:h", [Limit(100, per=3600, precision=60)]) == (
        admitted
    )


async def test_a_call_refused_with_its_units_ahead_still_decides_within_the_deadline(
    standalone_proxy: Proxy, redis_url: str, prefix: str
) -> None:
    """``deadline`` is per decision. A call that takes units ahead and is refused for them is
    sent again for its own weight: both round trips must fit in the one deadline (each got a
    deadline of its own: a slow store answered a try_acquire in up to twice the deadline)."""
    limits = [Limit(10, per=3600, precision=60)]
    async with (
        Limiter(
            standalone_proxy.url, limits, prefix=prefix, prefetch=8, deadline=0.1, on_error="closed"
        ) as limiter,
        Limiter(redis_url, limits, prefix=prefix) as other,
    ):
        assert (await limiter.try_acquire("ip:dl")).allowed  # (busy; 9 remain)
        assert (await other.try_acquire("ip:dl", 8)).allowed  # (1 remains)
        standalone_proxy.delay = 0.07
        started = time.monotonic()
        decision = await limiter.try_acquire("ip:dl")  # (asks 3: refused; then 1)
        took = time.monotonic() - started
        standalone_proxy.delay = 0
        assert took < 0.1 + 0.03, (took, decision)
        assert decision.degraded and not decision.allowed  # (the policy's answer, on time)
        await settle(limiter)  # (the cut call is undone: the store counts 9 + 1 admitted)
        assert await stored(redis_url, prefix, "ip:dl", limits) == 9


async def test_on_a_cluster_several_limiters_near_the_limit_and_calls_across_slots(
    redis_cluster_url: str, prefix: str
) -> None:
    """Cluster: calls on one identifier take units ahead (several limiters, near the limit:
    never past it, stored exactly); calls on identifiers in different slots never do."""
    limits = [Limit(120, per=3600, precision=60)]
    limiters = [
        Limiter(redis_cluster_url, limits, prefix=prefix, prefetch=16, cache_refusals=True)
        for _ in range(3)
    ]
    admitted = {"ip:c1": 0, "ip:c2": 0}
    refunded = {"ip:c1": 0, "ip:c2": 0}
    try:
        for round_ in range(40):
            calls = []
            for index in range(12):
                limiter = limiters[(round_ + index) % 3]
                ids = ["ip:c1"] if index % 3 else ["ip:c1", "ip:c2"]
                calls.append((ids, limiter.try_acquire(ids)))
            decisions = await asyncio.gather(*(call for _, call in calls))
            for (ids, _), decision in zip(calls, decisions, strict=True):
                if decision.allowed:
                    for name in ids:
                        admitted[name] += 1
        for limiter in limiters:
            assert limiter._prefetch is not None
        assert sum(limiter.statistics().prefetched for limiter in limiters) > 0
        assert admitted["ip:c1"] <= 120
    finally:
        for limiter in limiters:
            await limiter.aclose()
    for name in admitted:
        assert await stored(redis_cluster_url, prefix, name, limits) == (
            admitted[name] - refunded[name]
        )


@pytest.mark.parametrize("cache", [False, True])
async def test_a_call_kept_out_only_by_this_process_s_own_units_is_not_told_to_wait_a_window(
    redis_url: str, prefix: str, cache: bool
) -> None:
    """20 an hour, 2 admitted, 2 more held here: a call of 17 fits what was admitted, but the
    store counts the units held here and refuses it, with the retry_after of the window (an
    hour). The units go back within a second: the call must be told so, and ``acquire``
    must get in (it gave up at once under timeout=5, and slept an hour without one)."""
    limits = [Limit(20, per=3600, precision=60)]
    async with Limiter(
        redis_url, limits, prefix=prefix, prefetch=100, cache_refusals=cache
    ) as limiter:
        for _ in range(2):
            assert (await limiter.try_acquire("ip:own")).allowed
        assert limiter._prefetch is not None and limiter._prefetch.taken == 1
        refused = await limiter.try_acquire("ip:own", 17)
        if not refused.allowed:
            assert refused.retry_after < 1.0, refused
        admitted = await limiter.acquire("ip:own", 17, timeout=5)
        assert admitted.allowed
    assert await stored(redis_url, prefix, "ip:own", limits) == 19


@pytest.mark.parametrize("seed", range(3))
async def test_late_refunds_across_short_buckets_with_several_limiters_store_exactly(
    redis_url: str, prefix: str, seed: int
) -> None:
    """Several limiters (some prefetching) on short buckets; admissions are refunded a few
    buckets later, while other units are held: the store ends counting admitted - refunded."""
    import random

    rng = random.Random(seed)
    limits = [Limit(400, per=30, precision=0.05)]
    limiters = [
        Limiter(redis_url, limits, prefix=prefix, prefetch=rng.choice([0, 8, 32])) for _ in range(3)
    ]
    admitted = refunded = 0
    pending: list[tuple[Limiter, object]] = []
    try:
        for _ in range(60):
            calls = [(limiter, limiter.try_acquire("ip:lr", rng.choice([1, 1, 2]))) for limiter in
                     (rng.choice(limiters) for _ in range(8))]  # fmt: skip
            decisions = await asyncio.gather(*(call for _, call in calls))
            for (limiter, _), decision in zip(calls, decisions, strict=True):
                if decision.allowed:
                    admitted += decision._charge.weight if decision._charge else 0
                    if rng.random() < 0.25:
                        pending.append((limiter, decision))
            if pending and rng.random() < 0.5:
                limiter, decision = pending.pop(0)
                refunded += decision._charge.weight  # type: ignore[attr-defined]
                await limiter.refund("ip:lr", decision=decision)  # type: ignore[arg-type]
            await asyncio.sleep(rng.random() * 0.03)
    finally:
        for limiter in limiters:
            await limiter.aclose()
    assert await stored(redis_url, prefix, "ip:lr", limits) == admitted - refunded


async def test_a_cached_authority_clock_s_error_never_lets_an_allowance_outlive_its_bucket(
    standalone_proxy: Proxy, redis_url: str, prefix: str
) -> None:
    """AuthorityClock(max_age=...) extrapolates the authority's TIME from one sample: its
    estimate may be off by up to its ``error_bound`` (half the sample's round trip; here the
    reply path was 20 ms slow, so this process's time runs 10 ms behind the authority's). Its
    allowance ended 9 ms after its bucket had (1 ms margin): the other limiter had moved the
    key into the next window, and the units held were admitted on top of it (34 of 30 in
    that window, by the authority's time, this machine's clock). Without prefetch those calls
    go to the store, which judges them in the new window."""
    from aiolimit import FixedWindow
    from aiolimit._authority import AuthorityClock

    limits = [FixedWindow(30, per=1)]
    behind = AuthorityClock(standalone_proxy.url, max_age=3600, samples=1)
    await behind.now_us()  # (connected)
    standalone_proxy.delay = 0.02  # (while the clock samples: its offset is 10 ms off)
    await behind.synchronize()
    standalone_proxy.delay = 0
    exact = AuthorityClock(redis_url, max_age=3600)
    times: list[float] = []
    async with (
        Limiter(redis_url, limits, prefix=prefix, prefetch=64, clock=behind) as limiter,
        Limiter(redis_url, limits, prefix=prefix, clock=exact) as other,
    ):
        await other.peek("ip:warm")
        await _bucket_start(1.0, slack=0.9)  # (0.92 into a window)
        for _ in range(12):
            if (await limiter.try_acquire("ip:au")).allowed:
                times.append(time.time())
        while time.time() % 1.0 > 0.5 or time.time() % 1.0 < 0.001:  # noqa: ASYNC110
            await asyncio.sleep(0.0005)  # (to the next window)
        for _ in range(40):
            if (await other.try_acquire("ip:au")).allowed:
                times.append(time.time())
            if (await limiter.try_acquire("ip:au")).allowed:
                times.append(time.time())
    await behind.aclose()
    await exact.aclose()
    windows: dict[int, int] = {}
    for at in times:
        windows[int(at)] = windows.get(int(at), 0) + 1
    assert max(windows.values()) <= 30, windows
