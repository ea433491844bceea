"""Rate limiting for ``aiohttp.web``: a middleware and a per-handler decorator.

Importable with aiohttp installed (``pip install 'aiolimit-redis[aiohttp]'``)::

    from aiolimit.aiohttp import CLIENT_IP, exempt, header_key, limit, rate_limit_middleware

    app = web.Application(middlewares=[rate_limit_middleware(limiter)])

    @limit(limiter, "5/minute", key=header_key("x-api-key"))
    async def search(request: web.Request) -> web.Response: ...

    @exempt
    async def health(request: web.Request) -> web.Response: ...

Same behaviour as ``aiolimit.starlette``: every key with a value is one identifier; the
middleware judges the handler's ``@limit`` declarations with its own keys, all or nothing;
429 with RFC 9457 problem+json, ``Retry-After`` and the ``RateLimit`` / ``RateLimit-Policy``
fields; 503 when the store is down under ``on_error="closed"``; IPv6
clients keyed per /64 unless ``ipv6_prefix`` says otherwise (128: per address). Headers are
added to the handler's response unless it was already prepared (streamed). A request
holding ``Concurrency`` slots keeps them until its body is sent: a ``FileResponse`` or a body
from a file or an async iterator gives them back once aiohttp has sent it, after every
middleware had its say (see ``_release_once_sent``).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from aiohttp import web
from aiohttp.payload import Payload
from multidict import CIMultiDict

from aiolimit._limiter import Limiter
from aiolimit._limits import BaseLimit
from aiolimit._web.client_ip import DEFAULT_IPV6_PREFIX, ClientIPResolver, ForwardedHeader
from aiolimit._web.flow import (
    EXEMPT_MARK,
    Layer,
    RequestLimits,
    RouteLimit,
    RouteTable,
    Rule,
    Verdict,
    check_exempt,
    judge,
    mark_exempt,
    route_rule,
)
from aiolimit._web.headers import PROBLEM_CONTENT_TYPE
from aiolimit._web.keys import CLIENT_IP, KeyFunc, WeightFunc, _call, raw_header_key

__all__ = [
    "CLIENT_IP",
    "RouteLimit",
    "exempt",
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


LAYERS_MARK = "__aiolimit_layers__"
#: Where the first layer to judge a request leaves its ``RequestLimits``.
#: (``web.RequestKey`` since aiohttp 3.12, where plain text keys warn; text before it).
REQUEST_KEY: Any = (
    web.RequestKey("aiolimit.request", RequestLimits)
    if hasattr(web, "RequestKey")
    else "aiolimit.request"
)

E = TypeVar("E")


def exempt(handler: E) -> E:
    """Marks a handler as exempt from the middleware's limits (its own ``@limit`` still applies)."""
    return mark_exempt(handler)


#: The scope of a route's own limits on a request no route matched (a handler called for
#: 404s): one for all, not one (and a rule kept in memory) per path a client makes up.
NO_ROUTE = "(no route)"


def route_scope(request: web.Request) -> str:
    """A route's own limits are kept per ``"<method> <path template>"`` (``"GET /items/{id}"``)."""
    route = request.match_info.route
    resource = route.resource
    if resource is None:
        return NO_ROUTE
    method = "GET" if route.method == "HEAD" else route.method  # add_get adds a HEAD route
    return f"{method} {resource.canonical}" if method != "*" else resource.canonical


class _Settings:
    """How a middleware or decorator finds the client and writes headers."""

    def __init__(
        self,
        trusted_proxies: Iterable[str],
        forwarded_header: ForwardedHeader,
        ipv6_prefix: int,
        legacy_headers: bool,
    ) -> None:
        self.resolver = ClientIPResolver(
            trusted_proxies, header=forwarded_header, ipv6_prefix=ipv6_prefix
        )
        self.legacy = legacy_headers

    def client_ip(self, request: web.Request) -> str | None:
        forwarded = (
            request.headers.getall(self.resolver.header, [])
            if self.resolver.reads_forwarded
            else []
        )
        return self.resolver.resolve(_peer(request), forwarded)


def _problem(verdict: Verdict) -> web.Response:
    headers = CIMultiDict(verdict.headers)
    headers["Content-Type"] = PROBLEM_CONTENT_TYPE
    return web.Response(status=verdict.status, body=verdict.body, headers=headers)


def _route_layers(request: web.Request) -> tuple[tuple[_Marker, ...], bool]:
    handler = request.match_info.handler
    return getattr(handler, LAYERS_MARK, ()), bool(getattr(handler, EXEMPT_MARK, False))


async def _run(state: RequestLimits, request: web.Request, handler: Handler) -> web.StreamResponse:
    """Runs the handler under an admitted verdict: refunds on error, adds the headers."""
    response = await _refunding(state.verdict, request, handler, state)
    if state.refused is None and not response.prepared:
        response.headers.extend(state.headers())
    return response


