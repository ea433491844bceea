"""aiolimit demo: many simulated clients, several identifiers and limits, one local Redis.

Starts a throwaway redis-server on a free loopback port (or uses $REDIS_URL; falls back to the
embedded ``memory://`` store, with a notice, when no server binary exists), runs simulated
clients for a few seconds (``--seconds``), then shows per identifier what was admitted and which
limit refused the rest, shows the same limits over HTTP (``web_demo.py``, beside this file),
and ends on a private Redis Cluster whose primary is killed mid-run (``cluster_failover.py``).
Run it with ``bash dev.sh demo``, which puts the repository root on ``sys.path`` for the
``cluster`` tooling; the tests run it too, so it cannot rot.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import sys
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator

from aiolimit import Limit, Limiter

RULES = {
    "ip": [Limit(8, per=1), Limit(30, per=10, precision=1)],
    "user": [Limit(5, per=1), Limit(20, per=10, precision=2)],
}
CLIENTS = [  # (user, ip, requests per second it tries)
    ("user:alice", "ip:203.0.113.7", 4),
    ("user:bob", "ip:203.0.113.7", 6),  # alice and bob share an office IP
    ("user:carol", "ip:198.51.100.23", 9),
    ("user:dave", "ip:192.0.2.99", 2),
    ("user:eve", "ip:192.0.2.200", 25),  # a scraper
]


@contextlib.asynccontextmanager
async def redis_url() -> AsyncIterator[str]:
    if os.environ.get("REDIS_URL"):
        yield os.environ["REDIS_URL"]
        return
    try:
        import cluster  # the repository's server tooling (not part of the installed package)
    except ImportError:
        cluster = None  # type: ignore[assignment]
    if cluster is None or cluster.find_server_binary() is None:
        print("notice: no redis-server found: using the embedded store (memory://)\n")
        yield "memory://"
        return
    server = await asyncio.to_thread(cluster.start_standalone)
    try:
        print(f"started redis-server {server.url} (pid {server.pid})\n")
        yield server.url
    finally:
        await asyncio.to_thread(server.stop)


async def client(
    limiter: Limiter,
    user: str,
    ip: str,
    rate: float,
    seconds: float,
    tally: dict[str, Counter[str]],
) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        decision = await limiter.try_acquire([ip, user])
        for identifier in (ip, user):
            row = tally[identifier]
            row["attempts"] += 1
            if decision.allowed:
                row["admitted"] += 1
                continue
            mine = [p for p in decision.details if p.identifier == identifier and not p.allowed]
            for pair in mine:
                row[f"refused by {pair.limit}"] += 1
            if not mine:
                row["refused by the other identifier"] += 1
        await asyncio.sleep(random.expovariate(rate))


async def main(seconds: float) -> None:
    random.seed(7)
    async with redis_url() as url, Limiter(url, RULES, prefix=f"demo-{os.getpid()}") as limiter:
        print("limits:", {kind: [str(x) for x in limits] for kind, limits in RULES.items()})
        print(f"{len(CLIENTS)} clients for {seconds:g} s; each request names its ip AND user,")
        print("and is admitted only if every limit of both has room (all or nothing).\n")
        tally: dict[str, Counter[str]] = defaultdict(Counter)
        await asyncio.gather(*(client(limiter, u, i, r, seconds, tally) for u, i, r in CLIENTS))
        print(f"{'identifier':<20} {'attempts':>8} {'admitted':>8}  refused by")
        for identifier in sorted(tally):
            row = tally[identifier]
            refused = ", ".join(
                f"{k.removeprefix('refused by ')}: {v}"
                for k, v in sorted(row.items())
                if k.startswith("refused")
            )
            print(f"{identifier:<20} {row['attempts']:>8} {row['admitted']:>8}  {refused or '-'}")
        stats = limiter.statistics()
        print(f"\n{stats.decisions} decisions: {stats.allowed} admitted, {stats.refused} refused.")
        for user in ("user:eve", "ip:192.0.2.200"):
            d = await limiter.peek(user)
            print(f"{user} now: allowed={d.allowed} retry_after={d.retry_after:.2f}s ({d.limit})")
        try:
            from web_demo import run_web_demo
        except ImportError:
            return
        print("\n--- over HTTP ---")
        await run_web_demo(url)
    await cluster_part()


async def cluster_part() -> None:
    """The same library on a Redis Cluster, through a killed primary (cluster_failover.py)."""
    try:
        from cluster_failover import run_cluster_demo

        import cluster
    except ImportError:
        return
    if cluster.find_server_binary() is None:
        return
    print("\n--- Redis Cluster: two slots per decision (check, then commit), a primary killed ---")
    await run_cluster_demo(seconds=3.5)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="aiolimit demo: simulated clients, then HTTP")
    parser.add_argument(
        "--seconds", type=float, default=4.0, help="how long the simulated clients run (4)"
    )
    sys.exit(asyncio.run(main(parser.parse_args().seconds)))
