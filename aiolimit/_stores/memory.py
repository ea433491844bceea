"""The embedded store (``memory://``): the same Lua scripts, run in-process by Lua 5.1.

Not a mock: ``lua/`` runs unchanged on a small in-memory keyspace (``aiolimit._embedded``) that
implements the Redis commands the scripts use, TTLs included. One script call runs to completion
without awaiting, so under asyncio every decision is atomic, as on Redis.

The engine's errors are translated here, and only here, into ``BackendError`` (the engine's
error as ``__cause__``), as a Redis store translates Redis' errors, so the limiter's failure
policy (``on_error``) applies on ``memory://`` exactly as on Redis.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from aiolimit._calls import decide_script
from aiolimit._clock import Clock, LocalClock
from aiolimit._errors import BackendError, ConfigurationError
from aiolimit._stores.base import Reply, Result, ScriptCall, Store


class MemoryStore(Store):
    """One process's keyspace; give several limiters the same one to share state."""

    address = "memory://"
    loop_bound = False

    def __init__(self) -> None:
        try:
            from aiolimit._embedded.store import EmbeddedStore, ScriptError
        except ImportError as exc:  # lupa missing
            raise ConfigurationError(
                "memory:// needs the 'lupa' package: pip install 'aiolimit[embedded]'"
            ) from exc
        self.engine = EmbeddedStore()
        self._engine_error = ScriptError
        self._script = decide_script()
        self._sha = self.engine.script_load(self._script.source)

    @contextmanager
    def _translate_errors(self) -> Iterator[None]:
        """The engine's ScriptError (a command's or the script's error) -> BackendError."""
        try:
            yield
        except self._engine_error as exc:
            raise BackendError(f"store at {self.address} failed: {exc}") from exc

    async def run(self, calls: Sequence[ScriptCall]) -> list[Result]:
        # Yield first, then run every call without awaiting: a caller cancelled at this
        # await has run nothing, and one that gets past it has its replies (nothing can be
        # charged for a caller that is gone).
        await asyncio.sleep(0)
        results: list[Result] = []
        for call in calls:
            try:
                with self._translate_errors():
                    reply: Reply = self.engine.evalsha(self._sha, call.keys, call.args)
            except BackendError as error:
                results.append(error)
            else:
                results.append(reply)
        return results

    async def delete(self, keys: Sequence[str]) -> None:
        with self._translate_errors():
            self.engine.delete(*keys)

    def default_clock(self) -> Clock:
        return LocalClock()

    async def aclose(self) -> None:
        return None
