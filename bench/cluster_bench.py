"""aiolimit against its peers on one Redis Cluster: 2 identifiers x 3 limits, two layouts.

Run from the repository root::

    .venv/bin/python -m bench.cluster_bench                     # ~35 s, a private 3+3 cluster
    .venv/bin/python -m bench.cluster_bench --duration 3 --rounds 3 --json cluster.json
    REDIS_CLUSTER_URL=redis://127.0.0.1:7000 .venv/bin/python -m bench.cluster_bench

Scenarios (each decision names one ``ip:`` and one ``user:`` identifier, 3 limits each):

- ``one slot``: the two identifiers of every decision hash to the same slot (chosen by search:
  aiolimit's hash tag is the identifier itself, so this is what a shared tag buys), so
  aiolimit decides with one atomic script call;
- ``two primaries``: the two identifiers live on different primaries, so aiolimit runs its
  two phases (a check per slot, then a commit per slot, nodes in parallel).

The peers (``limits`` with its async redis cluster storage, ``pyrate-limiter`` on a
``RedisCluster``) get the same identifiers on the same cluster in the same run; they make one
or more round trips per (identifier, limit) whatever the layout. Columns are those of
``bench/bench.py`` (see bench/README.md); ``rt/dec`` is socket writes per decision (a pipeline
counts once).

``ceiling`` is no limiter: the calls aiolimit's protocol makes (one acquire in one slot; across
slots a check per slot, then an acquire per slot), packed once in advance and sent by a
minimal client (one connection per primary, no op ids, no decoding, deadlines or retries;
``bench/_peers.py``). Under each table: aiolimit against the best peer and against that
ceiling, and, for ``two primaries``, the issue's targets (>= 3x the best peer, client CPU
<= 60 µs per decision).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import uuid
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from redis.cluster import RedisCluster
from redis.crc import key_slot

from bench._measure import CommandCounter, ServerStats, counting_commands, format_table
from bench._peers import library_versions, windows
from bench.bench import Config, Outcome, _fmt, run_round, server

CONTENDERS = ("aiolimit", "limits", "pyrate", "ceiling")
PEERS = ("limits", "pyrate")
#: The issue's targets for ``two primaries``: x the best peer's decisions/s, client CPU µs.
TARGET_RATIO, TARGET_CPU_US = 3.0, 60.0
SCENARIOS = ("one slot", "two primaries")


def _slot(identifier: str) -> int:
    # aiolimit's keys are <prefix>:{<identifier>} (plain identifiers need no escaping).
    return key_slot(identifier.encode())


def id_sets(
    scenario: str, concurrency: int, pool: int, node_of_slot: dict[int, str]
) -> list[list[tuple[str, ...]]]:
    """Per task, ``pool`` distinct (ip, user) pairs laid out as the scenario says."""
    by_slot: dict[int, list[str]] = defaultdict(list)
    needed = concurrency * pool
    users = [f"user:{task}-{j}" for task in range(concurrency) for j in range(pool)]
    if scenario == "one slot":
        wanted = {_slot(user) for user in users}
        n = 0
        missing = set(wanted)  # one ip per slot; users of one slot share it
        while missing:
            ip = f"ip:10.{n >> 16 & 255}.{n >> 8 & 255}.{n & 255}"
            n += 1
            slot = _slot(ip)
            if slot in wanted:
                by_slot[slot].append(ip)
                missing.discard(slot)
        pairs = []
        taken: dict[int, int] = defaultdict(int)
        for user in users:
            slot = _slot(user)
            ips = by_slot[slot]
            pairs.append((ips[taken[slot] % len(ips)], user))
            taken[slot] += 1
    else:
        pairs = []
        n = 0
        for user in users:
            while True:
                ip = f"ip:10.{n >> 16 & 255}.{n >> 8 & 255}.{n & 255}"
                n += 1
                if node_of_slot[_slot(ip)] != node_of_slot[_slot(user)]:
                    pairs.append((ip, user))
                    break
    assert len(pairs) == needed
    return [pairs[task * pool : (task + 1) * pool] for task in range(concurrency)]


def slot_owners(url: str) -> dict[int, str]:
    client = RedisCluster.from_url(url.replace("+cluster://", "://", 1))
    try:
        return {slot: client.nodes_manager.slots_cache[slot][0].name for slot in range(16384)}
    finally:
        client.close()


async def run_scenario(
    url: str, scenario: str, sets: list[list[tuple[str, ...]]], config: Config,
    stats: ServerStats, counter: CommandCounter, token: str,
) -> dict[str, Outcome]:  # fmt: skip
    limits = windows(3, saturated=False)
    outcomes = {name: Outcome() for name in config.contenders}
    for round_index in range(config.rounds):
        shift = round_index % len(config.contenders)
        for name in config.contenders[shift:] + config.contenders[:shift]:
            outcome = outcomes[name]
            if outcome.status != "ok":
                continue
            result = await run_round(
                name, outcome, url=url, algorithm="sliding", limits=limits,
                prefix=f"cbench-{token}-{name}-{scenario.replace(' ', '-')}", id_sets=sets,
                config=config, stats=stats, counter=counter,
            )  # fmt: skip
            if result is None:
                continue
            print(
                f"  {scenario} round {round_index + 1} {name}: "
                f"{result.decisions_per_second:,.0f} decisions/s"
                + (f", {result.errors} errors" if result.errors else ""),
                file=sys.stderr,
                flush=True,
            )
    return outcomes


def table(outcomes: dict[str, Outcome]) -> str:
    headers = ["contender", "dec/s", "p50 ms", "p99 ms", "cpu µs/dec", "rt/dec", "cmds/dec",
               "srv µs/dec", "admit %", "errors"]  # fmt: skip
    rows = []
    for name, outcome in outcomes.items():
        m = outcome.measurement
        if outcome.status != "ok" or not m.decisions:
            rows.append([name, outcome.status[:40], *([""] * (len(headers) - 2))])
            continue
        rows.append(
            [
                name,
                _fmt(m.decisions_per_second, 0),
                _fmt(m.latency_ms(50), 3),
                _fmt(m.latency_ms(99), 3),
                _fmt(m.cpu_us_per_decision),
                _fmt(m.round_trips_per_decision, 2),
                _fmt(m.commands_per_decision, 2),
                _fmt(m.server_us_per_decision),
                _fmt(100 * m.admitted / m.decisions, 1),
                str(m.errors),
            ]
        )
    notes = [f"  {name}: {outcome.impl or '-'}" for name, outcome in outcomes.items()]
    return format_table(headers, rows) + "\n" + "\n".join(notes)


def verdicts(scenario: str, outcomes: dict[str, Outcome]) -> list[str]:
    """aiolimit against the best peer and the ceiling client (and, for ``two primaries``,
    against the targets), from the measured outcomes; nothing for what did not run."""
    ours = outcomes.get("aiolimit")
    if ours is None or ours.status != "ok" or not ours.measurement.decisions:
        return []
    mine = ours.measurement
    lines = []
    ran = {
        name: outcome.measurement
        for name, outcome in outcomes.items()
        if outcome.status == "ok" and outcome.measurement.decisions
    }
    peers = [(ran[name].decisions_per_second, name) for name in PEERS if name in ran]
    if peers:
        best, name = max(peers)
        ratio = mine.decisions_per_second / best
        line = f"{scenario}: aiolimit/{name} (best peer) = {ratio:.2f}x decisions/s"
        if scenario == "two primaries":
            line += f" (>= {TARGET_RATIO:g}x): {'met' if ratio >= TARGET_RATIO else 'MISSED'}"
        lines.append(line)
    if scenario == "two primaries":
        cpu = mine.cpu_us_per_decision
        lines.append(
            f"{scenario}: aiolimit client CPU {cpu:.1f} µs/decision (<= {TARGET_CPU_US:g}): "
            + ("met" if cpu <= TARGET_CPU_US else "MISSED")
        )
    top = ran.get("ceiling")
    if top is not None:
        lines.append(
            f"{scenario}: aiolimit makes {mine.decisions_per_second / top.decisions_per_second:.0%}"
            f" of the ceiling client's {top.decisions_per_second:,.0f} decisions/s; client CPU "
            f"{mine.cpu_us_per_decision:.1f} against its {top.cpu_us_per_decision:.1f} µs/decision "
            f"({mine.cpu_us_per_decision / top.cpu_us_per_decision:.2f}x)"
        )
    return lines


async def run(config: Config) -> dict[str, Any]:
    token = uuid.uuid4().hex[:8]
    report: dict[str, Any] = {
        "config": {k: v for k, v in vars(config).items() if k not in ("quiet", "json_path")},
        "versions": {"python": platform.python_version(), **library_versions()},
        "results": [],
    }
    with server(config) as url, counting_commands() as counter:
        owners = slot_owners(url)
        stats = ServerStats.from_url(url)
        try:
            version = stats.server_version()
            for scenario in SCENARIOS:
                sets = id_sets(scenario, config.concurrency, config.id_pool, owners)
                outcomes = await run_scenario(url, scenario, sets, config, stats, counter, token)
                print(
                    f"\n== cluster, {scenario}: 2 ids x 3 limits "
                    f"[{', '.join(map(str, windows(3, saturated=False)))}]; redis {version}, "
                    f"3 primaries, concurrency {config.concurrency}, {config.rounds} rounds x "
                    + (f"{config.duration} s" if config.count is None else f"{config.count}")
                    + f" (+{config.warmup} s warm-up each)",
                    flush=True,
                )
                print(table(outcomes), flush=True)
                for line in verdicts(scenario, outcomes):
                    print(line, flush=True)
                report["results"].append(
                    {
                        "scenario": scenario,
                        "contenders": {
                            name: {
                                "impl": outcome.impl,
                                "status": outcome.status,
                                **(outcome.measurement.summary() if outcome.status == "ok" else {}),
                            }
                            for name, outcome in outcomes.items()
                        },
                    }
                )
        finally:
            stats.close()
    return report


def parse_args(argv: Sequence[str] | None = None) -> Config:
    parser = argparse.ArgumentParser(prog="python -m bench.cluster_bench", description=__doc__)
    parser.add_argument("--redis-url", help="a cluster seed (redis:// or redis+cluster://)")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--duration", type=float, default=1.5, help="seconds per phase")
    parser.add_argument("--count", type=int, help="decisions per phase instead of a duration")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=float, default=0.3)
    parser.add_argument("--id-pool", type=int, default=4, help="id pairs per task, used in turn")
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args(argv)
    url = args.redis_url
    if url and url.startswith(("redis://", "rediss://")):
        url = url.replace("://", "+cluster://", 1)
    return Config(
        mode="cluster",
        redis_url=url,
        concurrency=args.concurrency,
        duration=None if args.count else args.duration,
        count=args.count,
        rounds=args.rounds,
        warmup=args.warmup,
        id_pool=args.id_pool,
        contenders=[name.strip() for name in args.contenders.split(",") if name.strip()],
        json_path=args.json_path,
    )


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    report = asyncio.run(run(config))
    if config.json_path:
        with open(config.json_path, "w", encoding="utf-8") as out:
            json.dump(report, out, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
