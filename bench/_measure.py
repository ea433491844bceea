"""Measuring helpers shared by the benchmarks: load loop, percentiles, client CPU, server time.

What one measured phase records (``measure``):

- decisions, admitted, errors and wall time of a closed-loop load: ``concurrency`` tasks, each
  awaiting one decision after another (``run_load``);
- each decision's latency (``time.perf_counter_ns``), summarised as nearest-rank percentiles;
- client CPU: ``time.process_time()`` over the phase (the whole process: event loop, parsing,
  garbage collection), divided by decisions;
- client commands: what redis-py's asyncio connections packed and wrote (``counting_commands``
  patches two methods for the run; the cost is one counter increment per command);
- server work: the delta of ``INFO commandstats`` summed over the server's primaries
  (``ServerStats``).

Redis counts a command a script runs (``redis.call``) in commandstats too, and a script's own
``usec`` already includes them, so summing every command double counts. The server time of a
decision is therefore the script commands' time plus, for any other command, only the share the
client itself sent (client count / server count of that command).
"""

from __future__ import annotations

import asyncio
import cProfile
import gc
import math
import pstats
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import redis
from redis.cluster import RedisCluster

Decide = Callable[[tuple[str, ...]], Awaitable[bool]]

#: Commands whose server time includes the commands they run.
SCRIPT_COMMANDS = frozenset({"eval", "evalsha", "eval_ro", "evalsha_ro", "fcall", "fcall_ro"})
#: Our own snapshots; never part of a contender's cost.
IGNORED_COMMANDS = frozenset({"info"})
#: A task that fails this many decisions in a row stops (a broken contender must not spin).
MAX_ERRORS_IN_A_ROW = 100


