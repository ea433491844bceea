"""Key functions for the web integrations: what identifies a request, and its weight.

A key function gets the framework's request and returns the key's value; ``CLIENT_IP`` stands
for the client's IP as the integration's resolver finds it. ``key_value`` turns any value into
bounded, valid identifier text, one to one, so a huge or undecodable header can neither become
a huge or broken identifier nor share another client's identifier.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, TypeAlias

from aiolimit._errors import ConfigurationError

#: A key function gets the framework's request and returns the key's value (None: no key).
KeyFunc: TypeAlias = (
    "Callable[[Any], str | bytes | int | Awaitable[str | bytes | int | None] | None]"
)
WeightFunc: TypeAlias = "Callable[[Any], int | Awaitable[int]]"
#: The request's header fields as the client sent them: (name, value) byte strings, in order.
RawHeaders: TypeAlias = "Callable[[Any], Iterable[tuple[bytes, bytes]]]"

MAX_KEY_CHARS = 200
#: Starts every value that is not kept as it is, and so is never kept as it is itself.
ESCAPE = "~"


class _ClientIP:
    """Marker: the key is the client's IP, as the integration's resolver finds it."""

    def __repr__(self) -> str:
        return "CLIENT_IP"


#: Use as a key function: ``keys={"ip": CLIENT_IP}`` (the default keys).
CLIENT_IP: Any = _ClientIP()


def key_value(value: object) -> str | None:
    """A key function's result as identifier text: bounded, valid UTF-8, or None to skip.

    One to one: two different values never give the same text, so no client can take another's
    budget by sending cleverly chosen bytes. Text (or bytes that are valid UTF-8, read as that
    text) of at most ``MAX_KEY_CHARS`` characters not starting with ``~`` is kept as it is. Any
    other value starts with ``~``: ``~=`` and its bytes with ``\\`` doubled and undecodable
    bytes written ``\\xNN`` (lone surrogates count as their UTF-8 bytes), or ``~sha256:`` and
    the SHA-256 of its bytes when that would be longer than ``MAX_KEY_CHARS``.
    """
    if value is None:
        return None
    text: str | None
    if isinstance(value, bytes):
        raw = value
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = None
    else:
        text = value if isinstance(value, str) else str(value)
        try:
            raw = text.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates: aiohttp's reading of undecodable bytes
            raw, text = text.encode("utf-8", "surrogatepass"), None
    if not raw:
        return None
    if text is not None and len(text) <= MAX_KEY_CHARS and not text.startswith(ESCAPE):
        return text
    escaped = raw.replace(b"\\", b"\\\\").decode("utf-8", "backslashreplace")
    if len(escaped) + 2 <= MAX_KEY_CHARS:
        return f"{ESCAPE}={escaped}"
    return f"{ESCAPE}sha256:{hashlib.sha256(raw).hexdigest()}"


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


def raw_header_key(name: str, raw_headers: RawHeaders) -> KeyFunc:
    """A key function returning the first ``name`` header's bytes as sent (None when absent).

    Each integration passes its framework's raw header list, so the identifier is made from
    the bytes themselves, never from the framework's decoding of them (Latin-1 in Starlette,
    UTF-8 with lone surrogates in aiohttp): the same bytes give the same identifier under
    both, and ``key_value`` keeps different bytes apart.
    """
    if not isinstance(name, str) or not name or not name.isascii():
        raise ConfigurationError(f"a header name must be non-empty ASCII text, got {name!r}")
    wanted = name.lower().encode("ascii")

    def key(request: Any) -> bytes | None:
        for field, value in raw_headers(request):
            if field.lower() == wanted:
                return value
        return None

    key.__name__ = f"header_key({name!r})"
    return key
