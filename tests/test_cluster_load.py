"""Invariants under load and faults on a real local Redis Cluster.

Every request names 2-3 hot identifiers whose keys live in different slots (on different
primaries), under several limits, so every decision takes the two-phase path. The limits'
windows are minutes to a day long, so each window covers the whole run: the weight admitted
for an identifier over the run can never exceed its smallest limit, and the weight stored in
each (identifier, limit) counter must equal exactly the weight admitted (nothing lost, nothing
charged twice, every compensation complete).

Faults are real: kill -9 of a primary by pid, live resharding in small batches (ASK and
TRYAGAIN), SCRIPT FLUSH on every primary. The tests assert invariants, never timings.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from _workers import bucket_counts
from redis.cluster import RedisCluster as SyncRedisCluster
from redis.crc import key_slot

import cluster
from aiolimit import BackendError, BackendUnavailable, Limit, Limiter
from aiolimit._keys import main_key
from aiolimit._stores.cluster import ClusterStore

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

LIMITS: dict[str, list[Limit]] = {
    "user": [
        Limit(60, per=600, precision=10),
        Limit(90, per=3600, precision=60),
        Limit(150, per=86400, precision=3600),
    ],
    "ip": [Limit(80, per=900, precision=15), Limit(120, per=7200, precision=120)],
}
ROOMY = [Limit(1_000_000, per=3600, precision=60), Limit(2_000_000, per=86400, precision=3600)]


def wire(limit: Limit) -> str:
    return f"{round(limit.per * 1e6)}/{round((limit.precision or limit.per) * 1e6)}:"


def hot_identifiers(nodes: cluster.Cluster, prefix: str, kinds: dict[str, int]) -> list[str]:
    """Identifiers of each kind, all in different slots, spread round-robin over primaries."""
    ports = sorted(node.port for node in nodes.primaries())
    chosen: list[str] = []
    slots: set[int] = set()
    for kind, count in kinds.items():
        for i in range(10_000):
            if count == 0:
                break
            ident = f"{kind}:{i}"
            slot = key_slot(main_key(prefix, ident).encode())
            want = ports[len(chosen) % len(ports)]
            if slot not in slots and nodes.node_for_slot(slot).port == want:
                chosen.append(ident)
                slots.add(slot)
                count -= 1
    return chosen


def pick(rng: random.Random, hot: Sequence[str]) -> tuple[list[str], int]:
    """A request: one user, one ip, sometimes a second user; weight 1-3."""
    users = [ident for ident in hot if ident.startswith("user:")]
    ips = [ident for ident in hot if ident.startswith("ip:")]
    ids = [rng.choice(users), rng.choice(ips)]
    if rng.random() < 0.5:
        ids.append(rng.choice([u for u in users if u != ids[0]]))
    return ids, rng.randint(1, 3)


@dataclass
class Tally:
    """What one load run saw."""

    admitted: Counter[str] = field(default_factory=Counter)
    refused: list[tuple[list[str], int]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    slowest_error: float = 0.0
    decisions: int = 0
    admitted_after: int = 0  # admissions after the fault was over

    def merge(self, other: dict[str, Any]) -> None:
        self.admitted.update(other["admitted"])
        self.refused += [(ids, weight) for ids, weight in other["refused"]]
        self.errors += other["errors"]
        self.decisions += other["decisions"]


async def hammer(
    limiter: Limiter,
    hot: Sequence[str],
    *,
    tasks: int,
    seed: int,
    per_task: int | None = None,
    until: anyio.Event | None = None,
    fault_over: list[bool] | None = None,
) -> Tally:
    """``tasks`` concurrent clients sending requests, ``per_task`` each or until ``until``."""
    tally = Tally()

    async def client(number: int) -> None:
        rng = random.Random(seed * 1000 + number)
        sent = 0
        while (per_task is None or sent < per_task) and not (until and until.is_set()):
            sent += 1
            ids, weight = pick(rng, hot)
            started = time.monotonic()
            try:
                decision = await limiter.try_acquire(ids, weight)
            except BackendError as exc:
                tally.errors.append(repr(exc))
                tally.slowest_error = max(tally.slowest_error, time.monotonic() - started)
                continue
            tally.decisions += 1
            if decision.allowed:
                for ident in ids:
                    tally.admitted[ident] += weight
                if fault_over and fault_over[0]:
                    tally.admitted_after += 1
            else:
                tally.refused.append((ids, weight))
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as group:
        for number in range(tasks):
            group.start_soon(client, number)
    return tally


def stored(seed_url: str, prefix: str, hot: Sequence[str], limits: dict[str, list[Limit]]) -> dict:
    """(identifier, limit) -> weight stored in that limit's buckets."""
    client = SyncRedisCluster.from_url(seed_url, decode_responses=True)
    try:
        result = {}
        for ident in hot:
            fields = bucket_counts(client.hgetall(main_key(prefix, ident)))
            for limit in limits[ident.split(":")[0]]:
                tail = wire(limit)
                result[(ident, str(limit))] = sum(
                    weight for name, weight in fields.items() if name[1:].startswith(tail)
                )
        return result
    finally:
        client.close()


