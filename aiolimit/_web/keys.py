"""Key functions for the web integrations: what identifies a request, and its weight.

A key function gets the framework's request and returns the key's value; ``CLIENT_IP`` stands
for the client's IP as the integration's resolver finds it. ``key_value`` turns any value into
bounded, valid identifier text, so a huge or undecodable header cannot become a huge or broken
identifier.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeAlias

from aiolimit._errors import ConfigurationError

#: A key function gets the framework's request and returns the key's value (None: no key).
KeyFunc: TypeAlias = "Callable[[Any], str | int | Awaitable[str | int | None] | None]"
WeightFunc: TypeAlias = "Callable[[Any], int | Awaitable[int]]"

MAX_KEY_CHARS = 200


class _ClientIP:
    """Marker: the key is the client's IP, as the integration's resolver finds it."""

    def __repr__(self) -> str:
        return "CLIENT_IP"


#: Use as a key function: ``keys={"ip": CLIENT_IP}`` (the default keys).
CLIENT_IP: Any = _ClientIP()


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


def header_key(name: str) -> KeyFunc:
    """A key function reading one request header (an API key, a user id set by a gateway).

    Works with Starlette and aiohttp requests alike; a missing header means no such key.
    """

    def key(request: Any) -> str | None:
        value: str | None = request.headers.get(name)
        return value

    key.__name__ = f"header_key({name!r})"
    return key
