"""Adversarial checks of the standalone decision path written out for speed: the deadline
scope's enter/leave, Store.run_one's future on the batched path, in-flight slots taken without
a coroutine, the breaker's fast path, the op ledger. Each ends with everything drained and the
stored charge equal to what callers were told was admitted."""

from __future__ import annotations

import asyncio
import gc
import time
from typing import Any

import pytest
from test_edges_charging import ROOMY, charged, settle, told_admitted

import cluster
from aiolimit import BackendUnavailable, Limit, Limiter
from aiolimit._protocol import MAX_IN_FLIGHT
from aiolimit.testing import ManualClock

ID = "ip:203.0.113.9"


async def drained(limiter: Limiter, within: float = 5.0) -> None:
    """Every slot given back, every op settled, no background task left."""
    proto = limiter._protocol
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not proto._in_flight and not proto._queued and not proto._tasks and \
                proto.ops.unsettled() == 0:  # fmt: skip
            return
        await asyncio.sleep(0.02)
    queued = {key: len(waiters) for key, waiters in proto._queued.items()}
    raise AssertionError(
        f"not drained: in_flight={proto._in_flight} queued={queued} "
        f"tasks={len(proto._tasks)} unsettled={proto.ops.unsettled()}"
    )


async def test_caller_cancel_and_outer_timeout_stay_themselves(
    fresh_standalone: cluster.Standalone, prefix: str
) -> None:
    """A paused server, a long deadline: a caller's cancel stays CancelledError, an outer
    asyncio.timeout stays TimeoutError; neither counts as a store failure; nothing charged."""
    limiter = Limiter(fresh_standalone.url, [ROOMY], prefix=prefix, deadline=5.0,
                      failure_threshold=1)  # fmt: skip
    await limiter.peek(ID)
    fresh_standalone.pause()
    try:
        task = asyncio.ensure_future(limiter.try_acquire(ID))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # batched path: several at once, all under an outer timeout
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.1):
                await asyncio.gather(*(limiter.try_acquire(ID) for _ in range(5)))
        assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
        stats = limiter.statistics()
        assert stats.breaker.state == "closed" and stats.breaker.failures == 0
        assert stats.breaker.timeouts == 0
    finally:
        fresh_standalone.resume()
    await drained(limiter)
    store = fresh_standalone.url
    await limiter.aclose()
    ok, stored = await settle(lambda: charged(store, prefix, ID), 0)
    assert ok, stored


async def test_deadline_on_a_paused_server_is_backend_unavailable_and_uncharged(
    fresh_standalone: cluster.Standalone, prefix: str
) -> None:
    limiter = Limiter(fresh_standalone.url, [ROOMY], prefix=prefix, deadline=0.15,
                      failure_threshold=1000)  # fmt: skip
    await limiter.peek(ID)
    fresh_standalone.pause()
    try:
        outcomes = await asyncio.gather(
            *(limiter.try_acquire(ID) for _ in range(20)), return_exceptions=True
        )
        assert all(isinstance(o, BackendUnavailable) for o in outcomes), outcomes
        assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
        assert limiter.statistics().breaker.timeouts == 20
    finally:
        fresh_standalone.resume()
    await drained(limiter)
    await limiter.aclose()
    ok, stored = await settle(lambda: charged(fresh_standalone.url, prefix, ID), 0)
    assert ok, stored


