"""How much state aiolimit leaves in a Redis Cluster under sustained load.

Run from the repository root::

    .venv/bin/python -m bench.state_soak --seconds 60
    .venv/bin/python -m bench.state_soak --seconds 10 --identifiers 32 --json soak.json
    REDIS_CLUSTER_URL=redis://127.0.0.1:7000 .venv/bin/python -m bench.state_soak

Two parts:

1. **Soak.** ``--concurrency`` tasks make decisions back to back for ``--seconds`` seconds, each
   naming one ``ip:`` and one ``user:`` identifier (drawn from ``--identifiers`` in all) whose
   keys live in different slots, under 3 roomy limits each (10^6/s, 10^7/min, 10^8/hour: every
   decision is admitted and charged, on the two-phase path). Then it reports the keys under
   the run's prefix on every primary (total, per identifier, grouped by the shape of their
   names), and the ``used_memory`` growth summed over the primaries.
2. **One identifier per algorithm.** For each algorithm's 240/hour limit, a fresh identifier
   gets 240 hits of weight 1 (its limit at full use), one at a time; then ``MEMORY USAGE``
   of every key under that identifier's tag, grouped the same way.

The cluster is the ``cluster`` package's private 3+3 one (started and stopped here) unless
``REDIS_CLUSTER_URL`` or ``--redis-cluster-url`` names one; only keys under this run's
prefix (``soak-<hex>``) are written, and they are deleted at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from typing import Any

from redis.cluster import RedisCluster
from redis.crc import key_slot

from aiolimit import (
    Concurrency,
    FixedWindow,
    Limit,
    Limiter,
    MinInterval,
    SlidingLog,
    TokenBucket,
)
from aiolimit._keys import main_key

SOAK_LIMITS = [Limit(10**6, per=1), Limit(10**7, per=60), Limit(10**8, per=3600)]
ALGORITHMS: list[tuple[str, Any]] = [
    ("Limit 240/h (precision 60 s)", Limit(240, per=3600, precision=60)),
    ("Limit 240/h (fixed precision)", Limit(240, per=3600)),
    ("FixedWindow 240/h", FixedWindow(240, per=3600)),
    ("SlidingLog 240/h", SlidingLog(240, per=3600)),
    ("TokenBucket 240/h", TokenBucket(240, per=3600)),
    ("MinInterval 15 s", MinInterval(15)),
    ("Concurrency 240", Concurrency(240, lease_ttl=3600)),
]
_HEX = re.compile(r"[0-9a-f]{16,}")


def shape(key: str, prefix: str) -> str:
    """A key's name with the prefix, the identifier's tag and long hex ids collapsed."""
    rest = key.removeprefix(prefix + ":")
    if rest.startswith("{"):
        rest = "{id}" + rest[rest.index("}") + 1 :]
    return _HEX.sub("*", rest)


def identifiers(count: int) -> tuple[list[str], list[str]]:
    half = max(count // 2, 1)
    return [f"ip:10.0.{i // 256}.{i % 256}" for i in range(half)], [
        f"user:{i}" for i in range(count - half)
    ]


class Primaries:
    """Raw per-primary reads: keys under a prefix, their memory, used_memory."""

    def __init__(self, seed_url: str) -> None:
        self.client = RedisCluster.from_url(seed_url, decode_responses=True)

    def nodes(self) -> list[Any]:
        return list(self.client.get_primaries())

    def used_memory(self) -> int:
        return sum(
            int(self.client.info("memory", target_nodes=node)["used_memory"])
            for node in self.nodes()
        )

    def keys(self, match: str) -> list[str]:
        found: list[str] = []
        for node in self.nodes():
            redis = self.client.get_redis_connection(node)
            found.extend(redis.scan_iter(match=match, count=1000))
        return found

    def memory_usage(self, key: str) -> int:
        return int(self.client.execute_command("MEMORY USAGE", key, "SAMPLES", "0") or 0)

    def delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            self.client.delete(key)

    def close(self) -> None:
        self.client.close()


def _escape_glob(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


async def soak(url: str, prefix: str, seconds: float, count: int, tasks: int) -> dict[str, Any]:
    ips, users = identifiers(count)
    pairs = [
        (ip, user)
        for ip in ips
        for user in users
        if key_slot(main_key(prefix, ip).encode()) != key_slot(main_key(prefix, user).encode())
    ]
    decisions = admitted = errors = 0
    async with Limiter(url, SOAK_LIMITS, prefix=prefix) as limiter:
        await limiter.peek(list(pairs[0]))
        stop = time.monotonic() + seconds

        async def worker(seed: int) -> None:
            nonlocal decisions, admitted, errors
            rng = random.Random(seed)
            while time.monotonic() < stop:
                try:
                    decision = await limiter.try_acquire(list(rng.choice(pairs)))
                except Exception:
                    errors += 1
                    continue
                decisions += 1
                admitted += decision.allowed

        started = time.monotonic()
        await asyncio.gather(*(worker(seed) for seed in range(tasks)))
        elapsed = time.monotonic() - started
    return {
        "decisions": decisions,
        "admitted": admitted,
        "errors": errors,
        "seconds": round(elapsed, 2),
        "decisions_per_second": round(decisions / elapsed),
        "identifiers": len(ips) + len(users),
    }


async def fill_each_algorithm(url: str, prefix: str) -> list[tuple[str, str, int]]:
    """(algorithm, identifier, admitted) after 240 hits on a fresh identifier each."""
    out = []
    for number, (name, limit) in enumerate(ALGORITHMS):
        identifier = f"algo:{number}"
        async with Limiter(url, [limit], prefix=prefix) as limiter:
            admitted = 0
            for _ in range(240):
                admitted += (await limiter.try_acquire(identifier)).allowed
        out.append((name, identifier, admitted))
    return out


def report_keys(primaries: Primaries, prefix: str, keys: list[str]) -> dict[str, Any]:
    shapes: Counter[str] = Counter(shape(key, prefix) for key in keys)
    return {"keys": len(keys), "by_shape": dict(shapes.most_common())}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--identifiers", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--redis-cluster-url", default=os.environ.get("REDIS_CLUSTER_URL"))
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--keep", action="store_true", help="leave the keys in place")
    args = parser.parse_args(argv)

    started_cluster = None
    if args.redis_cluster_url:
        seed_url = args.redis_cluster_url.replace("redis+cluster://", "redis://", 1)
    else:
        import cluster

        started_cluster = cluster.start_cluster()
        seed_url = started_cluster.seed_url
    url = "redis+cluster://" + seed_url.removeprefix("redis://")
    prefix = f"soak-{uuid.uuid4().hex[:8]}"
    primaries = Primaries(seed_url)
    result: dict[str, Any] = {"prefix": prefix, "python": sys.version.split()[0]}
    try:
        memory_before = primaries.used_memory()
        result["soak"] = asyncio.run(
            soak(url, prefix + "-load", args.seconds, args.identifiers, args.concurrency)
        )
        keys = primaries.keys(_escape_glob(prefix + "-load") + ":*")
        result["soak"].update(report_keys(primaries, prefix + "-load", keys))
        result["soak"]["used_memory_delta"] = primaries.used_memory() - memory_before
        ids = result["soak"]["identifiers"]
        result["soak"]["keys_per_identifier"] = round(len(keys) / ids, 1)
        result["soak"]["bytes_per_identifier"] = round(result["soak"]["used_memory_delta"] / ids)

        algo_prefix = prefix + "-algo"
        rows = []
        for name, identifier, admitted in asyncio.run(fill_each_algorithm(url, algo_prefix)):
            tag = main_key(algo_prefix, identifier)
            own = [tag, *primaries.keys(_escape_glob(tag) + ":*")]
            groups: dict[str, list[int]] = {}
            for key in own:
                size = primaries.memory_usage(key)
                if size:
                    entry = groups.setdefault(shape(key, algo_prefix), [0, 0])
                    entry[0] += 1
                    entry[1] += size
            rows.append({"algorithm": name, "admitted": admitted, "keys": groups})
        result["algorithms"] = rows
        if not args.keep:
            primaries.delete(keys)
            primaries.delete(primaries.keys(_escape_glob(algo_prefix) + ":*"))
    finally:
        primaries.close()
        if started_cluster is not None:
            started_cluster.stop()

    s = result["soak"]
    print(
        f"soak: {s['seconds']} s, {s['decisions']} decisions ({s['decisions_per_second']}/s, "
        f"{s['admitted']} admitted, {s['errors']} errors) over {s['identifiers']} identifiers, "
        f"2 ids x 3 limits, two slots each"
    )
    print(f"  keys across primaries: {s['keys']}  ({s['keys_per_identifier']} per identifier)")
    for name, n in s["by_shape"].items():
        print(f"    {n:>9}  {name}")
    print(
        f"  used_memory delta: {s['used_memory_delta'] / 1e6:.2f} MB "
        f"({s['bytes_per_identifier']} bytes per identifier)"
    )
    print("one identifier per algorithm, 240 hits (MEMORY USAGE of its keys):")
    for row in result["algorithms"]:
        total_keys = sum(n for n, _ in row["keys"].values())
        total_bytes = sum(b for _, b in row["keys"].values())
        parts = ", ".join(f"{name}: {n} keys {b} B" for name, (n, b) in row["keys"].items())
        print(
            f"  {row['algorithm']:<32} admitted {row['admitted']:>3}  "
            f"{total_keys:>4} keys {total_bytes:>7} B  ({parts})"
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
