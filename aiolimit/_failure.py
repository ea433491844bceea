"""The failure policy: a deadline per decision, what to answer when the store fails, and a
circuit breaker that stops paying that deadline while the store is down.

- **Deadline.** Every decision (``try_acquire``, one round of ``acquire``, ``peek``,
  ``refund``) must finish within ``deadline`` seconds, or it fails with ``BackendUnavailable``.
  A stopped Redis accepts TCP and then never answers; without a deadline each request would
  hang until the socket timeout.
- **Policy** (``on_error``): ``"raise"`` lets the ``BackendError`` through; ``"open"`` admits
  and marks the decision ``degraded``; ``"closed"`` refuses and marks it ``degraded`` (the web
  integrations answer 503, never 429: a store failure is not "limited").
- **Breaker.** After ``failure_threshold`` failures in a row it opens: decisions get the
  policy's answer at once, without touching the store. After ``recovery_time`` seconds one
  decision is let through as a probe (half-open); its success closes the breaker, its failure
  opens it again for another ``recovery_time``. One log line (logger ``"aiolimit"``) per state
  change.

While a decision runs its deadline is published in ``aiolimit._deadline.DECISION_DEADLINE``
for the stores' retries; the limiter enforces it anyway (one timer per policy and loop,
``_DeadlineWheel``), so a store that ignores it is cut off.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from contextvars import Token
from dataclasses import dataclass
from types import TracebackType
from typing import Literal, NoReturn

from aiolimit._deadline import DECISION_DEADLINE
from aiolimit._decision import Decision
from aiolimit._errors import BackendError, BackendUnavailable, ConfigurationError
from aiolimit._validation import check_int, check_optional_seconds, check_seconds

OnError = Literal["open", "closed", "raise"]
ON_ERROR_CHOICES = ("open", "closed", "raise")
BreakerState = Literal["closed", "open", "half_open"]

logger = logging.getLogger("aiolimit")
#: Degraded decisions are logged at most once per this many seconds (with their count).
DEGRADED_LOG_INTERVAL = 10.0


class DeadlineExceeded(BackendUnavailable):
    """The decision did not finish within the limiter's deadline (private: catch the parent)."""


@dataclass(frozen=True, slots=True)
class BreakerStatistics:
    """The breaker's state and counters (this process only)."""

    state: BreakerState
    #: Store failures seen (timeouts included), whether or not they opened the breaker.
    failures: int
    #: Times the breaker went from closed or half-open to open.
    opened: int
    #: Decisions answered by the policy without asking the store (breaker open).
    short_circuited: int
    #: Decisions answered by the policy (``degraded=True``), short-circuited or failed.
    degraded: int
    #: Decisions that hit the deadline.
    timeouts: int


