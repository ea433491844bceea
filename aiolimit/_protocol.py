"""The decision protocol: one atomic call per slot, two phases across slots, and every undo.

The protocol owns the orchestration of a decision; the store only sends calls
(``aiolimit._stores.base.Store.run``), so all of this is tested without a server.

- One slot (standalone Redis, the embedded store, or a cluster call whose identifiers share a
  slot): a single atomic call decides and charges.
- Several slots (Redis Cluster):
  1. check: a read-only call per slot, all concurrently. Any refusal ends the decision; nothing
     was written anywhere.
  2. commit: an ``acquire`` per slot with one operation id, concurrently; each re-checks and
     charges atomically and records the op.
  3. compensate: if a commit was refused (another client won the race between the phases) or
     failed, every slot whose commit may have charged is sent an ``undo`` of that op. An undo
     credits exactly what the op charged there, once, and tombstones the op so a late commit
     cannot charge. The final state equals "never happened".

**What the caller was told is what is stored.** The argument, case by case:

- Every charging call carries an op (``aiolimit._ops``): this limiter's id, a stamp, and the
  stamps of its older ops on the same identifiers that are still *open* (sent, outcome not
  known). The script applies an op at most once per identifier: it records ``<stamp>@<time>``
  when the op charges there, replays (charges nothing) when it sees the op again, and refuses
  an op that was undone there or whose stamp is below the oldest open one (its client has
  settled it). It keeps only what is open, so a key holds no more entries than its limiter
  has calls in flight or undos pending, whatever the request rate (no key per decision).
- Admitted and told so: the reply came back; the op is settled (later calls ack past it).
- Refused: nothing was charged (a refused call records nothing); settled.
- Any failure (store error, the deadline, a cancellation, a degraded answer): the op may have
  charged, or may charge later (reply lost; a stopped server that runs it when resumed; a
  call still in a socket). ``acquire`` hands it to ``_settle``, which sends ``undo`` for it
  until the store answers: an undo credits exactly what the op charged (at the time it
  charged), once, and leaves a tombstone, so a copy of the op arriving after it charges
  nothing. Only once the undo is answered is the op settled; later calls then ack past it,
  which keeps refusing any late copy after the tombstone is dropped. A store that stays
  unreachable is retried with backoff for ``UNDO_PATIENCE`` seconds (each attempt bounded by
  ``UNDO_BUDGET``); when it comes back within that time the state converges to "never
  happened". Past it (or when the limiter is closed first) the op is given up, logged and
  counted in ``compensation_errors``: a charge it made then stays until it expires, erring on
  the side of refusing, never of admitting.
- A client that resends a call by itself (redis-py's retry after a lost reply) resends the
  same op: it replays. So does the cluster store's own retry.
- Cross-slot: the check phase writes nothing. A commit refused by one slot (another client won
  the race) is compensated at once on the slots that charged; a commit that failed anywhere is
  compensated on every slot that did not refuse before the caller hears of the error, and
  settled in the background if that compensation fails too.

Residual limits, stated: the ledger lives in the identifier's key, so it lasts as long as the
key does (a window past its last write at least, ``OP_RETENTION_MS`` of ``lua/prelude.lua``
after an undo). A copy of an op held up somewhere for longer than that would find no ledger
and be applied; a request does not sit in a TCP connection that long in practice. And an undo
acknowledged by a primary that dies before replicating it is lost with that primary: Redis
without ``WAIT`` gives no stronger guarantee.

**Every undo lives here**, in one set of background tasks: compensation of a cross-slot
commit, the cleanup of a lease-taking call whose caller went away or failed (its lease may
have been taken), and lease releases. Such work must finish even when the decision that
started it is cancelled or out of time.

Cancellation vocabulary (one, asyncio's, everywhere in aiolimit): a decision's deadline is an
``asyncio.timeout``; work that must outlive its caller is an ``asyncio`` task in
``Protocol._tasks``, awaited through ``asyncio.shield`` so that a cancelled caller stops waiting
but never stops the work; such a task sets a deadline of its own (``UNDO_BUDGET``) in
``aiolimit._deadline`` and runs under its own ``asyncio.timeout``. ``aclose`` waits for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import operator
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from aiolimit._calls import (
    ACQUIRE,
    CHECK,
    REFUND,
    RELEASE,
    RENEW,
    UNDO,
    Call,
    Mode,
    RawReply,
    Reply,
    allows,
    decision,
    decode,
    encode,
    replies_decision,
    reply_decision,
)
from aiolimit._clock import Clock, ServerClock
from aiolimit._deadline import DECISION_DEADLINE, current_deadline
from aiolimit._decision import Charge, Decision
from aiolimit._errors import BackendUnavailable, ConfigurationError
from aiolimit._lease import Lease
from aiolimit._ops import Op, OpLedger
from aiolimit._retry import backoff
from aiolimit._rules import IdentifierPlan
from aiolimit._stores.base import Store, clear_unsent, was_unsent


@dataclass(frozen=True, slots=True)
class Turn:
    """A reserved turn whose op is kept open while its caller waits for it."""

    plans: Sequence[IdentifierPlan]
    weight: int
    op: Op
    keys: list[str]


#: Set by ``Limiter.acquire`` around a decision that may reserve a turn: ``acquire`` below
#: appends the turn it reserved, and leaves its op open for the caller to end.
HELD_TURNS: ContextVar[list[Turn] | None] = ContextVar("aiolimit_held_turns", default=None)


class KeepOpen(list[Turn]):
    """Set as ``HELD_TURNS`` around a decision whose admission takes units ahead (a prefetched
    allowance, ``aiolimit._prefetch``): its op is kept open whatever its delay, for the
    allowance to give back what it does not use (``Protocol.give_back``). ``replayed``: the
    admission came from a replay (a resent copy of an op that had run already): its pairs
    report the time of the replay, not the time the op charged."""

    replayed = False


def _note_replay(raw: Sequence[int]) -> None:
    """Tells a ``KeepOpen`` holder that an acquire's reply was a replay."""
    if raw[1] == 1:
        held = HELD_TURNS.get()
        if type(held) is KeepOpen:
            held.replayed = True