def check_exact(
    charges: dict, tally: Tally, hot: Sequence[str], limits: dict[str, list[Limit]]
) -> None:
    """Stored == admitted on every pair; admitted never above the smallest limit."""
    for ident in hot:
        kind_limits = limits[ident.split(":")[0]]
        assert tally.admitted[ident] <= min(limit.amount for limit in kind_limits), ident
        for limit in kind_limits:
            assert charges[(ident, str(limit))] == tally.admitted[ident], (ident, str(limit))


# --- 4 processes x 64 tasks ------------------------------------------------------------------


def worker_main() -> None:
    """Entry point of one load process: 64 tasks, then a JSON tally on stdout."""
    url, prefix, seed, per_task = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    hot = json.loads(sys.argv[5])

    async def main() -> None:
        async with Limiter(url, LIMITS, prefix=prefix, deadline=5.0) as limiter:
            await limiter.peek(hot[:2])  # connect and learn the topology before the start
            print("ready", flush=True)
            await anyio.to_thread.run_sync(sys.stdin.readline)
            tally = await hammer(limiter, hot, tasks=64, seed=seed, per_task=per_task)
            stats = limiter.statistics()
            protocol = limiter._protocol.statistics
            store = limiter.store
            assert isinstance(store, ClusterStore)
            out = {
                "admitted": dict(tally.admitted),
                "refused": tally.refused,
                "errors": tally.errors,
                "decisions": tally.decisions,
                "multi_slot": stats.multi_slot_decisions,
                "compensations": stats.compensations,
                "refused_at_check": protocol.refused_at_check,
                "compensation_errors": protocol.compensation_errors,
                "retries": store.statistics().retries,
            }
            print(json.dumps(out), flush=True)

    anyio.run(main)


def test_four_processes_never_over_admit_and_store_exactly_what_they_admit(
    local_cluster: cluster.Cluster, redis_cluster_url: str, prefix: str
) -> None:
    """4 processes x 64 tasks on hot identifiers across primaries, several limits each: no
    pair admits above its limit and every stored counter equals the admitted weight."""
    hot = hot_identifiers(local_cluster, prefix, {"user": 4, "ip": 2})
    code = "import sys; sys.path.insert(0, sys.argv.pop(1)); import test_cluster_load as t; "
    code += "t.worker_main()"
    here = str(Path(__file__).parent)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                code,
                here,
                redis_cluster_url,
                prefix,
                str(seed),
                "12",
                json.dumps(hot),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONWARNINGS": "error"},
        )
        for seed in range(4)
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        started = time.monotonic()
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        outputs = [json.loads(proc.communicate(timeout=90)[0]) for proc in procs]
        elapsed = time.monotonic() - started
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert all(proc.returncode == 0 for proc in procs)
    assert elapsed < 60  # every window (10 min and longer) covers the whole run
    tally = Tally()
    for output in outputs:
        tally.merge(output)
    assert tally.errors == []
    assert tally.decisions == 4 * 64 * 12
    charges = stored(local_cluster.seed_url, prefix, hot, LIMITS)
    check_exact(charges, tally, hot, LIMITS)

    # Spurious refusals: refused requests that the final state would still admit; only a
    # transient state (another decision's charges, later compensated) can have refused them.
    room = {
        ident: min(limit.amount for limit in LIMITS[ident.split(":")[0]]) - tally.admitted[ident]
        for ident in hot
    }
    spurious = sum(1 for ids, weight in tally.refused if all(room[i] >= weight for i in ids))
    totals = {
        key: sum(output[key] for output in outputs)
        for key in ("multi_slot", "compensations", "refused_at_check", "compensation_errors")
    }
    assert totals["compensation_errors"] == 0
    assert totals["multi_slot"] == tally.decisions + len(procs)  # each also made one peek
    print(
        f"\n[cluster concurrency] decisions={tally.decisions} "
        f"admitted={tally.decisions - len(tally.refused)} refused={len(tally.refused)} "
        f"refused_at_check={totals['refused_at_check']} "
        f"compensations={totals['compensations']} spurious_refusals<={spurious} "
        f"elapsed={elapsed:.2f}s"
    )


