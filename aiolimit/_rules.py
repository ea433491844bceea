"""Rules: which limits apply to an identifier, and the boundary checks on every call.

An identifier's kind is the text before its first ``:`` (``"ip:203.0.113.7"`` is of kind
``ip``). Rules map kinds to limits; ``"*"`` is the default for kinds without a rule of their own.
A plain sequence of limits is the rule ``{"*": limits}``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Protocol, TypeAlias

from aiolimit._errors import ConfigurationError, InvalidRequestError, WeightNeverFits
from aiolimit._keys import aux_key, identifier_kind, main_key
from aiolimit._limits import BaseLimit, parse_limits
from aiolimit._ruleset import Override, RuleSet
from aiolimit._validation import MAX_AMOUNT
from aiolimit._validation import check_weight as validate_weight

LimitsArg: TypeAlias = (
    "str | Sequence[BaseLimit | str] | Mapping[str, str | Sequence[BaseLimit | str]]"
)
MAX_WEIGHT = MAX_AMOUNT


@dataclass(frozen=True, slots=True)
class IdentifierPlan:
    """What one identifier contributes to a script call, with key indexes relative to it."""

    identifier: str
    limits: tuple[BaseLimit, ...]
    keys: tuple[str, ...]
    # This identifier's block of the script's ARGV (see lua/decide.lua), built once.
    block: bytes
    max_weight: int
    has_leases: bool  # a Concurrency limit applies: acquiring takes a lease to release
    queueable: bool  # every limit is GCRA, so acquire may reserve a turn instead of retrying
    shadow: bool = False  # decided and charged as usual, but never refuses (counted instead)
    exempt: bool = False  # never limited: left out of every decision
    deny: bool = False  # always refused


def check_limits(kind: str, limits: object) -> tuple[BaseLimit, ...]:
    if isinstance(limits, str):
        limits = [limits]  # "10/second;100/minute": one string may hold several
    if isinstance(limits, bytes) or not isinstance(limits, Iterable):
        raise ConfigurationError(f"limits for {kind!r} must be a list of limits, got {limits!r}")
    checked = tuple(
        limit
        for item in limits
        for limit in (parse_limits(item) if isinstance(item, str) else (item,))
    )
    for limit in checked:
        if not isinstance(limit, BaseLimit):
            raise ConfigurationError(
                f"limits for {kind!r} must be Limit objects or strings like '10/second', "
                f"got {limit!r}"
            )
    seen: dict[object, BaseLimit] = {}
    for limit in checked:
        other = seen.setdefault(limit.storage, limit)
        if other is not limit:
            raise ConfigurationError(
                f"limits for {kind!r}: {other} and {limit} would share one counter (same "
                "algorithm and window); keep one of them"
            )
    return checked


class Rules:
    """The limits per identifier kind, and the per-identifier plans built from them.

    Built from limits given in code, or from a ``RuleSet`` (rules as data: overrides, allow
    and deny lists, shadow rules). ``overrides`` (a ``RemoteOverrides``) adds the overrides
    kept in Redis, looked up on demand; its local cache answers ``plans``.
    """

    def __init__(self, limits: LimitsArg | RuleSet, prefix: str) -> None:
        self.ruleset: RuleSet | None = None
        if isinstance(limits, RuleSet):
            self.ruleset = limits
            rules = dict(limits.kinds)
        elif isinstance(limits, Mapping):
            if not limits:
                raise ConfigurationError("limits must name at least one kind (or '*')")
            rules = {}
            for kind, items in limits.items():
                if not isinstance(kind, str) or not kind or (":" in kind and kind != "*"):
                    raise ConfigurationError(
                        f"a rule's kind must be non-empty text without ':' (or '*'), got {kind!r}"
                    )
                rules[kind] = check_limits(kind, items)
        else:
            rules = {"*": check_limits("*", limits)}
        if not any(rules.values()):
            raise ConfigurationError("at least one limit must be configured")
        self.by_kind: dict[str, tuple[BaseLimit, ...]] = rules
        self.prefix = prefix
        self.plan = lru_cache(maxsize=65536)(self._plan)
        self._special = lru_cache(maxsize=65536)(self._plan_special)
        ruleset = self.ruleset
        self.shadow_all = ruleset is not None and ruleset.shadow
        self.shadow_kinds = frozenset() if ruleset is None else ruleset.shadow_kinds
        #: Overrides kept in Redis (set by the limiter while it follows the rules there).
        self.remote: RemoteLookup | None = None
        self._simple = ruleset is None or not (
            ruleset.exact or ruleset.networks or ruleset.shadow or ruleset.shadow_kinds
        )

    def override_for(self, identifier: str) -> Override | None:
        # A followed document keeps its exact overrides in Redis: the one found there is this
        # identifier's exact override, under the same precedence as one in a file.
        remote = None if self.remote is None else self.remote.cached(identifier)
        if self.ruleset is None:
            return remote
        return self.ruleset.override_for(identifier, remote)

    def plan_for(self, identifier: str) -> IdentifierPlan:
        """The identifier's plan under these rules, its override included."""
        if self._simple and self.remote is None:
            return self.plan(identifier)
        return self._special(identifier, self.override_for(identifier))

    def _plan_special(self, identifier: str, override: Override | None) -> IdentifierPlan:
        if override is not None and override.deny:
            return replace(self._plan_of(identifier, self._deny_limits(identifier)), deny=True)
        if override is not None and override.exempt:
            return replace(self._plan_of(identifier, self._deny_limits(identifier)), exempt=True)
        limits = self.limits_for(identifier)
        if override is not None:
            limits = override.apply(limits)
        shadow = (
            self.shadow_all
            or identifier_kind(identifier) in self.shadow_kinds
            or (override is not None and override.shadow)
        )
        plan = self._plan_of(identifier, limits)
        # A shadow rule never delays a request either: no turn is reserved on it (acquire
        # retries, and a refusal by shadow rules alone is admitted).
        return replace(plan, shadow=True, queueable=False) if shadow else plan

    def _deny_limits(self, identifier: str) -> tuple[BaseLimit, ...]:
        try:
            return self.limits_for(identifier)
        except InvalidRequestError:  # allowed / denied without a rule of its kind: no keys
            return ()

    def register(self, kind: str, limits: object) -> tuple[BaseLimit, ...]:
        """Adds the rule for a kind of identifiers declared elsewhere (a route's own limits).

        Registering the same limits again is a no-op; a kind that already has other limits is a
        ``ConfigurationError`` (two declarations would share, and fight over, one counter).
        """
        if not isinstance(kind, str) or not kind or ":" in kind or kind == "*":
            raise ConfigurationError(
                f"a rule's kind must be non-empty text without ':' (and not '*'), got {kind!r}"
            )
        checked = check_limits(kind, limits)
        if not checked:
            raise ConfigurationError(f"limits for {kind!r}: at least one limit is needed")
        current = self.by_kind.get(kind)
        if current is None:
            self.by_kind[kind] = checked
            self.plan.cache_clear()  # an identifier of this kind may have had the default plan
        elif current != checked:
            raise ConfigurationError(
                f"limits for {kind!r} are already {list(map(str, current))}; another "
                f"declaration asks for {list(map(str, checked))}. Give one of them another name"
            )
        return checked

    def limits_for(self, identifier: str) -> tuple[BaseLimit, ...]:
        kind = identifier_kind(identifier)
        limits = self.by_kind.get(kind)
        if limits is None:
            limits = self.by_kind.get("*")
        if limits is None:
            raise InvalidRequestError(
                f"no limits for identifier {identifier!r} of kind {kind!r}; configured kinds: "
                f"{sorted(self.by_kind)} (add a '*' rule for a default)"
            )
        return limits

    def _plan(self, identifier: str) -> IdentifierPlan:
        return self._plan_of(identifier, self.limits_for(identifier))

    def _plan_of(self, identifier: str, limits: tuple[BaseLimit, ...]) -> IdentifierPlan:
        keys = [main_key(self.prefix, identifier)]
        pairs: list[str | int] = []
        for limit in limits:
            suffix = limit.aux_suffix
            aux = 0
            if suffix is not None:
                keys.append(aux_key(self.prefix, identifier, suffix))
                aux = len(keys)
            pairs += (aux, *limit.wire)
        max_weight = min((limit.max_weight for limit in limits), default=MAX_WEIGHT)
        codes = {limit.wire[0] for limit in limits}
        return IdentifierPlan(
            identifier,
            limits,
            tuple(keys),
            ",".join(map(str, (len(keys), len(limits), *pairs))).encode("ascii"),
            max_weight,
            has_leases="lease" in codes,
            queueable=codes == {"gcra"},
        )

    def plans(self, ids: object) -> list[IdentifierPlan]:
        """Validates a call's identifiers; duplicates count once, order is kept."""
        if isinstance(ids, str):
            if ids:  # (the commonest call: one identifier)
                return [self.plan_for(ids)]
            ids = (ids,)
        elif (type(ids) is list or type(ids) is tuple) and len(ids) == 1:
            identifier = ids[0]
            if type(identifier) is str and identifier:
                return [self.plan_for(identifier)]
        plan = self.plan_for
        return [plan(identifier) for identifier in identifiers_of(ids)]

    def all_keys(self, identifier: str) -> tuple[str, ...]:
        return self.plan_for(identifier).keys


