"""Operation ids, and this limiter's ledger of the ops whose outcome it does not know yet.

Every charging call carries an op: ``<client>:<stamp>:<open>`` (see ``lua/decide.lua``). The
client is this limiter's random id, the stamp counts up, and ``open`` lists the older stamps
still *unsettled* on the call's identifiers: sent, but with no reply yet (in flight, or lost
and being undone; the oldest ``MAX_OPEN`` of them). The script keeps, per identifier and
client, only those, the newer ones and the undone ones, and treats everything below the oldest
open stamp as settled: a copy of such
an op arriving late (a stopped server resumed, a client that resent it by itself) charges
nothing. So the state the scripts keep for exactly-once grows with the ops in flight or being
undone, never with the request rate.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import islice

#: Open stamps an op names at most: the oldest ones. Under a burst of calls in flight on one
#: identifier, the newer open ops go unnamed, so the script may drop their entries early: if
#: such an op then fails, its undo credits nothing (the limit errs toward refusing), but each
#: call's cost stays bounded.
MAX_OPEN = 32


@dataclass(slots=True)
class Op:
    """One operation: its client, its stamp, and the older stamps still open when it began.

    Never changed once made (not frozen: a frozen dataclass's ``__init__`` costs about 0.4 µs
    more, and every charging decision makes one)."""

    client: str
    stamp: int
    open: tuple[int, ...] = ()
    _wire: str = field(default="", compare=False, repr=False)

    @property
    def id(self) -> str:
        """The op's identity (what a lease is held under)."""
        return f"{self.client}:{self.stamp}"

    @property
    def wire(self) -> str:
        """``<client>:<stamp>:<open>``, as the scripts read it (made once)."""
        wire = self._wire
        if not wire:
            if self.open:
                wire = f"{self.client}:{self.stamp}:{','.join(map(str, self.open))}"
            else:
                wire = f"{self.client}:{self.stamp}:"
            self._wire = wire
        return wire


class OpLedger:
    """Stamps ops and remembers which are unsettled, per main key (bounded by them)."""

    __slots__ = ("_next", "_open", "client")

    def __init__(self) -> None:
        self.client = secrets.token_hex(6)
        self._next = 0
        # main key -> its unsettled stamps, in increasing order (dicts keep insertion order)
        self._open: dict[str, dict[int, None]] = {}

    def open(self, keys: Sequence[str]) -> Op:
        """A new op over these main keys, unsettled until ``settle``."""
        self._next += 1
        stamp = self._next
        book = self._open
        if len(keys) == 1:  # (the stamps of one key are unique and ascending already)
            stamps = book.get(keys[0])
            if stamps is None:
                book[keys[0]] = {stamp: None}
                return Op(self.client, stamp)
            open_ = tuple(islice(stamps, MAX_OPEN))
            stamps[stamp] = None
            return Op(self.client, stamp, open_)
        older: list[int] = []
        for key in keys:
            stamps = book.get(key)
            if stamps is None:
                book[key] = {stamp: None}
            else:
                # The oldest first (stamps enter each dict in increasing order).
                older.extend(islice(stamps, MAX_OPEN))
                stamps[stamp] = None
        if not older:
            return Op(self.client, stamp)
        return Op(self.client, stamp, tuple(sorted(set(older))[:MAX_OPEN]))

    def settle(self, keys: Sequence[str], op: Op) -> None:
        """The op's outcome is known (answered, or undone): later calls ack past it."""
        book = self._open
        for key in keys:
            stamps = book.get(key)
            if stamps is not None:
                stamps.pop(op.stamp, None)
                if not stamps:
                    del book[key]

    def unsettled(self) -> int:
        """Unsettled (key, op) entries (for tests and statistics)."""
        return sum(len(stamps) for stamps in self._open.values())