# --- faults under load -----------------------------------------------------------------------


async def run_with_fault(
    limiter: Limiter, hot: Sequence[str], fault: Callable[[], None], *, after: float = 0.6
) -> Tally:
    """Load from 32 tasks; ``fault`` runs in a thread once load flows; load goes on for
    ``after`` seconds once the fault is over."""
    stop = anyio.Event()
    fault_over = [False]
    result: list[Tally] = []

    async def load() -> None:
        result.append(
            await hammer(limiter, hot, tasks=32, seed=7, until=stop, fault_over=fault_over)
        )

    async with anyio.create_task_group() as group:
        group.start_soon(load)
        await anyio.sleep(0.3)  # let load flow before the fault
        await anyio.to_thread.run_sync(fault)
        fault_over[0] = True
        await anyio.sleep(after)
        stop.set()
    return result[0]


async def test_failover_mid_load_resumes_without_double_charge(
    fresh_cluster: cluster.Cluster, prefix: str
) -> None:
    """kill -9 of a primary mid-load: decisions resume after promotion, errors (if any) are
    BackendUnavailable within the deadline, and no counter holds more than was admitted."""
    nodes = fresh_cluster
    hot = hot_identifiers(nodes, prefix, {"user": 3, "ip": 3})
    victim = nodes.node_for_slot(key_slot(main_key(prefix, hot[0]).encode()))
    limits = {"user": ROOMY, "ip": ROOMY}
    deadline = 5.0

    def fault() -> None:
        victim.kill()
        nodes.wait_for_failover(victim, timeout=15)

    async with Limiter(nodes.url, limits, prefix=prefix, deadline=deadline) as limiter:
        tally = await run_with_fault(limiter, hot, fault, after=1.0)
        protocol = limiter._protocol.statistics
        store = limiter.store
        assert isinstance(store, ClusterStore)
        retries = store.statistics().retries
    assert all("BackendUnavailable" in error for error in tally.errors)
    assert tally.slowest_error <= deadline + 0.5
    assert tally.admitted_after > 0  # decisions resumed after the promotion
    assert protocol.compensation_errors == 0
    live = nodes.primaries()[0]  # the seed may be the dead primary
    charges = stored(f"redis://{live.host}:{live.port}", prefix, hot, limits)
    lost = 0
    for ident in hot:
        for limit in ROOMY:
            # Never more than admitted: no op was applied twice. Less is possible: writes the
            # dead primary acknowledged but had not yet replicated are gone with it.
            assert charges[(ident, str(limit))] <= tally.admitted[ident]
            lost += tally.admitted[ident] - charges[(ident, str(limit))]
    print(
        f"\n[failover] decisions={tally.decisions} errors={len(tally.errors)} "
        f"retries={retries} admitted_after={tally.admitted_after} lost_weight={lost}"
    )


