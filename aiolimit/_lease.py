"""Leases: the concurrency slots an admitted request holds until it releases them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from types import TracebackType

import anyio

# (mode, op id) -> awaitable; bound by the limiter to the request's identifiers and weight.
LeaseCall = Callable[[str, str], Awaitable[object]]


class Lease:
    """Held by a decision admitted under a ``Concurrency`` limit; release it when done.

    ``async with limiter.limit(ids)`` releases on exit, including on errors and cancellation.
    With ``try_acquire``/``acquire`` it is yours: ``await decision.lease.release()`` (or
    ``async with decision.lease:``). A lease that is never released expires after the limit's
    ``lease_ttl``; ``renew()`` restarts that time for long holders.
    """

    __slots__ = ("_call", "op_id", "released")

    def __init__(self, call: LeaseCall, op_id: str) -> None:
        self._call = call
        self.op_id = op_id
        self.released = False

    async def release(self) -> None:
        """Gives the slots back (idempotent; shielded from cancellation)."""
        if self.released:
            return
        with anyio.CancelScope(shield=True):
            await self._call("release", self.op_id)
        self.released = True

    async def renew(self) -> None:
        """Restarts the lease's time to live."""
        if self.released:
            raise RuntimeError("cannot renew a released lease")
        await self._call("renew", self.op_id)

    async def __aenter__(self) -> Lease:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:  # fmt: skip
        await self.release()

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"<Lease {self.op_id[:8]} {state}>"
