"""Rules in Redis, followed by every process: pushes seen within the bound, invalid updates
rejected as a whole, overrides looked up on demand. Real servers, real processes."""

from __future__ import annotations

import asyncio
import json
import secrets
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import redis.asyncio as redis_asyncio

from aiolimit import Limit, Limiter, RuleSet
from aiolimit._follow import rules_keys, split
from cluster import Standalone

ROOT = Path(__file__).resolve().parent.parent
INTERVAL = 0.5
#: A push is in force everywhere within the poll interval plus a round trip; slack for CI.
BOUND = INTERVAL + 0.5
DENY_PROBE = RuleSet.from_mapping({"kinds": {"user": "1000/hour"}, "deny": ["user:probe"]})
ALLOW_PROBE = RuleSet.from_mapping({"kinds": {"user": "5/hour"}})


@asynccontextmanager
async def followers(url: str, prefix: str, count: int) -> AsyncIterator[list[asyncio.Queue[dict]]]:
    """``count`` limiter processes following the rules; a queue of version changes each."""
    procs = []
    queues: list[asyncio.Queue[dict]] = []
    try:
        for _ in range(count):
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tests._rules_child", url, prefix, str(INTERVAL),
                cwd=ROOT, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            )  # fmt: skip
            procs.append(proc)
        for proc in procs:
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), 30)
            assert line.strip() == b"ready", line
            queue: asyncio.Queue[dict] = asyncio.Queue()
            queues.append(queue)

            async def pump(stream: asyncio.StreamReader, into: asyncio.Queue[dict]) -> None:
                async for raw in stream:
                    await into.put(json.loads(raw))

            asyncio.get_running_loop().create_task(pump(proc.stdout, queue))
        yield queues
    finally:
        for proc in procs:
            if proc.stdin is not None:
                proc.stdin.close()
        for proc in procs:
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def next_change(queue: asyncio.Queue[dict]) -> dict:
    return await asyncio.wait_for(queue.get(), 5)


@pytest.mark.parametrize("server", ["standalone", "cluster"])
async def test_a_push_reaches_every_process_within_the_bound(
    server: str, redis_url: str, redis_cluster_url: str, prefix: str
) -> None:
    url = redis_url if server == "standalone" else redis_cluster_url
    async with (
        Limiter(url, {"user": "1/hour"}, prefix=prefix) as pusher,
        followers(url, prefix, 3) as queues,
    ):
        latencies = []
        for rules, allowed in ((DENY_PROBE, False), (ALLOW_PROBE, True), (DENY_PROBE, False)):
            pushed_at = time.time()
            assert await pusher.push_rules(rules)
            for queue in queues:
                change = await next_change(queue)
                assert change["version"] == rules.version
                assert change["allowed"] is allowed  # the rules decide, not just the version
                latencies.append(change["at"] - pushed_at)
        print(
            f"{server}: push -> in force, max {max(latencies) * 1000:.1f} ms over {len(latencies)}"
        )
        assert max(latencies) < BOUND


async def test_a_lost_notification_is_made_up_by_the_poll(redis_url: str, prefix: str) -> None:
    """The document written without a notification (as after a lost message) is still seen."""
    raw = redis_asyncio.Redis.from_url(redis_url)
    try:
        async with followers(redis_url, prefix, 2) as queues:
            document, _ = split(DENY_PROBE)
            written_at = time.time()
            await raw.set(rules_keys(prefix).doc, document)  # no PUBLISH
            for queue in queues:
                change = await next_change(queue)
                assert change["version"] == DENY_PROBE.version and change["allowed"] is False
                assert change["at"] - written_at < BOUND
            # Deleting the document brings back the limiter's own rules everywhere.
            await raw.delete(rules_keys(prefix).doc)
            for queue in queues:
                change = await next_change(queue)
                assert change["version"] is None and change["allowed"] is True
    finally:
        await raw.aclose()


@pytest.mark.parametrize(
    "garbage",
    [
        b"not json",
        json.dumps({"format": 1, "version": "x", "rules": {"kinds": {"user": "10/sec0nd"}}}),
        json.dumps({"format": 99, "version": "x", "rules": {"kinds": {"user": "1/s"}}}),
    ],
)
async def test_an_invalid_update_changes_nothing(
    redis_url: str, prefix: str, garbage: bytes | str
) -> None:
    raw = redis_asyncio.Redis.from_url(redis_url)
    async with (
        Limiter(redis_url, {"user": "1/hour"}, prefix=prefix) as pusher,
        Limiter(
            redis_url, {"user": "1/hour"}, prefix=prefix, follow_rules=True, rules_interval=0.05
        ) as follower,
    ):
        try:
            assert await pusher.push_rules(ALLOW_PROBE)
            await follower.peek("user:a")
            assert follower.statistics().rules_version == ALLOW_PROBE.version
            await raw.set(rules_keys(prefix).doc, garbage)
            await raw.publish(rules_keys(prefix).channel, "x")
            await asyncio.sleep(0.3)
            stats = follower.statistics()
            assert stats.rules_version == ALLOW_PROBE.version
            assert stats.rules_rejected >= 1
            decisions = [(await follower.try_acquire("user:a")).allowed for _ in range(6)]
            assert decisions == [True] * 5 + [False]  # still 5/hour
        finally:
            await raw.aclose()


