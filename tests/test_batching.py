"""The tick batcher's deadlines (pure logic: a send function stands in for a server)."""

from __future__ import annotations

import asyncio
import time

from aiolimit._stores.batching import Pending, TickBatcher, wait_results


async def test_each_call_times_out_at_its_own_deadline_and_the_rest_still_get_replies() -> None:
    """One flush, calls with different deadlines, a server that answers only some of them:
    each unanswered call gets a TimeoutError at its own deadline (not the flush's latest),
    the answered ones their reply, and a late reply to a timed-out call is dropped."""
    sent: list[list[Pending]] = []
    release = asyncio.Event()

    async def send(calls: list[Pending]) -> None:
        sent.append(calls)
        calls[0].resolve([1])  # answered at once
        await release.wait()  # the others hang until released
        for call in calls:
            call.resolve([2])

    batcher = TickBatcher(send, split=False)
    start = time.monotonic()
    deadlines = [start + 5, start + 0.05, start + 0.15, start + 5]
    futures = [batcher.submit([f"k{i}"], [], deadline) for i, deadline in enumerate(deadlines)]
    answered_at: dict[int, float] = {}

    async def watch(i: int) -> None:
        (result,) = await wait_results([futures[i]])
        answered_at[i] = time.monotonic() - start
        assert (result == [1]) if i == 0 else isinstance(result, TimeoutError), (i, result)

    await asyncio.gather(watch(0), watch(1), watch(2))
    assert len(sent) == 1 and len(sent[0]) == 4  # one flush, one send
    assert answered_at[0] < 0.04
    assert 0.05 <= answered_at[1] < 0.14
    assert 0.15 <= answered_at[2] < 0.5
    release.set()
    assert (await futures[3]) == [2]  # the long deadline's call got its reply
    assert all(
        isinstance(futures[i].result(), TimeoutError) for i in (1, 2)
    )  # late replies dropped
    assert all(call.watch is None for call in sent[0])  # every call answered: no timer left
    await batcher.aclose()


async def test_a_call_out_of_time_before_its_flush_is_not_sent() -> None:
    sent: list[list[Pending]] = []

    async def send(calls: list[Pending]) -> None:
        sent.append(calls)
        for call in calls:
            call.resolve([1])

    batcher = TickBatcher(send, split=False)
    late = batcher.submit(["late"], [], time.monotonic() - 0.001)
    fine = batcher.submit(["fine"], [], time.monotonic() + 5)
    results = await wait_results([late, fine])
    assert isinstance(results[0], TimeoutError)
    assert results[1] == [1]
    assert [[call.keys[0] for call in calls] for calls in sent] == [["fine"]]
    await batcher.aclose()


async def test_a_cancelled_waiter_leaves_its_batch_and_timer_consistent() -> None:
    """A caller cancelled while its call is in flight: the others get their replies and
    the flush's timer is gone once the pipeline answers."""
    release = asyncio.Event()
    sent: list[list[Pending]] = []

    async def send(calls: list[Pending]) -> None:
        sent.append(calls)
        await release.wait()
        for call in calls:
            call.resolve([3])

    batcher = TickBatcher(send, split=False)
    deadline = time.monotonic() + 5
    waiters = [
        asyncio.ensure_future(wait_results([batcher.submit(["k"], [], deadline)])) for _ in range(3)
    ]
    await asyncio.sleep(0.01)
    waiters[1].cancel()
    release.set()
    results = await asyncio.gather(*waiters, return_exceptions=True)
    assert isinstance(results[1], asyncio.CancelledError)
    assert results[0] == [[3]] and results[2] == [[3]]
    assert all(call.watch is None for call in sent[0])
    await batcher.aclose()
