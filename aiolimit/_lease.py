"""Leases: the concurrency slots an admitted request holds until it releases them."""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING

from aiolimit._calls import RELEASE, RENEW
from aiolimit._errors import LeaseExpired, UsageError

if TYPE_CHECKING:
    from aiolimit._ops import Op
    from aiolimit._protocol import Protocol
    from aiolimit._rules import IdentifierPlan


class Lease:
    """Held by a decision admitted under a ``Concurrency`` limit; release it when done.

    ``async with limiter.limit(ids)`` releases on exit, including on errors and cancellation.
    With ``try_acquire``/``acquire`` it is yours: ``await decision.lease.release()`` (or
    ``async with decision.lease:``). A lease that is never released expires after the limit's
    ``lease_ttl``; ``renew()`` restarts that time for long holders.
    """

    __slots__ = ("_op", "_plans", "_protocol", "_weight", "op_id", "released")

    def __init__(
        self, protocol: Protocol, plans: Sequence[IdentifierPlan], weight: int, op: Op
    ) -> None:
        self._protocol = protocol
        self._plans = plans
        self._weight = weight
        self._op = op
        self.op_id = op.id
        self.released = False

    async def release(self) -> None:
        """Gives the slots back (idempotent; finishes even if the caller is cancelled).

        If the store fails, the error is raised and the release goes on being retried in
        the background (with backoff, for minutes), so the slot does not wait for the TTL.
        """
        if self.released:
            return
        self.released = True
        await self._protocol.lease_call(RELEASE, self._plans, self._weight, self._op)

    async def renew(self) -> None:
        """Restarts the lease's time to live.

        Raises ``LeaseExpired`` if it already ran out (its slots may be held by another
        request by now), and ``UsageError`` after ``release``.
        """
        if self.released:
            raise UsageError("cannot renew a released lease")
        decision = await self._protocol.lease_call(RENEW, self._plans, self._weight, self._op)
        if not decision.allowed:
            raise LeaseExpired(
                f"lease {self.op_id} expired before renew(); acquire again to hold a slot"
            )

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
