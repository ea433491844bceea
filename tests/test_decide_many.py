"""decide_many (lua/decide.lua): a pipeline's calls in one script run, on a real server.

The standalone store sends a pipeline of calls as one FCALL of decide_many, which reads each
main key and TIME once for the whole batch. Its promise: the replies and the stored state are
exactly those of the same calls sent one by one, in order; a call that fails is that call's
error alone, and the calls after it see none of its writes.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from aiolimit import Concurrency, Limit, Limiter, SlidingLog, TokenBucket
from aiolimit._calls import Call, Mode, decide_library, encode
from aiolimit._stores.resp import pack_many

T0 = 1_700_000_000_000_000
IDENTIFIERS = ("ip:a", "ip:b", "user:c")
LIMITS = [
    Limit(6, per=1, precision=0.1),
    Limit(20, per=10),
    TokenBucket(3, per=1, burst=4),
    SlidingLog(8, per=2),
    Concurrency(5, lease_ttl=30),
]


def _value(reply: Any) -> Any:
    """A reply as comparable data: an error by its message."""
    if isinstance(reply, ResponseError):
        return ("error", str(reply))
    if isinstance(reply, list):
        return [_value(item) for item in reply]
    return reply


async def _one_by_one(client: Redis, calls: Sequence[Call]) -> list[Any]:
    name = decide_library().function
    replies = []
    for call in calls:
        try:
            replies.append(
                await client.execute_command("FCALL", name, len(call.keys), *call.keys, *call.args)
            )
        except ResponseError as error:
            replies.append(error)
    return [_value(reply) for reply in replies]


async def _many(client: Redis, calls: Sequence[Call]) -> list[Any]:
    """The calls as one FCALL of decide_many, packed as the store packs them."""
    connection = await client.connection_pool.get_connection()
    try:
        head = b"$5\r\nFCALL\r\n$%d\r\n%b\r\n" % (
            len(decide_library().many),
            decide_library().many.encode(),
        )
        await connection.send_packed_command(pack_many(head, calls))
        try:
            reply = await connection.read_response()
        except ResponseError as error:
            return [("error", str(error))] * len(calls)
    finally:
        await client.connection_pool.release(connection)
    assert isinstance(reply, list) and len(reply) == len(calls)
    return [_value(item) for item in reply]


async def _state(client: Redis, prefix: str) -> dict[str, Any]:
    """Every key under prefix (named without it): a hash's fields, a sorted set's members."""
    state: dict[str, Any] = {}
    async for key in client.scan_iter(match=f"{prefix}:*"):
        name = key.decode()[len(prefix) :]
        kind = (await client.type(key)).decode()
        if kind == "hash":
            state[name] = await client.hgetall(key)
        else:
            state[name] = await client.zrange(key, 0, -1, withscores=True)
    return state


def _workload(
    prefix: str,
    seed: int,
    count: int,
    *,
    idle: bool = False,
    groups: Sequence[Sequence[str]] = (IDENTIFIERS,),
) -> list[Call]:
    """A random program: acquires, refunds, undos, releases, checks and peeks over one or two
    identifiers, weights 0 to 3, two clients' ops, times moving by -50 to +150 ms (a key's time
    never runs backwards: a later call must see the time an earlier one of its batch wrote);
    and now and then a call the script refuses (an unknown mode, an op it cannot parse).
    ``idle``: three clients, and now and then 16 minutes of silence, after which the script
    prunes the idle clients' ledgers. A call names identifiers of one of ``groups`` (on Redis
    Cluster: identifiers sharing a slot)."""
    rng = random.Random(seed)
    limiter = Limiter("memory://", LIMITS, prefix=prefix)
    clients = ("c1", "c2", "c3") if idle else ("c1", "c2")
    stamps = dict.fromkeys(clients, 0)
    done: list[str] = []  # acquire ops sent, "<client>:<stamp>"
    now = T0
    calls = []
    for _ in range(count):
        now += rng.randrange(-50_000, 150_000)  # a clock behind now and then: time is max'ed
        if idle and rng.random() < 0.03:
            now += 16 * 60_000_000
        group = groups[0] if len(groups) == 1 else rng.choice(groups)
        chosen = rng.sample(group, min(len(group), rng.choice((1, 1, 2))))
        plans = [limiter._rules.plans(identifier)[0] for identifier in chosen]
        client = rng.choice(clients)
        roll = rng.random()
        weight = rng.randrange(0, 4)
        if roll < 0.04:
            calls.append(encode(Mode.CHECK, plans, weight, now, 0))
            calls[-1].args[0] = "bogus"
            continue
        if roll < 0.06:
            calls.append(encode(Mode.ACQUIRE, plans, weight, now, 0, "not an op"))
            continue
        if roll < 0.16 and done:
            op = rng.choice(done)
            mode = rng.choice((Mode.UNDO, Mode.RELEASE, Mode.RENEW))
            calls.append(encode(mode, plans, max(weight, 1), now, 0, op + ":"))
            continue
        if roll < 0.3:
            calls.append(encode(rng.choice((Mode.CHECK, Mode.PEEK)), plans, weight, now, 0))
            continue
        stamps[client] += 1
        stamp = stamps[client]
        opened = sorted(rng.sample(range(max(1, stamp - 6), stamp), min(stamp - 1, 2)))
        op = f"{client}:{stamp}:{','.join(map(str, opened))}"
        mode = Mode.REFUND if roll < 0.4 else Mode.ACQUIRE
        calls.append(encode(mode, plans, weight, now, 0, op, penalty=rng.random() < 0.1))
        if mode is Mode.ACQUIRE:
            done.append(f"{client}:{stamp}")
    return calls


@pytest.mark.parametrize(
    ("seed", "idle"), [(1, False), (2, False), (3, False), (4, True), (5, True)]
)
async def test_a_batch_decides_and_writes_exactly_as_its_calls_one_by_one(
    server: Redis, prefix: str, seed: int, idle: bool
) -> None:
    alone = _workload(f"{prefix}a", seed, 300, idle=idle)
    batched = _workload(f"{prefix}b", seed, 300, idle=idle)
    expected = await _one_by_one(server, alone)
    rng = random.Random(seed)
    got: list[Any] = []
    at = 0
    while at < len(batched):
        size = rng.randrange(1, 13)
        got += await _many(server, batched[at : at + size])
        at += size
    assert got == expected
    admitted = sum(1 for reply in expected if isinstance(reply, list) and reply[0] == 1)
    refused = sum(1 for reply in expected if isinstance(reply, list) and reply[0] == 0)
    errors = sum(1 for reply in expected if isinstance(reply, tuple))
    # The program exercised what it claims to: admissions, refusals and errors alike.
    assert admitted > 50 and refused > 20 and errors > 5, (admitted, refused, errors)
    assert await _state(server, f"{prefix}b") == await _state(server, f"{prefix}a")


async def test_a_call_that_fails_part_way_is_its_own_error_and_writes_nothing(
    server: Redis, prefix: str
) -> None:
    """The middle call's block names a key the call was not given: it is refused before it
    reads anything (it must not take the next call's key for its own). The calls around it
    answer as they would alone, and the last sees only the first's charge."""
    limiter = Limiter("memory://", [Limit(10, per=60)], prefix=prefix)
    plans = limiter._rules.plans("ip:x")
    first = encode(Mode.ACQUIRE, plans, 3, T0, 0, "c:1:")
    broken = encode(Mode.ACQUIRE, plans, 4, T0, 0, "c:2:")
    broken = Call(broken.mode, [], broken.args, broken.plans)  # its block wants one key
    last = encode(Mode.ACQUIRE, plans, 2, T0, 0, "c:3:")
    first_reply, failed, last_reply = await _many(server, [first, broken, last])
    assert first_reply[0] == 1 and first_reply[4] == 7  # 10 - 3
    assert failed[0] == "error" and "aiolimit" in failed[1]
    assert last_reply[0] == 1 and last_reply[4] == 5  # 10 - 3 - 2: nothing of the 4
    peek = encode(Mode.PEEK, plans, 0, T0, 0)
    assert (await _one_by_one(server, [peek]))[0][4] == 5


async def test_a_call_that_raises_part_way_is_its_own_error(server: Redis, prefix: str) -> None:
    """The middle call's second identifier is not a hash: its read raises (WRONGTYPE) after
    its first identifier was loaded. That call alone fails; the batch drops what it held
    loaded, and the last call sees exactly the first's charge."""
    limiter = Limiter("memory://", [Limit(10, per=60)], prefix=prefix)
    plans = limiter._rules.plans("ip:x")
    both = limiter._rules.plans(["ip:x", "ip:not-a-hash"])
    await server.set(both[1].keys[0], "a string")
    first = encode(Mode.ACQUIRE, plans, 3, T0, 0, "c:1:")
    broken = encode(Mode.ACQUIRE, both, 4, T0, 0, "c:2:")
    last = encode(Mode.ACQUIRE, plans, 2, T0, 0, "c:3:")
    first_reply, failed, last_reply = await _many(server, [first, broken, last])
    assert first_reply[0] == 1 and first_reply[4] == 7
    assert failed[0] == "error" and "WRONGTYPE" in failed[1]
    assert last_reply[0] == 1 and last_reply[4] == 5
    assert await server.get(both[1].keys[0]) == b"a string"


async def _dumped(client: Redis, prefix: str) -> dict[bytes, bytes | None]:
    """Every key under prefix, serialized (whatever its type)."""
    return {key: await client.dump(key) async for key in client.scan_iter(match=f"{prefix}:*")}


@pytest.mark.parametrize("batched", [False, True], ids=["alone", "batched"])
@pytest.mark.parametrize("mode", [Mode.REFUND, Mode.UNDO, Mode.RELEASE])
async def test_a_writing_call_whose_last_set_is_not_a_set_writes_nothing(
    server: Redis, prefix: str, mode: Mode, batched: bool
) -> None:
    """A refund, an undo or a release over two identifiers' logs and leases, the last sorted
    set it would touch planted with a string: refused (WRONGTYPE) before its first write.
    (An acquire reads every set before it writes; these modes wrote the first identifier's
    sets, then failed on the second's, and Redis keeps a failed script's writes.)"""
    limiter = Limiter(
        "memory://", [SlidingLog(5, per=60), Concurrency(3, lease_ttl=30)], prefix=prefix
    )
    plans = limiter._rules.plans(["ip:x", "ip:y"])
    acquire = encode(Mode.ACQUIRE, plans, 2, T0, 0, "c:1:")
    assert (await _one_by_one(server, [acquire]))[0][0] == 1
    planted = plans[1].keys[2 if mode is Mode.RELEASE else 1]  # ip:y's lease set, or its log
    assert await server.type(planted) == b"zset"
    await server.delete(planted)
    await server.set(planted, "a string")
    before = await _dumped(server, prefix)
    op = "" if mode is Mode.REFUND else "c:1:"
    call = encode(mode, plans, 2, T0 + 1000, 0, op)
    peek = encode(Mode.PEEK, limiter._rules.plans("ip:x"), 0, T0 + 1000, 0)
    if batched:
        failed, after = await _many(server, [call, peek])
    else:
        (failed,) = await _one_by_one(server, [call])
        (after,) = await _one_by_one(server, [peek])
    assert failed[0] == "error" and "WRONGTYPE" in failed[1], failed
    assert await _dumped(server, prefix) == before
    assert after[4] == 3 and after[8] == 1  # ip:x: 2 of 5 logged, 2 of 3 leases still held


async def test_a_call_with_fewer_blocks_than_it_announces_is_refused(
    server: Redis, prefix: str
) -> None:
    """A call announcing more identifier blocks than it carries is an error of its own, alone
    or in a batch (in a batch it must not read the next call's arguments as its blocks)."""
    limiter = Limiter("memory://", [Limit(10, per=60)], prefix=prefix)
    plans = limiter._rules.plans("ip:x")
    good = encode(Mode.ACQUIRE, plans, 3, T0, 0, "c:1:")
    short = encode(Mode.ACQUIRE, plans, 4, T0, 0, "c:2:")
    short = Call(short.mode, short.keys, [*short.args[:6], 2, *short.args[7:]], short.plans)
    (alone,) = await _one_by_one(server, [short])
    assert alone[0] == "error" and "bad block count" in alone[1]
    first_reply, failed, last_reply = await _many(server, [good, short, good])
    assert failed[0] == "error" and "bad block count" in failed[1]
    assert first_reply[0] == 1 and first_reply[4] == 7
    assert last_reply[0] == 1 and last_reply[1] == 1  # the same op again: a replay
    assert await _state(server, prefix) != {}


async def test_a_batch_with_a_bad_layout_runs_none_of_its_calls(server: Redis, prefix: str) -> None:
    limiter = Limiter("memory://", [Limit(10, per=60)], prefix=prefix)
    plans = limiter._rules.plans("ip:x")
    good = encode(Mode.ACQUIRE, plans, 3, T0, 0, "c:1:")
    name = decide_library().many
    # Two calls announced, the second's arguments cut short.
    args = [2, 1, len(good.args), *good.args, 1, 50, *good.args]
    with pytest.raises(ResponseError, match="bad batch layout at call 2"):
        await server.execute_command("FCALL", name, 2, *good.keys, *good.keys, *args)
    assert await _state(server, prefix) == {}


async def test_the_store_sends_a_pipeline_as_one_script_run_and_admits_exactly(
    redis_url: str, prefix: str, server: Redis
) -> None:
    """400 concurrent callers on 4 identifiers of 25 each: exactly 100 admitted, in far fewer
    script runs than decisions (the pipelines went as decide_many)."""
    await server.config_resetstat()
    async with Limiter(redis_url, [Limit(25, per=60, precision=1)], prefix=prefix) as limiter:
        results = await asyncio.gather(*(limiter.try_acquire(f"ip:{i % 4}") for i in range(400)))
        stats = await server.info("commandstats")
        left = [(await limiter.peek(f"ip:{i}")).remaining for i in range(4)]
    assert sum(1 for decision in results if decision.allowed) == 100
    assert left == [0, 0, 0, 0]
    runs = stats["cmdstat_fcall"]["calls"]
    assert runs < 200, f"{runs} FCALLs for 400 decisions: the batches were not sent as one"


async def test_the_cluster_store_sends_each_nodes_calls_as_one_script_run(
    local_cluster: Any, prefix: str
) -> None:
    """On Redis Cluster a node's pipeline is one script run: decide_many for calls on one
    slot, decide_node across slots (tests/test_decide_node.py). 100 concurrent callers on each
    of 4 identifiers limited to 25, and 40 more on identifiers of their own: exactly 25
    admitted on each of the 4, every lone one admitted, in far fewer script runs than
    decisions."""
    import cluster as tooling

    nodes: tooling.Cluster = local_cluster
    for node in nodes.primaries():
        node.client.config_resetstat()
    async with Limiter(nodes.url, [Limit(25, per=60, precision=1)], prefix=prefix) as limiter:
        crowd = [f"ip:{i % 4}" for i in range(400)]
        lone = [f"user:{i}" for i in range(40)]
        results = await asyncio.gather(*(limiter.try_acquire(i) for i in crowd + lone))
        left = [(await limiter.peek(f"ip:{i}")).remaining for i in range(4)]
    runs = sum(
        node.client.info("commandstats").get("cmdstat_fcall", {}).get("calls", 0)
        for node in nodes.primaries()
    )
    admitted = [decision.allowed for decision in results]
    assert sum(admitted[:400]) == 100 and all(admitted[400:])
    assert left == [0, 0, 0, 0]
    assert runs < 30, f"{runs} FCALLs for 440 decisions: a node's calls were not one"


MINUTE = 60_000_000


async def _alone_and_batched(
    server: Redis, prefix: str, build: Any
) -> tuple[list[Any], list[Any], dict[str, Any], dict[str, Any]]:
    """``build(prefix)`` gives (setup calls, calls): the setup one by one on both prefixes,
    then the calls one by one on the first and as one batch on the second."""
    setup_a, calls_a = build(f"{prefix}a")
    setup_b, calls_b = build(f"{prefix}b")
    await _one_by_one(server, setup_a)
    await _one_by_one(server, setup_b)
    alone = await _one_by_one(server, calls_a)
    batched = await _many(server, calls_b)
    return alone, batched, await _state(server, f"{prefix}a"), await _state(server, f"{prefix}b")


def _one_limit(prefix: str) -> list[Any]:
    return Limiter("memory://", [Limit(10, per=1)], prefix=prefix)._rules.plans("ip:a")


async def test_a_ledger_pruned_in_a_batch_is_not_brought_back_by_a_later_call(
    server: Redis, prefix: str
) -> None:
    """Client X's ledger is idle for 16 minutes; in one batch X resends op 1 (it replays), a
    new client Y's first write prunes X's idle ledger, and X resends op 1 again: alone it finds
    no ledger and charges; the batch must not answer from the pruned ledger it had read."""

    def build(p: str) -> tuple[list[Call], list[Call]]:
        plans = _one_limit(p)
        later = T0 + 16 * MINUTE
        setup = [encode(Mode.ACQUIRE, plans, 1, T0, 0, "X:1:")]
        calls = [
            encode(Mode.ACQUIRE, plans, 1, later, 0, "X:1:"),
            encode(Mode.ACQUIRE, plans, 1, later, 0, "Y:1:"),
            encode(Mode.ACQUIRE, plans, 1, later, 0, "X:1:"),
            encode(Mode.PEEK, plans, 1, later, 0),
        ]
        return setup, calls

    alone, batched, state_alone, state_batched = await _alone_and_batched(server, prefix, build)
    assert batched == alone
    assert state_batched == state_alone


async def test_an_undo_after_a_prune_in_a_batch_leaves_its_tombstone(
    server: Redis, prefix: str
) -> None:
    """As above, then an undo of X's op 5 (never run): alone it records op 5 as undone, so a
    late copy of op 5 is refused; the batch must leave the same tombstone."""

    def build(p: str) -> tuple[list[Call], list[Call]]:
        plans = _one_limit(p)
        later = T0 + 16 * MINUTE
        setup = [encode(Mode.ACQUIRE, plans, 1, T0, 0, "C:10:")]
        calls = [
            encode(Mode.ACQUIRE, plans, 1, later, 0, "C:10:"),
            encode(Mode.ACQUIRE, plans, 1, later, 0, "D:1:"),
            encode(Mode.UNDO, plans, 1, later, 0, "C:5:"),
        ]
        return setup, calls

    alone, batched, state_alone, state_batched = await _alone_and_batched(server, prefix, build)
    assert batched == alone
    assert state_batched == state_alone
    late_a = encode(Mode.ACQUIRE, _one_limit(f"{prefix}a"), 1, T0 + 16 * MINUTE, 0, "C:5:")
    late_b = encode(Mode.ACQUIRE, _one_limit(f"{prefix}b"), 1, T0 + 16 * MINUTE, 0, "C:5:")
    assert await _one_by_one(server, [late_b]) == await _one_by_one(server, [late_a])


async def test_a_refused_call_of_a_new_client_does_not_make_the_next_call_prune(
    server: Redis, prefix: str
) -> None:
    """A refused call of client Z, new to the key, writes nothing; Y's acquire after it,
    alone, does not prune (its own ledger exists, the TTL needs no refresh), so W's ledger,
    idle for just under 15 minutes, stays. The batch must keep it too."""

    def build(p: str) -> tuple[list[Call], list[Call]]:
        plans = _one_limit(p)
        setup = [
            encode(Mode.ACQUIRE, plans, 1, T0, 0, "W:1:"),
            encode(Mode.ACQUIRE, plans, 1, T0 + 15 * MINUTE - 50_000, 0, "Y:1:"),
        ]
        later = T0 + 15 * MINUTE + 50_000
        calls = [
            encode(Mode.ACQUIRE, plans, 50, later, 0, "Z:1:"),  # refused: 50 > 10
            encode(Mode.ACQUIRE, plans, 1, later, 0, "Y:2:"),
        ]
        return setup, calls

    alone, batched, state_alone, state_batched = await _alone_and_batched(server, prefix, build)
    assert batched == alone
    assert state_batched == state_alone