def percentile(ascending: Sequence[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0-100] of an ascending sequence; NaN when empty."""
    if not ascending:
        return math.nan
    rank = max(1, math.ceil(q / 100 * len(ascending)))
    return ascending[min(rank, len(ascending)) - 1]


def _command_name(raw: object) -> str:
    """``"EVALSHA"``, ``b"SCRIPT LOAD"`` -> ``"evalsha"``, ``"script"`` (commandstats' base)."""
    text = raw.decode() if isinstance(raw, (bytes, bytearray, memoryview)) else str(raw)
    words = text.split()
    return words[0].lower() if words else ""


# -- what the client sent -------------------------------------------------------------------


class CommandCounter:
    """Commands packed and socket writes made by redis-py asyncio connections (this process)."""

    def __init__(self) -> None:
        self.raw_commands: Counter[Any] = Counter()
        self.writes = 0

    def snapshot(self) -> tuple[dict[str, int], int]:
        """(commands by lower-case base name, writes) so far."""
        commands: Counter[str] = Counter()
        for raw, count in self.raw_commands.items():
            commands[_command_name(raw)] += count
        return dict(commands), self.writes


@contextmanager
def counting_commands() -> Iterator[CommandCounter]:
    """Counts every command redis-py's asyncio connections send while the block runs (and
    those aiolimit writes on their transports itself: ``resp.write_now``).

    A pipeline packs several commands into one write, so writes are round trips and commands
    are commands. Both methods are restored on exit.
    """
    from redis.asyncio.connection import AbstractConnection

    counter = CommandCounter()
    raw_commands = counter.raw_commands
    original_pack = AbstractConnection.pack_command
    original_send = AbstractConnection.send_packed_command

    def pack_command(self: Any, *args: Any) -> Any:
        raw_commands[args[0]] += 1
        return original_pack(self, *args)

    def send_packed_command(self: Any, *args: Any, **kwargs: Any) -> Any:
        counter.writes += 1
        if args and isinstance(args[0], bytes | bytearray):
            # Packed by hand (aiolimit's stores write RESP themselves, bypassing pack_command).
            for name in _packed_command_names(bytes(args[0])):
                raw_commands[name] += 1
        return original_send(self, *args, **kwargs)  # the coroutine, unchanged

    from aiolimit._stores import resp

    original_write_now = resp.write_now

    def write_now(connection: Any, packed: bytes) -> None:
        # aiolimit's lone calls write on the connection's transport directly.
        counter.writes += 1
        for name in _packed_command_names(packed):
            raw_commands[name] += 1
        original_write_now(connection, packed)

    AbstractConnection.pack_command = pack_command  # type: ignore[method-assign]
    AbstractConnection.send_packed_command = send_packed_command  # type: ignore[method-assign]
    resp.write_now = write_now
    try:
        yield counter
    finally:
        AbstractConnection.pack_command = original_pack  # type: ignore[method-assign]
        AbstractConnection.send_packed_command = original_send  # type: ignore[method-assign]
        resp.write_now = original_write_now


def _packed_command_names(buffer: bytes) -> list[bytes]:
    """The command names in a buffer of RESP commands packed by hand (cheaply: every command
    in such a buffer is taken to be the first one's, as aiolimit's stores write them)."""
    if not buffer.startswith(b"*"):
        return []
    head = buffer.index(b"\r\n")
    size_end = buffer.index(b"\r\n", head + 2)
    size = int(buffer[head + 3 : size_end])
    name = buffer[size_end + 2 : size_end + 2 + size]
    return [name] * (buffer.count(b"\r\n*") + 1)


# -- what the server did --------------------------------------------------------------------

CommandTotals = dict[str, tuple[int, int]]  # base command name -> (calls, usec)


def _delta(after: CommandTotals, before: CommandTotals) -> CommandTotals:
    out = {}
    for name, (calls, usec) in after.items():
        old_calls, old_usec = before.get(name, (0, 0))
        if calls != old_calls:
            out[name] = (calls - old_calls, usec - old_usec)
    return out


class ServerStats:
    """Synchronous access to a server's primaries: commandstats, key cleanup, MEMORY USAGE.

    ``ServerStats.from_url("redis://127.0.0.1:6379/0")`` watches one server (and its database
    for keys); ``"redis+cluster://host:port"`` discovers the cluster's primaries.
    """

    def __init__(self, clients: Sequence[redis.Redis]) -> None:
        self.clients = list(clients)

    @classmethod
    def from_url(cls, url: str) -> ServerStats:
        parts = urlsplit(url)
        if parts.scheme.endswith("+cluster"):
            seed = parts._replace(scheme=parts.scheme.removesuffix("+cluster")).geturl()
            cluster = RedisCluster.from_url(seed)
            try:
                nodes = [(node.host, node.port) for node in cluster.get_primaries()]
            finally:
                cluster.close()
            auth = {"username": parts.username, "password": parts.password}
            return cls([redis.Redis(host=h, port=p, **auth) for h, p in nodes])
        return cls([redis.Redis.from_url(url)])

    def snapshot(self) -> CommandTotals:
        totals: dict[str, list[int]] = {}
        for client in self.clients:
            stats: dict[str, dict[str, Any]] = client.info("commandstats")
            for key, values in stats.items():
                name = key.removeprefix("cmdstat_").split("|")[0]
                entry = totals.setdefault(name, [0, 0])
                entry[0] += int(values["calls"])
                entry[1] += int(values["usec"])
        return {name: (calls, usec) for name, (calls, usec) in totals.items()}

    def server_version(self) -> str:
        info: dict[str, Any] = self.clients[0].info("server")
        return str(info.get("redis_version", "?"))

    def keys(self, pattern: str) -> Iterator[tuple[redis.Redis, bytes]]:
        for client in self.clients:
            for key in client.scan_iter(match=pattern, count=1000):
                yield client, key

    def delete_matching(self, pattern: str) -> int:
        """UNLINKs every key matching ``pattern`` (a glob) on every primary; returns the count."""
        deleted = 0
        for client in self.clients:
            # One UNLINK per key: a cluster node refuses a multi-key UNLINK across slots.
            pipe = client.pipeline(transaction=False)
            for key in client.scan_iter(match=pattern, count=1000):
                pipe.unlink(key)
                if len(pipe) >= 500:
                    deleted += sum(pipe.execute())
            if len(pipe):
                deleted += sum(pipe.execute())
        return deleted

    def memory_usage(self, pattern: str) -> tuple[int, int]:
        """(number of keys, total bytes) of the keys matching ``pattern``, exactly (SAMPLES 0)."""
        count = total = 0
        for client, key in self.keys(pattern):
            usage = client.memory_usage(key, samples=0)
            count += 1
            total += int(usage or 0)
        return count, total

    def close(self) -> None:
        for client in self.clients:
            client.close()


# -- the load -------------------------------------------------------------------------------


@dataclass
class LoadResult:
    decisions: int
    admitted: int
    errors: int
    elapsed: float
    latencies_ns: list[int]
    first_error: str | None = None


async def run_load(
    decide: Decide,
    id_sets: Sequence[Sequence[tuple[str, ...]]],
    *,
    duration: float | None = None,
    count: int | None = None,
) -> LoadResult:
    """One task per entry of ``id_sets``; each decides on its id tuples in turn, back to back.

    Stops at ``duration`` seconds or after ``count`` decisions in all (split evenly over the
    tasks), whichever comes first; one of them is required. A failed decision is counted as an
    error and not timed; a task stops after ``MAX_ERRORS_IN_A_ROW`` failures in a row.
    """
    if duration is None and count is None:
        raise ValueError("run_load needs a duration or a count")
    per_task = math.inf if count is None else math.ceil(count / len(id_sets))
    clock = time.perf_counter_ns
    start = clock()
    deadline = math.inf if duration is None else start + duration * 1e9
    latencies: list[int] = []
    totals = {"admitted": 0, "errors": 0}
    first_error: list[str] = []

    async def worker(mine: Sequence[tuple[str, ...]]) -> None:
        done = admitted = in_a_row = 0
        local: list[int] = []
        size = len(mine)
        try:
            while done < per_task:
                t0 = clock()
                if t0 >= deadline:
                    break
                try:
                    allowed = await decide(mine[done % size])
                except Exception as exc:
                    totals["errors"] += 1
                    if not first_error:
                        cause = exc.__cause__ or exc.__context__
                        first_error.append(repr(exc) + (f" from {cause!r}" if cause else ""))
                    in_a_row += 1
                    if in_a_row >= MAX_ERRORS_IN_A_ROW:
                        break
                    done += 1
                    continue
                local.append(clock() - t0)
                in_a_row = 0
                admitted += allowed
                done += 1
        finally:
            latencies.extend(local)
            totals["admitted"] += admitted

    await asyncio.gather(*(worker(mine) for mine in id_sets))
    elapsed = (clock() - start) / 1e9
    return LoadResult(
        decisions=len(latencies),
        admitted=totals["admitted"],
        errors=totals["errors"],
        elapsed=elapsed,
        latencies_ns=latencies,
        first_error=first_error[0] if first_error else None,
    )


@dataclass
class Measurement:
    """One or more measured phases of one contender, summed."""

    decisions: int = 0
    admitted: int = 0
    errors: int = 0
    elapsed: float = 0.0
    cpu_seconds: float = 0.0
    latencies_ns: list[int] = field(default_factory=list)
    client_commands: dict[str, int] = field(default_factory=dict)
    client_writes: int = 0
    server: CommandTotals = field(default_factory=dict)
    rounds_per_second: list[float] = field(default_factory=list)
    first_error: str | None = None

    def add(self, other: Measurement) -> None:
        self.decisions += other.decisions
        self.admitted += other.admitted
        self.errors += other.errors
        self.elapsed += other.elapsed
        self.cpu_seconds += other.cpu_seconds
        self.latencies_ns.extend(other.latencies_ns)
        self.client_writes += other.client_writes
        for name, count in other.client_commands.items():
            self.client_commands[name] = self.client_commands.get(name, 0) + count
        for name, (calls, usec) in other.server.items():
            old_calls, old_usec = self.server.get(name, (0, 0))
            self.server[name] = (old_calls + calls, old_usec + usec)
        self.rounds_per_second.extend(other.rounds_per_second)
        self.first_error = self.first_error or other.first_error

    def _per_decision(self, value: float) -> float:
        return value / self.decisions if self.decisions else math.nan

    @property
    def decisions_per_second(self) -> float:
        return self.decisions / self.elapsed if self.elapsed else math.nan

    def latency_ms(self, q: float) -> float:
        ordered = sorted(self.latencies_ns)
        return percentile(ordered, q) / 1e6

    @property
    def cpu_us_per_decision(self) -> float:
        return self._per_decision(self.cpu_seconds * 1e6)

    def _top_level(self) -> tuple[float, float, float, float]:
        """(script usec, script calls, other usec, other calls) the client itself caused."""
        script_usec = script_calls = other_usec = other_calls = 0.0
        for name, (calls, usec) in self.server.items():
            if name in IGNORED_COMMANDS or calls <= 0:
                continue
            if name in SCRIPT_COMMANDS:
                script_usec += usec
                script_calls += calls
                continue
            share = min(1.0, self.client_commands.get(name, 0) / calls)
            other_usec += usec * share
            other_calls += calls * share
        return script_usec, script_calls, other_usec, other_calls

    @property
    def server_us_per_decision(self) -> float:
        script_usec, _, other_usec, _ = self._top_level()
        return self._per_decision(script_usec + other_usec)

    @property
    def server_us_per_call(self) -> float:
        """Mean server µs of a script call (of any top-level command when there are none)."""
        script_usec, script_calls, other_usec, other_calls = self._top_level()
        if script_calls:
            return script_usec / script_calls
        return other_usec / other_calls if other_calls else math.nan

    @property
    def commands_per_decision(self) -> float:
        """Commands the client sent per decision (a pipelined command counts)."""
        sent = sum(n for name, n in self.client_commands.items() if name not in IGNORED_COMMANDS)
        return self._per_decision(sent)

    @property
    def round_trips_per_decision(self) -> float:
        """Socket writes per decision: a pipeline or a multi-command write counts once."""
        return self._per_decision(self.client_writes)

    @property
    def server_commands_per_decision(self) -> float:
        """Every command the server ran per decision, including those run inside scripts."""
        ran = sum(calls for name, (calls, _) in self.server.items() if name not in IGNORED_COMMANDS)
        return self._per_decision(ran)

    def summary(self) -> dict[str, Any]:
        return {
            "decisions": self.decisions,
            "admitted": self.admitted,
            "errors": self.errors,
            "first_error": self.first_error,
            "elapsed_s": round(self.elapsed, 4),
            "decisions_per_s": round(self.decisions_per_second, 1),
            "rounds_decisions_per_s": [round(x, 1) for x in self.rounds_per_second],
            "p50_ms": round(self.latency_ms(50), 4),
            "p90_ms": round(self.latency_ms(90), 4),
            "p99_ms": round(self.latency_ms(99), 4),
            "p999_ms": round(self.latency_ms(99.9), 4),
            "cpu_us_per_decision": round(self.cpu_us_per_decision, 2),
            "server_us_per_call": round(self.server_us_per_call, 2),
            "server_us_per_decision": round(self.server_us_per_decision, 2),
            "commands_per_decision": round(self.commands_per_decision, 3),
            "round_trips_per_decision": round(self.round_trips_per_decision, 3),
            "server_commands_per_decision": round(self.server_commands_per_decision, 3),
            "client_commands": dict(sorted(self.client_commands.items())),
            "server_commandstats": {
                name: {"calls": calls, "usec": usec}
                for name, (calls, usec) in sorted(self.server.items())
            },
        }


async def measure(
    decide: Decide,
    id_sets: Sequence[Sequence[tuple[str, ...]]],
    *,
    duration: float | None = None,
    count: int | None = None,
    stats: ServerStats | None = None,
    counter: CommandCounter | None = None,
) -> Measurement:
    """One measured phase of ``run_load`` with CPU, client command and server deltas.

    The snapshots are taken outside the timed load; ``stats`` is queried synchronously, so no
    other contender should be running meanwhile (the deltas would mix).
    """
    gc.collect()
    server_before = stats.snapshot() if stats else {}
    commands_before, writes_before = counter.snapshot() if counter else ({}, 0)
    cpu_before = time.process_time()
    load = await run_load(decide, id_sets, duration=duration, count=count)
    cpu = time.process_time() - cpu_before
    commands_after, writes_after = counter.snapshot() if counter else ({}, 0)
    server = _delta(stats.snapshot(), server_before) if stats else {}
    commands = {
        name: n - commands_before.get(name, 0)
        for name, n in commands_after.items()
        if n != commands_before.get(name, 0)
    }
    return Measurement(
        decisions=load.decisions,
        admitted=load.admitted,
        errors=load.errors,
        elapsed=load.elapsed,
        cpu_seconds=cpu,
        latencies_ns=load.latencies_ns,
        client_commands=commands,
        client_writes=writes_after - writes_before,
        server=server,
        rounds_per_second=[load.decisions / load.elapsed if load.elapsed else math.nan],
        first_error=load.first_error,
    )


# -- profiles and tables --------------------------------------------------------------------


async def profiled(awaitable: Awaitable[Any]) -> tuple[Any, pstats.Stats]:
    """Awaits under cProfile (every task on the loop is profiled meanwhile)."""
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        result = await awaitable
    finally:
        profiler.disable()
    return result, pstats.Stats(profiler)


def _area(filename: str) -> str:
    for marker, area in (
        ("/aiolimit/", "aiolimit"),
        ("/redis/asyncio/", "redis-py asyncio"),
        ("/redis/", "redis-py"),
        ("/hiredis/", "hiredis"),
        ("/asyncio/", "asyncio"),
        ("/bench/", "bench loop"),
        ("/limits/", "limits"),
        ("/pyrate_limiter/", "pyrate"),
        ("/throttled/", "throttled"),
    ):
        if marker in filename:
            return area
    return "builtins" if filename == "~" else "other stdlib"


def profile_rows(
    stats: pstats.Stats, decisions: int, top: int = 25
) -> tuple[list[list[str]], list[list[str]]]:
    """(by area, top functions) as table rows in µs per decision (own time; cumulative)."""
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    areas: dict[str, float] = {}
    functions = []
    for (filename, line, name), (_, calls, own, cumulative, _) in raw.items():
        area = _area(filename)
        areas[area] = areas.get(area, 0.0) + own
        short = filename.rsplit("site-packages/", 1)[-1].rsplit("/work/main/", 1)[-1]
        functions.append((own, cumulative, calls, f"{short}:{line}({name})"))
    total = sum(areas.values())
    by_area = [
        [area, f"{own / decisions * 1e6:.1f}", f"{own / total * 100:.0f}%"]
        for area, own in sorted(areas.items(), key=lambda item: -item[1])
    ]
    functions.sort(reverse=True)
    by_function = [
        [
            where,
            f"{own / decisions * 1e6:.2f}",
            f"{cum / decisions * 1e6:.2f}",
            f"{n / decisions:.2f}",
        ]
        for own, cum, n, where in functions[:top]
    ]
    return by_area, by_function


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain text table; the first column left-aligned, the others right-aligned."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            str(cell).ljust(width) if i == 0 else str(cell).rjust(width)
            for i, (cell, width) in enumerate(zip(cells, widths, strict=True))
        )

    rule = "  ".join("-" * width for width in widths)
    return "\n".join([line(headers), rule, *(line(row) for row in rows)])
