"""Poll a condition until it holds; the only way this package waits for anything."""

from __future__ import annotations

import time
from collections.abc import Callable

from cluster._errors import ClusterNotHealthy


def poll_until(check: Callable[[], str | None], *, timeout: float, what: str) -> None:
    """Call `check` until it returns None (done) or `timeout` seconds pass.

    `check` returns a short description of what is still missing; the last one ends up in
    the ClusterNotHealthy message, which is what makes a timeout debuggable.
    """
    deadline = time.monotonic() + timeout
    delay = 0.01
    while True:
        problem = check()
        if problem is None:
            return
        if time.monotonic() >= deadline:
            raise ClusterNotHealthy(f"{what} not reached within {timeout:g} s: {problem}")
        time.sleep(delay)
        delay = min(delay * 1.5, 0.1)
