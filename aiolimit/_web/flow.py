"""What the web integrations share about one request, whatever the framework: which rule
applies to its route, asking the limiter (``judge``), and giving a charge back (``refund``).

The pieces it builds on have their own modules beside this one: the client's IP behind
trusted proxies (``client_ip``), key functions (``keys``), and the RateLimit headers and
problem+json bodies (``headers``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from aiolimit._algorithms import Concurrency
from aiolimit._decision import Decision
from aiolimit._errors import BackendError, ConfigurationError, LeaseExpired, WeightNeverFits
from aiolimit._limiter import Limiter
from aiolimit._prefetch import Admitted
from aiolimit._rules import check_limits
from aiolimit._validation import MAX_AMOUNT, check_int
from aiolimit._web.headers import (
    admitted_fields,
    denied_body,
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
    """One resolved set of settings: which limiter, which keys, what weight.

    With ``own`` the rule carries limits of its own (a route's ``"5/minute"``): its identifiers
    are of a kind of their own, named after the route (see ``OwnLimits``), and never touch the
    limiter's other rules.
    """

    __slots__ = ("keys", "limiter", "own", "weight")

    def __init__(
        self,
        limiter: Limiter,
        keys: Mapping[str, KeyFunc],
        weight: int | WeightFunc,
        own: OwnLimits | None = None,
    ):
        if not isinstance(limiter, Limiter):
            raise ConfigurationError(f"limiter must be an aiolimit.Limiter, got {limiter!r}")
        if not callable(weight):
            check_int("weight", weight, 1, MAX_AMOUNT)
        self.limiter = limiter
        self.keys = check_keys(keys)
        self.weight = weight
        self.own = own

    async def identifiers(self, request: Any, client_ip: Callable[[], str | None]) -> list[str]:
        ids = []
        prefix = "" if self.own is None else self.own.kind_for(self.limiter, request) + ":"
        for kind, func in self.keys.items():
            raw = client_ip() if func is CLIENT_IP else await _call(func, request)
            value = key_value(raw)
            if value is not None:
                ids.append(f"{prefix}{kind}:{value}")
        return ids

    async def weight_of(self, request: Any) -> int:
        weight = self.weight
        if isinstance(weight, int):
            return weight
        value = await _call(weight, request)
        return check_int("a weight function's result", value, 1, MAX_AMOUNT)


def escape_kind(text: str) -> str:
    """Text usable as an identifier kind: ``%`` and ``:`` percent-escaped (one to one)."""
    return text.replace("%", "%25").replace(":", "%3A")


class OwnLimits:
    """Limits declared where a route is: ``"5/minute"`` for this route only, per key.

    The identifiers are ``<scope>:<key kind>:<value>`` (``"GET /search:ip:203.0.113.7"``):
    ``scope`` is ``name`` when given (routes naming the same scope share one budget), else the
    route's methods and path template, as the framework's ``route_scope`` finds them. Each
    scope becomes a rule of the limiter the first time it is seen (``Limiter.add_rule``).
    Two unnamed declarations with different limits on one route (a router's and its route's)
    are two budgets: the first judged keeps the plain scope, the other's scope is followed
    by its limits (``"GET /v1/report 5/minute"``); the order is the route's own, the same in
    every process.
    """

    __slots__ = ("kinds", "limits", "name", "route_scope")

    def __init__(
        self,
        limits: Any,
        name: str | None,
        route_scope: Callable[[Any], str],
    ) -> None:
        if name is not None and (not isinstance(name, str) or not name):
            raise ConfigurationError(f"name must be non-empty text, got {name!r}")
        self.limits = check_limits("the route's limits", limits)
        self.name = None if name is None else escape_kind(name)
        self.route_scope = route_scope
        self.kinds: dict[tuple[int, str], str] = {}  # (limiter, scope) -> its kind

    def kind_for(self, limiter: Limiter, request: Any) -> str:
        scope = self.name if self.name is not None else escape_kind(self.route_scope(request))
        kind = self.kinds.get((id(limiter), scope))
        if kind is None:
            kind = scope
            try:
                limiter.add_rule(kind, self.limits)
            except ConfigurationError:
                if self.name is not None:  # a name given twice with other limits: the user's
                    raise
                # Another declaration on this route took the plain scope with other limits.
                text = ";".join(str(limit) for limit in self.limits)
                kind = escape_kind(f"{scope} {text}")
                limiter.add_rule(kind, self.limits)
            self.kinds[(id(limiter), scope)] = kind
        return kind


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


async def refund_quietly(
    limiter: Limiter, ids: Sequence[str], weight: int, decision: Decision
) -> None:
    """Gives the weight back on the pairs ``decision`` charged for ``ids`` (whatever the rules
    are now); a store failure is only logged.

    Cancellation of the request itself never triggers a refund (a client that hangs up early
    must not get its requests for free); a refund once started finishes even if the request
    is cancelled meanwhile (the limiter runs it in a task of its own).
    """
    charged = {pair.identifier for pair in decision.details}
    ids = [identifier for identifier in ids if identifier in charged]  # (not the exempt ones)
    if not ids:
        return
    try:
        await limiter.refund(ids, weight, decision=decision)
    except BackendError as exc:
        logger.warning("aiolimit: refund of %d on %d identifier(s) failed: %s",
                       weight, len(ids), exc)  # fmt: skip


#: How long a web layer waits for a lease's release when its limiter has no deadline.
RELEASE_WAIT = 1.0


async def release_quietly(decision: Decision, limiter: Limiter | None = None) -> None:
    """Releases the concurrency lease an admission holds, if any, waiting at most the
    limiter's deadline (else ``RELEASE_WAIT``): a store that fails or does not answer delays
    no response longer, and is only logged; the release goes on in the background (see
    ``Lease.release``), and the lease expires at its TTL at the latest."""
    started = _start_release(decision, limiter)
    if started is not None:
        await _released([started])


def _start_release(
    decision: Decision, limiter: Limiter | None
) -> tuple[asyncio.Future[None], float] | None:
    """Starts releasing a decision's lease in a task of its own, before anything is awaited:
    a request cancelled by a cancel scope (a request timeout around the app) runs its
    cleanup where every ``await`` is cancelled again, and a release started only after one
    would never start. Returns the task and how long to wait for it."""
    lease = decision.lease
    if lease is None or lease.released or (limiter is not None and limiter.closed):
        return None  # (a closed limiter's leases expire at their TTL)
    deadline = None if limiter is None else limiter._failure.deadline_seconds
    task = asyncio.ensure_future(lease.release())
    task.add_done_callback(_log_release)
    return task, deadline or RELEASE_WAIT


async def _released(started: Sequence[tuple[asyncio.Future[None], float]]) -> None:
    """Waits for started releases, together, at most the longest of their waits (never
    cancelling a release itself)."""
    await asyncio.wait([task for task, _ in started], timeout=max(wait for _, wait in started))


def _lease_ttl(decision: Decision) -> float | None:
    """The shortest lease TTL of a decision's ``Concurrency`` pairs (None: it holds none)."""
    if decision.lease is None:
        return None
    ttls = [pair.limit.per for pair in decision.details if isinstance(pair.limit, Concurrency)]
    return min(ttls) if ttls else None


#: Failed lease renewals are logged at most once in this many seconds, with their count.
RENEWAL_LOG_INTERVAL = 10.0
_renewals = {"failed": 0, "logged_at": -RENEWAL_LOG_INTERVAL}


def _renewal_failed(error: BaseException) -> None:
    """Counts a failed renewal; one line per ``RENEWAL_LOG_INTERVAL`` (a store outage fails
    every in-flight request's renewals, a third of a lease TTL apart)."""
    _renewals["failed"] += 1
    now = time.monotonic()
    if now - _renewals["logged_at"] >= RENEWAL_LOG_INTERVAL:
        logger.warning("aiolimit: %d lease renewal(s) failed since the last report; last: %r",
                       _renewals["failed"], error)  # fmt: skip
        _renewals["failed"], _renewals["logged_at"] = 0, now


def _log_release(task: asyncio.Task[None]) -> None:
    if task.cancelled():
        return
    error = task.exception()
    if error is not None:
        logger.warning("aiolimit: releasing a lease failed (retried in the background): %s",
                       error)  # fmt: skip


def _log_refund(task: asyncio.Task[None]) -> None:
    """What a web layer's refund met beyond a store failure (``refund_quietly`` logs those):
    logged, as nobody may be left to read it."""
    if task.cancelled():
        return
    error = task.exception()
    if error is not None:
        logger.error("aiolimit: giving a request's charge back failed: %r", error)


class _OfCharge:
    """A verdict's decision is its one charge's (``Verdict``)."""


OF_CHARGE = _OfCharge()


# -- one request ----------------------------------------------------------------------------


def route_rule(
    limiter: Limiter,
    limits: Any,
    *,
    key: KeyFunc | None,
    keys: Mapping[str, KeyFunc] | None,
    weight: int | WeightFunc | None,
    name: str | None,
    route_scope: Callable[[Any], str],
) -> Rule:
    """The rule of a route's declaration (a dependency, a decorator), checked as both take it.

    With ``limits`` the route has limits of its own (``OwnLimits``), per ``key`` (one key
    function) or ``keys``; without, the limiter's rules apply to ``keys``. Unset, the weight
    is 1 (and the route inherits the middleware's: see ``Layer.weight_given``).
    """
    if key is not None:
        if keys is not None:
            raise ConfigurationError("give key= (one key function) or keys=, not both")
        if limits is None:
            raise ConfigurationError(
                "key= names a route's own limits' key: give limits too (e.g. '5/minute'), "
                "or keys={kind: key function} to apply the limiter's rules"
            )
        keys = {"key": key}
    if limits is None and name is not None:
        raise ConfigurationError("name= names a route's own limits: give limits too")
    own = None if limits is None else OwnLimits(limits, name, route_scope)
    return Rule(limiter, keys or {"ip": CLIENT_IP}, 1 if weight is None else weight, own)


def check_exempt(exempt: object) -> None:
    """A middleware's ``exempt=``: a function of the request (sync or async), or None."""
    if exempt is not None and not callable(exempt):
        raise ConfigurationError(
            f"exempt must be a function of the request returning true to skip limiting, got "
            f"{exempt!r}; exempt paths go in routes={{path: None}} (a '/prefix*' for a subtree)"
        )


#: The attribute ``exempt`` sets on an endpoint or handler.
EXEMPT_MARK = "__aiolimit_exempt__"
F = TypeVar("F")


def mark_exempt(endpoint: F) -> F:
    """Marks an endpoint or handler as exempt from the middleware's limits."""
    try:
        setattr(endpoint, EXEMPT_MARK, True)
    except AttributeError as exc:  # a builtin or a class with __slots__
        raise ConfigurationError(f"cannot mark {endpoint!r} exempt: {exc}") from exc
    return endpoint


@dataclass(frozen=True, slots=True)
class Layer:
    """One declaration limiting a request: a middleware's rule, a dependency, a decorator.

    ``weight_given``: its weight is the route's (a request costs one weight under every limit
    that applies to it: the largest given by a route's layers, else the middleware's).
    ``client_ip`` resolves the client's IP as this layer was told to (its trusted proxies).
    ``own_client``: False for a route's layer told nothing of proxies (nor an IPv6 prefix):
    under a middleware it finds the client as that middleware does, so that proxies are
    declared once (on the middleware) and a route's limit is still per client.
    """

    rule: Rule
    client_ip: Callable[[Any], str | None]
    weight_given: bool = False
    refund: bool = False
    own_client: bool = True


class Charge:
    """One limiter's decision within a request's verdict.

    ``refund_ids``: the identifiers of the layers that asked for ``refund_on_error`` (given
    back when the request fails); ``given_back``: refunded already (a charge is shared by
    every layer's view of the request, and given back once).

    An admission made from prefetched units (``admitted``) makes its ``Decision`` only when
    something asks for it (a dependency, a refund): most requests never do, and only send
    the ``RateLimit`` fields, made from the admission itself. Such an admission never holds a
    lease (``holds_lease``).
    """

    __slots__ = ("_admitted", "_decision", "given_back", "ids", "limiter", "refund_ids", "weight")

    def __init__(
        self,
        limiter: Limiter,
        ids: Sequence[str],
        weight: int,
        decision: Decision | None,
        refund_ids: Sequence[str] = (),
        admitted: Admitted | None = None,
    ) -> None:
        self.limiter = limiter
        self.ids = ids
        self.weight = weight
        self._decision = decision
        self._admitted = admitted
        self.refund_ids = refund_ids
        self.given_back = False

    @property
    def decision(self) -> Decision:
        decision = self._decision
        if decision is None:
            prefetch = self.limiter._prefetch
            assert prefetch is not None and self._admitted is not None
            decision = self._decision = prefetch.decision_of(self._admitted)
        return decision

    @property
    def holds_lease(self) -> bool:
        """Its admission holds ``Concurrency`` slots (released when the request is over)."""
        decision = self._decision
        return decision is not None and decision.lease is not None

    @property
    def refund(self) -> bool:
        return bool(self.refund_ids)

    @property
    def refundable(self) -> bool:
        """Admitted and really charged (a degraded admission charged nothing)."""
        return self.decision.allowed and not self.decision.degraded and not self.given_back


class Verdict:
    """What to do with one request: pass it with ``headers``, or answer ``status``/``body``.

    ``charges`` are the admitted decisions, one per limiter (those to give back on a refund);
    ``decision`` is the deciding one: the refusal, or all admissions merged (given as
    ``OF_CHARGE``: the one charge's, made when asked for).
    """

    __slots__ = ("_decision", "body", "charges", "headers", "renew_every", "renewing", "status")

    def __init__(
        self,
        charges: list[Charge],
        decision: Decision | _OfCharge | None,
        headers: list[tuple[str, str]],
        status: int = 200,
        body: bytes = b"",
    ) -> None:
        self.charges = charges
        self._decision = decision
        self.headers = headers
        self.status = status
        self.body = body
        self.renewing: asyncio.Task[None] | None = None  # keeps the leases while it runs
        self.renew_every = 0.0  # its interval, s

    @property
    def decision(self) -> Decision | None:
        decision = self._decision
        if isinstance(decision, _OfCharge):
            return self.charges[0].decision
        return decision

    @decision.setter
    def decision(self, decision: Decision | None) -> None:
        self._decision = decision

    @property
    def refused(self) -> bool:
        return self.status != 200

    @property
    def refund(self) -> bool:
        """Some charge is to be given back when the request fails (``refund_on_error``)."""
        return any(charge.refund for charge in self.charges)

    @property
    def refundable(self) -> bool:
        return any(charge.refundable for charge in self.charges)

    def decision_for(self, limiter: Limiter) -> Decision | None:
        for charge in self.charges:
            if charge.limiter is limiter:
                return charge.decision
        return None

    async def give_back(self, *, on_error: bool = False) -> None:
        """Refunds the real charges not given back yet: all of them (a later refusal, which
        also releases their leases), or with ``on_error`` those whose layers asked for
        ``refund_on_error`` (the request failed)."""
        releasing = []
        if not on_error:
            self._stop_renewing()
            releasing = self._start_releases()
        # Every refund is started before any is awaited (as the releases are): a cleanup
        # inside a cancelled scope (a request timeout) has each ``await`` cancelled again, and
        # a refund started only after one would never start. Once started, a refund finishes
        # whatever happens to the request (``refund_quietly``).
        refunds = []
        for charge in self.charges:
            if charge.refundable and (charge.refund or not on_error):
                charge.given_back = True
                ids = charge.refund_ids if on_error else charge.ids
                task = asyncio.ensure_future(
                    refund_quietly(charge.limiter, ids, charge.weight, charge.decision)
                )
                task.add_done_callback(_log_refund)
                refunds.append(task)
        if refunds:
            await asyncio.wait(refunds)  # (never cancels them, nor raises what they met)
        if releasing:
            await _released(releasing)

    async def release(self) -> None:
        """The request is over: the ``Concurrency`` slots its admissions hold are released
        (a ``Concurrency`` limit counts requests in flight, not requests per lease TTL)."""
        releasing = self.releasing()
        if releasing:
            await _released(releasing)

    def releasing(self) -> list[tuple[asyncio.Future[None], float]]:
        """``release`` started, with nothing awaited: the releases to wait for (``_released``),
        if any. All started before anything is awaited, and waited for together: a store
        that does not answer costs one wait, not one each."""
        if self.renewing is None:
            for charge in self.charges:
                if charge.holds_lease:
                    break
            else:
                return []  # (the commonest: no lease anywhere, nothing to release)
        self._stop_renewing()
        return self._start_releases()

    def _start_releases(self) -> list[tuple[asyncio.Future[None], float]]:
        started = (_start_release(c.decision, c.limiter) for c in self.charges)
        return [item for item in started if item is not None]

    def keep_leases(self) -> None:
        """While the request runs, its leases are renewed every third of their TTL, so a
        request that outlives ``lease_ttl`` (a stream, a long download) still counts;
        ``release`` stops it. Nothing runs for a request that holds no lease."""
        for charge in self.charges:
            if charge.holds_lease:
                break
        else:
            return  # (the commonest: no lease anywhere)
        ttls = [ttl for c in self.charges if (ttl := _lease_ttl(c.decision)) is not None]
        if not ttls:
            return
        interval = min(ttls) / 3
        if self.renewing is not None:
            if interval >= self.renew_every:
                return
            self.renewing.cancel()  # a lease with a shorter TTL joined (a later layer's)
        self.renew_every = interval
        self.renewing = asyncio.ensure_future(self._renew(interval))

    def _stop_renewing(self) -> None:
        if self.renewing is not None:
            self.renewing.cancel()
            self.renewing = None

    async def _renew(self, interval: float) -> None:
        expired: set[int] = set()
        while True:
            await asyncio.sleep(interval)
            for charge in list(self.charges):
                lease = charge.decision.lease
                if lease is None or lease.released or id(lease) in expired:
                    continue
                if charge.limiter.closed:  # (aclose: the lease expires at its TTL)
                    return
                try:
                    async with asyncio.timeout(interval):
                        await lease.renew()
                except LeaseExpired:  # its slot may be another request's by now
                    expired.add(id(lease))
                    logger.warning("aiolimit: lease %s expired during its request", lease.op_id)
                except Exception as exc:  # the store: tried again at the next tick
                    _renewal_failed(exc)


def shown(limiter: Limiter, decision: Decision) -> Decision:
    """The decision as its client is told it: without the pairs of shadow rules.

    A shadow rule is decided and charged but never refuses; a client that follows the
    ``RateLimit`` fields would slow down for it all the same (its ``r=0`` while it still
    admits, its wait on a 429 that an enforced limit made). The lease and the charge stay
    on the decision itself: this one only describes it.
    """
    details = decision.details
    if not limiter._rules_special or not details or decision.degraded:
        return decision
    kept = tuple(pair for pair in details if not _is_shadow(limiter, pair.identifier))
    if len(kept) == len(details):
        return decision
    if decision.allowed and not kept:  # (all shadow: nothing enforced to describe)
        return Decision(True, 0, 0.0, 0.0, None, None, ())
    told = Decision.from_pairs(kept)
    # (A refusal names an enforced pair that refused, unless the rules changed meanwhile:
    # then it is described as it came.)
    return told if told.allowed == decision.allowed else decision


def _is_shadow(limiter: Limiter, identifier: str) -> bool:
    try:
        return limiter._rules.plan_for(identifier).shadow
    except Exception:  # (rules swapped since, without this kind: not known to be one)
        return False


def merged_headers(charges: Sequence[Charge], *, legacy: bool) -> list[tuple[str, str]]:
    """One ``RateLimit-Policy`` and one ``RateLimit`` field for every admitted decision."""
    real = [
        shown(charge.limiter, charge.decision) for charge in charges if not charge.decision.degraded
    ]
    if not real:
        return []
    if len(real) == 1:
        return rate_limit_headers(real[0], legacy=legacy)
    details = tuple(pair for decision in real for pair in decision.details)
    return rate_limit_headers(Decision.from_pairs(details), legacy=legacy)


async def judge(
    layers: Sequence[Layer], request: Any, *, legacy: bool,
    charged: Mapping[int, Collection[str]] | None = None,
    client_ip: Callable[[Any], str | None] | None = None,
) -> Verdict | None:  # fmt: skip
    """Judges one request under every layer that limits it; None when no key applies.

    The layers' identifiers are gathered per limiter; each limiter decides once, all or
    nothing, at the request's one weight. With several limiters they decide in turn and a
    refusal gives back what the earlier ones charged: a refused request is charged nothing.
    Store failures follow each limiter's ``on_error``: a degraded admission passes without
    headers, a degraded refusal is a 503, and ``"raise"`` lets ``BackendError`` through.
    ``charged``: identifiers this request was charged already, per ``id(limiter)`` (by an
    earlier layer): not charged again. ``client_ip``: the judging middleware's, for the
    layers without one of their own (``Layer.own_client``).
    """
    if len(layers) == 1 and not charged and (client_ip is None or layers[0].own_client):
        return await _judge_one(layers[0], request, legacy=legacy)
    groups: dict[int, tuple[Limiter, dict[str, None], dict[str, None]]] = {}
    for layer in layers:
        resolve = layer.client_ip if client_ip is None or layer.own_client else client_ip
        ids = await layer.rule.identifiers(request, functools.partial(resolve, request))
        if ids and charged:
            done = charged.get(id(layer.rule.limiter))
            if done:
                ids = [identifier for identifier in ids if identifier not in done]
        if ids:
            limiter = layer.rule.limiter
            _, group, refund = groups.setdefault(id(limiter), (limiter, {}, {}))
            group.update(dict.fromkeys(ids))
            if layer.refund:
                refund.update(dict.fromkeys(ids))
    if not groups:
        return None
    given = [layer for layer in layers if layer.weight_given]
    if given:
        weight = max([await layer.rule.weight_of(request) for layer in given])
    else:
        weight = await layers[0].rule.weight_of(request)
    verdict = Verdict([], None, [])
    for limiter, group, refund in groups.values():
        ids = list(group)
        try:
            decision = await limiter.try_acquire(ids, weight)
        except WeightNeverFits as exc:
            await verdict.give_back()
            status, body = never_fits_body(exc)
            return Verdict([], None, [], status, body)
        except BaseException:
            await verdict.give_back()
            raise
        if not decision.allowed:
            await verdict.give_back()
            return refusal(decision, legacy=legacy, limiter=limiter)
        verdict.charges.append(Charge(limiter, ids, weight, decision, list(refund)))
    charges = verdict.charges
    verdict.decision = (
        charges[0].decision
        if len(charges) == 1
        else Decision.from_pairs(tuple(p for c in charges for p in c.decision.details))
    )
    verdict.headers = merged_headers(charges, legacy=legacy)
    return verdict


async def _judge_one(layer: Layer, request: Any, *, legacy: bool) -> Verdict | None:
    """``judge`` for the common case of one layer (a middleware alone): one limiter."""
    rule = layer.rule
    ids = await rule.identifiers(request, functools.partial(layer.client_ip, request))
    if not ids:
        return None
    weight = await rule.weight_of(request)
    return await judge_ids(rule.limiter, ids, weight, refund=layer.refund, legacy=legacy)


async def judge_ids(
    limiter: Limiter, ids: Sequence[str], weight: int, *, refund: bool, legacy: bool
) -> Verdict:
    """One limiter's verdict on ``ids`` at ``weight`` (a valid weight): admitted from the
    units this process took ahead when it can (``judge_local``: nothing awaited), else
    decided by ``try_acquire``."""
    verdict = judge_local(limiter, ids, weight, refund=refund, legacy=legacy)
    if verdict is not None:
        return verdict
    return await judge_store(limiter, ids, weight, refund=refund, legacy=legacy)


def judge_local(
    limiter: Limiter, ids: Sequence[str], weight: int, *, refund: bool, legacy: bool
) -> Verdict | None:
    """``judge_ids`` admitting from the units this process took ahead (``Limiter(prefetch=)``),
    with nothing awaited; None when the store must decide (``judge_store``)."""
    admitted = limiter._admit_prefetched(ids, weight)
    if admitted is None:
        return None
    details = admitted[0]
    if len(details) == 1 and not legacy:  # the commonest: its Decision is not made
        fields = admitted_fields(details[0], admitted[3], admitted[4])
        if fields is not None:
            charge = Charge(limiter, ids, weight, None, ids if refund else (), admitted)
            return Verdict([charge], OF_CHARGE, fields)
    assert limiter._prefetch is not None
    return _admitted(limiter, ids, weight, limiter._prefetch.decision_of(admitted), refund, legacy)


async def judge_store(
    limiter: Limiter, ids: Sequence[str], weight: int, *, refund: bool, legacy: bool
) -> Verdict:
    """``judge_ids`` when the store decides (``try_acquire``)."""
    try:
        decision = await limiter.try_acquire(ids, weight)
    except WeightNeverFits as exc:
        status, body = never_fits_body(exc)
        return Verdict([], None, [], status, body)
    if not decision.allowed:
        return refusal(decision, legacy=legacy, limiter=limiter)
    return _admitted(limiter, ids, weight, decision, refund, legacy)


def _admitted(
    limiter: Limiter, ids: Sequence[str], weight: int, decision: Decision, refund: bool,
    legacy: bool,
) -> Verdict:  # fmt: skip
    return Verdict(
        [Charge(limiter, ids, weight, decision, ids if refund else ())],
        decision,
        rate_limit_headers(shown(limiter, decision), legacy=legacy),
    )


def refusal(decision: Decision, *, legacy: bool, limiter: Limiter | None = None) -> Verdict:
    """The verdict for a refused decision: 429 (503 when degraded, 403 when denied); its
    headers and body describe the enforced limits only (``shown``)."""
    if decision.denied:
        status, body = denied_body()
        return Verdict([], decision, [], status, body)
    told = decision if limiter is None else shown(limiter, decision)
    status, body = problem_body(told)
    if decision.degraded:
        headers = [("Retry-After", str(retry_after_seconds(decision)))]
    else:
        headers = rate_limit_headers(told, legacy=legacy)
    return Verdict([], decision, headers, status, body)


# -- several layers on one request ----------------------------------------------------------


class RequestLimits:
    """What the first layer to judge a request leaves for the others (in the ASGI scope or
    the aiohttp request): the layers it judged, what it charged, and a refusal by a later one.

    A layer it judged does nothing more. A layer it did not see (a second middleware, or a
    dependency it could not find) judges on its own through ``add``: if it refuses, it gives
    back what this request was charged and records the refusal, and the outer layer passes the
    refusal's response as it is; if it admits, its charges join the request's (one set of
    headers, given back once).
    """

    __slots__ = ("added", "client_ip", "included", "legacy", "missed", "refused", "verdict")

    def __init__(
        self, included: Sequence[object], legacy: bool,
        client_ip: Callable[[Any], str | None] | None = None,
    ) -> None:  # fmt: skip
        self.included = {id(layer): layer for layer in included} if included else {}
        self.legacy = legacy
        #: The first middleware's way to find the client (see ``Layer.own_client``).
        self.client_ip = client_ip
        self.verdict: Verdict | None = None
        self.refused: Verdict | None = None
        self.added = False  # a later layer added charges: the headers are merged again
        #: Called when a layer was not seen by the first one (its route index is stale).
        self.missed: Callable[[], None] | None = None

    def judged(self, marker: object) -> bool:
        return id(marker) in self.included

    def include(self, markers: Sequence[object]) -> None:
        for marker in markers:
            self.included[id(marker)] = marker

    def headers(self) -> list[tuple[str, str]]:
        if self.refused is not None or self.verdict is None:
            return []
        if not self.added:
            return self.verdict.headers
        return merged_headers(self.verdict.charges, legacy=self.legacy)

    async def add(self, layers: Sequence[Layer], request: Any) -> Verdict | None:
        """Judges layers the first one did not see; a refusal gives everything back. An
        identifier a limiter charged for this request already (the same limiter's
        middleware on an app and on its mounted sub-app) is not charged again: None when
        nothing is left to judge."""
        charged: dict[int, set[str]] = {}
        if self.verdict is not None:
            for charge in self.verdict.charges:
                charged.setdefault(id(charge.limiter), set()).update(charge.ids)
        verdict = await judge(
            layers, request, legacy=self.legacy, charged=charged, client_ip=self.client_ip
        )
        if verdict is None:
            return None
        if verdict.refused:
            if self.verdict is not None:
                await self.verdict.give_back()
            self.refused = verdict
        elif self.verdict is None:
            self.verdict = verdict
            verdict.keep_leases()
        else:
            self.verdict.charges += verdict.charges
            self.added = True
            self.verdict.keep_leases()
        return verdict
