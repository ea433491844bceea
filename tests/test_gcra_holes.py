"""GCRA (TokenBucket, MinInterval): undoing a queued turn frees it, exactly and safely.

gcra.lua records reservations (turns admitted after a delay) and the holes their undos leave
in the queue (see its header). These tests drive the script directly at chosen µs times, with
op ids and the reservation flag, on Redis, Valkey and memory://, and check two things: an undone
turn's capacity goes to the next request that can use it, and no sequence of charges, undos
and refunds ever admits more than the rate allows.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from typing import Any

import pytest
from redis.asyncio import Redis

from aiolimit import Limiter, MinInterval, TokenBucket
from aiolimit._calls import Call, Mode, decide_script
from aiolimit._embedded.store import EmbeddedStore
from aiolimit._keys import main_key
from aiolimit.testing import ManualClock

T0 = 1_700_000_000_000_000  # µs
S = 1_000_000
SLACK_MS = 600_000


class Script:
    """Raw calls of lua/decide.lua for one identifier under one GCRA limit."""

    def __init__(self, limiter: Limiter, prefix: str, limit: Any) -> None:
        self.limiter = limiter
        self.keys = [main_key(prefix, "ip:1")]
        self.block = ",".join(map(str, (1, 1, 0, *limit.wire)))

    async def call(
        self, mode: str, now: int, weight: int = 1, op: str = "", wait_us: int = 0
    ) -> list[int]:
        flags = f"r{wait_us}" if wait_us else ""
        argv = [mode, now, weight, SLACK_MS, op, flags, 1, self.block]
        (reply,) = await self.limiter.store.run([Call(Mode(mode), self.keys, argv, ())])
        assert not isinstance(reply, BaseException), reply
        return list(reply)

    async def admitted_at(self, now: int, op: str, weight: int = 1, wait_us: int = 0) -> int | None:
        """acquire: when the request is admitted (µs), or None if refused."""
        reply = await self.call("acquire", now, weight, op, wait_us)
        if reply[0] != 1:
            return None
        assert reply[5] <= wait_us, reply  # admitted within the wait it was given
        return now + reply[5]


async def test_an_undone_turn_goes_to_the_next_waiter(store_url: str, prefix: str) -> None:
    """MinInterval(2 s): the token at 0, waiter A reserves 2 s, waiter B 4 s. A's undo frees
    the turn at 2 s: a newcomer queued before it is admitted at 2 s (before, at 6 s), B keeps
    4 s, and the next one after that queues at 6 s."""
    async with Limiter(store_url, [MinInterval(2)], prefix=prefix) as limiter:
        script = Script(limiter, prefix, MinInterval(2))
        wait = 30 * S
        assert await script.admitted_at(T0, "m:1:") == T0
        assert await script.admitted_at(T0 + 10, "a:1:", wait_us=wait) == T0 + 2 * S
        assert await script.admitted_at(T0 + 20, "b:1:", wait_us=wait) == T0 + 4 * S
        undo = await script.call("undo", T0 + 30, 1, "a:1:")
        assert undo[1] == 0  # applied
        assert await script.admitted_at(T0 + 40, "m:2:", wait_us=wait) == T0 + 2 * S
        assert await script.admitted_at(T0 + 50, "m:3:", wait_us=wait) == T0 + 6 * S
        # without waiting, nothing fits before the next free turn
        assert await script.admitted_at(T0 + 60, "m:4:") is None


async def test_a_refusal_points_at_a_freed_turn_and_never_reports_negative_room(
    store_url: str, prefix: str
) -> None:
    """MinInterval(2 s): the token at 0, A reserves 2 s, B 4 s; A's undo frees the turn at
    2 s. A request that cannot wait is refused, and its retry_after is that freed turn (what
    a waiting request is given), not past the queue (6 s): a refusal cache would otherwise
    refuse what the store reserves. Its remaining is 0, never negative."""
    async with Limiter(store_url, [MinInterval(2)], prefix=prefix) as limiter:
        script = Script(limiter, prefix, MinInterval(2))
        wait = 30 * S
        assert await script.admitted_at(T0, "m:1:") == T0
        assert await script.admitted_at(T0 + 10, "a:1:", wait_us=wait) == T0 + 2 * S
        assert await script.admitted_at(T0 + 20, "b:1:", wait_us=wait) == T0 + 4 * S
        assert (await script.call("undo", T0 + 30, 1, "a:1:"))[1] == 0  # applied
        refused = await script.call("acquire", T0 + 40, 1, "m:2:")
        assert refused[0] == 0 and refused[3] == 0
        assert refused[4] == 0, refused  # remaining
        assert refused[5] == 2 * S - 40, refused  # retry: the freed turn
        assert await script.admitted_at(T0 + 50, "m:3:", wait_us=wait) == T0 + 2 * S


async def test_two_freed_turns_serve_two_newcomers(store_url: str, prefix: str) -> None:
    """MinInterval(1 s), turns queued at 1, 2, 3 and 4 s; the turns at 2 and 3 s are undone
    (one hole of two turns): the next two newcomers take 2 s and 3 s, the third queues at 5 s."""
    async with Limiter(store_url, [MinInterval(1)], prefix=prefix) as limiter:
        script = Script(limiter, prefix, MinInterval(1))
        wait = 30 * S
        await script.admitted_at(T0, "m:1:")
        for i in range(1, 5):
            assert await script.admitted_at(T0 + i, f"w{i}:1:", wait_us=wait) == T0 + i * S
        await script.call("undo", T0 + 10, 1, "w3:1:")
        await script.call("undo", T0 + 11, 1, "w2:1:")
        newcomers = [
            await script.admitted_at(T0 + 20 + i, f"n{i}:1:", wait_us=wait) for i in range(3)
        ]
        assert newcomers == [T0 + 2 * S, T0 + 3 * S, T0 + 5 * S]


async def test_a_hole_left_unused_in_time_is_gone(store_url: str, prefix: str) -> None:
    """A freed turn is usable only while it lies ahead: at 2.5 s a 2-second turn no longer fits
    in the hole [2 s, 4 s), so a newcomer queues after the last turn, as without the undo."""
    async with Limiter(store_url, [MinInterval(2)], prefix=prefix) as limiter:
        script = Script(limiter, prefix, MinInterval(2))
        wait = 30 * S
        await script.admitted_at(T0, "m:1:")
        await script.admitted_at(T0 + 10, "a:1:", wait_us=wait)
        await script.admitted_at(T0 + 20, "b:1:", wait_us=wait)
        await script.call("undo", T0 + 30, 1, "a:1:")
        assert await script.admitted_at(T0 + 2_500_000, "m:2:", wait_us=wait) == T0 + 6 * S


async def test_undoing_a_request_that_took_a_hole_gives_the_hole_back(
    store_url: str, prefix: str
) -> None:
    """The newcomer that took A's freed turn fails in turn: its undo reopens the hole, which
    the next waiter takes; B's turn never moves."""
    async with Limiter(store_url, [MinInterval(2)], prefix=prefix) as limiter:
        script = Script(limiter, prefix, MinInterval(2))
        wait = 30 * S
        await script.admitted_at(T0, "m:1:")
        await script.admitted_at(T0 + 10, "a:1:", wait_us=wait)
        assert await script.admitted_at(T0 + 20, "b:1:", wait_us=wait) == T0 + 4 * S
        await script.call("undo", T0 + 30, 1, "a:1:")
        assert await script.admitted_at(T0 + 40, "c:1:", wait_us=wait) == T0 + 2 * S
        assert (await script.call("undo", T0 + 50, 1, "c:1:"))[1] == 0
        assert await script.admitted_at(T0 + 60, "d:1:", wait_us=wait) == T0 + 2 * S
        assert await script.admitted_at(T0 + 70, "e:1:", wait_us=wait) == T0 + 6 * S


