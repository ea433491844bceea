"""The two-phase protocol (aiolimit/_protocol.py) alone, with an in-memory store.

No server: ``FakeSlots`` interprets the script's calling convention (lua/decide.lua) for plain
counters (one per identifier and limit, no time), op records included, and lets a test step
in before a call (another client racing between the phases, a lost reply). What is pinned
here is orchestration: which calls go out, in which phase, and what the final state is.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import pytest

from aiolimit import BackendUnavailable, Decision, Limit, Limiter
from aiolimit._calls import Call, Mode
from aiolimit._clock import ServerClock
from aiolimit._protocol import MAX_IN_FLIGHT, Protocol
from aiolimit._rules import Rules
from aiolimit._stores.base import Store

LIMITS = [Limit(3, per=60), Limit(5, per=3600)]
SLOTS = {"a": 1, "b": 2, "c": 3, "a2": 1, "g": 4}

Hook = Callable[[str, Call], None]


class LostReply(ConnectionError):
    """The call ran on the server but its reply never came back."""


class FakeSlots(Store):
    """Counters per (main key, limit) and op records, judged the way decide.lua judges."""

    address = "fake://"
    single_slot = False

    def __init__(self) -> None:
        self.retries_calls = True
        self.used: dict[tuple[str, str], int] = {}
        self.ops: dict[str, str] = {}  # op key -> 'A' applied, 'R' undone
        self.sent: list[tuple[str, str]] = []  # (mode, first identifier) in send order
        self.before: Hook | None = None
        self.after: Hook | None = None

    def pairs(self, call: Call) -> list[tuple[tuple[str, str], int]]:
        """(counter key, amount) per pair, in the order the reply lists them."""
        return [
            ((plan.keys[0], str(limit)), limit.amount)
            for plan in call.plans
            for limit in plan.limits
        ]

    def fill(self, identifier: str, rules: Rules) -> None:
        """Another client uses up every limit of ``identifier``."""
        plan = rules.plan(identifier)
        for limit in plan.limits:
            self.used[(plan.keys[0], str(limit))] = limit.amount

    def execute(self, call: Call) -> list[int]:
        mode, weight, op = str(call.args[0]), int(call.args[2]), str(call.args[4])
        if op:  # op records live per identifier: "<client>:<stamp>:<open>" -> its identity
            op = call.plans[0].keys[0] + "|" + op.rsplit(":", 1)[0]
        pairs = self.pairs(call)
        self.sent.append((mode, call.plans[0].identifier))
        if self.before is not None:
            self.before(mode, call)
        fits = [self.used.get(key, 0) + weight <= amount for key, amount in pairs]
        allowed, replay = all(fits), False
        if mode == "acquire":
            record = self.ops.get(op) if op else None
            if record is not None:
                allowed, replay = record == "A", True
            elif allowed:
                for key, _ in pairs:
                    self.used[key] = self.used.get(key, 0) + weight
                if op:
                    self.ops[op] = "A"
        elif mode == "undo":
            assert op, "undo needs an op id"
            if self.ops.get(op) == "A":
                for key, _ in pairs:
                    self.used[key] -= weight
            else:
                replay = True
            self.ops[op] = "R"
            allowed = True
        reply = [int(allowed), int(replay), 0]
        for (key, amount), fit in zip(pairs, fits, strict=True):
            reply += [int(fit), max(amount - self.used.get(key, 0), 0), 0, 0]
        if self.after is not None:
            self.after(mode, call)
        return reply

    def slot(self, key: str) -> int:
        return SLOTS[key.split("{")[1].split("}")[0]]

    async def delete(self, keys: Sequence[str]) -> None:
        raise NotImplementedError

    def default_clock(self) -> ServerClock:
        return ServerClock()

    async def aclose(self) -> None:
        return None

    async def run(self, calls: Sequence[Call]) -> list[list[int] | BaseException]:  # type: ignore[override]
        results: list[list[int] | BaseException] = []
        for call in calls:
            try:
                results.append(self.execute(call))
            except Exception as exc:
                results.append(exc)
        return results

    def modes(self) -> list[str]:
        return [mode for mode, _ in self.sent]


@pytest.fixture
def rules() -> Rules:
    return Rules(LIMITS, "p")


@pytest.fixture
def slots() -> FakeSlots:
    return FakeSlots()


def protocol(slots: FakeSlots, *, op_ids: bool = True) -> Protocol:
    slots.retries_calls = op_ids
    return Protocol(slots, ServerClock(), undo_patience=0.05)


async def test_one_slot_is_one_call_without_a_check_phase(slots: FakeSlots, rules: Rules) -> None:
    """Identifiers sharing a slot are decided by a single acquire call, no check phase."""
    proto = protocol(slots)
    decision = await proto.acquire(rules.plans(["a", "a2"]), 1)
    assert decision.allowed
    assert slots.modes() == ["acquire"]
    assert proto.statistics.single_slot == 1
    assert proto.statistics.multi_slot == 0


async def test_every_charging_call_carries_an_op_and_no_op_key(
    slots: FakeSlots, rules: Rules
) -> None:
    """A single-slot acquire carries an op "<client>:<stamp>:<open>" and no extra key; a check
    carries none."""
    seen: list[Call] = []
    slots.before = lambda mode, call: seen.append(call)
    proto = protocol(slots)
    await proto.acquire(rules.plans(["a"]), 1)
    await proto.decide(Mode.CHECK, rules.plans(["a"]), 1)
    acquire, check = seen
    client, stamp, open_ = str(acquire.args[4]).split(":")
    assert client == proto.ops.client and int(stamp) == 1 and open_ == ""
    assert acquire.keys == list(rules.plan("a").keys)
    assert check.args[4] == ""


async def test_all_slots_admitted_charges_every_slot_once(slots: FakeSlots, rules: Rules) -> None:
    """Across slots: check on every slot, then one commit per slot, and every pair charged."""
    proto = protocol(slots)
    decision = await proto.acquire(rules.plans(["a", "b", "c"]), 2)
    assert decision.allowed
    assert slots.modes() == ["check"] * 3 + ["acquire"] * 3
    assert set(slots.used.values()) == {2}
    assert len(slots.used) == 6


async def test_refusal_at_check_writes_nothing(slots: FakeSlots, rules: Rules) -> None:
    """One full slot refuses at check: no commit is sent and no slot changes."""
    slots.fill("b", rules)
    before = dict(slots.used)
    proto = protocol(slots)
    decision = await proto.acquire(rules.plans(["a", "b", "c"]), 1)
    assert not decision.allowed
    assert slots.modes() == ["check"] * 3
    assert slots.used == before
    assert proto.statistics.refused_at_check == 1
    assert proto.statistics.compensations == 0


async def test_refused_commit_undoes_the_other_slots(slots: FakeSlots, rules: Rules) -> None:
    """A commit refused after a passed check (a racing client) triggers undo on the slots
    that charged, and the final state equals "never happened"."""

    def race(mode: str, call: Call) -> None:
        if mode == "acquire" and call.plans[0].identifier == "b":
            slots.fill("b", rules)

    slots.before = race
    proto = protocol(slots)
    decision = await proto.acquire(rules.plans(["a", "b", "c"]), 1)
    assert not decision.allowed
    undone = sorted(ident for mode, ident in slots.sent if mode == "undo")
    assert undone == ["a", "c"]  # b refused, so it charged nothing and needs no undo
    full = {key: value for key, value in slots.used.items() if "{b}" not in key[0]}
    assert set(full.values()) == {0}
    assert proto.statistics.compensations == 1
    assert proto.statistics.compensation_errors == 0


async def test_error_mid_commit_undoes_then_raises(slots: FakeSlots, rules: Rules) -> None:
    """A commit whose reply is lost is undone with the others, then the error is raised."""

    def lose(mode: str, call: Call) -> None:
        if mode == "acquire" and call.plans[0].identifier == "c":
            raise LostReply("reply lost")

    slots.after = lose  # c's commit ran, only its reply is lost
    proto = protocol(slots)
    with pytest.raises(LostReply):
        await proto.acquire(rules.plans(["a", "b", "c"]), 1)
    assert sorted(ident for mode, ident in slots.sent if mode == "undo") == ["a", "b", "c"]
    assert set(slots.used.values()) == {0}
    assert proto.statistics.compensations == 1


async def test_undo_before_a_late_commit_blocks_it(slots: FakeSlots, rules: Rules) -> None:
    """An undo that overtakes its commit (the commit never arrived) tombstones the op: the
    late commit then charges nothing."""

    def never_arrives(mode: str, call: Call) -> None:
        if mode == "acquire" and call.plans[0].identifier == "b":
            raise LostReply("request lost on the way")

    slots.before = never_arrives
    proto = protocol(slots)
    late: list[Call] = []
    original = slots.execute

    def record(call: Call) -> list[int]:
        if call.args[0] == "acquire" and call.plans[0].identifier == "b":
            late.append(call)
        return original(call)

    slots.execute = record  # type: ignore[method-assign]
    with pytest.raises(LostReply):
        await proto.acquire(rules.plans(["a", "b"]), 1)
    slots.before = None
    reply = original(late[0])  # the lost commit finally reaches the server
    assert reply[:2] == [0, 1]  # refused, as a replay of a cancelled op
    assert set(slots.used.values()) == {0}


async def test_failed_undo_is_counted_and_raised(slots: FakeSlots, rules: Rules) -> None:
    """If compensation itself fails, compensation_errors counts it and the error surfaces."""

    def chaos(mode: str, call: Call) -> None:
        if mode == "acquire" and call.plans[0].identifier == "b":
            slots.fill("b", rules)
        if mode == "undo":
            raise BackendUnavailable("store gone")

    slots.before = chaos
    proto = protocol(slots)
    with pytest.raises(BackendUnavailable):
        await proto.acquire(rules.plans(["a", "b"]), 1)
    assert proto.statistics.compensations == 1
    assert proto.statistics.compensation_errors == 1


async def test_statistics_count_slots_per_call(slots: FakeSlots, rules: Rules) -> None:
    """slots_per_call histograms multi-slot decisions by their number of slots."""
    proto = protocol(slots)
    await proto.acquire(rules.plans(["a", "b"]), 1)
    await proto.acquire(rules.plans(["a", "b", "c"]), 1)
    await proto.acquire(rules.plans(["a", "a2"]), 1)
    stats = proto.statistics
    assert (stats.single_slot, stats.multi_slot) == (1, 2)
    assert stats.slots_per_call == {2: 1, 3: 1}


async def test_a_deadline_during_the_commit_still_undoes_every_slot(
    slots: FakeSlots, rules: Rules
) -> None:
    """Cancelled while its commits are in flight, a decision undoes them all, to zero."""
    import asyncio

    release = asyncio.Event()
    proto = protocol(slots)
    real_run = slots.run

    async def slow_commits(calls: Sequence[Call]) -> list[list[int] | BaseException]:
        results = await real_run(calls)  # the commits apply on the server ...
        if calls and calls[0].args[0] == "acquire":
            await release.wait()  # ... but their replies never arrive in time
        return results

    slots.run = slow_commits  # type: ignore[method-assign]
    plans = rules.plans(["a", "b", "c"])
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await proto.acquire(plans, 1)
    await asyncio.sleep(0)  # let the undo task run to completion
    for _ in range(5):
        if not proto._tasks:
            break
        await asyncio.sleep(0.01)
    assert slots.modes()[-3:] == ["undo", "undo", "undo"]
    assert all(count == 0 for count in slots.used.values())
    assert proto.statistics.compensations == 1
    release.set()


# --- charging calls in flight per identifier -----------------------------------------------


class HeldSlots(FakeSlots):
    """FakeSlots whose calls wait for a permit each (``let``), so a test sees how many are
    in flight at once. Checks (phase 1 across slots) go at once, unless ``hold_checks``
    names the identifier whose slot holds them (a frozen node)."""

    def __init__(self) -> None:
        super().__init__()
        self.permits = asyncio.Semaphore(0)
        self.running: dict[str, int] = {}
        self.most: dict[str, int] = {}
        self.hold_checks: str | None = None

    def let(self, count: int) -> None:
        for _ in range(count):
            self.permits.release()

    async def run(self, calls: Sequence[Call]) -> list[list[int] | BaseException]:  # type: ignore[override]
        if calls[0].mode is Mode.CHECK:
            held = [c for c in calls if c.plans[0].identifier == self.hold_checks]
            if held:
                await asyncio.Event().wait()  # (never answers: the caller's deadline ends it)
            return await super().run(calls)
        name = calls[0].plans[0].identifier
        self.running[name] = self.running.get(name, 0) + 1
        self.most[name] = max(self.most.get(name, 0), self.running[name])
        try:
            await self.permits.acquire()
        finally:
            self.running[name] -= 1
        return await super().run(calls)


async def _until(condition: Callable[[], bool]) -> None:
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("never happened")


async def test_a_burst_on_one_identifier_leaves_max_in_flight_at_a_time() -> None:
    """200 charging calls on "a" at once: MAX_IN_FLIGHT reach the store, the rest wait in
    this process and go as answers come back; a call on "b" meanwhile does not wait."""
    slots = HeldSlots()
    rules = Rules([Limit(10**6, per=60)], "p")
    proto = protocol(slots)
    burst = [asyncio.ensure_future(proto.acquire([rules.plan("a")], 1)) for _ in range(200)]
    await _until(lambda: slots.running.get("a") == MAX_IN_FLIGHT)
    other = asyncio.ensure_future(proto.acquire([rules.plan("b")], 1))
    await _until(lambda: slots.running.get("b") == 1)
    assert slots.running["a"] == MAX_IN_FLIGHT
    assert proto.statistics.waited_in_flight == 200 - MAX_IN_FLIGHT
    slots.let(201)
    decisions = await asyncio.gather(*burst, other)
    assert all(d.allowed for d in decisions)
    assert slots.most["a"] == MAX_IN_FLIGHT
    assert slots.used[(rules.plan("a").keys[0], str(Limit(10**6, per=60)))] == 200
    assert proto._in_flight == {} and proto._queued == {}


async def test_calls_stuck_in_their_check_take_no_place_on_their_other_identifiers() -> None:
    """Fault isolation: 200 calls on ["g", "b"] whose check never comes back from b's slot (a
    frozen node) hold no place among the calls in flight on "g": MAX_IN_FLIGHT calls on "g"
    alone, and a call on ["g", "c"], still go at once (they queued behind the stuck ones)."""
    slots = HeldSlots()
    slots.hold_checks = "b"
    rules = Rules([Limit(10**6, per=60)], "p")
    proto = protocol(slots)
    stuck = [asyncio.ensure_future(proto.acquire(rules.plans(["g", "b"]), 1)) for _ in range(200)]
    for _ in range(5):
        await asyncio.sleep(0)
    assert proto._in_flight == {}  # (no place taken, no op open)
    alone = [
        asyncio.ensure_future(proto.acquire([rules.plan("g")], 1)) for _ in range(MAX_IN_FLIGHT)
    ]
    await _until(lambda: slots.running.get("g") == MAX_IN_FLIGHT)
    assert proto.statistics.waited_in_flight == 0
    slots.let(MAX_IN_FLIGHT + 2)  # (those, then the commit of ["g", "c"] on each slot)
    assert all(d.allowed for d in await asyncio.gather(*alone))
    assert (await proto.acquire(rules.plans(["g", "c"]), 1)).allowed
    for task in stuck:
        task.cancel()
    await asyncio.gather(*stuck, return_exceptions=True)
    assert proto._in_flight == {} and proto._queued == {} and not proto._tasks  # nothing to undo


async def test_a_burst_on_two_identifiers_respects_each_ones_cap() -> None:
    """The same with two identifiers per call (``acquire`` takes both slots without waiting
    when both are free, else waits in line): MAX_IN_FLIGHT commits at a time (checks carry no
    op and write nothing: they are not held back); and a call whose second identifier is full
    waits, while a call on its first alone goes."""
    slots = HeldSlots()
    rules = Rules([Limit(10**6, per=60)], "p")
    proto = protocol(slots)
    pair = rules.plans(["a", "b"])
    burst = [asyncio.ensure_future(proto.acquire(pair, 1)) for _ in range(200)]
    await _until(lambda: slots.running.get("a") == MAX_IN_FLIGHT)
    for _ in range(5):
        await asyncio.sleep(0)
    assert slots.running["a"] == MAX_IN_FLIGHT
    assert proto.statistics.waited_in_flight == 200 - MAX_IN_FLIGHT
    slots.let(10**4)  # (a check and a commit per slot each)
    assert all(d.allowed for d in await asyncio.gather(*burst))
    assert slots.most["a"] == MAX_IN_FLIGHT
    assert proto._in_flight == {} and proto._queued == {}

    slots.permits = asyncio.Semaphore(0)  # (the permits left over)
    full = [
        asyncio.ensure_future(proto.acquire([rules.plan("b")], 1)) for _ in range(MAX_IN_FLIGHT)
    ]
    await _until(lambda: slots.running.get("b") == MAX_IN_FLIGHT)
    blocked = asyncio.ensure_future(proto.acquire(rules.plans(["c", "b"]), 1))
    alone = asyncio.ensure_future(proto.acquire([rules.plan("c")], 1))
    await _until(lambda: slots.running.get("c") == 1)
    assert len(proto._queued.get(rules.plan("b").keys[0], ())) == 1  # (the pair, on "b")
    slots.let(10**4)
    assert all(d.allowed for d in await asyncio.gather(*full, blocked, alone))
    assert proto._in_flight == {} and proto._queued == {}


async def test_callers_cancelled_in_line_give_their_place_up() -> None:
    """Callers cancelled while they wait in line (one of them just as a slot was handed to
    it) charge nothing, hold nothing, and the callers behind them still get through."""
    slots = HeldSlots()
    rules = Rules([Limit(10**6, per=60)], "p")
    proto = protocol(slots)
    plan = rules.plan("a")
    running = [asyncio.ensure_future(proto.acquire([plan], 1)) for _ in range(MAX_IN_FLIGHT)]
    await _until(lambda: slots.running.get("a") == MAX_IN_FLIGHT)
    waiting = [asyncio.ensure_future(proto.acquire([plan], 1)) for _ in range(6)]
    await _until(lambda: len(proto._queued.get(plan.keys[0], ())) == 6)
    for task in waiting[2:4]:  # two in the middle of the line leave it
        task.cancel()
    first = proto._queued[plan.keys[0]][0]
    slots.let(1)  # one call answered: its slot goes to the first in line ...
    await _until(first.done)
    waiting[0].cancel()  # ... which is cancelled before it could use it: the next one gets it
    slots.let(MAX_IN_FLIGHT + 6)
    results = await asyncio.gather(*running, *waiting, return_exceptions=True)
    done = results[MAX_IN_FLIGHT:]
    assert isinstance(done[0], asyncio.CancelledError)
    assert isinstance(done[2], asyncio.CancelledError) and isinstance(
        done[3], asyncio.CancelledError
    )
    assert all(getattr(done[i], "allowed", False) for i in (1, 4, 5))
    await proto.aclose()
    admitted = sum(bool(getattr(r, "allowed", False)) for r in results)
    assert slots.used[(plan.keys[0], str(Limit(10**6, per=60)))] == admitted
    assert proto._in_flight == {} and proto._queued == {}


# --- a user's clock that fails, and capacity given back while refusals are cached -------------


class FlipClock:
    """A user's clock: valid µs, or, while ``bad`` is set, 2**53 (no valid time: what a
    ManualClock advanced past 9e9 s reads); with ``once``, one bad reading clears ``bad``."""

    ttl_slack_ms = 1000
    sleep_margin = 0.000_5

    def __init__(self, *, once: bool = False) -> None:
        self.bad = False
        self.once = once

    async def now_us(self) -> int:
        if not self.bad:
            return time.time_ns() // 1000
        self.bad = not self.once
        return 2**53

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


@pytest.mark.parametrize("once", [False, True], ids=["stays-bad", "one-bad-reading"])
@pytest.mark.parametrize("how", ["race-lost", "commit-error"])
async def test_a_clock_failing_after_the_commits_does_not_stop_their_undo(
    slots: FakeSlots, rules: Rules, how: str, once: bool
) -> None:
    """A cross-slot acquire over a, b, c whose commits leave with a valid time; then the
    clock fails (for good, or once). b loses the race, or b's commit fails: a and c, which
    charged, are undone all the same (the undo is judged at the decision's time), and the
    caller hears the refusal or the commit's error, not a clock error."""
    clock = FlipClock(once=once)

    def before(mode: str, call: Call) -> None:
        if mode == "acquire" and call.plans[0].identifier == "b":
            clock.bad = True
            if how == "race-lost":
                slots.fill("b", rules)  # another client won b between the phases
            else:
                raise ConnectionError("b's commit failed")

    slots.before = before
    proto = Protocol(slots, clock, undo_patience=0.5)
    try:
        outcome: object = await proto.acquire(rules.plans(["a", "b", "c"]), 1)
    except Exception as error:
        outcome = error
    await asyncio.sleep(0.2)  # (a background undo, were there one, has had its turn)
    await proto.aclose()
    if how == "race-lost":
        assert isinstance(outcome, Decision) and not outcome.allowed, outcome
    else:
        assert isinstance(outcome, ConnectionError) and "b's commit" in str(outcome), outcome
    charged = {key: used for key, used in slots.used.items() if "{b}" not in key[0] and used}
    assert not charged, f"commits never undone: {charged}"


async def test_one_bad_clock_reading_does_not_abandon_a_background_undo(rules: Rules) -> None:
    """An acquire whose reply is lost is undone in the background; its first try meets one
    bad clock reading. The undo is tried again (as after any failure) and lands."""
    slots = FakeSlots()
    clock = FlipClock(once=True)

    def lose(mode: str, call: Call) -> None:
        if mode == "acquire":
            clock.bad = True  # the undo's first reading
            raise LostReply("reply lost")  # the acquire charged

    slots.after = lose
    proto = Protocol(slots, clock, undo_patience=2.0)
    with pytest.raises(LostReply):
        await proto.acquire(rules.plans(["a"]), 1)
    for _ in range(100):
        if set(slots.used.values()) == {0}:
            break
        await asyncio.sleep(0.02)
    await proto.aclose()
    assert set(slots.used.values()) == {0}, f"the undo was abandoned: {slots.used}"
    assert proto.statistics.compensation_errors == 0


class CachedSlots(FakeSlots):
    """FakeSlots whose refusals say "again in an hour" (so a limiter's refusal cache keeps
    them), and whose undo calls take ``undo_delay`` seconds to answer."""

    def __init__(self) -> None:
        super().__init__()
        self.undo_delay = 0.0

    def execute(self, call: Call) -> list[int]:
        reply = super().execute(call)
        at = 3
        for plan in call.plans:
            for _ in plan.limits:
                if reply[at] == 0:
                    reply[at + 2] = reply[at + 3] = 3_600_000_000
                at += 4
        return reply

    async def run(self, calls: Sequence[Call]) -> list[list[int] | BaseException]:  # type: ignore[override]
        if self.undo_delay and any(call.mode is Mode.UNDO for call in calls):
            await asyncio.sleep(self.undo_delay)
        return await super().run(calls)


async def test_a_refusal_cached_during_a_compensation_is_dropped_when_it_lands() -> None:
    """With ``cache_refusals``: a cross-slot acquire over a, b charges a, loses the race on
    b, and undoes a. A refusal of a made while that undo is on its way is true then and is
    cached (for an hour); once the undo lands the store admits a again, and so must the
    cache."""
    slots = CachedSlots()
    limits = [Limit(1, per=3600)]
    limiter = Limiter(slots, limits, prefix="p", cache_refusals=True, deadline=5.0)
    rules = Rules(limits, "p")

    def race(mode: str, call: Call) -> None:
        if mode == "acquire" and call.plans[0].identifier == "b":
            slots.fill("b", rules)

    slots.before = race
    slots.undo_delay = 0.3
    try:
        first = asyncio.ensure_future(limiter.try_acquire(["a", "b"]))
        await asyncio.sleep(0.1)  # a is charged; its undo is on its way
        meanwhile = await limiter.try_acquire("a")
        assert not meanwhile.allowed and not meanwhile.degraded  # the store's own refusal
        assert not (await first).allowed
        slots.before = None
        assert {v for k, v in slots.used.items() if "{a}" in k[0]} == {0}  # the undo landed
        again = await limiter.try_acquire("a")
        assert again.allowed, f"refused by the cache after the compensation landed: {again}"
    finally:
        await limiter.aclose()


async def test_a_cross_slot_call_that_queued_is_judged_at_a_fresh_time() -> None:
    """A call whose check passed, then queued for its place behind MAX_IN_FLIGHT charging
    calls, checks and commits at the time read after the wait: judged at the time before it,
    its charge would leave its window that much early. Without a wait, check and commit share
    one reading (test_cluster_node_faults: one reading per decision)."""
    from aiolimit.testing import ManualClock

    slots = HeldSlots()
    rules = Rules([Limit(10**6, per=60)], "p")
    clock = ManualClock(start=1_700_000_000.0)
    proto = Protocol(slots, clock, undo_patience=0.05)
    seen: list[Call] = []
    slots.before = lambda mode, call: seen.append(call)
    full = [
        asyncio.ensure_future(proto.acquire([rules.plan("g")], 1)) for _ in range(MAX_IN_FLIGHT)
    ]
    await _until(lambda: slots.running.get("g") == MAX_IN_FLIGHT)
    late = asyncio.ensure_future(proto.acquire(rules.plans(["g", "c"]), 1))
    await _until(lambda: any(call.mode is Mode.CHECK for call in seen))
    for _ in range(5):
        await asyncio.sleep(0)
    checked_at = next(call for call in seen if call.mode is Mode.CHECK).args[1]
    clock.advance(30)
    slots.let(10**4)
    assert all(d.allowed for d in await asyncio.gather(*full, late))
    commits = [call for call in seen if call.mode is Mode.ACQUIRE and len(call.plans) == 1]
    committed_at = {call.args[1] for call in commits if call.plans[0].identifier == "c"}
    assert checked_at == 1_700_000_000_000_000
    assert committed_at == {1_700_000_030_000_000}
