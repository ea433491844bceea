"""A call on a slot being migrated, whose keys are all still here, runs whole.

While a slot is MIGRATING, its node serves the keys it still holds and answers "non local
key" (an ASK, inside a script) for any key it does not hold, a key the script itself just
emptied included. Redis keeps the writes of a script that fails part way, so a call that
empties a sorted set and touches it again (a trim that removes the last expired entry, then
the new entry's ZADD; an UNLINK, then a PEXPIRE or the reply's read) would be answered with
an error and leave part of its writes: a charge or a credit that nobody recorded.

The algorithms never touch a key again after emptying it: they add before they remove, keep
one entry rather than empty a set they go on using, and remember in the call what they
emptied (it reads as empty). The oracle is the same program on an identifier in a stable
slot of the same node: every reply and every stored key must match. Each test module run
starts a private 2-primary cluster (redis-server, and Valkey where a binary is found).
"""

from __future__ import annotations

import asyncio
import random
import zlib
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import AbstractContextManager, asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import AskError, ResponseError, TryAgainError
from test_decide_many import _value, _workload
from test_decide_node import _slot_of

import cluster
from aiolimit import BaseLimit, Concurrency, Limit, Limiter, RateLimited, SlidingLog
from aiolimit._calls import Call, Mode, decide_library, encode

pytestmark = pytest.mark.cluster

T0 = 1_700_000_000_000_000
SECOND = 1_000_000
VALKEY = cluster.find_valkey_binary()


@pytest.fixture(scope="module", params=["redis", "valkey"])
def nodes(request: pytest.FixtureRequest) -> Iterator[cluster.Cluster]:
    if request.param == "valkey" and VALKEY is None:
        pytest.skip("no valkey-server")
    with cluster.start_cluster(
        primaries=2,
        replicas_per_primary=0,
        binary=VALKEY if request.param == "valkey" else None,
    ) as started:
        yield started


@contextmanager
def _migrating(source: cluster.Node, target: cluster.Node, *slots: int) -> Iterator[None]:
    """The slots MIGRATING from ``source`` to ``target`` (keys stay where they are), then
    STABLE again."""
    for slot in slots:
        target.execute("CLUSTER", "SETSLOT", slot, "IMPORTING", source.node_id)
        source.execute("CLUSTER", "SETSLOT", slot, "MIGRATING", target.node_id)
    try:
        yield
    finally:
        for slot in slots:
            for node in (target, source):
                node.execute("CLUSTER", "SETSLOT", slot, "STABLE")


@dataclass(frozen=True)
class Step:
    mode: Mode
    at: float  # seconds after T0
    weight: int = 1
    op: int = 0  # the op's stamp (the undone op's, for an undo); 0: the step's own number
    open: str = ""  # older stamps still open (their undo may come)


def _acquire(at: float, weight: int = 1) -> Step:
    return Step(Mode.ACQUIRE, at, weight)


# name: (limits, the steps before the migration starts, the step run while it is under way)
PROGRAMS: dict[str, tuple[list[BaseLimit], list[Step], Step]] = {
    "log charge after its only entry expired": (
        [SlidingLog(3, per=60)],
        [_acquire(0)],
        _acquire(61),
    ),
    "log charge after every entry expired, several": (
        [SlidingLog(3, per=60), Limit(5, per=60)],
        [_acquire(0), _acquire(1, 2)],
        _acquire(70),
    ),
    "log charge at its newest entry's time": (
        [SlidingLog(3, per=60)],
        [_acquire(0)],
        _acquire(0),
    ),
    "log charge whose tidy deletes the last voided entries": (
        [SlidingLog(1000, per=60)],
        [_acquire(0)]
        + [_acquire(30 + i / 1000) for i in range(130)]
        + [Step(Mode.REFUND, 31, 130)],
        _acquire(61),
    ),
    "log refund of everything (UNLINK, then its TTL)": (
        # The minute log holds 61 s and 62 s (the trim at 62 s took 0 s): a refund of 2
        # empties it; the hour log keeps its 0 s entry.
        [SlidingLog(10, per=3600), SlidingLog(10, per=60)],
        [_acquire(0, 3), _acquire(61), _acquire(62)],
        Step(Mode.REFUND, 63, 2),
    ),
    "log refund that cuts its oldest entry": (
        [SlidingLog(5, per=60)],
        [_acquire(0, 3)],
        Step(Mode.REFUND, 1, 2),
    ),
    "log undo of its only entry": (
        [SlidingLog(5, per=60)],
        [_acquire(0, 2)],
        Step(Mode.UNDO, 1, 2, op=1),
    ),
    "log undo that rewrites a later entry into its own name": (
        # "2/2" then "4/2": undoing the first rewrites the second as "2/2".
        [SlidingLog(5, per=60)],
        [_acquire(0, 2), Step(Mode.ACQUIRE, 1, 2, open="1")],
        Step(Mode.UNDO, 2, 2, op=1),
    ),
    "lease acquire after its only lease expired": (
        [Concurrency(2, lease_ttl=5)],
        [_acquire(0)],
        _acquire(6),
    ),
    "lease release of its only lease": (
        [Concurrency(2, lease_ttl=5), Limit(10, per=60)],
        [_acquire(0)],
        Step(Mode.RELEASE, 1, op=1),
    ),
    "lease undo of its only lease": (
        [Concurrency(2, lease_ttl=5)],
        [_acquire(0)],
        Step(Mode.UNDO, 1, op=1),
    ),
}


