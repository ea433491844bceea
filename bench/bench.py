"""aiolimit against its peers on one Redis server, in one process, in one run.

Run from the repository root (``bench`` is a package)::

    .venv/bin/python -m bench.bench                       # 1x1 and 2x3, sliding, ~35 s
    .venv/bin/python -m bench.bench --ids 2 --limits 3 --duration 3 --rounds 3
    .venv/bin/python -m bench.bench --algorithm all --shapes 1x1 --memory
    .venv/bin/python -m bench.bench --saturated --json results.json
    .venv/bin/python -m bench.bench --profile --ids 2 --limits 3   # where aiolimit's CPU goes

The server: ``--redis-url`` (or ``REDIS_URL``; ``REDIS_CLUSTER_URL`` with ``--mode cluster``),
otherwise a private redis-server (or 3+3 cluster) started by the ``cluster`` package on free
ports and stopped at the end. Contenders run back to back on that server, each after its own
warm-up, in an order rotated every round; each writes only keys under its own prefix and those
keys are deleted after every phase. See bench/README.md for what each column means.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from bench._measure import (
    CommandCounter,
    Measurement,
    ServerStats,
    counting_commands,
    format_table,
    measure,
    profile_rows,
    profiled,
    run_load,
)
from bench._peers import (
    ALGORITHMS,
    CONTENDERS,
    EXTRA_CONTENDERS,
    Contender,
    Unsupported,
    Window,
    library_versions,
    make_contender,
    windows,
)

KINDS = ("ip", "user", "key", "org")
MEMORY_LIMIT = Window(240, 3600)
#: The performance issue's goals, per (ids, limits) shape, against the best peer in the run:
#: decisions/s ratio at concurrency >= 16, client CPU µs per decision, server µs per call.
TARGETS = {(1, 1): (3.0, 20.0, 12.0), (2, 3): (4.0, 25.0, 30.0)}
PEERS = ("limits", "pyrate", "pyrate-direct", "throttled")
#: With most decisions refused (--saturated), aiolimit's refusal cache against the best peer.
SATURATED_TARGET = 10.0


@dataclass
class Config:
    mode: str = "standalone"
    redis_url: str | None = None
    concurrency: int = 64
    shapes: list[tuple[int, int]] = field(default_factory=lambda: [(1, 1), (2, 3)])
    algorithms: list[str] = field(default_factory=lambda: ["sliding"])
    contenders: list[str] = field(default_factory=lambda: list(CONTENDERS))
    saturated: bool = False
    duration: float | None = 1.5
    count: int | None = None
    warmup: float = 0.3
    rounds: int = 2
    id_pool: int = 4
    sliding_buckets: int = 10
    memory: bool = False
    memory_only: bool = False
    profile: bool = False
    json_path: str | None = None
    quiet: bool = False


@dataclass
class Outcome:
    """One contender's result for one algorithm and shape: a measurement, or why not."""

    impl: str = ""
    status: str = "ok"
    measurement: Measurement = field(default_factory=Measurement)


