"""Following the rules in Redis when things go wrong: the first read, hung re-reads, a frozen
server at start. Real servers; every fault is bounded in time."""

from __future__ import annotations

import asyncio
import time

import pytest
from _proxy import Link, Proxy

from aiolimit import BackendError, Limiter, RuleSet
from cluster import Standalone

DENY = RuleSet.from_mapping({"kinds": {"user": "1000/hour"}, "deny": ["user:banned"]})
V1 = RuleSet.from_mapping({"kinds": {"user": "1000/hour"}, "deny": ["user:a"]})
V2 = RuleSet.from_mapping({"kinds": {"user": "1000/hour"}, "deny": ["user:b"]})


async def test_concurrent_first_decisions_all_wait_for_the_document(
    redis_url: str, prefix: str
) -> None:
    async with Limiter(redis_url, {"user": "1000/hour"}, prefix=prefix) as pusher:
        assert await pusher.push_rules(DENY)
    async with Limiter(redis_url, {"user": "1000/hour"}, prefix=prefix, follow_rules=True) as fresh:
        decisions = await asyncio.gather(*(fresh.try_acquire("user:banned") for _ in range(10)))
        assert [d.denied for d in decisions] == [True] * 10
    async with Limiter(redis_url, {"user": "1000/hour"}, prefix=prefix, follow_rules=True) as fresh:
        peeks = await asyncio.gather(*(fresh.peek("user:banned") for _ in range(5)))
        assert [d.denied for d in peeks] == [True] * 5


@pytest.mark.parametrize("on_error", ["open", "closed", "raise"])
async def test_no_first_read_is_decided_by_the_failure_policy(
    fresh_standalone: Standalone, prefix: str, on_error: str
) -> None:
    """A server frozen at start: no decision is made under rules the limiter has not read;
    each answers within its deadline as ``on_error`` says (and the document is used once the
    server is back)."""
    async with Limiter(fresh_standalone.url, {"user": "1000/hour"}, prefix=prefix) as pusher:
        assert await pusher.push_rules(DENY)
    deadline = 0.3
    fresh_standalone.pause()
    fresh = Limiter(
        fresh_standalone.url, {"user": "1000/hour"}, prefix=prefix, follow_rules=True,
        deadline=deadline, on_error=on_error,  # type: ignore[arg-type]
    )  # fmt: skip
    try:
        for _ in range(2):
            started = time.monotonic()
            if on_error == "raise":
                with pytest.raises(BackendError):
                    await fresh.try_acquire("user:banned")
            else:
                decision = await fresh.try_acquire("user:banned")
                assert decision.degraded and decision.allowed is (on_error == "open")
            assert time.monotonic() - started < deadline + 0.3
    finally:
        fresh_standalone.resume()
    try:
        async with asyncio.timeout(10):
            while True:
                try:
                    decision = await fresh.try_acquire("user:banned")
                except BackendError:
                    decision = None
                if decision is not None and not decision.degraded:
                    break
                await asyncio.sleep(0.1)
        assert decision.denied
    finally:
        await fresh.aclose()


async def test_a_hung_re_read_is_abandoned_and_following_goes_on(
    redis_url: str, prefix: str
) -> None:
    """A notification's re-read on a connection that stopped answering: abandoned within the
    bound; the next poll (on a new connection) reads again, and later pushes are seen."""
    host, port = redis_url.removeprefix("redis://").split("/")[0].split(":")
    proxy = await Proxy(host, int(port)).start()
    hang = asyncio.Event()
    try:
        async with (
            Limiter(redis_url, {"user": "1000/hour"}, prefix=prefix) as pusher,
            Limiter(
                proxy.url, {"user": "1000/hour"}, prefix=prefix, follow_rules=True,
                rules_interval=1.0,
            ) as follower,
        ):  # fmt: skip
            await follower.peek("user:x")
            assert await pusher.push_rules(DENY)  # a first re-read after a notification
            await asyncio.sleep(0.3)
            assert follower.statistics().rules_version == DENY.version
            old = {id(link) for link in proxy.links}

            async def blackhole_old_links(link: Link, data: bytes) -> None:
                if id(link) in old:  # these connections "died" silently
                    await hang.wait()

            proxy.on_request = blackhole_old_links
            assert await pusher.push_rules(V1)  # a re-read on a dead connection
            await asyncio.sleep(0.3)
            assert await pusher.push_rules(V2)
            async with asyncio.timeout(5):  # a few polls
                while follower.statistics().rules_version != V2.version:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
            assert (await follower.try_acquire("user:b")).denied
    finally:
        hang.set()
        await proxy.aclose()


