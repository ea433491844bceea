"""Issue 9 (items 1, 2, 4, 5): what the caller was told is what is stored.

A decision is charged exactly when its caller was told "admitted" (``allowed`` and not
``degraded``): never for an error, a degraded answer, a deadline, a cancellation, a late
execution by a resumed server or a reply that came back late, nor twice for a client that
resends by itself; and an undo keeps trying until a failed decision is "never happened".

Every test ends the same way: let everything drain (the limiter is closed, the server answers
again), then read the stored charge back with a fresh limiter's ``peek`` (``remaining`` of a
limit far from full: charge = amount - weight - remaining) and compare it with the weight of
the decisions that were reported admitted. Real servers only; network faults go through
``tests/_proxy.py``; server faults are real signals to pids the ``cluster`` package started.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from _proxy import Link, Proxies, Proxy, drop_first_script_reply, script_calls
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import key_slot

import cluster
from aiolimit import BackendError, Decision, Limit, Limiter, SlidingLog
from aiolimit._keys import main_key
from aiolimit._stores.cluster import ClusterStore
from aiolimit.testing import ManualClock

#: Far from full in every test, so peek's ``remaining`` always shows the stored charge. A
#: sliding window of 60 buckets: a charge stays counted for at least 59 minutes, whenever the
#: test runs (a fixed window, ``precision=per``, forgets every charge on the hour).
ROOMY = Limit(1_000_000, per=3600, precision=60)


def told_admitted(outcome: object) -> bool:
    """The caller was told "admitted": a real (not degraded) allowed decision."""
    return isinstance(outcome, Decision) and outcome.allowed and not outcome.degraded


async def charged(store: Any, prefix: str, identifier: str, limit: Limit = ROOMY) -> int:
    """Weight stored for ``identifier`` under ``limit``, read by a fresh limiter's peek."""
    async with Limiter(store, [limit], prefix=prefix, deadline=5.0) as reader:
        decision = await reader.peek(identifier)
    return limit.amount - decision.remaining  # peek: what is left now


async def settle(
    read: Any, expected: int, *, within: float = 5.0, poll: float = 0.05
) -> tuple[bool, int]:
    """Polls ``await read()`` until it equals ``expected`` or ``within`` seconds pass.

    Returns (converged, last value). Read errors (a node failing over) count as "not yet".
    """
    deadline = time.monotonic() + within
    last = -1
    while True:
        try:
            last = await read()
        except BackendError:
            last = -1
        if last == expected:
            return True, last
        if time.monotonic() >= deadline:
            return False, last
        await asyncio.sleep(poll)


async def _outcome(call: Any) -> object:
    """The decision, or the BackendError raised (on_error="raise")."""
    try:
        result: object = await call
    except BackendError as error:
        result = error
    return result


async def test_roomy_keeps_a_charge_across_the_hour(redis_url: str, prefix: str) -> None:
    """Every test here reads back what it charged seconds earlier, by the server's clock. CI
    once ran one across 04:00 UTC while ROOMY was a fixed hourly window: it read back 0 charged
    for 1 admitted. A charge made just before the hour is still counted just after it."""
    clock = ManualClock(start=1_700_002_800.0 - 0.1)  # 0.1 s before an hour since the epoch
    async with Limiter(redis_url, [ROOMY], prefix=prefix, clock=clock) as limiter:
        assert (await limiter.try_acquire("ip:203.0.113.7")).allowed
        clock.advance(0.2)
        assert ROOMY.amount - (await limiter.peek("ip:203.0.113.7")).remaining == 1


def slot_of(prefix: str, identifier: str) -> int:
    return key_slot(main_key(prefix, identifier).encode())


def owner(nodes: cluster.Cluster, prefix: str, identifier: str) -> cluster.Node:
    return nodes.node_for_slot(slot_of(prefix, identifier))


def proxied_client(nodes: cluster.Cluster, proxies: Proxies) -> RedisCluster:
    """The cluster client aiolimit builds for a redis+cluster:// URL (no redis-py retries,
    reinitialize_steps=0, no socket timeout), with every node reached through its proxy."""
    seed = nodes.nodes[0]
    return RedisCluster(
        host=seed.host,
        port=seed.port,
        address_remap=proxies.remap,
        reinitialize_steps=0,
        retry=Retry(NoBackoff(), 0),
        socket_timeout=None,
        socket_connect_timeout=2.0,
        health_check_interval=0,
    )


# --- item 1: cancelled calls ------------------------------------------------------------------

#: When to cancel, after creating the calls: right away, after a few event-loop turns, or
#: after a short real pause (so some calls are on the wire, some answered, some not yet sent).
CANCEL_POINTS: list[tuple[str, float]] = [
    *[("ticks", n) for n in range(6)],
    *[("seconds", s) for s in (0.00005, 0.0001, 0.0002, 0.0003, 0.0005, 0.001, 0.002, 0.004)],
]
CALLS_PER_POINT = 40


@pytest.fixture(params=["standalone", "memory"])
def single_slot_store(request: pytest.FixtureRequest) -> str:
    """A store on which a one-identifier decision is one atomic call. (On one cluster slot,
    cancelling by the clock rarely lands after the send: see the proxied test below.)"""
    if request.param == "standalone":
        url: str = request.getfixturevalue("redis_url")
        return url
    return "memory://"