def _two_slots(nodes: cluster.Cluster, node: cluster.Node, prefix: str) -> tuple[str, str]:
    """Two identifiers on ``node``, on slots of their own."""
    found: dict[int, str] = {}
    for i in range(20_000):
        identifier = f"ip:{i}"
        slot = _slot_of(prefix, identifier)
        if nodes.node_for_slot(slot).port == node.port:
            found.setdefault(slot, identifier)
            if len(found) == 2:
                first, second = found.values()
                return first, second
    raise AssertionError(f"no two identifiers on {node!r}")


def _encoded(
    limits: Sequence[BaseLimit], prefix: str, identifier: str, step: Step, number: int
) -> Call:
    """Step ``number`` of a program as a call, with an op id as the limiter sends one."""
    plans = Limiter("memory://", list(limits), prefix=prefix)._rules.plans(identifier)
    op = f"c:{step.op or number}:{step.open}"
    return encode(step.mode, plans, step.weight, T0 + int(step.at * SECOND), 0, op)


async def _run(
    client: Redis,
    limits: Sequence[BaseLimit],
    prefix: str,
    identifier: str,
    step: Step,
    number: int,
) -> Any:
    """Runs step ``number`` of a program as one FCALL (keys declared): its reply as data."""
    call = _encoded(limits, prefix, identifier, step, number)
    try:
        reply = await client.execute_command(  # type: ignore[no-untyped-call]
            "FCALL", decide_library().function, len(call.keys), *call.keys, *call.args
        )
    except ResponseError as error:
        reply = error
    return _value(reply)


async def _stored(client: Redis, prefix: str, identifier: str) -> dict[str, Any]:
    """The identifier's keys (named without prefix and identifier): their values, and whether
    each has a TTL."""
    state: dict[str, Any] = {}
    async for key in client.scan_iter(match=f"{prefix}:{{{identifier}}}*"):
        name = key.decode()[len(prefix) :].replace("{" + identifier + "}", "{ID}")
        if (await client.type(key)).decode() == "hash":
            value: Any = await client.hgetall(key)
        else:
            value = await client.zrange(key, 0, -1, withscores=True)
        state[name] = (value, await client.pttl(key) > 0)
    return state


@asynccontextmanager
async def _set_up(
    nodes: cluster.Cluster, prefix: str, limits: Sequence[BaseLimit], setup: Sequence[Step]
) -> AsyncIterator[tuple[Redis, str, str, AbstractContextManager[None]]]:
    """A client of the first primary (the library loaded), an identifier to move and a stable
    one on slots of their own there, ``setup`` run on both, and a context manager that keeps
    the first one's slot MIGRATING."""
    source, target = nodes.primaries()[:2]
    moving, stable = _two_slots(nodes, source, prefix)
    client = Redis(host=source.host, port=source.port)
    try:
        await client.execute_command("FUNCTION", "LOAD", "REPLACE", decide_library().code)
        for number, step in enumerate(setup, 1):
            for identifier in (moving, stable):
                reply = await _run(client, limits, prefix, identifier, step, number)
                assert not isinstance(reply[0], str), reply
        yield client, moving, stable, _migrating(source, target, _slot_of(prefix, moving))
    finally:
        await client.aclose()


