"""The decision script's own server time, with no client logic: FCALLs pipelined on a private
redis-server, read from ``INFO commandstats``.

Run from the repository root (``bench`` is a package)::

    .venv/bin/python -m bench.script_cost                     # this tree's lua/, 5 rounds
    .venv/bin/python -m bench.script_cost --lua /tmp/old/lua --lua lua --rounds 7   # A/B

Each ``--lua`` directory is loaded as a FUNCTION library of its own on one server; rounds
alternate the libraries (A B, then B A, ...) so that a machine's drift falls on both alike.
Scenarios, each on fresh identifiers, times from the server's TIME:

- ``check``: a read-only check, 1 identifier x 1 sliding limit (10 buckets);
- ``acquire+op``: an acquire with an op id, as a limiter sends one alone;
- ``acquire+16 open``: the same, naming 16 older open ops (concurrent calls on one identifier);
- ``2x3+op``: 2 identifiers x 3 sliding limits, with an op id;
- ``many 1x1`` and ``many 2x3`` (libraries that have ``decide_many``): the acquires above sent
  16 to an FCALL over 4 identifiers, as the stores send a pipeline: server µs per decision;
- ``many 1x1 spread``: the same over 256 identifiers (as ``bench.bench``'s 64 tasks x 4
  identifiers each), so a batch rarely touches one key twice;
- ``many 1x1 spread, no op``: the same without op ids: what the exactly-once ledger (reading,
  recording and storing the op) costs is the difference (the limiter always sends one);
- ``fleet of 64``: single acquires on one identifier from 64 clients in turn (64 limiter
  processes sharing a busy identifier: its hash holds 64 op ledgers), to compare with
  ``acquire+op`` (one client);
- ``lease take+release``: one identifier under ``Concurrency(1000)``, each op acquired (a
  lease taken) then released by the next call, server µs per call (the lease set's ZSET
  commands and its TTL kept with the main key's);
- ``floor``: what any script of this kind pays, with no logic at all: one FCALL that reads
  TIME, HGETALLs a small hash, HSETs 3 fields of it and returns 7 integers.

Reported: server µs per decision, best and median over the rounds; with two libraries, the
second's median over the first's.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import cluster
from aiolimit import Concurrency, Limit, Limiter
from aiolimit._calls import SCRIPT_FILES, Call, Mode, encode, lua_dir
from aiolimit._stores.resp import command_head, pack_many

SCENARIOS = (
    "check", "acquire+op", "acquire+16 open", "2x3+op", "many 1x1", "many 1x1 spread",
    "many 1x1 spread, no op", "many 2x3", "fleet of 64", "lease take+release",
)  # fmt: skip
FLOOR = """#!lua name=cost_floor
redis.register_function('cost_floor', function(keys, args)
  local t = redis.call('TIME')
  local fields = redis.call('HGETALL', keys[1])
  redis.call('HSET', keys[1], 't', t[1], 'w', t[2], 'o', t[1] .. ';' .. t[2])
  return {1, 0, 1, 1, #fields, 0, 1000}
end)
"""
ONE = [Limit(10**9, per=1, precision=0.1)]
THREE = [
    Limit(10**9, per=1, precision=0.1),
    Limit(10**10, per=60, precision=6),
    Limit(10**11, per=3600, precision=360),
]
LEASE = [Concurrency(1000, lease_ttl=60)]
BATCH = 16


def library(directory: Path, tag: str) -> tuple[str, bool]:
    """A FUNCTION library of the scripts in ``directory``, its functions named by ``tag``."""
    code = "\n".join((directory / name).read_text(encoding="utf-8") for name in SCRIPT_FILES)
    many = "local function decide_many(" in code
    text = (
        f"#!lua name=cost_{tag}\n{code}\n"
        f"redis.register_function('cost_{tag}', function(keys, args)\n"
        "  return decide(keys, args)\nend)\n"
    )
    if many:
        text += (
            f"redis.register_function('cost_many_{tag}', function(keys, args)\n"
            "  return decide_many(keys, args)\nend)\n"
        )
    return text, many


def program(scenario: str, run: int, count: int) -> list[Call]:
    """``count`` calls of ``scenario`` on identifiers of their own (``run`` tells them apart)."""
    one = Limiter("memory://", ONE, prefix="cost")
    three = Limiter("memory://", THREE, prefix="cost")
    calls = []
    for i in range(1, count + 1):
        who = f"{run}"
        if scenario.startswith("many 1x1 spread"):  # (as the bench's 64 tasks x 4 identifiers)
            who = f"{run}:{i % 256}"
        elif scenario.startswith("many"):
            who = f"{run}:{i % 4}"
        if scenario == "check":
            calls.append(encode(Mode.CHECK, one._rules.plans(f"ip:{who}"), 1, None, 0))
        elif scenario in ("acquire+op", "many 1x1", "many 1x1 spread"):
            plans = one._rules.plans(f"ip:{who}")
            calls.append(encode(Mode.ACQUIRE, plans, 1, None, 0, f"c{run}:{i}:"))
        elif scenario == "many 1x1 spread, no op":
            calls.append(encode(Mode.ACQUIRE, one._rules.plans(f"ip:{who}"), 1, None, 0))
        elif scenario == "fleet of 64":  # client c<k> sends its (i // 64)-th op
            op = f"c{run}x{i % 64}:{i // 64 + 1}:"
            calls.append(encode(Mode.ACQUIRE, one._rules.plans(f"ip:{who}"), 1, None, 0, op))
        elif scenario == "lease take+release":  # op k taken by call 2k-1, released by 2k
            plans = Limiter("memory://", LEASE, prefix="cost")._rules.plans(f"ip:{who}")
            mode = Mode.ACQUIRE if i % 2 else Mode.RELEASE
            calls.append(encode(mode, plans, 1, None, 0, f"c{run}:{(i + 1) // 2}:"))
        elif scenario == "acquire+16 open":
            opened = ",".join(str(stamp) for stamp in range(max(1, i - 16), i))
            plans = one._rules.plans(f"ip:{who}")
            calls.append(encode(Mode.ACQUIRE, plans, 1, None, 0, f"c{run}:{i}:{opened}"))
        else:
            plans = three._rules.plans([f"ip:{who}", f"user:{who}"])
            calls.append(encode(Mode.ACQUIRE, plans, 1, None, 0, f"c{run}:{i}:"))
    return calls


async def server_us(
    client: Any, tag: str, scenario: str, calls: Sequence[Call]
) -> float:  # fmt: skip
    """Runs ``calls`` pipelined (500 a pipeline); server µs per decision."""
    await client.config_resetstat()
    for start in range(0, len(calls), 500):
        chunk = calls[start : start + 500]
        if scenario.startswith("many"):
            connection = await client.connection_pool.get_connection()
            try:
                head = command_head("FCALL", f"cost_many_{tag}")
                batches = [chunk[i : i + BATCH] for i in range(0, len(chunk), BATCH)]
                await connection.send_packed_command(
                    b"".join(pack_many(head, batch) for batch in batches)
                )
                for _ in batches:
                    reply = await connection.read_response()
                    if any(not isinstance(item, list) for item in reply):
                        raise RuntimeError(f"a call failed: {reply!r:.300}")
            finally:
                await client.connection_pool.release(connection)
            continue
        pipe = client.pipeline(transaction=False)
        for call in chunk:
            pipe.execute_command("FCALL", f"cost_{tag}", len(call.keys), *call.keys, *call.args)
        await pipe.execute()
    stats = await client.info("commandstats")
    return float(stats["cmdstat_fcall"]["usec"]) / len(calls)


async def floor_us(client: Any, key: str, count: int) -> float:
    """The floor scenario: ``count`` FCALLs of cost_floor pipelined; server µs per call."""
    await client.config_resetstat()
    for start in range(0, count, 500):
        pipe = client.pipeline(transaction=False)
        for _ in range(min(500, count - start)):
            pipe.execute_command("FCALL", "cost_floor", 1, key)
        await pipe.execute()
    stats = await client.info("commandstats")
    return float(stats["cmdstat_fcall"]["usec"]) / count


async def measure(directories: Sequence[Path], rounds: int, count: int) -> list[str]:
    from redis.asyncio import Redis

    server = cluster.start_standalone()
    lines = []
    with server:
        client = Redis.from_url(server.url)
        try:
            tags, many = [], []
            for index, directory in enumerate(directories):
                code, has_many = library(directory, str(index))
                await client.execute_command("FUNCTION", "LOAD", "REPLACE", code)  # type: ignore[no-untyped-call]
                tags.append(str(index))
                many.append(has_many)
            await client.execute_command("FUNCTION", "LOAD", "REPLACE", FLOOR)  # type: ignore[no-untyped-call]
            floor: list[float] = []
            found: dict[tuple[str, int], list[float]] = {}
            run = 0
            for round_ in range(rounds):
                order = list(range(len(tags)))
                if round_ % 2:
                    order.reverse()
                run += 1
                floor.append(await floor_us(client, f"cost:{{floor:{run}}}", count))
                for scenario in SCENARIOS:
                    for index in order:
                        if scenario.startswith("many") and not many[index]:
                            continue
                        run += 1
                        calls = program(scenario, run, count)
                        us = await server_us(client, tags[index], scenario, calls)
                        found.setdefault((scenario, index), []).append(us)
        finally:
            await client.aclose()
    for scenario in SCENARIOS:
        cells = []
        medians: list[float | None] = []
        for index, directory in enumerate(directories):
            values = found.get((scenario, index))
            if not values:
                cells.append(f"{directory!s:>20s}: -")
                medians.append(None)
                continue
            median = statistics.median(values)
            medians.append(median)
            cells.append(f"{directory!s:>20s}: best {min(values):6.2f} median {median:6.2f}")
        line = f"{scenario:22s} " + " | ".join(cells)
        if len(medians) == 2 and None not in medians:
            first, second = medians
            assert first is not None and second is not None
            line += f" | second/first {second / first:.2f}"
        lines.append(line)
    lines.append(f"{'floor':22s} best {min(floor):6.2f} median {statistics.median(floor):6.2f}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.script_cost", description=__doc__)
    parser.add_argument(
        "--lua",
        action="append",
        type=Path,
        default=None,
        help="a directory of the scripts (repeat for an A/B); default: lua/",
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--count", type=int, default=10_000, help="calls per scenario and round")
    args = parser.parse_args(argv)  # fmt: skip
    directories = args.lua or [Path(str(lua_dir()))]
    print("server µs per decision (FCALL, pipelined; INFO commandstats)")
    for line in asyncio.run(measure(directories, args.rounds, args.count)):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
