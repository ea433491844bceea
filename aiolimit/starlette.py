"""Rate limiting for Starlette and FastAPI: a pure ASGI middleware and a FastAPI dependency.

Importable with Starlette installed (``pip install 'aiolimit-redis[fastapi]'``)::

    from aiolimit import Limit, Limiter
    from aiolimit.starlette import CLIENT_IP, RateLimit, RateLimitMiddleware, exempt, header_key

    limiter = Limiter(url, {"ip": [Limit(10, per=1)], "user": [Limit(100, per=60)]},
                      deadline=0.25, on_error="open")
    app.add_middleware(RateLimitMiddleware, limiter=limiter,
                       keys={"ip": CLIENT_IP, "user": header_key("x-user")},
                       trusted_proxies=["10.0.0.0/8"])

    @app.get("/report", dependencies=[Depends(RateLimit(limiter, "5/minute"))])
    async def report(): ...

    @app.get("/health")
    @exempt
    async def health(): ...

Every key that gives a value becomes one identifier (``"ip:203.0.113.7"``, ``"user:42"``).
The middleware finds the request's route and the ``RateLimit`` dependencies on it and judges
them with its own keys in one all-or-nothing ``try_acquire`` per limiter: one decision, one
set of ``RateLimit`` fields, nothing charged anywhere when any of them refuses. IPv6 clients
are keyed per /64 (``"ip:2001:db8:1:2::/64"``), since one subscriber can rotate through a
whole /64; ``ipv6_prefix=128`` keys each address alone. A header's value is keyed by its
bytes, one to one (see ``header_key``). Refused: 429 with RFC 9457 problem+json,
``Retry-After`` and the ``RateLimit``/``RateLimit-Policy`` fields (see
``aiolimit._web.headers`` for the header semantics). Store down and ``on_error="closed"``: 503.

Behind a proxy, note that uvicorn's own ``proxy_headers`` (on by default, trusting
``127.0.0.1``) rewrites the ASGI ``client`` from ``X-Forwarded-For`` before any middleware runs.
Either keep that and leave ``trusted_proxies`` empty, or run uvicorn with
``proxy_headers=False`` and let ``trusted_proxies`` decide; not both. Declare them once, on
the middleware: a ``RateLimit`` given no ``trusted_proxies`` (nor ``ipv6_prefix``) finds the
client as the middleware that judges the request does (alone, it uses its own settings).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, HTTPConnection, Request
from starlette.responses import Response
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from aiolimit._decision import Decision
from aiolimit._limiter import Limiter
from aiolimit._limits import BaseLimit
from aiolimit._web.client_ip import (
    DEFAULT_IPV6_PREFIX,
    PEER_CACHE_SIZE,
    ClientIPResolver,
    ForwardedHeader,
)
from aiolimit._web.flow import (
    EXEMPT_MARK,
    Layer,
    RequestLimits,
    RouteLimit,
    RouteTable,
    Rule,
    Verdict,
    _released,
    check_exempt,
    judge,
    judge_local,
    judge_store,
    mark_exempt,
    route_rule,
)
from aiolimit._web.headers import PROBLEM_CONTENT_TYPE
from aiolimit._web.keys import (
    CLIENT_IP,
    KeyFunc,
    WeightFunc,
    _call,
    key_value,
    raw_header_key,
)

__all__ = [
    "CLIENT_IP",
    "RateLimit",
    "RateLimitExceeded",
    "RateLimitMiddleware",
    "RouteLimit",
    "exempt",
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
    template = _effective_path(request.scope, request.scope.get("route"))
    return template if isinstance(template, str) else request.url.path


def _effective_path(scope: Scope, route: Any) -> Any:
    """The route's full path template: FastAPI 0.16x keeps the original route of an included
    router (its path without the inclusion's prefix) and the effective one beside it."""
    fastapi_scope = scope.get("fastapi")
    if isinstance(fastapi_scope, dict):
        effective = getattr(fastapi_scope.get("effective_route_context"), "path", None)
        if isinstance(effective, str) and effective:
            return effective
    return getattr(route, "path", None)


def _route_path(scope: Scope) -> str:
    """The path as the app's routes see it: without the root path a server was given
    (``uvicorn --root-path /api``; ASGI's ``path`` includes it), as ``routes=`` is written."""
    path: str = scope["path"]
    root = scope.get("root_path", "")
    if root and isinstance(root, str) and path.startswith(root):
        rest = path[len(root) :]
        if not rest or rest.startswith("/"):
            return rest or "/"
    return path


def _inclusion(scope: Scope) -> Any:
    """FastAPI's context of an included router's route (its inclusion's ``dependencies``),
    or None: a route's declarations include those its inclusion adds."""
    fastapi_scope = scope.get("fastapi")
    if isinstance(fastapi_scope, dict):
        return fastapi_scope.get("effective_route_context")
    return None


def _encode(headers: Iterable[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    known = _FIELD_NAMES
    encoded = []
    for name, value in headers:  # (a loop, not a comprehension: no frame of its own)
        encoded.append((known.get(name) or _field_name(name), value.encode("latin-1")))
    return encoded


def _field_name(name: str) -> bytes:
    """A header's name as ASGI sends it: lower case, bytes (the few our layers write, kept)."""
    encoded = _FIELD_NAMES.get(name)
    if encoded is None:
        encoded = name.lower().encode("latin-1")
        if len(_FIELD_NAMES) < 64:
            _FIELD_NAMES[name] = encoded
    return encoded


_FIELD_NAMES: dict[str, bytes] = {}


#: Where the first layer to judge a request leaves its ``RequestLimits`` in the ASGI scope.
SCOPE_KEY = "aiolimit.request"
_UNKNOWN = object()  # (a peer not seen yet: ``RateLimitMiddleware._ids_of``)

E = TypeVar("E")


def exempt(endpoint: E) -> E:
    """Marks an endpoint as exempt from the middleware's limits (its own limits still apply).

    ``@app.get("/health")`` above ``@exempt`` (FastAPI), or ``Route("/health", exempt(health))``.
    """
    return mark_exempt(endpoint)


def route_scope(request: Request) -> str:
    """A route's own limits are kept per ``"<methods> <path template>"`` (``"GET /items/{id}"``),
    the templates of the mounts it is under included (``"GET /t/{tenant}/report"``)."""
    route = request.scope.get("route")
    path = _effective_path(request.scope, route)
    if not isinstance(path, str):
        return request.url.path
    methods = getattr(route, "methods", None) or ()
    shown = sorted(m for m in methods if m != "HEAD") or sorted(methods)
    where = _mount_templates(request.scope) + path
    return f"{','.join(shown)} {where}" if shown else where


#: Where the middleware leaves, in the ASGI scope, the path templates of the mounts the
#: request goes through (``"/t/{tenant}"``).
MOUNTS_KEY = "aiolimit.mounts"


def _mount_templates(scope: Scope) -> str:
    """The app's root path and the templates of the mounts the request went through.

    A mount's ``root_path`` holds the values its path matched (``/t/acme``): a route's own
    limits kept per value would be a new budget, and a new rule, for every value a client
    sends. The templates come from the middleware (``MOUNTS_KEY``), else from matching the
    outermost router again; failing that, a mount with path parameters reads ``/{mount}``.
    """
    root = scope.get("root_path", "")
    app_root = scope.get("app_root_path", root)
    if not isinstance(root, str) or not isinstance(app_root, str) or root == app_root:
        return root if isinstance(root, str) else ""
    mounts = scope.get(MOUNTS_KEY)
    if not isinstance(mounts, str):
        routes = getattr(scope.get("router"), "routes", None)
        found = match_route(routes, {**scope, "root_path": app_root}) if routes else None
        mounts = found[2].get(MOUNTS_KEY) if found is not None else None
        if isinstance(mounts, str):
            scope[MOUNTS_KEY] = mounts
    if isinstance(mounts, str):
        return app_root + mounts
    route = scope.get("route")
    own = set(getattr(route, "param_convertors", None) or ())
    params = scope.get("path_params") or {}
    if any(name not in own for name in params):
        return app_root + "/{mount}"  # (bounded: never a value a client chose)
    return root


def _walk_dependencies(dependant: Any, found: dict[int, RateLimit], depth: int = 0) -> None:
    if dependant is None or depth > 32:
        return
    for sub in getattr(dependant, "dependencies", ()):
        call = getattr(sub, "call", None)
        if isinstance(call, RateLimit):
            found.setdefault(id(call), call)
        _walk_dependencies(sub, found, depth + 1)


def route_limits(route: Any, context: Any = None) -> tuple[tuple[RateLimit, ...], bool]:
    """The ``RateLimit`` dependencies of a route (FastAPI, at any depth; with ``context``, a
    FastAPI included router's effective route, its router's too) and its exemption."""
    if context is None:
        try:
            cached = _ROUTE_MARKS.get(route)
        except TypeError:  # None, or not weakly referable
            cached = None
        if cached is not None:
            return cached
    found: dict[int, RateLimit] = {}
    _walk_dependencies(getattr(route, "dependant", None), found)
    if context is not None:
        _walk_dependencies(getattr(context, "dependant", None), found)
        _add_depends(getattr(context, "dependencies", None), found)
    endpoint = getattr(route, "endpoint", None)
    marks = (tuple(found.values()), bool(getattr(endpoint, EXEMPT_MARK, False)))
    if context is None:
        with contextlib.suppress(TypeError):  # not weakly referable: not cached
            _ROUTE_MARKS[route] = marks
    return marks


def _add_depends(depends: Any, found: dict[int, RateLimit]) -> None:
    """``Depends(...)`` markers (a router's ``dependencies=``) that are ``RateLimit``s."""
    for marker in depends or ():
        call = getattr(marker, "dependency", None)
        if isinstance(call, RateLimit):
            found.setdefault(id(call), call)


_ROUTE_MARKS: weakref.WeakKeyDictionary[Any, tuple[tuple[RateLimit, ...], bool]] = (
    weakref.WeakKeyDictionary()
)


def _included(route: Any) -> tuple[Sequence[Any], Any] | None:
    """A FastAPI included router (a route that selects among its router's routes itself):
    its router's routes and the ``Depends`` its inclusion adds; None for any other route."""
    select = getattr(route, "_match", None)
    router = getattr(route, "original_router", None)
    if not callable(select) or router is None or hasattr(route, "endpoint"):
        return None
    context = getattr(route, "include_context", None)
    return getattr(router, "routes", ()), getattr(context, "dependencies", None)


def _marked(routes: Sequence[Any], depth: int = 0) -> bool:
    """Whether any route (through mounts and included routers) has limits or is exempt."""
    for route in routes:
        layers, is_exempt = route_limits(route)
        if layers or is_exempt:
            return True
        if depth >= 8:
            continue
        included = _included(route)
        if included is not None:
            found: dict[int, RateLimit] = {}
            _add_depends(included[1], found)
            if found or _marked(included[0], depth + 1):
                return True
            continue
        inner = getattr(route, "routes", None)
        if inner and not hasattr(route, "endpoint") and _marked(inner, depth + 1):
            return True
    return False


class _EffectiveRoute:
    """What a key function or a route's own limits read of a route: path, methods, endpoint."""

    __slots__ = ("endpoint", "methods", "name", "path")

    def __init__(self, route: Any, context: Any) -> None:
        self.path = getattr(context, "path", None) or getattr(route, "path", None)
        self.methods = getattr(route, "methods", None)
        self.endpoint = getattr(route, "endpoint", None)
        self.name = getattr(route, "name", None)


def match_route(
    routes: Sequence[Any], scope: Scope, depth: int = 0, mounts: str = ""
) -> tuple[Any, Any, Scope] | None:
    """The route the router will run, fully matched (through mounts and FastAPI's included
    routers), its FastAPI context if any, and the scope it will see (with ``MOUNTS_KEY``: the
    templates of the mounts on the way). None when no route matches fully: a 404 or 405 is
    judged by the middleware's own limits alone."""
    for route in routes:
        if depth < 8 and _included(route) is not None:
            try:
                match, child, inner, context = route._match(scope)
            except Exception:  # another FastAPI's internals: leave it to the dependencies
                return None
            if match is not Match.FULL or inner is None:
                continue
            merged = {**scope, **child}
            if inner is route or _included(inner) is not None:
                if inner is route:
                    return None
                return match_route([inner], merged, depth + 1, mounts)
            merged["route"] = _EffectiveRoute(inner, context)
            merged[MOUNTS_KEY] = mounts
            return inner, context, merged
        match, child = route.matches(scope)
        if match is not Match.FULL:
            continue
        merged = {**scope, **child, "route": route}
        inner_routes = getattr(route, "routes", None)
        if inner_routes is not None and not hasattr(route, "endpoint") and depth < 8:
            template = getattr(route, "path", "")
            inner_mounts = mounts + (template if isinstance(template, str) else "")
            return match_route(inner_routes, merged, depth + 1, inner_mounts)
        merged[MOUNTS_KEY] = mounts
        return route, None, merged
    return None


class RateLimitMiddleware:
    """Pure ASGI middleware: limits every HTTP request (websockets and lifespan pass through).

    ``routes`` maps an exact path, or a ``"/prefix*"`` pattern, to a ``RouteLimit`` (another
    limiter, keys or weight) or to ``None`` (exempt). ``exempt(request)`` (sync or async)
    returning true skips limiting, and so does an endpoint marked with ``exempt``. With
    ``refund_on_error`` the weight is given back when the app raises or answers 5xx (never
    when the client hangs up: that would make requests free).

    The middleware finds the route the request goes to, and the ``RateLimit`` dependencies
    on it, and judges them together with its own keys: one decision per limiter (one for all
    when they share it), all or nothing, one set of ``RateLimit`` fields on the response.
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
        check_exempt(exempt)
        self._exempt = exempt
        self._refund = refund_on_error
        self._legacy = legacy_headers
        self._marked: dict[int, tuple[int, bool]] = {}
        self._missed = self._marked.clear  # (a route index found stale: ``RequestLimits``)
        self._layers: dict[int, Layer] = {}  # per rule of the route table (they live as long)
        # A request judged with no Request made (``_ids_of``): under the middleware's one
        # rule, keyed by the client alone, at a fixed weight. The identifiers' kinds, with
        # their ':'.
        base = self._routes.base
        self._simple: tuple[str, ...] | None = None
        if (
            not routes
            and exempt is None
            and isinstance(weight, int)
            and all(func is CLIENT_IP for func in base.keys.values())
        ):
            self._simple = tuple(f"{kind}:" for kind in base.keys)
        self._ids_by_peer: dict[str | None, tuple[str, ...] | None] = {}

    def _client_ip(self, request: Request) -> str | None:
        return self._client_of(request.scope)

    def _client_of(self, scope: Scope) -> str | None:
        client = scope.get("client")
        peer = client[0] if client else None
        if not self._resolver.reads_forwarded:
            return self._resolver.resolve(peer, ())
        values = [v.decode("latin-1") for k, v in scope["headers"] if k == self._header]
        return self._resolver.resolve(peer, values)

    def _route(self, scope: Scope) -> tuple[tuple[RateLimit, ...], bool, Scope]:
        """The matched route's own layers and exemption, and the scope it will see."""
        router = getattr(scope.get("app"), "router", None)
        if router is None:
            router = self._inner_router()
        routes = getattr(router, "routes", None)
        if not routes:
            return (), False, scope
        known = self._marked.get(id(routes))
        if known is None or known[0] != len(routes):
            known = (len(routes), _marked(routes))
            self._marked[id(routes)] = known
        if not known[1]:
            return (), False, scope
        found = match_route(routes, scope)
        if found is None:
            return (), False, scope
        root = scope.get("root_path", "")
        if root == scope.get("app_root_path", root):
            scope[MOUNTS_KEY] = found[2][MOUNTS_KEY]  # for the route's own limits' scope
        else:
            # A middleware of a mounted sub-app: its mounts are the sub-app's, and the outer
            # ones' templates are not known here (root_path holds their values): the
            # scope is found from the outermost router (``_mount_templates``).
            del found[2][MOUNTS_KEY]
        layers, is_exempt = route_limits(found[0], found[1])
        overrides = getattr(scope.get("app"), "dependency_overrides", None)
        if overrides and layers:  # an overridden RateLimit (tests often turn limits off so)
            layers = tuple(dep for dep in layers if dep not in overrides)
        return layers, is_exempt, found[2]

    def _inner_router(self) -> Any:
        """The router of the app this middleware wraps directly (``RateLimitMiddleware(app)``
        rather than ``add_middleware``: the app has not put itself in the scope yet), found
        through other middlewares' ``.app``."""
        inner: Any = self.app
        for _ in range(8):
            router = getattr(inner, "router", None)
            if router is not None:
                return router
            if getattr(inner, "routes", None) is not None:
                return inner
            inner = getattr(inner, "app", None)
            if inner is None:
                return None
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        own, is_exempt, seen = self._route(scope)
        ids = None
        if self._simple is not None and not own and not is_exempt and SCOPE_KEY not in scope:
            ids = self._ids_of(scope)
        if ids is not None:
            # The commonest request (the middleware's one rule, keyed by the client alone):
            # judged with no Request made.
            state = RequestLimits((), self._legacy, self._client_ip)
            scope[SCOPE_KEY] = state
            simple = self._routes.base
            weight = simple.weight
            assert isinstance(weight, int)
            limiter = simple.limiter
            verdict: Verdict | None = judge_local(
                limiter, ids, weight, refund=self._refund, legacy=self._legacy
            )
            if verdict is None:  # (nothing taken ahead here: the store decides)
                verdict = await judge_store(
                    limiter, ids, weight, refund=self._refund, legacy=self._legacy
                )
            if verdict is not None and verdict.refused:
                await _send_problem(send, verdict)
                return
        else:
            rule = None if is_exempt else self._routes.match(_route_path(scope))
            request = Request(seen, receive)
            if rule is not None and self._exempt is not None and await _call(self._exempt, request):
                rule = None
            base = None
            if rule is not None:
                base = self._layers.get(id(rule))
                if base is None:
                    base = Layer(rule, self._client_ip, refund=self._refund)
                    self._layers[id(rule)] = base
            outer = scope.get(SCOPE_KEY)
            if isinstance(outer, RequestLimits):
                # Another middleware judged first: join its decision (its headers, refunds).
                await self._join(outer, base, own, request, scope, receive, send)
                return
            layers = [dep.layer for dep in own]
            if base is not None:
                layers.insert(0, base)
            if not layers:
                await self.app(scope, receive, send)
                return
            state = RequestLimits(own, self._legacy, self._client_ip)
            scope[SCOPE_KEY] = state
            verdict = await judge(layers, request, legacy=self._legacy, client_ip=self._client_ip)
            if verdict is not None and verdict.refused:
                await _send_problem(send, verdict)
                return
        state.missed = self._missed
        state.verdict = verdict
        if verdict is not None:
            verdict.keep_leases()
        status = 0
        client_gone = False  # (its hang-up, seen here, is never a reason to refund)

        async def receive_watched() -> Message:
            nonlocal client_gone
            message = await receive()
            if message["type"] == "http.disconnect":
                client_gone = True
            return message

        async def send_with_headers(message: Message) -> None:
            nonlocal status, client_gone
            if message["type"] == "http.response.start":
                status = message["status"]
                extra = _encode(state.headers())
                if extra:
                    message = {**message, "headers": [*message.get("headers", ()), *extra]}
            elif (
                message["type"] == "http.response.body"
                and not message.get("more_body", False)
                and state.verdict is not None
            ):
                # Released before the response's end goes out: a client that sends its next
                # request on reading this one never finds its own slot still held.
                releasing = state.verdict.releasing()
                if releasing:
                    await _released(releasing)
            try:
                await send(message)
            except OSError:  # (ASGI 2.4: the server's send raises once the client is gone)
                client_gone = True
                raise

        try:
            await self.app(scope, receive_watched, send_with_headers)
        except Exception as error:
            if state.verdict is not None and not (client_gone or _clients_own(error)):
                await state.verdict.give_back(on_error=True)
            raise
        finally:
            if state.verdict is not None:
                releasing = state.verdict.releasing()
                if releasing:
                    await _released(releasing)
        if status >= 500 and state.verdict is not None and not client_gone:
            await state.verdict.give_back(on_error=True)

    def _ids_of(self, scope: Scope) -> tuple[str, ...] | None:
        """The identifiers of a request under the middleware's one rule when it is keyed by
        the client alone (``_simple``), as ``Rule.identifiers`` makes them; None when no key
        applies (the request is then judged as any other). Kept per peer address (bounded)
        when no forwarded header is read: they depend on nothing else then."""
        kinds = self._simple
        assert kinds is not None
        if self._resolver.reads_forwarded:
            return self._ids_for(self._client_of(scope))
        client = scope.get("client")
        peer = client[0] if client else None
        known = self._ids_by_peer.get(peer, _UNKNOWN)
        if known is _UNKNOWN:
            known = self._ids_for(self._client_of(scope))
            if len(self._ids_by_peer) >= PEER_CACHE_SIZE:
                self._ids_by_peer.clear()
            self._ids_by_peer[peer] = known
        return known  # type: ignore[return-value]

    def _ids_for(self, client: str | None) -> tuple[str, ...] | None:
        kinds = self._simple
        assert kinds is not None
        value = key_value(client)
        if value is None:
            return None
        return tuple([kind + value for kind in kinds])

    async def _join(
        self,
        outer: RequestLimits,
        base: Layer | None,
        own: Sequence[RateLimit],
        request: Request,
        scope: Scope,
        receive: Receive,
        send: Send,
    ) -> None:
        """Under another middleware: judge what it did not, as part of its request."""
        layers = [dep.layer for dep in own if not outer.judged(dep)]
        if base is not None:
            layers.insert(0, base)
        outer.include(own)
        if layers:
            verdict = await outer.add(layers, request)
            if verdict is not None and verdict.refused:
                await _send_problem(send, verdict)
                return
        await self.app(scope, receive, send)  # the outer middleware writes the headers


def _clients_own(error: BaseException) -> bool:
    """The request failed by its client's doing, which ``refund_on_error`` never gives back:
    the client hung up (``ClientDisconnect``, from reading the body after it went away) or
    sent a request the app refuses as such (an HTTP status below 500, or FastAPI's
    validation errors, answered 422). Giving those back would make requests free."""
    if isinstance(error, ClientDisconnect):
        return True
    status = getattr(error, "status_code", None)
    if isinstance(status, int) and status < 500:
        return True
    return any(kind.__name__ == "RequestValidationError" for kind in type(error).__mro__)


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

    Answered as RFC 9457 problem+json with no registration needed: the dependency adds
    ``rate_limit_exceeded_handler`` to the app's handlers the first time it refuses, unless a
    handler for this class (or for status 429/503) is registered already.
    """

    def __init__(self, verdict: Verdict) -> None:
        super().__init__(verdict.status, "rate limited", dict(verdict.headers))
        self.verdict = verdict
        self.decision = verdict.decision


async def rate_limit_exceeded_handler(request: Request, exc: Exception) -> Response:
    """Renders ``RateLimitExceeded`` as problem+json (registered for you; see there)."""
    if not isinstance(exc, RateLimitExceeded):  # pragma: no cover - registered for it only
        raise exc
    verdict = exc.verdict
    return Response(
        verdict.body, verdict.status, dict(verdict.headers), media_type=PROBLEM_CONTENT_TYPE
    )


def _ensure_handler(scope: Scope) -> None:
    handlers = scope.get("starlette.exception_handlers")
    if isinstance(handlers, tuple) and len(handlers) == 2 and isinstance(handlers[0], dict):
        handlers[0].setdefault(RateLimitExceeded, rate_limit_exceeded_handler)


class RateLimit:
    """FastAPI dependency: ``Depends(RateLimit(limiter, "5/minute"))`` on a route.

    With ``limits`` (``"5/minute"``, ``"10/second;100/hour"`` or ``Limit`` objects) the route
    has limits of its own, per client IP by default, or per ``key`` (one key function) or
    ``keys`` (kind -> key function); they are kept per route (its methods and path template),
    or per ``name`` shared by every route that uses it, and never touch the limiter's rules.
    Without ``limits`` it applies the limiter's rules to ``keys`` (default: the client IP).

    ``weight`` is what a request to this route costs, under every limit that applies to it
    (the middleware's too); unset, a route costs the middleware's weight, or 1.

    Under ``RateLimitMiddleware`` the middleware judges the route's dependencies with its own
    keys, once; the dependency then only yields the decision. Alone, the first ``RateLimit``
    of a route to run judges all of the route's. It yields the ``Decision`` (None when no key
    applied), sets the headers on the response (when the endpoint returns data rather than a
    ``Response`` of its own, as FastAPI merges them then), and raises ``RateLimitExceeded``
    (problem+json) when refused. With ``refund_on_error`` the weight is given back when the
    endpoint raises anything but an ``HTTPException`` below 500.
    """

    def __init__(
        self,
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
    ) -> None:
        rule = route_rule(
            limiter, limits, key=key, keys=keys, weight=weight, name=name, route_scope=route_scope
        )
        self._resolver = ClientIPResolver(
            trusted_proxies, header=forwarded_header, ipv6_prefix=ipv6_prefix
        )
        own_client = self._resolver.reads_forwarded or ipv6_prefix != DEFAULT_IPV6_PREFIX
        self.layer = Layer(rule, self._client_ip, weight is not None, refund_on_error, own_client)
        self._legacy = legacy_headers

    def _client_ip(self, request: Request) -> str | None:
        peer = request.client.host if request.client else None
        return self._resolver.resolve(peer, request.headers.getlist(self._resolver.header))

    async def __call__(
        self, request: HTTPConnection, response: Response
    ) -> AsyncIterator[Decision | None]:
        # (Annotated HTTPConnection, FastAPI gives it to websocket routes as well: a
        # dependency on a whole app or router reaches them, and lets them through.)
        scope = request.scope
        if scope["type"] != "http":
            yield None  # websockets are not limited here (as the middleware passes them)
            return
        state = scope.get(SCOPE_KEY)
        limiter = self.layer.rule.limiter
        if isinstance(state, RequestLimits) and state.judged(self):
            # Judged already, with the middleware's keys or by the route's first RateLimit.
            yield None if state.verdict is None else state.verdict.decision_for(limiter)
            return
        if isinstance(state, RequestLimits):
            if state.missed is not None:
                state.missed()  # the middleware's route index did not see this dependency
            verdict = await state.add([self.layer], request)
            outer = True
        else:
            own, _ = route_limits(scope.get("route"), _inclusion(scope))
            overrides = getattr(scope.get("app"), "dependency_overrides", None)
            if overrides:  # an overridden RateLimit is not judged (as under the middleware)
                own = tuple(dep for dep in own if dep not in overrides)
            mine = own if self in own else (self,)
            state = RequestLimits(mine, self._legacy)
            scope[SCOPE_KEY] = state
            verdict = state.verdict = await judge(
                [dep.layer for dep in mine], request, legacy=self._legacy
            )
            outer = False
        if verdict is None:  # no key applies, or its identifiers were charged already
            try:
                yield None if state.verdict is None else state.verdict.decision_for(limiter)
            finally:
                # A RateLimit this one did not see may have judged since (it joined this
                # request): the first to judge releases the request's slots.
                if not outer and state.verdict is not None:
                    await state.verdict.release()
            return
        if verdict.refused:
            _ensure_handler(scope)
            raise RateLimitExceeded(verdict)
        if not outer:
            for name, value in verdict.headers:
                response.headers[name] = value
            verdict.keep_leases()
        try:
            if not (verdict.refund and verdict.refundable):
                yield verdict.decision_for(limiter)
                return
            try:
                yield verdict.decision_for(limiter)
            except Exception as exc:
                if not _clients_own(exc):
                    await verdict.give_back(on_error=True)
                raise
        finally:
            # The request is over: its Concurrency slots go back (the layer that judged it
            # first releases them all; under a middleware, the middleware does).
            if not outer:
                await verdict.release()