async def test_cancelled_single_slot_calls_charge_nothing(
    single_slot_store: str, prefix: str
) -> None:
    """Calls cancelled at any point leave exactly the admitted decisions' weight stored."""
    limiter = Limiter(single_slot_store, [ROOMY], prefix=prefix)
    await limiter.peek("warm-up")  # connections open and the script loaded
    admitted = cancelled = 0
    for kind, amount in CANCEL_POINTS:
        calls = [
            asyncio.ensure_future(limiter.try_acquire("ip:203.0.113.7"))
            for _ in range(CALLS_PER_POINT)
        ]
        if kind == "ticks":
            for _ in range(int(amount)):
                await asyncio.sleep(0)
        else:
            await asyncio.sleep(amount)
        for call in calls:
            call.cancel()
        for outcome in await asyncio.gather(*calls, return_exceptions=True):
            admitted += told_admitted(outcome)
            cancelled += isinstance(outcome, asyncio.CancelledError)
    store = limiter.store
    await limiter.aclose()  # everything sent has been answered
    reader: Any = store if single_slot_store == "memory://" else single_slot_store
    converged, stored = await settle(
        lambda: charged(reader, prefix, "ip:203.0.113.7"), admitted, within=3.0
    )
    assert cancelled > 0
    assert converged, f"stored {stored} for {admitted} admitted ({cancelled} cancelled)"


IDENTIFIER = "ip:203.0.113.7"


@pytest.fixture(params=["standalone", "cluster-one-slot"])
async def on_the_wire(
    request: pytest.FixtureRequest, prefix: str
) -> AsyncIterator[tuple[Limiter, Proxy, str]]:
    """(a limiter whose calls for IDENTIFIER cross ``proxy``, that proxy, a URL to read the
    store directly). The cluster limiter uses a client of the test's own (aiolimit's
    settings, address_remap to the proxies): a URL cannot name proxies."""
    if request.param == "standalone":
        url: str = request.getfixturevalue("redis_url")
        host, port = url.removeprefix("redis://").split("/")[0].split(":")
        proxy = await Proxy(host, int(port)).start()
        limiter = Limiter(proxy.url, [ROOMY], prefix=prefix)
        yield limiter, proxy, url
        await limiter.aclose()
        await proxy.aclose()
        return
    nodes: cluster.Cluster = request.getfixturevalue("local_cluster")
    proxies = await Proxies().start((node.host, node.port) for node in nodes.nodes)
    client = proxied_client(nodes, proxies)
    limiter = Limiter(client, [ROOMY], prefix=prefix)
    yield limiter, proxies[owner(nodes, prefix, IDENTIFIER).port], nodes.url
    await limiter.aclose()
    await client.aclose()
    await proxies.aclose()


async def test_calls_cancelled_once_sent_charge_nothing(
    on_the_wire: tuple[Limiter, Proxy, str], prefix: str
) -> None:
    """Calls cancelled the moment their request leaves the client (the server then runs
    them) leave exactly the admitted decisions' weight stored."""
    await _cancel_once_sent(*on_the_wire, prefix, [IDENTIFIER] * 10)


@pytest.mark.cluster
async def test_calls_of_a_node_batch_cancelled_once_sent_charge_nothing(
    local_cluster: cluster.Cluster, prefix: str
) -> None:
    """The same, with each tick's 10 calls on 10 slots of one node: one FCALL of decide_node,
    whose callers are all cancelled as it leaves."""
    node, identifiers = _on_slots_of_one_node(local_cluster, prefix, 10)
    proxies = await Proxies().start((n.host, n.port) for n in local_cluster.nodes)
    client = proxied_client(local_cluster, proxies)
    limiter = Limiter(client, [ROOMY], prefix=prefix)
    try:
        await _cancel_once_sent(limiter, proxies[node.port], local_cluster.url, prefix, identifiers)
    finally:
        await limiter.aclose()
        await client.aclose()
        await proxies.aclose()


async def _cancel_once_sent(
    limiter: Limiter, proxy: Proxy, direct_url: str, prefix: str, identifiers: list[str]
) -> None:
    """20 rounds of one try_acquire per identifier, all cancelled when their request passes
    ``proxy``; then the stored weight converges to the admitted decisions'."""
    for identifier in set(identifiers):
        await limiter.peek(identifier)  # connections open and the script loaded
    in_flight: list[asyncio.Future[Decision]] = []

    def cancel_in_flight(link: Link, data: bytes) -> None:
        if script_calls(data):
            for call in in_flight:
                call.cancel()

    proxy.on_request = cancel_in_flight
    admitted = cancelled = 0
    for _ in range(20):
        in_flight[:] = [asyncio.ensure_future(limiter.try_acquire(i)) for i in identifiers]
        for outcome in await asyncio.gather(*in_flight, return_exceptions=True):
            admitted += told_admitted(outcome)
            cancelled += isinstance(outcome, asyncio.CancelledError)
    proxy.on_request = None
    await limiter.aclose()
    assert cancelled > 0

    async def stored() -> int:
        return sum([await charged(direct_url, prefix, i) for i in set(identifiers)])

    converged, total = await settle(stored, admitted)
    assert converged, f"stored {total} for {admitted} admitted ({cancelled} cancelled)"


# --- item 1: a stopped server, and replies that come back late ---------------------------------

DEADLINE = 0.2


