"""aiolimit's client CPU per decision, two source trees against each other on one server.

    .venv/bin/python -m bench.client_ab --tree /tmp/old --tree . [--shape 2x3] [--rounds 4]
    .venv/bin/python -m bench.client_ab --tree /tmp/old --tree . --shape cross-slot

``script_cost --lua A --lua B`` compares two versions of the scripts on the server; this is the
same for the Python side. Each ``--tree`` is a checkout (``git worktree add /tmp/old <commit>``)
whose ``aiolimit`` package is imported by a child process of its own (``PYTHONPATH=<tree>``),
so two versions never share a process. The trees take turns, round by round, in alternating
order, against one server started here (``--redis-url`` to use another): a standalone
redis-server for ``1x1`` and ``2x3``, a private 3+3 cluster for ``cross-slot`` (2 identifiers
x 3 limits on different primaries: the two-phase path). Each child runs ``--concurrency``
tasks deciding back to back (aiolimit alone, no peers), three measured passes after a warm-up,
and reports its best CPU time per decision (``time.process_time``: the limiter, redis-py and
the event loop) and its best decisions per second. The table shows the best and the median
over the rounds, and the second tree's median over the first's. The machine's noise moves
both trees alike within a round; read the ratio over several rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SHAPES = ("1x1", "2x3", "cross-slot")


async def _child(url: str, shape: str, concurrency: int, count: int) -> dict[str, float]:
    """Runs in the child: one tree's measurement (its ``aiolimit`` is on ``PYTHONPATH``)."""
    from aiolimit import Limit, Limiter

    if shape == "cross-slot":
        from bench.cluster_bench import id_sets, slot_owners

        sets = id_sets("two primaries", concurrency, 4, slot_owners(url))
    else:
        width = 1 if shape == "1x1" else 2
        names = ("ip", "user")[:width]
        sets = [
            [tuple(f"{name}:{task}-{j}" for name in names) for j in range(4)]
            for task in range(concurrency)
        ]
    limits = [Limit(10**6, per=1), Limit(10**7, per=60), Limit(10**8, per=3600)]
    if shape == "1x1":
        limits = limits[:1]
    prefix = f"client-ab-{os.getpid()}"
    async with Limiter(url, {"ip": limits, "user": limits}, prefix=prefix) as limiter:

        async def worker(ids: list[tuple[str, ...]], n: int) -> None:
            for i in range(n):
                await limiter.try_acquire(list(ids[i % len(ids)]))

        await asyncio.gather(*(worker(ids, max(count // 10, 5)) for ids in sets))
        cpu, rate = float("inf"), 0.0
        for _ in range(3):
            started_cpu, started = time.process_time(), time.perf_counter()
            await asyncio.gather(*(worker(ids, count) for ids in sets))
            elapsed = time.perf_counter() - started
            decisions = concurrency * count
            cpu = min(cpu, (time.process_time() - started_cpu) / decisions * 1e6)
            rate = max(rate, decisions / elapsed)
        for identifiers in {ident for ids in sets for pair in ids for ident in pair}:
            await limiter.reset(identifiers)  # (the server is left as it was)
    return {"cpu": cpu, "rate": rate}


def _run_tree(tree: Path, url: str, shape: str, concurrency: int, count: int) -> dict[str, Any]:
    bench_root = Path(__file__).resolve().parent.parent  # (this checkout's bench/ and cluster/)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(bench_root)])}
    # (this file runs in the child, whatever the tree holds: an older one may lack it)
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", url, "--shape", shape]
    argv += ["--concurrency", str(concurrency), "--count", str(count)]
    done = subprocess.run(argv, env=env, cwd=tree, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{tree}: the measurement failed:\n{done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def compare(
    trees: list[Path], url: str, shape: str, rounds: int, concurrency: int, count: int
) -> dict[Path, list[dict[str, Any]]]:
    results: dict[Path, list[dict[str, Any]]] = {tree: [] for tree in trees}
    for round_index in range(rounds):
        order = trees if round_index % 2 == 0 else trees[::-1]
        for tree in order:
            results[tree].append(_run_tree(tree, url, shape, concurrency, count))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.client_ab", description=__doc__)
    parser.add_argument("--tree", action="append", default=[], help="a checkout (give two)")
    parser.add_argument("--shape", choices=SHAPES, default="2x3")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--count", type=int, help="decisions per task and pass")
    parser.add_argument("--redis-url", help="a server (a cluster seed for cross-slot)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    count = args.count or (150 if args.shape == "cross-slot" else 400)
    if args.child:
        # Run as a file, this directory leads sys.path, where bench/bench.py would pass for the
        # bench package: the package is found through PYTHONPATH instead.
        here = Path(__file__).resolve().parent
        sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
        print(json.dumps(asyncio.run(_child(args.child, args.shape, args.concurrency, count))))
        return 0
    trees = [Path(tree).resolve() for tree in args.tree]
    if len(trees) != 2 or not all((tree / "aiolimit").is_dir() for tree in trees):
        parser.error("give --tree twice, each a checkout holding aiolimit/")
    import cluster

    if args.redis_url:
        results = compare(trees, args.redis_url, args.shape, args.rounds, args.concurrency, count)
    else:
        start = cluster.start_cluster if args.shape == "cross-slot" else cluster.start_standalone
        with start() as server:
            results = compare(trees, server.url, args.shape, args.rounds, args.concurrency, count)
    print(f"\naiolimit client CPU per decision, {args.shape}, concurrency {args.concurrency}, "
          f"{args.rounds} rounds (best of 3 passes each)\n")  # fmt: skip
    medians = []
    for tree in trees:
        cpus = [r["cpu"] for r in results[tree]]
        rates = [r["rate"] for r in results[tree]]
        medians.append(statistics.median(cpus))
        print(f"{tree!s:<40} cpu µs/dec best {min(cpus):7.1f} median {medians[-1]:7.1f}   "
              f"dec/s median {statistics.median(rates):9,.0f}")  # fmt: skip
    print(f"\nsecond/first (median cpu): {medians[1] / medians[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
