"""Rules as data: one documented format, read from TOML or JSON, validated as a whole.

A rules document says which limits apply to each kind of identifier, and what is special about
some identifiers::

    # rules.toml (top-level keys first: in TOML a key after [table] belongs to that table)
    shadow = false                      # true: the whole limiter only reports (never refuses)
    allow = ["ip:127.0.0.1"]            # never limited (same as exempt = true)
    deny = ["ip:203.0.113.0/24"]        # always refused (403 on the web)

    [kinds]
    ip = ["10/second", "120/minute"]    # a limit string, a list of them, or limit tables
    "*" = "50/minute"                   # the default for kinds without a rule

    [kinds.user]                        # the long form: limits and a shadow flag
    limits = ["100/minute", { type = "token_bucket", rate = 5, per = 1, burst = 20 }]
    shadow = true                       # decided and charged, never refused; counted

    [overrides]
    "user:42" = { scale = 10 }          # 10x every limit of its kind
    "user:7" = { limits = "1/minute" }  # limits of its own
    "ip:10.0.0.0/8" = { exempt = true } # a network (CIDR) for ip-like kinds: never limited
    "user:beta" = { shadow = true }     # this identifier's pairs only report

The same document as JSON has the same keys. A limit table has a ``type`` and that limit
type's fields: ``window`` (``Limit``: amount, per, precision), ``fixed_window`` and
``sliding_log`` (amount, per), ``token_bucket`` (rate, per, burst), ``min_interval``
(seconds), ``concurrency`` (max, lease_ttl). Errors name the key that is wrong
(``kinds.user.limits[1].rate``) and, for syntax, the line.

Precedence for one identifier: a deny (its own or any network's holding it), then allow /
exempt (likewise), then its exact override, then the most specific network override, then its
kind's rule, then ``"*"``.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import json
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from aiolimit._algorithms import (
    MAX_CONCURRENCY,
    MAX_LOG_AMOUNT,
    Concurrency,
    FixedWindow,
    MinInterval,
    SlidingLog,
    TokenBucket,
    max_exact_burst,
)
from aiolimit._errors import ConfigurationError
from aiolimit._limits import MAX_PERIOD, MIN_PERIOD, BaseLimit, Limit, parse_limits
from aiolimit._validation import MAX_AMOUNT

SCHEMA_VERSION = 1
LIMIT_TYPES: dict[str, type[BaseLimit]] = {
    "window": Limit,
    "fixed_window": FixedWindow,
    "sliding_log": SlidingLog,
    "token_bucket": TokenBucket,
    "min_interval": MinInterval,
    "concurrency": Concurrency,
}
_FIELDS: dict[str, tuple[str, ...]] = {
    "window": ("amount", "per", "precision"),
    "fixed_window": ("amount", "per"),
    "sliding_log": ("amount", "per"),
    "token_bucket": ("rate", "per", "burst"),
    "min_interval": ("seconds",),
    "concurrency": ("max", "lease_ttl"),
}
TOP_KEYS = ("version", "shadow", "kinds", "overrides", "allow", "deny")
OVERRIDE_KEYS = ("limits", "scale", "exempt", "shadow")
#: The kind the web integrations key clients by (``keys={"ip": CLIENT_IP}``).
IP_KIND = "ip"
MAX_SCALE = 1_000_000.0


class RulesError(ConfigurationError):
    """A rules document that cannot be used; ``where`` names the key (or line) at fault."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(f"{where}: {message}" if where else message)
        self.where = where


IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True, slots=True)
class Override:
    """What is special about one identifier (or a network of them)."""

    limits: tuple[BaseLimit, ...] | None = None
    scale: float | None = None
    exempt: bool = False
    deny: bool = False
    shadow: bool = False

    def apply(self, limits: tuple[BaseLimit, ...]) -> tuple[BaseLimit, ...]:
        if self.limits is not None:
            return self.limits
        if self.scale is not None:
            return tuple(scale_limit(limit, self.scale) for limit in limits)
        return limits


ALLOW = Override(exempt=True)
DENY = Override(deny=True)