async def test_an_undone_admission_with_a_waiter_behind_it_frees_its_capacity(
    store_url: str, prefix: str
) -> None:
    """TokenBucket(1 per 2 s, burst 2): two admitted at once (0 s), then a waiter queues at
    2 s. The second admission's reply was lost and it is undone: its capacity comes back
    (a newcomer is admitted at once), the waiter keeps its turn. Before, the undo credited
    nothing once a turn was queued behind it."""
    limit = TokenBucket(1, per=2, burst=2)
    async with Limiter(store_url, [limit], prefix=prefix) as limiter:
        script = Script(limiter, prefix, limit)
        wait = 30 * S
        assert await script.admitted_at(T0, "m:1:") == T0
        assert await script.admitted_at(T0 + 10, "x:1:") == T0 + 10
        assert await script.admitted_at(T0 + 20, "w:1:", wait_us=wait) == T0 + 2 * S
        assert await script.admitted_at(T0 + 30, "m:2:") is None
        await script.call("undo", T0 + 40, 1, "x:1:")
        assert await script.admitted_at(T0 + 50, "m:3:") == T0 + 50
        assert await script.admitted_at(T0 + 60, "m:4:") is None
        assert await script.admitted_at(T0 + 70, "m:5:", wait_us=wait) == T0 + 4 * S


