"""The embedded backend: aiolimit's Redis Lua scripts run in-process on an in-memory keyspace.

It is not a mock. Scripts run on real Lua 5.1 (lupa), the version Redis embeds, inside a copy
of Redis 7.0's scripting environment (``sandbox``), over a keyspace that expires keys
as Redis does (``keyspace``) and commands that keep Redis' replies, errors and number
rules (``commands``, ``sorted_sets``, ``numbers``);
``replies`` converts replies across the Lua boundary. This module is the store's
face: EVAL/EVALSHA over a script cache, plus a few direct commands for tests and tools.
``tests/test_embedded_store.py`` runs the same scripts on a real server to keep both honest.

Every call runs to completion under a lock, so a script is atomic for asyncio tasks and for
threads alike. As in Redis 7.0, expiry is judged by the time the script started, while TTL
arithmetic (PTTL, PEXPIRE's base) reads the live clock.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .commands import execute
from .keyspace import Keyspace
from .replies import (
    CommandError,
    ScriptError,
    parse_reply,
    plain,
    text,
    to_arg,
)
from .sandbox import Sandbox

__all__ = ["EmbeddedStore", "NoScriptError", "ScriptError"]

_SHEBANG_FLAGS = {
    b"no-writes",
    b"allow-oom",
    b"allow-stale",
    b"no-cluster",
    b"allow-cross-slot-keys",
}
Arg = str | bytes | memoryview | int | float


class NoScriptError(ScriptError):
    """EVALSHA of a script this store has not loaded (Redis' NOSCRIPT)."""


@dataclass(frozen=True)
class _Script:
    sha: str
    function: Any
    read_only: bool


class EmbeddedStore:
    """An in-process Redis for aiolimit's scripts: EVALSHA semantics over a Python keyspace."""

    def __init__(
        self,
        *,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._lock = threading.Lock()
        self._keyspace = Keyspace(monotonic, wall)
        self._sandbox = Sandbox(self._keyspace)
        self._scripts: dict[str, _Script] = {}

    # ------------------------------------------------------------------------- scripts

    def script_load(self, source: str | bytes) -> str:
        """Compile and cache a script; return its SHA1 (the key EVALSHA takes)."""
        with self._lock:
            return self._load(source.encode() if isinstance(source, str) else bytes(source))

    def evalsha(self, sha: str | bytes, keys: Sequence[Arg], args: Sequence[Arg]) -> Any:
        """Run a loaded script; raise NoScriptError if this store has not seen it."""
        name = (sha.decode("latin-1") if isinstance(sha, bytes) else sha).lower()
        with self._lock:
            script = self._scripts.get(name)
            if script is None:
                raise NoScriptError("NOSCRIPT No matching script. Please use EVAL.")
            return self._execute(script, keys, args)

    def eval(self, source: str | bytes, keys: Sequence[Arg], args: Sequence[Arg]) -> Any:
        """Load (if needed) and run a script, like EVAL."""
        with self._lock:
            sha = self._load(source.encode() if isinstance(source, str) else bytes(source))
            return self._execute(self._scripts[sha], keys, args)

    def script_exists(self, *shas: str) -> list[bool]:
        with self._lock:
            return [sha.lower() in self._scripts for sha in shas]

    def script_flush(self) -> None:
        with self._lock:
            self._scripts.clear()

    # ------------------------------------------------------------------ direct helpers

    def execute_command(self, *args: Arg) -> Any:
        """Run one command outside any script, with the reply redis-py would return."""
        with self._lock:
            self._keyspace.begin()
            try:
                reply = execute(self._keyspace, [to_arg(arg) for arg in args], from_script=False)
            except CommandError as error:
                raise ScriptError(str(error)) from None
            return plain(reply)

    def delete(self, *keys: str | bytes) -> int:
        result: int = self.execute_command("DEL", *keys) if keys else 0
        return result

    def exists(self, key: str | bytes) -> bool:
        return bool(self.execute_command("EXISTS", key))

    def pttl(self, key: str | bytes) -> int:
        result: int = self.execute_command("PTTL", key)
        return result

    def type(self, key: str | bytes) -> str:
        result: bytes = self.execute_command("TYPE", key)
        return result.decode()

    def hgetall(self, key: str | bytes) -> dict[bytes, bytes]:
        flat: list[bytes] = self.execute_command("HGETALL", key)
        return dict(zip(flat[::2], flat[1::2], strict=True))

    def keys(self) -> list[bytes]:
        """Every live key (expired ones are purged on the way)."""
        with self._lock:
            self._keyspace.begin()
            return [key for key in list(self._keyspace.data) if self._keyspace.get(key) is not None]

    def flushall(self) -> None:
        with self._lock:
            self._keyspace.clear()

    # ---------------------------------------------------------------------- internals

    def _load(self, source: bytes) -> str:
        sha = hashlib.sha1(source).hexdigest()
        if sha not in self._scripts:
            body, read_only = _split_shebang(source)
            function, error = self._sandbox.compile(body)
            if function is None:
                message = text(error).replace("\r", " ").replace("\n", " ")
                raise ScriptError(f"ERR Error compiling script (new function): {message}")
            self._scripts[sha] = _Script(sha, function, read_only)
        return sha

    def _execute(self, script: _Script, keys: Sequence[Arg], args: Sequence[Arg]) -> Any:
        keys_bytes = [to_arg(key) for key in keys]
        args_bytes = [to_arg(arg) for arg in args]
        self._keyspace.begin()
        ok, payload = self._sandbox.run(
            script.function, keys_bytes, args_bytes, script.sha, read_only=script.read_only
        )
        if not ok:
            raise ScriptError(payload.decode("utf-8", "replace"))
        reply, _ = parse_reply(payload)
        if isinstance(reply, ScriptError):
            raise reply
        return reply


def _split_shebang(source: bytes) -> tuple[bytes, bool]:
    """Redis 7's "#!lua flags=..." line: validate it, blank it (keeping line numbers)."""
    if not source.startswith(b"#!"):
        return source, False
    line, newline, rest = source.partition(b"\n")
    if not newline:
        raise ScriptError("ERR Invalid script shebang")
    parts = line.split()
    if parts[0] != b"#!lua":
        raise ScriptError(f"ERR Unexpected engine in script shebang: {text(parts[0])}")
    flags: set[bytes] = set()
    for part in parts[1:]:
        if not part.startswith(b"flags="):
            raise ScriptError(f"ERR Unknown lua shebang option: {text(part)}")
        for flag in filter(None, part[6:].split(b",")):
            if flag not in _SHEBANG_FLAGS:
                raise ScriptError(f"ERR Unexpected flag in script shebang: {text(flag)}")
            flags.add(flag)
    return b"\n" + rest, b"no-writes" in flags