@pytest.mark.slow
@pytest.mark.parametrize("on_error", ["raise", "closed", "open"])
async def test_calls_abandoned_on_a_stopped_server_charge_nothing(
    fresh_standalone: cluster.Standalone, prefix: str, on_error: str
) -> None:
    """Calls that met a SIGSTOPped server and got an error or a degraded answer at their
    deadline are not charged when the server resumes and runs them."""
    limiter = Limiter(
        fresh_standalone.url,
        [ROOMY],
        prefix=prefix,
        deadline=DEADLINE,
        on_error=on_error,  # type: ignore[arg-type]
        failure_threshold=1000,  # every call reaches the server
    )
    outcomes: list[object] = []
    try:
        outcomes.append(await limiter.try_acquire("ip:203.0.113.7"))  # admitted, charged
        fresh_standalone.pause()
        try:
            started = time.monotonic()
            for _ in range(4):
                outcomes.append(await _outcome(limiter.try_acquire("ip:203.0.113.7")))
            concurrent = [limiter.try_acquire("ip:203.0.113.7") for _ in range(8)]
            outcomes += await asyncio.gather(*map(_outcome, concurrent))
            assert time.monotonic() - started < 5 * (DEADLINE + 0.25)
            await asyncio.sleep(DEADLINE)  # resumed well after every deadline
        finally:
            fresh_standalone.resume()
    finally:
        await limiter.aclose()  # waits for the late replies: the scripts have run
    failed = [outcome for outcome in outcomes[1:] if not told_admitted(outcome)]
    assert len(failed) == 12  # every call met the stopped server
    admitted = sum(map(told_admitted, outcomes))
    converged, stored = await settle(
        lambda: charged(fresh_standalone.url, prefix, "ip:203.0.113.7"), admitted
    )
    assert converged, f"stored {stored} for {admitted} admitted"


@pytest.mark.parametrize("on_error", ["raise", "closed", "open"])
async def test_late_replies_past_the_deadline_charge_nothing(
    standalone_proxy: Proxy, prefix: str, on_error: str
) -> None:
    """The server runs the call on time but its reply arrives after the deadline: the caller
    got an error or a degraded answer, so nothing stays charged."""
    limiter = Limiter(
        standalone_proxy.url,
        [ROOMY],
        prefix=prefix,
        deadline=DEADLINE,
        on_error=on_error,  # type: ignore[arg-type]
        failure_threshold=1000,
    )
    outcomes: list[object] = []
    try:
        outcomes.append(await limiter.try_acquire("ip:203.0.113.7"))
        standalone_proxy.delay = DEADLINE * 2.5
        for _ in range(4):
            outcomes.append(await _outcome(limiter.try_acquire("ip:203.0.113.7")))
        concurrent = [limiter.try_acquire("ip:203.0.113.7") for _ in range(6)]
        outcomes += await asyncio.gather(*map(_outcome, concurrent))
        standalone_proxy.delay = 0.0  # later traffic (an undo, if any) is not delayed
    finally:
        await limiter.aclose()
    assert not any(map(told_admitted, outcomes[1:]))
    admitted = sum(map(told_admitted, outcomes))
    converged, stored = await settle(
        lambda: charged(standalone_proxy.url, prefix, "ip:203.0.113.7"), admitted
    )
    assert converged, f"stored {stored} for {admitted} admitted"


async def test_expensive_sliding_log_call_fits_a_short_deadline_and_charges_once(
    redis_url: str, prefix: str
) -> None:
    """A SlidingLog(1_000_000, per=2) call of weight 999,999 (2 s of Redis before the cost
    was bounded) is decided within a 0.2 s deadline and charged exactly once."""
    limits = [SlidingLog(1_000_000, per=2)]
    async with Limiter(redis_url, limits, prefix=prefix, deadline=0.2) as limiter:
        decision = await limiter.try_acquire("ip:1", 999_999)
        assert decision.allowed and not decision.degraded and decision.remaining == 1
        assert not (await limiter.peek("ip:1", 2)).allowed
        assert (await limiter.peek("ip:1", 1)).allowed


# --- item 2: a user's own client that resends by itself ---------------------------------------


@pytest.mark.parametrize("weight", [1, 7])
async def test_users_own_client_with_default_retries_charges_once(
    standalone_proxy: Proxy, prefix: str, weight: int
) -> None:
    """Limiter(redis.asyncio.Redis(...)) with redis-py's default retries: a reply lost after
    the server ran the call is never charged twice (stored == weight admitted)."""
    client = Redis(host="127.0.0.1", port=standalone_proxy.port)  # redis-py's defaults
    limiter = Limiter(client, [ROOMY], prefix=prefix)
    try:
        await limiter.peek("warm-up")  # the script is loaded; no NOSCRIPT round below
        dropped = drop_first_script_reply(standalone_proxy)
        outcome = await _outcome(limiter.try_acquire("ip:203.0.113.7", weight))
        assert dropped == [1]  # the fault did happen
    finally:
        await limiter.aclose()
        await client.aclose()
    admitted = weight if told_admitted(outcome) else 0
    converged, stored = await settle(
        lambda: charged(standalone_proxy.url, prefix, "ip:203.0.113.7"), admitted
    )
    assert converged, f"stored {stored} for {admitted} admitted ({outcome!r})"