T = TypeVar("T")
logger = logging.getLogger("aiolimit")

#: Charging calls (acquire, refund) of this limiter in flight at once on one identifier; more
#: wait in this process until one is answered. An op names the older ops still open on its
#: identifiers, and the script keeps every entry from the oldest of them on: a burst of
#: thousands of calls on one identifier, all sent before any reply, would each pay for a
#: ledger of thousands of entries (2,500 calls: ~225 µs of server time each against ~25 for
#: a lone call). Held back here, the calls that leave later name newer open ops, and the
#: ledger stays about this size. Other identifiers never wait for a busy one.
MAX_IN_FLIGHT = 128

#: Seconds one attempt of an undo (or a lease release) may take once its caller is gone.
UNDO_BUDGET = 5.0
#: Seconds a refused call waits at most for the release of the leases it took across slots
#: (``_release_refused``), and before the decision's deadline at the latest (at most a tenth of
#: the time left). A release answers in a round trip; one that does not is left to finish in
#: the background: a refusal already made is not held near the deadline, where a stalled
#: event loop would let the deadline cut it (and the failure policy answer instead).
RELEASE_WAIT = 0.1
RELEASE_MARGIN = 0.05
#: Seconds an undo is retried while the store does not answer. A stopped or partitioned
#: server that comes back within it ends up exactly as if the failed decision never happened.
UNDO_PATIENCE = 300.0


#: Seconds a cross-slot check phase may take before its commit reads the clock again. The
#: commit reuses the time the check read (a TIME authority is asked once per decision); after
#: a slow check (a node busy, a call retried through a failover) that time is seconds old, and
#: the charge would be judged then: it would leave its window that much early. Measured on
#: the clock's own ``monotonic`` (a manual clock's time moves only when told to).
STALE_CHECK = 0.02

#: A time the scripts store exactly: whole µs below 2**53 (Lua numbers are doubles).
MAX_NOW_US = 2**53
#: ``decide``'s ``now_us`` when the call has not read the clock yet (no valid time).
READ_CLOCK = -1


class ClockError(ConfigurationError):
    """A clock's ``now_us()`` gave no valid time. ``decide`` reads the clock before it sends
    anything, so an acquire or refund that meets this error has nothing to undo or finish."""


async def client_now(clock: Clock) -> int | None:
    """``clock.now_us()``, checked: whole µs since the epoch in [0, 2**53), or None (the
    script reads its server's TIME)."""
    now = await clock.now_us()
    if now is None or (type(now) is int and 0 <= now < MAX_NOW_US):
        return now
    if not isinstance(now, bool):  # an int subclass, an IntEnum, a numpy integer: its value
        try:
            value = operator.index(now)
        except TypeError:
            pass
        else:
            if 0 <= value < MAX_NOW_US:
                return value
    raise ClockError(
        f"{clock!r}.now_us() returned {now!r}: a clock must return None (the server's TIME) "
        f"or whole microseconds since the epoch, an int in [0, 2**53)"
    )


@dataclass(slots=True)
class ProtocolStatistics:
    """How often the cross-slot path ran, and how often it had to undo a commit."""

    single_slot: int = 0
    multi_slot: int = 0
    refused_at_check: int = 0
    compensations: int = 0
    compensation_errors: int = 0
    slots_per_call: dict[int, int] = field(default_factory=dict)
    #: Charging calls that waited because ``MAX_IN_FLIGHT`` calls were in flight on one of
    #: their identifiers.
    waited_in_flight: int = 0