@dataclass(frozen=True, slots=True)
class RuleSet:
    """A validated rules document (see the module's docstring for the format).

    ``exact`` holds the overrides of single identifiers, ``networks`` those of CIDR ranges
    (most specific first, per kind). ``document`` is the canonical JSON form and ``version``
    its SHA-256, the same for the same rules whatever the source's layout.
    """

    kinds: Mapping[str, tuple[BaseLimit, ...]]
    shadow_kinds: frozenset[str] = frozenset()
    shadow: bool = False
    exact: Mapping[str, Override] = field(default_factory=dict)
    networks: tuple[tuple[str, IPNetwork, Override], ...] = ()
    document: str = ""
    version: str = ""

    # -- reading ----------------------------------------------------------------------------

    @classmethod
    def from_file(cls, path: str | Path) -> RuleSet:
        """Reads ``.toml`` or ``.json`` (by suffix; anything else is tried as TOML)."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise RulesError(str(path), f"cannot read the rules file: {exc}") from exc
        return cls.from_text(text, "json" if path.suffix.lower() == ".json" else "toml")

    @classmethod
    def from_text(cls, text: str, format: str = "toml") -> RuleSet:
        if format == "json":
            duplicated: list[_Duplicated] = []
            try:
                data = json.loads(
                    text, object_pairs_hook=lambda pairs: _json_object(pairs, duplicated)
                )
            except json.JSONDecodeError as exc:
                raise RulesError(
                    f"line {exc.lineno}, column {exc.colno}", f"not valid JSON: {exc.msg}"
                ) from exc
            except (ValueError, RecursionError) as exc:  # an int past 4300 digits, deep nesting
                raise RulesError("", f"not usable JSON: {exc}") from exc
            if duplicated:  # json keeps the last of a key given twice; TOML refuses it: so do we
                _refuse_duplicate("", data)
        elif format == "toml":
            try:
                data = tomllib.loads(text)
            except (
                ValueError,
                RecursionError,
            ) as exc:  # (TOMLDecodeError; an int past 4300 digits)
                raise RulesError("", f"not valid TOML: {exc}") from exc
        else:
            raise RulesError("", f"format must be 'toml' or 'json', got {format!r}")
        return cls.from_mapping(data)

    @classmethod
    def from_mapping(cls, data: object) -> RuleSet:
        """Validates a parsed document as a whole: the first problem raises ``RulesError``."""
        if not isinstance(data, Mapping):
            raise RulesError("", f"a rules document is a table/object, got {_kind(data)}")
        unknown = sorted(set(map(str, data)) - set(TOP_KEYS))
        if unknown:
            raise RulesError(unknown[0], f"unknown key; allowed: {', '.join(TOP_KEYS)}")
        version = data.get("version", SCHEMA_VERSION)
        if version != SCHEMA_VERSION or isinstance(version, bool):
            raise RulesError("version", f"must be {SCHEMA_VERSION}, got {version!r}")
        shadow = _bool(data, "shadow", "shadow")
        raw_kinds = data.get("kinds")
        if not isinstance(raw_kinds, Mapping) or not raw_kinds:
            raise RulesError("kinds", "a table of kind -> limits with at least one kind is needed")
        kinds: dict[str, tuple[BaseLimit, ...]] = {}
        shadow_kinds = set()
        canonical_kinds: dict[str, Any] = {}
        for kind, spec in raw_kinds.items():
            where = f"kinds.{_key(kind)}"
            _check_kind(where, kind)
            limits_spec, kind_shadow = spec, False
            if isinstance(spec, Mapping):
                extra = sorted(set(map(str, spec)) - {"limits", "shadow"})
                if extra:
                    raise RulesError(f"{where}.{extra[0]}", "unknown key; allowed: limits, shadow")
                if "limits" not in spec:
                    raise RulesError(f"{where}.limits", "missing")
                limits_spec = spec["limits"]
                kind_shadow = _bool(spec, "shadow", f"{where}.shadow")
            kinds[kind] = read_limits(f"{where}" if limits_spec is spec else f"{where}.limits",
                                      limits_spec)  # fmt: skip
            if kind_shadow:
                shadow_kinds.add(kind)
            canonical_kinds[kind] = {"limits": [limit_table(x) for x in kinds[kind]]}
            if kind_shadow:
                canonical_kinds[kind]["shadow"] = True
        exact: dict[str, Override] = {}
        networks: list[tuple[str, IPNetwork, Override]] = []
        canonical_overrides: dict[str, Any] = {}
        raw_overrides = data.get("overrides", {})
        if not isinstance(raw_overrides, Mapping):
            raise RulesError(
                "overrides", f"a table of identifier -> override, got {_kind(raw_overrides)}"
            )
        written: dict[str, str] = {}  # identifier (see _identifier) -> as the document wrote it
        for raw_identifier, spec in raw_overrides.items():
            where = f"overrides.{_key(raw_identifier)}"
            override = _override(where, spec)
            identifier = _identifier(where, raw_identifier)
            if identifier in written:
                raise RulesError(
                    where,
                    f"the same as {written[identifier]!r} (both are {identifier!r}); keep one",
                )
            written[identifier] = raw_identifier
            _place(where, identifier, override, exact, networks)
            _check_scale(where, identifier.partition(":")[0], override, kinds)
            canonical_overrides[identifier] = override_table(override)
        listed: dict[str, set[str]] = {}
        for name, marker in (("allow", ALLOW), ("deny", DENY)):
            entries = data.get(name, [])
            if not isinstance(entries, list):
                raise RulesError(name, f"a list of identifiers, got {_kind(entries)}")
            listed[name] = set()
            for index, raw_identifier in enumerate(entries):
                where = f"{name}[{index}]"
                identifier = _identifier(where, raw_identifier)
                _place(where, identifier, marker, exact, networks)
                listed[name].add(identifier)
        # Most specific first (the network override that applies when neither a deny nor an
        # allow / exempt holds the identifier: those win from any network, see override_for).
        networks.sort(key=lambda item: (-item[1].prefixlen, not item[2].deny, not item[2].exempt))
        canonical = {
            "version": SCHEMA_VERSION,
            "shadow": shadow,
            "kinds": canonical_kinds,
            "overrides": canonical_overrides,
            "allow": sorted(listed["allow"]),
            "deny": sorted(listed["deny"]),
        }
        document = json.dumps(canonical, sort_keys=True, separators=(",", ":"))
        return cls(
            kinds,
            frozenset(shadow_kinds),
            shadow,
            exact,
            tuple(networks),
            document,
            hashlib.sha256(document.encode()).hexdigest(),
        )

    @classmethod
    def from_limits(cls, kinds: Mapping[str, tuple[BaseLimit, ...]]) -> RuleSet:
        """The rules a ``Limiter`` was given in code (no overrides, nothing in shadow)."""
        return cls.from_mapping(
            {"kinds": {k: [limit_table(x) for x in v] for k, v in kinds.items()}}
        )

    # -- deciding ---------------------------------------------------------------------------

    def override_for(self, identifier: str, exact: Override | None = None) -> Override | None:
        """The override that decides ``identifier`` (None: its kind's rule decides).

        A deny wins (the identifier's own, or of any network holding it, however wide), then
        an allow / exempt (likewise), then the identifier's exact override, then the most
        specific network's override. ``exact`` is an exact override kept elsewhere (the Redis
        hash of a followed document), weighed as one of ``self.exact`` would be.
        """
        own = self.exact.get(identifier)
        if exact is not None and (own is None or _strength(exact) > _strength(own)):
            own = exact
        if (own is not None and own.deny) or not self.networks:
            return own
        kind, _, value = identifier.partition(":")
        address: object = None
        special: Override | None = None  # the strongest deny / exempt of a network holding it
        nearest: Override | None = None  # the most specific other network override holding it
        for net_kind, network, override in self.networks:
            if net_kind != kind:
                continue
            if address is None:
                address = _address(value)
                if address is None:
                    return own
            if not _within(address, network):
                continue
            if override.deny:
                return override
            if override.exempt:
                special = special or override
            elif nearest is None:
                nearest = override
        if own is not None and own.exempt:
            return own
        return special or own or nearest


def _strength(override: Override) -> int:
    return 2 if override.deny else 1 if override.exempt else 0


# -- limits ----------------------------------------------------------------------------------


def read_limits(where: str, spec: object) -> tuple[BaseLimit, ...]:
    """A limit string, a limit table, or a list of them, as one rule's limits."""
    items = spec if isinstance(spec, list) else [spec]
    if not items:
        raise RulesError(where, "at least one limit is needed")
    limits: list[BaseLimit] = []
    for index, item in enumerate(items):
        at = f"{where}[{index}]" if isinstance(spec, list) else where
        if isinstance(item, BaseLimit):
            limits.append(item)
        elif isinstance(item, str):
            try:
                limits.extend(parse_limits(item))
            except ConfigurationError as exc:
                raise RulesError(at, str(exc)) from exc
        elif isinstance(item, Mapping):
            limits.append(_limit_from_table(at, item))
        else:
            raise RulesError(
                at, f"a limit is a string like '10/second' or a table, got {_kind(item)}"
            )
    seen: dict[object, BaseLimit] = {}
    for limit in limits:
        other = seen.setdefault(limit.storage, limit)
        if other is not limit:
            raise RulesError(where, f"{other} and {limit} would share one counter; keep one")
    return tuple(limits)


def _limit_from_table(where: str, table: Mapping[str, Any]) -> BaseLimit:
    kind = table.get("type")
    if not isinstance(kind, str) or kind not in LIMIT_TYPES:
        raise RulesError(f"{where}.type", f"must be one of {', '.join(LIMIT_TYPES)}, got {kind!r}")
    fields = _FIELDS[kind]
    extra = sorted(set(map(str, table)) - {"type", *fields})
    if extra:
        raise RulesError(
            f"{where}.{extra[0]}", f"unknown field for {kind}; allowed: {', '.join(fields)}"
        )
    values = {name: table[name] for name in fields if name in table}
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RulesError(f"{where}.{name}", f"must be a number, got {value!r}")
    try:
        return LIMIT_TYPES[kind](**values)
    except TypeError as exc:
        raise RulesError(where, f"{kind} needs {', '.join(fields)}: {exc}") from exc
    except ConfigurationError as exc:
        raise RulesError(where, str(exc)) from exc


def limit_table(limit: BaseLimit) -> dict[str, Any]:
    """A limit as a table of the rules format (what ``_limit_from_table`` reads back)."""
    if isinstance(limit, Limit):
        table: dict[str, Any] = {"type": "window", "amount": limit.amount, "per": limit.per}
        if limit.precision != limit.per:
            table["precision"] = limit.precision
        return table
    if isinstance(limit, FixedWindow):
        return {"type": "fixed_window", "amount": limit.amount, "per": limit.per}
    if isinstance(limit, SlidingLog):
        return {"type": "sliding_log", "amount": limit.amount, "per": limit.per}
    if isinstance(limit, TokenBucket):
        return {"type": "token_bucket", "rate": limit.rate, "per": limit.per, "burst": limit.amount}
    if isinstance(limit, MinInterval):
        return {"type": "min_interval", "seconds": limit.seconds}
    if isinstance(limit, Concurrency):
        return {"type": "concurrency", "max": limit.max, "lease_ttl": limit.lease_ttl}
    raise RulesError("", f"cannot write {limit!r} as a rules table")


def scale_limit(limit: BaseLimit, factor: float, *, strict: bool = False) -> BaseLimit:
    """The limit with ``factor`` times its capacity (at least 1 of anything).

    A scaled limit its type cannot hold (a Concurrency max over 1,000, a MinInterval under
    1 ms, an amount over 1e12, ...) raises ``ConfigurationError`` when ``strict``: a document
    is checked that way as a whole, so such a ``scale`` is refused before it is ever used.
    Otherwise (deciding, where nothing may raise) it is clamped to the nearest limit the type
    allows, the bound it overshot: for a scale up, less than asked, never more than the type
    can enforce.
    """

    def times(amount: int, most: int) -> int:
        wanted = max(1, math.floor(amount * factor))
        return wanted if strict else min(wanted, most)

    if isinstance(limit, (Limit, FixedWindow)):
        return replace(limit, amount=times(limit.amount, MAX_AMOUNT))
    if isinstance(limit, SlidingLog):
        return replace(limit, amount=times(limit.amount, MAX_LOG_AMOUNT))
    if isinstance(limit, TokenBucket):
        burst = max_exact_burst(limit.wire[2])
        return replace(
            limit,
            rate=times(limit.rate, MAX_AMOUNT),
            burst=times(limit.amount, min(MAX_AMOUNT, burst)),
        )
    if isinstance(limit, MinInterval):
        seconds = limit.seconds / factor
        if not strict:
            seconds = min(max(seconds, MIN_PERIOD), MAX_PERIOD)
        return replace(limit, seconds=seconds)
    if isinstance(limit, Concurrency):
        return replace(limit, max=times(limit.max, MAX_CONCURRENCY))
    if strict:
        raise RulesError("", f"cannot scale {limit!r}")
    return limit


def _check_scale(
    where: str, kind: str, override: Override, kinds: Mapping[str, tuple[BaseLimit, ...]]
) -> None:
    """Refuses a ``scale`` that makes limits of ``kind`` (or of ``"*"``) their type cannot hold."""
    limits = kinds.get(kind, kinds.get("*"))
    if override.scale is None or limits is None:
        return
    for limit in limits:
        try:
            scale_limit(limit, override.scale, strict=True)
        except ConfigurationError as exc:
            rule = kind if kind in kinds else "*"
            raise RulesError(
                f"{where}.scale", f"scaling kinds.{_key(rule)} by {override.scale:g}: {exc}"
            ) from exc


# -- overrides -------------------------------------------------------------------------------


def _override(where: str, spec: object) -> Override:
    if not isinstance(spec, Mapping):
        raise RulesError(
            where, f"an override is a table ({', '.join(OVERRIDE_KEYS)}), got {_kind(spec)}"
        )
    extra = sorted(set(map(str, spec)) - set(OVERRIDE_KEYS))
    if extra:
        raise RulesError(f"{where}.{extra[0]}", f"unknown key; allowed: {', '.join(OVERRIDE_KEYS)}")
    if "limits" in spec and "scale" in spec:
        raise RulesError(where, "give limits or scale, not both")
    limits = read_limits(f"{where}.limits", spec["limits"]) if "limits" in spec else None
    scale = None
    if "scale" in spec:
        scale = spec["scale"]
        if (
            isinstance(scale, bool)
            or not isinstance(scale, (int, float))
            or not (isinstance(scale, int) or math.isfinite(scale))
            or not 0 < scale <= MAX_SCALE
        ):
            raise RulesError(
                f"{where}.scale", f"must be a number in (0, {MAX_SCALE:g}], got {scale!r}"
            )
        scale = float(scale)
    exempt = _bool(spec, "exempt", f"{where}.exempt")
    shadow = _bool(spec, "shadow", f"{where}.shadow")
    if not (limits or scale or exempt or shadow):
        raise RulesError(where, f"says nothing; give one of {', '.join(OVERRIDE_KEYS)}")
    return Override(limits, scale, exempt, False, shadow)


def override_table(override: Override) -> dict[str, Any]:
    table: dict[str, Any] = {}
    if override.limits is not None:
        table["limits"] = [limit_table(limit) for limit in override.limits]
    if override.scale is not None:
        table["scale"] = override.scale
    if override.exempt:
        table["exempt"] = True
    if override.shadow:
        table["shadow"] = True
    return table


def override_from_json(text: str | bytes) -> Override:
    """One override as stored in Redis (``override_table`` as JSON); invalid raises
    ``RulesError``."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:  # bad JSON or UTF-8, a huge int, deep nesting
        raise RulesError("override", f"not valid JSON: {exc}") from exc
    return _override("override", data)


def _identifier(where: str, identifier: object) -> str:
    """The identifier as the document means it: of the ``ip`` kind, as the web layer names
    clients (``_web/client_ip.py``): an address in its compressed lowercase form, an
    IPv4-mapped IPv6 address (or network) as the IPv4 one, a network by its own address
    (``ip:2001:DB8:1:2::5/64`` is the client ``ip:2001:db8:1:2::/64``). Other kinds are the
    application's own: kept as written."""
    if not isinstance(identifier, str) or not identifier:
        raise RulesError(where, f"an identifier is non-empty text, got {identifier!r}")
    kind, sep, value = identifier.partition(":")
    if kind != IP_KIND or not sep:
        return identifier
    found = _address(value)
    if isinstance(found, ipaddress.IPv6Network):
        mapped = found.network_address.ipv4_mapped
        if mapped is not None and found.prefixlen >= 96:
            found = ipaddress.IPv4Network((mapped, found.prefixlen - 96))
    elif isinstance(found, ipaddress.IPv6Address) and found.ipv4_mapped is not None:
        found = found.ipv4_mapped
    return identifier if found is None else f"{kind}:{found}"


def _place(
    where: str,
    identifier: str,
    override: Override,
    exact: dict[str, Override],
    networks: list[tuple[str, IPNetwork, Override]],
) -> None:
    kind, sep, value = identifier.partition(":")
    network = _network(value) if sep and "/" in value else None
    address, slash, bits = value.partition("/")
    if network is None and slash and bits.isdigit() and _address(address) is not None:
        raise RulesError(where, f"{identifier!r} is not a valid network (address/prefix length)")
    if network is not None and _is_exact_block(value, network):
        network = None  # "ip:2001:db8:1:2::/64" is how the web layer names a /64 client
    previous = exact.get(identifier) if network is None else None
    if previous is not None and previous != override:
        if override is DENY or previous is DENY:
            override = DENY
        elif override is ALLOW or previous is ALLOW:
            override = ALLOW
    if network is None:
        exact[identifier] = override
    else:
        networks.append((kind, network, override))


def _is_exact_block(value: str, network: IPNetwork) -> bool:
    """A /64 written as the web layer writes IPv6 clients is an identifier, not a range."""
    return network.version == 6 and network.prefixlen == 64 and value.endswith("::/64")


def _network(value: str) -> IPNetwork | None:
    try:
        return ipaddress.ip_network(value, strict=False)
    except ValueError:
        return None


@functools.lru_cache(maxsize=4096)  # the same identifiers come again and again
def _address(value: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | IPNetwork | None:
    if "/" in value:
        return _network(value)
    try:
        return ipaddress.ip_address(value)
    except ValueError:
        return None


def _within(address: object, network: IPNetwork) -> bool:
    if isinstance(address, (ipaddress.IPv4Network, ipaddress.IPv6Network)):
        return address.version == network.version and address.subnet_of(network)  # type: ignore[arg-type]
    return address in network


# -- JSON objects with a key given twice ------------------------------------------------------


class _Duplicated(dict[str, Any]):
    """A JSON object that had ``duplicate`` twice (``json`` would keep the last silently)."""

    duplicate: str = ""


def _json_object(pairs: list[tuple[str, Any]], duplicated: list[_Duplicated]) -> dict[str, Any]:
    data = dict(pairs)
    if len(data) == len(pairs):
        return data
    seen: set[str] = set()
    marked = _Duplicated(data)
    for key, _ in pairs:
        if key in seen:
            marked.duplicate = key
            break
        seen.add(key)
    duplicated.append(marked)
    return marked


def _refuse_duplicate(where: str, value: object) -> None:
    """Raises at the first object (outermost, in document order) that had a key twice."""
    if isinstance(value, dict):
        if isinstance(value, _Duplicated):
            at = _key(value.duplicate)
            raise RulesError(f"{where}.{at}" if where else at, "given twice in one object")
        for key, item in value.items():
            _refuse_duplicate(f"{where}.{_key(key)}" if where else _key(key), item)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _refuse_duplicate(f"{where}[{index}]", item)


# -- small checks ----------------------------------------------------------------------------


def _check_kind(where: str, kind: object) -> None:
    if not isinstance(kind, str) or not kind or (":" in kind):
        raise RulesError(where, "a kind is non-empty text without ':' (or '*')")


def _bool(table: Mapping[str, Any], name: str, where: str) -> bool:
    value = table.get(name, False)
    if not isinstance(value, bool):
        raise RulesError(where, f"must be true or false, got {value!r}")
    return value


def _key(text: object) -> str:
    text = str(text)
    return text if text.replace("_", "").replace("-", "").isalnum() else json.dumps(text)


def _kind(value: object) -> str:
    return f"{type(value).__name__} {value!r}"[:120]
