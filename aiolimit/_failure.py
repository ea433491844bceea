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
for the stores' retries; the limiter enforces it anyway with ``asyncio.timeout``, so a store
that ignores it is cut off.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
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
        return self.recovery_time if self.state == "half_open" else 0.0

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


class _DeadlineScope:
    """``async with policy.deadline():`` asyncio's timeout plus the DECISION_DEADLINE variable.

    Exceeding it raises ``BackendUnavailable`` (its ``__cause__`` is a ``TimeoutError``).
    ``asyncio.timeout`` costs one timer handle; it is on every decision's path.
    """

    __slots__ = ("_address", "_seconds", "_timeout", "_token")

    def __init__(self, seconds: float, address: str) -> None:
        self._seconds = seconds
        self._address = address
        self._timeout = asyncio.timeout(seconds)
        self._token: Token[float | None] | None = None

    async def __aenter__(self) -> None:
        self._token = DECISION_DEADLINE.set(time.monotonic() + self._seconds)
        await self._timeout.__aenter__()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:  # fmt: skip
        try:
            await self._timeout.__aexit__(exc_type, exc, tb)
            return False  # asyncio's timeout never swallows an exception
        except TimeoutError as timeout:
            raise DeadlineExceeded(
                f"store at {self._address} gave no decision within the deadline of "
                f"{self._seconds:g}s"
            ) from timeout
        finally:
            if self._token is not None:
                DECISION_DEADLINE.reset(self._token)


class _NoDeadline:
    __slots__ = ()

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc_info: object) -> None:
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
        self.on_error: OnError = on_error
        #: The breaker of the whole store; a cluster node gets one of its own, alike
        #: (``breaker_for``), so a frozen node's failures refuse only what needs that node.
        self.breaker = breaker if breaker is not None else CircuitBreaker()
        self._breakers: dict[str, CircuitBreaker] = {"": self.breaker}
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
        return _NO_DEADLINE if seconds is None else _DeadlineScope(seconds, self.address)

    def short_circuit(self) -> Decision:
        """The answer while the breaker is open: the policy's, or ``BackendUnavailable``."""
        return self._answer(BackendUnavailable("circuit breaker open: the store is not asked"))

    def failed(
        self, error: BackendError, breakers: tuple[CircuitBreaker, ...] | None = None
    ) -> Decision:
        """Records a store failure on ``breakers`` (default: the store's); returns the
        policy's degraded decision or re-raises. An error that names its fault domain counts
        against that domain's breaker only; the others just give up their probe."""
        if isinstance(error, DeadlineExceeded):
            self.timeouts += 1
        if breakers is None:
            breakers = (self.breaker,)
        domain = getattr(error, "fault_domain", None)
        blamed = [b for b in breakers if b.name == domain] or list(breakers)
        for breaker in breakers:
            if breaker in blamed:
                breaker.record_failure(error)
            else:
                breaker.record_abandoned()
        return self._answer(error)

    def check_open(self) -> None:
        """For calls without a degraded answer (refund): fail fast while the breaker is open.

        Such calls never take the half-open probe slot, and their outcome is not recorded.
        """
        if self.breaker.state == "open" and self.breaker.retry_after() > 0:
            raise BackendUnavailable("circuit breaker open: the store is not asked")

    def _answer(self, error: BackendError) -> Decision:
        on_error = self.on_error
        if on_error == "raise":
            _reraise(error)
        self.degraded += 1
        self._log_degraded(error)
        if on_error == "open":
            return Decision(True, 0, 0.0, 0.0, None, None, (), degraded=True)
        wait = max(self.breaker.retry_after(), 0.001)
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

    def statistics(self) -> BreakerStatistics:
        """Every breaker together: the worst state, the counters summed."""
        breakers = list(self._breakers.values())
        worst = max(breakers, key=lambda b: _SEVERITY[b.state])
        return BreakerStatistics(
            state=worst.state,
            failures=sum(b.failures for b in breakers),
            opened=sum(b.opened for b in breakers),
            short_circuited=sum(b.short_circuited for b in breakers),
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
