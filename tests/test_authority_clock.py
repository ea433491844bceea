"""AuthorityClock: one Redis node's TIME is ``now`` for every slot and every client.

Skew is injected, never waited for: a skewed client is one whose local time source is off by
+-5 s. With an AuthorityClock such clients decide exactly as an unskewed one does; with their
own local clocks they do not.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

import pytest
from _proxy import Proxy
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from aiolimit import AuthorityClock, BackendError, ConfigurationError, Limit, Limiter, LocalClock

SKEWS = (-5.0, 0.0, 5.0)
# 3 per 2 s, judged in 0.1 s buckets: a clock 5 s off judges by a window with none of the
# charges an honest clock made a moment ago, and the reverse.
LIMITS = [Limit(3, per=2, precision=0.1)]


def skewed(seconds: float) -> Callable[[], float]:
    """A local monotonic time source that is ``seconds`` off."""
    return lambda: time.monotonic() + seconds


class SkewedLocalClock(LocalClock):
    """This process's wall clock, ``skew`` seconds off (a client with a wrong clock)."""

    def __init__(self, skew: float) -> None:
        self.skew = skew

    async def now_us(self) -> int | None:
        return (time.time_ns() // 1000) + round(self.skew * 1_000_000)


async def server_time_us(client: Redis) -> int:
    seconds, micros = await client.time()
    return int(seconds) * 1_000_000 + int(micros)


@pytest.fixture
async def raw(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def test_each_now_is_a_fresh_time_of_the_authority(redis_url: str, raw: Redis) -> None:
    """Without max_age every now_us is one TIME round trip, between two server TIMEs."""
    async with AuthorityClock(redis_url) as clock:
        before = await server_time_us(raw)
        now = await clock.now_us()
        after = await server_time_us(raw)
        assert now is not None and before <= now <= after
        await clock.now_us()
        assert clock.round_trips == 2
        assert clock.error_bound == 0.0 and clock.offset is None


@pytest.mark.parametrize("skew", SKEWS)
async def test_cached_offset_cancels_local_skew(redis_url: str, raw: Redis, skew: float) -> None:
    """max_age: a few samples, then now_us with no round trip, within the reported bound of
    the server's TIME whatever the local skew; the offset reports the skew."""
    clock = AuthorityClock(redis_url, max_age=30, samples=4, time_source=skewed(skew))
    async with clock:
        await clock.synchronize()
        assert clock.round_trips == 4
        before = await server_time_us(raw)
        now = await clock.now_us()
        after = await server_time_us(raw)
        assert clock.round_trips == 4  # served from the cached offset
        bound_us = clock.error_bound * 1_000_000
        assert 0 < clock.error_bound < 0.05
        assert now is not None and before - bound_us <= now <= after + bound_us
        # The offset maps the skewed monotonic source onto the server's epoch time.
        assert clock.offset is not None
        assert abs((clock.offset + time.monotonic() + skew) - time.time()) < 0.05


async def test_cached_offset_is_resampled_after_max_age(redis_url: str) -> None:
    """Once max_age has passed on the local source, the next now_us samples again."""
    local = [1000.0]
    clock = AuthorityClock(redis_url, max_age=10, samples=3, time_source=lambda: local[0])
    async with clock:
        await clock.now_us()
        assert clock.round_trips == 3
        local[0] += 9.0
        bound_before = clock.error_bound
        await clock.now_us()
        assert clock.round_trips == 3
        local[0] += 2.0
        assert clock.error_bound > bound_before  # drift accumulates with the sample's age
        await clock.now_us()
        assert clock.round_trips == 6


async def run_scenarios(make_clock: Callable[[float], object], url: str, prefix: str) -> list:
    """Two scenarios per skewed client, judged by what it and an honest client decide.

    fill_then_ask: the honest client uses up an identifier, the skewed one asks at once.
    ask_after: the skewed client uses up an identifier, the honest one asks at once.
    An honest client in the skewed one's place is refused in both.
    """
    outcomes = []
    clocks = {skew: make_clock(skew) for skew in SKEWS}
    limiters = {
        skew: Limiter(url, LIMITS, prefix=prefix, clock=clock)  # type: ignore[arg-type]
        for skew, clock in clocks.items()
    }
    try:
        honest = limiters[0.0]
        for skew, limiter in limiters.items():
            ids = [f"user:fill-{skew}", f"ip:fill-{skew}"]  # two slots on a cluster
            assert (await honest.try_acquire(ids, 3)).allowed
            outcomes.append(("fill_then_ask", skew, (await limiter.try_acquire(ids)).allowed))
            ids = [f"user:ask-{skew}", f"ip:ask-{skew}"]
            assert (await limiter.try_acquire(ids, 3)).allowed
            outcomes.append(("ask_after", skew, (await honest.try_acquire(ids)).allowed))
    finally:
        for limiter in limiters.values():
            await limiter.aclose()
        for clock in clocks.values():
            if isinstance(clock, AuthorityClock):
                await clock.aclose()
    return outcomes


@pytest.mark.cluster
@pytest.mark.parametrize("max_age", [None, 30.0])
async def test_skewed_clients_with_an_authority_decide_like_an_honest_one(
    redis_cluster_url: str, prefix: str, max_age: float | None
) -> None:
    """Clients 5 s fast or slow, sharing an AuthorityClock's node, make exactly the honest
    client's decisions on every slot (all refused here)."""

    def make(skew: float) -> AuthorityClock:
        return AuthorityClock(redis_cluster_url, max_age=max_age, time_source=skewed(skew))

    outcomes = await run_scenarios(make, redis_cluster_url, prefix)
    assert [allowed for _, _, allowed in outcomes] == [False] * len(outcomes)


@pytest.mark.cluster
async def test_skewed_local_clocks_do_not(redis_cluster_url: str, prefix: str) -> None:
    """The same clients on their own clocks: the fast one is admitted where an honest client
    is refused, and the slow one's charges do not count against the honest client."""
    outcomes = await run_scenarios(SkewedLocalClock, redis_cluster_url, prefix)
    assert outcomes == [
        ("fill_then_ask", -5.0, False),  # a key's time never runs backwards: judged as honest
        ("ask_after", -5.0, True),  # its charges landed 5 s in the past, outside the window
        ("fill_then_ask", 0.0, False),
        ("ask_after", 0.0, False),
        ("fill_then_ask", 5.0, True),  # it judges by a window 5 s ahead, empty
        ("ask_after", 5.0, False),
    ]


@pytest.mark.cluster
async def test_a_cluster_client_passed_in_is_used_and_left_open(
    redis_cluster_seed_url: str,
) -> None:
    """An AuthorityClock over a RedisCluster the caller owns reads TIME and leaves it open."""
    client = RedisCluster.from_url(redis_cluster_seed_url)
    try:
        async with AuthorityClock(client) as clock:
            now = await clock.now_us()
            assert now is not None and abs(now / 1e6 - time.time()) < 1.0
        assert await client.ping()
    finally:
        await client.aclose()


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        (("http://x",), {}),
        ((42,), {}),
        (("redis://127.0.0.1:1",), {"max_age": 0}),
        (("redis://127.0.0.1:1",), {"max_age": True}),
        (("redis://127.0.0.1:1",), {"samples": 0}),
        (("redis://127.0.0.1:1",), {"drift_ppm": -1}),
        (("redis://127.0.0.1:1",), {"socket_timeout": "2"}),
        (("redis://127.0.0.1:1",), {"socket_timeout": -1}),
        (("redis://127.0.0.1:1",), {"socket_timeout": 0}),
        (("redis+cluster://127.0.0.1:1",), {"socket_timeout": None}),
    ],
)
def test_bad_arguments_fail_at_construction(args: tuple, kwargs: dict) -> None:
    """A wrong URL, client or option is a ConfigurationError when the clock is built."""
    with pytest.raises(ConfigurationError):
        AuthorityClock(*args, **kwargs)