async def test_the_undo_of_an_old_admission_credits_nothing(store_url: str, prefix: str) -> None:
    """TokenBucket(3/s, burst 1): an op admitted at 0 s is undone at 10 s (an undo that kept
    trying through an outage). Its slot ended at 1/3 s: nothing of it is still charged, so the
    undo must not free the unit admitted at 10 s. It did, before and since the old single-TAT
    code: the undo gave its weight back from the tail, and a second request went through
    1 ms after the first (found by a stress build's fuzzing)."""
    limit = TokenBucket(3, per=1, burst=1)
    async with Limiter(store_url, [limit], prefix=prefix) as limiter:
        script = Script(limiter, prefix, limit)
        assert await script.admitted_at(T0, "old:1:") == T0
        assert await script.admitted_at(T0 + 10 * S, "m:1:") == T0 + 10 * S
        assert (await script.call("undo", T0 + 10 * S + 1_000, 1, "old:1:"))[1] == 0
        assert await script.admitted_at(T0 + 10 * S + 2_000, "m:2:") is None


async def test_the_undo_of_an_admission_others_charged_after_frees_nothing(
    store_url: str, prefix: str
) -> None:
    """TokenBucket(1/s, burst 3): X (1 at 0 s, slot [0, 1)), Y (2 at 0.4 s, slot [1, 3)), two
    waiters queued, then X, the waiters undone. X's slot is behind Y's, which cannot move
    before 0.4 s, its own charge: crediting X at the tail (or at the top of the immediate
    admissions, as b5a0783 did) let 6 units through within 2.6 s, one more than the rate
    allows. Now only the last immediate admission's slot is known, and X credits nothing."""
    limit = TokenBucket(1, per=1, burst=3)
    async with Limiter(store_url, [limit], prefix=prefix) as limiter:
        script = Script(limiter, prefix, limit)
        wait = 30 * S
        assert await script.admitted_at(T0, "x:1:") == T0
        y = await script.admitted_at(T0 + 400_000, "y:1:", weight=2)
        assert y == T0 + 400_000
        assert await script.admitted_at(T0 + 401_000, "r1:1:", wait_us=wait) == T0 + S
        assert await script.admitted_at(T0 + 800_000, "r2:1:", 2, wait) == T0 + 3 * S
        for op in ("x:1:", "r2:1:", "r1:1:"):
            await script.call("undo", T0 + 1_050_000, 1 if op != "r2:1:" else 2, op)
        n1 = await script.admitted_at(T0 + 1_850_000, "n1:1:")
        n2 = await script.admitted_at(T0 + 1_900_000, "n2:1:", 3, wait)
    admitted = sorted([(y, 2), (n1, 1), (n2, 3)])
    for i, (start, _) in enumerate(admitted):
        total = 0
        for at, weight in admitted[i:]:
            total += weight
            assert total <= 3 + (at - start) / S, admitted


async def test_turns_past_the_cap_still_hold_their_slots(store_url: str, prefix: str) -> None:
    """MinInterval(1 s): 20 waiters queued (turns at 1..20 s; only the last 16 are recorded),
    then those 16 are undone. The 4 waiters left keep their turns: a newcomer, and the undo
    of an admission made before them, cannot take a slot before the 5th second. (Dropping the
    earliest turns from the record used to forget them: the next queue's plain block then
    covered their slots.)"""
    limit = MinInterval(1)
    async with Limiter(store_url, [limit], prefix=prefix) as limiter:
        script = Script(limiter, prefix, limit)
        wait = 60 * S
        assert await script.admitted_at(T0, "p:1:") == T0
        for i in range(1, 21):
            assert await script.admitted_at(T0 + i, f"w{i}:1:", wait_us=wait) == T0 + i * S
        for i in range(5, 21):
            await script.call("undo", T0 + 100 + i, 1, f"w{i}:1:")
        first = await script.admitted_at(T0 + 200, "n1:1:", wait_us=wait)
        await script.call("undo", T0 + 300, 1, "p:1:")  # an admission from before the queue
        second = await script.admitted_at(T0 + 400, "n2:1:", wait_us=wait)
        assert first == T0 + 5 * S
        assert second == T0 + 6 * S


