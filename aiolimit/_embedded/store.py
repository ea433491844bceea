"""The embedded engine's face: aiolimit's Redis Lua scripts run in-process on an in-memory keyspace.

It is not a mock. Scripts run on real Lua 5.1 (lupa), the version Redis embeds, inside a copy
of Redis 7.0's scripting environment (``sandbox``), over a keyspace that expires keys as Redis
does (``keyspace``) and the commands the scripts call, with Redis' replies, errors and number
rules (``commands``, ``sorted_sets``, ``numbers``). It does what the scripts need, not all of
Redis: scripts are loaded and run by SHA1 (SCRIPT LOAD, EVALSHA), and a few direct helpers let
tools inspect what is stored. The project's tests run the same scripts on a real server to keep
both honest.

Every call runs to completion under a lock, so a script is atomic for asyncio tasks and for
threads alike. As in Redis 7.0, expiry is judged by the time the script started, while TTL
arithmetic (PTTL, PEXPIRE's base) reads the live clock.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from .commands import execute
from .keyspace import CommandError, Keyspace, Status
from .sandbox import Sandbox, ScriptError

__all__ = ["EmbeddedStore", "NoScriptError", "ScriptError"]

Arg = str | bytes | memoryview | int | float


class NoScriptError(ScriptError):
    """EVALSHA of a script this store has not loaded (Redis' NOSCRIPT)."""


def _to_arg(value: object) -> bytes:
    """KEYS/ARGV items as redis-py sends them (str as UTF-8, numbers via repr)."""
    if isinstance(value, bytes | memoryview | bytearray):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, int | float) and not isinstance(value, bool):
        return repr(value).encode()
    raise TypeError(f"Invalid input of type {type(value).__name__!r}: use bytes, str, int or float")


def _plain(reply: Any) -> Any:
    """A command's reply as redis-py returns it (a status is plain bytes)."""
    if isinstance(reply, list):
        return [_plain(item) for item in reply]
    return bytes(reply) if isinstance(reply, Status) else reply


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
        self._scripts: dict[str, Any] = {}  # sha1 -> the compiled Lua function

    def __repr__(self) -> str:
        return f"<EmbeddedStore keys={len(self._keyspace.data)} scripts={len(self._scripts)}>"

    # ------------------------------------------------------------------------- scripts

    def script_load(self, source: str | bytes) -> str:
        """Compile and cache a script; return its SHA1 (the key EVALSHA takes)."""
        with self._lock:
            return self._load(source.encode() if isinstance(source, str) else bytes(source))

    def evalsha(self, sha: str | bytes, keys: Sequence[Arg], args: Sequence[Arg]) -> Any:
        """Run a loaded script; raise NoScriptError if this store has not seen it."""
        name = (sha.decode("latin-1") if isinstance(sha, bytes) else sha).lower()
        with self._lock:
            if name not in self._scripts:
                raise NoScriptError("NOSCRIPT No matching script. Please use EVAL.")
            return self._execute(name, keys, args)

    def eval(self, source: str | bytes, keys: Sequence[Arg], args: Sequence[Arg]) -> Any:
        """Load (if needed) and run a script, like EVAL."""
        with self._lock:
            sha = self._load(source.encode() if isinstance(source, str) else bytes(source))
            return self._execute(sha, keys, args)

    # ------------------------------------------------------------------ direct helpers

    def execute_command(self, *args: Arg) -> Any:
        """Run one command outside any script, with the reply redis-py would return.

        Besides the scripts' commands this answers ZCARD, so tools can count a sorted set's
        members (leases) whether they expired or not; scripts cannot call it.
        """
        command = [_to_arg(arg) for arg in args]
        with self._lock:
            self._keyspace.begin()
            try:
                if command[0].lower() == b"zcard" and len(command) == 2:
                    return len(self._keyspace.get_zset(command[1]).scores)
                return _plain(execute(self._keyspace, command, from_script=False))
            except CommandError as error:
                raise ScriptError(str(error)) from None

    def delete(self, *keys: str | bytes) -> int:
        """DEL: how many of the keys existed."""
        result: int = self.execute_command("DEL", *keys) if keys else 0
        return result

    def pttl(self, key: str | bytes) -> int:
        """PTTL: milliseconds left, -1 without a TTL, -2 for a missing key."""
        result: int = self.execute_command("PTTL", key)
        return result

    def hgetall(self, key: str | bytes) -> dict[bytes, bytes]:
        flat: list[bytes] = self.execute_command("HGETALL", key)
        return dict(zip(flat[::2], flat[1::2], strict=True))

    def keys(self) -> list[bytes]:
        """Every live key (expired ones are purged on the way)."""
        with self._lock:
            self._keyspace.begin()
            return [key for key in list(self._keyspace.data) if self._keyspace.get(key) is not None]

    # ---------------------------------------------------------------------- internals

    def _load(self, source: bytes) -> str:
        sha = hashlib.sha1(source).hexdigest()
        if sha not in self._scripts:
            self._scripts[sha] = self._sandbox.compile(source)
        return sha

    def _execute(self, sha: str, keys: Sequence[Arg], args: Sequence[Arg]) -> Any:
        keys_bytes = [_to_arg(key) for key in keys]
        args_bytes = [_to_arg(arg) for arg in args]
        self._keyspace.begin()
        return self._sandbox.run(self._scripts[sha], keys_bytes, args_bytes, sha)