def group_by_slot(plans: Sequence[IdentifierPlan], slot_of: Any) -> list[Sequence[IdentifierPlan]]:
    groups: dict[int, list[IdentifierPlan]] = {}
    for plan in plans:
        groups.setdefault(slot_of(plan.keys[0]), []).append(plan)
    return list(groups.values())


def _as_is(reply: Reply, weight: int) -> Reply:
    """An allowing slot's reply within a refused call across slots, its pairs' remaining as
    stored (a check, or a commit since undone, reports it after the charge: ``weight`` less,
    for every algorithm), as one call over every slot reports an allowing pair when another
    refuses. Their reset_after stays the one after the charge."""
    pairs = tuple(pair._replace(remaining=pair.remaining + weight) for pair in reply.pairs)
    return Reply(reply.allowed, reply.replay, reply.now_us, pairs)


def _refusal(replies: Sequence[Reply], weight: int) -> Decision:
    """The refusal of a call across slots, from each slot's reply."""
    return _merge([_as_is(reply, weight) if reply.allowed else reply for reply in replies])


def _merge(replies: Sequence[Reply]) -> Decision:
    if len(replies) == 1:
        return decision(replies[0])
    pairs = tuple(pair for reply in replies for pair in reply.pairs)
    return decision(Reply(all(r.allowed for r in replies), False, 0, pairs))


def _first_error(results: Sequence[RawReply | BaseException]) -> BaseException | None:
    """The error to raise for ``results``: a slot that did not answer (or answered what any
    call gets now, ``store_wide``) before one that answered with an error about its own keys.
    The failure policy counts only the former against its node's breaker, and records the
    latter as the store being up: raised in its place, a clobbered key on one node would pass
    for the success of a silent node in the same decision, whose breaker then never opens."""
    first = None
    for result in results:
        if not isinstance(result, BaseException):
            continue
        if isinstance(result, BackendUnavailable) or getattr(result, "store_wide", False):
            return result
        if first is None:
            first = result
    return first


