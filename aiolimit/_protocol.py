"""The decision protocol: one atomic call per slot, and two phases across slots.

Orchestration only: it groups identifier plans by slot and calls an abstract ``Runner`` (run
these script calls concurrently, return each reply or error), so it is tested without a server.

- One slot (standalone Redis, the embedded store, or a cluster call whose identifiers share a
  slot): a single atomic call decides and charges.
- Several slots (Redis Cluster):
  1. check: a read-only call per slot, all concurrently. Any refusal ends the decision; nothing
     was written anywhere.
  2. commit: an ``acquire`` per slot with one operation id, concurrently; each re-checks and
     charges atomically and records the op.
  3. compensate: if a commit was refused (another client won the race between the phases) or
     failed, every other slot is sent an ``undo`` of that op. An undo credits exactly what
     the op charged there, once, and tombstones the op so a late commit cannot charge. The
     final state equals "never happened".
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from aiolimit._decision import Decision
from aiolimit._rules import IdentifierPlan
from aiolimit._wire import ACQUIRE, CHECK, UNDO, Call, Reply, decision, decode, encode

RawReply = list[int]
Runner = Callable[[Sequence[Call]], Awaitable[list[RawReply | BaseException]]]
SlotOf = Callable[[str], int]


@dataclass(slots=True)
class ProtocolStatistics:
    """How often the cross-slot path ran, and how often it had to undo a commit."""

    single_slot: int = 0
    multi_slot: int = 0
    refused_at_check: int = 0
    compensations: int = 0
    compensation_errors: int = 0
    slots_per_call: dict[int, int] = field(default_factory=dict)


def new_op_id() -> str:
    return uuid.uuid4().hex


def group_by_slot(plans: Sequence[IdentifierPlan], slot_of: SlotOf) -> list[list[IdentifierPlan]]:
    groups: dict[int, list[IdentifierPlan]] = {}
    for plan in plans:
        groups.setdefault(slot_of(plan.keys[0]), []).append(plan)
    return list(groups.values())


def _merge(replies: Sequence[Reply]) -> Decision:
    pairs = tuple(pair for reply in replies for pair in reply.pairs)
    return decision(Reply(all(r.allowed for r in replies), False, 0, pairs))


def _first_error(results: Sequence[RawReply | BaseException]) -> BaseException | None:
    for result in results:
        if isinstance(result, BaseException):
            return result
    return None


class Protocol:
    """Decides over any set of identifier plans on a store reached through ``run``."""

    def __init__(
        self, run: Runner, slot_of: SlotOf, slack_ms: int, penalty: bool, *,
        always_op_ids: bool = False, single_slot: bool = False,
    ) -> None:  # fmt: skip
        # With always_op_ids every charging call carries an op id, so a runner may retry any
        # call after a lost reply without charging twice (the cluster store does).
        self._always_op_ids = always_op_ids
        # A single-node store puts every key in one slot: skip the grouping.
        self._single_slot = single_slot
        self._run = run
        self._slot_of = slot_of
        self._slack_ms = slack_ms
        self._penalty = penalty
        self.statistics = ProtocolStatistics()
        self._undoing: set[asyncio.Task[list[RawReply | BaseException]]] = set()

    def _calls(
        self, mode: str, groups: Sequence[Sequence[IdentifierPlan]], weight: int,
        now_us: int | None, op: str = "", max_wait_us: int = 0,
    ) -> list[Call]:  # fmt: skip
        slack, penalty = self._slack_ms, self._penalty
        return [
            encode(mode, group, weight, now_us, slack, op, penalty, max_wait_us) for group in groups
        ]

    async def _replies(self, calls: Sequence[Call]) -> list[Reply]:
        results = await self._run(calls)
        error = _first_error(results)
        if error is not None:
            raise error
        return [decode(call, result) for call, result in zip(calls, results, strict=True)]  # type: ignore[arg-type]

    async def decide(
        self, mode: str, plans: Sequence[IdentifierPlan], weight: int, now_us: int | None,
        op: str = "", max_wait_us: int = 0,
    ) -> Decision:  # fmt: skip
        """Runs ``mode`` (see ``lua/decide.lua``) over every plan, all or nothing.

        ``max_wait_us`` > 0 lets queueable (GCRA) pairs reserve a turn within that wait; the
        delay comes back as the pairs' ``retry_after`` on an allowed decision.
        """
        if not op and self._always_op_ids and mode != CHECK:
            op = new_op_id()
        groups = [plans] if self._single_slot else group_by_slot(plans, self._slot_of)
        if len(groups) == 1:
            self.statistics.single_slot += 1
            calls = self._calls(mode, groups, weight, now_us, op, max_wait_us)
            return _merge(await self._replies(calls))
        self.statistics.multi_slot += 1
        counts = self.statistics.slots_per_call
        counts[len(groups)] = counts.get(len(groups), 0) + 1
        if mode != ACQUIRE:
            # check and refund touch each slot independently; there is nothing to undo.
            calls = self._calls(mode, groups, weight, now_us, op, max_wait_us)
            return _merge(await self._replies(calls))
        return await self._two_phase(groups, weight, now_us, op or new_op_id(), max_wait_us)

    async def _two_phase(
        self, groups: Sequence[Sequence[IdentifierPlan]], weight: int, now_us: int | None,
        op: str, max_wait_us: int,
    ) -> Decision:  # fmt: skip
        if not self._penalty:
            checks = self._calls(CHECK, groups, weight, now_us, "", max_wait_us)
            checked = await self._replies(checks)
            if not all(reply.allowed for reply in checked):
                self.statistics.refused_at_check += 1
                return _merge(checked)
        calls = self._calls(ACQUIRE, groups, weight, now_us, op, max_wait_us)
        try:
            results = await self._run(calls)
        except BaseException:
            # Cancelled or out of time with the commits in flight: any of them may have
            # charged. Undo every slot (an undo of an op never applied only tombstones it).
            self.statistics.compensations += 1
            await self._undo(calls, weight, now_us, op)
            raise
        replies: list[Reply | None] = [
            None if isinstance(result, BaseException) else decode(call, result)
            for call, result in zip(calls, results, strict=True)
        ]
        error = _first_error(results)
        if error is None and all(reply is not None and reply.allowed for reply in replies):
            return _merge([reply for reply in replies if reply is not None])
        if self._penalty and error is None:
            return _merge([reply for reply in replies if reply is not None])
        # Undo the op on every slot whose commit may have charged (allowed, or no reply at
        # all). Slots that refused charged nothing; they are skipped to save a round trip.
        self.statistics.compensations += 1
        undo = [
            call
            for call, reply in zip(calls, replies, strict=True)
            if reply is None or reply.allowed
        ]
        await self._undo(undo, weight, now_us, op)
        if error is not None:
            raise error
        return _merge([reply for reply in replies if reply is not None])

    async def _undo(self, calls: Sequence[Call], weight: int, now_us: int | None, op: str) -> None:
        """Undoes ``op`` on the slots of ``calls``, in a task of its own: a deadline or a
        cancellation of the decision stops the waiting, never the undo."""
        undos = [encode(UNDO, call.plans, weight, now_us, self._slack_ms, op) for call in calls]
        task = asyncio.ensure_future(self._run(undos))
        self._undoing.add(task)
        task.add_done_callback(self._undo_done)
        results = await asyncio.shield(task)
        error = _first_error(results)
        if error is not None:
            raise error

    def _undo_done(self, task: asyncio.Task[list[RawReply | BaseException]]) -> None:
        self._undoing.discard(task)
        failed = task.cancelled() or task.exception() is not None
        if not failed:
            failed = _first_error(task.result()) is not None
        if failed:
            self.statistics.compensation_errors += 1
