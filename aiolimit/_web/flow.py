"""What the web integrations share about one request, whatever the framework: which rule
applies to its route, asking the limiter (``judge``), and giving a charge back (``refund``).

The pieces it builds on have their own modules beside this one: the client's IP behind
trusted proxies (``client_ip``), key functions (``keys``), and the RateLimit headers and
problem+json bodies (``headers``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aiolimit._decision import Decision
from aiolimit._errors import BackendError, ConfigurationError, WeightNeverFits
from aiolimit._limiter import Limiter
from aiolimit._validation import MAX_AMOUNT, check_int
from aiolimit._web.headers import (
    never_fits_body,
    problem_body,
    rate_limit_headers,
    retry_after_seconds,
)
from aiolimit._web.keys import CLIENT_IP, KeyFunc, WeightFunc, _call, check_keys, key_value

logger = logging.getLogger("aiolimit")


# -- route rules ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RouteLimit:
    """Per-route settings: another limiter (other limits), other keys, another weight.

    ``None`` fields inherit the middleware's. Map a route to ``None`` to exempt it.
    """

    limiter: Limiter | None = None
    keys: Mapping[str, KeyFunc] | None = None
    weight: int | WeightFunc | None = None


class Rule:
    """One resolved set of settings: which limiter, which keys, what weight."""

    __slots__ = ("keys", "limiter", "weight")

    def __init__(self, limiter: Limiter, keys: Mapping[str, KeyFunc], weight: int | WeightFunc):
        if not isinstance(limiter, Limiter):
            raise ConfigurationError(f"limiter must be an aiolimit.Limiter, got {limiter!r}")
        if not callable(weight):
            check_int("weight", weight, 1, MAX_AMOUNT)
        self.limiter = limiter
        self.keys = check_keys(keys)
        self.weight = weight

    async def identifiers(self, request: Any, client_ip: Callable[[], str | None]) -> list[str]:
        ids = []
        for kind, func in self.keys.items():
            raw = client_ip() if func is CLIENT_IP else await _call(func, request)
            value = key_value(raw)
            if value is not None:
                ids.append(f"{kind}:{value}")
        return ids

    async def weight_of(self, request: Any) -> int:
        weight = self.weight
        if isinstance(weight, int):
            return weight
        value = await _call(weight, request)
        return check_int("a weight function's result", value, 1, MAX_AMOUNT)


class RouteTable:
    """Exact paths first, then the longest ``prefix*`` pattern; ``None`` exempts."""

    def __init__(self, base: Rule, routes: Mapping[str, RouteLimit | None] | None) -> None:
        self.base = base
        self.exact: dict[str, Rule | None] = {}
        self.prefixes: list[tuple[str, Rule | None]] = []
        for path, spec in (routes or {}).items():
            if not isinstance(path, str) or not path.startswith("/"):
                raise ConfigurationError(f"a route must be a path starting with '/', got {path!r}")
            if spec is not None and not isinstance(spec, RouteLimit):
                raise ConfigurationError(f"route {path!r} must map to RouteLimit or None")
            rule = None
            if spec is not None:
                rule = Rule(
                    spec.limiter or base.limiter,
                    spec.keys if spec.keys is not None else base.keys,
                    spec.weight if spec.weight is not None else base.weight,
                )
            if path.endswith("*"):
                self.prefixes.append((path[:-1], rule))
            else:
                self.exact[path] = rule
        self.prefixes.sort(key=lambda item: len(item[0]), reverse=True)

    def match(self, path: str) -> Rule | None:
        if not self.exact and not self.prefixes:
            return self.base
        if path in self.exact:
            return self.exact[path]
        for prefix, rule in self.prefixes:
            if path.startswith(prefix):
                return rule
        return self.base


# -- refunds --------------------------------------------------------------------------------


async def refund_quietly(limiter: Limiter, ids: Sequence[str], weight: int) -> None:
    """Gives the weight back; a store failure is only logged.

    Cancellation of the request itself never triggers a refund (a client that hangs up early
    must not get its requests for free); a refund once started finishes even if the request
    is cancelled meanwhile (the limiter runs it in a task of its own).
    """
    try:
        await limiter.refund(list(ids), weight)
    except BackendError as exc:
        logger.warning("aiolimit: refund of %d on %d identifier(s) failed: %s",
                       weight, len(ids), exc)  # fmt: skip


# -- one request ----------------------------------------------------------------------------


@dataclass(slots=True)
class Verdict:
    """What to do with one request: pass it with ``headers``, or answer ``status``/``body``."""

    limiter: Limiter
    ids: list[str]
    weight: int
    decision: Decision | None
    headers: list[tuple[str, str]]
    status: int = 200
    body: bytes = b""

    @property
    def refused(self) -> bool:
        return self.status != 200

    @property
    def refundable(self) -> bool:
        """Admitted and really charged (a degraded admission charged nothing)."""
        return self.decision is not None and self.decision.allowed and not self.decision.degraded


async def judge(
    rule: Rule, request: Any, client_ip: Callable[[], str | None], *, legacy: bool
) -> Verdict | None:
    """Asks the limiter about one request; None when no key applies (nothing is limited).

    Store failures follow the limiter's ``on_error``: a degraded admission passes without
    headers, a degraded refusal is a 503, and ``"raise"`` lets ``BackendError`` through.
    """
    ids = await rule.identifiers(request, client_ip)
    if not ids:
        return None
    weight = await rule.weight_of(request)
    try:
        decision = await rule.limiter.try_acquire(ids, weight)
    except WeightNeverFits as exc:
        status, body = never_fits_body(exc)
        return Verdict(rule.limiter, ids, weight, None, [], status, body)
    headers = rate_limit_headers(decision, legacy=legacy)
    if decision.allowed:
        return Verdict(rule.limiter, ids, weight, decision, headers)
    status, body = problem_body(decision)
    if decision.degraded:
        headers = [("Retry-After", str(retry_after_seconds(decision)))]
    return Verdict(rule.limiter, ids, weight, decision, headers, status, body)