async def _refunding(
    verdict: Verdict | None,
    request: web.Request,
    handler: Handler,
    state: RequestLimits | None = None,
) -> web.StreamResponse:
    """Runs the handler; when it raises or answers 5xx, gives back the charges whose layers
    asked for ``refund_on_error`` (each charge once, whoever notices first)."""
    try:
        response = await handler(request)
    except web.HTTPException as exc:
        if verdict is not None and exc.status >= 500:
            await verdict.give_back(on_error=True)
        if state is not None:
            exc.headers.extend(state.headers())
        raise
    except Exception:
        # A client that hung up (a write to its closed connection raised) is not refunded:
        # that would make requests free.
        if verdict is not None and not _client_gone(request):
            await verdict.give_back(on_error=True)
        raise
    if verdict is not None and response.status >= 500 and not _client_gone(request):
        await verdict.give_back(on_error=True)
    return response


def _client_gone(request: web.Request) -> bool:
    """The request's connection is closed or closing: its client went away."""
    transport = request.transport
    return transport is None or transport.is_closing()


async def _judge_first(
    layers: list[Layer], included: Sequence[object], settings: _Settings,
    request: web.Request, handler: Handler,
) -> web.StreamResponse:  # fmt: skip
    state = RequestLimits(included, settings.legacy, settings.client_ip)
    request[REQUEST_KEY] = state
    verdict = await judge(layers, request, legacy=settings.legacy, client_ip=settings.client_ip)
    if verdict is not None and verdict.refused:
        return _problem(verdict)
    state.verdict = verdict
    if verdict is not None:
        verdict.keep_leases()
    sending = False
    try:
        response = await _run(state, request, handler)
        if state.verdict is not None and _holds_leases(state.verdict) and _sent_later(response):
            sending = _release_once_sent(request, response, state.verdict)
        return response
    finally:
        if state.verdict is not None and not sending:  # the request is over: its
            await state.verdict.release()  # Concurrency slots go back


def _holds_leases(verdict: Verdict) -> bool:
    return any(
        charge.holds_lease and not charge.decision.lease.released  # type: ignore[union-attr]
        for charge in verdict.charges
    )


def _sent_later(response: web.StreamResponse) -> bool:
    """aiohttp writes a returned response after the middlewares have returned: a body in
    memory in one write, but a ``FileResponse`` or a body read from a file or an async
    iterator for as long as the download lasts."""
    if response.prepared:
        return False
    return not isinstance(response, web.Response) or isinstance(response.body, Payload)


def _release_once_sent(
    request: web.Request, response: web.StreamResponse, verdict: Verdict
) -> bool:
    """Keeps the request's ``Concurrency`` slots until aiohttp has sent the streamed body, so
    that a download counts as a request in flight until it ends. aiohttp sends a returned
    response once every middleware has returned (each may still add to it: headers,
    cookies), ending with its ``write_eof``: the slots go back when that has finished, before
    the connection takes its next request. A body that fails there is the app's, given back
    under ``refund_on_error``; a client that hung up (``ConnectionError``) is not refunded.
    Should ``write_eof`` never come (the response replaced, or a failure before), they go
    back when the task that runs the request ends. False when there is no such task (the
    caller releases at once, as for any other response)."""
    task = asyncio.current_task()
    if task is None:
        return False
    write_eof = response.write_eof

    async def write_eof_then_release(data: bytes = b"") -> None:
        try:
            await write_eof(data)
        except ConnectionError:
            raise
        except Exception:
            if not _client_gone(request):
                await verdict.give_back(on_error=True)
            raise
        finally:
            await verdict.release()

    def ended(task: asyncio.Task[Any]) -> None:
        error = None if task.cancelled() else task.exception()
        if isinstance(error, Exception) and not isinstance(error, ConnectionError):
            _keep(verdict.give_back(on_error=True))  # (each charge is given back once)
        _keep(verdict.release())  # (nothing left to do if write_eof released them)

    response.write_eof = write_eof_then_release  # type: ignore[method-assign]
    task.add_done_callback(ended)
    return True


#: Releases and refunds started once a streamed response was sent (held until they end).
_after_sending: set[asyncio.Future[None]] = set()


def _keep(coroutine: Coroutine[Any, Any, None]) -> None:
    task = asyncio.ensure_future(coroutine)
    _after_sending.add(task)
    task.add_done_callback(_after_sending.discard)