class CircuitBreaker:
    """Closed -> open after ``failure_threshold`` failures in a row; one probe after
    ``recovery_time`` seconds (half-open) closes it or opens it again.

    Not thread-safe: one breaker belongs to one event loop, like the limiter that owns it.
    """

    def __init__(
        self, failure_threshold: int = 5, recovery_time: float = 1.0, *, name: str = ""
    ) -> None:
        #: What it guards: "" for the whole store, else one cluster node ("host:port").
        self.name = name
        self.failure_threshold = check_int("failure_threshold", failure_threshold, 1, 10**6)
        self.recovery_time = check_seconds("recovery_time", recovery_time, 0, 3600, open_low=True)
        self.state: BreakerState = "closed"
        self._consecutive = 0
        self._opened_at = 0.0
        self._probing = False
        self.failures = 0
        self.opened = 0
        self.short_circuited = 0

    def allow(self) -> bool:
        """True if the store may be asked now; the caller then reports success or failure."""
        if self.state == "closed":
            return True
        if self._probing:
            self.short_circuited += 1
            return False
        if self.state == "open" and time.monotonic() - self._opened_at < self.recovery_time:
            self.short_circuited += 1
            return False
        # Open long enough (or half-open with no probe in flight): this call is the probe.
        if self.state == "open":
            self._set_state("half_open", "probing the store")
        self._probing = True
        return True

    def retry_after(self) -> float:
        """Seconds until the breaker will let a probe through (a hint for refused callers)."""
        if self.state == "open":
            return max(0.0, self._opened_at + self.recovery_time - time.monotonic())
        if self.state == "half_open" and self._probing:
            return self.recovery_time  # (the probe in flight ends by then, or opens it again)
        return 0.0

    def record_success(self) -> None:
        self._consecutive = 0
        if self.state != "closed":
            self._probing = False
            self._set_state("closed", "the store answered")

    def record_failure(self, error: BaseException) -> None:
        self.failures += 1
        self._consecutive += 1
        if self.state == "half_open" or (
            self.state == "closed" and self._consecutive >= self.failure_threshold
        ):
            self._probing = False
            self._opened_at = time.monotonic()
            self.opened += 1
            self._set_state(
                "open",
                f"{self._consecutive} failure(s) in a row, last: {error}; "
                f"next probe in {self.recovery_time:g}s",
            )

    def record_abandoned(self) -> None:
        """The call was cancelled from outside before it could tell: free the probe slot."""
        self._probing = False

    def _set_state(self, state: BreakerState, why: str) -> None:
        previous, self.state = self.state, state
        level = logging.WARNING if state == "open" else logging.INFO
        where = f" for {self.name}" if self.name else ""
        logger.log(level, "aiolimit circuit breaker%s %s -> %s: %s", where, previous, state, why)

    def __repr__(self) -> str:
        return (
            f"CircuitBreaker(failure_threshold={self.failure_threshold}, "
            f"recovery_time={self.recovery_time:g}, state={self.state!r})"
        )


class _DeadlineWheel:
    """The deadlines of every decision running under one policy on one event loop, watched by
    one timer.

    ``asyncio.timeout`` costs each decision a timer handle, a push on the loop's heap (whose
    comparisons run in Python) and a cancel: about 5 µs of CPU a decision with 64 in flight,
    a seventh of a decision's client work. A policy's deadlines all have the same length,
    so they come due in the order their decisions began: a queue in that order, whose head is
    the next due, needs one timer for all of them. A decision that ends marks itself done
    and lets go of its task; the timer drops such entries when it next fires, and once they
    are most of the queue (and over ``COMPACT_AFTER``) the queue keeps only the running ones,
    as asyncio does with its cancelled timers: the queue stays within twice the decisions in
    flight, whatever the deadline's length.
    """

    __slots__ = ("_armed", "_finished", "_loop", "_queue")

    COMPACT_AFTER = 64

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: deque[_DeadlineScope] = deque()
        self._armed: _DeadlineScope | None = None  # the entry the timer is set for
        self._finished = 0  # entries of decisions that ended in time, still in the queue

    def add(self, scope: _DeadlineScope) -> None:
        self._queue.append(scope)
        if self._armed is None:
            self._arm(scope)

    def finished(self) -> None:
        """A decision ended before its deadline (its entry stays until dropped)."""
        self._finished += 1
        queue = self._queue
        if self._finished > self.COMPACT_AFTER and 2 * self._finished > len(queue):
            self._queue = deque(scope for scope in queue if scope.running)
            self._finished = 0

    def _arm(self, scope: _DeadlineScope) -> None:
        self._armed = scope
        self._loop.call_at(scope.due, self._fire)

    def _fire(self) -> None:
        armed, self._armed = self._armed, None
        assert armed is not None
        queue = self._queue
        # Entries up to the one the timer was set for are due (the loop judged it so; the
        # ones before it came due no later); a running one expires. Then the finished
        # entries at the head go, and the timer is set for the first one still running.
        due = armed.due
        while queue:
            scope = queue[0]
            if scope.running and scope.due > due:
                self._arm(scope)
                return
            queue.popleft()
            if scope.running:
                scope.expire()
            elif not scope.expired:
                self._finished -= 1


