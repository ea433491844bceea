"""The exceptions aiolimit raises, all under one root::

    AiolimitError
    ├── ConfigurationError   (also ValueError)  a limit, rule, URL or option is invalid
    ├── InvalidRequestError  (also ValueError)  the arguments of one call are invalid
    │   └── WeightNeverFits                     the weight exceeds a limit: it can never pass
    ├── UsageError           (also RuntimeError) used after ``aclose()`` or on another event loop
    ├── RateLimited                             refused; ``.decision`` says why and for how long
    ├── LeaseExpired                            renew() came after the lease ran out
    └── BackendError                            the store failed; the Redis error is __cause__
        └── BackendUnavailable                  no answer (connection refused, timeout, down)

Store failures are never reported as "limited", and bad input is rejected before anything is
sent, so a ``ValueError`` from aiolimit always means nothing was stored or changed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aiolimit._decision import Decision


class AiolimitError(Exception):
    """Root of every exception aiolimit raises."""


class ConfigurationError(AiolimitError, ValueError):
    """A limit, rule, URL or option given to aiolimit is invalid."""


class InvalidRequestError(AiolimitError, ValueError):
    """The identifiers or weight given to one call are invalid; nothing was sent or changed."""


class WeightNeverFits(InvalidRequestError):
    """The weight is larger than a limit that applies, so no amount of waiting admits it."""


class UsageError(AiolimitError, RuntimeError):
    """The object cannot serve this call: it was closed, or it belongs to another event loop."""


class RateLimited(AiolimitError):
    """The request was refused; ``decision`` carries ``retry_after`` and the binding limit."""

    def __init__(self, decision: Decision) -> None:
        self.decision = decision
        super().__init__(
            f"rate limited by {decision.limit} for {decision.identifier!r}; "
            f"retry after {decision.retry_after:.3f}s"
        )


class LeaseExpired(AiolimitError):
    """``Lease.renew`` found the lease already expired: its slots may be another's by now, so
    it is not brought back. Acquire again to hold a slot."""


class BackendError(AiolimitError):
    """The store (Redis, Redis Cluster, embedded) failed; the original error is ``__cause__``."""

    #: The store answered, but with an error that any call would get now (out of memory, a
    #: replica's READONLY, BUSY with someone else's script), not one about this call's keys:
    #: the circuit breaker counts it as it counts a store that does not answer.
    store_wide: bool = False


class BackendUnavailable(BackendError):
    """The store did not answer in time or refused the connection."""
