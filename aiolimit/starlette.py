"""Rate limiting for Starlette and FastAPI: a pure ASGI middleware and a FastAPI dependency.

Importable only with Starlette installed (``pip install aiolimit[web]``)::

    from aiolimit import Limit, Limiter
    from aiolimit.starlette import RateLimitMiddleware, RateLimit, RouteLimit, header_key

    limiter = Limiter(url, {"ip": [Limit(10, per=1)], "user": [Limit(100, per=60)]},
                      deadline=0.25, on_error="open")
    app.add_middleware(RateLimitMiddleware, limiter=limiter,
                       keys={"ip": CLIENT_IP, "user": header_key("x-user")},
                       trusted_proxies=["10.0.0.0/8"],
                       routes={"/search": RouteLimit(weight=5), "/health": None})

    @app.get("/report", dependencies=[Depends(RateLimit(limiter, weight=10))])
    async def report(): ...

Every key that gives a value becomes one identifier (``"ip:203.0.113.7"``, ``"user:42"``) and
all of them are decided in one all-or-nothing ``try_acquire``. IPv6 clients are keyed per /64
(``"ip:2001:db8:1:2::/64"``), since one subscriber can rotate through a whole /64;
``ipv6_prefix=128`` keys each address alone. A header's value is keyed by its bytes, one to
one (see ``header_key``). Refused: 429 with RFC 9457 problem+json, ``Retry-After`` and the
``RateLimit``/``RateLimit-Policy`` fields (see ``aiolimit._web.headers`` for the header
semantics). Store down and ``on_error="closed"``: 503.

Behind a proxy, note that uvicorn's own ``proxy_headers`` (on by default, trusting
``127.0.0.1``) rewrites the ASGI ``client`` from ``X-Forwarded-For`` before any middleware runs.
Either keep that and leave ``trusted_proxies`` empty, or run uvicorn with
``proxy_headers=False`` and let ``trusted_proxies`` decide; not both.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from aiolimit._decision import Decision
from aiolimit._limiter import Limiter
from aiolimit._web.client_ip import DEFAULT_IPV6_PREFIX, ClientIPResolver, ForwardedHeader
from aiolimit._web.flow import RouteLimit, RouteTable, Rule, Verdict, judge, refund_quietly
from aiolimit._web.headers import PROBLEM_CONTENT_TYPE
from aiolimit._web.keys import CLIENT_IP, KeyFunc, WeightFunc, _call, raw_header_key

__all__ = [
    "CLIENT_IP",
    "RateLimit",
    "RateLimitExceeded",
    "RateLimitMiddleware",
    "RouteLimit",
    "header_key",
    "path_key",
    "rate_limit_exceeded_handler",
]


def header_key(name: str) -> KeyFunc:
    """Key function: one request header (an API key, a user id set by a gateway), by its bytes.

    A missing header means no such key. The value's bytes as sent make the identifier, read as
    UTF-8 text when they are that (the same under Starlette and aiohttp); two different values
    never share an identifier, whatever their bytes.
    """
    return raw_header_key(name, _raw_headers)


def _raw_headers(request: Request) -> list[tuple[bytes, bytes]]:
    return request.headers.raw


def path_key(request: Request) -> str:
    """Key function: the route's path template when routed (dependency), else the URL path."""
    route = request.scope.get("route")
    template = getattr(route, "path", None)
    return template if isinstance(template, str) else request.url.path