@pytest.mark.parametrize("name", list(PROGRAMS))
async def test_a_call_on_a_migrating_slot_runs_whole_as_on_a_stable_one(
    nodes: cluster.Cluster, name: str
) -> None:
    limits, setup, last = PROGRAMS[name]
    prefix = f"m{zlib.crc32(name.encode()) % 10**6}"
    async with _set_up(nodes, prefix, limits, setup) as (client, moving, stable, migrating):
        with migrating:
            number = len(setup) + 1
            expected = await _run(client, limits, prefix, stable, last, number)
            got = await _run(client, limits, prefix, moving, last, number)
            stored = await _stored(client, prefix, moving)
        assert got == expected
        assert stored == await _stored(client, prefix, stable)


async def _snapshot(client: Redis, keys: Sequence[str]) -> list[tuple[bytes, int] | None]:
    """Each key's serialized value and TTL (ms), None for a missing one."""
    taken: list[tuple[bytes, int] | None] = []
    for key in keys:
        value = await client.dump(key)
        taken.append(None if value is None else (value, await client.pttl(key)))
    return taken


async def _restore(
    client: Redis, keys: Sequence[str], taken: Sequence[tuple[bytes, int] | None]
) -> None:
    for key, item in zip(keys, taken, strict=True):
        await client.delete(key)
        if item is not None:
            await client.restore(key, max(item[1], 0), item[0])


@pytest.mark.parametrize("seed", [21, 22])
async def test_random_programs_on_a_migrating_slot_run_whole_or_not_at_all(
    nodes: cluster.Cluster, seed: int
) -> None:
    """decide_many's random programs (every algorithm, ops, undos, releases, refunds, errors)
    on one identifier. Before each call, its keys are copied to an identifier of a stable slot
    of the same node; the call runs there, and on the original while its slot is MIGRATING.
    Each call on the migrating slot either answers and stores exactly as on the stable copy,
    or is redirected (ASK, TRYAGAIN: a key of it is missing) having written nothing, and then
    runs as on the copy once the slot is stable again."""
    source, target = nodes.primaries()[:2]
    prefix = f"w{seed}"
    moving, stable = _two_slots(nodes, source, prefix)
    slot = _slot_of(prefix, moving)
    program = _workload(prefix, seed, 250, groups=[[moving]])
    function = decide_library().function

    async def run(keys: Sequence[str], args: Sequence[Any]) -> Any:
        try:
            return _value(await client.execute_command("FCALL", function, len(keys), *keys, *args))
        except (AskError, TryAgainError):
            raise
        except ResponseError as error:
            return _value(error)

    whole = redirected = 0
    client = Redis(host=source.host, port=source.port)
    try:
        await client.execute_command("FUNCTION", "LOAD", "REPLACE", decide_library().code)
        for call in program:
            copy = [key.replace("{" + moving + "}", "{" + stable + "}") for key in call.keys]
            before = await _snapshot(client, call.keys)
            await _restore(client, copy, before)
            expected = await run(copy, call.args)
            stored = await _stored(client, prefix, stable)
            with _migrating(source, target, slot):
                try:
                    got = await run(call.keys, call.args)
                    whole += 1
                except (AskError, TryAgainError):
                    got = None
                    redirected += 1
            if got is None:
                after = await _snapshot(client, call.keys)
                # The same values, and no TTL raised (they only ran down meanwhile).
                assert [item and item[0] for item in after] == [
                    item and item[0] for item in before
                ], "wrote, then redirected"
                assert all(
                    a is None or b is None or a[1] <= b[1]
                    for a, b in zip(after, before, strict=True)
                ), "a TTL was set, then redirected"
                got = await run(call.keys, call.args)
            assert got == expected, call.args
            assert await _stored(client, prefix, moving) == stored, call.args
    finally:
        await client.aclose()
    # Both ways were taken, the one this file is about often.
    assert whole > 100 and redirected > 5, (whole, redirected)


