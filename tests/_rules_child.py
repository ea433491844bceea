"""A limiter process following the rules in Redis, for tests/test_rules_follow.py.

``python -m tests._rules_child URL PREFIX INTERVAL``: prints ``ready`` once following, then a
JSON line ``{"version": ..., "at": <time.time()>, "allowed": ...}`` whenever the version in
force changes, until stdin closes (or 60 s pass).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from aiolimit import Limiter


async def main(url: str, prefix: str, interval: float) -> None:
    async with Limiter(
        url, {"user": "1000/hour"}, prefix=prefix, follow_rules=True, rules_interval=interval
    ) as limiter:
        await limiter.peek("user:probe")
        print("ready", flush=True)
        loop = asyncio.get_running_loop()
        closed = loop.run_in_executor(None, sys.stdin.read)
        seen = limiter.statistics().rules_version
        deadline = time.monotonic() + 60
        while not closed.done() and time.monotonic() < deadline:
            version = limiter.statistics().rules_version
            if version != seen:
                seen = version
                allowed = (await limiter.peek("user:probe")).allowed
                print(json.dumps({"version": version, "at": time.time(), "allowed": allowed}),
                      flush=True)  # fmt: skip
            await asyncio.sleep(0.002)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3])))
