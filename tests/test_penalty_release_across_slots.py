"""Penalty mode across slots: the release of a refused call's leases (4348fb5).

Under ``count_refused`` an acquire across slots commits on every slot at once (no check
phase). When some slot refuses, ``_two_phase`` now releases, with ``lease_call(RELEASE)``,
the ``Concurrency`` leases the allowing slots took, before it returns the refusal. That
release is a new await between the decision and the caller: these tests put a frozen node,
a cancellation and a crowd there.

Invariants: a refused call is a refusal (not an error, not a degraded admission); it holds
nothing afterwards; leases held never exceed a limit; refusals are counted on every rate
pair alike (once, or, for a call its caller gave up on, not at all: its op is undone).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from typing import Any

import pytest
from redis.crc import key_slot

import cluster
from aiolimit import Concurrency, Limit, Limiter
from aiolimit._keys import main_key

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def nodes() -> Iterator[cluster.Cluster]:
    with cluster.start_cluster(primaries=2, replicas_per_primary=0) as started:
        yield started


def _on(nodes: cluster.Cluster, prefix: str, kind: str, node: cluster.Node) -> str:
    for i in range(100_000):
        identifier = f"{kind}:{i}"
        slot = key_slot(main_key(prefix, identifier).encode())
        if nodes.node_for_slot(slot).port == node.port:
            return identifier
    raise AssertionError(f"no identifier on {node!r}")


def _rules(c_max: int = 2, r_max: int = 1) -> dict[str, Any]:
    return {
        "c": [Concurrency(c_max, lease_ttl=60), Limit(10_000, per=3600, precision=60)],
        "r": [Limit(r_max, per=3600, precision=60)],
        "t": [Limit(10_000, per=3600, precision=60)],
    }


async def _used(limiter: Limiter, c: str, t: str) -> tuple[int, int, int]:
    """(c's places held, c's rate limit used, t's rate limit used)."""
    places, rate = (await limiter.peek(c)).details
    return (
        places.limit.amount - places.remaining,
        rate.limit.amount - rate.remaining,
        10_000 - (await limiter.peek(t)).remaining,
    )


async def test_a_refusal_whose_release_meets_a_frozen_node_is_still_a_refusal(
    nodes: cluster.Cluster,
) -> None:
    """Penalty mode, ``c`` (``Concurrency(2)``) on node A, ``r`` (``Limit(1)``, spent) on node B;
    ``on_error="open"``, a 1 s deadline. A call on ``[c, r]`` commits on both: A allows
    (takes a lease), B refuses. The store has decided: a refusal. Node A then freezes before
    ``_two_phase``'s release of that lease answers (the release waits up to ``UNDO_BUDGET``, 5
    s, inside the caller's deadline). The deadline cancels the wait; ``acquire`` takes the
    error for a failed decision, spawns an undo of the op (which also credits the penalty
    on every slot), and the limiter's failure policy answers: with ``on_error="open"``, a
    degraded *admission* of a request the store refused (``raise``: BackendUnavailable).
    Before 4348fb5 the refusal was returned at once.

    Expected: a refusal (not degraded). Observed: allowed, degraded."""
    prefix = "frozen"
    node_a, node_b = nodes.primaries()[:2]
    c, r = _on(nodes, prefix, "c", node_a), _on(nodes, prefix, "r", node_b)
    url = f"redis+cluster://{node_b.host}:{node_b.port}"
    async with Limiter(
        url, _rules(), prefix=prefix, count_refused=True, deadline=1.0, on_error="open"
    ) as lim:
        first = await lim.try_acquire([c, r])
        assert first.allowed and first.lease is not None
        await first.lease.release()
        protocol = lim._protocol
        release = protocol.lease_call

        async def freezing_release(*args: Any, **kwargs: Any) -> Any:
            node_a.pause()  # (right after the commit: the refusal is decided)
            return await release(*args, **kwargs)

        protocol.lease_call = freezing_release  # type: ignore[method-assign]
        try:
            refused = await lim.try_acquire([c, r])
        finally:
            protocol.lease_call = release  # type: ignore[method-assign]
            node_a.resume()
        verdict = (refused.allowed, refused.degraded)
        await asyncio.wait_for(protocol.aclose(), 15)  # (the background work ends)
    async with Limiter(url, _rules(), prefix=prefix) as fresh:
        places, _, _ = await _used(fresh, c, c.replace("c", "t"))
    assert places == 0  # (held: nothing leaked, whatever the verdict)
    assert verdict == (False, False)


async def test_a_caller_cancelled_during_the_release_leaves_nothing_held(
    nodes: cluster.Cluster,
) -> None:
    """The caller of a refused penalty call is cancelled while ``_two_phase`` releases its
    leases (the release is held back until the cancel lands). The release goes on (shielded);
    ``acquire`` undoes the op in the background, so the call ends counted nowhere, or (had
    the undo not run) everywhere: ``c``'s and ``t``'s rate pairs agree, and ``c`` holds no
    lease."""
    prefix = "cancel"
    node_a, node_b = nodes.primaries()[:2]
    c, r = _on(nodes, prefix, "c", node_a), _on(nodes, prefix, "r", node_b)
    t = _on(nodes, prefix, "t", node_b)
    async with Limiter(
        nodes.url, _rules(r_max=2), prefix=prefix, count_refused=True, deadline=5.0
    ) as lim:
        first = await lim.try_acquire([c, r, t], 2)
        assert first.allowed and first.lease is not None
        await first.lease.release()
        protocol = lim._protocol
        release = protocol.lease_call
        entered, go = asyncio.Event(), asyncio.Event()

        async def held_release(*args: Any, **kwargs: Any) -> Any:
            entered.set()
            await go.wait()
            return await release(*args, **kwargs)

        protocol.lease_call = held_release  # type: ignore[method-assign]
        try:
            task = asyncio.create_task(lim.try_acquire([c, r, t], 2))
            await asyncio.wait_for(entered.wait(), 5)
            task.cancel()
            await asyncio.sleep(0.05)
        finally:
            go.set()
            protocol.lease_call = release  # type: ignore[method-assign]
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(protocol.aclose(), 15)
    async with Limiter(nodes.url, _rules(r_max=2), prefix=prefix) as fresh:
        places, rate_c, rate_t = await _used(fresh, c, t)
    assert places == 0
    assert rate_c == rate_t and rate_c in (2, 4), (rate_c, rate_t)


async def test_a_crowd_of_refused_weighted_calls_never_exceeds_nor_leaks(
    nodes: cluster.Cluster,
) -> None:
    """Two limiters, 60 concurrent calls of weight 1-3 on ``[c, r, t]`` (``c`` under
    ``Concurrency(4)`` with a holder keeping 1 place throughout, ``r`` under ``Limit(6)``:
    most calls refused by ``r``), and ``[c, t]`` alone. Admitted holders never exceed 4
    places (counted by the tasks); afterwards only the keeper's place is held, and every
    call, refused or not, is counted once on ``c``'s and on ``t``'s rate pair."""
    prefix = "crowd"
    node_a, node_b = nodes.primaries()[:2]
    c, r = _on(nodes, prefix, "c", node_a), _on(nodes, prefix, "r", node_b)
    t = _on(nodes, prefix, "t", node_b)
    rules = _rules(c_max=4, r_max=6)
    limiters = [Limiter(nodes.url, rules, prefix=prefix, count_refused=True) for _ in range(2)]
    inside = peak = sent = 0
    errors: list[BaseException] = []
    try:
        keeper = await limiters[0].try_acquire(c)
        assert keeper.lease is not None
        sent += 1  # (counted on c's rate pair only: t gets one less below)

        async def one(limiter: Limiter, number: int) -> None:
            nonlocal inside, peak, sent
            rng = random.Random(number)
            weight = rng.randint(1, 3)
            ids = [c, r, t] if rng.random() < 0.8 else [c, t]
            try:
                decision = await limiter.try_acquire(ids, weight)
            except Exception as error:  # the verdict
                errors.append(error)
                return
            sent += weight
            if decision.allowed:
                assert decision.lease is not None
                inside += weight
                peak = max(peak, inside)
                await asyncio.sleep(rng.random() / 50)
                inside -= weight
                await decision.lease.release()

        await asyncio.wait_for(asyncio.gather(*(one(limiters[n % 2], n) for n in range(60))), 30)
        for limiter in limiters:
            await asyncio.wait_for(limiter._protocol.aclose(), 10)
        places, rate_c, rate_t = await _used(limiters[0], c, t)
        await keeper.lease.release()
    finally:
        for limiter in limiters:
            await limiter.aclose()
    assert errors == [], errors[:3]
    assert peak <= 3, peak  # (the keeper holds the fourth)
    assert places == 1, places
    assert (rate_c, rate_t) == (sent, sent - 1)


async def test_a_refusal_reports_the_places_its_release_gave_back(nodes: cluster.Cluster) -> None:
    """Penalty mode: a call on ``[c, r]`` refused by ``r`` (on another slot) took a lease on
    ``c`` and ``_two_phase`` released it before returning; the refusal is built from the raw
    replies (``replies_decision``), where ``c``'s slot reported its ``Concurrency`` pair after
    the charge: one place fewer than it has. One slot's call (the same limits on one
    identifier) reports an allowing pair of a refused call as it is, and ``peek`` right
    after says both places are free.

    Expected: the refusal's ``Concurrency`` pair has ``remaining`` 2, as ``peek`` does.
    Observed: 1 (the released lease still counted)."""
    prefix = "stale"
    node_a, node_b = nodes.primaries()[:2]
    c, r = _on(nodes, prefix, "c", node_a), _on(nodes, prefix, "r", node_b)
    async with Limiter(nodes.url, _rules(), prefix=prefix, count_refused=True) as lim:
        first = await lim.try_acquire([c, r])
        assert first.allowed and first.lease is not None
        await first.lease.release()
        refused = await lim.try_acquire([c, r])
        assert not refused.allowed and refused.lease is None
        (reported,) = [p for p in refused.details if isinstance(p.limit, Concurrency)]
        (now,) = [p for p in (await lim.peek(c)).details if isinstance(p.limit, Concurrency)]
    assert now.remaining == 2
    assert reported.remaining == now.remaining