class Protocol:
    """Decides over any set of identifier plans on ``store``, judged by ``clock``.

    ``undo_patience`` bounds, in seconds, how long an undo is retried while the store does
    not answer; past it the op is given up (logged, counted in ``compensation_errors``).
    """

    def __init__(
        self, store: Store, clock: Clock, *, penalty: bool = False,
        undo_patience: float = UNDO_PATIENCE,
    ) -> None:  # fmt: skip
        self._store = store
        self._clock = clock
        # Each script reads its server's TIME: no clock to ask on a decision's path.
        self._server_time = type(clock) is ServerClock
        self._slack_ms = clock.ttl_slack_ms
        self._penalty = penalty
        self._patience = undo_patience
        self.ops = OpLedger()
        self.statistics = ProtocolStatistics()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = False  # (aclose has begun: no new background work)
        #: Seconds a lease renewal may take (the limiter's deadline; None: unbounded). It is
        #: no decision, but a store opened for a deadline has no socket timeout of its own.
        self.renew_deadline: float | None = None
        #: Called with the plans of an undo (a cross-slot compensation, or one finished in
        #: the background) or of a refund finished in the background, once the store has
        #: answered it: capacity may have come back while refusals were being cached, and
        #: the limiter's refusal cache drops what it holds for them.
        self.on_given_back: Callable[[Sequence[IdentifierPlan]], None] | None = None
        self._release_waiters: set[asyncio.Future[None]] = set()
        #: Leases this process released so far: a waiter compares it before and after its
        #: call, so a release whose wake-up came before it waited is not missed.
        self.releases = 0
        # Charging calls in flight per main key, and the calls waiting for one of them.
        self._in_flight: dict[str, int] = {}
        self._queued: dict[str, deque[asyncio.Future[None]]] = {}

    # --- the calls --------------------------------------------------------------------------

    def _groups(self, plans: Sequence[IdentifierPlan]) -> list[Sequence[IdentifierPlan]]:
        if self._store.single_slot:
            return [plans]
        return group_by_slot(plans, self._store.slot)

    def _calls(
        self, mode: Mode, groups: Sequence[Sequence[IdentifierPlan]], weight: int,
        now_us: int | None, op: Op | None = None, max_wait_us: int = 0,
    ) -> list[Call]:  # fmt: skip
        slack, penalty = self._slack_ms, self._penalty
        wire = "" if op is None else op.wire
        calls = [
            encode(mode, group, weight, now_us, slack, wire, penalty, max_wait_us)
            for group in groups
        ]
        if now_us is not None:  # (a time of the client's: a call sent again later moves it on)
            monotonic = self._clock.monotonic
            read_at = monotonic()
            for call in calls:
                call.monotonic, call.read_at = monotonic, read_at
        return calls

    async def _raw_replies(self, calls: Sequence[Call]) -> list[RawReply]:
        results = await self._store.run(calls)
        error = _first_error(results)
        if error is not None:
            raise error
        return results  # type: ignore[return-value]

    # --- decisions --------------------------------------------------------------------------

    async def decide(
        self, mode: Mode, plans: Sequence[IdentifierPlan], weight: int, op: Op | None = None,
        max_wait_us: int = 0, *, checked: bool = False, now_us: int | None = -1,
        groups: Sequence[Sequence[IdentifierPlan]] | None = None,
    ) -> Decision:  # fmt: skip
        """Runs ``mode`` (see ``lua/decide.lua``) over every plan, all or nothing.

        ``max_wait_us`` > 0 lets queueable (GCRA) pairs reserve a turn within that wait; the
        delay comes back as the pairs' ``retry_after`` on an allowed decision. An acquire
        needs an ``op``; ``acquire`` is the safe way to make one. ``checked``: an acquire
        across slots whose check phase allowed already (``_check_phase``): commit at once.
        ``now_us``: the time to judge by when the call has read it already (a TIME
        authority is then asked once per decision); ``READ_CLOCK`` (-1): read it here.
        ``groups``: ``plans`` grouped by slot, when the caller has grouped them already.
        """
        if now_us == READ_CLOCK:
            now_us = None if self._server_time else await client_now(self._clock)
        if self._store.single_slot:
            # The common path, written out: one call, one reply.
            self.statistics.single_slot += 1
            call = encode(
                mode, plans, weight, now_us, self._slack_ms, "" if op is None else op.wire,
                self._penalty, max_wait_us,
            )  # fmt: skip
            result = await self._store.run_one(call)
            if isinstance(result, BaseException):
                raise result
            if mode is ACQUIRE:
                _note_replay(result)
            return reply_decision(call, result)
        if groups is None:
            groups = self._groups(plans)
        if len(groups) == 1:
            self.statistics.single_slot += 1
            calls = self._calls(mode, groups, weight, now_us, op, max_wait_us)
            raws = await self._raw_replies(calls)
            if mode is ACQUIRE:
                _note_replay(raws[0])
            return replies_decision(calls, raws)
        self._count_slots(len(groups))
        if mode is not ACQUIRE:
            # check, refund and undo touch each slot independently.
            calls = self._calls(mode, groups, weight, now_us, op, max_wait_us)
            return replies_decision(calls, await self._raw_replies(calls))
        assert op is not None
        return await self._two_phase(groups, weight, now_us, op, max_wait_us, checked=checked)

    async def acquire(
        self, plans: Sequence[IdentifierPlan], weight: int, max_wait_us: int = 0
    ) -> Decision:
        """Admits and charges, or charges nothing; an admission under a ``Concurrency`` limit
        carries its ``Lease``.

        What the caller is told is what is stored. If the call fails in any way (a store
        error, the deadline, a cancellation) it may still have charged, or may charge later
        (a reply lost after the server ran it; a stopped server that runs it when resumed).
        So its op is undone in the background until the store answers: the undo credits
        exactly what the op charged, or, if the op has not run, blocks it, and once the undo
        is answered every later call acks past the op, so a copy arriving later still charges
        nothing. A client that resends a call by itself resends the same op, which replays.
        """
        checked = False  # (across slots: the check phase allowed already)
        now_us: int | None = READ_CLOCK  # (read for the check phase: the commit's time too)
        groups: list[Sequence[IdentifierPlan]] | None = None  # (by slot, once grouped)
        if len(plans) == 1:
            key = plans[0].keys[0]
            keys = [key]
            in_flight = self._in_flight
            count = in_flight.get(key, 0)
            if count < MAX_IN_FLIGHT and key not in self._queued:
                in_flight[key] = count + 1  # (``_enter`` without a wait, written out)
                slots = keys
            else:
                slots = await self._enter(keys)
        else:
            keys = [plan.keys[0] for plan in plans]
            if not self._store.single_slot and not self._penalty:
                groups = self._groups(plans)
                if len(groups) > 1:
                    # Across slots the check phase comes first, before this call takes its
                    # places among the calls in flight on its keys and opens its op: checks
                    # write nothing and carry no op, and a call stuck there (a frozen node)
                    # must not hold a place on its other keys, which healthy calls on them
                    # would queue for (fault isolation). A refusal ends the call here.
                    now_us = None if self._server_time else await client_now(self._clock)
                    began = self._clock.monotonic()
                    refused = await self._check_phase(groups, weight, max_wait_us, now_us)
                    if refused is not None:
                        self._count_slots(len(groups))
                        return refused
                    checked = True
                    if now_us is not None and self._clock.monotonic() - began > STALE_CHECK:
                        now_us = READ_CLOCK  # (the commit re-checks at the time it reads)
            in_flight, queued = self._in_flight, self._queued
            for key in keys:
                if in_flight.get(key, 0) >= MAX_IN_FLIGHT or key in queued:
                    slots = await self._enter(keys)
                    # It queued behind other commits: what its check read is stale by now,
                    # so the commit checks again first (else each of a burst's calls that
                    # passed on the state before the burst commits, and is compensated), at
                    # a time read again (a charge judged at the time before the wait would
                    # leave its window that much early).
                    checked = False
                    if now_us is not None:
                        now_us = READ_CLOCK
                    break
            else:
                if len(set(keys)) == len(keys):
                    for key in keys:  # (``_enter`` without a wait, written out)
                        in_flight[key] = in_flight.get(key, 0) + 1
                    slots = keys
                else:
                    slots = await self._enter(keys)
        try:
            op = self.ops.open(keys)
            try:
                if self._server_time and self._store.single_slot:
                    # ``decide``'s common path, written out here: one coroutine fewer.
                    self.statistics.single_slot += 1
                    call = encode(
                        ACQUIRE, plans, weight, None, self._slack_ms, op.wire, self._penalty,
                        max_wait_us,
                    )  # fmt: skip
                    reply = await self._store.run_one(call)
                    if isinstance(reply, BaseException):
                        raise reply
                    if reply[1] == 1:
                        _note_replay(reply)
                    result = reply_decision(call, reply)
                elif now_us != READ_CLOCK or groups is not None:
                    # (one read of the clock, a TIME authority's; the slots grouped once)
                    result = await self.decide(
                        ACQUIRE, plans, weight, op, max_wait_us, checked=checked,
                        now_us=now_us, groups=groups,
                    )  # fmt: skip
                else:
                    result = await self.decide(ACQUIRE, plans, weight, op, max_wait_us)
            except BaseException as error:
                if (
                    getattr(error, "_aiolimit_undone", None) == op.stamp
                    or isinstance(error, ClockError)
                    or was_unsent(error)
                ):
                    self.ops.settle(keys, op)  # the two phases undid it, or nothing was sent
                else:
                    self._spawn(self._settle(plans, weight, op, keys))
                raise
        finally:
            self._leave(slots)
        held = HELD_TURNS.get()
        if (
            held is not None
            and result.allowed
            and (type(held) is KeepOpen or any(p.retry_after > 0 for p in result.details))
        ):
            # A reserved turn: its caller waits for it, and may be cancelled meanwhile. The op
            # stays open until the caller hands it back (``end_turn``), so that its undo
            # still finds it.
            held.append(Turn(plans, weight, op, keys))
        else:
            self.ops.settle(keys, op)
        if result.allowed:
            if plans[0].has_leases if len(plans) == 1 else any(p.has_leases for p in plans):
                result = replace(result, lease=Lease(self, plans, weight, op))
            # (set on the decision just made: refund(decision=) gives back what it records)
            object.__setattr__(result, "_charge", Charge(self, plans, weight))
        return result

    async def _enter(self, keys: Sequence[str]) -> list[str]:
        """Takes a slot on each of ``keys`` (in sorted order, so two calls never wait for each
        other in a cycle), waiting in line where ``MAX_IN_FLIGHT`` charging calls are in
        flight already. Returns the keys to hand to ``_leave``."""
        counts, queued = self._in_flight, self._queued
        taken: list[str] = []
        try:
            for key in sorted(set(keys)) if len(keys) > 1 else keys:
                if counts.get(key, 0) < MAX_IN_FLIGHT and key not in queued:
                    counts[key] = counts.get(key, 0) + 1
                    taken.append(key)
                    continue
                self.statistics.waited_in_flight += 1
                waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                queue = queued.setdefault(key, deque())
                queue.append(waiter)
                try:
                    await waiter  # (``_leave`` hands its slot over: counted for us already)
                except BaseException:
                    if waiter.done() and not waiter.cancelled():
                        taken.append(key)  # handed over, then cancelled: passed on below
                    else:
                        with contextlib.suppress(ValueError):  # (``_leave`` dropped it)
                            queue.remove(waiter)
                        if not queue and queued.get(key) is queue:
                            del queued[key]
                    raise
                taken.append(key)
        except BaseException:
            self._leave(taken)
            raise
        return taken

    def _leave(self, keys: Sequence[str]) -> None:
        """Gives back the slots ``_enter`` took: each to the first caller in line for that
        key, else free."""
        counts, queued = self._in_flight, self._queued
        for key in keys:
            queue = queued.get(key)
            if queue is not None:
                while queue:
                    waiter = queue.popleft()
                    if not waiter.done():
                        waiter.set_result(None)
                        break
                else:
                    waiter = None
                if not queue:
                    del queued[key]
                if waiter is not None:
                    continue  # the slot went to that caller
            left = counts[key] - 1
            if left:
                counts[key] = left
            else:
                del counts[key]

    def end_turn(self, turn: Turn, *, undo: bool) -> None:
        """Settles a held turn's op: it came (the caller went through), or, with ``undo``, the
        caller gave up waiting: the op is undone in the background (its turn becomes free for
        the next waiter) until the store answers."""
        if undo:
            self._spawn(self._settle(turn.plans, turn.weight, turn.op, turn.keys))
        else:
            self.ops.settle(turn.keys, turn.op)

    def give_back(self, turn: Turn, weight: int) -> asyncio.Task[None] | None:
        """Settles a kept-open op (``KeepOpen``): with ``weight``, that much of what it charged
        is given back first, by an undo of the op for that weight (it credits each key at the
        time the op charged it, once) in the background, until the store answers (the task
        returned)."""
        if weight:
            return self._spawn(self._settle(turn.plans, weight, turn.op, turn.keys))
        self.ops.settle(turn.keys, turn.op)
        return None

    async def refund(self, plans: Sequence[IdentifierPlan], weight: int) -> Decision:
        """Gives ``weight`` back on every pair, once (a resent copy replays). A refund once
        started finishes even if its caller is cancelled. One that fails (the deadline, a
        store error) may have been applied, whole or on some slots, or not at all: it is sent
        again in the background, with the same op, until the store answers (a slot that
        applied it replays), so it lands once on every pair; its op stays open till then."""
        keys = [plan.keys[0] for plan in plans]
        try:
            slots = await self._enter(keys)
        except BaseException as error:  # (cancelled, or out of time, in line: nothing sent)
            # (a mark of its own: a store's ``mark_unsent`` on a refund's error does not stop
            # the resend in the background below, so the caller may not refund again)
            error._aiolimit_refund_unsent = True  # type: ignore[attr-defined]
            raise
        op = self.ops.open(keys)

        async def refund() -> Decision:
            finishing = False
            try:
                return await self.decide(REFUND, plans, weight, op)
            except BaseException as error:  # (the deadline cancels it: CancelledError)
                if not self._closing and not isinstance(error, ClockError):
                    finishing = True
                    self._spawn(self._settle(plans, weight, op, keys, REFUND))
                raise
            finally:
                if not finishing:
                    self.ops.settle(keys, op)
                self._leave(slots)

        return await self._shielded(refund(), own_budget=False)

    def _count_slots(self, slots: int) -> None:
        self.statistics.multi_slot += 1
        counts = self.statistics.slots_per_call
        counts[slots] = counts.get(slots, 0) + 1

    async def _check_phase(
        self, groups: Sequence[Sequence[IdentifierPlan]], weight: int, max_wait_us: int,
        now_us: int | None,
    ) -> Decision | None:  # fmt: skip
        """Phase 1 across slots: one read-only check per slot, concurrently. The refusal
        (nothing was written), or None when every slot allows."""
        checks = self._calls(CHECK, groups, weight, now_us, None, max_wait_us)
        checked = await self._raw_replies(checks)
        if all(allows(raw) for raw in checked):  # (an allowed check needs no decoding)
            return None
        self.statistics.refused_at_check += 1
        return _refusal([decode(c, r) for c, r in zip(checks, checked, strict=True)], weight)

    async def _two_phase(
        self, groups: Sequence[Sequence[IdentifierPlan]], weight: int, now_us: int | None,
        op: Op, max_wait_us: int, *, checked: bool = False,
    ) -> Decision:  # fmt: skip
        if not self._penalty and not checked:
            refused = await self._check_phase(groups, weight, max_wait_us, now_us)
            if refused is not None:
                return refused
        calls = self._calls(ACQUIRE, groups, weight, now_us, op, max_wait_us)
        try:
            results = await self._store.run(calls)
        except BaseException:
            # Cancelled or out of time with the commits in flight: ``acquire`` undoes them.
            self.statistics.compensations += 1
            raise
        error = _first_error(results)
        if error is not None:
            # A commit may have charged: undo every slot that did not refuse, before the
            # caller hears of the error. If that undo fails too, ``acquire`` keeps trying.
            self.statistics.compensations += 1
            undo = [
                call
                for call, result in zip(calls, results, strict=True)
                if isinstance(result, BaseException) or decode(call, result).allowed
            ]
            await self._compensated(undo, weight, op, now_us, error)
            error._aiolimit_undone = op.stamp  # type: ignore[attr-defined]
            raise error
        if all(allows(raw) for raw in results):  # type: ignore[arg-type]
            return replies_decision(calls, results)  # type: ignore[arg-type]
        if self._penalty:
            # Every slot committed (no check phase: refusals are counted), and a slot whose
            # own pairs allowed took the op's ``Concurrency`` leases there. The call is
            # refused, so no caller holds a ``Lease`` to release them: they go here, as one
            # call's script takes none for a refused call (the penalty is for rate limits).
            refusal = replies_decision(calls, results)  # type: ignore[arg-type]
            holding = [
                plan
                for call, raw in zip(calls, results, strict=True)
                if allows(raw)  # type: ignore[arg-type]
                for plan in call.plans
                if plan.has_leases
            ]
            if holding:
                return await self._release_refused(refusal, holding, weight, op)
            return refusal
        replies = [decode(call, result) for call, result in zip(calls, results, strict=True)]  # type: ignore[arg-type]
        # Another client won the race between the phases: undo the slots that charged (the
        # others charged nothing). If that undo fails, ``acquire`` undoes them all.
        self.statistics.compensations += 1
        undo = [call for call, reply in zip(calls, replies, strict=True) if reply.allowed]
        await self._compensated(undo, weight, op, now_us)
        return _refusal(replies, weight)

    async def _release_refused(
        self, refusal: Decision, holding: Sequence[IdentifierPlan], weight: int, op: Op
    ) -> Decision:
        """Releases the leases a refused call took across slots under ``count_refused``
        (``_two_phase``), and returns the refusal with its ``Concurrency`` pairs as the
        release left them. The store has refused: nothing that happens to the release turns
        that into an error (nor into the failure policy's answer). It is awaited
        ``RELEASE_WAIT`` at most, and until just before the decision's deadline at the latest;
        one not answered by then, or failed, goes on in the background until the store answers
        (``lease_call``), and the refusal reports those pairs as the commit did (the lease
        counted)."""
        release = self._spawn(self.lease_call(RELEASE, holding, weight, op))
        deadline = current_deadline()
        left = RELEASE_WAIT
        if deadline is not None:
            until = deadline - time.monotonic()
            left = min(left, until - min(RELEASE_MARGIN, max(until, 0.0) / 10))
        # ``asyncio.wait`` neither cancels the release when the time is up nor raises what
        # the release met: cancelled (``aclose`` stops background work), failed or out of
        # time, the caller still gets its refusal (a cancellation of the caller propagates).
        await asyncio.wait((release,), timeout=max(left, 0.0))
        if not release.done() or release.cancelled() or release.exception() is not None:
            return refusal  # (out of time, or failed: lease_call goes on with it)
        released = release.result()
        after = {
            (pair.identifier, pair.limit): pair
            for pair in released.details
            if pair.limit.wire[0] == "lease"
        }
        if not after:
            return refusal
        details = tuple(after.get((p.identifier, p.limit), p) for p in refusal.details)
        merged = Decision.from_pairs(details)
        # (the slots' all-or-nothing verdict stands, as in ``decision``: a refusal)
        return merged if not merged.allowed else replace(merged, allowed=False)

    # --- undo, release, renew ---------------------------------------------------------------

    async def _compensated(
        self, calls: Sequence[Call], weight: int, op: Op, now_us: int | None,
        cause: BaseException | None = None,
    ) -> None:  # fmt: skip
        """``_compensate`` run to its end whatever happens to the caller, within a budget of
        its own (``_shielded``). One still unanswered when the budget ends raises
        ``BackendUnavailable`` (from ``cause``, the error that called for it, if any), not
        the budget's ``TimeoutError``: the caller is answered by the failure policy, as for
        any store failure, and ``acquire`` goes on undoing (the error carries no mark)."""
        try:
            await self._shielded(self._compensate(calls, weight, op, now_us))
        except TimeoutError as exc:
            self.statistics.compensation_errors += 1
            raise BackendUnavailable(
                f"no answer within {UNDO_BUDGET:g} s undoing op {op.id} on "
                f"{len(calls)} slot(s) (tried again in the background)"
                + ("" if cause is None else f"; the decision had failed: {cause}")
            ) from (cause or exc)

    async def _compensate(
        self, calls: Sequence[Call], weight: int, op: Op, now_us: int | None
    ) -> None:
        """Undoes ``op`` on the slots of ``calls`` once, at the decision's ``now_us`` (read
        before anything was sent: a clock failing now must not pass for one that failed
        before the commits); raises the first error."""
        try:
            undos = self._calls(UNDO, [call.plans for call in calls], weight, now_us, op)
            error = _first_error(await self._store.run(undos))
        except Exception as exc:
            error = exc
        if error is not None:
            self.statistics.compensation_errors += 1
            # The undo may never have been written, but the commits before it were (or may
            # have been): raised to ``acquire``, its mark would settle the op with no undo.
            raise clear_unsent(error)
        if self.on_given_back is not None:
            self.on_given_back([plan for call in calls for plan in call.plans])

    async def _settle(
        self, plans: Sequence[IdentifierPlan], weight: int, op: Op, keys: Sequence[str],
        mode: Mode = UNDO,
    ) -> None:  # fmt: skip
        """Undoes ``op`` over ``plans`` (or, with ``mode`` REFUND, sends a refund that failed
        again: its first try was made) until the store answers (``undo_patience`` at most);
        then the op is settled and later calls ack past it."""
        what = "undoing" if mode is UNDO else "refunding"
        try:
            answered = await self._until_answered(
                lambda: self.decide(mode, plans, weight, op), f"{what} op {op.id}",
                failed=mode is not UNDO,
            )  # fmt: skip
            if not answered:
                self.statistics.compensation_errors += 1
            elif self.on_given_back is not None:
                self.on_given_back(plans)
        finally:
            self.ops.settle(keys, op)

    async def _until_answered(
        self, attempt: Callable[[], Awaitable[object]], what: str, *, failed: bool = False
    ) -> bool:
        """Runs ``attempt`` until the store answers: each try with a deadline of its own
        (``UNDO_BUDGET``), backing off between tries, for ``undo_patience`` at most. False,
        and a log line, if it never did. ``failed``: a first try was already made elsewhere."""
        give_up = time.monotonic() + self._patience
        for tries in itertools.count(1):
            if failed or tries > 1:
                await asyncio.sleep(backoff(tries - 1))
            budget = min(UNDO_BUDGET, max(give_up - time.monotonic(), 0.001))
            try:
                DECISION_DEADLINE.set(time.monotonic() + budget)
                async with asyncio.timeout(budget):
                    await attempt()
                return True
            except Exception as error:
                if time.monotonic() + backoff(tries) >= give_up:
                    logger.warning("aiolimit: gave up %s after %d attempts: %s", what, tries, error)
                    return False
        raise AssertionError("unreachable")  # pragma: no cover

    async def lease_call(
        self, mode: Mode, plans: Sequence[IdentifierPlan], weight: int, op: Op
    ) -> Decision:
        """Releases or renews the leases of ``op``; a release finishes even if its caller
        is cancelled."""
        assert mode in (RELEASE, RENEW)
        if mode is RENEW:
            seconds = self.renew_deadline
            if seconds is None:
                return await self.decide(RENEW, plans, weight, op)
            token = DECISION_DEADLINE.set(time.monotonic() + seconds)
            try:
                async with asyncio.timeout(seconds):
                    return await self.decide(RENEW, plans, weight, op)
            except TimeoutError as error:
                raise BackendUnavailable(
                    f"no answer within {seconds:g} s renewing lease {op.id}"
                ) from error
            finally:
                DECISION_DEADLINE.reset(token)

        async def release() -> Decision:
            # What follows the release runs in its own task, whether or not its caller is
            # still waiting (a caller cancelled again, or by a scope that cancels again, stops
            # waiting at once): a failure keeps trying in the background (a release is
            # idempotent), so one reset connection does not hold the slot until the lease
            # TTL; a success wakes this process's waiters.
            try:
                decision = await self.decide(RELEASE, plans, weight, op)
            except BaseException:  # (its own time budget running out: CancelledError here)
                if not self._closing:
                    self._spawn(self._retry_release(plans, weight, op))
                raise
            self._wake_release_waiters()
            return decision

        try:
            return await self._shielded(release())
        except TimeoutError as error:  # a store that does not answer in time
            raise BackendUnavailable(
                f"no answer within {UNDO_BUDGET:g} s releasing lease {op.id}"
            ) from error

    async def _retry_release(self, plans: Sequence[IdentifierPlan], weight: int, op: Op) -> None:
        released = await self._until_answered(
            lambda: self.decide(RELEASE, plans, weight, op), f"releasing lease {op.id}",
            failed=True,
        )  # fmt: skip
        if released:
            self._wake_release_waiters()

    def _wake_release_waiters(self) -> None:
        self.releases += 1
        waiters, self._release_waiters = self._release_waiters, set()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def next_release(self) -> asyncio.Future[None]:
        """Done when this process next releases a lease (waiters for a slot try again then;
        other processes' releases are seen by polling)."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._release_waiters.add(waiter)
        waiter.add_done_callback(self._release_waiters.discard)
        return waiter

    def _spawn(self, work: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Runs ``work`` in a task of its own (it sets its own deadline)."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_retrieve)
        return task

    async def _shielded(self, work: Coroutine[Any, Any, T], *, own_budget: bool = True) -> T:
        """Runs ``work`` to its end: a cancellation of the caller stops the wait, not the work.

        With ``own_budget`` the work gets ``UNDO_BUDGET`` seconds of its own (an undo must
        finish even when the decision ran out of time); without, it keeps the caller's
        deadline, if any.
        """
        inherited = DECISION_DEADLINE.get()

        async def bounded() -> T:
            deadline = inherited
            if own_budget or deadline is None:
                deadline = time.monotonic() + UNDO_BUDGET
                DECISION_DEADLINE.set(deadline)
            async with asyncio.timeout(max(deadline - time.monotonic(), 0.0)):
                return await work

        return await asyncio.shield(self._spawn(bounded()))

    async def aclose(self, grace: float = UNDO_BUDGET) -> None:
        """Waits up to ``grace`` seconds for the undos and releases still running, then stops them
        (their ops stay charged if they ran: the store never answered)."""
        self._closing = True
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=grace)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


def _retrieve(task: asyncio.Task[Any]) -> None:
    """Marks a background task's error as seen (its waiter, if any, got it already)."""
    if not task.cancelled():
        task.exception()