@pytest.mark.cluster
async def test_users_own_cluster_client_with_default_retries_charges_once(
    local_cluster: cluster.Cluster, prefix: str
) -> None:
    """Limiter(RedisCluster(...)) with redis-py's default retries: a lost reply to a
    one-slot call is not charged twice either."""
    proxies = await Proxies().start((node.host, node.port) for node in local_cluster.nodes)
    seed = local_cluster.nodes[0]
    client = RedisCluster(host=seed.host, port=seed.port, address_remap=proxies.remap)
    limiter = Limiter(client, [ROOMY], prefix=prefix)
    identifier = "ip:203.0.113.7"
    try:
        await limiter.peek(identifier)
        owner = local_cluster.node_for_slot(key_slot(main_key(prefix, identifier).encode()))
        dropped = drop_first_script_reply(proxies[owner.port])
        outcome = await _outcome(limiter.try_acquire(identifier, 3))
        assert dropped == [1]
    finally:
        await limiter.aclose()
        await client.aclose()
        await proxies.aclose()
    admitted = 3 if told_admitted(outcome) else 0
    converged, stored = await settle(
        lambda: charged(local_cluster.url, prefix, identifier), admitted
    )
    assert converged, f"stored {stored} for {admitted} admitted ({outcome!r})"


# --- item 4: exactly-once bookkeeping outlives every retry --------------------------------------

#: Windows of a day: every key of these limits lives about a day, far beyond any deadline.
DAY_LIMITS = [Limit(1000, per=86400, precision=3600), SlidingLog(1000, per=86400)]


def in_other_slots(prefix: str, count: int, start: int = 0) -> list[str]:
    """``count`` identifiers whose keys live in ``count`` different slots."""
    chosen: dict[int, str] = {}
    for i in range(start, start + 100_000):
        chosen.setdefault(slot_of(prefix, f"user:{i}"), f"user:{i}")
        if len(chosen) == count:
            return list(chosen.values())
    raise AssertionError("no identifiers in distinct slots")


def key_ttls(nodes: cluster.Cluster, prefix: str) -> dict[str, int]:
    """PTTL (ms) of every key under ``prefix`` on every primary (-1: no TTL), read raw."""
    ttls = {}
    for node in nodes.primaries():
        for key in node.client.scan_iter(match=f"{prefix}:*", count=1000):
            ttls[key] = node.client.pttl(key)
    return ttls


@pytest.mark.cluster
@pytest.mark.parametrize("deadline", [300, 3600])
async def test_exactly_once_bookkeeping_outlives_the_deadline(
    local_cluster: cluster.Cluster, prefix: str, deadline: int
) -> None:
    """After charging calls (one slot, two slots, a refund) made with ``deadline``, every key
    the limiter wrote lives at least that long: whatever makes a retried call apply once
    cannot expire while the limiter may still retry it."""
    ids = in_other_slots(prefix, 3)
    async with Limiter(local_cluster.url, DAY_LIMITS, prefix=prefix, deadline=deadline) as lim:
        assert told_admitted(await lim.try_acquire(ids[0], 2))  # one slot
        assert told_admitted(await lim.try_acquire(ids[1:], 3))  # two slots, two phases
        await lim.refund(ids[1:], 1)
    ttls = key_ttls(local_cluster, prefix)
    assert ttls, "the calls wrote nothing?"
    short = {key: ttl for key, ttl in ttls.items() if ttl != -1 and ttl < deadline * 1000}
    assert not short, f"{len(short)} of {len(ttls)} keys expire before the deadline: {short}"
    assert -1 not in ttls.values(), "every key needs a TTL"


async def test_standalone_keys_outlive_the_deadline(redis_url: str, prefix: str) -> None:
    """On one server too, every key written by charging calls with deadline=3600 lives at
    least as long as that deadline (the bookkeeping a fix may add included)."""
    async with Limiter(redis_url, DAY_LIMITS, prefix=prefix, deadline=3600) as limiter:
        assert told_admitted(await limiter.try_acquire(["user:1", "user:2"], 2))
        await limiter.refund("user:1", 1)
    raw = Redis.from_url(redis_url, decode_responses=True)
    try:
        ttls = {key: await raw.pttl(key) async for key in raw.scan_iter(match=f"{prefix}:*")}
    finally:
        await raw.aclose()
    assert ttls
    assert all(ttl >= 3600 * 1000 for ttl in ttls.values()), ttls


# --- item 5: an undo that outlasts its first budget --------------------------------------------

SMALL = Limit(10, per=3600, precision=60)  # sliding, like ROOMY: no reset on the hour


@pytest.fixture(scope="module")
def calm_cluster() -> Iterator[cluster.Cluster]:
    """A private 3-primary cluster without replicas and with Redis' default node timeout
    (15 s): a primary stopped for a few seconds is never failed over, so a test decides how
    long a node is out. Tests heal it (resume) before they return."""
    nodes = cluster.start_cluster(replicas_per_primary=0, node_timeout_ms=15000)
    with nodes:
        yield nodes


def two_primaries(nodes: cluster.Cluster, prefix: str) -> tuple[str, str]:
    """Identifiers a, b on two different primaries, neither the seed (nodes[0])."""
    seed_port = nodes.nodes[0].port
    found: dict[int, str] = {}
    for i in range(100_000):
        identifier = f"user:{i}"
        port = nodes.node_for_slot(slot_of(prefix, identifier)).port
        if port != seed_port:
            found.setdefault(port, identifier)
        if len(found) == 2:
            a, b = found.values()
            return a, b
    raise AssertionError("no identifiers on two non-seed primaries")