async def test_the_queue_bookkeeping_stays_bounded(redis_url: str, prefix: str) -> None:
    """300 reservations queued and undone in every order: the field stays a few hundred bytes
    (at most 16 turns and 16 holes), and the limit still holds afterwards."""
    limit = MinInterval(1)
    rng = random.Random(7)
    async with Limiter(redis_url, [limit], prefix=prefix) as limiter:
        script = Script(limiter, prefix, limit)
        now = T0
        live: list[str] = []
        for i in range(300):
            now += 1_000
            op = f"c{i % 50}:{i}:"
            if await script.admitted_at(now, op, wait_us=3600 * S) is not None:
                live.append(op)
            if live and rng.random() < 0.5:
                await script.call("undo", now, 1, live.pop(rng.randrange(len(live))))
        redis = Redis.from_url(redis_url)
        try:
            fields = await redis.hgetall(main_key(prefix, "ip:1"))
        finally:
            await redis.aclose()
    state = next(value for name, value in fields.items() if name.startswith(b"g"))
    assert len(state) < 2_000, state
    assert state.count(b";r") <= 16 and state.count(b";h") <= 16


@pytest.mark.parametrize("burst", [1, 3])
async def test_undos_never_admit_more_than_the_rate(
    store_url: str, prefix: str, burst: int
) -> None:
    """Random programs of immediate and queued requests and undos (of any op, in any order,
    before or after its admission: an undone request never went through): the admission
    times of the requests left keep the rate, no interval [a, a + d] holding more than
    burst + d / T of them; and undos do give capacity back (more admitted than without)."""
    per = 1
    limit = TokenBucket(1, per=per, burst=burst)
    interval = per * S
    for seed in range(3):
        rng = random.Random(seed * 10 + burst)
        async with Limiter(store_url, [limit], prefix=f"{prefix}-{seed}") as limiter:
            script = Script(limiter, f"{prefix}-{seed}", limit)
            now = T0
            admitted: dict[int, int] = {}  # stamp -> admission time
            open_: list[int] = []  # stamps still undoable (their client awaits an outcome)
            undone = 0

            for stamp in range(1, 251):
                now += rng.choice((1, 1_000, 50_000, 200_000, 400_000))
                if rng.random() < 0.7 or not open_:
                    wait = rng.choice((0, 2 * S, 10 * S, 10 * S))
                    op = f"c:{stamp}:" + ",".join(map(str, open_))
                    at = await script.admitted_at(now, op, wait_us=wait)
                    if at is not None:
                        admitted[stamp] = at
                        open_ = [*open_, stamp][-30:]
                else:
                    victim = open_.pop(rng.randrange(len(open_)))
                    del admitted[victim]
                    undone += 1
                    undo = await script.call(
                        "undo",
                        now,
                        1,
                        f"c:{victim}:" + ",".join(map(str, sorted([*open_, victim]))),
                    )
                    assert undo[1] == 0, (seed, stamp, victim)
        times = sorted(admitted.values())
        for i, start in enumerate(times):
            for j in range(i, len(times)):
                span = times[j] - start
                assert j - i + 1 <= burst + span // interval, (seed, times[i : j + 1])
        # the capacity came back: more were admitted than the rate alone allows over the run
        assert len(times) + undone > burst + (now - T0) // interval, (len(times), undone)


async def test_refunds_keep_every_queued_turn(store_url: str, prefix: str) -> None:
    """Refunds (newest first) beside queued turns and holes: TAT never drops below the last
    queued turn, so no newcomer is admitted closer than T to a turn already given."""
    limit = MinInterval(1)
    async with Limiter(store_url, [limit], prefix=prefix) as limiter:
        script = Script(limiter, prefix, limit)
        wait = 30 * S
        assert await script.admitted_at(T0, "m:1:") == T0
        turns = [await script.admitted_at(T0 + 10 + i, f"w{i}:1:", wait_us=wait) for i in range(4)]
        assert turns == [T0 + (i + 1) * S for i in range(4)]
        await script.call("undo", T0 + 20, 1, "w1:1:")  # a hole at [2 s, 3 s)
        for _ in range(5):
            await script.call("refund", T0 + 30, 1)
        newcomers = [
            await script.admitted_at(T0 + 40 + i, f"n{i}:1:", wait_us=wait) for i in range(2)
        ]
        assert newcomers == [T0 + 2 * S, T0 + 5 * S]


