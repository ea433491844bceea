"""The embedded store (``memory://``): the same Lua scripts, run in-process by Lua 5.1.

Not a mock: ``lua/`` runs unchanged on a small in-memory keyspace (``aiolimit._embedded``) that
implements the Redis commands the scripts use, TTLs included. One script call runs to completion
without awaiting, so under asyncio every decision is atomic, as on Redis.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from aiolimit._calls import decide_script
from aiolimit._clock import Clock, LocalClock
from aiolimit._errors import ConfigurationError
from aiolimit._stores.base import Result, ScriptCall, Store


class MemoryStore(Store):
    """One process's keyspace; give several limiters the same one to share state."""

    address = "memory://"

    def __init__(self) -> None:
        try:
            from aiolimit._embedded.store import EmbeddedStore
        except ImportError as exc:  # lupa missing
            raise ConfigurationError(
                "memory:// needs the 'lupa' package: pip install 'aiolimit[embedded]'"
            ) from exc
        self.engine = EmbeddedStore()
        self._script = decide_script()
        self._sha = self.engine.script_load(self._script.source)

    loop_bound = False

    async def run(self, calls: Sequence[ScriptCall]) -> list[Result]:
        results: list[Result] = [
            self.engine.evalsha(self._sha, call.keys, call.args) for call in calls
        ]
        await asyncio.sleep(0)
        return results

    async def delete(self, keys: Sequence[str]) -> None:
        self.engine.delete(*keys)

    def default_clock(self) -> Clock:
        return LocalClock()

    async def aclose(self) -> None:
        return None
