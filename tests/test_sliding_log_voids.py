"""The sliding log's voids: late undos and large refunds cost O(log n), and stay exact.

sliding_log.lua credits a late undo (one with more than REWRITE entries charged after it) and a
refund that reaches past CUT entries by recording the credited unit numbers as a void instead
of rewriting or deleting every entry at once; voided entries are deleted a bounded number per
call. These tests drive the script directly (op ids, undo, refund, peek at chosen times) and
compare every answer with the reference model (tests/reference.py), on Redis, Valkey,
memory:// and the cluster, then bound what one call costs on a real server.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from redis.asyncio import Redis
from reference import Log, Verdict

from aiolimit import Limiter, SlidingLog
from aiolimit._calls import Call, Mode, decide_script
from aiolimit._embedded.store import EmbeddedStore
from aiolimit._keys import aux_key, main_key

T0 = 1_700_000_000_000_000  # µs
SLACK_MS = 600_000  # keys outlive the test whatever the manual times


class Script:
    """Raw calls of lua/decide.lua for one identifier under one SlidingLog."""

    def __init__(self, limiter: Limiter, prefix: str, limit: SlidingLog) -> None:
        self.limiter = limiter
        self.limit = limit
        self.keys = [main_key(prefix, "ip:1"), aux_key(prefix, "ip:1", limit.aux_suffix)]
        self.block = ",".join(map(str, (2, 1, 2, *limit.wire)))

    async def call(self, mode: str, now: int, weight: int, op: str = "") -> list[int]:
        argv = [mode, now, weight, SLACK_MS, op, "", 1, self.block]
        (reply,) = await self.limiter.store.run([Call(Mode(mode), self.keys, argv, ())])
        assert not isinstance(reply, BaseException), reply
        return list(reply)


def verdict(reply: list[int]) -> Verdict:
    return Verdict(bool(reply[3]), reply[4], reply[5], reply[6])


def expected_peek(model: Log, now: int, weight: int) -> Verdict:
    """What peek answers: the decision for ``weight``, and when it allows, the state now."""
    answer = model.check(now, weight)
    if not answer.allowed:
        return answer
    state = model.check(now, 0)
    return Verdict(True, state.remaining, 0, state.reset_us)


async def run_program(script: Script, seed: int, steps: int) -> int:
    """A random program of charges, late undos and refunds, each followed by a peek compared
    with the model; returns how many undos and refunds took the void path (a lower bound)."""
    rng = random.Random(seed)
    limit = script.limit
    model = Log(limit.amount, round(limit.per * 1_000_000))
    now = T0
    stamp = 0
    pending: dict[str, tuple[int, int]] = {}  # undo client -> (charged at, weight)
    free_clients = [f"u{i}" for i in range(40)]
    client_stamps = dict.fromkeys(free_clients, 0)
    big = 0
    for step in range(steps):
        now += rng.choice((1, 50, 400, 2_000)) if rng.random() < 0.99 else 700_000
        roll = rng.random()
        where = f"seed {seed} step {step}"
        no_undo = (roll < 0.92 and not free_clients) or (0.92 <= roll < 0.97 and not pending)
        if roll < 0.82 or no_undo:
            stamp += 1
            weight = 1 if rng.random() < 0.8 else rng.randint(2, 4)
            reply = await script.call("acquire", now, weight, f"m:{stamp}:")
            admitted = model.check(now, weight).allowed
            assert bool(reply[0]) == admitted, where
            if admitted:
                model.charge(now, weight)
        elif roll < 0.92:
            client = free_clients.pop(rng.randrange(len(free_clients)))
            client_stamps[client] += 1
            weight = rng.randint(1, 5)
            op = f"{client}:{client_stamps[client]}:"
            reply = await script.call("acquire", now, weight, op)
            admitted = model.check(now, weight).allowed
            assert bool(reply[0]) == admitted, where
            if admitted:
                model.charge(now, weight)
                pending[client] = (now, weight)
            else:
                free_clients.append(client)
        elif roll < 0.97:
            # the oldest pending op most of the time: the latest undo, many charges after it
            clients = sorted(pending, key=lambda c: pending[c][0])
            client = clients[0] if rng.random() < 0.7 else rng.choice(clients)
            charged_at, weight = pending.pop(client)
            later = sum(1 for t in set(model.units) if t > charged_at)
            reply = await script.call("undo", now, weight, f"{client}:{client_stamps[client]}:")
            assert reply[1] == 0, where
            if charged_at > now - model.per:
                model.units = [t for t in model.units if t != charged_at]
            big += later > 32
            free_clients.append(client)
        else:
            weight = rng.randint(1, 40) if rng.random() < 0.5 else rng.randint(150, 320)
            entries_before = len(set(model.units))
            await script.call("refund", now, weight)
            model.refund(now, weight)
            big += entries_before - len(set(model.units)) > 128
        probe = rng.randint(1, limit.amount)
        got = verdict(await script.call("peek", now, probe))
        assert got == expected_peek(model, now, probe), (where, probe)
    return big


@pytest.mark.parametrize("seed", [1, 2])
async def test_voids_agree_with_the_reference_model(store_url: str, prefix: str, seed: int) -> None:
    """1,200 random steps per seed (charges, undos of ops with many charges after them,
    refunds of up to 320 entries, expiry): every peek answers what the model does."""
    limit = SlidingLog(300, per=3)
    async with Limiter(store_url, [limit], prefix=prefix) as limiter:
        big = await run_program(Script(limiter, prefix, limit), seed, 1_200)
    assert big >= 10, f"only {big} undos/refunds took the void path: the test lost its point"


async def test_a_refund_of_weight_zero_gives_nothing_back(store_url: str, prefix: str) -> None:
    """The script takes weight 0 (the Python API refuses it; decide_many's random programs send
    it): a refund of 0, with an op or without, leaves the log as it was. (Once, cutting the
    newest entry to itself added its own name and then removed it: all 3 units came back.)"""
    limit = SlidingLog(5, per=60)
    async with Limiter(store_url, [limit], prefix=prefix) as limiter:
        script = Script(limiter, prefix, limit)
        assert (await script.call("acquire", T0, 3, "c:1:"))[0] == 1
        await script.call("refund", T0 + 1000, 0)
        await script.call("refund", T0 + 2000, 0, "c:2:")
        assert verdict(await script.call("peek", T0 + 3000, 1)).remaining == 2


async def test_voids_agree_with_the_reference_model_on_the_cluster(
    redis_cluster_url: str, prefix: str
) -> None:
    """The same program through the cluster store (EVALSHA or FCALL on the slot's primary)."""
    limit = SlidingLog(300, per=3)
    async with Limiter(redis_cluster_url, [limit], prefix=prefix) as limiter:
        big = await run_program(Script(limiter, prefix, limit), 3, 800)
    assert big >= 5, f"only {big} undos/refunds took the void path: the test lost its point"


async def op_then_charges(script: Script, op: str, count: int, model: Log | None = None) -> int:
    """Charges 1 unit as ``op`` at T0, then ``count`` more 10 µs apart; returns the time."""
    now = T0
    await script.call("acquire", now, 1, op)
    for i in range(count):
        now += 10
        assert (await script.call("acquire", now, 1, f"m:{i + 1}:"))[0] == 1
        if model is not None:
            model.charge(now, 1)
    return now


async def test_a_refund_void_just_above_an_undo_void_stays_ordered(
    store_url: str, prefix: str
) -> None:
    """An op undone late (void (0, 1]), then a refund of every unit above it (void (1, 201],
    adjacent): the two must merge. Inserted out of order, the list kept a void above the
    newest entry once the swept entries were gone, and the next charges fell inside it: a
    peek after one more charge said 1000 left of 1000 (found by fuzzing with REWRITE = 0)."""
    limit = SlidingLog(1000, per=3600)
    model = Log(limit.amount, 3600 * 1_000_000)
    async with Limiter(store_url, [limit], prefix=prefix) as limiter:
        script = Script(limiter, prefix, limit)
        now = await op_then_charges(script, "u:1:", 200, model) + 10
        await script.call("undo", now, 1, "u:1:")  # 200 entries after it: a void
        await script.call("refund", now, 200)  # 200 entries above y = 1: a void
        model.refund(now, 200)
        for i in range(5):
            now += 10
            assert (await script.call("acquire", now, 1, f"m:{300 + i}:"))[0] == 1
            model.charge(now, 1)
            assert verdict(await script.call("peek", now, 1)) == expected_peek(model, now, 1)
        await script.call("refund", now, 2)
        model.refund(now, 2)
        assert verdict(await script.call("peek", now, 1)) == expected_peek(model, now, 1)


class StressScript:
    """The same calls, to a build of the script whose thresholds make every late undo and
    every refund take the void path and sweep one entry a call (REWRITE = 0, CUT = 0,
    SWEEP = 1): the void code runs on nearly every step, with small amounts. On Redis by EVAL
    of that build, on memory:// by the embedded engine."""

    def __init__(self, url: str | None, prefix: str, limit: SlidingLog) -> None:
        source = decide_script().source
        for name, value in (("REWRITE", 32), ("CUT", 128), ("SWEEP", 128)):
            old = f"local {name} = {value} "
            assert old in source, old
            source = source.replace(old, f"local {name} = {0 if name != 'SWEEP' else 1} ")
        self.source = source
        self.redis = Redis.from_url(url) if url else None
        self.engine = EmbeddedStore() if url is None else None
        self.sha = self.engine.script_load(source) if self.engine else ""
        self.keys = [main_key(prefix, "ip:1"), aux_key(prefix, "ip:1", limit.aux_suffix)]
        self.block = ",".join(map(str, (2, 1, 2, *limit.wire)))

    async def call(self, mode: str, now: int, weight: int, op: str = "") -> list[int]:
        argv = [mode, now, weight, SLACK_MS, op, "", 1, self.block]
        if self.engine is not None:
            return list(self.engine.evalsha(self.sha, self.keys, argv))
        assert self.redis is not None
        reply = await self.redis.eval(self.source, len(self.keys), *self.keys, *argv)  # type: ignore[misc]
        return list(reply)


async def run_small_program(script: Any, model: Log, seed: int, steps: int) -> None:
    """Charges (several at one µs, which merge into one entry), undos of ops in any order,
    refunds of up to twice the amount, each followed by peeks compared with the model."""
    rng = random.Random(seed)
    now, stamp = T0, 0
    free = [f"u{i}" for i in range(30)]
    stamps = dict.fromkeys(free, 0)
    pending: dict[str, tuple[int, int]] = {}
    for step in range(steps):
        now += rng.choice((0, 0, 1, 10, 1_000, 50_000, 300_000))
        roll = rng.random()
        where = f"seed {seed} step {step}"
        if roll < 0.7 and (roll < 0.5 or free):
            weight = rng.randint(1, model.amount)
            if roll < 0.5:
                stamp += 1
                client, op = "", f"m:{stamp}:"
            else:
                client = free.pop(rng.randrange(len(free)))
                stamps[client] += 1
                op = f"{client}:{stamps[client]}:"
            admitted = model.check(now, weight).allowed
            assert bool((await script.call("acquire", now, weight, op))[0]) == admitted, where
            if admitted:
                model.charge(now, weight)
                if client:
                    pending[client] = (now, weight)
            elif client:
                free.append(client)
        elif roll < 0.85 and pending:
            client = rng.choice(list(pending))
            charged_at, weight = pending.pop(client)
            await script.call("undo", now, weight, f"{client}:{stamps[client]}:")
            if charged_at > now - model.per:
                for _ in range(min(weight, model.units.count(charged_at))):
                    model.units.remove(charged_at)
            free.append(client)
        else:
            weight = rng.randint(1, 2 * model.amount)
            await script.call("refund", now, weight)
            model.refund(now, weight)
        for probe in (1, rng.randint(1, model.amount)):
            got = verdict(await script.call("peek", now, probe))
            assert got == expected_peek(model, now, probe), (where, probe)


@pytest.mark.parametrize("backend", ["redis", "memory"])
async def test_voids_on_every_step_agree_with_the_model(
    redis_url: str, prefix: str, backend: str
) -> None:
    """12 programs of 300 steps, amounts 1 to 200, on the stress build: every answer is the
    model's. (This found the misordered merge of adjacent voids.)"""
    for seed in range(12):
        amount = (1, 2, 3, 5, 40, 200)[seed % 6]
        limit = SlidingLog(amount, per=1)
        script = StressScript(redis_url if backend == "redis" else None, f"{prefix}-{seed}", limit)
        try:
            await run_small_program(script, Log(amount, 1_000_000), seed, 300)
        finally:
            if script.redis is not None:
                await script.redis.aclose()


async def _entries(url: str, prefix: str, limit: Any) -> int:
    redis = Redis.from_url(url)
    try:
        return int(await redis.zcard(aux_key(prefix, "ip:1", limit.aux_suffix)))
    finally:
        await redis.aclose()


async def test_a_refund_of_10000_entries_costs_under_a_millisecond(
    redis_url: str, prefix: str
) -> None:
    """SlidingLog(10**4 per hour) full with 10,000 entries: refunds of 9,000 and then of every
    entry but one, undos of the oldest ops: no script call over 1 ms (SLOWLOG), and the voided
    entries are gone after a few more calls. The 9,000-entry refund alone took ~1.35 ms when it
    deleted every entry at once."""
    limit = SlidingLog(10_000, per=3600)

    async def attempt(prefix: str) -> tuple[int, int]:
        """(the slowest script call in µs, the entries left) for one run of the scenario."""
        redis = Redis.from_url(redis_url)
        async with Limiter(redis_url, [limit], prefix=prefix) as limiter:
            script = Script(limiter, prefix, limit)
            now = await op_then_charges(script, "u1:1:", 9_999)
            assert await _entries(redis_url, prefix, limit) == 10_000
            await redis.config_set("slowlog-log-slower-than", 1000)
            await redis.slowlog_reset()
            now += 10
            assert (await script.call("refund", now, 9_000))[4] == 9_000  # remaining after it
            assert (await script.call("undo", now, 1, "u1:1:"))[4] == 9_001
            for _ in range(80):  # the voided entries leave SWEEP per call
                now += 10
                assert (await script.call("acquire", now, 1, f"m:{10_000 + _}:"))[0] == 1
                assert (await script.call("refund", now, 1))[4] == 9_001
            assert (await script.call("peek", now, 1))[4] == 9_001
            slow = await redis.slowlog_get(10)
            worst = max((entry["duration"] for entry in slow), default=0)
            await redis.config_set("slowlog-log-slower-than", 10_000)
            entries = await _entries(redis_url, prefix, limit)
        await redis.aclose()
        return worst, entries

    # SLOWLOG times a call by the wall clock: a server descheduled mid-call (two cores shared
    # with the client and other servers) shows a spike that a second run does not repeat.
    # A call whose cost grows with the log is over 1 ms in every run.
    worsts = []
    for run in range(3):
        worst, entries = await attempt(f"{prefix}{run}")
        # 999 entries hold the live units; the undone op's entry stays, voided, until it leaves
        assert entries == 1000, f"{entries} entries left for 999 live units"
        worsts.append(worst)
        if worst < 1000:
            break
    assert min(worsts) < 1000, f"the slowest script call ran {worsts} µs in each run"
