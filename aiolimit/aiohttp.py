"""Rate limiting for ``aiohttp.web``: a middleware and a per-handler decorator.

Importable only with aiohttp installed (``pip install aiolimit[web]``)::

    from aiolimit.aiohttp import CLIENT_IP, header_key, limit, rate_limit_middleware

    app = web.Application(middlewares=[rate_limit_middleware(limiter, routes={"/health": None})])

    @limit(limiter, keys={"user": header_key("x-user")}, weight=5)
    async def search(request: web.Request) -> web.Response: ...

Same behaviour as ``aiolimit.starlette``: every key with a value is one identifier, decided
all or nothing; 429 with RFC 9457 problem+json, ``Retry-After`` and the ``RateLimit`` /
``RateLimit-Policy`` fields; 503 when the store is down under ``on_error="closed"``; IPv6
clients keyed per /64 unless ``ipv6_prefix`` says otherwise (128: per address). Headers are
added to the handler's response unless it was already prepared (streamed).
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from aiolimit._limiter import Limiter
from aiolimit._web.client_ip import DEFAULT_IPV6_PREFIX, ClientIPResolver, ForwardedHeader
from aiolimit._web.flow import RouteLimit, RouteTable, Rule, judge, refund_quietly
from aiolimit._web.headers import PROBLEM_CONTENT_TYPE
from aiolimit._web.keys import CLIENT_IP, KeyFunc, WeightFunc, _call, raw_header_key

__all__ = [
    "CLIENT_IP",
    "RouteLimit",
    "header_key",
    "limit",
    "path_key",
    "rate_limit_middleware",
]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def header_key(name: str) -> KeyFunc:
    """Key function: one request header (an API key, a user id set by a gateway), by its bytes.

    A missing header means no such key. The value's bytes as sent make the identifier, read as
    UTF-8 text when they are that (the same under Starlette and aiohttp); two different values
    never share an identifier, whatever their bytes.
    """
    return raw_header_key(name, _raw_headers)


def _raw_headers(request: web.Request) -> tuple[tuple[bytes, bytes], ...]:
    return request.raw_headers


def path_key(request: web.Request) -> str:
    """Key function: the matched route's template (``/users/{id}``), else the path."""
    info = request.match_info.route.resource
    return info.canonical if info is not None else request.path


def _peer(request: web.Request) -> str | None:
    transport = request.transport
    peer = transport.get_extra_info("peername") if transport is not None else None
    if isinstance(peer, (tuple, list)) and peer:
        return str(peer[0])
    return request.remote


class _Guard:
    """The part shared by the middleware and the decorator: judge, answer, add headers."""

    def __init__(
        self,
        trusted_proxies: Iterable[str],
        forwarded_header: ForwardedHeader,
        ipv6_prefix: int,
        refund_on_error: bool,
        legacy_headers: bool,
    ) -> None:
        self.resolver = ClientIPResolver(
            trusted_proxies, header=forwarded_header, ipv6_prefix=ipv6_prefix
        )
        self.refund = refund_on_error
        self.legacy = legacy_headers

    def client_ip(self, request: web.Request) -> str | None:
        forwarded = (
            request.headers.getall(self.resolver.header, []) if self.resolver.trusted else []
        )
        return self.resolver.resolve(_peer(request), forwarded)

    async def __call__(
        self, rule: Rule, request: web.Request, handler: Handler
    ) -> web.StreamResponse:
        verdict = await judge(rule, request, lambda: self.client_ip(request), legacy=self.legacy)
        if verdict is None:
            return await handler(request)
        if verdict.refused:
            headers = CIMultiDict(verdict.headers)
            headers["Content-Type"] = PROBLEM_CONTENT_TYPE
            return web.Response(status=verdict.status, body=verdict.body, headers=headers)
        refund = self.refund and verdict.refundable
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            if refund and exc.status >= 500:
                await refund_quietly(verdict.limiter, verdict.ids, verdict.weight)
            exc.headers.extend(verdict.headers)
            raise
        except Exception:
            if refund:
                await refund_quietly(verdict.limiter, verdict.ids, verdict.weight)
            raise
        if refund and response.status >= 500:
            await refund_quietly(verdict.limiter, verdict.ids, verdict.weight)
        if not response.prepared:
            response.headers.extend(verdict.headers)
        return response


def rate_limit_middleware(
    limiter: Limiter,
    *,
    keys: Mapping[str, KeyFunc] | None = None,
    weight: int | WeightFunc = 1,
    routes: Mapping[str, RouteLimit | None] | None = None,
    exempt: Callable[[web.Request], bool | Awaitable[bool]] | None = None,
    trusted_proxies: Iterable[str] = (),
    forwarded_header: ForwardedHeader = "x-forwarded-for",
    ipv6_prefix: int = DEFAULT_IPV6_PREFIX,
    refund_on_error: bool = False,
    legacy_headers: bool = False,
) -> Any:
    """An ``aiohttp.web`` middleware limiting every request (see ``aiolimit.starlette`` for
    ``routes``, ``exempt`` and ``refund_on_error``, which mean the same here)."""
    table = RouteTable(Rule(limiter, keys or {"ip": CLIENT_IP}, weight), routes)
    guard = _Guard(trusted_proxies, forwarded_header, ipv6_prefix, refund_on_error, legacy_headers)

    @web.middleware
    async def aiolimit_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        rule = table.match(request.path)
        if rule is None or (exempt is not None and await _call(exempt, request)):
            return await handler(request)
        return await guard(rule, request, handler)

    return aiolimit_middleware


def limit(
    limiter: Limiter,
    *,
    keys: Mapping[str, KeyFunc] | None = None,
    weight: int | WeightFunc = 1,
    trusted_proxies: Iterable[str] = (),
    forwarded_header: ForwardedHeader = "x-forwarded-for",
    ipv6_prefix: int = DEFAULT_IPV6_PREFIX,
    refund_on_error: bool = False,
    legacy_headers: bool = False,
) -> Callable[[Handler], Handler]:
    """Decorator for one ``async def handler(request)``: its own limiter, keys and weight."""
    rule = Rule(limiter, keys or {"ip": CLIENT_IP}, weight)
    guard = _Guard(trusted_proxies, forwarded_header, ipv6_prefix, refund_on_error, legacy_headers)

    def decorate(handler: Handler) -> Handler:
        @functools.wraps(handler)
        async def limited(request: web.Request) -> web.StreamResponse:
            return await guard(rule, request, handler)

        return limited

    return decorate
