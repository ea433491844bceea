"""What the web integrations share, whatever the framework: the client's IP behind trusted
proxies, identifiers from key functions, the response headers, and the problem+json bodies.

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

import functools
import hashlib
import inspect
import ipaddress
import json
import logging
import math
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, TypeAlias

import anyio

from aiolimit._decision import Decision, PairDecision
from aiolimit._errors import BackendError, ConfigurationError, WeightNeverFits
from aiolimit._limiter import Limiter

logger = logging.getLogger("aiolimit")

IPAddress: TypeAlias = "ipaddress.IPv4Address | ipaddress.IPv6Address"
Network: TypeAlias = "ipaddress.IPv4Network | ipaddress.IPv6Network"
#: A key function gets the framework's request and returns the key's value (None: no key).
KeyFunc: TypeAlias = "Callable[[Any], str | int | Awaitable[str | int | None] | None]"
WeightFunc: TypeAlias = "Callable[[Any], int | Awaitable[int]]"
ForwardedHeader = Literal["x-forwarded-for", "forwarded"]

MAX_FORWARDED_CHARS = 8192
MAX_HOPS = 64
MAX_KEY_CHARS = 200
PROBLEM_CONTENT_TYPE = "application/problem+json"
QUOTA_EXCEEDED = "https://iana.org/assignments/http-problem-types#quota-exceeded"
REDUCED_CAPACITY = "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity"


class _ClientIP:
    """Marker: the key is the client's IP, as the integration's resolver finds it."""

    def __repr__(self) -> str:
        return "CLIENT_IP"


#: Use as a key function: ``keys={"ip": CLIENT_IP}`` (the default keys).
CLIENT_IP: Any = _ClientIP()


def parse_ip(text: str) -> IPAddress | None:
    """An address from ``1.2.3.4``, ``1.2.3.4:80``, ``[2001:db8::1]:80``, ``"..."``; else None."""
    text = text.strip().strip('"').strip()
    if not text or len(text) > 64:
        return None
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            return None
        text = text[1:end]
    elif text.count(":") == 1:  # IPv4 with a port
        text = text.split(":", 1)[0]
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _forwarded_for(element: str) -> str | None:
    """The ``for=`` value of one RFC 7239 ``Forwarded`` element, or None."""
    for pair in element.split(";"):
        name, sep, value = pair.partition("=")
        if sep and name.strip().lower() == "for":
            return value.strip()
    return None


class ClientIPResolver:
    """The client's IP: the socket peer, unless the peer is a trusted proxy.

    Behind trusted proxies the forwarded chain is read right to left and the first hop that is
    not a trusted proxy is the client (the rightmost untrusted hop: hops to its left were
    written by the client and can be anything). A malformed hop stops the walk at the last
    good one, so garbage can never pick the client's identity. Only ``header`` is read
    (``X-Forwarded-For`` or RFC 7239 ``Forwarded``), never both: a proxy sets one, and the
    other would come from the client untouched. IPv6 clients may be grouped by ``/ipv6_prefix``
    (one /64 is usually one subscriber).
    """

    def __init__(
        self,
        trusted_proxies: Iterable[str] = (),
        *,
        header: ForwardedHeader = "x-forwarded-for",
        ipv6_prefix: int | None = None,
    ) -> None:
        if isinstance(trusted_proxies, str):
            trusted_proxies = (trusted_proxies,)
        try:
            self.trusted: tuple[Network, ...] = tuple(
                ipaddress.ip_network(item, strict=False) for item in trusted_proxies
            )
        except (TypeError, ValueError) as exc:
            raise ConfigurationError(
                f"trusted_proxies must be IP addresses or networks like '10.0.0.0/8': {exc}"
            ) from exc
        if header not in ("x-forwarded-for", "forwarded"):
            raise ConfigurationError(
                f"forwarded_header must be 'x-forwarded-for' or 'forwarded', got {header!r}"
            )
        if ipv6_prefix is not None and (
            isinstance(ipv6_prefix, bool)
            or not isinstance(ipv6_prefix, int)
            or not 1 <= ipv6_prefix <= 128
        ):
            raise ConfigurationError(f"ipv6_prefix must be None or 1..128, got {ipv6_prefix!r}")
        self.header = header
        self.ipv6_prefix = ipv6_prefix

    def is_trusted(self, address: IPAddress) -> bool:
        return any(address in network for network in self.trusted)

    def resolve(self, peer: str | None, forwarded: Sequence[str]) -> str | None:
        """The client's IP as text, from the peer address and the header's values (in order).

        A peer that is not an IP address (a Unix socket, a server's odd ``client`` value) is
        used as it is, and no peer at all is ``"unknown"``: such requests share one identifier
        rather than escaping the limits.
        """
        client = parse_ip(peer) if peer else None
        if client is None:
            return key_value(peer) or "unknown"
        if self.trusted and forwarded and self.is_trusted(client):
            for hop in self._hops_right_to_left(forwarded):
                address = parse_ip(hop) if hop is not None else None
                if address is None:
                    break
                client = address
                if not self.is_trusted(address):
                    break
        return self.format(client)

    def _hops_right_to_left(self, values: Sequence[str]) -> Iterable[str | None]:
        text = ",".join(values)
        truncated = len(text) > MAX_FORWARDED_CHARS
        if truncated:
            text = text[-MAX_FORWARDED_CHARS:]
        hops = text.split(",")
        if truncated:
            hops = hops[1:]  # the first piece may be a cut-off address
        for count, hop in enumerate(reversed(hops)):
            if count >= MAX_HOPS:
                return
            yield _forwarded_for(hop) if self.header == "forwarded" else hop

    def format(self, address: IPAddress) -> str:
        if self.ipv6_prefix is not None and isinstance(address, ipaddress.IPv6Address):
            network = ipaddress.IPv6Network((address, self.ipv6_prefix), strict=False)
            return str(network)
        return str(address)


# -- identifiers ---------------------------------------------------------------------------


def key_value(value: object) -> str | None:
    """A key function's result as identifier text: bounded, valid UTF-8, or None to skip."""
    if value is None:
        return None
    text = value if isinstance(value, str) else str(value)
    if not text:
        return None
    if len(text) > MAX_KEY_CHARS or not text.isascii():
        # Bounded (a huge header must not become a huge cache entry) and always encodable:
        # aiohttp decodes undecodable header bytes to lone surrogates.
        raw = text.encode("utf-8", "surrogatepass")
        if len(text) > MAX_KEY_CHARS:
            return "sha256:" + hashlib.sha256(raw).hexdigest()
        return raw.decode("utf-8", "backslashreplace")
    return text


async def _call(func: Callable[[Any], Any], request: Any) -> Any:
    result = func(request)
    if inspect.isawaitable(result):
        result = await result
    return result


def check_keys(keys: Mapping[str, KeyFunc] | None) -> dict[str, KeyFunc]:
    if keys is None:
        return {"ip": CLIENT_IP}
    if not isinstance(keys, Mapping) or not keys:
        raise ConfigurationError("keys must be a non-empty mapping of kind -> key function")
    for kind, func in keys.items():
        if not isinstance(kind, str) or not kind or ":" in kind:
            raise ConfigurationError(
                f"a key's kind must be non-empty text without ':', got {kind!r}"
            )
        if not callable(func) and func is not CLIENT_IP:
            raise ConfigurationError(f"key {kind!r} must be callable or CLIENT_IP, got {func!r}")
    return dict(keys)


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
        if isinstance(weight, bool) or not (
            callable(weight) or (isinstance(weight, int) and weight >= 1)
        ):
            raise ConfigurationError(f"weight must be an int >= 1 or a callable, got {weight!r}")
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
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigurationError(f"a weight function must return an int >= 1, got {value!r}")
        return value


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


# -- headers and bodies ---------------------------------------------------------------------


def _seconds(value: object) -> float | None:
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def quota_and_window(limit: Any) -> tuple[int, int] | None:
    """(quota, window in whole seconds) of any limit type, or None if it cannot say (cached)."""
    try:
        return _described(limit)
    except TypeError:  # an unhashable limit type
        return _describe(limit)


def _describe(limit: Any) -> tuple[int, int] | None:
    """How ``quota_and_window`` reads a limit.

    ``Limit`` has ``amount``/``per``. Other algorithms are read by duck typing: a capacity
    (``amount``, ``capacity``, ``burst``, ``limit``, else ``max_weight``) and a window
    (``per``, ``period``, ``window``, ``interval``), or ``capacity / rate`` seconds when the
    limit has a refill ``rate`` per second instead.
    """
    quota = None
    for name in ("amount", "capacity", "burst", "limit", "max_weight"):
        value = getattr(limit, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            quota = value
            break
    if quota is None:
        return None
    window = None
    for name in ("per", "period", "window", "interval"):
        window = _seconds(getattr(limit, name, None))
        if window is not None:
            break
    if window is None:
        rate = _seconds(getattr(limit, "rate", None))
        if rate is None or rate <= 0:
            return None
        window = quota / rate
    if not math.isfinite(window) or window <= 0:
        return None
    return quota, max(1, math.ceil(window))


_described = functools.lru_cache(maxsize=1024)(_describe)

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


def _items(decision: Decision, weight: int = 1) -> list[_Item]:
    """One item per policy name: the tightest pair when two identifiers share a name.

    A pair's ``remaining`` is what would be left after this request; when the decision was
    refused nothing was charged, so a pair that had room still has ``weight`` more available.
    """
    chosen: dict[str, _Item] = {}
    for pair in decision.details:
        described = quota_and_window(pair.limit)
        if described is None:
            continue
        if not decision.allowed and pair.allowed:
            pair = pair._replace(remaining=pair.remaining + weight)
        name = policy_name(pair.identifier, *described)
        current = chosen.get(name)
        if current is None or (pair.allowed, pair.remaining) < (
            current.pair.allowed,
            current.pair.remaining,
        ):
            chosen[name] = _Item(name, *described, pair)
    return list(chosen.values())


def retry_after_seconds(decision: Decision) -> int:
    """Whole seconds, rounded up, the largest over the refusing pairs; at least 1."""
    return max(1, math.ceil(decision.retry_after - 1e-9))


def rate_limit_headers(
    decision: Decision, *, weight: int = 1, legacy: bool = False
) -> list[tuple[str, str]]:
    """The headers for any response this decision covers (none for a degraded one)."""
    if decision.degraded or not decision.details:
        return []
    items = _items(decision, weight)
    headers: list[tuple[str, str]] = []
    if items:
        policies = ", ".join(f'"{i.name}";q={i.quota};w={i.window}' for i in items)
        limits = ", ".join(
            f'"{i.name}";r={max(0, i.pair.remaining)};t={_effective_window(i.pair)}' for i in items
        )
        headers += [("RateLimit-Policy", policies), ("RateLimit", limits)]
    if legacy and decision.limit is not None:
        described = quota_and_window(decision.limit)
        binding = next((p for p in decision.details if p.identifier == decision.identifier), None)
        if described is not None and binding is not None:
            headers += [
                ("X-RateLimit-Limit", str(described[0])),
                ("X-RateLimit-Remaining", str(max(0, decision.remaining))),
                ("X-RateLimit-Reset", str(_effective_window(binding))),
            ]
    if not decision.allowed:
        headers.append(("Retry-After", str(retry_after_seconds(decision))))
    return headers


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


def never_fits_body(error: WeightNeverFits) -> tuple[int, bytes]:
    """A request heavier than a limit: 429 without Retry-After (waiting cannot help)."""
    problem = {
        "type": QUOTA_EXCEEDED,
        "title": "Request cannot be satisfied as assigned quota has been exceeded",
        "status": 429,
        "detail": "This request costs more than the quota allows; it can never be admitted.",
    }
    return 429, json.dumps(problem, separators=(",", ":")).encode()


# -- refunds --------------------------------------------------------------------------------


async def refund_quietly(limiter: Limiter, ids: Sequence[str], weight: int) -> None:
    """Gives the weight back, shielded from cancellation; a store failure is only logged.

    Cancellation of the request itself never triggers a refund (a client that hangs up early
    must not get its requests for free); this only keeps a started refund from being lost.
    """
    with anyio.CancelScope(shield=True):
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
    headers = rate_limit_headers(decision, weight=weight, legacy=legacy)
    if decision.allowed:
        return Verdict(rule.limiter, ids, weight, decision, headers)
    status, body = problem_body(decision)
    if decision.degraded:
        headers = [("Retry-After", str(retry_after_seconds(decision)))]
    return Verdict(rule.limiter, ids, weight, decision, headers, status, body)


def header_key(name: str) -> KeyFunc:
    """A key function reading one request header (an API key, a user id set by a gateway).

    Works with Starlette and aiohttp requests alike; a missing header means no such key.
    """

    def key(request: Any) -> str | None:
        value: str | None = request.headers.get(name)
        return value

    key.__name__ = f"header_key({name!r})"
    return key
