"""Key naming: every key of one identifier shares a hash tag made from the identifier.

``<prefix>:{<escaped identifier>}`` is the identifier's main key; algorithms that need a
structure of their own append ``:<suffix>`` after the tag. Identifiers are untrusted: ``%``,
``{`` and ``}`` are percent-escaped so the tag is exactly the identifier and two identifiers can
never share a key; an identifier whose escaped form exceeds 256 bytes is replaced by
``%H<sha256>`` (a form escaping can never produce, since a literal ``%`` becomes ``%25``).
"""

from __future__ import annotations

import hashlib
from functools import lru_cache

from aiolimit._errors import ConfigurationError, InvalidRequestError

MAX_TAG_BYTES = 256
_ESCAPES = str.maketrans({"%": "%25", "{": "%7B", "}": "%7D"})


def check_prefix(prefix: object) -> str:
    """A prefix is any non-empty text without hash-tag braces."""
    if not isinstance(prefix, str) or not prefix or "{" in prefix or "}" in prefix:
        raise ConfigurationError(
            f"prefix must be a non-empty str without '{{' or '}}', got {prefix!r}"
        )
    return prefix


@lru_cache(maxsize=65536)
def identifier_tag(identifier: str) -> str:
    """The hash-tag body for an identifier (escaped, bounded in length)."""
    escaped = identifier.translate(_ESCAPES)
    try:
        raw = escaped.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"identifier {identifier!r} is not valid text (lone surrogate); "
            "identifiers must be encodable as UTF-8"
        ) from exc
    if len(raw) > MAX_TAG_BYTES:
        return "%H" + hashlib.sha256(raw).hexdigest()
    return escaped


def main_key(prefix: str, identifier: str) -> str:
    """The HASH holding every counter of ``identifier``."""
    return f"{prefix}:{{{identifier_tag(identifier)}}}"


def aux_key(prefix: str, identifier: str, suffix: str) -> str:
    """A key of ``identifier`` for one algorithm's own structure (same slot as its main key)."""
    return f"{prefix}:{{{identifier_tag(identifier)}}}:{suffix}"


def identifier_kind(identifier: str) -> str:
    """The text before the first ``:`` (the whole identifier if it has none)."""
    return identifier.partition(":")[0]
