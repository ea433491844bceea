"""The local refusal cache: a pair that just refused is refused again here, without asking.

Capacity only comes back with time. When the store refuses ``weight`` on a pair (an
identifier under one limit) and says it would fit again in ``retry_after`` seconds, nothing
this process can observe makes it fit sooner except a refund or a reset: other requests only
take more. So until then, a request on that pair asking for at least that weight, and willing
to wait less than the time left, is refused locally, in microseconds and without a round trip.
Under attack or saturation, when most decisions are refusals, this keeps the store's load
proportional to the admitted traffic rather than to the offered one.

What keeps it exact:

- The entry expires early, never late: its end is ``retry_after`` counted from when the
  *request left*, not from when the reply came back, and the store decided somewhere in
  between.
- A smaller weight than the one refused is not refused from the cache (it may fit).
- A caller that may wait (``acquire`` reserving a turn on a token bucket) is refused locally
  only if the pair frees up after the caller's whole wait.
- ``Concurrency`` refusals are never cached: a release returns capacity at any moment.
  Degraded answers (the store was not asked) are never cached.
- ``refund`` and ``reset`` made through this limiter drop the identifiers' entries first;
  an undo (a cross-slot compensation, or one finished in the background) or a refund finished
  in the background (it had failed) drops them when it lands.

What it cannot see: a ``refund`` or ``reset`` made by *another* process (or another limiter
object). Until the cached ``retry_after`` passes, this process keeps refusing that pair; it
never admits more than the store would, it only refuses for at most that long what the store
might now admit.

The cache is bounded (least recently refused entries go first) and counts its hits.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from aiolimit._algorithms import Concurrency
from aiolimit._decision import Decision, PairDecision
from aiolimit._limits import BaseLimit

DEFAULT_SIZE = 10_000


@dataclass(slots=True)
class _Entry:
    """One pair's last refusal: ``weight`` or more cannot pass before ``until``."""

    limit: BaseLimit
    weight: int
    until: float  # on the limiter clock's monotonic() scale
    reset_until: float
    remaining: int


class RefusalCache:
    """Refusals per identifier, each good until its pair's ``retry_after`` runs out."""

    __slots__ = ("_by_identifier", "_size", "epoch", "hits")

    def __init__(self, size: int = DEFAULT_SIZE) -> None:
        self._by_identifier: OrderedDict[str, list[_Entry]] = OrderedDict()
        self._size = size
        #: Decisions answered from the cache.
        self.hits = 0
        #: Moves at every ``forget``: a refusal whose request left before a refund or reset
        #: of this process finished may predate it, and is not kept.
        self.epoch = 0

    def lookup(
        self,
        identifiers: Iterable[tuple[str, tuple[BaseLimit, ...]]],
        weight: int,
        max_wait: float,
        now: float,
    ) -> Decision | None:
        """A local refusal if a cached pair cannot fit ``weight`` within ``max_wait``, else None.

        ``identifiers`` are the call's (identifier, limits) in order; ``now`` is the clock's
        monotonic time.
        """
        by_identifier = self._by_identifier
        if not by_identifier:
            return None
        refused: list[PairDecision] | None = None
        horizon = now + max_wait
        for identifier, limits in identifiers:
            entries = by_identifier.get(identifier)
            if entries is None:
                continue
            for entry in entries:
                if entry.until > horizon and weight >= entry.weight and entry.limit in limits:
                    if refused is None:
                        refused = []
                    refused.append(
                        PairDecision(
                            identifier,
                            entry.limit,
                            False,
                            entry.remaining,
                            entry.until - now,
                            max(entry.reset_until - now, entry.until - now),
                        )
                    )
        if refused is None:
            return None
        self.hits += 1
        return Decision.from_pairs(tuple(refused))

    def remember(self, decision: Decision, weight: int, sent_at: float, epoch: int) -> None:
        """Keeps the refusing pairs of a store refusal made for a request sent at ``sent_at``,
        when the cache's ``epoch`` was ``epoch``."""
        if decision.allowed or decision.degraded or epoch != self.epoch:
            return
        by_identifier = self._by_identifier
        for pair in decision.details:
            if pair.allowed or pair.retry_after <= 0 or isinstance(pair.limit, Concurrency):
                continue
            # A microsecond early, plus the rounding of float seconds far from zero (an
            # epoch-based clock has ulps of ~0.2 µs): the entry must expire no later than the
            # instant the store admits again.
            until = sent_at + pair.retry_after - (1e-6 + abs(sent_at) * 1e-15)
            entry = _Entry(pair.limit, weight, until, sent_at + pair.reset_after, pair.remaining)
            entries = by_identifier.get(pair.identifier)
            if entries is None:
                by_identifier[pair.identifier] = [entry]
                if len(by_identifier) > self._size:
                    by_identifier.popitem(last=False)
                continue
            by_identifier.move_to_end(pair.identifier)
            # One entry per limit; expired ones go while we are here.
            entries[:] = [
                kept for kept in entries if kept.limit != pair.limit and kept.until > sent_at
            ]
            entries.append(entry)

    def forget(self, identifiers: Iterable[str]) -> None:
        """Drops what is known of these identifiers (this process refunds or resets them).

        Called before the refund or reset is sent and again once it is done, so that no
        refusal read before it stays.
        """
        self.epoch += 1
        for identifier in identifiers:
            self._by_identifier.pop(identifier, None)

    def __len__(self) -> int:
        return len(self._by_identifier)

    def __repr__(self) -> str:
        return f"RefusalCache({len(self)} identifiers, hits={self.hits})"