class _DeadlineScope:
    """``async with policy.deadline():`` bounds one decision, and publishes its deadline in
    DECISION_DEADLINE meanwhile.

    Exceeding it cancels the decision's task, and the scope raises ``BackendUnavailable``
    (``DeadlineExceeded``; its ``__cause__`` is a ``TimeoutError``) as ``asyncio.timeout``
    would raise ``TimeoutError``: only for its own cancellation. A cancellation from
    elsewhere (the caller's, an outer timeout's) stays a ``CancelledError``. The timer is
    the policy's ``_DeadlineWheel``.
    """

    __slots__ = ("_address", "_cancelling", "_seconds", "_task", "_token", "_wheel", "due",
                 "expired", "running")  # fmt: skip

    def __init__(self, seconds: float, address: str, wheel: _DeadlineWheel) -> None:
        self._seconds = seconds
        self._address = address
        self._wheel = wheel
        self._token: Token[float | None] | None = None
        self._task: asyncio.Task[object] | None = None
        self._cancelling = 0
        self.due = 0.0  # in the loop's time
        self.running = False
        self.expired = False

    async def __aenter__(self) -> None:
        self.enter()

    def enter(self) -> None:
        """Starts the scope (what ``__aenter__`` does, without a coroutine: the limiter's own
        decision path calls ``enter`` and ``leave`` around its await)."""
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a decision's deadline needs a running task")
        self._task = task
        self._cancelling = task.cancelling()
        self._token = DECISION_DEADLINE.set(time.monotonic() + self._seconds)
        self.due = self._wheel._loop.time() + self._seconds
        self.running = True
        self._wheel.add(self)

    def expire(self) -> None:
        """The deadline passed with the decision still running: cancel its task."""
        self.running = False
        self.expired = True
        assert self._task is not None
        self._task.cancel()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:  # fmt: skip
        self.leave(exc_type)
        return False

    def leave(self, exc_type: type[BaseException] | None) -> None:
        """Ends the scope, the decision having ended with ``exc_type`` (None: it returned).
        Raises ``DeadlineExceeded`` where the decision was cancelled by this deadline."""
        self.running = False
        task, self._task = self._task, None  # (the entry may outlive the decision a while)
        try:
            if not self.expired:
                self._wheel.finished()
            elif (
                task is not None
                and task.uncancel() <= self._cancelling
                and exc_type is not None
                and issubclass(exc_type, asyncio.CancelledError)
            ):
                raise DeadlineExceeded(
                    f"store at {self._address} gave no decision within the deadline of "
                    f"{self._seconds:g}s"
                ) from TimeoutError()
        finally:
            if self._token is not None:
                DECISION_DEADLINE.reset(self._token)


class _NoDeadline:
    __slots__ = ()

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc_info: object) -> None:
        return None

    def enter(self) -> None:
        return None

    def leave(self, exc_type: type[BaseException] | None) -> None:
        return None


_NO_DEADLINE = _NoDeadline()


