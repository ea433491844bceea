"""How long decisions stall when a primary dies, by cluster-node-timeout.

Starts a local 3 primaries + 3 replicas cluster with the given node timeout, keeps one task
deciding on an identifier owned by one primary (and one on another primary), kill -9s that
primary, and reports how long its decisions failed or stalled until the replica took over,
and whether the other primary's decisions were affected. Afterwards it compares the charges
stored for both identifiers with the decisions admitted (degraded ones aside): more stored
would be a charge made twice; fewer, charges the killed primary acknowledged but had not yet
replicated (Redis replicates asynchronously)::

    python -m bench.failover --node-timeout 1000 --node-timeout 15000 [--no-full-coverage]

With Redis' default ``cluster-require-full-coverage yes`` every primary answers CLUSTERDOWN
from the moment the dead one is marked failed until its replica is promoted, so the other
shards stall too; ``--no-full-coverage`` shows them unaffected.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time

from redis.crc import key_slot

import cluster
from aiolimit import BackendError, Limit, Limiter
from aiolimit._keys import main_key

PREFIX = "failover"
LIMITS = [Limit(10**9, per=3600)]


def identifier_on(nodes: cluster.Cluster, port: int, taken: set[str]) -> str:
    for i in range(100_000):
        identifier = f"user:{i}"
        slot = key_slot(main_key(PREFIX, identifier).encode())
        if nodes.node_for_slot(slot).port == port and identifier not in taken:
            return identifier
    raise AssertionError("no identifier found")


async def measure(node_timeout_ms: int, full_coverage: bool) -> dict[str, float]:
    with cluster.start_cluster(node_timeout_ms=node_timeout_ms) as nodes:
        if not full_coverage:
            for node in nodes.nodes:
                node.execute("CONFIG", "SET", "cluster-require-full-coverage", "no")
        victim, other = nodes.primaries()[:2]
        doomed = identifier_on(nodes, victim.port, set())
        healthy = identifier_on(nodes, other.port, {doomed})
        deadline = max(5.0, node_timeout_ms / 1000 * 2 + 5)
        async with Limiter(nodes.url, LIMITS, prefix=PREFIX, deadline=deadline) as limiter:
            admitted = {doomed: 0, healthy: 0}
            worst = {doomed: 0.0, healthy: 0.0}
            errors = {doomed: 0, healthy: 0}
            killed_at: list[float] = []
            recovered: list[float] = []
            back = asyncio.Event()
            stop = asyncio.Event()

            async def loop(identifier: str) -> None:
                while not stop.is_set():
                    started = time.monotonic()
                    try:
                        decision = await limiter.try_acquire(identifier)
                        # (a degraded answer was decided by the failure policy: not stored)
                        admitted[identifier] += decision.allowed and not decision.degraded
                        # Only a decision started after the kill says the slots are served
                        # again: one sent before it may read a reply already in its socket.
                        late = bool(killed_at) and started >= killed_at[0]
                        if identifier == doomed and late and not recovered:
                            recovered.append(time.monotonic())
                            back.set()
                    except BackendError:
                        errors[identifier] += 1
                    worst[identifier] = max(worst[identifier], time.monotonic() - started)
                    await asyncio.sleep(0.005)

            tasks = [asyncio.ensure_future(loop(i)) for i in (doomed, healthy)]
            await asyncio.sleep(0.5)
            killed_at.append(time.monotonic())
            victim.kill()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(back.wait(), deadline * 3)
            await asyncio.sleep(0.5)
            stop.set()
            await asyncio.gather(*tasks)
            stored = {}
            for identifier in (doomed, healthy):
                decision = await limiter.peek(identifier)  # (remaining now: nothing charged)
                stored[identifier] = LIMITS[0].amount - decision.remaining
        return {
            "node_timeout_ms": node_timeout_ms,
            "full_coverage": full_coverage,
            "stall_s": (recovered[0] - killed_at[0]) if recovered else float("nan"),
            "doomed_errors": errors[doomed],
            "healthy_errors": errors[healthy],
            "healthy_worst_s": worst[healthy],
            "doomed_over_charged": stored[doomed] - admitted[doomed],
            "healthy_over_charged": stored[healthy] - admitted[healthy],
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--node-timeout", type=int, action="append", default=[])
    parser.add_argument(
        "--no-full-coverage",
        action="store_true",
        help="set cluster-require-full-coverage no (other shards keep serving during failover)",
    )
    args = parser.parse_args()
    for timeout in args.node_timeout or [1000]:
        result = asyncio.run(measure(timeout, not args.no_full_coverage))
        coverage = "yes" if result["full_coverage"] else "no"
        print(
            f"cluster-node-timeout {result['node_timeout_ms']} ms, "
            f"cluster-require-full-coverage {coverage}: decisions on the dead "
            f"primary's slots stalled {result['stall_s']:.2f} s "
            f"({result['doomed_errors']} errors); the other primary: worst decision "
            f"{result['healthy_worst_s'] * 1000:.1f} ms, {result['healthy_errors']} errors; "
            f"stored - admitted: {result['doomed_over_charged']} / "
            f"{result['healthy_over_charged']} (above 0: charged twice; below 0: charges the "
            "dead primary acknowledged and never replicated)"
        )


if __name__ == "__main__":
    main()
