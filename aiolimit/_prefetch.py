"""Prefetched allowances (``Limiter(..., prefetch=N)``): admissions made in this process from
capacity taken ahead in the store, with no round trip.

A call on identifiers that are busy in this process (a second call within the current bucket
of their limits) asks the store for its weight plus up to ``N`` more units, in the same
all-or-nothing script call and under the same op as any acquire. The extra units are this
process's *allowance*: later calls on the same identifiers take from it locally, until it is
used up or the bucket it was charged in ends, whichever comes first. Then what is left is
given back with an undo of that op (the undo credits the bucket the op charged, at the time it
charged it), so the store ends up counting exactly what was admitted.

Why this never over-admits. Only sliding and fixed window counters take part (``Limit``,
``FixedWindow``): they count per bucket, and a unit admitted at any instant of a bucket counts
the same as one charged at its start. An allowance is used only while the store's time is
still in the bucket the op charged in: that bucket ends ``reset_after - (n - 1) * precision``
after the script ran (``reset_after`` as the reply gives it for an admitted pair of ``n``
buckets), and the script ran after the call was sent, so the store's time at a local instant
``m`` is at most ``reply time + (m - sent)``. The allowance ends ``margin`` before that bound,
and after ``MAX_LIFE`` at most. A unit taken later than that goes to the store. This needs one
clock for every process (the server's, or a TIME authority: ``LocalClock`` is refused), and a
reply that was a replay (a resent copy of an op that had run) keeps no units: its pairs tell
the replay's bucket, not the op's. So every admitted unit is counted in its own
bucket (or a later one, when the key's time ran ahead of the call's), and while an allowance
lives the store counts its unused units too: other processes can only be refused early, never
admitted past a limit.

Sizing. An allowance is taken only on identifiers seen this bucket already, and is at most
twice the weight they were admitted in the bucket so far (the previous bucket's, when they were
busy then), at most ``N`` and at most a quarter of what the store said remains: an identifier
with one call per bucket never pays for one, and near a limit allowances shrink to nothing. A
refused prefetch charged nothing; the call is made again for its own weight alone. One call
at a time takes units ahead on a set of identifiers; the others wait for its units, within
their own deadline.

What it does not see: a count the store lost (a reset made by another process, a restart, a
failover to a replica behind). That wipes the units this process holds from the store's count;
until its allowance ends (at most one bucket and ``MAX_LIFE``, at most ``N`` units per set of
identifiers) this process may admit them on top of the count the store restarted from. A reset
through this limiter drops its allowances first.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from aiolimit._decision import Charge, Decision, PairDecision, made_decision
from aiolimit._protocol import Turn
from aiolimit._rules import IdentifierPlan

if TYPE_CHECKING:
    from aiolimit._clock import Clock
    from aiolimit._protocol import Protocol

#: The largest ``prefetch``.
MAX_PREFETCH = 1_000_000
#: An allowance ends this long before the bucket it was charged in can have ended in the
#: store's time (seconds), plus a thousandth of its length (the two clocks' rates may differ),
#: plus twice a cached authority clock's error bound.
MARGIN = 0.001
#: An allowance shorter than this is not worth taking (seconds).
MIN_LIFE = 0.002
#: An allowance lives at most this long (seconds): a long bucket (a fixed window of an hour)
#: would otherwise keep its units from other processes, and its op open, that long.
MAX_LIFE = 1.0
#: At most this share of what the store said remains is taken ahead (1 / SHARE).
SHARE = 4
#: Once a take leaves an allowance with less than 1 / LOW of its units, its next units are
#: asked for in the background.
LOW = 4
#: Sets of identifiers remembered for sizing (live allowances come on top): past this, those
#: not busy lately are forgotten (all of them, if all were).
MAX_HINTS = 20_000

_new_pair = tuple.__new__


class Admitted(NamedTuple):
    """An admission ``Allowances.admit`` made, as it stood: its ``Decision`` is made from this
    when asked for (``Allowances.decision_of``)."""

    details: tuple[PairDecision, ...]  # the store's pairs for the allowance
    plans: Sequence[IdentifierPlan]
    weight: int
    left: int  # the units the allowance held after this admission
    elapsed: float  # seconds from the store's call to this admission


_new_admitted = tuple.__new__


def _bucket_left(pair: PairDecision) -> float | None:
    """Seconds from the script's time to the end of the bucket an admitted pair charged, or
    None when the pair cannot take part."""
    wire = pair.limit._wire
    if wire[0] != "sw" and wire[0] != "fw":
        return None
    period_us, precision_us = wire[2], wire[3]
    buckets = -(-period_us // precision_us)
    left_us = round(pair.reset_after * 1_000_000) - (buckets - 1) * precision_us
    if left_us <= 0 or left_us > precision_us:
        return None
    return left_us / 1_000_000


def eligible(plans: Sequence[IdentifierPlan], single_slot: bool) -> bool:
    """Whether calls on ``plans`` may take allowances: window counters only, one slot."""
    if not plans or (len(plans) > 1 and not single_slot):
        return False
    for plan in plans:
        if plan.shadow or plan.has_leases:
            return False
        for limit in plan.limits:
            code = limit._wire[0]
            if code != "sw" and code != "fw":
                return False
    return True


class Allowance:
    """Units taken ahead on one set of identifiers, and how busy they are (for sizing).

    ``turn`` is None for a hint only (no units held): what the last decision said remains
    (``remaining``), and the weight admitted (``used``) while ``until`` (this process's
    monotonic time) had not passed."""

    __slots__ = (
        "ahead", "back", "back_units", "details", "left", "plans", "remaining", "sent", "size",
        "timer", "turn", "until", "used",
    )  # fmt: skip

    def __init__(self, plans: Sequence[IdentifierPlan]) -> None:
        self.plans = plans
        self.turn: Turn | None = None
        self.left = 0
        self.until = -math.inf
        self.sent = 0.0
        self.used = 0
        self.remaining = 0
        self.details: tuple[PairDecision, ...] = ()
        self.timer: asyncio.TimerHandle | None = None
        self.size = 0  # the units it was opened with
        self.ahead = False  # its next units were asked for ahead (``Allowances.low``)
        # The give-back of its units still in flight (and how many), if any.
        self.back: asyncio.Task[None] | None = None
        self.back_units = 0


class Allowances:
    """This limiter's allowances, keyed by the call's identifiers (in order)."""

    def __init__(self, size: int, protocol: Protocol, clock: Clock) -> None:
        self.size = size
        self._protocol = protocol
        self._clock = clock
        self._by_ids: dict[tuple[str, ...] | str, Allowance] = {}
        self._tuples: set[tuple[str, ...]] = set()  # the keys of several identifiers
        # keys with a call taking units ahead in flight -> the event its waiters wait on
        self._pending: dict[tuple[str, ...] | str, asyncio.Event | None] = {}
        self.local = 0  # admissions made from allowances
        self.taken = 0  # allowances taken
        self.returned = 0  # allowances that gave units back
        # Moves on every reset through this limiter (``drop``) and on ``close``: a call that
        # took units ahead and was sent before it keeps none (the reset wiped them from the
        # store, or nothing will give them back once the limiter is closed).
        self.epoch = 0
        self._in_flight = 0  # calls taking units ahead in flight
        # The last round trip of a call this limiter's allowances sent that the store answered
        # (seconds): a caller waits for another call's refill only while it would still have
        # time to ask the store itself after.
        self.round_trip = 0.0
        self._idle: asyncio.Event | None = None
        #: Called with an allowance's plans when a take leaves it below ``1 / LOW`` of its
        #: units (once per allowance): the limiter asks for the next units in the
        #: background, so that the calls that follow rarely find it empty and wait.
        self.low: Callable[[Sequence[IdentifierPlan]], None] | None = None

    def sending(self) -> int:
        """A call that takes units ahead is sent: the epoch to hand to ``opened``."""
        self._in_flight += 1
        return self.epoch

    def answered(self) -> None:
        """That call came back (or failed, or was cancelled)."""
        self._in_flight -= 1
        if not self._in_flight and self._idle is not None:
            self._idle.set()
            self._idle = None

    async def drained(self, within: float) -> None:
        """Waits (``within`` seconds at most) for the calls taking units ahead still in flight."""
        if not self._in_flight:
            return
        if self._idle is None:
            self._idle = asyncio.Event()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), within)

    @staticmethod
    def key(plans: Sequence[IdentifierPlan]) -> tuple[str, ...] | str:
        if len(plans) == 1:
            return plans[0].identifier
        return tuple(plan.identifier for plan in plans)

    def take(self, plans: Sequence[IdentifierPlan], weight: int) -> Decision | None:
        """An admission from a live allowance on these plans, or None (ask the store)."""
        admitted = self.admit(plans, weight)
        return None if admitted is None else self.decision_of(admitted)

    def admit(self, plans: Sequence[IdentifierPlan], weight: int) -> Admitted | None:
        """``take``, with the admission's ``Decision`` left unmade: what it will say, as it
        stands now (``decision_of`` makes it, the same whenever it is asked for). A web layer
        that only needs the ``RateLimit`` fields of most admissions never pays for one."""
        entry = self._by_ids.get(plans[0].identifier if len(plans) == 1 else self.key(plans))
        if entry is None or entry.left < weight or entry.turn is None:
            return None
        held = entry.plans
        if len(plans) == 1 and len(held) == 1:  # (``same_limits`` of one plan, written out)
            if plans[0].limits is not held[0].limits and plans[0].limits != held[0].limits:
                return None
        elif not same_limits(plans, held):
            return None
        now = self._clock.monotonic()
        if now >= entry.until:
            self._finish(entry)
            return None
        entry.left -= weight
        entry.used += weight
        self.local += 1
        if entry.left * LOW < entry.size and not entry.ahead and self.low is not None:
            entry.ahead = True
            self.low(entry.plans)
        # (Read now: a refill of this allowance replaces them.)
        return _new_admitted(Admitted, (entry.details, entry.plans, weight, entry.left,
                                        now - entry.sent))  # fmt: skip

    def decision_of(self, admitted: Admitted) -> Decision:
        """The ``Decision`` of an admission ``admit`` made: each pair's remaining as the store
        said plus the units the allowance held after it, its reset as the store said less the
        time since the store was asked."""
        details, plans, weight, left, elapsed = admitted
        if len(details) != 1:
            return self._rebuilt_pairs(details, plans, weight, left, elapsed)
        # One pair (the commonest): as ``_rebuilt_pairs`` makes it, with no loop.
        pair = details[0]
        reset = pair.reset_after - elapsed
        if reset < 0.0:
            reset = 0.0
        remaining = pair.remaining + left
        identifier, limit = pair.identifier, pair.limit
        return made_decision(
            True, remaining, 0.0, reset, identifier, limit,
            (_new_pair(PairDecision, (identifier, limit, True, remaining, 0.0, reset)),),
            Charge(self._protocol, plans, weight),
        )  # fmt: skip

    def extra(self, plans: Sequence[IdentifierPlan], weight: int) -> int:
        """How many units to take ahead on a call the store must decide (0: none)."""
        key = self.key(plans)
        entry = self._by_ids.get(key)
        if entry is None or entry.used == 0 or key in self._pending:
            return 0  # (units ahead are being taken already: no herd of them on a refill)
        now = self._clock.monotonic()
        if now < entry.until:
            demand = 2 * entry.used  # busy in this bucket: twice what it took so far
        elif now - entry.until < entry.until - entry.sent:
            demand = entry.used  # busy in the bucket before: as much again
        else:
            return 0
        room = min((plan.max_weight for plan in plans), default=0) - weight
        return max(min(self.size, demand, entry.remaining // SHARE, room), 0)

    def pending(self, plans: Sequence[IdentifierPlan], flag: bool) -> None:
        """Marks a call taking units ahead on ``plans`` as in flight (or done, which wakes the
        calls that waited for it): meanwhile other calls there take none (each would hold its
        own, and give most of it back), they wait for its units (``refill``)."""
        key = self.key(plans)
        if flag:
            self._pending[key] = None
        else:
            done = self._pending.pop(key, None)
            if done is not None:
                done.set()

    async def refill(self, plans: Sequence[IdentifierPlan]) -> bool:
        """Waits for the call taking units ahead on ``plans`` that is in flight, if any (its
        caller's deadline bounds it): True if there was one. A caller cancelled meanwhile has
        taken nothing."""
        key = self.key(plans)
        if key not in self._pending:
            return False
        done = self._pending[key]
        if done is None:
            done = self._pending[key] = asyncio.Event()
        await done.wait()
        return True

    def observe(
        self, plans: Sequence[IdentifierPlan], weight: int, decision: Decision, sent: float
    ) -> None:
        """Notes a decision the store made for ``weight`` alone (sizing only)."""
        if decision.degraded or not decision.details:
            return
        key = self.key(plans)
        entry = self._by_ids.get(key)
        now = self._clock.monotonic()
        if entry is not None and entry.turn is not None and now >= entry.until:
            self._finish(entry)
        if entry is None:
            if len(self._by_ids) >= MAX_HINTS:
                self._forget_hints(now)
            entry = Allowance(plans)
            self._by_ids[key] = entry
            if type(key) is tuple:
                self._tuples.add(key)
        entry.remaining = decision.remaining
        if not decision.allowed:
            return
        if now < entry.until and same_limits(plans, entry.plans):
            entry.used += weight
            return
        life = self._life(decision.details, sent)
        if life is None:
            return
        if entry.turn is not None:
            return  # (a live allowance with too little left for this call: it ends on its own)
        entry.plans = plans
        entry.until = life
        entry.sent = sent
        entry.used = weight

    def refused(
        self, plans: Sequence[IdentifierPlan], weight: int, decision: Decision, wait: float
    ) -> Decision:
        """A refusal the store made for ``weight`` alone, while units this process holds on
        ``plans`` (too few for the call) were counted in it: when they alone keep it out
        (each refusing pair's remaining plus them would fit it), they are given back now, and
        the refusal says to try again in ``wait`` seconds (about the round trip the give-back
        takes), not when the window would have slid far enough (up to a whole period: an
        ``acquire`` slept that long, or gave up at once under its timeout)."""
        entry = self._by_ids.get(self.key(plans))
        if entry is None or len(entry.plans) != len(plans):
            return decision
        if entry.turn is not None:
            left = entry.left  # (held: given back now)
        elif entry.back is not None and not entry.back.done():
            left = entry.back_units  # (being given back: this call may have been judged first)
        else:
            return decision
        if not left:
            return decision
        if not same_limits(plans, entry.plans):
            return decision
        details = decision.details
        if not details or any(
            not pair.allowed and pair.remaining + left < weight for pair in details
        ):
            return decision
        self._finish(entry)
        pairs = tuple(
            pair
            if pair.allowed or pair.retry_after <= wait
            else _new_pair(
                PairDecision,
                (pair.identifier, pair.limit, False, pair.remaining, wait, pair.reset_after),
            )
            for pair in details
        )
        return dataclasses.replace(
            decision, retry_after=min(decision.retry_after, wait), details=pairs
        )

    def opened(
        self, plans: Sequence[IdentifierPlan], weight: int, extra: int, turn: Turn,
        decision: Decision, sent: float, epoch: int, *, replayed: bool = False,
    ) -> Decision:  # fmt: skip
        """A call that took ``extra`` units ahead was admitted: keeps them (or gives them back
        at once, when too little of the bucket is left, when a reset or ``close`` came since
        it was sent: ``epoch``, or when the reply was a replay: its pairs tell the bucket of
        the replay's time, which may be later than the op's), and returns the caller's
        decision."""
        key = self.key(plans)
        old = self._by_ids.get(key)
        if old is not None and old.turn is not None:
            self._finish(old)  # (taken ahead: what the old one has left goes back)
        life = None if replayed else self._life(decision.details, sent)
        entry = Allowance(plans)
        if old is not None and old.back is not None and not old.back.done():
            entry.back, entry.back_units = old.back, old.back_units  # (for ``refused``)
        entry.turn = turn
        entry.left = entry.size = extra
        entry.sent = sent
        entry.used = weight + (old.used if old is not None and old.until > sent else 0)
        entry.remaining = decision.remaining
        entry.details = decision.details
        if life is None or life - self._clock.monotonic() < MIN_LIFE or epoch != self.epoch:
            entry.until = -math.inf
            self._giving_back(entry, turn, extra)
            self.returned += 1
            entry.turn = None
            entry.left = 0
            entry.details = ()
            self._by_ids[key] = entry
            if type(key) is tuple:
                self._tuples.add(key)
            return self._rebuilt_pairs(
                decision.details, plans, weight, 0, self._clock.monotonic() - sent
            )
        entry.until = life
        self._by_ids[key] = entry
        if type(key) is tuple:
            self._tuples.add(key)
        self.taken += 1
        delay = max(life - self._clock.monotonic(), 0.0)
        entry.timer = asyncio.get_running_loop().call_later(delay, self._expire, key, entry)
        return self.decision_of(
            _new_admitted(Admitted, (entry.details, plans, weight, extra,
                                     self._clock.monotonic() - sent))
        )  # fmt: skip

    def _life(self, details: Sequence[PairDecision], sent: float) -> float | None:
        """The monotonic time an allowance charged with these pairs ends at, or None."""
        shortest = math.inf
        for pair in details:
            left = _bucket_left(pair)
            if left is None or not pair.allowed:
                return None
            shortest = min(shortest, left)
        if shortest == math.inf:
            return None
        # A clock that extrapolates the authority's time (AuthorityClock(max_age=...)) may be
        # off by its error bound, and another process's as much the other way: this one's
        # bucket may end that much earlier in the time the store judges by.
        error = getattr(self._clock, "error_bound", 0.0)
        return sent + min(shortest - MARGIN - shortest / 1000 - 2 * error, MAX_LIFE)

    def _rebuilt_pairs(
        self, details: Sequence[PairDecision], plans: Sequence[IdentifierPlan], weight: int,
        left: int, elapsed: float,
    ) -> Decision:  # fmt: skip
        """An admission of ``weight``: each pair's remaining as the store said plus the units
        still held here, its reset as the store said less the time since (``elapsed``)."""
        pairs: list[PairDecision] = []
        remaining = -1
        reset = 0.0
        binding: PairDecision | None = None
        for pair in details:
            mine = _new_pair(
                PairDecision,
                (pair.identifier, pair.limit, True, pair.remaining + left, 0.0,
                 max(pair.reset_after - elapsed, 0.0)),
            )  # fmt: skip
            pairs.append(mine)
            if binding is None or mine.remaining < remaining:
                binding, remaining = mine, mine.remaining
            if mine.reset_after > reset:
                reset = mine.reset_after
        assert binding is not None
        return made_decision(
            True, remaining, 0.0, reset, binding.identifier, binding.limit, tuple(pairs),
            Charge(self._protocol, plans, weight),
        )  # fmt: skip

    def _expire(self, key: tuple[str, ...] | str, entry: Allowance) -> None:
        entry.timer = None
        if entry.turn is not None:
            self._finish(entry)

    def _finish(self, entry: Allowance) -> None:
        """Ends a live allowance: what is left is given back (its op undone for that much)."""
        turn = entry.turn
        if turn is None:
            return
        entry.turn = None
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None
        left, entry.left = entry.left, 0
        entry.details = ()
        if left:
            self.returned += 1
        self._giving_back(entry, turn, left)

    def _giving_back(self, entry: Allowance, turn: Turn, units: int) -> None:
        """Gives ``units`` of the entry's op back (none: settles it); remembered on the entry
        while in flight (``refused``)."""
        task = self._protocol.give_back(turn, units)
        if task is not None:
            entry.back, entry.back_units = task, units
            task.add_done_callback(lambda _: _gone(entry, task))

    def drop(self, identifiers: set[str]) -> None:
        """Ends (and forgets) the allowances on any of ``identifiers`` (a reset)."""
        self.epoch += 1
        by_ids = self._by_ids
        for name in identifiers:
            entry = by_ids.pop(name, None)
            if entry is not None:
                self._finish(entry)
        for key in [key for key in self._tuples if not identifiers.isdisjoint(key)]:
            self._tuples.discard(key)
            entry = by_ids.pop(key, None)
            if entry is not None:
                self._finish(entry)

    def close(self) -> None:
        """Ends every allowance (the limiter is closing)."""
        self.epoch += 1
        for entry in self._by_ids.values():
            self._finish(entry)
        self._by_ids.clear()
        self._tuples.clear()

    def _forget_hints(self, now: float) -> None:
        """Forgets the hints of identifiers not busy lately (none left: every hint)."""
        kept = {
            key: entry
            for key, entry in self._by_ids.items()
            if entry.turn is not None or now - entry.until < entry.until - entry.sent
        }
        if len(kept) >= MAX_HINTS // 2:
            kept = {key: entry for key, entry in kept.items() if entry.turn is not None}
        self._by_ids = kept
        self._tuples = {key for key in kept if type(key) is tuple}


def same_limits(plans: Sequence[IdentifierPlan], held: Sequence[IdentifierPlan]) -> bool:
    """Whether ``plans`` (made anew for each call) judge by the limits ``held`` did."""
    if len(plans) != len(held):
        return False
    for mine, theirs in zip(plans, held, strict=True):
        if mine.limits is not theirs.limits and mine.limits != theirs.limits:
            return False
    return True


def _gone(entry: Allowance, task: asyncio.Task[None]) -> None:
    if entry.back is task:
        entry.back, entry.back_units = None, 0
