"""Standalone, cluster and memory:// answer alike (the script's fast path, a cross-slot
refusal's remaining), and a refund through a decision that sent nothing can be sent again
(from an adversarial review). Real redis-server processes (conftest)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from aiolimit import InvalidRequestError, Limit, Limiter
from aiolimit._protocol import MAX_IN_FLIGHT
from aiolimit.testing import ManualClock

START = 1_700_000_040.0  # on a minute boundary


# -- change 4: refund(decision=) -------------------------------------------------------------


async def test_refund_cancelled_while_queued_for_its_key_can_be_sent_again(
    standalone_proxy: Any, prefix: str
) -> None:
    """refund(decision=) subtracts from the decision's "left" before it awaits
    ``Protocol.refund``, whose first await (``_enter``: a place among the MAX_IN_FLIGHT calls
    on the key) is not shielded. A refund cancelled (or out of its deadline) while it waits
    in line sent nothing, yet its decision counts it as given back: the caller can never
    refund that charge (InvalidRequestError), and the unit stays charged."""
    clock = ManualClock(START)
    async with Limiter(
        standalone_proxy.url, "1000/minute", prefix=prefix, clock=clock, deadline=None
    ) as limiter:
        charged = await limiter.try_acquire("user:1")
        assert charged.allowed
        standalone_proxy.delay = 0.5  # every reply from now on is late: calls stay in flight
        busy = [asyncio.create_task(limiter.try_acquire("user:1")) for _ in range(MAX_IN_FLIGHT)]
        await asyncio.sleep(0.05)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(limiter.refund("user:1", decision=charged), 0.1)
        await asyncio.gather(*busy)
        standalone_proxy.delay = 0
        await asyncio.sleep(0.2)  # (a refund sent in the background would have landed)
        before = (await limiter.peek("user:1")).remaining
        # Nothing was sent: the caller may send it again, and it lands once.
        try:
            await limiter.refund("user:1", decision=charged)
        except InvalidRequestError as error:
            pytest.fail(f"a refund that sent nothing used up the decision: {error}")
        assert (await limiter.peek("user:1")).remaining == before + 1


# -- change 3: the script's fast path on a Redis Cluster and memory:// ---------------------

from aiolimit import FixedWindow  # noqa: E402

SHAPE = [Limit(5, per=1, precision=0.25), FixedWindow(12, per=4), Limit(40, per=10)]
IDS = ["ip:a", "ip:b", "user:c", "user:d", "org:e", "k:f", "k:g", "k:h", "k:i"]


async def _program(url: str, prefix: str, seed: int, count: int) -> list[Any]:
    import random

    rng = random.Random(seed)
    clock = ManualClock(START)
    told = []
    async with Limiter(url, SHAPE, prefix=prefix, clock=clock) as limiter:
        for _ in range(count):
            roll = rng.random()
            if roll < 0.03:
                clock.advance(11)
            else:
                clock.advance(rng.choice((0, 0, 0.001, 0.05, 0.2, 0.6)))
            ids = rng.sample(IDS, rng.choice((1, 1, 2, 3, 5, 8)))
            weight = rng.choice((1, 1, 1, 2, 3))
            kind = rng.random()
            if kind < 0.1:
                d = await limiter.peek(ids, weight)
                told.append(("peek", d.allowed, d.remaining))
                continue
            d = await limiter.try_acquire(ids, weight)
            # (a refusal's remaining: see the cross-slot refusal test below)
            told.append(
                ("acq", tuple(ids), weight, d.allowed, d.remaining if d.allowed else None,
                 round(d.retry_after, 4),
                 tuple((p.identifier, p.allowed, p.remaining if d.allowed else None)
                       for p in d.details))
            )  # fmt: skip
            if d.allowed and kind < 0.2:
                await limiter.refund(ids[0], decision=d)
                told.append(("refund", ids[0]))
    return told


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_held_fast_path_on_cluster_and_memory_answers_as_standalone(
    redis_url: str, redis_cluster_url: str, prefix: str, seed: int
) -> None:
    """The same random program (several identifiers, windows, refusals, refunds) on a
    standalone server, a Redis Cluster (batches through decide_node, cross-slot two phases)
    and memory://: every answer the same."""
    standalone = await _program(redis_url, prefix + ":s", seed, 300)
    cluster = await _program(redis_cluster_url, prefix + ":c", seed, 300)
    memory = await _program("memory://", prefix + ":m", seed, 300)
    for i, (s, c, m) in enumerate(zip(standalone, cluster, memory, strict=True)):
        assert s == c, (i, s, c)
        assert s == m, (i, s, m)


async def test_a_cross_slot_refusal_reports_the_remaining_stored_as_standalone_does(
    redis_url: str, redis_cluster_url: str, prefix: str
) -> None:
    """A refusal charged nothing. On a standalone server (and memory://) a refused decision's
    allowing pairs report what is stored (5 left on "b"); on a cluster, a refusal at the
    check phase reported them as if charged (5 - 3 = 2): the CHECK calls' replies were
    merged as they are, and Decision.remaining and the RateLimit headers depended on the
    store's topology. They are reported as stored now (reset_after stays the one after the
    charge)."""
    told = {}
    for name, url in (("standalone", redis_url), ("cluster", redis_cluster_url)):
        clock = ManualClock(START)
        async with Limiter(url, [Limit(5, per=1)], prefix=f"{prefix}:{name}", clock=clock) as lim:
            assert (await lim.try_acquire("a", 3)).allowed
            refused = await lim.try_acquire(["a", "b"], 3)
            assert not refused.allowed
            told[name] = {p.identifier: p.remaining for p in refused.details}
            assert (await lim.peek("b")).remaining == 5  # nothing charged on b
    assert told["standalone"] == {"a": 2, "b": 5}
    assert told["cluster"] == told["standalone"]
