"""Rules kept in Redis: publishing a rules document, and following it from every process.

The document lives under the limiter's prefix, in one hash slot (tag ``{%rules}``, a tag no
identifier can have: identifiers escape ``%``):

- ``<prefix>:{%rules}:doc``: JSON ``{"format": 1, "version": <sha256>, "rules": <the rules
  without their exact overrides>, "override_kinds": [...], "override_count": n}``;
- ``<prefix>:{%rules}:overrides``: a HASH, identifier -> override as JSON. It may hold
  millions: no process loads it; each looks identifiers up when it meets them (``HMGET``,
  one round trip for a call's unknown identifiers of the kinds that have overrides) and keeps
  the answers, found or not, in a bounded LRU cache emptied at every new version;
- ``<prefix>:rules-changed``: the channel a push publishes the new version on.

A push (``publish``) writes the overrides to a staging hash, then one script swaps the
overrides in, sets the document and publishes, atomically (``lua/publish_rules.lua``).

A following limiter (``RulesFollower``) reads the document before its first decision (every
decision waits for that read; see ``Limiter._follow`` for when it cannot be made), then
re-reads it on every notification and every ``interval`` seconds (the fallback when a
notification is lost: a reconnect, a cluster failover). So a push is in force everywhere
within ``interval`` plus one round trip, and usually within a few milliseconds. A document
that does not validate is rejected as a whole (logged, counted) and the rules in force stay;
a deleted document brings back the rules the limiter was made with.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import logging
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiolimit._calls import lua_dir
from aiolimit._errors import BackendError, ConfigurationError
from aiolimit._keys import identifier_kind
from aiolimit._ruleset import Override, RulesError, RuleSet, override_from_json

if TYPE_CHECKING:
    from aiolimit._stores.base import Store

logger = logging.getLogger("aiolimit")

FORMAT = 1
#: Fields per HSET while staging overrides.
STAGE_CHUNK = 1000
#: A staging hash left by a pusher that died expires after this many ms.
STAGE_TTL_MS = 600_000
_MISSING = object()


@dataclass(frozen=True, slots=True)
class RulesKeys:
    doc: str
    overrides: str
    channel: str

    def staging(self) -> str:
        return f"{self.overrides}:staging:{secrets.token_hex(8)}"


def rules_keys(prefix: str) -> RulesKeys:
    base = f"{prefix}:{{%rules}}"
    return RulesKeys(f"{base}:doc", f"{base}:overrides", f"{prefix}:rules-changed")


@dataclass(frozen=True, slots=True)
class Document:
    """A rules document as stored: the rules (exact overrides apart) and their version."""

    rules: RuleSet
    version: str
    override_kinds: frozenset[str]
    override_count: int
    raw: Mapping[str, Any]


def split(ruleset: RuleSet) -> tuple[str, dict[str, str]]:
    """(document JSON, exact overrides as identifier -> JSON) for ``ruleset``."""
    canonical = json.loads(ruleset.document)
    exact: dict[str, str] = {}
    kept: dict[str, Any] = {}
    for identifier, table in canonical["overrides"].items():
        if identifier in ruleset.exact:
            exact[identifier] = json.dumps(table, sort_keys=True, separators=(",", ":"))
        else:
            kept[identifier] = table  # a network: stays in the document
    canonical["overrides"] = kept
    document = {
        "format": FORMAT,
        "version": ruleset.version,
        "rules": canonical,
        "override_kinds": sorted({identifier_kind(i) for i in exact}),
        "override_count": len(exact),
    }
    return json.dumps(document, sort_keys=True, separators=(",", ":")), exact


def parse_document(raw: bytes | str) -> Document:
    """A stored document, validated; ``RulesError`` when it cannot be used."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # (UnicodeDecodeError is a ValueError)
        raise RulesError("document", f"not valid JSON: {exc}") from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise RulesError("document.format", f"must be {FORMAT}")
    version = data.get("version")
    kinds = data.get("override_kinds", [])
    count = data.get("override_count", 0)
    if not isinstance(version, str) or not version:
        raise RulesError("document.version", "missing")
    if not isinstance(kinds, list) or not all(isinstance(k, str) for k in kinds):
        raise RulesError("document.override_kinds", "must be a list of kinds")
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise RulesError("document.override_count", "must be a count")
    rules = RuleSet.from_mapping(data.get("rules"))
    return Document(rules, version, frozenset(kinds), count, data)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def fingerprint(raw: bytes | str) -> str:
    """What ``publish(expect=...)`` takes for a stored document that cannot be parsed (its
    version cannot be trusted): the SHA-1 of its bytes, as the script computes it."""
    data = raw.encode() if isinstance(raw, str) else raw
    return "sha1:" + hashlib.sha1(data, usedforsecurity=False).hexdigest()


