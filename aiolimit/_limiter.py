"""The limiter: the public face that validates, asks the protocol, and waits when told to."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import logging
import math
import os
import threading
import time
from collections.abc import Awaitable, Callable, Generator, Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, ParamSpec, TypeVar

from aiolimit._algorithms import Concurrency
from aiolimit._calls import ACQUIRE, PEEK, Mode
from aiolimit._clock import Clock, LocalClock
from aiolimit._decision import Charge, Decision
from aiolimit._errors import (
    BackendError,
    BackendUnavailable,
    ConfigurationError,
    InvalidRequestError,
    RateLimited,
    UsageError,
)
from aiolimit._failure import (
    BreakerStatistics,
    CircuitBreaker,
    DeadlineExceeded,
    FailurePolicy,
    OnError,
)
from aiolimit._follow import RulesFollower, publish
from aiolimit._keys import check_prefix, identifier_kind
from aiolimit._limits import BaseLimit
from aiolimit._prefetch import MAX_PREFETCH, Admitted, Allowances, eligible, same_limits
from aiolimit._protocol import HELD_TURNS, UNDO_BUDGET, KeepOpen, Protocol, Turn
from aiolimit._refusals import DEFAULT_SIZE, RefusalCache
from aiolimit._rules import IdentifierPlan, LimitsArg, Rules, check_weight, identifiers_of
from aiolimit._ruleset import RuleSet
from aiolimit._stores import default_deadline, open_store
from aiolimit._stores.base import Store
from aiolimit._validation import MAX_SECONDS, check_bool, check_int, check_optional_seconds
from aiolimit.metrics import Metrics

# acquire reserves a GCRA turn at most this far ahead (also keeps the scaled values exact).
MAX_RESERVATION_US = 3_600_000_000
#: Seconds between tries while waiting for a Concurrency slot another process may release:
#: 10 ms at first, doubling to at most 250 ms (a release in this process wakes waiters at once).
LEASE_POLL_MIN = 0.01
LEASE_POLL_MAX = 0.25
#: A cached refusal yields to the event loop once in this many decisions.
CACHED_YIELD_EVERY = 16
#: prefetch: a call waits for at most this many refills by other calls before its own.
REFILL_WAITS = 4
#: The refusal cache holds at most this many identifiers (refusal_cache_size).
MAX_CACHE = 10_000_000

Identifiers = str | Sequence[str]
P = ParamSpec("P")
T = TypeVar("T")
logger = logging.getLogger("aiolimit")

#: How many forks this process is from the one that imported aiolimit (``_check_usable``): in
#: a forked child the thread that forked keeps its id, and a loop object copied from the parent
#: still says it runs in that thread, though it runs nowhere there (asyncio's running loop is
#: per process).
_forks = 0


def _forked() -> None:
    global _forks
    _forks += 1


os.register_at_fork(after_in_child=_forked)


@dataclass(frozen=True, slots=True)
class LimiterStatistics:
    """Counters kept by this limiter object (this process only)."""

    decisions: int
    allowed: int
    refused: int
    errors: int
    waits: int
    multi_slot_decisions: int
    compensations: int
    #: Refusals answered by the local refusal cache, without asking the store.
    cached_refusals: int
    #: Refused by the rules' deny list (counted in ``refused`` too).
    denied: int
    #: Admitted although a shadow rule refused them (counted in ``allowed``).
    shadow_refusals: int
    #: Following the rules in Redis: the version in force (None: the limiter's own rules),
    #: how many times the rules were replaced, and invalid documents rejected.
    rules_version: str | None
    rules_reloads: int
    rules_rejected: int
    #: The failure policy's circuit breaker: state and counters (see ``aiolimit._failure``).
    breaker: BreakerStatistics
    #: Admissions made in this process from prefetched units (``prefetch``), with no round
    #: trip (counted in ``allowed`` too).
    prefetched: int = 0


class Limiter:
    """Rate limits several identifiers under several limits each, all or nothing.

    ``store`` is a URL (``redis://``, ``rediss://``, ``unix://``,
    ``redis+cluster://host:port[,host:port...]``, ``memory://``) or a ``redis.asyncio.Redis``
    / ``RedisCluster`` client you own. ``limits`` is a list of limits for every identifier,
    or a mapping from identifier kind (the text before the first ``:``) to limits, with ``"*"``
    as the default rule.

    ``cache_refusals=True`` keeps, in this process, the pairs the store just refused, and
    refuses them again locally until their ``retry_after`` has passed (capacity only comes
    back with time): under saturation most refusals cost a few microseconds and no round trip.
    Refunds and resets made through this limiter drop the entries; those made by another
    process are seen only when the entry expires (see ``aiolimit._refusals``).
    ``refusal_cache_size`` bounds it in identifiers.

    ``prefetch=N`` (sliding and fixed window counters only) lets identifiers that are busy in
    this process take up to ``N`` units ahead in the call that charges them, and admits later
    calls on them from those units here, with no round trip, until the current bucket of their
    limits ends (1 s at most); what is left is given back then. Never over-admits (see
    ``aiolimit._prefetch``); other processes may be refused while units are held here, and a
    reset made by another process is not seen until then.
    """

    def __init__(
        self,
        store: str | Any,
        limits: LimitsArg | RuleSet,
        *,
        prefix: str = "aiolimit",
        clock: Clock | None = None,
        count_refused: bool = False,
        socket_timeout: float = 2.0,
        deadline: float | Literal["auto"] | None = "auto",
        on_error: OnError = "raise",
        failure_threshold: int = 5,
        recovery_time: float = 1.0,
        cache_refusals: bool = False,
        refusal_cache_size: int = DEFAULT_SIZE,
        follow_rules: bool = False,
        rules_interval: float = 1.0,
        override_cache_size: int = 100_000,
        metrics: Metrics | None = None,
        prefetch: int = 0,
    ) -> None:
        # Failure policy (aiolimit._failure): each decision gets `deadline` seconds ("auto":
        # 1 s, or 5 s on a cluster so a failover is ridden through); a store
        # failure raises, admits ("open") or refuses ("closed") with degraded=True; after
        # `failure_threshold` failures in a row the breaker stops asking the store for
        # `recovery_time` seconds, then probes.
        self._failure = FailurePolicy(
            deadline=default_deadline(store) if deadline == "auto" else deadline,
            on_error=on_error,
            breaker=CircuitBreaker(failure_threshold, recovery_time),
        )
        check_bool("count_refused", count_refused)
        # cache_refusals (aiolimit._refusals): a pair the store refused is refused here,
        # with no round trip, until its retry_after has passed.
        check_bool("cache_refusals", cache_refusals)
        if cache_refusals and count_refused:
            raise ConfigurationError(
                "cache_refusals=True cannot be combined with count_refused=True: a refusal "
                "answered locally would not be counted as a penalty in the store"
            )
        self._refusals = (
            RefusalCache(check_int("refusal_cache_size", refusal_cache_size, 1, MAX_CACHE))
            if cache_refusals
            else None
        )
        self._rules = Rules(limits, check_prefix(prefix))
        self._initial_rules = self._rules
        self._added_rules: dict[str, tuple[BaseLimit, ...]] = {}
        self._rules_special = self._rules.ruleset is not None
        self._store: Store = open_store(
            store,
            socket_timeout=socket_timeout,
            bounded_by_deadline=self._failure.deadline_seconds is not None,
        )
        self._failure.address = self._store.address
        self.clock: Clock = clock if clock is not None else self._store.default_clock()
        if not isinstance(self.clock, Clock):
            raise ConfigurationError(f"clock must implement aiolimit.Clock, got {clock!r}")
        self._protocol = Protocol(self._store, self.clock, penalty=count_refused)
        self._count_refused = count_refused
        self._protocol.renew_deadline = self._failure.deadline_seconds
        if self._refusals is not None:
            refusals = self._refusals
            # An undo (a cross-slot compensation, or a failed call's, finished in the
            # background) or a refund finished in the background gives capacity back:
            # refusals cached meanwhile would refuse what the store now admits.
            self._protocol.on_given_back = lambda plans: refusals.forget(
                plan.identifier for plan in plans
            )
        # prefetch (aiolimit._prefetch): busy identifiers take units ahead, admitted here.
        prefetch = check_int("prefetch", prefetch, 0, MAX_PREFETCH)
        if prefetch and count_refused:
            raise ConfigurationError(
                "prefetch cannot be combined with count_refused=True: a call that takes units "
                "ahead and is refused would count them all as a penalty"
            )
        if prefetch and isinstance(self.clock, LocalClock) and self._store.loop_bound:
            raise ConfigurationError(
                "prefetch needs every process to judge by one clock: the server's (the "
                "default) or a TIME authority. With clock=LocalClock() each process judges by "
                "its own, and units one took ahead could be admitted in a bucket that another's "
                "clock has ended already"
            )
        self._prefetch = Allowances(prefetch, self._protocol, self.clock) if prefetch else None
        self._ahead: set[asyncio.Future[None]] = set()  # (refills ahead in flight: kept alive)
        if self._prefetch is not None:
            self._prefetch.low = self._running_low
        self._counts = {
            "decisions": 0,
            "allowed": 0,
            "refused": 0,
            "errors": 0,
            "waits": 0,
            "denied": 0,
            "shadow_refusals": 0,
        }
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_forks = _forks  # (``_check_usable``)
        # metrics (aiolimit.metrics): every decision of try_acquire/acquire is recorded.
        if metrics is not None and not isinstance(metrics, Metrics):
            raise ConfigurationError(
                f"metrics must be an aiolimit.metrics.Metrics (OpenTelemetryMetrics, "
                f"PrometheusMetrics), got {metrics!r}"
            )
        self._metrics = metrics
        if metrics is not None:
            metrics.bind(self)
        # follow_rules (aiolimit._follow): the rules document in Redis under this prefix
        # replaces `limits` while it exists, in every process, within rules_interval seconds.
        # Each read of it (and a decision's wait for the first) takes at most a decision's
        # deadline, or without one the socket timeout.
        self._follow_budget: float = self._failure.deadline_seconds or socket_timeout
        self._follower: RulesFollower | None = None
        if check_bool("follow_rules", follow_rules):
            if not self._store.loop_bound or self._store.address.startswith("memory"):
                raise ConfigurationError(
                    "follow_rules=True needs a Redis server (the rules document lives there)"
                )
            self._follower = RulesFollower(
                self._store,
                self._rules.prefix,
                self.set_rules,
                interval=check_optional_seconds("rules_interval", rules_interval, 0.01, 3600)
                or 1.0,
                cache_size=check_int("override_cache_size", override_cache_size, 1, MAX_CACHE),
                timeout=self._follow_budget,
            )
            self._rules.remote = self._follower
            self._rules_special = True

    @property
    def store(self) -> Store:
        return self._store

    @property
    def limits(self) -> dict[str, tuple[BaseLimit, ...]]:
        """The rules: identifier kind -> limits."""
        return dict(self._rules.by_kind)

    def add_rule(self, kind: str, limits: str | Sequence[BaseLimit | str]) -> None:
        """Adds the limits for a new identifier kind (a route's own limits use this).

        Adding the same limits again does nothing; a kind that already has other limits is a
        ``ConfigurationError``, and so is ``"*"`` or a kind containing ``:``.
        """
        self._added_rules[kind] = self._rules.register(kind, limits)

    async def push_rules(self, rules: RuleSet, *, expect: str = "*") -> bool:
        """Publishes ``rules`` as the rules document in Redis under this limiter's prefix:
        every limiter following it (``follow_rules=True``) switches to them. With ``expect``
        a version ("" for no document), nothing is written (False) if the stored document is
        no longer that one. This limiter follows at once if it follows at all. Within the
        limiter's deadline: past it, or at once while the breaker is open,
        ``BackendUnavailable``.
        """
        if not isinstance(rules, RuleSet):
            raise ConfigurationError(f"push_rules takes a RuleSet, got {rules!r}")
        self._check_usable()
        self._failure.check_open()
        # Under the deadline, as reset() is: past it ``BackendUnavailable`` (what was sent may
        # still land when a stopped server resumes: read the document again to know).
        async with self._failure.deadline():
            pushed = await publish(self._store, self._rules.prefix, rules, expect=expect)
        follower = self._follower
        if follower is not None:
            follower.start()  # following from now on, whether a decision was made here or not
            if pushed:
                await follower.refresh()
        return pushed

    @property
    def rules(self) -> RuleSet:
        """The rules in force now, as a ``RuleSet`` (see ``set_rules``)."""
        current = self._rules.ruleset
        return current if current is not None else RuleSet.from_limits(self._rules.by_kind)

    def set_rules(self, rules: RuleSet | LimitsArg | None) -> None:
        """Replaces the rules for the decisions that start from now on (``None``: the rules the
        limiter was made with). Decisions in flight finish under the rules they started with.
        Kinds added with ``add_rule`` (routes' own limits) carry over.
        """
        fresh = self._initial_rules if rules is None else Rules(rules, self._rules.prefix)
        for kind, limits in self._added_rules.items():
            fresh.register(kind, limits)
        fresh.remote = self._rules.remote
        self._rules = fresh
        self._rules_special = fresh.ruleset is not None or fresh.remote is not None

    @property
    def closed(self) -> bool:
        """True once ``aclose()`` was called (the limiter is not usable any more)."""
        return self._closed

    def _check_usable(self) -> None:
        if self._closed:
            raise UsageError(f"{self!r} is closed (aclose() was called); open a new Limiter")
        if self._store.loop_bound:
            if (
                getattr(self._loop, "_thread_id", None) == threading.get_ident()
                and self._loop_forks == _forks
            ):
                # This limiter's loop runs in this thread, so it is the loop running here (one
                # loop runs in a thread at a time): no need to ask asyncio, which costs a
                # getpid() call per call. (Unless this process was forked since the loop was
                # first used: the parent's loop object may name this thread, and run nowhere.)
                return
            loop = asyncio.get_running_loop()
            if self._loop is None:
                self._loop = loop
                self._loop_forks = _forks
            elif loop is not self._loop:
                raise UsageError(
                    f"{self!r} was first used on another event loop; its connections belong "
                    "to that loop. Create one limiter per event loop (e.g. in the app's lifespan)"
                )

    async def _decide(
        self, mode: Mode, plans: list[IdentifierPlan], weight: int, max_wait_us: int = 0
    ) -> Decision:
        """One decision under the failure policy: deadline, breaker, ``on_error``."""
        self._check_usable()
        failure = self._failure
        if self._store.single_slot:
            breaker = failure.breaker
            if breaker.state != "closed" and not breaker.allow():  # (closed: it allows)
                return failure.short_circuit()
            breakers: tuple[CircuitBreaker, ...] = (breaker,)
        else:
            breakers = self._breakers(plans)
            for index, breaker in enumerate(breakers):
                if not breaker.allow():
                    for taken in breakers[:index]:
                        taken.record_abandoned()
                    return failure.short_circuit(breakers)
        scope = failure.deadline()
        try:
            # ``async with scope`` written out: two coroutines fewer per decision.
            scope.enter()
            try:
                if mode is ACQUIRE:
                    decision = await self._protocol.acquire(plans, weight, max_wait_us)
                else:
                    decision = await self._protocol.decide(mode, plans, weight)
            except BaseException as error:
                scope.leave(type(error))  # (raises DeadlineExceeded if the deadline cut it)
                raise
            scope.leave(None)
        except BackendError as exc:
            self._counts["errors"] += 1
            return failure.failed(exc, breakers)
        except BaseException:
            self._counts["errors"] += 1
            for breaker in breakers:
                breaker.record_abandoned()
            raise
        for breaker in breakers:
            breaker.record_success()
        return decision

    def _breakers(self, plans: list[IdentifierPlan]) -> tuple[CircuitBreaker, ...]:
        """The breakers a decision must pass: the store's, or one per cluster node it needs."""
        failure = self._failure
        if self._store.single_slot:
            return (failure.breaker,)
        domain = self._store.fault_domain
        return tuple({failure.breaker_for(domain(plan.keys[0])): None for plan in plans})

    async def try_acquire(self, ids: Identifiers, weight: int = 1) -> Decision:
        """Admits and charges ``weight`` on every pair if all have room; never waits.

        Under a ``Concurrency`` limit an admitted decision carries a ``lease`` to release.
        """
        if self._follower is not None:
            unread = await self._follow(ids)
            if unread is not None:
                return self._unread(unread)
        plans = self._rules.plans(ids)
        weight = check_weight(weight, plans)
        if self._metrics is None and not self._rules_special:
            return await self._try_store(plans, weight, 0)  # (``_try``'s common path)
        return await self._try(plans, weight, 0)

    def _take_prefetched(self, ids: Identifiers, weight: int) -> Decision | None:
        """``try_acquire`` answered from this process's prefetched units, with nothing
        awaited; None when the call must be made (see ``_admit_prefetched``)."""
        admitted = self._admit_prefetched(ids, weight)
        if admitted is None:
            return None
        assert self._prefetch is not None
        return self._prefetch.decision_of(admitted)

    def _admit_prefetched(self, ids: Identifiers, weight: int) -> Admitted | None:
        """An admission from this process's prefetched units, with nothing awaited, its
        ``Decision`` left unmade (``Allowances.decision_of`` makes it); None when the call
        must be made (prefetch off, no live allowance for these identifiers, rules from
        Redis, metrics to record). ``weight`` is a valid weight.

        The web layers' path for an admission made here: the same take as ``try_acquire``'s,
        without its periodic yield (a request never loops without the server's reads
        between)."""
        prefetch = self._prefetch
        if (
            prefetch is None
            or self._follower is not None
            or self._metrics is not None
            or self._rules_special
        ):
            return None
        self._check_usable()  # (closed, or another event loop: raises as try_acquire does)
        admitted = prefetch.admit(self._rules.plans(ids), weight)
        if admitted is not None:
            counts = self._counts
            counts["decisions"] += 1
            counts["allowed"] += 1
        return admitted

    async def _follow(self, ids: Identifiers, *, strict: bool = False) -> BackendError | None:
        """Rules from Redis: read before the first decision; overrides looked up on demand.

        Every decision waits for the first read of the document (concurrent ones wait for
        the same read), at most the limiter's deadline (without one, ``socket_timeout``).
        When the read fails or does not come in time, or the breaker is open, the error
        is returned: the caller answers as the failure policy says (``on_error``), as if
        the decision itself had failed, and the next decision waits for a read again.
        Once read, a failed override lookup does not stop the decision: the rules in force
        and the cached overrides decide (the decision itself meets the failure policy);
        ``strict`` (refund, reset: they must not act on other keys) returns its error too.
        """
        follower = self._follower
        assert follower is not None
        self._check_usable()
        budget = self._follow_budget
        if not follower.ready:
            # The read goes through the breaker as a decision would: while it is open no
            # decision waits for a read, and once recovery_time has passed one decision's
            # read is the probe (the others are answered at once meanwhile). A failed probe
            # gives its slot back here; a decision's failure policy (``_unread``) records the
            # failure (the breaker opens again), and a refund or reset that took the probe
            # leaves the next call to probe.
            breaker = self._failure.breaker
            if breaker.state != "closed" and not breaker.allow():
                return _BreakerOpen("circuit breaker open: the rules were not read")
            probing = breaker.state == "half_open"
            failure: BackendError | None = None
            try:
                await follower.first_read(budget)
            except BackendError as exc:
                failure = exc
            except TimeoutError:
                failure = BackendUnavailable(
                    f"{self._store.address}: no answer within {budget:g} s to the first read "
                    "of the rules document"
                )
            except BaseException:
                if probing:
                    breaker.record_abandoned()
                raise
            if failure is not None:
                if probing:
                    breaker.record_abandoned()
                return failure
            if probing:
                breaker.record_success()
        ids = (ids,) if isinstance(ids, str) else ids
        wanted = follower.missing(ids)
        if wanted and (strict or self._failure.breaker.state != "open"):
            try:
                async with asyncio.timeout(budget):
                    # The call's own identifiers stay cached until its plans are built.
                    keep = len(ids) if isinstance(ids, (list, tuple, set, frozenset)) else 0
                    await follower.fetch(wanted, keep=keep)
            except BackendError as exc:
                if strict:
                    return exc
            except TimeoutError:
                if strict:
                    return BackendUnavailable(
                        f"{self._store.address}: no answer within {budget:g} s to an override "
                        "lookup"
                    )
        return None

    def _unread(self, error: BackendError, *, count: bool = True) -> Decision:
        """The failure policy's answer to a decision made before the rules could be read
        (raises under ``on_error="raise"``); counted as a decision that failed."""
        counts = self._counts
        if isinstance(error, _BreakerOpen):
            decision = self._failure.short_circuit()  # the store was not asked
        else:
            counts["errors"] += 1
            decision = self._failure.failed(error)
        if count:
            counts["decisions"] += 1
            counts["allowed" if decision.allowed else "refused"] += 1
            if self._metrics is not None:
                self._metrics.record(decision, 0.0, "*")
        return decision

    async def _try(self, plans: list[IdentifierPlan], weight: int, max_wait_us: int) -> Decision:
        metrics = self._metrics
        if metrics is None:
            if not self._rules_special:
                return await self._try_store(plans, weight, max_wait_us)
            return await self._try_rules(plans, weight, max_wait_us)
        started = time.perf_counter()
        decision = await self._try_rules(plans, weight, max_wait_us)
        binding = decision.identifier
        if binding is None:  # (a call under shadow rules alone: counted under their kind)
            if decision.shadow_refusals:
                binding = decision.shadow_refusals[0].identifier
            elif decision.details:
                binding = decision.details[0].identifier
        kind = identifier_kind(binding or "")
        if kind not in self._rules.by_kind:
            kind = "*"
        metrics.record(decision, time.perf_counter() - started, kind)
        return decision

    async def _try_rules(
        self, plans: list[IdentifierPlan], weight: int, max_wait_us: int
    ) -> Decision:
        if self._rules_special:
            screened = self._screen(plans)
            if isinstance(screened, Decision):
                return screened
            plans = screened
        decision = await self._try_store(plans, weight, max_wait_us)
        if not self._rules_special:
            return decision
        if not decision.allowed and not decision.degraded:
            decision = await self._unshadow(plans, weight, max_wait_us, decision)
        if decision.details and any(plan.shadow for plan in plans):
            decision = _enforced_summary(decision, {p.identifier for p in plans if p.shadow})
        return decision

    async def _prefetching(
        self, prefetch: Allowances, plans: list[IdentifierPlan], weight: int
    ) -> Decision:
        """The store's decision for a call that may take units ahead (``prefetch``). Whatever
        it waits for (other calls' refills, a call with units ahead refused, then its own),
        it is decided within the one deadline of a decision."""
        clock = self.clock
        seconds = self._failure.deadline_seconds
        began = time.monotonic()
        for _ in range(REFILL_WAITS):
            if not await self._refilled(prefetch, plans, seconds, began):
                break
            # Another call was taking units ahead on these identifiers: from them, if it got
            # them and they are not all taken yet (else the next one's, a few times at most).
            local = prefetch.take(plans, weight)
            if local is not None:
                return local
        extra = prefetch.extra(plans, weight)
        if extra and seconds is not None:
            # Refused for its units ahead, a call is sent again for its own weight: when the
            # store takes too long for two round trips in what is left of the deadline, it
            # takes none (a call the store answers in time would come back as a failure).
            if seconds - (time.monotonic() - began) < 2 * prefetch.round_trip:
                extra = 0
        if extra:
            taken = await self._taking_ahead(prefetch, plans, weight, extra, seconds, began)
            if taken is not None:
                return taken
            # Refused with the units ahead, which charged nothing: asked again for its own.
        sent = clock.monotonic()
        asked = time.monotonic()
        decision = await self._decide_within(plans, weight, seconds, began)
        if not decision.degraded:
            prefetch.round_trip = time.monotonic() - asked
        return self._observed(prefetch, plans, weight, decision, sent)

    async def _taking_ahead(
        self, prefetch: Allowances, plans: list[IdentifierPlan], weight: int, extra: int,
        seconds: float | None, began: float, *, background: bool = False,
    ) -> Decision | None:  # fmt: skip
        """Asks the store for ``weight`` plus ``extra`` units under one op kept open: the
        caller's decision (``Allowances.opened`` keeps the extra units), or None when the
        store refused it (nothing was charged: the caller asks again for its own weight).
        ``background``: a refill ahead (``_quietly``); None as well when it failed."""
        held = KeepOpen()
        token = HELD_TURNS.set(held)
        sent = self.clock.monotonic()
        prefetch.pending(plans, True)
        epoch = prefetch.sending()
        asked = time.monotonic()
        try:
            if background:
                answer = await self._quietly(plans, weight + extra)
                if answer is None:
                    return None
                decision = answer
            else:
                decision = await self._decide_within(plans, weight + extra, seconds, began)
            if not decision.degraded:
                prefetch.round_trip = time.monotonic() - asked
        except BaseException:
            for turn in held:  # (none: a turn is held only once the call returned)
                self._protocol.end_turn(turn, undo=True)
            raise
        finally:
            prefetch.pending(plans, False)
            HELD_TURNS.reset(token)
            prefetch.answered()
        if held:
            return prefetch.opened(
                plans, weight, extra, held[0], decision, sent, epoch, replayed=held.replayed
            )
        if decision.allowed or decision.degraded:
            return decision  # (the failure policy's answer: nothing was charged)
        prefetch.observe(plans, weight, decision, sent)
        return None

    def _running_low(self, plans: Sequence[IdentifierPlan]) -> None:
        """An allowance on ``plans`` is running low (``Allowances.low``): its next units are
        asked for in a task of their own, unless a call on them is asking already."""
        if self._closed:
            return
        task = asyncio.ensure_future(self._refill_ahead(list(plans)))
        self._ahead.add(task)
        task.add_done_callback(self._ahead.discard)

    async def _refill_ahead(self, plans: list[IdentifierPlan]) -> None:
        """Takes the next units on ``plans`` before the live allowance runs out, as a call
        that needs none for itself (weight 0): no caller waits for it, and the calls that
        find the allowance empty meanwhile wait for these units (``Allowances.refill``)
        rather than each asking the store. Not a decision: nothing is counted, the breaker
        neither records it nor lets it probe, and a failure only means the next call asks
        the store itself. Under the rules in force when it starts: plans whose limits
        changed since the allowance was taken take nothing (no call could use them)."""
        prefetch = self._prefetch
        if prefetch is None or self._closed:
            return
        try:
            current = self._rules.plans([plan.identifier for plan in plans])
        except InvalidRequestError:  # (its kind is gone from the rules)
            return
        if not same_limits(current, plans) or not eligible(current, self._store.single_slot):
            return
        extra = prefetch.extra(current, 0)
        if not extra:
            return
        try:
            await self._taking_ahead(prefetch, current, 0, extra, None, 0.0, background=True)
        except Exception as exc:  # (nobody to tell: the next call meets it, if it lasts)
            logger.debug("aiolimit: taking units ahead in the background failed: %r", exc)

    async def _quietly(self, plans: list[IdentifierPlan], weight: int) -> Decision | None:
        """An acquire for background work (a refill ahead), under the decisions' deadline:
        None when a breaker it needs is not closed, or the store failed. Unlike ``_decide``
        it counts nothing and tells the breaker nothing: it is no caller's decision, and a
        refill that failed must not make a caller's 503 (a call cut by the deadline is
        undone as any)."""
        if any(breaker.state != "closed" for breaker in self._breakers(plans)):
            return None
        self._check_usable()
        try:
            async with self._failure.deadline():
                return await self._protocol.acquire(plans, weight, 0)
        except BackendError as exc:
            logger.debug("aiolimit: taking units ahead in the background failed: %r", exc)
            return None

    async def _refilled(
        self, prefetch: Allowances, plans: list[IdentifierPlan], seconds: float | None,
        began: float,
    ) -> bool:  # fmt: skip
        """Waits for another call's refill on ``plans`` (``Allowances.refill``), within what
        is left of the deadline less twice the last round trip (its units may all go to
        earlier waiters: the call must still have time to ask the store itself; a slow store
        otherwise turned a chain of refills into calls past their deadline, and the breaker
        opened on a store that answered every call in time): False when there was none, or
        no time is left for it."""
        if seconds is None:
            return await prefetch.refill(plans)
        left = seconds - (time.monotonic() - began) - 2 * prefetch.round_trip
        if left <= 0:
            return False
        scope = asyncio.timeout(left)
        try:
            async with scope:
                return await prefetch.refill(plans)
        except TimeoutError:
            if not scope.expired():
                raise
            return False

    def _observed(
        self, prefetch: Allowances, plans: list[IdentifierPlan], weight: int,
        decision: Decision, sent: float,
    ) -> Decision:  # fmt: skip
        """A decision the store made for ``weight`` alone, noted for sizing; a refusal that
        only this process's own units kept out says so (``Allowances.refused``)."""
        prefetch.observe(plans, weight, decision, sent)
        if decision.allowed or decision.degraded:
            return decision
        now = self.clock.monotonic()
        return prefetch.refused(plans, weight, decision, max(now - sent, 0.001))

    async def _decide_within(
        self, plans: list[IdentifierPlan], weight: int, seconds: float | None, began: float
    ) -> Decision:
        """``_decide`` (an acquire) within what is left of a deadline of ``seconds`` that
        began at ``began`` (``time.monotonic``), cut as the deadline would cut it: the failure
        policy answers (a call that was sent is undone in the background)."""
        if seconds is None:
            return await self._decide(ACQUIRE, plans, weight)
        left = seconds - (time.monotonic() - began)
        failure = self._failure
        if left >= seconds:
            return await self._decide(ACQUIRE, plans, weight)  # (its own deadline is the one)
        if left > 0:
            scope = asyncio.timeout(left)
            try:
                async with scope:
                    return await self._decide(ACQUIRE, plans, weight)
            except TimeoutError:
                if not scope.expired():
                    raise
                # (``_decide`` counted the error as it was cut)
        else:
            self._counts["errors"] += 1
        error = DeadlineExceeded(
            f"store at {failure.address} gave no decision within the deadline of "
            f"{failure.deadline_seconds:g}s"
        )
        error.__cause__ = TimeoutError()
        return failure.failed(error, self._breakers(plans))

    def _screen(self, plans: list[IdentifierPlan]) -> list[IdentifierPlan] | Decision:
        """Leaves out the allowed (exempt) identifiers; a denied one refuses at once."""
        counts = self._counts
        for plan in plans:
            if plan.deny:
                counts["decisions"] += 1
                counts["refused"] += 1
                counts["denied"] += 1
                return Decision(
                    False, 0, math.inf, math.inf, plan.identifier, None, (), denied=True
                )
        active = [plan for plan in plans if not plan.exempt]
        if not active:
            counts["decisions"] += 1
            counts["allowed"] += 1
            return Decision(True, 0, 0.0, 0.0, None, None, ())
        return active

    async def _unshadow(
        self, plans: list[IdentifierPlan], weight: int, max_wait_us: int, decision: Decision
    ) -> Decision:
        """A refusal that only shadow rules made: admitted under the enforced rules alone."""
        shadowed = {plan.identifier for plan in plans if plan.shadow}
        refusing = tuple(pair for pair in decision.details if not pair.allowed)
        if not shadowed or not refusing or any(p.identifier not in shadowed for p in refusing):
            return decision
        counts = self._counts
        enforced = [plan for plan in plans if not plan.shadow]
        # The refusal was counted as one; this request is decided again without the shadows.
        counts["decisions"] -= 1
        counts["refused"] -= 1
        if enforced and self._count_refused:
            # count_refused: the refusal counted this request on every pair already, the
            # enforced ones included; they are given that back before the request is decided
            # on them, or they would count it twice (once refused, once admitted).
            breakers = self._breakers(enforced)
            try:
                async with self._failure.deadline():
                    await self._protocol.refund(enforced, weight)
            except BackendError as exc:  # (a refund once sent finishes in the background)
                counts["decisions"] += 1
                counts["errors"] += 1
                failed = self._failure.failed(exc, breakers)
                counts["allowed" if failed.allowed else "refused"] += 1
                return failed
        if enforced:
            again = await self._try_store(enforced, weight, max_wait_us)
        else:
            counts["decisions"] += 1
            counts["allowed"] += 1
            again = Decision(True, 0, 0.0, 0.0, None, None, ())
        if not again.allowed:
            return again  # the enforced rules refuse it too: as if the shadows were not there
        counts["shadow_refusals"] += 1
        _log_shadow(self, refusing)
        return dataclasses.replace(again, shadow_refusals=refusing)

    async def _try_store(
        self, plans: list[IdentifierPlan], weight: int, max_wait_us: int
    ) -> Decision:
        counts = self._counts
        prefetch = self._prefetch
        if prefetch is not None and max_wait_us == 0:
            self._check_usable()
            if prefetch.local % CACHED_YIELD_EVERY == CACHED_YIELD_EVERY - 1:
                # As a cached refusal: a caller looping on local admissions must let the
                # event loop run. Before the units are taken: a caller cancelled here has
                # taken nothing.
                await asyncio.sleep(0)
            local = prefetch.take(plans, weight)
            if local is not None:
                counts["decisions"] += 1
                counts["allowed"] += 1
                return local
        refusals = self._refusals
        sent_at = 0.0
        epoch = 0
        if refusals is not None:
            self._check_usable()
            sent_at = self.clock.monotonic()
            epoch = refusals.epoch
            cached = refusals.lookup(
                [(plan.identifier, plan.limits) for plan in plans],
                weight,
                max_wait_us / 1_000_000,
                sent_at,
            )
            if cached is not None:
                counts["decisions"] += 1
                counts["refused"] += 1
                if counts["decisions"] % CACHED_YIELD_EVERY == 0:
                    # A cached refusal never waits for anything: a caller that loops on them
                    # would never let the event loop run (replies, timers, other tasks).
                    await asyncio.sleep(0)
                return cached
        if prefetch is not None and max_wait_us == 0 and eligible(plans, self._store.single_slot):
            decision = await self._prefetching(prefetch, plans, weight)
        else:
            decision = await self._decide(ACQUIRE, plans, weight, max_wait_us)
        counts["decisions"] += 1
        if decision.allowed:
            counts["allowed"] += 1
        else:
            counts["refused"] += 1
            if refusals is not None:
                refusals.remember(decision, weight, sent_at, epoch)
        return decision

    async def acquire(
        self,
        ids: Identifiers,
        weight: int = 1,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - the documented API: it waits
    ) -> Decision:
        """Like ``try_acquire``, but sleeps ``retry_after`` and tries again until admitted.

        ``timeout=None`` (or ``math.inf``) waits as long as it takes, ``timeout=0`` never
        waits. When the next
        chance would come after the timeout, it raises ``RateLimited`` at once rather than
        sleeping in vain.
        """
        if timeout == math.inf:
            timeout = None  # as long as it takes
        timeout = check_optional_seconds("timeout", timeout, 0, MAX_SECONDS)
        clock = self.clock
        deadline = None if timeout is None else clock.monotonic() + timeout
        while self._follower is not None:
            unread = await self._follow(ids)
            if unread is None:
                break
            failed = self._unread(unread)
            if failed.allowed:
                return failed  # on_error="open"
            # on_error="closed": refused for now; tried again as a refusal would be.
            if deadline is not None and clock.monotonic() + failed.retry_after > deadline:
                raise RateLimited(failed)
            self._counts["waits"] += 1
            await clock.sleep(failed.retry_after + clock.sleep_margin)
        plans = self._rules.plans(ids)
        weight = check_weight(weight, plans)
        # When the call's one limit is a GCRA bucket, a waiter reserves its turn (charged now,
        # admitted after the delay): waiters are served in arrival order with one call each,
        # instead of all waking at once and retrying. Not with several pairs: each would
        # reserve its own turn and the caller pass at the latest, its unit on a faster bucket
        # charged at an earlier turn than it uses (that bucket refills meanwhile: over-admission).
        queueable = (
            timeout != 0 and len(plans) == 1 and plans[0].queueable and len(plans[0].limits) == 1
        )
        polls = 0
        while True:
            max_wait_us = 0
            if queueable:
                left = MAX_RESERVATION_US if deadline is None else deadline - clock.monotonic()
                max_wait_us = max(0, min(MAX_RESERVATION_US, int(left * 1_000_000)))
            started = clock.monotonic()
            releases = self._protocol.releases
            held: list[Turn] = []
            token = HELD_TURNS.set(held)
            try:
                decision = await self._try(plans, weight, max_wait_us)
            except BaseException:
                for turn in held:
                    self._protocol.end_turn(turn, undo=True)
                raise
            finally:
                HELD_TURNS.reset(token)
            if decision.denied:
                raise RateLimited(decision)  # the rules deny it: waiting cannot help
            # Waits count from the decision: time the clock moved while the call was in
            # flight (other tasks may move a manual clock) is already spent.
            elapsed_us = round((clock.monotonic() - started) * 1_000_000)
            if decision.allowed:
                delay_us = max((round(p.retry_after * 1e6) for p in decision.details), default=0)
                if delay_us > elapsed_us and not decision.degraded:
                    # A reserved turn. A waiter cancelled meanwhile gives it back: the undo
                    # frees that turn alone (the script keeps the queue's gaps), for the next
                    # waiter to take; later waiters keep theirs.
                    self._counts["waits"] += 1
                    try:
                        await clock.sleep((delay_us - elapsed_us) / 1e6)
                    except BaseException:
                        for turn in held:
                            self._protocol.end_turn(turn, undo=True)
                        raise
                for turn in held:
                    self._protocol.end_turn(turn, undo=False)
                return decision
            for turn in held:  # (none: a refusal reserves nothing)
                self._protocol.end_turn(turn, undo=False)
            # A refusal means not now: at least 1 µs (a refusal cached locally may have less
            # than 0.5 µs left, and a manual clock with no margin would never move).
            wait = max(round(decision.retry_after * 1e6) - elapsed_us, 1) / 1e6
            if _refused_by_a_lease(decision):
                # A lease's retry_after is when it expires at the latest; its holder usually
                # releases it sooner. Try again at a release in this process, or after a
                # poll interval growing to LEASE_POLL_MAX, or at the timeout.
                polls += 1
                wait = min(wait, LEASE_POLL_MIN * 2 ** min(polls - 1, 8), LEASE_POLL_MAX)
                if deadline is not None:
                    left = deadline - clock.monotonic()
                    if left <= 0:
                        raise RateLimited(decision)
                    wait = min(wait, left)
                self._counts["waits"] += 1
                await self._sleep_until_release(wait, releases)
                continue
            if deadline is not None and clock.monotonic() + wait > deadline:
                raise RateLimited(decision)
            self._counts["waits"] += 1
            await clock.sleep(wait + clock.sleep_margin)

    async def _sleep_until_release(self, seconds: float, releases: int) -> None:
        """Sleeps ``seconds`` on the clock, or less if this process releases a lease; not at
        all if it released one since it counted ``releases`` (before the refused call: the
        release may have landed after the store refused, and woken nobody)."""
        if self._protocol.releases != releases:
            return
        released = self._protocol.next_release()
        sleeping = asyncio.ensure_future(self.clock.sleep(seconds))
        try:
            await asyncio.wait((sleeping, released), return_when=asyncio.FIRST_COMPLETED)
        finally:
            sleeping.cancel()
            released.cancel()

    def limit(
        self, ids: Identifiers, weight: int = 1, *, timeout: float | None = None
    ) -> Acquisition:
        """``async with limiter.limit(ids) as decision:`` or ``await limiter.limit(ids)``."""
        return Acquisition(self, ids, weight, timeout)

    def limited(
        self,
        ids: Identifiers | Callable[..., Identifiers],
        weight: int | Callable[..., int] = 1,
        *,
        timeout: float | None = None,
    ) -> Callable[[Callable[P, Awaitable[T]]], Callable[P, Awaitable[T]]]:
        """A decorator for any coroutine function (an outgoing API call, a job): each call
        first acquires, as ``async with limiter.limit(...)`` would, then runs.

        ``ids`` and ``weight`` are values, or functions of the call's arguments (e.g.
        ``lambda user, query: f"user:{user}"``). ``timeout`` is ``acquire``'s: ``None`` waits
        as long as it takes, ``0`` raises ``RateLimited`` at once. ``Concurrency`` leases are
        held for the call and released when it ends, however it ends.
        """
        if not callable(ids):
            self._rules.plans(ids)  # a bad identifier fails here, not at the first call
        if not callable(weight):
            check_weight(weight, [])

        def decorate(function: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
            if not inspect.iscoroutinefunction(function):
                raise ConfigurationError(
                    f"limited() decorates coroutine functions (async def), got {function!r}"
                )

            @functools.wraps(function)
            async def call(*args: P.args, **kwargs: P.kwargs) -> T:
                key = ids(*args, **kwargs) if callable(ids) else ids
                units = weight(*args, **kwargs) if callable(weight) else weight
                async with self.limit(key, units, timeout=timeout):
                    return await function(*args, **kwargs)

            return call

        return decorate

    async def peek(self, ids: Identifiers, weight: int = 1) -> Decision:
        """The state now, charging nothing: ``allowed`` says whether ``weight`` would pass,
        ``remaining`` (and each pair's) is what is left now, ``reset_after`` when the pairs
        are full again, ``retry_after`` (if refused) when ``weight`` would pass.

        (Before 0.2, ``remaining`` was what would be left after ``weight``.)
        """
        if self._follower is not None:
            unread = await self._follow(ids)
            if unread is not None:
                return self._unread(unread, count=False)
        plans = self._rules.plans(ids)
        weight = check_weight(weight, plans)
        if self._rules_special:
            counts = dict(self._counts)
            screened = self._screen(plans)
            self._counts.update(counts)  # a peek is not a decision
            if isinstance(screened, Decision):
                return screened
            plans = screened
        return await self._decide(PEEK, plans, weight)

    async def refund(
        self, ids: Identifiers, weight: int | None = None, *, decision: Decision | None = None
    ) -> Decision:
        """Gives ``weight`` (default 1) back on every pair (newest charges first, never below
        zero), under the rules in force (following the rules in Redis: the identifier's
        override too).

        With ``decision`` (an admission this limiter returned), only what it charged is
        credited, whatever the rules are now: a limit added since is left alone, a limit
        removed since still gets its charge back. ``ids`` names which of its identifiers to
        credit; ``weight`` defaults to the weight it was charged, and no refund through it
        gives back more than that on any identifier (copies of it included): past that, or
        for a decision another limiter made, ``InvalidRequestError``. A decision that charged
        nothing (degraded, or only exempt identifiers) is returned as is, and nothing is
        sent; a refused one raises ``InvalidRequestError``.
        """
        charge = None
        if decision is not None:
            names = identifiers_of(ids)
            charge = self._charge_of(decision)
            if charge is None:
                return decision
            weight = check_weight(charge.weight if weight is None else weight, [])
            plans = self._given_back(charge, names, weight)
        else:
            if self._follower is not None:
                unread = await self._follow(ids, strict=True)
                if unread is not None:
                    raise unread
            plans = self._rules.plans(ids)
            weight = check_weight(1 if weight is None else weight, [])
        self._check_usable()
        self._failure.check_open(self._breakers(plans))
        if charge is not None:
            left = charge.left
            assert left is not None
            for plan in plans:  # (from here the refund is sent, and finishes in any case)
                left[plan.identifier] -= weight
        refusals = self._refusals
        if refusals is not None:
            refusals.forget(plan.identifier for plan in plans)
        try:
            async with self._failure.deadline():
                return await self._protocol.refund(plans, weight)
        except BaseException as error:
            if charge is not None and _unsent(error):
                # Nothing was sent (it waited in line for its keys): the caller may retry.
                left = charge.left
                assert left is not None
                for plan in plans:
                    left[plan.identifier] += weight
            raise
        finally:
            if refusals is not None:
                refusals.forget(plan.identifier for plan in plans)

    def _charge_of(self, decision: object) -> Charge | None:
        """The charge ``decision`` records, checked for a refund through this limiter; None
        when it charged nothing."""
        if not isinstance(decision, Decision):
            raise InvalidRequestError(
                f"decision must be a Decision the limiter returned, got {type(decision).__name__}"
            )
        if not decision.allowed:
            raise InvalidRequestError(
                "a refused decision charged nothing: there is nothing of it to give back"
            )
        charge = decision._charge
        if charge is None:
            if decision.degraded or not decision.details:
                return None  # a fail-open answer, or exempt identifiers only: nothing charged
            raise InvalidRequestError(
                "this decision records no charge: pass one that try_acquire, acquire or limit "
                "returned"
            )
        if charge.owner is not self._protocol:
            raise InvalidRequestError(
                "this decision was made by another limiter: refund it through that one"
            )
        return charge

    def _given_back(
        self, charge: Charge, names: Iterable[str], weight: int
    ) -> list[IdentifierPlan]:
        """The plans of ``names`` in ``charge``, checked to have ``weight`` left to give
        back."""
        left = charge.left
        if left is None:
            left = charge.left = {plan.identifier: charge.weight for plan in charge.plans}
        by_name = {plan.identifier: plan for plan in charge.plans}
        plans = []
        for name in names:
            plan = by_name.get(name)
            if plan is None:
                raise InvalidRequestError(
                    f"identifier {name!r} was not charged by this decision; it charged "
                    f"{sorted(by_name)}"
                )
            if weight > left[name]:
                raise InvalidRequestError(
                    f"a refund of {weight} on {name!r} through this decision gives back more "
                    f"than it charged there: {left[name]} of its {charge.weight} are left"
                )
            plans.append(plan)
        return plans

    def storage_keys(self, identifier: str) -> tuple[str, ...]:
        """The Redis keys that hold ``identifier``'s state under the rules in force."""
        return self._rules.plans(identifier)[0].keys

    async def reset(self, ids: Identifiers) -> None:
        """Forgets everything stored for these identifiers: their keys under the rules in
        force (following the rules in Redis: the identifier's override, looked up if need
        be), and under the rules the limiter was made with. Within the limiter's deadline,
        like a refund: past it, or at once while the breaker is open, ``BackendUnavailable``
        (the keys may or may not be gone)."""
        if self._follower is not None:
            unread = await self._follow(ids, strict=True)
            if unread is not None:
                raise unread
        plans = self._rules.plans(ids)
        self._check_usable()
        self._failure.check_open(self._breakers(plans))
        if self._prefetch is not None:
            # Units held here were charged before the reset: not to be admitted after it.
            self._prefetch.drop({plan.identifier for plan in plans})
        refusals = self._refusals
        if refusals is not None:
            refusals.forget(plan.identifier for plan in plans)
        try:
            # Under the deadline, as a refund is: a limiter with a deadline opens its
            # connections without a socket timeout, and a stopped server never answers.
            async with self._failure.deadline():
                for plan in plans:
                    await self._store.delete(self._every_key(plan))
        finally:
            if refusals is not None:
                refusals.forget(plan.identifier for plan in plans)
            if self._prefetch is not None:
                # Again once the delete is over (or gave up): a call that took units ahead
                # after the first drop may have run before the delete, which wiped them.
                self._prefetch.drop({plan.identifier for plan in plans})

    def _every_key(self, plan: IdentifierPlan) -> list[str]:
        """The plan's keys, and those the identifier has under the limiter's own rules (the
        rules in Redis may have replaced them since it was charged)."""
        keys = dict.fromkeys(plan.keys)
        if self._initial_rules is not self._rules:
            try:
                keys.update(dict.fromkeys(self._initial_rules.plan_for(plan.identifier).keys))
            except InvalidRequestError:  # no rule of its kind there
                pass
        return list(keys)

    def statistics(self) -> LimiterStatistics:
        protocol = self._protocol.statistics
        follower = self._follower
        serving = self._store.fault_domains()
        if serving is not None:
            self._failure.forget_domains(serving)
        return LimiterStatistics(
            **self._counts,
            multi_slot_decisions=protocol.multi_slot,
            compensations=protocol.compensations,
            cached_refusals=0 if self._refusals is None else self._refusals.hits,
            prefetched=0 if self._prefetch is None else self._prefetch.local,
            rules_version=None if follower is None else follower.statistics.version,
            rules_reloads=0 if follower is None else follower.statistics.reloads,
            rules_rejected=0 if follower is None else follower.statistics.rejected,
            breaker=self._failure.statistics(),
        )

    async def aclose(self) -> None:
        """Closes the connections the limiter opened (not a client you passed in).

        Undos and lease releases still running finish first. Idempotent; a closed limiter
        raises ``UsageError`` when used.
        """
        if self._closed:
            return
        self._closed = True
        if self._follower is not None:
            await self._follower.aclose()
        if self._metrics is not None:
            self._metrics.unbind(self)
        if self._prefetch is not None:
            self._prefetch.close()  # (what they hold is given back before the store closes)
            # A call taking units ahead still in flight gives them back when it returns
            # (``close`` moved the epoch): the protocol must still be open then.
            await self._prefetch.drained(UNDO_BUDGET)
        await self._protocol.aclose()
        await self._store.aclose()

    async def __aenter__(self) -> Limiter:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:  # fmt: skip
        await self.aclose()

    def __repr__(self) -> str:
        return f"Limiter({self._store.address!r}, {self._rules.by_kind!r}, clock={self.clock!r})"


class _BreakerOpen(BackendUnavailable):
    """The rules were not read because the breaker is open (the store was not asked)."""


#: Shadow refusals are logged at most once per this many seconds (with their count).
SHADOW_LOG_INTERVAL = 10.0


def _enforced_summary(decision: Decision, shadowed: set[str]) -> Decision:
    """``decision`` with its summary (``remaining``, ``retry_after``, ``reset_after``, the
    binding pair) made from the enforced pairs alone. Shadow pairs are decided and charged as
    usual and stay in ``details``, but they never refuse: a shadow rule with less left, or a
    longer wait, must not be what the caller reads (nor what ``acquire`` waits for, nor what a
    web layer advertises). With no enforced pair left, it reads as a call with no limits."""
    details = decision.details
    if not any(pair.identifier in shadowed for pair in details):
        return decision
    merged = Decision.from_pairs(tuple(p for p in details if p.identifier not in shadowed))
    return dataclasses.replace(
        decision,
        remaining=merged.remaining,
        retry_after=decision.retry_after if decision.allowed else merged.retry_after,
        reset_after=merged.reset_after,
        identifier=merged.identifier,
        limit=merged.limit,
    )


_shadow_log = {"at": -math.inf, "count": 0}


def _log_shadow(limiter: Limiter, refusing: tuple[Any, ...]) -> None:
    state = _shadow_log
    state["count"] += 1
    now = time.monotonic()
    if now - state["at"] < SHADOW_LOG_INTERVAL:
        return
    pair = refusing[0]
    logger.warning(
        "aiolimit shadow: %d request(s) admitted that shadow rules refused since the last "
        "report; e.g. %r under %s",
        state["count"], pair.identifier, pair.limit,
        extra={"aiolimit_event": "shadow_refusal", "aiolimit_count": state["count"]},
    )  # fmt: skip
    state["at"], state["count"] = now, 0


def _refused_by_a_lease(decision: Decision) -> bool:
    return any(
        not pair.allowed and isinstance(pair.limit, Concurrency) for pair in decision.details
    )


class Acquisition:
    """What ``Limiter.limit`` returns: awaitable, and an async context manager.

    One object may be entered by several tasks at once (as an ``asyncio.Semaphore`` is):
    each ``async with`` releases the lease it took. ``decision`` is the latest admission."""

    def __init__(
        self, limiter: Limiter, ids: Identifiers, weight: int, timeout: float | None
    ) -> None:
        self._limiter = limiter
        self._ids = ids
        self._weight = weight
        self._timeout = timeout
        self.decision: Decision | None = None
        # The admissions entered and not yet left, per task (innermost last).
        self._held: dict[asyncio.Task[Any] | None, list[Decision]] = {}

    def __await__(self) -> Generator[Any, None, Decision]:
        return self._limiter.acquire(self._ids, self._weight, timeout=self._timeout).__await__()

    async def __aenter__(self) -> Decision:
        decision = await self._limiter.acquire(self._ids, self._weight, timeout=self._timeout)
        self._held.setdefault(asyncio.current_task(), []).append(decision)
        self.decision = decision
        return decision

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:  # fmt: skip
        # Concurrency leases go back on every exit: normal, error or cancellation. A store
        # failure here must not mask how the body ended: the release is retried in the
        # background and the failure logged. The exit waits at most the limiter's deadline
        # (the release goes on in its own task), as a decision would.
        task = asyncio.current_task()
        held = self._held.get(task)
        decision = held.pop() if held else None
        if not held:
            self._held.pop(task, None)
        if decision is not None and decision.lease is not None:
            try:
                async with asyncio.timeout(self._limiter._failure.deadline_seconds):
                    await decision.lease.release()
            except (BackendError, TimeoutError) as error:
                logger.warning("aiolimit: releasing a lease failed, retrying: %r", error)


def _unsent(error: BaseException) -> bool:
    """The refund that raised ``error`` sent nothing (its cause chain is marked so by
    ``Protocol.refund``: it never left the line for its keys). A store's own ``mark_unsent``
    does not count: that refund is sent again in the background all the same."""
    seen: BaseException | None = error
    while seen is not None:
        if getattr(seen, "_aiolimit_refund_unsent", False):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
