"""Bounded cost: the largest single call's server time in the worst cases we know.

One call's server time should depend on the number of (identifier, limit) pairs, not on the
weight, the precision or the history. This provokes the worst cases and reports, per phase,
the largest and the mean server time of one decision:

- Redis: every EVALSHA's duration from SLOWLOG (``slowlog-log-slower-than 0``), in µs;
- memory://: the wall time of each call, which is how long it blocks the event loop.

Run from the repository root::

    .venv/bin/python -m bench.bounded_cost                 # a private redis-server, ~1 min
    .venv/bin/python -m bench.bounded_cost --redis-url redis://127.0.0.1:6379/0
    .venv/bin/python -m bench.bounded_cost --only log-1e6 --skip-memory

Scenarios (time comes from a ManualClock, so windows fill deterministically):

- ``log-1e6``: SlidingLog(10**6 per hour), weight 10**6 on an empty log, its refund, again.
- ``log-1e4``: SlidingLog(10**4 per hour) filled by 10**4 calls of weight 1, 1 ms apart; then
  refusals (retry_after is searched), admissions while entries leave, a refund of 10**4, and
  the first call after the whole log expired.
- ``log-undo``: SlidingLog(10**6 per hour): an op charged, 30,000 charges after it, then that
  op's undo (a late one, as after an outage), then calls while the log settles.
- ``window-3600``: Limit(3600 per hour, precision 1 s), one call per bucket until full; then
  admissions while buckets leave, refusals, refunds (newest first) and weight-0 peeks.
- ``window-40000``: the same with 40,000 buckets (precision 0.09 s), when the limit allows it.
- ``burst``: 2,500 calls on one identifier at once; per-call server time, and the wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import redis.asyncio as redis

from aiolimit import ConfigurationError, Limit, Limiter, SlidingLog
from aiolimit._calls import Call, Mode
from aiolimit._keys import aux_key, main_key
from aiolimit.testing import ManualClock

START = 1_700_000_000.0
T = TypeVar("T")


@dataclass
class Phase:
    scenario: str
    name: str
    calls: int
    max_us: float
    p99_us: float
    mean_us: float


class Recorder:
    """Times every call of a phase: SLOWLOG on Redis, the wall clock on memory://."""

    def __init__(self, backend: str, raw: redis.Redis | None) -> None:
        self.backend = backend
        self.raw = raw
        self.phases: list[Phase] = []
        self._walls: list[float] = []

    async def call(self, awaitable: Awaitable[T]) -> T:
        started = time.perf_counter()
        result = await awaitable
        self._walls.append((time.perf_counter() - started) * 1e6)
        return result

    @asynccontextmanager
    async def phase(self, scenario: str, name: str) -> AsyncIterator[None]:
        self._walls = []
        if self.raw is not None:
            await self.raw.execute_command("SLOWLOG", "RESET")
        yield
        times = self._walls
        if self.raw is not None:
            entries = await self.raw.execute_command("SLOWLOG", "GET", "-1")
            times = [float(entry[2]) for entry in entries if _is_script(entry)]
        if times:
            ordered = sorted(times)
            p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
            phase = Phase(scenario, name, len(times), ordered[-1], p99, statistics.fmean(times))
            self.phases.append(phase)
            print(_row(self.backend, phase), flush=True)


def _is_script(entry: Any) -> bool:
    args = entry[3]
    return bool(args) and bytes(args[0]).upper() in (b"FCALL", b"EVALSHA", b"EVAL")


Scenario = Callable[[Recorder, str], Awaitable[None]]


async def log_1e6(rec: Recorder, store: str) -> None:
    clock = ManualClock(start=START)
    async with _limiter(store, [SlidingLog(10**6, per=3600)], clock) as limiter:
        await limiter.peek("ip:1")  # connect
        async with rec.phase("log-1e6", "weight 1e6 on an empty log"):
            await rec.call(limiter.try_acquire("ip:1", 10**6))
        async with rec.phase("log-1e6", "refund 1e6"):
            await rec.call(limiter.refund("ip:1", 10**6))
        clock.advance(1)
        async with rec.phase("log-1e6", "weight 1e6 again, 1 s later"):
            await rec.call(limiter.try_acquire("ip:1", 10**6))
        async with rec.phase("log-1e6", "refused weight 1 on the full log"):
            await rec.call(limiter.try_acquire("ip:1", 1))