class FailurePolicy:
    """What a limiter does when its store fails: deadline, ``on_error`` and breaker together."""

    def __init__(
        self,
        *,
        deadline: float | None = 1.0,
        on_error: OnError = "raise",
        breaker: CircuitBreaker | None = None,
    ) -> None:
        if on_error not in ON_ERROR_CHOICES:
            raise ConfigurationError(
                f"on_error must be one of {', '.join(map(repr, ON_ERROR_CHOICES))}, "
                f"got {on_error!r}"
            )
        self.deadline_seconds = check_optional_seconds("deadline", deadline, 0, 3600, open_low=True)
        self._wheels: dict[tuple[asyncio.AbstractEventLoop, float], _DeadlineWheel] = {}
        self._last_wheel: _DeadlineWheel | None = None  # the one used last, and its seconds
        self._last_seconds = 0.0
        self.on_error: OnError = on_error
        #: The breaker of the whole store; a cluster node gets one of its own, alike
        #: (``breaker_for``), so a frozen node's failures refuse only what needs that node.
        self.breaker = breaker if breaker is not None else CircuitBreaker()
        self._breakers: dict[str, CircuitBreaker] = {"": self.breaker}
        #: The counters of the breakers ``forget_domains`` dropped (its state is unused).
        self._retired = CircuitBreaker(name="retired")
        self.degraded = 0
        self.timeouts = 0
        #: The store's address, for messages (set by the limiter once its store is open).
        self.address = "the store"
        self._logged_at = -math.inf
        self._unlogged = 0

    def breaker_for(self, domain: str) -> CircuitBreaker:
        """The breaker of one fault domain ("" is the whole store)."""
        breaker = self._breakers.get(domain)
        if breaker is None:
            template = self.breaker
            breaker = CircuitBreaker(
                template.failure_threshold, template.recovery_time, name=domain
            )
            self._breakers[domain] = breaker
        return breaker

    def deadline(self) -> _DeadlineScope | _NoDeadline:
        """A fresh ``async with`` scope bounding one decision (shared no-op when unbounded)."""
        seconds = self.deadline_seconds
        if seconds is None:
            return _NO_DEADLINE
        return _DeadlineScope(seconds, self.address, self._wheel(seconds))

    def _wheel(self, seconds: float) -> _DeadlineWheel:
        """The deadline timer of this policy's decisions on the running loop."""
        loop = asyncio.get_running_loop()
        last = self._last_wheel
        if last is not None and last._loop is loop and self._last_seconds == seconds:
            return last
        wheel = self._find_wheel(loop, seconds)
        self._last_wheel, self._last_seconds = wheel, seconds
        return wheel

    def _find_wheel(self, loop: asyncio.AbstractEventLoop, seconds: float) -> _DeadlineWheel:
        wheels = self._wheels
        wheel = wheels.get((loop, seconds))
        if wheel is None:
            # A limiter not bound to a loop (memory://) may meet several, one after another.
            for key in [key for key in wheels if key[0].is_closed()]:
                del wheels[key]
            wheel = wheels[loop, seconds] = _DeadlineWheel(loop)
        return wheel

    def short_circuit(self, breakers: tuple[CircuitBreaker, ...] | None = None) -> Decision:
        """The answer while a breaker of ``breakers`` (default: the store's) is open: the
        policy's, or ``BackendUnavailable``."""
        return self._answer(
            BackendUnavailable("circuit breaker open: the store is not asked"),
            (self.breaker,) if breakers is None else breakers,
        )

    def failed(
        self, error: BackendError, breakers: tuple[CircuitBreaker, ...] | None = None
    ) -> Decision:
        """Records a store failure on ``breakers`` (default: the store's); returns the
        policy's degraded decision or re-raises. An error that names its fault domain counts
        against that domain's breaker only; the others just give up their probe.

        Only a store that did not answer (``BackendUnavailable``: no connection, no reply by
        the deadline, the cluster down) counts as a failure: the breaker is there to stop
        paying the deadline while the store is down. An error the store answered with (a key
        another program clobbered, WRONGTYPE; a script error) concerns that call: it comes
        back at once, and five of them must not cut every other identifier off the store.
        Such an answer shows the store is up, as a success does. An answer that any call
        would get now (``store_wide``: out of memory, READONLY, BUSY) does count: the store
        is as good as down, for every identifier."""
        if isinstance(error, DeadlineExceeded):
            self.timeouts += 1
        if breakers is None:
            breakers = (self.breaker,)
        if not isinstance(error, BackendUnavailable) and not error.store_wide:
            for breaker in breakers:
                breaker.record_success()
            return self._answer(error, breakers)
        domain = getattr(error, "fault_domain", None)
        blamed = [b for b in breakers if b.name == domain] or list(breakers)
        for breaker in breakers:
            if breaker in blamed:
                breaker.record_failure(error)
            else:
                breaker.record_abandoned()
        return self._answer(error, breakers)

    def check_open(self, breakers: tuple[CircuitBreaker, ...] | None = None) -> None:
        """For calls without a degraded answer (refund): fail fast while a breaker of
        ``breakers`` (default: the store's; on a cluster, the nodes' the call needs) is open.

        Such calls never take the half-open probe slot, and their outcome is not recorded.
        """
        for breaker in (self.breaker,) if breakers is None else breakers:
            if breaker.state == "open" and breaker.retry_after() > 0:
                raise BackendUnavailable("circuit breaker open: the store is not asked")

    def _answer(self, error: BackendError, breakers: tuple[CircuitBreaker, ...]) -> Decision:
        """The policy's decision. A refusal's ``retry_after`` is when the last of the
        decision's ``breakers`` lets a probe through: on a cluster the breaker that is open
        is a node's, and the store's own (never used there) would say "now", sending
        ``acquire`` back to the breaker every millisecond."""
        on_error = self.on_error
        if on_error == "raise":
            _reraise(error)
        self.degraded += 1
        self._log_degraded(error)
        if on_error == "open":
            return Decision(True, 0, 0.0, 0.0, None, None, (), degraded=True)
        wait = max(max(breaker.retry_after() for breaker in breakers), 0.001)
        return Decision(False, 0, wait, wait, None, None, (), degraded=True)

    def _log_degraded(self, error: BackendError) -> None:
        """One WARNING per ``DEGRADED_LOG_INTERVAL`` at most, counting the ones it stands for."""
        now = time.monotonic()
        self._unlogged += 1
        if now - self._logged_at < DEGRADED_LOG_INTERVAL:
            return
        admitted = "admitted" if self.on_error == "open" else "refused"
        logger.warning(
            "aiolimit degraded: %d decision(s) %s without the store (on_error=%r) since the "
            "last report; last error from %s: %s",
            self._unlogged, admitted, self.on_error, self.address, error,
            extra={"aiolimit_event": "degraded", "aiolimit_count": self._unlogged},
        )  # fmt: skip
        self._logged_at = now
        self._unlogged = 0

    def forget_domains(self, serving: frozenset[str]) -> None:
        """Drops the breakers of fault domains not in ``serving`` (nodes that left the
        cluster, or a primary whose replica took over). No decision maps to such a node any
        more, so none would probe its breaker: left open, it would report the store as down
        for good. If the node serves again, it starts with a closed breaker."""
        for domain in [d for d in self._breakers if d and d not in serving]:
            gone = self._breakers.pop(domain)
            retired = self._retired
            retired.failures += gone.failures
            retired.opened += gone.opened
            retired.short_circuited += gone.short_circuited

    def statistics(self) -> BreakerStatistics:
        """Every breaker together: the worst state, the counters summed."""
        breakers = list(self._breakers.values())
        worst = max(breakers, key=lambda b: _SEVERITY[b.state])
        retired = self._retired  # (the counters of breakers dropped: totals never go back)
        return BreakerStatistics(
            state=worst.state,
            failures=retired.failures + sum(b.failures for b in breakers),
            opened=retired.opened + sum(b.opened for b in breakers),
            short_circuited=retired.short_circuited + sum(b.short_circuited for b in breakers),
            degraded=self.degraded,
            timeouts=self.timeouts,
        )

    def __repr__(self) -> str:
        return (
            f"FailurePolicy(deadline={self.deadline_seconds!r}, on_error={self.on_error!r}, "
            f"breaker={self.breaker!r})"
        )


_SEVERITY = {"closed": 0, "half_open": 1, "open": 2}


def _reraise(error: BaseException) -> NoReturn:
    raise error
