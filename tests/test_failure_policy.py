"""The failure policy against a real Redis that is stopped (SIGSTOP) or killed mid-load.

Times are asserted with generous margins (a loaded CI box), but every bound is finite: the
point is that no decision and no request waits longer than the deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Sequence

import pytest
from redis.asyncio import Redis

from aiolimit import BackendUnavailable, Limit, Limiter
from aiolimit._connection import redis_client
from aiolimit._deadline import DECISION_DEADLINE, time_left
from aiolimit._failure import CircuitBreaker
from aiolimit._stores.base import Result, ScriptCall
from aiolimit._stores.redis import RedisStore
from cluster import Standalone

DEADLINE = 0.2
RECOVERY = 0.4
THRESHOLD = 3
SLACK = 0.25  # scheduling noise allowed on top of a deadline


def make_limiter(server: Standalone, prefix: str, on_error: str) -> Limiter:
    return Limiter(
        server.url,
        [Limit(100, per=60)],
        prefix=prefix,
        deadline=DEADLINE,
        on_error=on_error,  # type: ignore[arg-type]
        failure_threshold=THRESHOLD,
        recovery_time=RECOVERY,
    )


async def timed_decision(limiter: Limiter) -> tuple[float, object]:
    """(seconds taken, the Decision or the exception raised)."""
    started = time.monotonic()
    try:
        outcome: object = await limiter.try_acquire("ip:203.0.113.7")
    except BackendUnavailable as exc:
        outcome = exc
    return time.monotonic() - started, outcome


async def wait_until_closed(limiter: Limiter, limit_seconds: float) -> float:
    """Polls decisions until one is healthy again; returns how long that took."""
    started = time.monotonic()
    while time.monotonic() - started < limit_seconds:
        _, outcome = await timed_decision(limiter)
        if not isinstance(outcome, BaseException) and not outcome.degraded:  # type: ignore[attr-defined]
            return time.monotonic() - started
        await asyncio.sleep(0.02)
    raise AssertionError(f"breaker still not closed after {limit_seconds}s")


@pytest.mark.slow
@pytest.mark.parametrize("on_error", ["open", "closed", "raise"])
async def test_sigstop_each_policy_within_deadline_then_breaker_recovers(
    fresh_standalone: Standalone, prefix: str, on_error: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Stopped Redis: failures take ~deadline, the breaker opens, then answers at once."""
    caplog.set_level(logging.INFO, logger="aiolimit")
    limiter = make_limiter(fresh_standalone, prefix, on_error)
    try:
        assert (await limiter.try_acquire("ip:203.0.113.7")).allowed
        fresh_standalone.pause()
        try:
            failing = [await timed_decision(limiter) for _ in range(THRESHOLD)]
            short_circuited = [await timed_decision(limiter) for _ in range(5)]
        finally:
            fresh_standalone.resume()
        for seconds, _ in failing:
            assert DEADLINE * 0.9 <= seconds < DEADLINE + SLACK
        for seconds, _ in short_circuited:
            assert seconds < 0.05
        for _, outcome in failing + short_circuited:
            if on_error == "raise":
                assert isinstance(outcome, BackendUnavailable)
            else:
                assert outcome.degraded  # type: ignore[attr-defined]
                assert outcome.allowed is (on_error == "open")  # type: ignore[attr-defined]
        assert limiter.statistics().breaker.state == "open"
        recovered_in = await wait_until_closed(limiter, RECOVERY + 3)
        assert recovered_in < RECOVERY + 1
        stats = limiter.statistics().breaker
        assert (stats.state, stats.opened, stats.timeouts) == ("closed", 1, THRESHOLD)
        assert stats.short_circuited >= 5
        messages = [r.getMessage() for r in caplog.records if r.name == "aiolimit"]
        transitions = [m.split(": ")[0] for m in messages if m.startswith("aiolimit circuit")]
        # Many degraded decisions, one rate-limited line (DEGRADED_LOG_INTERVAL) for them.
        degraded = [m for m in messages if m.startswith("aiolimit degraded")]
        assert len(degraded) == (0 if on_error == "raise" else 1), degraded
        assert transitions == [
            "aiolimit circuit breaker closed -> open",
            "aiolimit circuit breaker open -> half_open",
            "aiolimit circuit breaker half_open -> closed",
        ]
    finally:
        await limiter.aclose()