def on_nth_script_call(proxy: Proxy, nth: int, action: Any) -> list[Link]:
    """From now on, ``await action(link)`` when the ``nth`` script call reaches ``proxy``,
    before the server sees it. (A two-slot decision sends a node its check first, then its
    commit: after a warm-up, the commit is the 2nd.) Returns the links it fired on."""
    seen = [0]
    fired: list[Link] = []

    async def on_request(link: Link, data: bytes) -> None:
        before = seen[0]
        seen[0] += script_calls(data)
        if before < nth <= seen[0]:
            fired.append(link)
            await action(link)

    proxy.on_request = on_request
    return fired


@contextlib.asynccontextmanager
async def proxied_limiter(
    nodes: cluster.Cluster, prefix: str
) -> AsyncIterator[tuple[Proxies, Limiter]]:
    """A limiter (``SMALL``, 1 s deadline) on ``nodes``, every node reached through a proxy of
    its own; on the way out every proxy is healed and all of it closed."""
    proxies = await Proxies().start((node.host, node.port) for node in nodes.nodes)
    client = proxied_client(nodes, proxies)
    limiter = Limiter(client, [SMALL], prefix=prefix, deadline=1.0)
    try:
        yield proxies, limiter
    finally:
        for proxy in proxies.by_target.values():
            proxy.heal()
        await limiter.aclose()
        await client.aclose()
        await proxies.aclose()


async def fill(nodes: cluster.Cluster, prefix: str, identifier: str) -> None:
    """Another client takes all of ``identifier``'s room (told admitted: it stays charged)."""
    async with Limiter(nodes.url, [SMALL], prefix=prefix, deadline=5.0) as other:
        assert told_admitted(await other.try_acquire(identifier, SMALL.amount))


@pytest.mark.cluster
@pytest.mark.slow
async def test_commit_stuck_on_a_stopped_node_is_undone_on_the_others(
    calm_cluster: cluster.Cluster, prefix: str
) -> None:
    """Two slots: the commit succeeds on A while B's node is SIGSTOPped: the decision fails at
    its deadline, A's charge is undone at once, and B ends "never happened" once resumed."""
    nodes = calm_cluster
    a, b = two_primaries(nodes, prefix)
    node_b = owner(nodes, prefix, b)
    proxies = await Proxies().start((node.host, node.port) for node in nodes.nodes)
    client = proxied_client(nodes, proxies)
    limiter = Limiter(client, [SMALL], prefix=prefix, deadline=1.0)
    try:
        await limiter.peek([a, b])  # warm-up: one script call per node

        async def stop_b(link: Link) -> None:
            node_b.pause()

        fired = on_nth_script_call(proxies[node_b.port], 2, stop_b)
        started = time.monotonic()
        outcome = await _outcome(limiter.try_acquire([a, b]))
        assert time.monotonic() - started < 1.0 + 0.5
        assert fired and node_b.paused
        assert isinstance(outcome, BackendError)
        converged, stored_a = await settle(
            lambda: charged(nodes.url, prefix, a, SMALL), 0, within=1.0
        )
        assert converged, f"A still holds {stored_a} while B is stopped"
        await asyncio.sleep(0.5)
        node_b.resume()
        converged, stored_b = await settle(lambda: charged(nodes.url, prefix, b, SMALL), 0)
        assert converged, f"B holds {stored_b} after it resumed"
    finally:
        nodes.heal()
        await limiter.aclose()
        await client.aclose()
        await proxies.aclose()


@pytest.mark.parametrize("fault", ["request lost", "reply lost"])
async def test_a_failed_refund_is_finished_once_when_the_store_answers(
    standalone_proxy: Proxy, prefix: str, fault: str
) -> None:
    """A refund whose request is lost (the proxy drops every byte until after its deadline)
    or whose reply is (the server ran it) raises; it is sent again in the background with
    the same op once the server is reachable, and lands exactly once: 3 charged - 2 = 1."""
    limiter = Limiter(standalone_proxy.url, [ROOMY], prefix=prefix, deadline=DEADLINE)
    try:
        for _ in range(3):
            assert told_admitted(await limiter.try_acquire("ip:203.0.113.7"))
        if fault == "request lost":
            standalone_proxy.partition()
        else:
            standalone_proxy.delay = DEADLINE * 2.5
        outcome = await _outcome(limiter.refund("ip:203.0.113.7", 2))
        assert isinstance(outcome, BackendError), outcome
        await asyncio.sleep(DEADLINE)
        standalone_proxy.heal()
        standalone_proxy.delay = 0.0
        converged, stored = await settle(
            lambda: charged(standalone_proxy.url, prefix, "ip:203.0.113.7"), 1
        )
        assert converged, f"stored {stored} for 3 admitted and 2 refunded"
        await asyncio.sleep(0.5)  # (a second landing would show now)
        assert await charged(standalone_proxy.url, prefix, "ip:203.0.113.7") == 1
    finally:
        standalone_proxy.heal()
        standalone_proxy.delay = 0.0
        await limiter.aclose()