def identifier_sets(concurrency: int, ids_per_call: int, pool: int) -> list[list[tuple[str, ...]]]:
    """Per task, ``pool`` distinct id tuples ("ip:...", "user:...", ...) used in turn."""
    sets = []
    for task in range(concurrency):
        mine = []
        for j in range(pool):
            ids = []
            for k in range(ids_per_call):
                kind = KINDS[k % len(KINDS)] + (str(k // len(KINDS)) if k >= len(KINDS) else "")
                ids.append(f"{kind}:10.{task}.{j}.{k}" if kind == "ip" else f"{kind}:{task}-{j}")
            mine.append(tuple(ids))
        sets.append(mine)
    return sets


def _log(config: Config, text: str) -> None:
    if not config.quiet:
        print(text, file=sys.stderr, flush=True)


# -- servers --------------------------------------------------------------------------------


@contextmanager
def server(config: Config) -> Iterator[str]:
    """The URL to benchmark against: the given one, or a server started here and stopped."""
    url = config.redis_url
    if url is None:
        url = os.environ.get("REDIS_CLUSTER_URL" if config.mode == "cluster" else "REDIS_URL")
    if url:
        if config.mode == "cluster" and url.startswith(("redis://", "rediss://")):
            scheme, rest = url.split("://", 1)
            url = f"{scheme}+cluster://{rest}"
        yield url
        return
    import cluster

    started: Any = (
        cluster.start_cluster() if config.mode == "cluster" else cluster.start_standalone()
    )
    try:
        yield started.url
    finally:
        started.stop()


# -- throughput -----------------------------------------------------------------------------


async def _phase(
    contender: Contender,
    id_sets: list[list[tuple[str, ...]]],
    config: Config,
    stats: ServerStats,
    counter: CommandCounter,
) -> Measurement:
    identifiers = sorted({ident for mine in id_sets for ids in mine for ident in ids})
    try:
        decide = await contender.open(identifiers)
        if config.warmup > 0:
            warm = await run_load(decide, id_sets, duration=config.warmup)
            if warm.errors and not warm.decisions:
                raise RuntimeError(f"every warm-up decision failed: {warm.first_error}")
        return await measure(
            decide, id_sets, duration=config.duration, count=config.count,
            stats=stats, counter=counter,
        )  # fmt: skip
    finally:
        await contender.aclose()
        stats.delete_matching(contender.key_pattern)


async def run_round(
    name: str, outcome: Outcome, *, url: str, algorithm: str, limits: Any, prefix: str,
    id_sets: list[list[tuple[str, ...]]], config: Config, stats: ServerStats,
    counter: CommandCounter,
) -> Measurement | None:  # fmt: skip
    """One contender's measured phase, added to ``outcome``; None (and a status saying why)
    when it cannot run this algorithm or failed."""
    try:
        contender = make_contender(
            name, url=url, algorithm=algorithm, limits=limits, prefix=prefix,
            sliding_buckets=config.sliding_buckets,
        )  # fmt: skip
        outcome.impl = contender.impl
        result = await _phase(contender, id_sets, config, stats, counter)
    except Unsupported as exc:
        outcome.status = f"n/a: {exc}"
        return None
    except Exception as exc:
        outcome.status = f"failed: {exc!r}"[:200]
        return None
    outcome.measurement.add(result)
    return result


async def run_shape(
    url: str, algorithm: str, ids: int, nlimits: int, config: Config,
    stats: ServerStats, counter: CommandCounter, token: str,
) -> dict[str, Outcome]:  # fmt: skip
    """Every contender for one algorithm and shape, ``rounds`` times in rotated order."""
    limits = windows(nlimits, saturated=config.saturated)
    id_sets = identifier_sets(config.concurrency, ids, config.id_pool)
    outcomes = {name: Outcome() for name in config.contenders}
    for round_index in range(config.rounds):
        shift = round_index % len(config.contenders)
        order = config.contenders[shift:] + config.contenders[:shift]
        for name in order:
            outcome = outcomes[name]
            if outcome.status != "ok":
                continue
            result = await run_round(
                name, outcome, url=url, algorithm=algorithm, limits=limits,
                prefix=f"bench-{token}-{name}-{algorithm}-{ids}x{nlimits}", id_sets=id_sets,
                config=config, stats=stats, counter=counter,
            )  # fmt: skip
            if result is None:
                continue
            _log(
                config,
                f"  {algorithm} {ids}x{nlimits} round {round_index + 1} {name}: "
                f"{result.decisions_per_second:,.0f} decisions/s"
                + (f", {result.errors} errors" if result.errors else ""),
            )
    return outcomes


def _fmt(value: float, digits: int = 1) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:,.{digits}f}"


def results_table(outcomes: dict[str, Outcome]) -> str:
    reference = outcomes.get("limits")
    base = (
        reference.measurement.decisions_per_second
        if reference and reference.status == "ok" and reference.measurement.decisions
        else math.nan
    )
    headers = [
        "contender", "dec/s", "p50 ms", "p99 ms", "cpu µs/dec", "srv µs/call",
        "srv µs/dec", "cmds/dec", "srv cmds/dec", "admit %", "errors", "vs limits",
    ]  # fmt: skip
    rows = []
    for name, outcome in outcomes.items():
        m = outcome.measurement
        if outcome.status != "ok" or not m.decisions:
            short = outcome.status.split(":", 1)[0] if outcome.status != "ok" else "none"
            rows.append([name, short, *([""] * (len(headers) - 2))])
            continue
        rows.append(
            [
                name,
                _fmt(m.decisions_per_second, 0),
                _fmt(m.latency_ms(50), 3),
                _fmt(m.latency_ms(99), 3),
                _fmt(m.cpu_us_per_decision),
                _fmt(m.server_us_per_call),
                _fmt(m.server_us_per_decision),
                _fmt(m.commands_per_decision, 2),
                _fmt(m.server_commands_per_decision, 1),
                _fmt(100 * m.admitted / m.decisions, 1),
                str(m.errors),
                f"{m.decisions_per_second / base:.2f}x" if not math.isnan(base) else "-",
            ]
        )
    notes = [
        f"  {name}: {outcome.impl or '-'}"
        + ("" if outcome.status == "ok" else f"  [{outcome.status}]")
        for name, outcome in outcomes.items()
    ]
    return format_table(headers, rows) + "\n" + "\n".join(notes)


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def target_lines(
    ids: int, nlimits: int, outcomes: dict[str, Outcome], *, concurrency: int, saturated: bool
) -> list[str]:
    """The goals of the performance issue, checked on this run's figures, and how far aiolimit
    is from the ceilings: the ``ceiling`` client (the same script calls, no client logic) and
    the server alone (1e6 / server µs per call)."""
    measured = {
        name: outcome.measurement
        for name, outcome in outcomes.items()
        if outcome.status == "ok" and outcome.measurement.decisions
    }
    peers = {name: m for name, m in measured.items() if name in PEERS}
    lines: list[str] = []
    ours = measured.get("aiolimit")
    if ours is None or not peers:
        return lines
    best = max(peers, key=lambda name: peers[name].decisions_per_second)
    fastest = min(peers, key=lambda name: peers[name].latency_ms(50))
    if saturated:
        cached = measured.get("aiolimit-cache")
        if cached is not None:
            ratio = cached.decisions_per_second / peers[best].decisions_per_second
            lines.append(
                f"target saturated {ids}x{nlimits}: aiolimit-cache/{best} = {ratio:.2f}x "
                f"decisions/s (>= {SATURATED_TARGET:g}x): {_verdict(ratio >= SATURATED_TARGET)}"
            )
        return lines
    if concurrency == 1:
        ours_p50, theirs_p50 = ours.latency_ms(50), peers[fastest].latency_ms(50)
        lines.append(
            f"target one task {ids}x{nlimits}: p50 {ours_p50:.3f} ms vs {fastest} "
            f"{theirs_p50:.3f} ms (<=): {_verdict(ours_p50 <= theirs_p50)}"
        )
    target = TARGETS.get((ids, nlimits))
    if target is not None:
        ratio_goal, cpu_goal, server_goal = target
        ratio = ours.decisions_per_second / peers[best].decisions_per_second
        if concurrency >= 16:
            lines.append(
                f"target {ids}x{nlimits}: aiolimit/{best} (best peer) = {ratio:.2f}x "
                f"decisions/s (>= {ratio_goal:g}x): {_verdict(ratio >= ratio_goal)}"
            )
        # Server time per decision: a pipeline of decisions may be one script call
        # (decide_many), so a call's mean is not what one decision costs.
        cpu, server = ours.cpu_us_per_decision, ours.server_us_per_decision
        lines.append(
            f"target {ids}x{nlimits}: client CPU {cpu:.1f} µs/decision (<= {cpu_goal:g}): "
            f"{_verdict(cpu <= cpu_goal)}; server {server:.1f} µs/decision "
            f"(<= {server_goal:g}): {_verdict(server <= server_goal)}"
        )
    ceiling = measured.get("ceiling")
    if ceiling is not None:
        share = ours.decisions_per_second / ceiling.decisions_per_second
        lines.append(
            f"ceiling {ids}x{nlimits}: aiolimit reaches {share:.0%} "
            f"of the minimal client's {ceiling.decisions_per_second:,.0f} decisions/s "
            f"(its client CPU {ceiling.cpu_us_per_decision:.1f} µs/decision)"
        )
    if ours.server_us_per_decision > 0:
        bound = 1e6 / ours.server_us_per_decision
        lines.append(
            f"ceiling {ids}x{nlimits}: the server alone could make {bound:,.0f} decisions/s "
            f"at this script time ({ours.server_us_per_decision:.1f} µs each); aiolimit "
            f"reaches {ours.decisions_per_second / bound:.0%}"
        )
    return lines


# -- memory ---------------------------------------------------------------------------------


async def _fill(contender: Contender, identifier: str, hits: int, clock: Any = None,
                step: float = 0.0) -> tuple[int, bool]:  # fmt: skip
    """``hits`` decisions on one identifier (advancing ``clock`` by ``step`` between), then one
    more: (admitted, whether that extra one was refused)."""
    decide = await contender.open([identifier])
    admitted = 0
    for i in range(hits):
        if clock is not None and i:
            clock.advance(step)
        admitted += await decide((identifier,))
    refused = not await decide((identifier,))
    return admitted, refused


async def memory_rows(
    url: str, config: Config, stats: ServerStats, token: str
) -> list[dict[str, Any]]:
    """MEMORY USAGE of one identifier's keys under a 240/hour limit after 240 admitted hits."""
    rows: list[dict[str, Any]] = []
    identifier = "user:memory-probe"
    for algorithm in config.algorithms:
        variants: list[tuple[str, str, Any]] = [(name, "burst", None) for name in config.contenders]
        if "aiolimit" in config.contenders and algorithm == "sliding":
            variants.append(("aiolimit", "spread", "manual"))
        for name, how, clock_kind in variants:
            prefix = f"bench-{token}-mem-{name}-{algorithm}-{how}"
            clock = None
            if clock_kind == "manual":
                from aiolimit.testing import ManualClock

                start = (time.time() // 3600) * 3600
                clock = ManualClock(start=start)
            row: dict[str, Any] = {"algorithm": algorithm, "contender": name, "fill": how}
            try:
                contender = make_contender(
                    name, url=url, algorithm=algorithm, limits=[MEMORY_LIMIT], prefix=prefix,
                    sliding_buckets=config.sliding_buckets, clock=clock,
                )  # fmt: skip
                row["impl"] = contender.impl
                try:
                    step = MEMORY_LIMIT.per / MEMORY_LIMIT.amount
                    admitted, refused = await _fill(
                        contender, identifier, MEMORY_LIMIT.amount, clock, step
                    )
                    keys, size = stats.memory_usage(contender.key_pattern)
                finally:
                    await contender.aclose()
                    stats.delete_matching(contender.key_pattern)
                row.update(admitted=admitted, next_refused=refused, keys=keys, bytes=size)
            except Unsupported as exc:
                row["status"] = f"n/a: {exc}"
            except Exception as exc:
                row["status"] = f"failed: {exc!r}"[:200]
            rows.append(row)
    return rows


def memory_table(rows: list[dict[str, Any]]) -> str:
    headers = [
        "algorithm",
        "contender",
        "fill",
        "keys",
        "bytes",
        "admitted",
        "241st refused",
        "impl",
    ]
    body = []
    for row in rows:
        if "status" in row:
            body.append(
                [row["algorithm"], row["contender"], row["fill"], "", "", "", "", row["status"]]
            )
            continue
        body.append(
            [
                row["algorithm"], row["contender"], row["fill"], str(row["keys"]),
                f"{row['bytes']:,}", str(row["admitted"]), "yes" if row["next_refused"] else "NO",
                row["impl"],
            ]
        )  # fmt: skip
    return format_table(headers, body)


# -- profile --------------------------------------------------------------------------------


async def profile_aiolimit(
    url: str, ids: int, nlimits: int, config: Config, stats: ServerStats,
    counter: CommandCounter, token: str,
) -> dict[str, Any]:  # fmt: skip
    """aiolimit alone under cProfile: own time per area and per function, µs per decision."""
    algorithm = config.algorithms[0]
    limits = windows(nlimits, saturated=config.saturated)
    id_sets = identifier_sets(config.concurrency, ids, config.id_pool)
    identifiers = sorted({ident for mine in id_sets for tup in mine for ident in tup})
    contender = make_contender(
        "aiolimit", url=url, algorithm=algorithm, limits=limits,
        prefix=f"bench-{token}-profile", sliding_buckets=config.sliding_buckets,
    )  # fmt: skip
    try:
        decide = await contender.open(identifiers)
        await run_load(decide, id_sets, duration=max(config.warmup, 0.2))
        plain = await measure(
            decide, id_sets, duration=config.duration, count=config.count, stats=stats,
            counter=counter,
        )  # fmt: skip
        profiled_run, profile = await profiled(
            run_load(decide, id_sets, duration=config.duration, count=config.count)
        )
    finally:
        await contender.aclose()
        stats.delete_matching(contender.key_pattern)
    by_area, by_function = profile_rows(profile, max(profiled_run.decisions, 1))
    return {
        "shape": f"{ids}x{nlimits}",
        "algorithm": algorithm,
        "unprofiled": plain.summary(),
        "profiled_decisions_per_s": profiled_run.decisions / profiled_run.elapsed,
        "by_area": by_area,
        "by_function": by_function,
    }


def profile_text(report: dict[str, Any]) -> str:
    plain = report["unprofiled"]
    lines = [
        f"aiolimit profile, {report['algorithm']} {report['shape']}: unprofiled "
        f"{plain['decisions_per_s']:,.0f} dec/s, {plain['cpu_us_per_decision']} client CPU "
        f"µs/dec; under cProfile {report['profiled_decisions_per_s']:,.0f} dec/s "
        "(cProfile inflates Python-heavy code; read the shares)",
        format_table(["area (own time)", "µs/dec", "share"], report["by_area"]),
        "",
        format_table(["function", "own µs/dec", "cum µs/dec", "calls/dec"], report["by_function"]),
    ]
    return "\n".join(lines)


# -- main -----------------------------------------------------------------------------------


async def run(config: Config) -> dict[str, Any]:
    """Runs everything the config asks for; prints tables; returns the JSON-able report."""
    token = uuid.uuid4().hex[:8]
    report: dict[str, Any] = {
        "config": {
            key: value for key, value in vars(config).items() if key not in ("quiet", "json_path")
        },
        "versions": {"python": platform.python_version(), **library_versions()},
        "results": [],
    }
    with server(config) as url, counting_commands() as counter:
        stats = ServerStats.from_url(url)
        try:
            report["server"] = {"mode": config.mode, "redis_version": stats.server_version()}
            header = (
                f"{config.mode} redis {report['server']['redis_version']}, concurrency "
                f"{config.concurrency}, {'saturated' if config.saturated else 'admitting'} limits, "
                + (f"{config.rounds} rounds x {config.duration} s" if config.count is None
                   else f"{config.rounds} rounds x {config.count} decisions")
                + f" (+{config.warmup} s warm-up each)"
            )  # fmt: skip
            if config.profile:
                ids, nlimits = config.shapes[-1]
                profile = await profile_aiolimit(url, ids, nlimits, config, stats, counter, token)
                report["profile"] = profile
                print(profile_text(profile), flush=True)
                return report
            for algorithm in [] if config.memory_only else config.algorithms:
                for ids, nlimits in config.shapes:
                    limits = windows(nlimits, saturated=config.saturated)
                    outcomes = await run_shape(
                        url, algorithm, ids, nlimits, config, stats, counter, token
                    )
                    title = (
                        f"\n== {algorithm}: {ids} id(s) x {nlimits} limit(s) "
                        f"[{', '.join(map(str, limits))}]; {header}"
                    )
                    print(title, flush=True)
                    print(results_table(outcomes), flush=True)
                    targets = target_lines(
                        ids,
                        nlimits,
                        outcomes,
                        concurrency=config.concurrency,
                        saturated=config.saturated,
                    )
                    for line in targets if algorithm == "sliding" else []:
                        print(line, flush=True)
                    report["results"].append(
                        {
                            "algorithm": algorithm,
                            "ids": ids,
                            "limits": [str(window) for window in limits],
                            "saturated": config.saturated,
                            "contenders": {
                                name: {
                                    "impl": outcome.impl,
                                    "status": outcome.status,
                                    **(
                                        outcome.measurement.summary()
                                        if outcome.status == "ok"
                                        else {}
                                    ),
                                }
                                for name, outcome in outcomes.items()
                            },
                        }
                    )
            if config.memory:
                rows = await memory_rows(url, config, stats, token)
                report["memory"] = rows
                print(
                    f"\n== memory per identifier: one {MEMORY_LIMIT} limit after "
                    f"{MEMORY_LIMIT.amount} admitted hits (MEMORY USAGE ... SAMPLES 0; 'spread' "
                    "= aiolimit with a manual clock, one hit every 15 s over the hour)",
                    flush=True,
                )
                print(memory_table(rows), flush=True)
        finally:
            stats.close()
    return report


def _shape(text: str) -> tuple[int, int]:
    ids, _, nlimits = text.lower().partition("x")
    try:
        shape = (int(ids), int(nlimits))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"a shape is <ids>x<limits>, e.g. 2x3; got {text!r}"
        ) from None
    if shape[0] < 1 or shape[1] < 1:
        raise argparse.ArgumentTypeError(f"a shape needs at least 1 id and 1 limit, got {text!r}")
    return shape


def parse_args(argv: Sequence[str] | None = None) -> Config:
    parser = argparse.ArgumentParser(
        prog="python -m bench.bench",
        description="aiolimit vs limits / pyrate-limiter / throttled-py on one Redis server.",
    )
    parser.add_argument("--mode", choices=("standalone", "cluster"), default="standalone")
    parser.add_argument("--redis-url", help="use this server (default: REDIS_URL, or start one)")
    parser.add_argument("--concurrency", type=int, default=64, help="tasks (default 64)")
    parser.add_argument("--ids", type=int, help="identifiers per call (with --limits: one shape)")
    parser.add_argument("--limits", type=int, help="limits per identifier (1-4)")
    parser.add_argument(
        "--shapes", default="1x1,2x3", help="comma-separated <ids>x<limits> (default 1x1,2x3)"
    )
    parser.add_argument(
        "--algorithm", default="sliding", help=f"{'|'.join(ALGORITHMS)}|all (default sliding)"
    )
    parser.add_argument(
        "--contenders", default=",".join(CONTENDERS),
        help=f"comma-separated, from {', '.join(CONTENDERS + EXTRA_CONTENDERS)}",
    )  # fmt: skip
    parser.add_argument(
        "--saturated", action="store_true", help="tiny limits (1/s, 2/min, ...): most refused"
    )
    parser.add_argument("--duration", type=float, help="seconds per measured phase (default 1.5)")
    parser.add_argument("--count", type=int, help="decisions per measured phase instead")
    parser.add_argument("--warmup", type=float, default=0.3, help="warm-up seconds per phase")
    parser.add_argument("--rounds", type=int, default=2, help="phases per contender (default 2)")
    parser.add_argument("--id-pool", type=int, default=4, help="id tuples per task (default 4)")
    parser.add_argument(
        "--sliding-buckets", type=int, default=10,
        help="aiolimit sliding counter buckets per window: precision = per / N (default 10)",
    )  # fmt: skip
    parser.add_argument("--memory", action="store_true", help="also MEMORY USAGE per identifier")
    parser.add_argument("--memory-only", action="store_true", help="only MEMORY USAGE, no load")
    parser.add_argument("--profile", action="store_true", help="profile aiolimit alone instead")
    parser.add_argument("--json", dest="json_path", help="also write the report here (- = stdout)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = parser.parse_args(argv)

    if args.ids is not None or args.limits is not None:
        shapes = [(args.ids or 1, args.limits or 1)]
    else:
        shapes = [_shape(part) for part in args.shapes.split(",") if part.strip()]
    algorithms = list(ALGORITHMS) if args.algorithm == "all" else args.algorithm.split(",")
    contenders = [name.strip() for name in args.contenders.split(",") if name.strip()]
    for algorithm in algorithms:
        if algorithm not in ALGORITHMS:
            parser.error(f"--algorithm must be one of {', '.join(ALGORITHMS)} or all")
    for name in contenders:
        if name not in CONTENDERS + EXTRA_CONTENDERS:
            parser.error(f"unknown contender {name!r}")
    if args.count is not None and args.count < 1:
        parser.error("--count must be >= 1")
    if args.concurrency < 1 or args.rounds < 1 or args.id_pool < 1 or args.sliding_buckets < 1:
        parser.error("--concurrency, --rounds, --id-pool and --sliding-buckets must be >= 1")
    duration = args.duration if args.duration is not None else (None if args.count else 1.5)
    if duration is not None and not 0 < duration <= 600:
        parser.error("--duration must be in (0, 600] seconds")
    return Config(
        mode=args.mode,
        redis_url=args.redis_url,
        concurrency=args.concurrency,
        shapes=shapes,
        algorithms=algorithms,
        contenders=contenders,
        saturated=args.saturated,
        duration=duration,
        count=args.count,
        warmup=max(args.warmup, 0.0),
        rounds=args.rounds,
        id_pool=args.id_pool,
        sliding_buckets=args.sliding_buckets,
        memory=args.memory or args.memory_only,
        memory_only=args.memory_only,
        profile=args.profile,
        json_path=args.json_path,
        quiet=args.quiet,
    )


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    report = asyncio.run(run(config))
    if config.json_path:
        text = json.dumps(report, indent=2, default=str)
        if config.json_path == "-":
            print(text)
        else:
            with open(config.json_path, "w", encoding="utf-8") as out:
                out.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
