"""Rules as data at scale: a push of many overrides, and what following costs a decision.

    .venv/bin/python -m bench.rules_scale [--overrides 1000000] [--decisions 2000]

Against a redis-server started here (repository tooling, loopback): builds a RuleSet with
``--overrides`` identifier overrides, pushes it, and reports the push time and Redis memory,
a following limiter's first decision (document read and one override look-up), and one task's
sequential decisions: on identifiers whose overrides are cached, on identifiers looked up one
by one, and on a limiter without rules data. Bounded by the counts given.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import redis.asyncio as redis_asyncio

import cluster
from aiolimit import Limiter, RuleSet


async def measure(overrides: int, decisions: int) -> dict[str, float]:
    server = cluster.start_standalone()
    with server:
        started = time.perf_counter()
        table = {f"user:{n}": {"scale": 2} for n in range(overrides)}
        rules = RuleSet.from_mapping({"kinds": {"user": "100000/minute"}, "overrides": table})
        parsed = time.perf_counter() - started
        raw = redis_asyncio.Redis.from_url(server.url)
        try:
            before = (await raw.info("memory"))["used_memory"]
            async with Limiter(server.url, {"user": "1/second"}) as pusher:
                started = time.perf_counter()
                assert await pusher.push_rules(rules)
                pushed = time.perf_counter() - started
            grown = (await raw.info("memory"))["used_memory"] - before
        finally:
            await raw.aclose()
        out = {"parse_s": parsed, "push_s": pushed, "redis_mb": grown / 1e6}
        async with Limiter(server.url, {"user": "1/second"}, follow_rules=True) as follower:
            started = time.perf_counter()
            first = await follower.peek(f"user:{overrides - 1}")
            out["first_decision_ms"] = (time.perf_counter() - started) * 1000
            assert first.details[0].limit.amount == 200_000  # the override applies
            hot = min(200, overrides)
            for n in range(hot):
                await follower.try_acquire(f"user:{n}")
            started = time.perf_counter()
            for n in range(decisions):
                await follower.try_acquire(f"user:{n % hot}")
            out["cached_us"] = (time.perf_counter() - started) / decisions * 1e6
            started = time.perf_counter()
            for n in range(decisions):
                await follower.try_acquire(f"user:{(hot + n) % overrides}")
            out["lookup_us"] = (time.perf_counter() - started) / decisions * 1e6
        async with Limiter(server.url, {"user": "100000/minute"}) as plain:
            for n in range(hot):
                await plain.try_acquire(f"user:{n}")
            started = time.perf_counter()
            for n in range(decisions):
                await plain.try_acquire(f"user:{n % hot}")
            out["plain_us"] = (time.perf_counter() - started) / decisions * 1e6
        return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.rules_scale", description=__doc__)
    parser.add_argument("--overrides", type=int, default=1_000_000)
    parser.add_argument("--decisions", type=int, default=2000)
    args = parser.parse_args(argv)
    out = asyncio.run(measure(args.overrides, args.decisions))
    print(
        f"{args.overrides:,} overrides: parse {out['parse_s']:.1f} s, "
        f"push {out['push_s']:.1f} s, Redis +{out['redis_mb']:.0f} MB"
    )
    print(f"a following limiter's first decision: {out['first_decision_ms']:.1f} ms")
    print(
        f"one task, per decision: {out['cached_us']:.0f} µs (cached overrides), "
        f"{out['lookup_us']:.0f} µs (a look-up each), {out['plain_us']:.0f} µs (no rules data)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
