"""The running decision's deadline, shared by the failure policy, the stores and the clocks.

While a decision runs, ``DECISION_DEADLINE`` holds the absolute ``time.monotonic()`` by which
it must be done, or ``None`` when the limiter has no deadline. A store that retries starts no
retry or backoff that would end past it; work that must outlive the decision (an undo) runs in
a task of its own that sets its own budget here. Child tasks inherit the variable with the
context.
"""

from __future__ import annotations

import time
from contextvars import ContextVar

#: Absolute ``time.monotonic()`` by which the running decision must be done (None: no limit).
DECISION_DEADLINE: ContextVar[float | None] = ContextVar("aiolimit_decision_deadline", default=None)


def current_deadline() -> float | None:
    """The running decision's absolute deadline (``time.monotonic()``), if any."""
    return DECISION_DEADLINE.get()


def time_left() -> float | None:
    """Seconds left before the running decision's deadline (may be <= 0); None if unbounded."""
    deadline = DECISION_DEADLINE.get()
    return None if deadline is None else deadline - time.monotonic()