async def read_raw_document(store: Store, prefix: str) -> bytes | None:
    raw = await store.command("GET", rules_keys(prefix).doc)
    return raw.encode() if isinstance(raw, str) else raw


async def read_document(store: Store, prefix: str) -> Document | None:
    raw = await store.command("GET", rules_keys(prefix).doc)
    return None if raw is None else parse_document(raw)


async def read_overrides(store: Store, prefix: str) -> dict[str, str]:
    """Every stored override (an operator's command: it reads the whole hash)."""
    key = rules_keys(prefix).overrides
    found: dict[str, str] = {}
    cursor: Any = 0
    while True:
        cursor, page = await store.command("HSCAN", key, cursor, "COUNT", 1000)
        if isinstance(page, dict):
            items = list(page.items())
        else:
            items = list(zip(page[::2], page[1::2], strict=True))
        for field, value in items:
            found[_text(field)] = _text(value)
        if int(cursor) == 0:
            return found


async def publish(store: Store, prefix: str, ruleset: RuleSet, *, expect: str = "*") -> bool:
    """Publishes ``ruleset`` to every following process; False (nothing written) when
    ``expect`` is a version ("" for none, ``fingerprint(raw)`` for a document that could not
    be read) and the stored document is no longer that one."""
    keys = rules_keys(prefix)
    document, exact = split(ruleset)
    staging = keys.staging()
    if exact:
        items = list(exact.items())
        for start in range(0, len(items), STAGE_CHUNK):
            flat = [part for pair in items[start : start + STAGE_CHUNK] for part in pair]
            await store.command("HSET", staging, *flat)
        await store.command("PEXPIRE", staging, STAGE_TTL_MS)
    script = (lua_dir() / "publish_rules.lua").read_text(encoding="utf-8")
    done = await store.command(
        "EVAL", script, 3, keys.doc, keys.overrides, staging,
        document, "1" if exact else "0", keys.channel, ruleset.version, expect,
    )  # fmt: skip
    return bool(int(done))


@dataclass(slots=True)
class FollowerStatistics:
    version: str | None = None
    reloads: int = 0
    rejected: int = 0
    notifications: int = 0
    override_lookups: int = 0
    version_refused: str | None = None


def _retrieve(task: asyncio.Task[None]) -> None:
    """A first read nobody waits for any more: its failure is not an unhandled error."""
    if not task.cancelled():
        task.exception()


