"""The limiter: the public face that validates, asks the protocol, and waits when told to."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Generator, Sequence
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any, Literal

from aiolimit._clock import Clock
from aiolimit._decision import Decision
from aiolimit._errors import BackendError, ConfigurationError, RateLimited
from aiolimit._failure import BreakerStatistics, CircuitBreaker, FailurePolicy, OnError
from aiolimit._keys import check_prefix
from aiolimit._lease import Lease
from aiolimit._protocol import Protocol, new_op_id
from aiolimit._rules import IdentifierPlan, LimitsArg, Rules, check_weight
from aiolimit._stores import default_deadline, open_store
from aiolimit._stores.base import Store
from aiolimit._wire import ACQUIRE, CHECK, REFUND, UNDO, Call

logger = logging.getLogger("aiolimit")

# acquire reserves a GCRA turn at most this far ahead (also keeps the scaled values exact).
MAX_RESERVATION_US = 3_600_000_000

Identifiers = str | Sequence[str]


@dataclass(frozen=True, slots=True)
class LimiterStatistics:
    """Counters kept by this limiter object (this process only)."""

    decisions: int
    allowed: int
    refused: int
    errors: int
    waits: int
    multi_slot_decisions: int
    compensations: int
    #: The failure policy's circuit breaker: state and counters (see ``aiolimit._failure``).
    breaker: BreakerStatistics


class Limiter:
    """Rate limits several identifiers under several limits each, all or nothing.

    ``store`` is a URL (``redis://``, ``rediss://``, ``unix://``, ``memory://``) or a
    ``redis.asyncio.Redis`` client you own. ``limits`` is a list of limits for every identifier,
    or a mapping from identifier kind (the text before the first ``:``) to limits, with ``"*"``
    as the default rule.
    """

    def __init__(
        self,
        store: str | Any,
        limits: LimitsArg,
        *,
        prefix: str = "aiolimit",
        clock: Clock | None = None,
        count_refused: bool = False,
        socket_timeout: float = 2.0,
        deadline: float | Literal["auto"] | None = "auto",
        on_error: OnError = "raise",
        failure_threshold: int = 5,
        recovery_time: float = 1.0,
    ) -> None:
        # Failure policy (aiolimit._failure): each decision gets `deadline` seconds ("auto":
        # 1 s, or 5 s on a cluster so a failover is ridden through); a store
        # failure raises, admits ("open") or refuses ("closed") with degraded=True; after
        # `failure_threshold` failures in a row the breaker stops asking the store for
        # `recovery_time` seconds, then probes.
        self._failure = FailurePolicy(
            deadline=default_deadline(store) if deadline == "auto" else deadline,
            on_error=on_error,
            breaker=CircuitBreaker(failure_threshold, recovery_time),
        )
        if not isinstance(count_refused, bool):
            raise ConfigurationError(f"count_refused must be a bool, got {count_refused!r}")
        self._rules = Rules(limits, check_prefix(prefix))
        self._store: Store = open_store(
            store,
            socket_timeout=socket_timeout,
            bounded_by_deadline=self._failure.deadline_seconds is not None,
        )
        self._failure.address = self._store.address
        self.clock: Clock = clock if clock is not None else self._store.default_clock()
        if not isinstance(self.clock, Clock):
            raise ConfigurationError(f"clock must implement aiolimit.Clock, got {clock!r}")
        self._protocol = Protocol(
            self._run,
            self._store.slot,
            self.clock.ttl_slack_ms,
            count_refused,
            always_op_ids=self._store.retries_calls,
            single_slot=self._store.single_slot,
        )
        self._background: set[asyncio.Task[None]] = set()
        self._counts = {"decisions": 0, "allowed": 0, "refused": 0, "errors": 0, "waits": 0}

    @property
    def store(self) -> Store:
        return self._store

    @property
    def limits(self) -> dict[str, tuple[Any, ...]]:
        """The rules: identifier kind -> limits."""
        return dict(self._rules.by_kind)

    async def _run(self, calls: Sequence[Call]) -> list[list[int] | BaseException]:
        if len(calls) == 1:
            call = calls[0]
            return [await self._store.run(call.keys, call.args)]
        return await self._store.run_many([(call.keys, call.args) for call in calls])

    async def _decide(
        self, mode: str, ids: Identifiers, weight: int, op: str = "", max_wait_us: int = 0,
        plans: list[IdentifierPlan] | None = None,
    ) -> Decision:  # fmt: skip
        if plans is None:
            plans = self._rules.plans(ids)
            check_weight(weight, plans)
        failure = self._failure
        if not failure.breaker.allow():
            return failure.short_circuit()
        try:
            async with failure.deadline():
                now = await self.clock.now_us()
                decision = await self._protocol.decide(mode, plans, weight, now, op, max_wait_us)
        except BackendError as exc:
            self._counts["errors"] += 1
            return failure.failed(exc)
        except BaseException:
            self._counts["errors"] += 1
            failure.breaker.record_abandoned()
            raise
        failure.breaker.record_success()
        return decision

    async def try_acquire(self, ids: Identifiers, weight: int = 1) -> Decision:
        """Admits and charges ``weight`` on every pair if all have room; never waits.

        Under a ``Concurrency`` limit an admitted decision carries a ``lease`` to release.
        """
        plans = self._rules.plans(ids)
        check_weight(weight, plans)
        decision, _ = await self._try(plans, weight, 0)
        return decision

    async def _try(
        self, plans: list[IdentifierPlan], weight: int, max_wait_us: int
    ) -> tuple[Decision, str]:
        leases = any(plan.has_leases for plan in plans)
        op = new_op_id() if leases or max_wait_us else ""
        try:
            decision = await self._decide(ACQUIRE, (), weight, op, max_wait_us, plans)
        except BaseException:
            if leases:  # the script may have taken the lease before the caller went away
                await self._undo(plans, weight, op)
            raise
        if leases and decision.degraded:  # the store may still apply it after the deadline
            self._spawn_undo(plans, weight, op)
        counts = self._counts
        counts["decisions"] += 1
        counts["allowed" if decision.allowed else "refused"] += 1
        if leases and decision.allowed and not decision.degraded:

            async def lease_call(mode: str, op_id: str) -> object:
                now = await self.clock.now_us()
                return await self._protocol.decide(mode, plans, weight, now, op_id)

            decision = replace(decision, lease=Lease(lease_call, op))
        return decision, op

    async def acquire(
        self,
        ids: Identifiers,
        weight: int = 1,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - the documented API: it waits
    ) -> Decision:
        """Like ``try_acquire``, but sleeps ``retry_after`` and tries again until admitted.

        ``timeout=None`` waits as long as it takes, ``timeout=0`` never waits. When the next
        chance would come after the timeout, it raises ``RateLimited`` at once rather than
        sleeping in vain.
        """
        if timeout is not None and (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not timeout >= 0  # also rejects NaN
        ):
            raise ConfigurationError(f"timeout must be None or seconds >= 0, got {timeout!r}")
        plans = self._rules.plans(ids)
        check_weight(weight, plans)
        clock = self.clock
        deadline = None if timeout is None else clock.monotonic() + timeout
        # When every limit is a GCRA bucket, a waiter reserves its turn (charged now, admitted
        # after the delay): waiters are served in arrival order with one call each, instead
        # of all waking at once and retrying.
        queueable = timeout != 0 and all(plan.queueable for plan in plans)
        virtual = bool(getattr(clock, "virtual", False))
        while True:
            max_wait_us = 0
            if queueable:
                left = MAX_RESERVATION_US if deadline is None else deadline - clock.monotonic()
                max_wait_us = max(0, min(MAX_RESERVATION_US, int(left * 1_000_000)))
            started_us = await clock.now_us() if virtual else None
            decision, op = await self._try(plans, weight, max_wait_us)
            # On a virtual clock (ManualClock) other tasks may have moved time while this
            # call was in flight; waits count from the decision, in whole µs.
            elapsed_us = 0
            if started_us is not None:
                elapsed_us = ((await clock.now_us()) or started_us) - started_us
            if decision.allowed:
                delay_us = max((round(p.retry_after * 1e6) for p in decision.details), default=0)
                if delay_us > elapsed_us and not decision.degraded:
                    await self._wait_reservation(plans, weight, op, (delay_us - elapsed_us) / 1e6)
                return decision
            wait = max(round(decision.retry_after * 1e6) - elapsed_us, 0) / 1e6
            if deadline is not None and clock.monotonic() + wait > deadline:
                raise RateLimited(decision)
            self._counts["waits"] += 1
            # A tiny margin: the server rounds to microseconds and its clock ticks on.
            await clock.sleep(wait + (0.0 if virtual else 0.000_5))

    def _spawn_undo(self, plans: list[IdentifierPlan], weight: int, op: str) -> asyncio.Task[None]:
        task = asyncio.ensure_future(self._undo_now(plans, weight, op))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _undo(self, plans: list[IdentifierPlan], weight: int, op: str) -> None:
        """Undoes ``op`` in a task of its own, so a cancelled caller cannot stop it."""
        await asyncio.shield(self._spawn_undo(plans, weight, op))

    async def _undo_now(self, plans: list[IdentifierPlan], weight: int, op: str) -> None:
        try:
            now = await self.clock.now_us()
            await self._protocol.decide(UNDO, plans, weight, now, op)
        except Exception as error:  # the lease then expires by its TTL
            logger.warning("aiolimit: could not undo op %s: %r", op, error)

    async def _wait_reservation(
        self, plans: list[IdentifierPlan], weight: int, op: str, delay: float
    ) -> None:
        """Sleeps until a reserved turn.

        A waiter cancelled meanwhile does not give its turn back: later waiters' turns were
        counted after it, so returning a turn in the middle of the queue would let two of
        them through at once. The turn stays a gap.
        """
        self._counts["waits"] += 1
        await self.clock.sleep(delay)

    def limit(
        self, ids: Identifiers, weight: int = 1, *, timeout: float | None = None
    ) -> Acquisition:
        """``async with limiter.limit(ids) as decision:`` or ``await limiter.limit(ids)``."""
        return Acquisition(self, ids, weight, timeout)

    async def peek(self, ids: Identifiers, weight: int = 1) -> Decision:
        """The decision ``try_acquire`` would make now, charging nothing."""
        return await self._decide(CHECK, ids, weight)

    async def refund(self, ids: Identifiers, weight: int = 1) -> Decision:
        """Gives ``weight`` back on every pair (newest charges first, never below zero)."""
        plans = self._rules.plans(ids)
        check_weight(weight, [])
        self._failure.check_open()
        async with self._failure.deadline():
            now = await self.clock.now_us()
            return await self._protocol.decide(REFUND, plans, weight, now)

    async def reset(self, ids: Identifiers) -> None:
        """Forgets everything stored for these identifiers."""
        plans = self._rules.plans(ids)
        for plan in plans:
            await self._store.delete(plan.keys)

    def statistics(self) -> LimiterStatistics:
        protocol = self._protocol.statistics
        return LimiterStatistics(
            **self._counts,
            multi_slot_decisions=protocol.multi_slot,
            compensations=protocol.compensations,
            breaker=self._failure.statistics(),
        )

    async def aclose(self) -> None:
        """Closes the connections the limiter opened (not a client you passed in)."""
        if self._background:  # undos of leases whose callers went away
            await asyncio.gather(*self._background, return_exceptions=True)
        await self._store.aclose()

    async def __aenter__(self) -> Limiter:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:  # fmt: skip
        await self.aclose()

    def __repr__(self) -> str:
        return f"Limiter({self._store.address!r}, {self._rules.by_kind!r}, clock={self.clock!r})"


class Acquisition:
    """What ``Limiter.limit`` returns: awaitable, and an async context manager."""

    def __init__(
        self, limiter: Limiter, ids: Identifiers, weight: int, timeout: float | None
    ) -> None:
        self._limiter = limiter
        self._ids = ids
        self._weight = weight
        self._timeout = timeout
        self.decision: Decision | None = None

    def __await__(self) -> Generator[Any, None, Decision]:
        return self._limiter.acquire(self._ids, self._weight, timeout=self._timeout).__await__()

    async def __aenter__(self) -> Decision:
        self.decision = await self._limiter.acquire(self._ids, self._weight, timeout=self._timeout)
        return self.decision

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:  # fmt: skip
        # Concurrency leases go back on every exit: normal, error or cancellation.
        if self.decision is not None and self.decision.lease is not None:
            await self.decision.lease.release()
