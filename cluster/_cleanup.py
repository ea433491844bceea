"""Stop, at interpreter exit, whatever this process started and did not stop itself."""

from __future__ import annotations

import atexit
import contextlib
import threading
from typing import Protocol


class _Stoppable(Protocol):
    def stop(self) -> None: ...


_lock = threading.Lock()
_alive: dict[int, _Stoppable] = {}
_hooked = False


def stop_at_exit(owner: _Stoppable) -> None:
    """Make sure `owner.stop()` runs at exit unless forget() was called first."""
    global _hooked
    with _lock:
        _alive[id(owner)] = owner
        if not _hooked:
            atexit.register(_stop_all)
            _hooked = True


def forget(owner: _Stoppable) -> None:
    """Called by stop(): nothing left to clean up for `owner`."""
    with _lock:
        _alive.pop(id(owner), None)


def _stop_all() -> None:
    with _lock:
        owners = list(_alive.values())
    for owner in owners:
        # Best effort at exit: one failure must not leave the other servers running.
        with contextlib.suppress(Exception):
            owner.stop()
