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
import logging
import time
import uuid
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from aiolimit._calls import (
    ACQUIRE,
    CHECK,
    RELEASE,
    RENEW,
    UNDO,
    Call,
    Mode,
    RawReply,
    Reply,
    decision,
    decode,
    encode,
)
from aiolimit._clock import Clock
from aiolimit._deadline import DECISION_DEADLINE
from aiolimit._decision import Decision
from aiolimit._lease import Lease
from aiolimit._rules import IdentifierPlan
from aiolimit._stores.base import Store

T = TypeVar("T")
logger = logging.getLogger("aiolimit")

#: Seconds an undo (or a lease release) may take, retries included, once its caller is gone.
UNDO_BUDGET = 5.0


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


def group_by_slot(plans: Sequence[IdentifierPlan], slot_of: Any) -> list[Sequence[IdentifierPlan]]:
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
    """Decides over any set of identifier plans on ``store``, judged by ``clock``."""

    def __init__(self, store: Store, clock: Clock, *, penalty: bool = False) -> None:
        self._store = store
        self._clock = clock
        self._slack_ms = clock.ttl_slack_ms
        self._penalty = penalty
        # A store that may resend a call after a lost reply gets an op id on every charging
        # call, which the script applies once.
        self._always_op_ids = store.retries_calls
        self.statistics = ProtocolStatistics()
        self._tasks: set[asyncio.Task[Any]] = set()

    # --- the calls --------------------------------------------------------------------------

    def _groups(self, plans: Sequence[IdentifierPlan]) -> list[Sequence[IdentifierPlan]]:
        if self._store.single_slot:
            return [plans]
        return group_by_slot(plans, self._store.slot)

    def _calls(
        self, mode: Mode, groups: Sequence[Sequence[IdentifierPlan]], weight: int,
        now_us: int | None, op: str = "", max_wait_us: int = 0,
    ) -> list[Call]:  # fmt: skip
        slack, penalty = self._slack_ms, self._penalty
        return [
            encode(mode, group, weight, now_us, slack, op, penalty, max_wait_us) for group in groups
        ]

    async def _replies(self, calls: Sequence[Call]) -> list[Reply]:
        results = await self._store.run(calls)
        error = _first_error(results)
        if error is not None:
            raise error
        return [decode(call, result) for call, result in zip(calls, results, strict=True)]  # type: ignore[arg-type]

    # --- decisions --------------------------------------------------------------------------

    async def decide(
        self, mode: Mode, plans: Sequence[IdentifierPlan], weight: int, op: str = "",
        max_wait_us: int = 0,
    ) -> Decision:  # fmt: skip
        """Runs ``mode`` (see ``lua/decide.lua``) over every plan, all or nothing.

        ``max_wait_us`` > 0 lets queueable (GCRA) pairs reserve a turn within that wait; the
        delay comes back as the pairs' ``retry_after`` on an allowed decision.
        """
        now_us = await self._clock.now_us()
        if not op and self._always_op_ids and mode.writes:
            op = new_op_id()
        groups = self._groups(plans)
        if len(groups) == 1:
            self.statistics.single_slot += 1
            calls = self._calls(mode, groups, weight, now_us, op, max_wait_us)
            return _merge(await self._replies(calls))
        self.statistics.multi_slot += 1
        counts = self.statistics.slots_per_call
        counts[len(groups)] = counts.get(len(groups), 0) + 1
        if mode is not ACQUIRE:
            # check and refund touch each slot independently; there is nothing to undo.
            calls = self._calls(mode, groups, weight, now_us, op, max_wait_us)
            return _merge(await self._replies(calls))
        return await self._two_phase(groups, weight, now_us, op or new_op_id(), max_wait_us)

    async def acquire(
        self, plans: Sequence[IdentifierPlan], weight: int, max_wait_us: int = 0
    ) -> Decision:
        """Admits and charges, or charges nothing; an admission under a ``Concurrency`` limit
        carries its ``Lease``.

        A lease-taking call that fails or whose caller goes away may still have taken its
        lease on the server: it is undone in the background (an undo of an op never applied
        only tombstones it).
        """
        leases = any(plan.has_leases for plan in plans)
        op = new_op_id() if leases or max_wait_us else ""
        try:
            result = await self.decide(ACQUIRE, plans, weight, op, max_wait_us)
        except BaseException:
            if leases:
                self._spawn(self._undo_op(plans, weight, op))
            raise
        if leases and result.allowed:
            result = replace(result, lease=Lease(self, plans, weight, op))
        return result

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
            results = await self._store.run(calls)
        except BaseException:
            # Cancelled or out of time with the commits in flight: any of them may have
            # charged. Undo every slot (an undo of an op never applied only tombstones it).
            self.statistics.compensations += 1
            self._spawn(self._compensate(calls, weight, op))
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
        await self._shielded(self._compensate(undo, weight, op))
        if error is not None:
            raise error
        return _merge([reply for reply in replies if reply is not None])

    # --- undo, release, renew ---------------------------------------------------------------

    async def _compensate(self, calls: Sequence[Call], weight: int, op: str) -> None:
        """Undoes ``op`` on the slots of ``calls``; raises the first error."""
        try:
            now_us = await self._clock.now_us()
            undos = [encode(UNDO, call.plans, weight, now_us, self._slack_ms, op) for call in calls]
            error = _first_error(await self._store.run(undos))
        except Exception as exc:
            error = exc
        if error is not None:
            self.statistics.compensation_errors += 1
            raise error

    async def _undo_op(self, plans: Sequence[IdentifierPlan], weight: int, op: str) -> None:
        """Undoes ``op`` over ``plans``, whatever their slots (a lease whose caller left)."""
        try:
            await self.decide(UNDO, plans, weight, op)
        except Exception as error:  # the lease then expires by its TTL
            logger.warning("aiolimit: could not undo op %s: %s", op, error)

    async def lease_call(
        self, mode: Mode, plans: Sequence[IdentifierPlan], weight: int, op: str
    ) -> Decision:
        """Releases or renews the leases of ``op``; a release finishes even if its caller
        is cancelled."""
        assert mode in (RELEASE, RENEW)
        if mode is RENEW:
            return await self.decide(RENEW, plans, weight, op)
        return await self._shielded(self.decide(RELEASE, plans, weight, op))

    def _spawn(self, work: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Runs ``work`` in a task of its own with a budget of its own (``UNDO_BUDGET``)."""

        async def bounded() -> T:
            DECISION_DEADLINE.set(time.monotonic() + UNDO_BUDGET)
            async with asyncio.timeout(UNDO_BUDGET):
                return await work

        task = asyncio.ensure_future(bounded())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_retrieve)
        return task

    async def _shielded(self, work: Coroutine[Any, Any, T]) -> T:
        """Runs ``work`` to its end: a cancellation of the caller stops the wait, not the work."""
        return await asyncio.shield(self._spawn(work))

    async def aclose(self) -> None:
        """Waits for the undos and releases still running (each within its budget)."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


def _retrieve(task: asyncio.Task[Any]) -> None:
    """Marks a background task's error as seen (its waiter, if any, got it already)."""
    if not task.cancelled():
        task.exception()