async def log_1e4(rec: Recorder, store: str) -> None:
    clock = ManualClock(start=START)
    amount = 10**4
    async with _limiter(store, [SlidingLog(amount, per=3600)], clock) as limiter:
        await limiter.peek("ip:1")
        async with rec.phase("log-1e4", "fill: 1e4 calls, 1 ms apart"):
            for _ in range(amount):
                await rec.call(limiter.try_acquire("ip:1"))
                clock.advance(0.001)
        async with rec.phase("log-1e4", "refused (retry_after searched)"):
            for weight in (1, amount // 2, amount):
                await rec.call(limiter.try_acquire("ip:1", weight))
        clock.advance(3600 - 10)  # the first ~1,000 entries have left
        async with rec.phase("log-1e4", "admitted while entries leave"):
            for _ in range(500):
                await rec.call(limiter.try_acquire("ip:1"))
                clock.advance(0.002)
        async with rec.phase("log-1e4", "refund of 9,000 (newest first)"):
            await rec.call(limiter.refund("ip:1", 9_000))
        async with rec.phase("log-1e4", "refund of 1e4 (all of it)"):
            await rec.call(limiter.refund("ip:1", amount))
        async with rec.phase("log-1e4", "fill again: 1e4 calls, 1 ms apart"):
            for _ in range(amount):
                await rec.call(limiter.try_acquire("ip:1"))
                clock.advance(0.001)
        clock.advance(3600 * 2)
        async with rec.phase("log-1e4", "first call after all expired"):
            await rec.call(limiter.try_acquire("ip:1"))


async def log_undo(rec: Recorder, store: str) -> None:
    clock = ManualClock(start=START)
    limit = SlidingLog(10**6, per=3600)
    prefix = f"bench-cost-{uuid.uuid4().hex[:8]}"
    async with _limiter(store, [limit], clock, prefix) as limiter:
        keys = [main_key(prefix, "ip:1"), aux_key(prefix, "ip:1", limit.aux_suffix)]
        block = ",".join(map(str, (2, 1, 2, *limit.wire)))

        async def raw(mode: str, op: str) -> None:
            now = round(clock.time() * 1_000_000)
            argv = [mode, now, 1, 600_000, op, "", 1, block]
            (reply,) = await limiter.store.run([Call(Mode(mode), keys, argv, ())])
            assert not isinstance(reply, BaseException), reply

        await raw("acquire", "bench:1:")
        async with rec.phase("log-undo", "30,000 charges after the op"):
            for _ in range(30_000):
                clock.advance(0.001)
                await rec.call(limiter.try_acquire("ip:1"))
        async with rec.phase("log-undo", "the op's undo (30,000 entries after it)"):
            await rec.call(raw("undo", "bench:1:"))
        async with rec.phase("log-undo", "charges and refunds after it"):
            for _ in range(100):
                clock.advance(0.001)
                await rec.call(limiter.try_acquire("ip:1"))
                await rec.call(limiter.refund("ip:1"))


async def _window(rec: Recorder, store: str, name: str, buckets: int, per: float) -> None:
    clock = ManualClock(start=START)
    precision = per / buckets
    try:
        limit = Limit(buckets, per=per, precision=precision)
    except ConfigurationError as error:
        rec.phases.append(Phase(name, f"rejected: {error}", 0, 0.0, 0.0, 0.0))
        print(_row(rec.backend, rec.phases[-1]), flush=True)
        return
    async with _limiter(store, [limit], clock) as limiter:
        await limiter.peek("ip:1")
        async with rec.phase(name, f"fill: one call per bucket ({buckets})"):
            for _ in range(buckets):
                await rec.call(limiter.try_acquire("ip:1"))
                clock.advance(precision)
        async with rec.phase(name, "admitted while buckets leave"):
            for _ in range(200):
                await rec.call(limiter.try_acquire("ip:1"))
                clock.advance(precision)
        async with rec.phase(name, "refused (retry_after searched)"):
            for weight in (1, buckets // 2, buckets):
                await rec.call(limiter.try_acquire("ip:1", weight))
        async with rec.phase(name, "refunds of 1 and peeks"):
            for _ in range(50):
                await rec.call(limiter.refund("ip:1", 1))
                await rec.call(limiter.peek("ip:1", 0 + 1))
        async with rec.phase(name, f"refund of {buckets // 2} (newest first)"):
            await rec.call(limiter.refund("ip:1", buckets // 2))


async def window_3600(rec: Recorder, store: str) -> None:
    await _window(rec, store, "window-3600", 3600, 3600.0)


async def window_40000(rec: Recorder, store: str) -> None:
    await _window(rec, store, "window-40000", 40_000, 3600.0)


async def burst(rec: Recorder, store: str) -> None:
    """2,500 calls on one identifier at once (a hot key under a traffic spike): each call's
    server time must stay near a lone call's (the limiter keeps at most ``MAX_IN_FLIGHT`` of
    them in flight, so their op ledger stays small)."""
    clock = ManualClock(start=START)
    async with _limiter(store, [Limit(10**6, per=3600)], clock) as limiter:
        await limiter.peek("ip:1")  # connect
        async with rec.phase("burst", "2,500 calls on one identifier at once"):
            started = time.perf_counter()
            decisions = await asyncio.gather(*(limiter.try_acquire("ip:1") for _ in range(2500)))
            wall = time.perf_counter() - started
        admitted = sum(decision.allowed for decision in decisions)
        print(f"  burst on {rec.backend}: {admitted}/2500 admitted in {wall:.2f} s", flush=True)


SCENARIOS: dict[str, Scenario] = {
    "burst": burst,
    "log-1e6": log_1e6,
    "log-1e4": log_1e4,
    "log-undo": log_undo,
    "window-3600": window_3600,
    "window-40000": window_40000,
}


@asynccontextmanager
async def _limiter(
    store: str, limits: list[Any], clock: ManualClock, prefix: str | None = None
) -> AsyncIterator[Limiter]:
    prefix = prefix or f"bench-cost-{uuid.uuid4().hex[:8]}"
    async with Limiter(
        store, limits, prefix=prefix, clock=clock, deadline=None, socket_timeout=300
    ) as limiter:
        yield limiter
        await limiter.reset("ip:1")


async def run(url: str | None, names: list[str], memory: bool) -> list[tuple[str, Phase]]:
    results: list[tuple[str, Phase]] = []
    if url is not None:
        raw = redis.Redis.from_url(url)
        try:
            old = await raw.config_get("slowlog-*")
            await raw.config_set("slowlog-log-slower-than", 0)
            await raw.config_set("slowlog-max-len", 100_000)
            try:
                rec = Recorder("redis", raw)
                for name in names:
                    await SCENARIOS[name](rec, url)
                results += [("redis", phase) for phase in rec.phases]
            finally:
                for key, value in old.items():
                    await raw.config_set(key, value)
        finally:
            await raw.aclose()
    if memory:
        rec = Recorder("memory", None)
        for name in names:
            await SCENARIOS[name](rec, "memory://")
        results += [("memory", phase) for phase in rec.phases]
    return results


HEADER = (
    f"{'backend':8} {'scenario':13} {'phase':42} {'calls':>6} {'max µs':>10} {'p99 µs':>8} "
    f"{'mean µs':>9}"
)


def _row(backend: str, p: Phase) -> str:
    return (
        f"{backend:8} {p.scenario:13} {p.name[:42]:42} {p.calls:>6} "
        f"{p.max_us:>10.0f} {p.p99_us:>8.0f} {p.mean_us:>9.1f}"
    )


def report(results: list[tuple[str, Phase]]) -> str:
    return "\n".join([HEADER, *(_row(backend, p) for backend, p in results)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--redis-url", help="an existing server (default: start a private one)")
    parser.add_argument("--only", action="append", choices=sorted(SCENARIOS), help="repeatable")
    parser.add_argument("--skip-redis", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    options = parser.parse_args()
    names = options.only or list(SCENARIOS)
    server = None
    url = options.redis_url
    if url is None and not options.skip_redis:
        import cluster

        server = cluster.start_standalone()
        url = server.url
    print(HEADER, flush=True)
    try:
        results = asyncio.run(
            run(None if options.skip_redis else url, names, not options.skip_memory)
        )
    finally:
        if server is not None:
            server.stop()
    print("\n" + report(results))


if __name__ == "__main__":
    main()
