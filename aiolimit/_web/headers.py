"""The RateLimit response headers and the problem+json bodies, from a limiter's decision.

Headers follow draft-ietf-httpapi-ratelimit-headers-11 (May 2026, the latest draft): one
``RateLimit-Policy`` item per limit (``"ip-10-per-1s";q=10;w=1``) and one ``RateLimit`` item per
limit (``"ip-10-per-1s";r=7;t=1``), both Structured Field lists, on every limited response,
allowed or refused. ``r`` is what is left after this request; ``t`` is, for a refusing limit,
its retry-after and otherwise its reset-after, in whole seconds rounded up. A 429 also carries
``Retry-After`` (seconds rounded up, the largest over the refusing limits, so never earlier
than any refusing item's ``t``) and an RFC 9457 body of the draft's ``quota-exceeded`` problem
type, naming the violated policies but never the identifiers (they may hold API keys).
Legacy ``X-RateLimit-Limit/Remaining/Reset`` (Reset in delta seconds) describe the binding
limit and are off by default.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from aiolimit._algorithms import TokenBucket
from aiolimit._decision import Decision, PairDecision
from aiolimit._errors import WeightNeverFits
from aiolimit._limits import BaseLimit

PROBLEM_CONTENT_TYPE = "application/problem+json"
QUOTA_EXCEEDED = "https://iana.org/assignments/http-problem-types#quota-exceeded"
REDUCED_CAPACITY = "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity"


def quota_and_window(limit: BaseLimit | None) -> tuple[int, int] | None:
    """(quota, window in whole seconds) of a limit, for ``RateLimit-Policy``'s q and w.

    Every limit type says both (``BaseLimit.amount`` and ``per``): a window's amount per its
    period, a pool's size per its lease TTL. A token bucket's quota is its burst, and its
    window the time the bucket takes to refill from empty (``burst / rate`` periods), so that
    q/w is its sustained rate: ``TokenBucket(10, burst=100)`` is ``q=100;w=10``, not 100 per
    second. A bucket that refills in under a second (``MinInterval(0.2)``) says 1 per second:
    a window is whole seconds, and the quota is never more than the burst.
    """
    if limit is None:
        return None
    window = limit.per
    if isinstance(limit, TokenBucket):
        window = limit.per * limit.amount / limit.rate
    if not math.isfinite(window) or window <= 0:
        return None
    return limit.amount, max(1, math.ceil(window))


_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_.*-]")


def policy_name(identifier: str, quota: int, window: int) -> str:
    """``"ip-10-per-1s"``: the identifier's kind and the limit; stable across responses."""
    kind = identifier.partition(":")[0] if ":" in identifier else "default"
    return f"{_NAME_UNSAFE.sub('_', kind)[:32]}-{quota}-per-{window}s"


def _ceil_seconds(seconds: float) -> int:
    return max(0, math.ceil(seconds - 1e-9))


@dataclass(frozen=True, slots=True)
class _Item:
    name: str
    quota: int
    window: int
    pair: PairDecision
    policy: str  # its RateLimit-Policy item


#: (the policy name, quota, window, RateLimit-Policy item) per (identifier kind, limit), or
#: None for a limit that cannot be described: the same on every response (bounded). Keyed by
#: the limit object's identity (hashing a limit hashes all its fields), and holding the limit
#: itself, so that an id reused by a later object is never taken for it.
_DESCRIBED: dict[tuple[str, int], tuple[BaseLimit, tuple[str, int, int, str] | None]] = {}
#: The same keyed by the limit's value: equal limits that are different objects (an override
#: applied per identifier makes its own) share one description, as they share one text.
_BY_VALUE: dict[tuple[str, BaseLimit], tuple[str, int, int, str] | None] = {}
_DESCRIBED_MAX = 1024


def _described(identifier: str, limit: BaseLimit) -> tuple[str, int, int, str] | None:
    kind = identifier.partition(":")[0] if ":" in identifier else "default"
    key = (kind, id(limit))
    known = _DESCRIBED.get(key)
    if known is not None and known[0] is limit:
        return known[1]
    by_value = (kind, limit)
    hashable = True
    try:
        return _remember(key, limit, _BY_VALUE[by_value])
    except KeyError:
        pass
    except TypeError:  # (a limit that cannot be hashed: described each time)
        hashable = False
    described = quota_and_window(limit)
    found = None
    if described is not None:
        quota, window = described
        name = policy_name(identifier, quota, window)
        found = (name, quota, window, f'"{name}";q={quota};w={window}')
    if hashable:
        if len(_BY_VALUE) >= _DESCRIBED_MAX:
            _BY_VALUE.clear()
        _BY_VALUE[by_value] = found
    return _remember(key, limit, found)


def _remember(
    key: tuple[str, int], limit: BaseLimit, found: tuple[str, int, int, str] | None
) -> tuple[str, int, int, str] | None:
    if len(_DESCRIBED) >= _DESCRIBED_MAX:
        _DESCRIBED.clear()
    _DESCRIBED[key] = (limit, found)
    return found


def _items(decision: Decision) -> list[_Item]:
    """One item per policy name: the tightest pair when two identifiers share a name.

    A pair's ``remaining`` is what is left after this request: after its charge when the
    decision was allowed, and as it stands when refused (nothing was charged).
    """
    chosen: dict[str, _Item] = {}
    for pair in decision.details:
        described = _described(pair.identifier, pair.limit)
        if described is None:
            continue
        name = described[0]
        current = chosen.get(name)
        if current is None or (pair.allowed, pair.remaining) < (
            current.pair.allowed,
            current.pair.remaining,
        ):
            chosen[name] = _Item(name, described[1], described[2], pair, described[3])
    return list(chosen.values())