def _encode(headers: Iterable[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    return [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in headers]


class RateLimitMiddleware:
    """Pure ASGI middleware: limits every HTTP request (websockets and lifespan pass through).

    ``routes`` maps an exact path, or a ``"/prefix*"`` pattern, to a ``RouteLimit`` (another
    limiter, keys or weight) or to ``None`` (exempt). ``exempt(request)`` (sync or async)
    returning true skips limiting. With ``refund_on_error`` the weight is given back when the
    app raises or answers 5xx (never when the client hangs up: that would make requests free).
    """

    def __init__(
        self,
        app: ASGIApp,
        limiter: Limiter,
        *,
        keys: Mapping[str, KeyFunc] | None = None,
        weight: int | WeightFunc = 1,
        routes: Mapping[str, RouteLimit | None] | None = None,
        exempt: Callable[[Request], bool | Awaitable[bool]] | None = None,
        trusted_proxies: Iterable[str] = (),
        forwarded_header: ForwardedHeader = "x-forwarded-for",
        ipv6_prefix: int = DEFAULT_IPV6_PREFIX,
        refund_on_error: bool = False,
        legacy_headers: bool = False,
    ) -> None:
        self.app = app
        self._routes = RouteTable(Rule(limiter, keys or {"ip": CLIENT_IP}, weight), routes)
        self._resolver = ClientIPResolver(
            trusted_proxies, header=forwarded_header, ipv6_prefix=ipv6_prefix
        )
        self._header = forwarded_header.encode("latin-1")
        self._exempt = exempt
        self._refund = refund_on_error
        self._legacy = legacy_headers

    def _client_ip(self, scope: Scope) -> str | None:
        client = scope.get("client")
        peer = client[0] if client else None
        if not self._resolver.trusted:
            return self._resolver.resolve(peer, ())
        values = [v.decode("latin-1") for k, v in scope["headers"] if k == self._header]
        return self._resolver.resolve(peer, values)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rule = self._routes.match(scope["path"])
        if rule is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        if self._exempt is not None and await _call(self._exempt, request):
            await self.app(scope, receive, send)
            return
        verdict = await judge(rule, request, lambda: self._client_ip(scope), legacy=self._legacy)
        if verdict is None:
            await self.app(scope, receive, send)
            return
        if verdict.refused:
            await _send_problem(send, verdict)
            return
        extra = _encode(verdict.headers)
        status = 0

        async def send_with_headers(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
            await send(message)

        if not (self._refund and verdict.refundable):
            await self.app(scope, receive, send_with_headers)
            return
        try:
            await self.app(scope, receive, send_with_headers)
        except Exception:
            await refund_quietly(verdict.limiter, verdict.ids, verdict.weight)
            raise
        if status >= 500:
            await refund_quietly(verdict.limiter, verdict.ids, verdict.weight)


async def _send_problem(send: Send, verdict: Verdict) -> None:
    headers = _encode(
        [
            *verdict.headers,
            ("content-type", PROBLEM_CONTENT_TYPE),
            ("content-length", str(len(verdict.body))),
        ]
    )
    await send({"type": "http.response.start", "status": verdict.status, "headers": headers})
    await send({"type": "http.response.body", "body": verdict.body})


class RateLimitExceeded(HTTPException):
    """Raised by the ``RateLimit`` dependency: 429 (or 503 when the store is down).

    Register ``rate_limit_exceeded_handler`` for an RFC 9457 body; without it FastAPI's default
    handler still answers the right status and headers with ``{"detail": ...}``.
    """

    def __init__(self, verdict: Verdict) -> None:
        super().__init__(verdict.status, "rate limited", dict(verdict.headers))
        self.verdict = verdict
        self.decision = verdict.decision


async def rate_limit_exceeded_handler(request: Request, exc: Exception) -> Response:
    """``app.add_exception_handler(RateLimitExceeded, rate_limit_exceeded_handler)``."""
    if not isinstance(exc, RateLimitExceeded):  # pragma: no cover - registered for it only
        raise exc
    verdict = exc.verdict
    return Response(
        verdict.body, verdict.status, dict(verdict.headers), media_type=PROBLEM_CONTENT_TYPE
    )


class RateLimit:
    """FastAPI dependency: ``Depends(RateLimit(limiter, keys=..., weight=5))`` per route.

    It yields the ``Decision`` (or None when no key applied), sets the headers on the response
    (when the endpoint returns data rather than a ``Response`` of its own, as FastAPI merges
    them then), and raises ``RateLimitExceeded`` when refused. With ``refund_on_error`` the
    weight is given back when the endpoint raises anything but an ``HTTPException`` below 500.
    """

    def __init__(
        self,
        limiter: Limiter,
        *,
        keys: Mapping[str, KeyFunc] | None = None,
        weight: int | WeightFunc = 1,
        trusted_proxies: Iterable[str] = (),
        forwarded_header: ForwardedHeader = "x-forwarded-for",
        ipv6_prefix: int = DEFAULT_IPV6_PREFIX,
        refund_on_error: bool = False,
        legacy_headers: bool = False,
    ) -> None:
        self._rule = Rule(limiter, keys or {"ip": CLIENT_IP}, weight)
        self._resolver = ClientIPResolver(
            trusted_proxies, header=forwarded_header, ipv6_prefix=ipv6_prefix
        )
        self._refund = refund_on_error
        self._legacy = legacy_headers

    def _client_ip(self, request: Request) -> str | None:
        peer = request.client.host if request.client else None
        return self._resolver.resolve(peer, request.headers.getlist(self._resolver.header))

    async def __call__(
        self, request: Request, response: Response
    ) -> AsyncIterator[Decision | None]:
        verdict = await judge(
            self._rule, request, lambda: self._client_ip(request), legacy=self._legacy
        )
        if verdict is None:
            yield None
            return
        if verdict.refused:
            raise RateLimitExceeded(verdict)
        for name, value in verdict.headers:
            response.headers[name] = value
        if not (self._refund and verdict.refundable):
            yield verdict.decision
            return
        try:
            yield verdict.decision
        except HTTPException as exc:
            if exc.status_code >= 500:
                await refund_quietly(verdict.limiter, verdict.ids, verdict.weight)
            raise
        except Exception:
            await refund_quietly(verdict.limiter, verdict.ids, verdict.weight)
            raise