@pytest.mark.slow
async def test_kill_fails_fast_and_restart_closes_the_breaker(
    fresh_standalone: Standalone, prefix: str
) -> None:
    """A killed Redis refuses connections: errors come at once, and a restart closes the breaker."""
    limiter = make_limiter(fresh_standalone, prefix, "open")
    try:
        await limiter.try_acquire("ip:203.0.113.7")
        fresh_standalone.kill()
        outcomes = [await timed_decision(limiter) for _ in range(THRESHOLD + 2)]
        assert all(seconds < DEADLINE + SLACK for seconds, _ in outcomes)
        assert all(outcome.degraded for _, outcome in outcomes)  # type: ignore[attr-defined]
        assert limiter.statistics().breaker.state == "open"
        fresh_standalone.restart()
        recovered_in = await wait_until_closed(limiter, RECOVERY + 5)
        assert recovered_in < RECOVERY + 3
        decision = await limiter.try_acquire("ip:203.0.113.7")
        assert decision.allowed and not decision.degraded
        assert decision.remaining == 98  # restart emptied the data: 2 charged since
    finally:
        await limiter.aclose()


async def test_half_open_lets_exactly_one_probe_through(
    fresh_standalone: Standalone, prefix: str
) -> None:
    """While the probe is in flight, every other decision gets the policy's answer at once."""
    limiter = make_limiter(fresh_standalone, prefix, "closed")
    try:
        fresh_standalone.pause()
        try:
            for _ in range(THRESHOLD):
                await limiter.try_acquire("ip:203.0.113.7")
            await asyncio.sleep(RECOVERY + 0.05)
            probe = asyncio.create_task(timed_decision(limiter))
            await asyncio.sleep(0.02)  # the probe now waits on the stopped server
            others = await asyncio.gather(*(timed_decision(limiter) for _ in range(20)))
            assert all(seconds < 0.05 for seconds, _ in others)
            assert limiter.statistics().breaker.state == "half_open"
            seconds, _ = await probe
            assert DEADLINE * 0.9 <= seconds < DEADLINE + SLACK
        finally:
            fresh_standalone.resume()
        assert limiter.statistics().breaker.state == "open"  # the probe failed
    finally:
        await limiter.aclose()


class RecordingStore(RedisStore):
    """A real Redis store that records the deadline it sees (the contract cluster retries use)."""

    def __init__(self, client: Redis) -> None:
        super().__init__(client, owns_client=True)
        self.seen: list[float | None] = []

    async def run(self, calls: Sequence[ScriptCall]) -> list[Result]:
        self.seen.append(time_left())
        return await super().run(calls)

    def run_one(self, call: ScriptCall) -> Awaitable[Result]:
        self.seen.append(time_left())
        return super().run_one(call)


async def test_store_sees_the_decision_deadline(redis_url: str, prefix: str) -> None:
    """Inside a decision, stores see the time left in DECISION_DEADLINE; outside it is None."""
    store = RecordingStore(redis_client(redis_url, 2.0, io_timeout=2.0))
    limiter = Limiter(store, [Limit(5, per=60)], prefix=prefix, deadline=0.5)
    try:
        await limiter.try_acquire("ip:1")
        await limiter.peek("ip:1")
        await limiter.refund("ip:1")
    finally:
        await limiter.aclose()
    assert len(store.seen) == 3
    assert all(left is not None and 0 < left <= 0.5 for left in store.seen)
    assert DECISION_DEADLINE.get() is None


async def test_no_deadline_means_unbounded(redis_url: str, prefix: str) -> None:
    """deadline=None: no cancel scope, and stores see no deadline."""
    store = RecordingStore(redis_client(redis_url, 2.0, io_timeout=2.0))
    limiter = Limiter(store, [Limit(5, per=60)], prefix=prefix, deadline=None)
    try:
        assert (await limiter.try_acquire("ip:1")).allowed
    finally:
        await limiter.aclose()
    assert store.seen == [None]


def test_breaker_cancelled_probe_frees_the_slot() -> None:
    """A probe cancelled from outside does not leave the breaker stuck half-open."""
    breaker = CircuitBreaker(failure_threshold=1, recovery_time=0.001)
    breaker.record_failure(RuntimeError("down"))
    time.sleep(0.002)
    assert breaker.allow() and breaker.state == "half_open"
    assert not breaker.allow()
    breaker.record_abandoned()
    assert breaker.allow()
    breaker.record_success()
    assert breaker.state == "closed"


@pytest.mark.parametrize(
    "options",
    [{"deadline": 0}, {"deadline": -1}, {"on_error": "ignore"}, {"failure_threshold": 0},
     {"recovery_time": float("nan")}],
)  # fmt: skip
def test_bad_failure_options_are_configuration_errors(options: dict[str, object]) -> None:
    """Invalid deadline, on_error and breaker options fail in the constructor."""
    with pytest.raises(ValueError):
        Limiter("memory://", [Limit(1, per=1)], **options)  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.parametrize(("on_error", "status"), [("open", 200), ("closed", 503)])