class StressScript:
    """The same calls to a build of gcra.lua that records 1 turn and 1 hole (TURNS, HOLES):
    every cap path runs all the time. On Redis by EVAL, on memory:// by the embedded engine."""

    def __init__(self, url: str | None, prefix: str, limit: Any) -> None:
        source = decide_script().source
        old = "local TURNS, HOLES = 16, 16"
        assert old in source
        self.source = source.replace(old, "local TURNS, HOLES = 1, 1")
        self.redis = Redis.from_url(url) if url else None
        self.engine = EmbeddedStore() if url is None else None
        self.sha = self.engine.script_load(self.source) if self.engine else ""
        self.keys = [main_key(prefix, "ip:1")]
        self.block = ",".join(map(str, (1, 1, 0, *limit.wire)))

    async def call(
        self, mode: str, now: int, weight: int = 1, op: str = "", wait_us: int = 0
    ) -> list[int]:
        argv = [mode, now, weight, SLACK_MS, op, f"r{wait_us}" if wait_us else "", 1, self.block]
        if self.engine is not None:
            return list(self.engine.evalsha(self.sha, self.keys, argv))
        assert self.redis is not None
        return list(await self.redis.eval(self.source, 1, *self.keys, *argv))  # type: ignore[misc]


@pytest.mark.parametrize("backend", ["redis", "memory"])
async def test_a_stress_build_never_admits_more_than_the_rate(
    redis_url: str, prefix: str, backend: str
) -> None:
    """30 random programs (burst 1-3, rate 1 or 3 per second: fractional T; weights up to the
    burst; queued and immediate requests at the same µs or apart; undos of any op at any
    time) on the stress build: in every interval [a, a + d] the weight admitted and not
    undone stays within burst + d / T (times are µs, rounded up: 2 µs of slack). This found
    the undo of an old op freeing a later one's unit, and the block covering forgotten turns."""
    for seed in range(30):
        rng = random.Random(seed)
        burst, rate = rng.choice((1, 2, 3)), rng.choice((1, 3))
        limit = TokenBucket(rate, per=1, burst=burst)
        interval = S / rate
        script = StressScript(redis_url if backend == "redis" else None, f"{prefix}-{seed}", limit)
        now = T0
        admitted: dict[int, tuple[int, int]] = {}  # stamp -> (admitted at, weight)
        open_: list[int] = []
        try:
            for stamp in range(1, 301):
                now += rng.choice((0, 1, 1_000, 50_000, 200_000, 400_000))
                if rng.random() < 0.7 or not open_:
                    weight, wait = rng.randint(1, burst), rng.choice((0, 2 * S, 10 * S))
                    op = f"c:{stamp}:" + ",".join(map(str, open_))
                    reply = await script.call("acquire", now, weight, op, wait)
                    if reply[0] == 1:
                        assert reply[5] <= wait, reply
                        admitted[stamp] = (now + reply[5], weight)
                        open_ = [*open_, stamp][-30:]
                else:
                    victim = open_.pop(rng.randrange(len(open_)))
                    weight = admitted.pop(victim)[1]
                    op = f"c:{victim}:" + ",".join(map(str, sorted([*open_, victim])))
                    await script.call("undo", now, weight, op)
        finally:
            if script.redis is not None:
                await script.redis.aclose()
        times = sorted(admitted.values())
        for i, (start, _) in enumerate(times):
            total = 0
            for at, weight in times[i:]:
                total += weight
                assert total <= burst + (at - start + 2) / interval, (seed, burst, rate, times)


async def test_a_waiter_cancelled_before_its_turn_gives_the_turn_back(
    store_url: str, prefix: str
) -> None:
    """MinInterval(1 s) through the limiter: the token at 0 s, waiter A reserves 1 s and B 2 s;
    A is cancelled while it sleeps. Its op stays open until then, so its undo frees the turn
    at 1 s: a newcomer queued after that goes at 1 s, B keeps 2 s. (Before, the cancelled
    waiter's turn stayed charged and the newcomer went at 3 s.)"""
    clock = ManualClock(start=T0 / S)
    admitted: list[float] = []
    async with Limiter(store_url, [MinInterval(1)], prefix=prefix, clock=clock) as limiter:

        async def waiter() -> None:
            assert (await limiter.acquire("ip:1", timeout=10)).allowed
            admitted.append(round(clock.time() - T0 / S, 3))

        async def decided(count: int) -> None:
            while limiter.statistics().decisions < count:  # noqa: ASYNC110 - a plain counter
                await asyncio.sleep(0.001)

        await waiter()  # the token: at once
        a = asyncio.create_task(waiter())
        await decided(2)
        b = asyncio.create_task(waiter())
        await decided(3)
        a.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await a
        await asyncio.sleep(0.2)  # the undo runs in the background (a round trip)
        newcomer = asyncio.create_task(waiter())
        await decided(4)
        while not (b.done() and newcomer.done()):  # 0.1 s steps, letting the sleepers wake
            clock.advance(0.1)
            await asyncio.sleep(0.001)
        await asyncio.gather(b, newcomer)
    assert sorted(admitted) == [0.0, 1.0, 2.0], admitted
