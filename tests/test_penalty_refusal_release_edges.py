"""Penalty mode across slots: the refusal that ``_release_refused`` returns (29ec82c).

Under ``count_refused`` a call across slots commits on every slot; when a slot refuses,
``_two_phase`` releases the ``Concurrency`` leases the allowing slots took, waits for that
release until ``RELEASE_MARGIN`` before the decision's deadline at most, and returns the
refusal with the released pairs replaced by the release's reply.

Invariants checked here, on a private two-primary cluster: a store refusal comes back as a
refusal (never an error, never a degraded admission), whatever the release meets (a frozen
or killed node, a tiny deadline, no deadline, the limiter closed meanwhile); its fields are
consistent (``remaining`` the least of its pairs, ``reset_after`` the largest, the binding
pair the refusing one, ``details`` in the call's order, ``lease`` None) and equal ``peek``'s
right after; another holder's leases (another limiter's, other weights) are never dropped;
and once the release lands, or the lease expires, nothing is held.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
from redis.crc import key_slot

import cluster
from aiolimit import Concurrency, Decision, Limit, Limiter
from aiolimit._deadline import current_deadline
from aiolimit._keys import main_key

pytestmark = pytest.mark.cluster

RATE = Limit(1000, per=3600, precision=60)


@pytest.fixture(scope="module")
def nodes() -> Iterator[cluster.Cluster]:
    with cluster.start_cluster(primaries=2, replicas_per_primary=0) as started:
        yield started


def _on(nodes: cluster.Cluster, prefix: str, kind: str, node: cluster.Node, nth: int = 0) -> str:
    """The ``nth`` identifier of ``kind`` whose main key lives on ``node``."""
    found = 0
    for i in range(100_000):
        identifier = f"{kind}:{i}"
        slot = key_slot(main_key(prefix, identifier).encode())
        if nodes.node_for_slot(slot).port == node.port:
            if found == nth:
                return identifier
            found += 1
    raise AssertionError(f"no identifier on {node!r}")


def _rules(c_max: int = 3, r_max: int = 2, lease_ttl: float = 60) -> dict[str, Any]:
    return {
        "c": [Concurrency(c_max, lease_ttl=lease_ttl), RATE],
        "r": [Limit(r_max, per=3600, precision=60)],
        "t": [RATE],
    }


def _lease_pairs(decision: Decision, identifier: str) -> list[Any]:
    return [
        p for p in decision.details if p.identifier == identifier and p.limit.wire[0] == "lease"
    ]


async def _held(limiter: Limiter, c: str) -> int:
    (pair,) = _lease_pairs(await limiter.peek(c), c)
    return int(pair.limit.amount - pair.remaining)


def _assert_consistent_refusal(decision: Decision, refusing: str) -> None:
    """A refusal's own fields agree with its details (``Decision.from_pairs``'s rules)."""
    assert not decision.allowed and not decision.degraded and not decision.denied
    assert decision.lease is None
    details = decision.details
    assert decision.remaining == min(p.remaining for p in details)
    assert decision.reset_after == max(p.reset_after for p in details)
    refused = [p for p in details if not p.allowed]
    assert refused, details
    binding = max(refused, key=lambda p: p.retry_after)
    assert decision.identifier == refusing == binding.identifier
    assert decision.limit == binding.limit
    assert decision.retry_after == binding.retry_after > 0
    for pair in details:
        if pair.allowed:
            assert pair.retry_after == 0.0, pair


def _pause_on_release(limiter: Limiter, node: cluster.Node) -> tuple[asyncio.Event, Any]:
    """Makes the limiter's next lease release pause ``node`` first (once the store refused,
    before the release is answered): the event is set then; call the second item to put the
    plain release back."""
    protocol = limiter._protocol
    release = protocol.lease_call
    entered = asyncio.Event()

    async def freezing(*args: Any, **kwargs: Any) -> Any:
        node.pause()
        entered.set()
        return await release(*args, **kwargs)

    def restore() -> None:
        protocol.lease_call = release  # type: ignore[method-assign]

    protocol.lease_call = freezing  # type: ignore[method-assign]
    return entered, restore


async def _spend(limiter: Limiter, r: str, weight: int) -> None:
    spent = await limiter.try_acquire(r, weight)
    assert spent.allowed


@pytest.mark.parametrize("deadline", [1.0, None])
async def test_the_refusal_equals_peek_right_after_with_weights_and_two_holders(
    nodes: cluster.Cluster, deadline: float | None
) -> None:
    """Penalty mode. ``c1`` and ``c2`` (``Concurrency(3)`` and a rate limit) on node A, ``t``
    and ``r`` (spent) on node B; a holder keeps one place on ``c1`` (taken 0.3 s earlier, so
    the lease set's newest expiry is not the refused call's). A call of weight 2 on
    ``[c1, t, c2, r]`` commits on both nodes (A takes 2 places on each ``c``), B refuses,
    and the leases are released. The refusal must read exactly as ``peek`` does right after
    (pair for pair, in the call's order; times within 0.2 s): ``c1`` 2 places left, its
    reset the holder's, ``c2`` all 3 left and reset 0; and its own fields must agree with its
    details (binding pair ``r``)."""
    prefix = f"eq{deadline}"
    node_a, node_b = nodes.primaries()[:2]
    c1, c2 = _on(nodes, prefix, "c", node_a), _on(nodes, prefix, "c", node_a, 1)
    t, r = _on(nodes, prefix, "t", node_b), _on(nodes, prefix, "r", node_b)
    async with Limiter(
        nodes.url, _rules(), prefix=prefix, count_refused=True, deadline=deadline
    ) as lim:
        holder = await lim.try_acquire(c1)
        assert holder.lease is not None
        await _spend(lim, r, 2)
        await asyncio.sleep(0.3)
        refused = await lim.try_acquire([c1, t, c2, r], 2)
        after = await lim.peek([c1, t, c2, r], 2)
        _assert_consistent_refusal(refused, r)
        assert [(p.identifier, p.limit) for p in refused.details] == [
            (p.identifier, p.limit) for p in after.details
        ]
        for got, now in zip(refused.details, after.details, strict=True):
            assert (got.allowed, got.remaining) == (now.allowed, now.remaining), (got, now)
            assert abs(got.reset_after - now.reset_after) < 0.2, (got, now)
            assert abs(got.retry_after - now.retry_after) < 0.2, (got, now)
        (lease1,) = _lease_pairs(refused, c1)
        (lease2,) = _lease_pairs(refused, c2)
        assert lease1.remaining == 2 and 59 < lease1.reset_after < 59.8, lease1
        assert lease2.remaining == 3 and lease2.reset_after == 0.0, lease2
        await holder.lease.release()
        assert await _held(lim, c1) == 0 and await _held(lim, c2) == 0


async def test_duplicate_identifiers_count_once_in_the_refusal(nodes: cluster.Cluster) -> None:
    """``[c, r, c, c]`` (duplicates count once) with weight 2 under penalty: one lease pair
    for ``c`` in the refusal, reporting all 3 places (the release gave both back), and none
    held afterwards."""
    prefix = "dup"
    node_a, node_b = nodes.primaries()[:2]
    c, r = _on(nodes, prefix, "c", node_a), _on(nodes, prefix, "r", node_b)
    async with Limiter(nodes.url, _rules(), prefix=prefix, count_refused=True) as lim:
        await _spend(lim, r, 2)
        refused = await lim.try_acquire([c, r, c, c], 2)
        _assert_consistent_refusal(refused, r)
        assert [p.identifier for p in refused.details] == [c, c, r]
        (lease,) = _lease_pairs(refused, c)
        assert lease.remaining == 3 and lease.reset_after == 0.0
        assert await _held(lim, c) == 0


async def test_another_limiters_leases_on_the_same_identifier_survive_the_release(
    nodes: cluster.Cluster,
) -> None:
    """The same identifier under two limiters: ``other`` (no penalty, ``c`` under
    ``Concurrency(3)`` alone) holds 2 places; the penalty limiter's call on ``[c, r]``
    takes the third, is refused by ``r`` and releases it. ``other``'s two leases stay held
    (the release drops this op's members only), both limiters' ``peek`` agree with the
    refusal (1 place left), and ``other``'s release frees all 3."""
    prefix = "two"
    node_a, node_b = nodes.primaries()[:2]
    c, r = _on(nodes, prefix, "c", node_a), _on(nodes, prefix, "r", node_b)
    other_rules = {"c": [Concurrency(3, lease_ttl=60)], "r": [Limit(5, per=3600)]}
    async with (
        Limiter(nodes.url, other_rules, prefix=prefix) as other,
        Limiter(nodes.url, _rules(), prefix=prefix, count_refused=True) as lim,
    ):
        held = await other.try_acquire(c, 2)
        assert held.allowed and held.lease is not None
        await _spend(lim, r, 2)
        refused = await lim.try_acquire([c, r])
        _assert_consistent_refusal(refused, r)
        (lease,) = _lease_pairs(refused, c)
        assert lease.remaining == 1, lease
        assert await _held(lim, c) == 2 and await _held(other, c) == 2
        await held.lease.release()
        assert await _held(lim, c) == 0


async def test_a_tiny_deadline_never_turns_a_store_refusal_into_anything_else(
    nodes: cluster.Cluster,
) -> None:
    """``deadline=0.05``, ``on_error="open"``: 40 penalty calls on ``[c, r]`` (``r`` spent).
    A call whose commit the deadline cuts is the failure policy's (the store did not
    answer); but every call whose commits came back refused (``_release_refused`` entered)
    must end a refusal, whatever its release took. Afterwards nothing is held."""
    prefix = "tiny"
    node_a, node_b = nodes.primaries()[:2]
    c, r = _on(nodes, prefix, "c", node_a), _on(nodes, prefix, "r", node_b)
    async with Limiter(
        nodes.url, _rules(), prefix=prefix, count_refused=True, deadline=0.05, on_error="open"
    ) as lim:
        await lim.peek([c, r])  # (connections and library in place)
        await _spend(lim, r, 2)
        protocol = lim._protocol
        original = protocol._release_refused
        entered = 0

        async def counted(*args: Any, **kwargs: Any) -> Any:
            nonlocal entered
            entered += 1
            return await original(*args, **kwargs)

        protocol._release_refused = counted  # type: ignore[method-assign]
        outcomes = []
        for _ in range(40):
            before = entered
            decision = await lim.try_acquire([c, r])
            if entered > before:
                outcomes.append((decision.allowed, decision.degraded))
        protocol._release_refused = original  # type: ignore[method-assign]
        await asyncio.wait_for(protocol.aclose(), 15)
    assert entered > 0
    assert set(outcomes) == {(False, False)}, outcomes
    async with Limiter(nodes.url, _rules(), prefix=prefix) as fresh:
        assert await _held(fresh, c) == 0


async def test_closing_the_limiter_while_the_release_is_frozen_returns_the_refusal(
    nodes: cluster.Cluster,
) -> None:
    """No deadline; node A (``c``) frozen right after the commits, so the release does not
    answer. ``aclose()`` of the limiter while the caller waits for it: it must not hang
    (bounded by the undo budget), the caller gets the refusal (not a CancelledError, not an
    error), and once A is back the lease is released or expires (``lease_ttl`` 2 s)."""
    prefix = "close"
    node_a, node_b = nodes.primaries()[:2]
    c, r = _on(nodes, prefix, "c", node_a), _on(nodes, prefix, "r", node_b)
    rules = _rules(lease_ttl=2)
    lim = Limiter(nodes.url, rules, prefix=prefix, count_refused=True, deadline=None)
    await _spend(lim, r, 2)
    entered, restore = _pause_on_release(lim, node_a)
    try:
        caller = asyncio.create_task(lim.try_acquire([c, r]))
        await asyncio.wait_for(entered.wait(), 5)
        restore()
        started = time.monotonic()
        await asyncio.wait_for(lim.aclose(), 12)
        closed_in = time.monotonic() - started
        refused = await asyncio.wait_for(caller, 5)
    finally:
        node_a.resume()
    assert closed_in < 6, closed_in
    _assert_consistent_refusal(refused, r)
    async with Limiter(nodes.url, rules, prefix=prefix) as fresh:
        for _ in range(40):  # (released when A answers, else expired within 2 s)
            if await _held(fresh, c) == 0:
                break
            await asyncio.sleep(0.1)
        assert await _held(fresh, c) == 0


async def test_a_caller_cancelled_while_the_release_is_frozen_leaves_nothing_counted(
    nodes: cluster.Cluster,
) -> None:
    """Deadline 2 s; node A frozen during the release; the caller is cancelled while it
    waits. It hears its own cancellation; once A is back, the op is undone everywhere (the
    penalty too: ``c``'s and ``t``'s rate pairs agree) and no lease is held."""
    prefix = "cancelfrozen"
    node_a, node_b = nodes.primaries()[:2]
    c, r = _on(nodes, prefix, "c", node_a), _on(nodes, prefix, "r", node_b)
    t = _on(nodes, prefix, "t", node_b)
    async with Limiter(nodes.url, _rules(), prefix=prefix, count_refused=True, deadline=2.0) as lim:
        await _spend(lim, r, 2)
        protocol = lim._protocol
        entered, restore = _pause_on_release(lim, node_a)
        try:
            caller = asyncio.create_task(lim.try_acquire([c, r, t]))
            await asyncio.wait_for(entered.wait(), 5)
            restore()
            await asyncio.sleep(0.02)  # (within the refusal's wait for its release)
            caller.cancel()
            with pytest.raises(asyncio.CancelledError):
                await caller
            await asyncio.sleep(0.2)
        finally:
            node_a.resume()
        await asyncio.wait_for(protocol.aclose(), 20)
    async with Limiter(nodes.url, _rules(), prefix=prefix) as fresh:
        assert await _held(fresh, c) == 0
        rate_c = RATE.amount - (await fresh.peek(c)).details[1].remaining
        rate_t = RATE.amount - (await fresh.peek(t)).remaining
    assert rate_c == rate_t and rate_c in (0, 1), (rate_c, rate_t)


async def test_a_short_loop_stall_near_the_deadline_leaves_the_refusal_a_refusal(
    nodes: cluster.Cluster,
) -> None:
    """Deadline 1 s, ``on_error="open"``. The store refuses a penalty call on ``[c, r]``
    within milliseconds; node A (``c``) freezes before the lease release answers. Another
    coroutine on the loop runs 100 ms of blocking work, from 70 ms before the deadline to
    30 ms past it (a stall a tenth of the deadline, well within what a busy event loop does).

    Found when ``_release_refused`` held the refusal back until ``deadline - RELEASE_MARGIN``
    (50 ms before it): when the loop came back, the release wait's timer and the decision's
    deadline (the policy's ``_DeadlineWheel``, its timer armed for this decision) were due in
    one iteration, the wheel cancelled the task before it resumed, ``acquire`` spawned an
    undo of the op and the scope turned it into ``DeadlineExceeded``: the failure policy
    admitted a request the store had refused (with ``on_error="raise"``: BackendUnavailable).
    The refusal now waits ``RELEASE_WAIT`` (0.1 s) at most, then leaves the release to the
    background: it is returned long before the stall.

    Expected: the refusal the store gave, not degraded.
    """
    prefix = "stall"
    node_a, node_b = nodes.primaries()[:2]
    c, r = _on(nodes, prefix, "c", node_a), _on(nodes, prefix, "r", node_b)
    async with Limiter(
        nodes.url, _rules(), prefix=prefix, count_refused=True, deadline=1.0, on_error="open"
    ) as lim:
        await _spend(lim, r, 2)
        protocol = lim._protocol
        release = protocol.lease_call
        loop = asyncio.get_running_loop()

        async def freezing(*args: Any, **kwargs: Any) -> Any:
            node_a.pause()
            deadline = current_deadline()  # (the decision's: this task inherited it)
            assert deadline is not None
            loop.call_at(deadline - 0.07, time.sleep, 0.1)  # a neighbour's blocking work
            return await release(*args, **kwargs)

        protocol.lease_call = freezing  # type: ignore[method-assign]
        # (the policy's deadline timer is then armed for this decision itself, not re-armed
        # from an earlier decision's: both timers come due in the loop's first iteration)
        await asyncio.sleep(1.1)
        try:
            started = time.monotonic()
            decision = await lim.try_acquire([c, r])
            took = time.monotonic() - started
        finally:
            protocol.lease_call = release  # type: ignore[method-assign]
            node_a.resume()
        await asyncio.wait_for(protocol.aclose(), 15)
        assert took < 1.5, took
    async with Limiter(nodes.url, _rules(), prefix=prefix) as fresh:
        assert await _held(fresh, c) == 0
    assert (decision.allowed, decision.degraded) == (False, False), decision


async def test_a_release_to_a_killed_node_still_returns_the_refusal() -> None:
    """A private cluster: node A (``c``) is killed right after the commits, so the release
    meets a dead node (the cluster client retries within its budget). ``on_error="open"``,
    deadline 1 s, and no deadline: both calls are refusals (not degraded, no error), within
    the deadline (or the undo budget), and ``aclose()`` ends within its grace."""
    with cluster.start_cluster(primaries=2, replicas_per_primary=0) as own:
        node_a, node_b = own.primaries()[:2]
        verdicts = []
        for deadline in (1.0, None):
            prefix = f"kill{deadline}"
            c, r = _on(own, prefix, "c", node_a), _on(own, prefix, "r", node_b)
            if not node_a.is_running():
                node_a.restart()
                own.wait_healthy()
            url = f"redis+cluster://{node_b.host}:{node_b.port}"
            lim = Limiter(
                url, _rules(), prefix=prefix, count_refused=True, deadline=deadline,
                on_error="open",
            )  # fmt: skip
            try:
                await _spend(lim, r, 2)
                protocol = lim._protocol
                release = protocol.lease_call

                async def killing(*args: Any, release: Any = release, **kwargs: Any) -> Any:
                    node_a.kill()
                    return await release(*args, **kwargs)

                protocol.lease_call = killing  # type: ignore[method-assign]
                started = time.monotonic()
                decision = await lim.try_acquire([c, r])
                took = time.monotonic() - started
                protocol.lease_call = release  # type: ignore[method-assign]
            finally:
                closing = time.monotonic()
                await asyncio.wait_for(lim.aclose(), 15)
                closed_in = time.monotonic() - closing
            _assert_consistent_refusal(decision, r)
            verdicts.append((deadline, took, closed_in))
        for deadline, took, closed_in in verdicts:
            assert took < (deadline or 5.0) + 0.2, verdicts
            assert closed_in < 6.5, verdicts


async def test_closing_the_limiter_as_a_refusal_starts_its_release_does_not_cancel_the_caller(
    nodes: cluster.Cluster,
) -> None:
    """Shutdown while traffic is in flight. A penalty call on ``[c, r]`` (``c`` on node A)
    is refused; just as ``_release_refused`` begins, another holder's release (``x``, on
    node B) is running in the background and the limiter's ``aclose()`` starts: it waits for
    the background tasks it sees (that release), then cancels whatever background task is
    left. Node A freezes, so the refused call's own release, spawned after ``aclose``
    looked, is still running then and is cancelled. The caller, which nobody cancelled,
    waits for that task (``wait_for(shield(release))``): the shield's outer future is
    cancelled with it, ``wait_for`` returns ``fut.result()`` and raises CancelledError, which
    ``_release_refused`` does not catch (``except Exception``). ``acquire`` then spawns an
    undo of the op on a closed limiter, after ``aclose`` has stopped waiting for tasks.

    Expected: the refusal (the store decided; ``aclose`` must not cancel a caller). Observed:
    CancelledError raised in a task that was never cancelled.
    """
    prefix = "closerace"
    node_a, node_b = nodes.primaries()[:2]
    c, r = _on(nodes, prefix, "c", node_a), _on(nodes, prefix, "r", node_b)
    x = _on(nodes, prefix, "c", node_b)
    rules = _rules(lease_ttl=2)
    lim = Limiter(nodes.url, rules, prefix=prefix, count_refused=True, deadline=None)
    await _spend(lim, r, 2)
    holder = await lim.try_acquire(x)
    assert holder.lease is not None
    protocol = lim._protocol
    original = protocol._release_refused
    background: list[asyncio.Task[Any]] = []

    async def closing_meanwhile(*args: Any, **kwargs: Any) -> Any:
        node_a.pause()
        assert holder.lease is not None
        background.append(asyncio.create_task(holder.lease.release()))
        await asyncio.sleep(0)  # (its release is under way, in the limiter's tasks)
        background.append(asyncio.create_task(lim.aclose()))
        await asyncio.sleep(0)  # (aclose has looked at the tasks, and waits for them)
        return await original(*args, **kwargs)

    protocol._release_refused = closing_meanwhile  # type: ignore[method-assign]
    outcome: Any
    try:
        try:
            outcome = await asyncio.wait_for(lim.try_acquire([c, r]), 10)
        except asyncio.CancelledError as error:
            outcome = error
        await asyncio.wait_for(asyncio.gather(*background, return_exceptions=True), 15)
    finally:
        node_a.resume()
    async with Limiter(nodes.url, rules, prefix=prefix) as fresh:
        for _ in range(40):  # (released when A answers, else expired within 2 s)
            if await _held(fresh, c) == 0:
                break
            await asyncio.sleep(0.1)
        assert await _held(fresh, c) == 0
    assert isinstance(outcome, Decision), repr(outcome)
    _assert_consistent_refusal(outcome, r)