async def test_no_first_read_while_the_breaker_is_open(
    fresh_standalone: Standalone, prefix: str
) -> None:
    """Once the breaker opened, decisions do not wait for a read they would not get."""
    fresh_standalone.pause()
    limiter = Limiter(
        fresh_standalone.url, {"user": "1000/hour"}, prefix=prefix, follow_rules=True,
        deadline=0.2, on_error="closed", failure_threshold=1, recovery_time=30,
    )  # fmt: skip
    try:
        assert (await limiter.try_acquire("user:a")).degraded  # waited for the read: opened
        started = time.monotonic()
        decision = await limiter.try_acquire("user:a")
        assert decision.degraded and not decision.allowed
        assert time.monotonic() - started < 0.05
        assert limiter.statistics().breaker.state == "open"
    finally:
        fresh_standalone.resume()
        await limiter.aclose()


async def test_an_unread_document_under_an_open_breaker_costs_one_probe_per_recovery_time(
    redis_url: str, prefix: str
) -> None:
    """Redis does not answer from the start (a worker started during an outage): once the
    breaker has opened, decisions are answered at once, but for one probe per recovery_time,
    as without follow_rules. (The failed first reads never re-armed the open breaker, so
    after one recovery_time every decision waited for a read, the whole outage long.)"""
    host, port = redis_url.removeprefix("redis://").split("/")[0].split(":")
    proxy = await Proxy(host, int(port)).start()
    proxy.partition()
    fresh = Limiter(
        proxy.url, {"user": "1000/hour"}, prefix=prefix, follow_rules=True, deadline=0.3,
        on_error="open", failure_threshold=3, recovery_time=0.5,
    )  # fmt: skip
    slow: list[float] = []
    try:
        started = time.monotonic()

        async def one() -> None:
            began = time.monotonic()
            assert (await fresh.try_acquire("user:a")).degraded
            if time.monotonic() - began > 0.1:
                slow.append(began - started)

        tasks = []
        while time.monotonic() - started < 3.0:  # 50 decisions a second for 3 s
            tasks.append(asyncio.ensure_future(one()))
            await asyncio.sleep(0.02)
        await asyncio.gather(*tasks)
    finally:
        proxy.heal()
        await fresh.aclose()
        await proxy.aclose()
    late = [at for at in slow if at > 1.0]  # (the breaker opens within the first second)
    assert len(late) <= 10, f"{len(late)} decisions waited for a read after the first second"


@pytest.mark.parametrize("call", ["refund", "reset"])
async def test_a_refund_or_reset_that_took_the_probe_leaves_the_breaker_able_to_close(
    redis_url: str, prefix: str, call: str
) -> None:
    """The store is down before the first read; once recovery_time has passed, a refund (or
    reset) is the call that probes, and fails. When the store is back, decisions are made by
    it again (the failed probe's slot was never given back: every decision was short-
    circuited for good)."""
    host, port = redis_url.removeprefix("redis://").split("/")[0].split(":")
    proxy = await Proxy(host, int(port)).start()
    fresh = Limiter(
        proxy.url, {"ip": ["100/minute"]}, prefix=prefix, follow_rules=True, on_error="open",
        failure_threshold=1, recovery_time=0.2, deadline=0.2,
    )  # fmt: skip
    try:
        proxy.partition()
        assert (await fresh.try_acquire("ip:a")).degraded  # the read fails: the breaker opens
        await asyncio.sleep(0.3)
        with pytest.raises(BackendError):
            await getattr(fresh, call)("ip:a")  # the probe
        proxy.heal()
        for _ in range(50):  # (5 s at most)
            decision = await fresh.try_acquire("ip:a")
            if not decision.degraded:
                break
            await asyncio.sleep(0.1)
        assert not decision.degraded, fresh.statistics().breaker
        assert fresh.statistics().breaker.state == "closed"
    finally:
        proxy.heal()
        await fresh.aclose()
        await proxy.aclose()