def _router_path(request: web.Request) -> str:
    """The path aiohttp's router resolves: decoded, except ``%2F`` and ``%25`` (yarl's
    ``path_safe``; the raw path where yarl is older)."""
    url = request.rel_url
    safe = getattr(url, "path_safe", None)
    return safe if isinstance(safe, str) else url.raw_path


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
    ``routes``, ``exempt`` and ``refund_on_error``, which mean the same here).

    The handler's ``@limit`` declarations are judged with the middleware's keys, once: one
    decision per limiter (one for all when they share it), all or nothing, one set of
    ``RateLimit`` fields on the response. A handler marked ``@exempt`` skips the middleware's
    own limits.
    """
    table = RouteTable(Rule(limiter, keys or {"ip": CLIENT_IP}, weight), routes)
    settings = _Settings(trusted_proxies, forwarded_header, ipv6_prefix, legacy_headers)
    check_exempt(exempt)
    exempt_request = exempt
    own_layers: dict[int, Layer] = {}  # per rule of the route table (they live as long)

    @web.middleware
    async def aiolimit_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        markers, is_exempt = _route_layers(request)
        # The path as the router matches it: %2F stays encoded (it is no "/" to a route), so a
        # request cannot look like another path to the table than to the router.
        rule = None if is_exempt else table.match(_router_path(request))
        if rule is not None and exempt_request is not None and await _call(exempt_request, request):
            rule = None
        layers = [marker.layer for marker in markers]
        if rule is not None:
            layer = own_layers.get(id(rule))
            if layer is None:
                layer = own_layers[id(rule)] = Layer(
                    rule, settings.client_ip, refund=refund_on_error
                )
            layers.insert(0, layer)
        outer = request.get(REQUEST_KEY)
        if isinstance(outer, RequestLimits):
            # Another middleware judged first: join its decision (its headers, its refunds).
            layers = [m.layer for m in markers if not outer.judged(m)]
            if rule is not None:
                layers.insert(0, own_layers[id(rule)])
            outer.include(markers)
            if layers:
                verdict = await outer.add(layers, request)
                if verdict is not None and verdict.refused:
                    return _problem(verdict)
            return await handler(request)
        if not layers:
            return await handler(request)
        return await _judge_first(layers, markers, settings, request, handler)

    return aiolimit_middleware


class _Marker:
    """One ``@limit`` declaration, as the middleware finds it on the handler."""

    __slots__ = ("layer", "settings")

    def __init__(self, layer: Layer, settings: _Settings) -> None:
        self.layer = layer
        self.settings = settings


def limit(
    limiter: Limiter,
    limits: str | Sequence[BaseLimit | str] | None = None,
    *,
    key: KeyFunc | None = None,
    keys: Mapping[str, KeyFunc] | None = None,
    weight: int | WeightFunc | None = None,
    name: str | None = None,
    trusted_proxies: Iterable[str] = (),
    forwarded_header: ForwardedHeader = "x-forwarded-for",
    ipv6_prefix: int = DEFAULT_IPV6_PREFIX,
    refund_on_error: bool = False,
    legacy_headers: bool = False,
) -> Callable[[Handler], Handler]:
    """Decorator for one ``async def handler(request)``: ``@limit(limiter, "5/minute")``.

    ``limits``, ``key``, ``keys``, ``weight`` and ``name`` mean what they mean for
    ``aiolimit.starlette.RateLimit``: with ``limits`` the route has limits of its own (per
    client IP, or per ``key``), kept per route (method and path template) or per ``name``;
    without, the limiter's rules apply to ``keys``. ``weight`` is what a request costs under
    every limit that applies to it. Under ``rate_limit_middleware`` the middleware judges it
    with its own keys, once; alone, the outermost ``@limit`` judges all of the handler's.
    """
    rule = route_rule(
        limiter, limits, key=key, keys=keys, weight=weight, name=name, route_scope=route_scope
    )
    settings = _Settings(trusted_proxies, forwarded_header, ipv6_prefix, legacy_headers)
    own_client = settings.resolver.reads_forwarded or ipv6_prefix != DEFAULT_IPV6_PREFIX
    marker = _Marker(
        Layer(rule, settings.client_ip, weight is not None, refund_on_error, own_client), settings
    )

    def decorate(handler: Handler) -> Handler:
        inner: tuple[_Marker, ...] = getattr(handler, LAYERS_MARK, ())
        markers = (marker, *inner)

        @functools.wraps(handler)
        async def limited(request: web.Request) -> web.StreamResponse:
            state = request.get(REQUEST_KEY)
            if isinstance(state, RequestLimits):
                if state.judged(marker):
                    return await handler(request)
                verdict = await state.add([marker.layer], request)
                if verdict is not None and verdict.refused:
                    return _problem(verdict)
                return await _refunding(verdict, request, handler)
            layers = [m.layer for m in markers]
            return await _judge_first(layers, markers, settings, request, handler)

        setattr(limited, LAYERS_MARK, markers)
        return limited

    return decorate