class RulesFollower:
    """Keeps a limiter's rules equal to the document in Redis (see the module docstring)."""

    def __init__(
        self,
        store: Store,
        prefix: str,
        apply: Any,
        *,
        interval: float,
        cache_size: int,
        timeout: float,
    ) -> None:
        self.store = store
        self.keys = rules_keys(prefix)
        self._apply = apply  # apply(RuleSet | None): the limiter's set_rules
        self.interval = interval
        self.cache_size = cache_size
        #: Seconds a read of the document may take before it is abandoned.
        self.timeout = timeout
        self.statistics = FollowerStatistics()
        self._override_kinds: frozenset[str] = frozenset()
        self._cache: collections.OrderedDict[str, Override | None] = collections.OrderedDict()
        self._epoch = 0
        self._lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self._first: asyncio.Task[None] | None = None
        #: The document was read once: decisions may go on under the rules in force.
        self._ready = False

    # -- the rules ----------------------------------------------------------------------

    def start(self) -> None:
        """Starts the listener and the poll (once)."""
        if not self._tasks:
            self._tasks = [
                asyncio.create_task(self._listen(), name="aiolimit-rules-listen"),
                asyncio.create_task(self._poll(), name="aiolimit-rules-poll"),
            ]

    async def first_read(self, budget: float) -> None:
        """Starts following (once), and waits at most ``budget`` seconds for the first read
        of the document to succeed. Every caller waits for the same read: no decision is
        made under rules that were not read. ``BackendError`` or ``TimeoutError`` when it
        does not come in time; the next caller waits for it again (a new read if that one
        failed)."""
        self.start()
        task = self._first
        if task is None or task.done():
            task = self._first = asyncio.create_task(
                self.refresh(), name="aiolimit-rules-first-read"
            )
            task.add_done_callback(_retrieve)
        async with asyncio.timeout(budget):
            await asyncio.shield(task)

    async def refresh(self) -> None:
        """Reads the document and applies it; abandoned after ``timeout`` seconds (a
        connection that stopped answering must not hold the lock, and so every later read,
        for good)."""
        async with asyncio.timeout(self.timeout):
            async with self._lock:
                await self._refresh_locked()

    async def _refresh_locked(self) -> None:
        stats = self.statistics
        raw = await self.store.command("GET", self.keys.doc)
        self._ready = True  # read: the document, or none, or an invalid one (rejected)
        if raw is None:
            if stats.version is not None:
                self._install(None, None, frozenset())
                logger.warning("aiolimit rules: the document in Redis is gone; back to the "
                               "limiter's own rules")  # fmt: skip
            return
        try:
            document = parse_document(raw)
        except (RulesError, ConfigurationError) as exc:
            stats.rejected += 1
            logger.error(
                "aiolimit rules: rejected an invalid rules document (the rules in force stay): "
                "%s", exc, extra={"aiolimit_event": "rules_rejected"},
            )  # fmt: skip
            return
        if document.version in (stats.version, stats.version_refused):
            return
        try:
            self._install(document.rules, document.version, document.override_kinds)
        except ConfigurationError as exc:  # e.g. a kind a route declared with other limits
            stats.rejected += 1
            stats.version_refused = document.version
            logger.error("aiolimit rules: cannot apply version %s (the rules in force stay): "
                         "%s", document.version[:12], exc,
                         extra={"aiolimit_event": "rules_rejected"})  # fmt: skip
            return
        logger.info(
            "aiolimit rules: version %s in force (%d kinds, %d overrides in Redis)",
            document.version[:12], len(document.rules.kinds), document.override_count,
            extra={"aiolimit_event": "rules_reloaded"},
        )  # fmt: skip

    def _install(
        self, rules: RuleSet | None, version: str | None, override_kinds: frozenset[str]
    ) -> None:
        self._apply(rules)  # first: rules it cannot apply change nothing here
        self._epoch += 1
        self._cache.clear()
        self._override_kinds = override_kinds
        self.statistics.version = version
        self.statistics.reloads += 1

    async def _listen(self) -> None:
        while True:
            try:
                async for _ in self.store.subscribe(self.keys.channel):
                    self.statistics.notifications += 1
                    try:
                        await self.refresh()
                    except (BackendError, TimeoutError) as exc:  # the poll reads again
                        logger.debug("aiolimit rules: a re-read failed: %s", exc or "timeout")
            except BackendError as exc:
                logger.debug("aiolimit rules: subscription lost (%s); polling meanwhile", exc)
            except Exception:  # never let following die; polling goes on
                logger.exception("aiolimit rules: the subscription failed")
            await asyncio.sleep(self.interval)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.refresh()
            except TimeoutError:
                logger.debug("aiolimit rules: poll timed out")
            except BackendError as exc:
                logger.debug("aiolimit rules: poll failed: %s", exc)
            except Exception:
                logger.exception("aiolimit rules: the poll failed")

    # -- overrides on demand -------------------------------------------------------------

    def cached(self, identifier: str) -> Override | None:
        found = self._cache.get(identifier)
        return found if isinstance(found, Override) else None

    @property
    def ready(self) -> bool:
        """True once the document was read (the first decision waits for it)."""
        return self._ready

    def missing(self, ids: Iterable[str]) -> list[str]:
        """The call's identifiers of kinds with overrides that are not cached (the cached
        ones are marked as recently used)."""
        kinds = self._override_kinds
        if not kinds:
            return []
        cache = self._cache
        wanted = []
        for identifier in ids:
            if identifier in cache:
                cache.move_to_end(identifier)
            elif identifier_kind(identifier) in kinds and identifier not in wanted:
                wanted.append(identifier)
        return wanted

    async def fetch(self, wanted: list[str], keep: int = 0) -> None:
        """Looks ``wanted`` up in the overrides hash (one HMGET) and caches the answers.

        The cache keeps at least ``keep`` entries (the calling decision's identifiers, the
        most recently used): one call with more identifiers than ``cache_size`` must not
        evict its own overrides before its plans are built."""
        cache = self._cache
        epoch = self._epoch
        values = await self.store.command("HMGET", self.keys.overrides, *wanted)
        self.statistics.override_lookups += 1
        if epoch != self._epoch:
            return  # a new version came meanwhile; these answers may be stale
        for identifier, value in zip(wanted, values, strict=True):
            override = None
            if value is not None:
                try:
                    override = override_from_json(value)
                except (RulesError, ValueError) as exc:
                    logger.error("aiolimit rules: ignoring an invalid override for %r: %s",
                                 identifier, exc)  # fmt: skip
            cache[identifier] = override
        while len(cache) > max(self.cache_size, keep):
            cache.popitem(last=False)

    async def aclose(self) -> None:
        tasks, self._tasks = self._tasks, []
        if self._first is not None and not self._first.done():
            tasks.append(self._first)
        for task in tasks:
            task.cancel()
        if tasks:
            # Their cleanup is bounded (a frozen server must not hold up the close).
            await asyncio.wait(tasks, timeout=2.0)