async def test_http_load_while_redis_is_stopped(
    fresh_standalone: Standalone, prefix: str, on_error: str, status: int
) -> None:
    """Under concurrent HTTP load with Redis stopped, no request outlives the deadline."""
    from starlette.applications import Starlette
    from starlette.routing import Route
    from test_web_starlette import hello, serve

    from aiolimit.starlette import RateLimitMiddleware

    limiter = make_limiter(fresh_standalone, prefix, on_error)
    app = Starlette(routes=[Route("/", hello)])
    app.add_middleware(RateLimitMiddleware, limiter=limiter)
    try:
        async with serve(app) as client:
            healthy = await client.get("/")
            assert healthy.status_code == 200 and "ratelimit" in healthy.headers
            fresh_standalone.pause()
            try:
                started = time.monotonic()
                responses = await asyncio.gather(*(client.get("/") for _ in range(40)))
                elapsed = time.monotonic() - started
            finally:
                fresh_standalone.resume()
            assert {r.status_code for r in responses} == {status}
            assert elapsed < DEADLINE + 1.0
            assert all("ratelimit" not in r.headers for r in responses)
            if status == 503:
                assert all(
                    r.headers["content-type"] == "application/problem+json" for r in responses
                )
                assert all(int(r.headers["retry-after"]) >= 1 for r in responses)
            await asyncio.sleep(RECOVERY)
            after = await client.get("/")
            after = after if "ratelimit" in after.headers else await client.get("/")
            assert after.status_code == 200 and "ratelimit" in after.headers
        assert limiter.statistics().breaker.state == "closed"
    finally:
        await limiter.aclose()


# --- the deadline's one timer per policy and loop (_DeadlineWheel) ------------------------------


async def test_deadlines_expire_exactly_the_decisions_still_running() -> None:
    """120 decisions under one 60 ms deadline, each taking 0 to 118 ms: those done well before
    it answer, those still running well after it fail with DeadlineExceeded (its cause a
    TimeoutError), and the tasks carry no cancellation request afterwards."""
    from aiolimit._failure import DeadlineExceeded, FailurePolicy

    policy = FailurePolicy(deadline=0.06)

    async def decision(seconds: float) -> object:
        try:
            async with policy.deadline():
                await asyncio.sleep(seconds)
        except DeadlineExceeded as error:
            assert isinstance(error.__cause__, TimeoutError)
            assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
            return "deadline"
        return "done"

    lengths = [i / 1000 for i in range(120)]
    outcomes = await asyncio.gather(*(decision(seconds) for seconds in lengths))
    for seconds, outcome in zip(lengths, outcomes, strict=True):
        if seconds < 0.04:
            assert outcome == "done", seconds
        elif seconds > 0.09:
            assert outcome == "deadline", seconds


async def test_a_cancellation_from_outside_stays_a_cancellation() -> None:
    """The caller's own cancel and an outer timeout shorter than the deadline are not the
    deadline's: they come out as CancelledError and TimeoutError, not DeadlineExceeded."""
    from aiolimit._failure import FailurePolicy

    policy = FailurePolicy(deadline=5.0)

    async def decision() -> None:
        async with policy.deadline():
            await asyncio.sleep(10)

    task = asyncio.create_task(decision())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.02):
            await decision()
    # And the deadline's timer, set for those, fires on nothing and goes.
    started = time.monotonic()
    async with policy.deadline():
        await asyncio.sleep(0.01)
    assert time.monotonic() - started < 1.0


def test_one_policy_keeps_its_deadline_on_each_event_loop() -> None:
    """A limiter not bound to a loop (memory://) may decide on one loop, then another."""
    from aiolimit._failure import DeadlineExceeded, FailurePolicy

    policy = FailurePolicy(deadline=0.03)

    async def late() -> str:
        try:
            async with policy.deadline():
                await asyncio.sleep(1)
        except DeadlineExceeded:
            return "deadline"
        return "done"

    assert asyncio.run(late()) == "deadline"
    assert asyncio.run(late()) == "deadline"
    assert len(policy._wheels) == 1  # the closed loop's timer was let go


async def test_finished_decisions_are_let_go_before_their_deadline() -> None:
    """2,000 decisions one after another under a 60 s deadline: the tasks that made them (and
    what they hold) are freed as they finish, and the deadline's queue stays small (the old
    per-decision timer let go at once; a queue that kept each finished decision's task until
    its deadline came held all 2,000)."""
    import gc
    import weakref

    async with Limiter("memory://", [Limit(10**9, per=1)], deadline=60) as limiter:

        async def one(i: int) -> bytearray:
            await limiter.try_acquire(f"ip:{i % 7}")
            return bytearray(10_000)

        tasks = []
        for i in range(2000):
            task = asyncio.ensure_future(one(i))
            await task
            tasks.append(weakref.ref(task))
            del task
        gc.collect()
        alive = sum(1 for ref in tasks if ref() is not None)
        queued = sum(len(wheel._queue) for wheel in limiter._failure._wheels.values())
    assert alive <= 1, f"{alive} finished tasks still held"
    assert queued <= 200, f"{queued} entries in the deadline queue for 1 running decision"