async def test_resharding_under_load_loses_nothing_and_never_over_counts(
    fresh_cluster: cluster.Cluster, prefix: str
) -> None:
    """Slots of hot identifiers migrate in small batches under load (ASK, TRYAGAIN): no error
    reaches the caller and stored counters equal admitted weight exactly."""
    nodes = fresh_cluster
    hot = hot_identifiers(nodes, prefix, {"user": 4, "ip": 2})
    primaries = nodes.primaries()
    moves: dict[int, list[int]] = {}
    for ident in hot:
        slot = key_slot(main_key(prefix, ident).encode())
        owner = nodes.node_for_slot(slot)
        target = primaries[(primaries.index(owner) + 1) % len(primaries)]
        moves.setdefault(target.port, []).append(slot)
    by_port = {node.port: node for node in primaries}

    def fault() -> None:
        for port, slots in moves.items():
            nodes.migrate_slots(slots, by_port[port], batch=1, keys_per_batch=3)

    async with Limiter(nodes.url, LIMITS, prefix=prefix, deadline=5.0) as limiter:
        tally = await run_with_fault(limiter, hot, fault, after=0.3)
        store = limiter.store
        assert isinstance(store, ClusterStore)
        moved = store.statistics()
        compensation_errors = limiter._protocol.statistics.compensation_errors
    for ident in hot:
        slot = key_slot(main_key(prefix, ident).encode())
        assert nodes.node_for_slot(slot).port in moves  # it really moved
    assert moved.redirects + moved.retries > 0  # the load did run into the migration
    assert tally.errors == []
    assert compensation_errors == 0
    check_exact(stored(nodes.seed_url, prefix, hot, LIMITS), tally, hot, LIMITS)
    print(
        f"\n[resharding] decisions={tally.decisions} redirects={moved.redirects} "
        f"retries={moved.retries}"
    )


async def test_script_flush_mid_load_is_invisible(
    local_cluster: cluster.Cluster, redis_cluster_url: str, prefix: str
) -> None:
    """SCRIPT FLUSH on every primary, three times under load: no error, exact counters."""
    hot = hot_identifiers(local_cluster, prefix, {"user": 4, "ip": 2})

    def fault() -> None:
        for _ in range(3):
            local_cluster.flush_scripts()
            time.sleep(0.1)

    async with Limiter(redis_cluster_url, LIMITS, prefix=prefix, deadline=5.0) as limiter:
        tally = await run_with_fault(limiter, hot, fault, after=0.2)
        store = limiter.store
        assert isinstance(store, ClusterStore)
        noscript = store.statistics().noscript
    assert tally.errors == []
    assert noscript >= 1
    check_exact(stored(local_cluster.seed_url, prefix, hot, LIMITS), tally, hot, LIMITS)
    print(f"\n[script flush] decisions={tally.decisions} noscript_resends={noscript}")


def test_hot_identifiers_span_every_primary(local_cluster: cluster.Cluster, prefix: str) -> None:
    """The load tests' identifiers really live in distinct slots on every primary."""
    hot = hot_identifiers(local_cluster, prefix, {"user": 4, "ip": 2})
    slots = [key_slot(main_key(prefix, ident).encode()) for ident in hot]
    assert len(set(slots)) == len(hot) == 6
    ports = {local_cluster.node_for_slot(slot).port for slot in slots}
    assert len(ports) == len(local_cluster.primaries())


class PausingStore(ClusterStore):
    """The real cluster store; just before the first commit phase, a primary is SIGSTOPped
    (a fault timed between the phases, which load alone would hit only by chance)."""

    victim: cluster.Node

    async def run(self, calls: Any) -> list[Any]:
        if calls and calls[0].mode == "acquire" and not self.victim.paused:
            self.victim.pause()
        return await super().run(calls)


async def test_commit_stuck_past_the_deadline_is_compensated(
    fresh_cluster: cluster.Cluster, prefix: str
) -> None:
    """A primary stops between check and commit: the decision fails within its deadline with
    BackendUnavailable, and once the primary answers again every slot is as if the request
    never happened (the undo outlives the decision)."""
    nodes = fresh_cluster
    hot = hot_identifiers(nodes, prefix, {"user": 2, "ip": 1})
    victim = nodes.node_for_slot(key_slot(main_key(prefix, hot[1]).encode()))
    store = PausingStore.from_url(nodes.url)
    store.victim = victim
    deadline = 0.5
    try:
        async with Limiter(store, ROOMY, prefix=prefix, deadline=deadline) as limiter:
            started = time.monotonic()
            with pytest.raises(BackendUnavailable):
                await limiter.try_acquire(hot, 2)
            assert time.monotonic() - started < deadline + 0.3
            assert limiter.statistics().compensations == 1
            victim.resume()
            # aclose waits for the compensation still running for the cancelled decision.
    finally:
        if victim.paused:
            victim.resume()
    charges = stored(nodes.seed_url, prefix, hot, {"user": ROOMY, "ip": ROOMY})
    assert set(charges.values()) == {0}