async def test_overrides_are_looked_up_on_demand_in_a_bounded_cache(
    redis_url: str, prefix: str
) -> None:
    overrides = {f"user:{n}": {"limits": f"{n % 7 + 1}/hour"} for n in range(2000)}
    rules = RuleSet.from_mapping({"kinds": {"user": "2/hour"}, "overrides": overrides})
    async with (
        Limiter(redis_url, {"user": "1/hour"}, prefix=prefix) as pusher,
        Limiter(
            redis_url, {"user": "1/hour"}, prefix=prefix, follow_rules=True,
            override_cache_size=50,
        ) as follower,
    ):  # fmt: skip
        assert await pusher.push_rules(rules)
        # user:12 may send 12 % 7 + 1 = 6 per hour; user:99999 has no override: 2.
        assert [(await follower.try_acquire("user:12")).allowed for _ in range(7)] == [True] * 6 + [
            False
        ]
        assert [(await follower.try_acquire("user:99999")).allowed for _ in range(3)] == [
            True,
            True,
            False,
        ]
        for n in range(100, 300):
            await follower.peek(f"user:{n}")
        assert follower._follower is not None
        assert len(follower._follower._cache) <= 50  # bounded, whatever was looked up
        # Not the whole hash: a lookup per call with unknown identifiers, never a load.
        assert follower._follower.statistics.override_lookups <= 205
        # A new push with user:12 changed: in force at once here, within the bound elsewhere.
        overrides["user:12"] = {"limits": "10/hour"}
        assert await pusher.push_rules(
            RuleSet.from_mapping({"kinds": {"user": "2/hour"}, "overrides": overrides})
        )
        await asyncio.sleep(BOUND)
        assert (await follower.try_acquire("user:12")).allowed  # 7th of 10


async def test_a_push_expecting_an_older_version_writes_nothing(
    redis_url: str, prefix: str
) -> None:
    async with Limiter(redis_url, {"user": "1/hour"}, prefix=prefix) as limiter:
        assert await limiter.push_rules(ALLOW_PROBE, expect="")
        assert not await limiter.push_rules(DENY_PROBE, expect="")  # a document exists now
        assert await limiter.push_rules(DENY_PROBE, expect=ALLOW_PROBE.version)
        assert not await limiter.push_rules(ALLOW_PROBE, expect=ALLOW_PROBE.version)


async def test_decisions_in_flight_finish_under_the_rules_they_started_with(
    redis_url: str, prefix: str
) -> None:
    async with (
        Limiter(redis_url, {"user": [Limit(1, per=1)]}, prefix=prefix) as pusher,
        Limiter(
            redis_url, {"user": [Limit(1, per=1)]}, prefix=prefix, follow_rules=True,
            rules_interval=0.05,
        ) as limiter,
    ):  # fmt: skip
        assert (await limiter.try_acquire("user:w")).allowed
        waiting = asyncio.create_task(limiter.acquire("user:w", timeout=5))
        await asyncio.sleep(0.05)
        assert await pusher.push_rules(RuleSet.from_mapping({"kinds": {"user": "100/hour"}}))
        await asyncio.sleep(0.2)
        assert limiter.statistics().rules_reloads >= 1
        decision = await waiting
        assert decision.allowed and decision.details[0].limit == Limit(1, per=1)
        fresh = await limiter.try_acquire("user:w")
        assert fresh.details[0].limit == Limit(100, per=3600)


async def test_a_cluster_follower_hears_the_push(redis_cluster_url: str, prefix: str) -> None:
    async with (
        Limiter(redis_cluster_url, {"user": "1/hour"}, prefix=prefix) as pusher,
        Limiter(
            redis_cluster_url, {"user": "1/hour"}, prefix=prefix, follow_rules=True,
            rules_interval=30,  # so only the notification can bring the change in time
        ) as follower,
    ):  # fmt: skip
        await follower.peek("user:probe")
        await asyncio.sleep(0.2)  # the subscription is up
        assert await pusher.push_rules(DENY_PROBE)
        async with asyncio.timeout(5):
            while follower.statistics().rules_version != DENY_PROBE.version:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        assert (await follower.try_acquire("user:probe")).denied


async def test_following_never_slows_decisions_while_the_server_is_frozen(
    fresh_standalone: Standalone, prefix: str
) -> None:
    """A frozen server: the failure policy answers within its deadline, rules or not."""
    deadline = 0.2
    options = {
        "prefix": prefix, "follow_rules": True, "deadline": deadline, "on_error": "open",
        "rules_interval": 0.1,
    }  # fmt: skip
    async with Limiter(fresh_standalone.url, {"user": "5/hour"}, **options) as limiter:  # type: ignore[arg-type]
        assert await limiter.push_rules(ALLOW_PROBE)
        assert (await limiter.try_acquire("user:a")).allowed
        fresh_standalone.pause()
        # Opened while frozen; closed after the resume (aclose would take its grace periods).
        fresh = Limiter(fresh_standalone.url, {"user": "5/hour"}, **options)  # type: ignore[arg-type]
        try:
            for subject in (limiter, fresh, limiter, fresh):
                started = time.monotonic()
                decision = await subject.try_acquire(f"user:{secrets.token_hex(4)}")
                took = time.monotonic() - started
                assert decision.degraded and decision.allowed
                # The fresh limiter's first decision may also wait once for its first read.
                assert took < deadline * 2 + 0.1, took
        finally:
            fresh_standalone.resume()
            await fresh.aclose()
        # Back: the follower catches up and decides under the pushed rules again.
        async with asyncio.timeout(5):
            while (await limiter.try_acquire("user:b")).degraded:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        assert limiter.statistics().rules_version == ALLOW_PROBE.version