@pytest.mark.parametrize("finished", ["refund", "undo"])
async def test_a_refusal_cached_before_a_background_finish_lands_is_dropped_then(
    standalone_proxy: Proxy, prefix: str, finished: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``cache_refusals``: a refund whose request was lost, or an acquire whose reply
    was late (it charged) and whose undo's first tries were lost, is finished in the
    background. A refusal cached while that finish is pending was true when made, but the
    finish gives capacity back: once it lands, the cache must not refuse what the store now
    admits (else it would refuse it for the refusal's whole ``retry_after``, up to an hour
    here)."""
    import aiolimit._protocol

    # The background finish waits a second between tries (normally milliseconds), so that a
    # refusal is made and cached in between.
    monkeypatch.setattr(aiolimit._protocol, "backoff", lambda attempt: 1.0)
    tight = Limit(3, per=3600, precision=60)
    limiter = Limiter(
        standalone_proxy.url, [tight], prefix=prefix, deadline=DEADLINE, cache_refusals=True
    )
    try:
        if finished == "refund":
            for _ in range(3):
                assert told_admitted(await limiter.try_acquire("ip:203.0.113.7"))
            standalone_proxy.partition()
            outcome = await _outcome(limiter.refund("ip:203.0.113.7", 2))
            await asyncio.sleep(DEADLINE)  # (the lost copy is given up)
            standalone_proxy.heal()
            after = 1
        else:
            for _ in range(2):
                assert told_admitted(await limiter.try_acquire("ip:203.0.113.7"))
            blocking = True

            def lose_undos(link: Link, data: bytes) -> None:
                if blocking and b"\r\nundo\r\n" in data:
                    link.abort()

            standalone_proxy.on_request = lose_undos
            standalone_proxy.delay = DEADLINE * 2.5  # (the acquire charges; its reply is late)
            outcome = await _outcome(limiter.try_acquire("ip:203.0.113.7"))
            standalone_proxy.delay = 0.0
            await asyncio.sleep(DEADLINE * 2)  # (the late reply has come and gone)
            after = 2
        assert isinstance(outcome, BackendError), outcome
        refused = await limiter.try_acquire("ip:203.0.113.7")
        assert not refused.allowed and not refused.degraded  # the store's own refusal
        assert limiter.statistics().cached_refusals == 0
        blocking = False
        converged, stored = await settle(
            lambda: charged(standalone_proxy.url, prefix, "ip:203.0.113.7", tight), after
        )
        assert converged, f"stored {stored}: the {finished} did not land"
        decision = await limiter.try_acquire("ip:203.0.113.7")
        assert decision.allowed, f"refused by the cache after the {finished} landed: {decision}"
        assert await charged(standalone_proxy.url, prefix, "ip:203.0.113.7", tight) == after + 1
    finally:
        standalone_proxy.heal()
        standalone_proxy.delay = 0.0
        standalone_proxy.on_request = None
        await limiter.aclose()


async def test_a_refund_on_a_stopped_server_resumed_late_lands_once(
    fresh_standalone: cluster.Standalone, prefix: str
) -> None:
    """The server is SIGSTOPped while a refund is sent: the caller is told it failed at its
    deadline, and the background resends queue up behind it. Resumed well after, the server
    runs the first copy and every resend of it: the refund lands once (3 charged - 2 = 1)."""
    limiter = Limiter(
        fresh_standalone.url, [ROOMY], prefix=prefix, deadline=DEADLINE, failure_threshold=1000
    )
    try:
        for _ in range(3):
            assert told_admitted(await limiter.try_acquire("ip:203.0.113.7"))
        fresh_standalone.pause()
        try:
            outcome = await _outcome(limiter.refund("ip:203.0.113.7", 2))
            assert isinstance(outcome, BackendError), outcome
            await asyncio.sleep(1.5)  # (resends queue up on the stopped server meanwhile)
        finally:
            fresh_standalone.resume()
        converged, stored = await settle(
            lambda: charged(fresh_standalone.url, prefix, "ip:203.0.113.7"), 1
        )
        assert converged, f"stored {stored} for 3 admitted and 2 refunded"
        await asyncio.sleep(0.5)  # (a second landing would show now)
        assert await charged(fresh_standalone.url, prefix, "ip:203.0.113.7") == 1
    finally:
        await limiter.aclose()


@pytest.mark.cluster
@pytest.mark.slow
async def test_a_refund_cut_off_on_one_slot_is_finished_there_once(
    calm_cluster: cluster.Cluster, prefix: str
) -> None:
    """Two slots: a refund credits A while B's node is cut off (its proxy drops every byte)
    past the refund's deadline. The caller is told it failed; once B is reachable the refund
    is finished there, once, and A (which replays) is not credited twice."""
    nodes = calm_cluster
    a, b = two_primaries(nodes, prefix)
    async with proxied_limiter(nodes, prefix) as (proxies, limiter):
        proxy_b = proxies[owner(nodes, prefix, b).port]
        for _ in range(3):
            assert told_admitted(await limiter.try_acquire([a, b]))
        proxy_b.partition()
        outcome = await _outcome(limiter.refund([a, b], 2))
        assert isinstance(outcome, BackendError), outcome
        assert await charged(nodes.url, prefix, a, SMALL) == 1
        assert await charged(nodes.url, prefix, b, SMALL) == 3
        proxy_b.heal()
        converged, stored_b = await settle(
            lambda: charged(nodes.url, prefix, b, SMALL), 1, within=15.0
        )
        assert converged, f"B holds {stored_b}: 3 charged, 2 refunded"
        await asyncio.sleep(0.5)
        assert await charged(nodes.url, prefix, a, SMALL) == 1
        assert await charged(nodes.url, prefix, b, SMALL) == 1


UNDO_OUTAGE = 7.0  # longer than the 5 s an undo is given today


@pytest.mark.cluster
@pytest.mark.slow
async def test_undo_cut_off_longer_than_its_budget_converges(
    calm_cluster: cluster.Cluster, prefix: str
) -> None:
    """Two slots: A commits, B is refused (another client filled it between the phases), and
    A is cut off (its proxy drops every byte) for longer than 5 s while the undo is due: once
    A is reachable again, A converges to "never happened" within a bounded time."""
    nodes = calm_cluster
    a, b = two_primaries(nodes, prefix)
    node_a, node_b = owner(nodes, prefix, a), owner(nodes, prefix, b)
    async with proxied_limiter(nodes, prefix) as (proxies, limiter):
        proxy_a = proxies[node_a.port]
        await limiter.peek([a, b])

        async def cut_off_a_after_its_reply(link: Link, data: bytes) -> None:
            if link.marks.pop("commit", False):  # A's commit reply goes through, then no more
                asyncio.get_running_loop().call_soon(proxy_a.partition)

        async def mark_commit(link: Link) -> None:
            link.marks["commit"] = True

        async def fill_b(link: Link) -> None:
            await fill(nodes, prefix, b)

        on_nth_script_call(proxy_a, 2, mark_commit)
        proxy_a.on_reply = cut_off_a_after_its_reply
        fired = on_nth_script_call(proxies[node_b.port], 2, fill_b)
        outcome = await _outcome(limiter.try_acquire([a, b]))
        returned = time.monotonic()
        assert fired and proxy_a.partitioned
        assert not told_admitted(outcome)
        await asyncio.sleep(max(0.0, UNDO_OUTAGE - 1.0))
        proxy_a.heal()
        converged, stored_a = await settle(
            lambda: charged(nodes.url, prefix, a, SMALL), 0, within=returned + 15 - time.monotonic()
        )
        assert converged, f"A holds {stored_a} for 0 admitted"
        assert await charged(nodes.url, prefix, b, SMALL) == SMALL.amount  # the filler's


@pytest.mark.cluster
@pytest.mark.slow
async def test_undo_through_a_failover_converges(
    fresh_cluster: cluster.Cluster, prefix: str
) -> None:
    """Two slots: A commits (and replicates), B is refused, and A's primary is SIGSTOPped for
    longer than 5 s, so its replica is promoted while the undo is due: the promoted replica
    converges to "never happened" within a bounded time."""
    nodes = fresh_cluster
    a, b = two_primaries(nodes, prefix)
    node_a, node_b = owner(nodes, prefix, a), owner(nodes, prefix, b)
    (replica_a,) = [node for node in nodes.replicas() if node.execute("ROLE")[2] == node_a.port]
    proxies = await Proxies().start((node.host, node.port) for node in nodes.nodes)
    client = proxied_client(nodes, proxies)
    limiter = Limiter(client, [SMALL], prefix=prefix, deadline=1.0)
    try:
        await limiter.peek([a, b])

        async def refuse_b_then_stop_a(link: Link) -> None:
            key = main_key(prefix, a)
            deadline = time.monotonic() + 2.0
            while not node_a.client.exists(key):  # A's commit has run
                assert time.monotonic() < deadline, "A's commit never ran"
                await asyncio.sleep(0.002)
            offset = node_a.client.info("replication")["master_repl_offset"]
            while replica_a.client.info("replication")["slave_repl_offset"] < offset:
                assert time.monotonic() < deadline, "A's replica never caught up"
                await asyncio.sleep(0.002)
            await fill(nodes, prefix, b)
            node_a.pause()

        fired = on_nth_script_call(proxies[node_b.port], 2, refuse_b_then_stop_a)
        outcome = await _outcome(limiter.try_acquire([a, b]))
        stopped_at = time.monotonic()
        assert fired and node_a.paused
        assert not told_admitted(outcome)
        await asyncio.sleep(UNDO_OUTAGE - 1.0)
        node_a.resume()
        converged, stored_a = await settle(
            lambda: charged(nodes.url, prefix, a, SMALL),
            0,
            within=stopped_at + 15 - time.monotonic(),
        )
        assert converged, f"A holds {stored_a} for 0 admitted"
    finally:
        if node_a.paused:
            node_a.resume()
        await limiter.aclose()
        await client.aclose()
        await proxies.aclose()


def _on_slots_of_one_node(
    nodes: cluster.Cluster, prefix: str, count: int
) -> tuple[cluster.Node, list[str]]:
    """The node owning "ip:198.51.100.9", and ``count`` identifiers on slots of it, one each."""
    node = owner(nodes, prefix, "ip:198.51.100.9")
    by_slot: dict[int, str] = {}
    for i in range(100_000):
        identifier = f"ip:198.51.{i // 256}.{i % 256}"
        if owner(nodes, prefix, identifier).port == node.port:
            by_slot.setdefault(slot_of(prefix, identifier), identifier)
        if len(by_slot) == count:
            break
    return node, list(by_slot.values())


@pytest.mark.cluster
def _cut_after_first_reply(batch: list[int], resent: list[int]) -> tuple[Any, Any]:
    """A proxy's hooks: the first request chunk with 2 script calls or more is the batch; its
    reply reaches the client as its first 8 lines only (a reply of one pair is an array of 7
    integers: 8 lines), then the connection is reset. ``resent`` counts the script calls sent
    after that."""
    cut: list[bool] = []

    def on_request(link: Link, data: bytes) -> None:
        calls = script_calls(data)
        if cut:
            resent.append(calls)
        elif not batch and calls >= 2:
            batch.append(calls)
            link.marks["cut"] = True

    async def on_reply(link: Link, data: bytes) -> None:
        if link.marks.pop("cut", False):
            first = b"\r\n".join(data.split(b"\r\n")[:8]) + b"\r\n"
            assert len(first) < len(data), "the chunk held one reply only"
            link.client_writer.write(first)
            await link.client_writer.drain()
            await asyncio.sleep(0.05)  # the client reads it before the reset
            cut.append(True)
            link.abort()

    return on_request, on_reply


async def test_a_pipeline_cut_after_its_first_reply_keeps_that_reply(
    local_cluster: cluster.Cluster, prefix: str
) -> None:
    """A cluster pipeline of one-slot calls, each on a slot of its own, sent as EVALSHA (as to
    a server without FUNCTION: with FCALL a node's calls are one script run and one reply),
    whose connection is reset right after its first reply reached the client. That reply
    stands: its call is not resent. Exactly the calls without a reply are resent (each
    replays or runs once), every decision is admitted, and the store holds exactly what was
    admitted."""
    from aiolimit._calls import decide_script

    node, identifiers = _on_slots_of_one_node(local_cluster, prefix, 20)
    admin = Redis(host=node.host, port=node.port)
    await admin.script_load(decide_script().source)  # (a resend is one EVALSHA, no NOSCRIPT)
    await admin.aclose()
    proxies = await Proxies().start((n.host, n.port) for n in local_cluster.nodes)
    client = proxied_client(local_cluster, proxies)
    limiter = Limiter(client, [ROOMY], prefix=prefix)
    assert isinstance(limiter.store, ClusterStore)
    limiter.store._functions = False  # EVALSHA: one reply per call
    batch: list[int] = []  # script calls in the pipeline that gets cut
    resent: list[int] = []  # script calls sent after the cut
    try:
        await limiter.peek(identifiers[0])
        proxy = proxies[node.port]
        proxy.on_request, proxy.on_reply = _cut_after_first_reply(batch, resent)
        outcomes = await asyncio.gather(
            *(_outcome(limiter.try_acquire(identifier)) for identifier in identifiers)
        )
    finally:
        await limiter.aclose()
        await client.aclose()
        await proxies.aclose()
    assert len(batch) == 1 and batch[0] >= 2
    assert all(told_admitted(outcome) for outcome in outcomes), outcomes
    assert sum(resent) == batch[0] - 1, f"{sum(resent)} resent of a pipeline of {batch[0]}"

    async def stored() -> int:
        async with Limiter(local_cluster.url, [ROOMY], prefix=prefix, deadline=5.0) as reader:
            return sum([ROOMY.amount - (await reader.peek(i)).remaining for i in identifiers])

    converged, total = await settle(stored, 20)
    assert converged, f"stored {total} for 20 admitted"


@pytest.mark.parametrize("spread", [False, True], ids=["one slot", "twenty slots"])
async def test_a_batch_whose_reply_is_cut_is_resent_and_charged_once(
    local_cluster: cluster.Cluster, prefix: str, spread: bool
) -> None:
    """20 calls leave as one FCALL: of decide_many on one identifier, or of decide_node on 20
    identifiers on 20 slots of one node. Its reply is cut after 8 lines (the client holds no
    whole reply) and the connection reset. The calls ran, but no caller knows: each is
    resent on its own and replays its op. All 20 are admitted, and the store holds 20, not
    40."""
    from aiolimit._calls import decide_script

    if spread:
        node, identifiers = _on_slots_of_one_node(local_cluster, prefix, 20)
        function = b"aiolimit_node_"
    else:
        node = owner(local_cluster, prefix, "ip:198.51.100.9")
        identifiers = ["ip:198.51.100.9"] * 20
        function = b"aiolimit_many_"
    admin = Redis(host=node.host, port=node.port)
    await admin.script_load(decide_script().source)
    await admin.aclose()
    proxies = await Proxies().start((n.host, n.port) for n in local_cluster.nodes)
    client = proxied_client(local_cluster, proxies)
    limiter = Limiter(client, [ROOMY], prefix=prefix)
    batch: list[int] = []
    resent: list[int] = []
    sent: list[int] = []
    try:
        for identifier in set(identifiers):  # (the slot map, and the library on the node)
            await limiter.peek(identifier)
        proxy = proxies[node.port]
        on_request, on_reply = _cut_after_first_reply(batch, resent)

        def watch(link: Link, data: bytes) -> None:
            if not batch and function in data:
                sent.append(script_calls(data))
                batch.append(2)  # (the hooks' mark: a batch, whatever its call count)
                link.marks["cut"] = True
                return
            on_request(link, data)

        proxy.on_request, proxy.on_reply = watch, on_reply
        outcomes = await asyncio.gather(
            *(_outcome(limiter.try_acquire(identifier)) for identifier in identifiers)
        )
    finally:
        await limiter.aclose()
        await client.aclose()
        await proxies.aclose()
    assert sent == [1], f"the 20 calls left as {sent} script calls, not one batch"
    assert all(told_admitted(outcome) for outcome in outcomes), outcomes
    assert sum(resent) == 20, f"{sum(resent)} calls resent of 20 without a reply"

    async def stored() -> int:
        return sum(
            [
                await charged(local_cluster.url, prefix, identifier)
                for identifier in set(identifiers)
            ]
        )

    converged, total = await settle(stored, 20)
    assert converged, f"stored {total} for 20 admitted"