def retry_after_seconds(decision: Decision) -> int:
    """Whole seconds, rounded up, the largest over the refusing pairs; at least 1."""
    return max(1, math.ceil(decision.retry_after - 1e-9))


def rate_limit_headers(decision: Decision, *, legacy: bool = False) -> list[tuple[str, str]]:
    """The headers for any response this decision covers (none for a degraded one)."""
    details = decision.details
    if decision.degraded or not details:
        return []
    if len(details) == 1 and not legacy:  # the commonest: one identifier under one limit
        pair = details[0]
        described = _described(pair.identifier, pair.limit)
        if described is not None:
            headers = _one_pair(
                described,
                pair.remaining,
                pair.reset_after if pair.allowed else pair.retry_after,
            )
            if not decision.allowed:
                headers.append(("Retry-After", str(retry_after_seconds(decision))))
            return headers
    items = _items(decision)
    headers = []
    if items:
        policies = ", ".join(i.policy for i in items)
        limits = ", ".join(
            f'"{i.name}";r={max(0, i.pair.remaining)};t={_effective_window(i.pair)}' for i in items
        )
        headers += [("RateLimit-Policy", policies), ("RateLimit", limits)]
    if legacy and decision.limit is not None:
        quota_window = quota_and_window(decision.limit)
        binding = next(  # the binding pair: its identifier and its limit
            (
                p for p in decision.details
                if p.identifier == decision.identifier and p.limit == decision.limit
            ),
            None,
        )  # fmt: skip
        if quota_window is not None and binding is not None:
            headers += [
                ("X-RateLimit-Limit", str(quota_window[0])),
                ("X-RateLimit-Remaining", str(max(0, decision.remaining))),
                ("X-RateLimit-Reset", str(_effective_window(binding))),
            ]
    if not decision.allowed:
        headers.append(("Retry-After", str(retry_after_seconds(decision))))
    return headers


def admitted_fields(pair: PairDecision, left: int, elapsed: float) -> list[tuple[str, str]] | None:
    """``rate_limit_headers`` of an admission made from prefetched units on one pair, made
    from the numbers its ``Decision`` would be made from (``Allowances.decision_of``): the
    store's ``pair``, the units the allowance held after it, the seconds since the store
    was asked. None when the pair's limit cannot be described."""
    global _LAST_ADMITTED
    last = _LAST_ADMITTED
    if last[0] is pair:  # (the pair of the same allowance as the last admission's)
        described = last[1]
    else:
        described = _described(pair.identifier, pair.limit)
        _LAST_ADMITTED = (pair, described)  # (one assignment: another thread sees both)
    if described is None:
        return None
    return _one_pair(described, pair.remaining + left, pair.reset_after - elapsed)


#: The pair ``admitted_fields`` described last, and its description: every admission from
#: one allowance has the same pair (the store's), so a busy client's skip the lookup.
_LAST_ADMITTED: tuple[PairDecision | None, tuple[str, int, int, str] | None] = (None, None)


def _one_pair(
    described: tuple[str, int, int, str], remaining: int, seconds: float
) -> list[tuple[str, str]]:
    """The two fields of one described pair: ``remaining`` and ``seconds`` (its reset when
    admitted, its wait when refused) as ``_items`` and ``_effective_window`` give them."""
    if remaining < 0:
        remaining = 0
    whole = math.ceil(seconds - 1e-9)
    if whole < 0:
        whole = 0  # (as ``_effective_window``, written out: every response has it)
    return [
        ("RateLimit-Policy", described[3]),
        ("RateLimit", f'"{described[0]}";r={remaining};t={whole}'),
    ]


def _effective_window(pair: PairDecision) -> int:
    return _ceil_seconds(pair.reset_after if pair.allowed else pair.retry_after)


def problem_body(decision: Decision) -> tuple[int, bytes]:
    """(status, RFC 9457 body) for a refused decision: 429, or 503 when degraded."""
    if decision.degraded:
        status = 503
        problem: dict[str, Any] = {
            "type": REDUCED_CAPACITY,
            "title": "Request cannot be satisfied due to temporary server capacity constraints",
            "status": status,
            "detail": "The rate limiter's store is unavailable; try again later.",
        }
    else:
        status = 429
        violated = [i.name for i in _items(decision) if not i.pair.allowed]
        problem = {
            "type": QUOTA_EXCEEDED,
            "title": "Request cannot be satisfied as assigned quota has been exceeded",
            "status": status,
            "detail": f"Rate limit exceeded; retry after {retry_after_seconds(decision)} s.",
            "violated-policies": violated,
        }
    return status, json.dumps(problem, separators=(",", ":")).encode()


def denied_body() -> tuple[int, bytes]:
    """A request the rules' deny list refuses: 403, no Retry-After (waiting cannot help), and
    no ``RateLimit`` fields; the body does not say which identifier was denied."""
    problem = {
        "type": "about:blank",
        "title": "Forbidden",
        "status": 403,
        "detail": "Requests from this client are not accepted.",
    }
    return 403, json.dumps(problem, separators=(",", ":")).encode()


def never_fits_body(error: WeightNeverFits) -> tuple[int, bytes]:
    """A request heavier than a limit: 429 without Retry-After (waiting cannot help)."""
    problem = {
        "type": QUOTA_EXCEEDED,
        "title": "Request cannot be satisfied as assigned quota has been exceeded",
        "status": 429,
        "detail": "This request costs more than the quota allows; it can never be admitted.",
    }
    return 429, json.dumps(problem, separators=(",", ":")).encode()
