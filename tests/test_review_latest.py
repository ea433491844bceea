"""Adversarial review h5 of the latest changes: release counter for Concurrency waiters,
cross-slot acquire order, the script's fast path on a cluster / memory://, and
refund(decision=). Real redis-server processes (conftest); each test names what it checks."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from aiolimit import Concurrency, InvalidRequestError, Limit, Limiter
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