async def test_a_slow_authority_still_gets_its_offset_cached(
    redis_url: str, standalone_proxy: Proxy, prefix: str
) -> None:
    """The authority answers, but 0.15 s late (a proxy in front of it): redis-py's
    connection set-up and five samples take more than the limiter's 1 s deadline. The
    samples taken before the deadline are kept (``error_bound`` says how good they are), so
    decisions run on the cached offset instead of each starting the sampling over and
    failing at the deadline."""
    standalone_proxy.delay = 0.15
    clock = AuthorityClock(standalone_proxy.url, max_age=30)
    limiter = Limiter(redis_url, LIMITS, prefix=prefix, clock=clock, deadline=1.0)
    outcomes: list[tuple[float, str]] = []
    try:
        for _ in range(3):
            started = time.monotonic()
            try:
                await limiter.try_acquire("ip:203.0.113.7")
                outcome = "decided"
            except BackendError as error:
                outcome = type(error).__name__
            outcomes.append((round(time.monotonic() - started, 2), outcome))
    finally:
        await limiter.aclose()
        await clock.aclose()
    assert [outcome for _, outcome in outcomes[1:]] == ["decided", "decided"], outcomes
    assert all(took < 0.2 for took, _ in outcomes[1:]), outcomes
    assert clock.error_bound >= 0.075  # half a round trip of at least 0.15 s


@pytest.mark.parametrize(("max_age", "drift_ppm"), [(None, 100.0), (30, 100.0), (3600, 200.0)])
def test_ttl_slack_covers_the_cached_offsets_error_both_ways(
    max_age: float | None, drift_ppm: float
) -> None:
    """Keys are judged by the authority's clock and expire by their shard's: a key written by
    a client whose cached ``now`` is ahead must outlive what a client whose ``now`` is behind
    still counts in its window. The TTL slack (1 s for the exact authority) covers twice the
    drift a cached offset may gather before it is resampled (max_age 3600 s at 200 ppm: 0.72 s
    each way, 1.44 s in all)."""
    clock = AuthorityClock("redis://127.0.0.1:1", max_age, drift_ppm=drift_ppm)
    drift_ms = 0.0 if max_age is None else max_age * drift_ppm / 1000
    assert clock.ttl_slack_ms >= 1000 + 2 * drift_ms
    assert isinstance(clock.ttl_slack_ms, int)