async def test_leases_and_logs_under_a_slow_live_migration_lose_nothing(
    nodes: cluster.Cluster,
) -> None:
    """6 tasks take a lease and log a request on 4 identifiers (``async with limiter.limit``,
    released on exit), and give the request back inside (``refund``, as after an upstream
    error), while the slots stay MIGRATING for half a second, then move. A refund that empties
    a log and a release that empties a lease set happen all the time on the migrating node: no
    error reaches a caller, no log keeps a unit, and every lease is released."""
    source, target = nodes.primaries()[:2]
    prefix = "live"
    found: dict[int, str] = {}
    for i in range(20_000):
        identifier = f"ip:{i}"
        slot = _slot_of(prefix, identifier)
        if nodes.node_for_slot(slot).port == source.port:
            found.setdefault(slot, identifier)
            if len(found) == 4:
                break
    hot = list(found.values())
    limits: list[BaseLimit] = [SlidingLog(100_000, per=3600), Concurrency(3, lease_ttl=60)]
    admitted: Counter[str] = Counter()
    errors: list[BaseException] = []
    stop = asyncio.Event()
    url = f"redis+cluster://{source.host}:{source.port}"
    async with Limiter(url, limits, prefix=prefix, deadline=5.0) as limiter:

        async def worker(seed: int) -> None:
            rng = random.Random(seed)
            while not stop.is_set():
                identifier = rng.choice(hot)
                try:
                    async with limiter.limit(identifier, timeout=0):
                        admitted[identifier] += 1
                        await asyncio.sleep(rng.random() / 1000)
                        await limiter.refund(identifier)
                except RateLimited:
                    await asyncio.sleep(0)
                except Exception as error:  # collected: the test's verdict
                    errors.append(error)

        tasks = [asyncio.create_task(worker(seed)) for seed in range(6)]
        try:
            await asyncio.sleep(0.2)
            for slot in found:
                target.execute("CLUSTER", "SETSLOT", slot, "IMPORTING", source.node_id)
                source.execute("CLUSTER", "SETSLOT", slot, "MIGRATING", target.node_id)
            await asyncio.sleep(0.5)
            await asyncio.to_thread(nodes.migrate_slots, list(found), target, 1, 3)
            await asyncio.sleep(0.2)
        finally:
            stop.set()
            await asyncio.gather(*tasks)
    assert errors == [], errors[:3]
    assert all(nodes.node_for_slot(slot).port == target.port for slot in found)
    client = Redis(host=target.host, port=target.port)
    try:
        for identifier in hot:
            logged = await client.zrange(f"{prefix}:{{{identifier}}}:log:3600000000", 0, -1)
            assert admitted[identifier] > 20
            assert logged == [], identifier
            # (a release leaves the placeholder "~" rather than empty the set)
            leases = await client.zrange(f"{prefix}:{{{identifier}}}:lease", 0, -1)
            assert leases in ([], [b"~"]), leases
    finally:
        await client.aclose()


async def test_a_batched_call_after_one_that_emptied_its_set_is_sent_again(
    nodes: cluster.Cluster,
) -> None:
    """Two refunds of one identifier in one tick are one decide_many call on its slot (keys
    declared, checked once at the command's entry). On a migrating slot the first empties the
    log (UNLINK); the second would then meet the emptied log as "non local key". It is
    refused before it runs, tagged as not served, and sent again through the cluster client
    (TRYAGAIN until the slot settles): no error reaches either caller, and the log's two units
    are back."""
    source, target = nodes.primaries()[:2]
    prefix = "again"
    moving, _ = _two_slots(nodes, source, prefix)
    slot = _slot_of(prefix, moving)
    url = f"redis+cluster://{source.host}:{source.port}"
    async with Limiter(url, [SlidingLog(3, per=3600)], prefix=prefix, deadline=3.0) as limiter:
        for _ in range(2):
            assert (await limiter.try_acquire(moving)).allowed
        assert (await limiter.peek(moving)).remaining == 1
        target.execute("CLUSTER", "SETSLOT", slot, "IMPORTING", source.node_id)
        source.execute("CLUSTER", "SETSLOT", slot, "MIGRATING", target.node_id)

        async def settle() -> None:
            await asyncio.sleep(0.3)
            for node in (target, source):
                node.execute("CLUSTER", "SETSLOT", slot, "STABLE")

        try:
            results = await asyncio.gather(
                limiter.refund(moving, weight=2), limiter.refund(moving), settle(),
                return_exceptions=True,
            )  # fmt: skip
        finally:
            for node in (target, source):
                node.execute("CLUSTER", "SETSLOT", slot, "STABLE")
        assert not any(isinstance(result, BaseException) for result in results), results
        assert (await limiter.peek(moving)).remaining == 3