async def test_deadline_and_caller_cancel_in_the_same_tick_is_a_cancel(
    fresh_standalone: cluster.Standalone, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The deadline fires and the caller cancels too, before the task resumes: the caller's
    cancel wins (CancelledError, as asyncio.timeout would); the breaker counts no failure."""
    from aiolimit._failure import _DeadlineScope

    real_expire = _DeadlineScope.expire
    expired: list[object] = []

    def expire_then_caller_cancels(self: _DeadlineScope) -> None:
        task = self._task
        real_expire(self)
        expired.append(task)
        task.cancel()  # type: ignore[union-attr]  # the caller's own cancel, same tick

    monkeypatch.setattr(_DeadlineScope, "expire", expire_then_caller_cancels)
    limiter = Limiter(fresh_standalone.url, [ROOMY], prefix=prefix, deadline=0.1,
                      failure_threshold=1)  # fmt: skip
    await limiter.peek(ID)
    fresh_standalone.pause()
    try:
        tasks = [asyncio.ensure_future(limiter.try_acquire(ID)) for _ in range(3)]
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        assert len(expired) == 3
        assert all(isinstance(o, asyncio.CancelledError) for o in outcomes), outcomes
        assert limiter.statistics().breaker.failures == 0
    finally:
        fresh_standalone.resume()
    await drained(limiter)
    await limiter.aclose()


@pytest.mark.parametrize("point", ["ticks0", "ticks1", "ticks2", "ticks3", "sent"])
async def test_cancelled_batched_calls_leave_no_slot_op_or_charge(
    redis_url: str, prefix: str, point: str, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    caplog.set_level(logging.DEBUG, logger="asyncio")
    limiter = Limiter(redis_url, [ROOMY], prefix=prefix, deadline=5.0)
    await limiter.peek(ID)
    admitted = cancelled = 0
    for round_ in range(10):
        calls = [asyncio.ensure_future(limiter.try_acquire(ID)) for _ in range(40)]
        if point == "sent":
            await asyncio.sleep(0.0005 * round_)
        else:
            for _ in range(int(point[-1])):
                await asyncio.sleep(0)
        for call in calls[::2]:
            call.cancel()
        for outcome in await asyncio.gather(*calls, return_exceptions=True):
            admitted += told_admitted(outcome)
            cancelled += isinstance(outcome, asyncio.CancelledError)
    await drained(limiter)
    stats = limiter.statistics()
    await limiter.aclose()
    gc.collect()
    assert cancelled > 0
    ok, stored = await settle(lambda: charged(redis_url, prefix, ID), admitted)
    assert ok, (stored, admitted, cancelled, stats)
    gc.collect()
    await asyncio.sleep(0)
    assert not [r for r in caplog.records if r.name == "asyncio"], caplog.text


async def test_more_than_max_in_flight_on_one_key_queue_and_drain(
    fresh_standalone: cluster.Standalone, prefix: str
) -> None:
    """With the server paused, MAX_IN_FLIGHT + 72 calls on one key: the extra ones wait in
    line (the slow path); some waiters and some in-flight callers are cancelled; once the
    server resumes every slot comes back and exactly the admitted weight is stored."""
    limiter = Limiter(fresh_standalone.url, [ROOMY], prefix=prefix, deadline=10.0)
    await limiter.peek(ID)
    proto = limiter._protocol
    fresh_standalone.pause()
    try:
        calls = [asyncio.ensure_future(limiter.try_acquire(ID)) for _ in range(MAX_IN_FLIGHT + 72)]
        for _ in range(5):
            await asyncio.sleep(0)
        key = next(iter(proto._in_flight))
        assert proto._in_flight[key] == MAX_IN_FLIGHT
        assert len(proto._queued[key]) == 72
        for call in calls[MAX_IN_FLIGHT + 10 : MAX_IN_FLIGHT + 30]:  # waiters
            call.cancel()
        for call in calls[5:15]:  # in flight
            call.cancel()
        await asyncio.sleep(0.05)
        assert proto._in_flight[key] == MAX_IN_FLIGHT
    finally:
        fresh_standalone.resume()
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    admitted = sum(told_admitted(o) for o in outcomes)
    errors = [o for o in outcomes if isinstance(o, BaseException)
              and not isinstance(o, asyncio.CancelledError)]  # fmt: skip
    assert not errors, errors[:3]
    assert sum(isinstance(o, asyncio.CancelledError) for o in outcomes) == 30
    assert admitted == MAX_IN_FLIGHT + 72 - 30
    assert proto.statistics.waited_in_flight >= 72
    await drained(limiter)
    await limiter.aclose()
    ok, stored = await settle(lambda: charged(fresh_standalone.url, prefix, ID), admitted)
    assert ok, (stored, admitted)


async def test_deadline_while_waiting_in_line_for_a_slot(
    fresh_standalone: cluster.Standalone, prefix: str
) -> None:
    limiter = Limiter(fresh_standalone.url, [ROOMY], prefix=prefix, deadline=0.2,
                      failure_threshold=10**6)  # fmt: skip
    await limiter.peek(ID)
    fresh_standalone.pause()
    try:
        outcomes = await asyncio.gather(
            *(limiter.try_acquire(ID) for _ in range(MAX_IN_FLIGHT + 20)), return_exceptions=True
        )
        assert all(isinstance(o, BackendUnavailable) for o in outcomes), {type(o) for o in outcomes}
        assert not limiter._protocol._queued
    finally:
        fresh_standalone.resume()
    await drained(limiter)
    await limiter.aclose()
    ok, stored = await settle(lambda: charged(fresh_standalone.url, prefix, ID), 0)
    assert ok, stored


async def test_manual_clock_goes_through_decide(redis_url: str, prefix: str) -> None:
    """A non-server clock: acquire sends the clock's time (decide's path), not TIME."""
    clock = ManualClock(1_700_000_000.0)
    limiter = Limiter(redis_url, [Limit(2, per=10)], prefix=prefix, clock=clock)
    calls: list[Any] = []
    real = limiter._protocol.decide

    async def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[0])
        return await real(*args, **kwargs)

    limiter._protocol.decide = spy  # type: ignore[method-assign]
    try:
        assert (await limiter.try_acquire(ID)).allowed
        assert (await limiter.try_acquire(ID)).allowed
        refused = await limiter.try_acquire(ID)
        assert not refused.allowed and 0 < refused.retry_after <= 10
        clock.advance(10.0)
        assert (await limiter.try_acquire(ID)).allowed
        assert [str(m) for m in calls] == ["acquire"] * 4
    finally:
        await limiter.aclose()


def test_memory_limiter_on_two_loops_in_turn_with_a_deadline() -> None:
    """One memory:// limiter (and its policy) used on one loop, then another, then the first
    again; the deadline still fires on each (a paused decision is cut short)."""
    limiter = Limiter(
        "memory://", [Limit(3, per=60, precision=1)], deadline=0.1, failure_threshold=10**6
    )
    policy = limiter._failure

    async def run() -> list[bool]:
        return [(await limiter.try_acquire("ip:1")).allowed for _ in range(2)]

    async def expire() -> str:
        # the decision's deadline fires while its task waits (a stand-in for a slow store)
        real = limiter._protocol.acquire

        async def slow(*args: Any, **kwargs: Any) -> Any:
            await asyncio.sleep(1.0)
            return await real(*args, **kwargs)

        limiter._protocol.acquire = slow  # type: ignore[method-assign]
        try:
            await limiter.try_acquire("ip:2")
        except BackendUnavailable as error:
            return type(error).__name__
        finally:
            del limiter._protocol.acquire
        return "no deadline"

    a = asyncio.new_event_loop()
    b = asyncio.new_event_loop()
    try:
        assert a.run_until_complete(run()) == [True, True]
        assert b.run_until_complete(expire()) == "DeadlineExceeded"
        assert policy._last_wheel._loop is b  # type: ignore[union-attr]
        assert a.run_until_complete(run()) == [True, False]
        assert a.run_until_complete(expire()) == "DeadlineExceeded"
        assert policy._last_wheel._loop is a  # type: ignore[union-attr]
    finally:
        b.close()
    try:
        assert asyncio.run(expire()) == "DeadlineExceeded"  # a new loop after b closed
        assert asyncio.run(expire()) == "DeadlineExceeded"
        assert all(not loop.is_closed() for loop, _ in policy._wheels) or len(policy._wheels) <= 3
    finally:
        a.close()


async def test_half_open_admits_one_probe_and_records_its_outcome(
    fresh_standalone: cluster.Standalone, prefix: str
) -> None:
    """Open breaker, past recovery: of many concurrent decisions exactly one reaches the store
    (the probe); a failed probe opens it again, a successful one closes it."""
    # (a deadline roomy enough for a probe just after SIGCONT on a loaded machine)
    limiter = Limiter(fresh_standalone.url, [ROOMY], prefix=prefix, deadline=0.5,
                      on_error="closed", failure_threshold=1, recovery_time=0.2)  # fmt: skip
    breaker = limiter._failure.breaker
    await limiter.peek(ID)
    fresh_standalone.pause()
    try:
        first = await limiter.try_acquire(ID)  # times out: opens
        assert first.degraded and breaker.state == "open"
        await asyncio.sleep(0.25)
        short_before = breaker.short_circuited
        outcomes = await asyncio.gather(*(limiter.try_acquire(ID) for _ in range(8)))
        assert all(o.degraded for o in outcomes)
        assert breaker.short_circuited - short_before == 7  # one probe, seven refused
        assert breaker.state == "open" and breaker.failures == 2 and not breaker._probing
    finally:
        fresh_standalone.resume()
    await asyncio.sleep(0.25)
    short_before = breaker.short_circuited
    outcomes = await asyncio.gather(*(limiter.try_acquire(ID) for _ in range(8)))
    assert sum(not o.degraded for o in outcomes) == 1  # the probe
    assert breaker.short_circuited - short_before == 7
    assert breaker.state == "closed" and not breaker._probing
    assert all(not o.degraded for o in await asyncio.gather(
        *(limiter.try_acquire(ID) for _ in range(8))))  # fmt: skip
    # a cancelled probe frees the slot: the next one probes
    fresh_standalone.pause()
    try:
        await limiter.try_acquire(ID)
        assert breaker.state == "open"
        await asyncio.sleep(0.25)
        probe = asyncio.ensure_future(limiter.try_acquire(ID))
        await asyncio.sleep(0.02)
        assert breaker.state == "half_open" and breaker._probing
        probe.cancel()
        with pytest.raises(asyncio.CancelledError):
            await probe
        assert breaker.state == "half_open" and not breaker._probing
    finally:
        fresh_standalone.resume()
    assert not (await limiter.try_acquire(ID)).degraded
    assert breaker.state == "closed"
    await drained(limiter)
    await limiter.aclose()


@pytest.mark.parametrize("seed", range(3))
async def test_random_cancels_deadlines_and_pauses_charge_exactly_the_admitted(
    fresh_standalone: cluster.Standalone, prefix: str, seed: int
) -> None:
    import random

    rng = random.Random(seed)
    limiter = Limiter(fresh_standalone.url, [ROOMY], prefix=prefix, deadline=0.05,
                      failure_threshold=10**6)  # fmt: skip
    ids = [f"ip:10.0.0.{i}" for i in range(3)]
    await limiter.peek(ids[0])
    admitted = dict.fromkeys(ids, 0)
    outcomes_seen: dict[str, int] = {}
    for _ in range(15):
        calls = [(i, asyncio.ensure_future(limiter.try_acquire(i)))
                 for i in (rng.choice(ids) for _ in range(rng.randint(1, 60)))]  # fmt: skip
        pause = rng.random() < 0.3
        if pause:
            fresh_standalone.pause()
        try:
            for _ in range(rng.randint(0, 4)):
                await asyncio.sleep(0)
            if rng.random() < 0.5:
                await asyncio.sleep(rng.random() * 0.06)
            for _, call in calls:
                if rng.random() < 0.3:
                    call.cancel()
            if pause:
                await asyncio.sleep(rng.random() * 0.08)
        finally:
            if pause:
                fresh_standalone.resume()
        for (i, _), outcome in zip(calls, await asyncio.gather(
                *(c for _, c in calls), return_exceptions=True), strict=True):  # fmt: skip
            admitted[i] += told_admitted(outcome)
            name = type(outcome).__name__
            outcomes_seen[name] = outcomes_seen.get(name, 0) + 1
    await drained(limiter)
    await limiter.aclose()
    for i in ids:
        ok, stored = await settle(lambda i=i: charged(fresh_standalone.url, prefix, i), admitted[i])
        assert ok, (i, stored, admitted[i], outcomes_seen)
    assert set(outcomes_seen) <= {"Decision", "CancelledError", "DeadlineExceeded"}, outcomes_seen
