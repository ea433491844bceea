"""Redis Cluster: identifiers on different primaries decided in two phases, and a primary
killed (kill -9) while decisions keep coming.

Starts a private 3-primary + 3-replica cluster (the repository's ``cluster`` tooling, on free
loopback ports, node timeout 1 s), picks two identifiers whose keys live on different
primaries (so each decision is a check on both slots, then a commit on both), and runs
decisions for a few seconds. Half a second in, the primary of one identifier is killed. The
decisions that need it fail fast (per-node breaker) until its replica is promoted; the other
shard is not disturbed; afterwards the stored counts equal what was admitted.

The cluster runs with ``cluster-require-full-coverage no``. With Redis' default (``yes``) every
primary, the healthy ones too, answers CLUSTERDOWN from the moment the dead one is marked failed
until its replica is promoted (0.6-1.4 s here, README "Failover"): longer than this demo's 0.5 s
deadline, so a decision on the other shard would fail as well (about once a run).

Run: ``PYTHONPATH=. python examples/cluster_failover.py`` (``bash dev.sh demo`` runs it too).
"""

from __future__ import annotations

import asyncio
import time
import uuid

from redis.cluster import key_slot

from aiolimit import BackendError, Decision, Limit, Limiter

# A sliding hour in one-minute buckets: every admitted decision is still counted at the end,
# whenever the demo runs (a fixed hourly window would forget them all on the hour).
LIMIT = Limit(100_000, per=3600, precision=60)


def owner_port(nodes: object, identifier: str) -> int:
    # Keys are <prefix>:{<identifier>} (README, "Keys"): the identifier is the hash tag.
    slot = key_slot(identifier.encode())
    return int(nodes.node_for_slot(slot).port)  # type: ignore[attr-defined]


async def settled_peek(limiter: Limiter, identifier: str) -> Decision:
    """A peek once the store answers again: calls that need a dead primary fail fast while its
    node's circuit breaker is open (it probes again after a second), and the failover may end
    just as the demo does."""
    stop = time.monotonic() + 10
    while True:
        try:
            return await limiter.peek(identifier)
        except BackendError:
            if time.monotonic() > stop:
                raise
            await asyncio.sleep(0.1)


async def run_cluster_demo(seconds: float = 4.0) -> dict[str, int]:
    """Runs the demo; returns its counts (for the tests)."""
    import cluster  # the repository's tooling: not part of the installed package

    nodes = await asyncio.to_thread(cluster.start_cluster)
    prefix = f"demo-{uuid.uuid4().hex[:6]}"
    try:
        for node in nodes.nodes:  # the healthy shards keep serving while one fails over (above)
            await asyncio.to_thread(
                node.execute, "CONFIG", "SET", "cluster-require-full-coverage", "no"
            )
        print(f"started a 3+3 cluster: primaries on ports {[n.port for n in nodes.primaries()]}")
        users = [f"user:{n}" for n in range(50)]
        first = users[0]
        second = next(u for u in users if owner_port(nodes, u) != owner_port(nodes, first))
        victim_port = owner_port(nodes, first)
        bystander = next(
            u for u in users if owner_port(nodes, u) not in (victim_port, owner_port(nodes, second))
        )
        print(f"{first} lives on :{victim_port}, {second} on :{owner_port(nodes, second)}")
        counts = {"admitted": 0, "failed": 0, "bystander_admitted": 0, "bystander_failed": 0}
        async with Limiter(nodes.url, [LIMIT], prefix=prefix, deadline=0.5) as limiter:
            victim = next(n for n in nodes.primaries() if n.port == victim_port)
            killed_at = time.monotonic() + 0.5
            killed = False
            stall_start = stall_end = None
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                if not killed and time.monotonic() >= killed_at:
                    victim.kill()  # SIGKILL, by pid
                    killed = True
                    print(f"killed the primary :{victim_port} (pid {victim.pid})")
                try:
                    decision = await limiter.try_acquire([first, second])  # two slots
                    counts["admitted" if decision.allowed else "failed"] += 1
                    if killed and stall_start is not None and stall_end is None:
                        stall_end = time.monotonic()
                except BackendError:
                    counts["failed"] += 1
                    if killed and stall_start is None:
                        stall_start = time.monotonic()
                try:
                    other = await limiter.try_acquire(bystander)
                    counts["bystander_admitted" if other.allowed else "bystander_failed"] += 1
                except BackendError:
                    counts["bystander_failed"] += 1
                await asyncio.sleep(0.005)
            stats = limiter.statistics()
            stored = LIMIT.amount - (await settled_peek(limiter, first)).remaining
            stored_second = LIMIT.amount - (await settled_peek(limiter, second)).remaining
        if stall_start is not None and stall_end is not None:
            print(f"decisions needing :{victim_port} failed for {stall_end - stall_start:.1f} s "
                  "until its replica was promoted")  # fmt: skip
        print(
            f"{first}+{second}: {counts['admitted']} admitted, {counts['failed']} failed; "
            f"{bystander} (another shard): {counts['bystander_admitted']} admitted, "
            f"{counts['bystander_failed']} failed"
        )
        print(
            f"{stats.multi_slot_decisions} decisions spanned two slots (check, then commit), "
            f"{stats.compensations} compensated; stored now: {first} {stored}, "
            f"{second} {stored_second} (admitted {counts['admitted']})"
        )
        counts.update(stored_first=stored, stored_second=stored_second)
        return counts
    finally:
        await asyncio.to_thread(nodes.stop)


if __name__ == "__main__":
    asyncio.run(run_cluster_demo())