async def _run_many(client: Redis, calls: Sequence[Call]) -> Any:
    """The calls as one FCALL of decide_many (keys declared), as the stores send a pipeline."""
    keys: list[Any] = []
    args: list[Any] = [len(calls)]
    for call in calls:
        keys += call.keys
        args += [len(call.keys), len(call.args), *call.args]
    try:
        reply = await client.execute_command(  # type: ignore[no-untyped-call]
            "FCALL", decide_library().many, len(keys), *keys, *args
        )
    except ResponseError as error:
        reply = error
    return _value(reply)


# name: (limits, steps before the migration, one batch run while it is under way, steps after)
BATCHES: dict[str, tuple[list[BaseLimit], list[Step], list[Step], list[Step]]] = {
    # The minute log holds 61 s and 62 s: the first refund empties it; the second credits the
    # hour log, then reads the minute log. A resend of the second must replay, not credit.
    "a refund after a refund that emptied a log": (
        [SlidingLog(10, per=3600), SlidingLog(10, per=60)],
        [_acquire(0, 3), _acquire(61), _acquire(62)],
        [Step(Mode.REFUND, 63, 2, op=4), Step(Mode.REFUND, 63, 1, op=5)],
        [Step(Mode.REFUND, 63, 1, op=5), Step(Mode.PEEK, 64, 1, op=9)],
    ),
    # Ops 1 and 2 share one log entry (same instant), op 3 comes later and its charge trims
    # their expired leases. Op 3's release empties the lease set; op 1's undo then credits
    # the log and reads the lease set. Its retry must credit nothing of op 2's.
    "an undo after a release that emptied the lease set": (
        [SlidingLog(5, per=3600), Concurrency(5, lease_ttl=1)],
        [_acquire(0), Step(Mode.ACQUIRE, 0, open="1"), Step(Mode.ACQUIRE, 2, open="1")],
        [Step(Mode.RELEASE, 2.5, op=3, open="1"), Step(Mode.UNDO, 2.5, op=1)],
        [Step(Mode.UNDO, 3, op=1), Step(Mode.PEEK, 3, 1, op=9)],
    ),
    # A release of more leases than the op holds, past one ZREM slice (1,000 members): the
    # first slice empties the set, the second must not touch it.
    "a release past one ZREM slice": (
        [Concurrency(1000, lease_ttl=30)],
        [_acquire(0, 1000)],
        [Step(Mode.RELEASE, 1, 1500, op=1)],
        [Step(Mode.PEEK, 2, 1, op=9)],
    ),
}


@pytest.mark.parametrize("name", list(BATCHES))
async def test_a_batch_on_a_migrating_slot_ends_as_on_a_stable_one(
    nodes: cluster.Cluster, name: str
) -> None:
    """A decide_many batch whose earlier call empties a set a later call touches. On the
    migrating slot the later call is refused before it runs, tagged "aiolimit: unserved: "
    (the cluster store sends such a call again alone, as done here once the slot is stable):
    every reply, and what is stored, ends as on a stable slot."""
    limits, setup, batch, after = BATCHES[name]
    prefix = f"b{zlib.crc32(name.encode()) % 10**6}"
    async with _set_up(nodes, prefix, limits, setup) as (client, moving, stable, migrating):
        first = len(setup) + 1

        def calls(identifier: str) -> list[Call]:
            return [_encoded(limits, prefix, identifier, s, first + i) for i, s in enumerate(batch)]

        expected = await _run_many(client, calls(stable))
        with migrating:
            got = await _run_many(client, calls(moving))
        for i, reply in enumerate(got):
            if isinstance(reply, tuple) and "aiolimit: unserved: " in reply[1]:
                got[i] = await _run(client, limits, prefix, moving, batch[i], first + i)
        assert got == expected
        for number, step in enumerate(after, first + len(batch)):
            assert await _run(client, limits, prefix, moving, step, number) == await _run(
                client, limits, prefix, stable, step, number
            ), step
        assert await _stored(client, prefix, moving) == await _stored(client, prefix, stable)