def identifiers_of(ids: object) -> dict[str, None]:
    """A call's identifiers (the keys), validated; duplicates count once, order is kept."""
    if isinstance(ids, str):
        ids = (ids,)
    elif not isinstance(ids, (list, tuple, set, frozenset)):
        raise InvalidRequestError(
            f"identifiers must be a str or a list/tuple of str, got {type(ids).__name__}"
        )
    if not ids:
        raise InvalidRequestError("at least one identifier is needed, got none")
    seen: dict[str, None] = {}
    for identifier in ids:
        if not isinstance(identifier, str):
            raise InvalidRequestError(
                f"identifiers must be str, got {identifier!r} ({type(identifier).__name__})"
            )
        if not identifier:
            raise InvalidRequestError("an identifier must not be the empty string")
        seen[identifier] = None
    return seen


class RemoteLookup(Protocol):
    """The overrides kept in Redis, as far as this process has looked them up."""

    def cached(self, identifier: str) -> Override | None: ...


def check_weight(weight: object, plans: Sequence[IdentifierPlan]) -> int:
    """A weight is a positive int no larger than the smallest limit that applies."""
    checked = validate_weight(weight, None if plans else MAX_WEIGHT)
    for plan in plans:
        if checked > plan.max_weight:
            binding = min(plan.limits, key=lambda limit: limit.max_weight)
            raise WeightNeverFits(
                f"weight {checked} can never be admitted for {plan.identifier!r}: its limit "
                f"{binding} admits at most {binding.max_weight} at once"
            )
    return checked
