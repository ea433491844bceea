"""The store interface: the transport that runs the decision script, and nothing more.

A store sends script calls and returns their replies. It does not group identifiers, decide,
compensate or undo (the protocol does all of that) and it never reads a call's arguments:
``keys`` and ``args`` leave as they came. Its errors come back already in aiolimit's tree
(``aiolimit._connection.map_errors``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, Protocol

from aiolimit._clock import Clock
from aiolimit._errors import UsageError

#: A raw script reply: a flat list of integers.
Reply = list[int]
#: One script argument (blocks are pre-encoded bytes).
Arg = str | int | bytes
#: What ``run`` gives back for each call: its reply, or the error it met.
Result = Reply | BaseException


def mark_unsent(error: BaseException) -> BaseException:
    """Marks ``error`` as met before the call was written on any connection (no connection
    could be made: nothing listens, AUTH or SELECT refused at the handshake): the call
    cannot have run, so the protocol undoes nothing. Only a store that knows sets it."""
    error._aiolimit_unsent = True  # type: ignore[attr-defined]
    return error


def clear_unsent(error: BaseException) -> BaseException:
    """Takes the mark off ``error`` where it no longer holds for what the error is raised
    for (a resend after a write that may have gone out; an undo raised for the commits)."""
    if was_unsent(error):
        error._aiolimit_unsent = False  # type: ignore[attr-defined]
    return error


def was_unsent(error: BaseException) -> bool:
    """True if the store marked ``error`` with ``mark_unsent``."""
    return getattr(error, "_aiolimit_unsent", False) is True


class ScriptCall(Protocol):
    """What a store needs of a call: the KEYS and ARGV to send (``aiolimit._calls.Call``)."""

    @property
    def keys(self) -> Sequence[str]: ...

    @property
    def args(self) -> Sequence[Arg]: ...


class Store(ABC):
    """Runs decision script calls; each call is atomic on the store."""

    #: Where it points, for messages ("redis://127.0.0.1:6379/0", "memory://"); no password.
    address: str
    #: True if ``run`` may send a call again after a lost reply; the protocol then gives every
    #: charging call an op id, which the scripts apply once.
    retries_calls: bool = False
    #: True if every key is in one slot (standalone Redis, embedded): one call per decision.
    single_slot: bool = True
    #: True if the store's connections belong to the event loop that opened them.
    loop_bound: bool = True

    @abstractmethod
    async def run(self, calls: Sequence[ScriptCall]) -> list[Result]:
        """Sends the calls concurrently (each atomic on its own); a reply or an error each.

        The calls of one ``run`` may go to different slots. Errors are values, translated
        into aiolimit's errors; a cancellation of the caller is raised.
        """

    def run_one(self, call: ScriptCall) -> Awaitable[Result]:
        """``run`` of one call, awaited at once by the caller: its reply or its error.

        A store may answer with a future rather than a coroutine (a decision's common path
        awaits one frame fewer); cancelling the awaiting task cancels the call as ``run``
        would. A store that overrides ``run`` of one that overrides this (``RedisStore``)
        overrides this too: single calls do not go through ``run`` there."""
        return self._run_one(call)

    async def _run_one(self, call: ScriptCall) -> Result:
        return (await self.run((call,)))[0]

    def fault_domain(self, key: str) -> str:
        """What fails together with ``key`` (a cluster node), for per-domain circuit breakers;
        "" for the whole store."""
        return ""

    def fault_domains(self) -> frozenset[str] | None:
        """Every fault domain that serves keys now (a cluster's primaries), or None when not
        known (one domain, or no topology loaded yet)."""
        return None

    def slot(self, key: str) -> int:
        """The slot of a key; keys of one slot can share a call. Single-node stores: 0."""
        return 0

    @abstractmethod
    async def delete(self, keys: Sequence[str]) -> None:
        """Deletes keys (``reset``)."""

    @abstractmethod
    def default_clock(self) -> Clock:
        """The clock used when the limiter is given none."""

    @abstractmethod
    async def aclose(self) -> None:
        """Releases connections the store opened itself."""

    def describe(self) -> dict[str, Any]:
        return {"address": self.address}

    # -- operations: the rules document, inspection ------------------------------------------

    async def command(self, *args: Arg) -> Any:
        """One plain command, sent where its key lives (the rules document, ``inspect``)."""
        raise UsageError(
            f"{self.address} keeps no rules document and cannot be inspected; use a Redis server"
        )

    def subscribe(self, channel: str) -> AsyncIterator[bytes]:
        """The messages published on ``channel`` from now on, until the iterator is closed.

        A connection failure ends the iteration with a ``BackendError``; subscribe again.
        """
        raise UsageError(f"{self.address} has no publish/subscribe; use a Redis server")
