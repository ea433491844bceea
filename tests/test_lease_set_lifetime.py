"""A Concurrency lease set is never emptied and expires with its main key (9c62cb0).

``drop`` in ``lua/concurrency.lua`` leaves a placeholder member ``"~"`` scored ``-inf``
rather than empty the set, and ``flush`` in ``lua/decide.lua`` gives the set its main key's
TTL on every write (``mirror_leases``). These tests attack both halves, on a real server and
on the embedded engine (the same Lua):

- the placeholder is never a held lease: not in ``remaining``, ``retry_after`` or
  ``reset_after`` (check, peek, refusal), never brought back by ``renew``;
- the set never empties (double release, release after expiry, undo, weights past the ZREM
  batch of 1000, several ops released in any order), and holds nothing but the placeholder
  once every lease is gone;
- the set always has a TTL, never longer than its main key's (then Redis would hold the set
  alone: a migration of its slot answers TRYAGAIN to every call naming both keys) and never
  shorter (the main key alone: the same).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as redis_asyncio

from aiolimit import Concurrency, Limit, Limiter, RateLimited
from aiolimit._calls import RELEASE, RENEW, UNDO
from aiolimit._keys import main_key

PLACEHOLDER = b"~"
# PTTLs are read one after the other: the second is a few ms older.
TOLERANCE_MS = 50


@pytest.fixture(params=["redis", "memory"])
def url(request: pytest.FixtureRequest) -> str:
    if request.param == "memory":
        return "memory://"
    value: str = request.getfixturevalue("redis_url")
    return value


class Keys:
    """Raw reads of one identifier's two keys, on whichever store the limiter uses."""

    def __init__(self, limiter: Limiter, url: str, prefix: str, identifier: str) -> None:
        self.limiter, self.url = limiter, url
        self.main = main_key(prefix, identifier)
        self.aux = self.main + ":lease"
        self.raw: Any = None if url == "memory://" else redis_asyncio.Redis.from_url(url)

    async def command(self, *args: Any) -> Any:
        if self.raw is None:
            return self.limiter.store.engine.execute_command(*args)  # type: ignore[attr-defined]
        return await self.raw.execute_command(*args)

    async def members(self) -> list[tuple[bytes, float]]:
        if self.raw is not None:
            pairs = await self.raw.zrange(self.aux, 0, -1, withscores=True)
            return [(bytes(m), float(s)) for m, s in pairs]
        flat = await self.command("ZRANGE", self.aux, 0, -1, "WITHSCORES")
        return [(bytes(flat[i]), float(flat[i + 1])) for i in range(0, len(flat), 2)]

    async def ttls(self) -> tuple[int, int]:
        return int(await self.command("PTTL", self.main)), int(await self.command("PTTL", self.aux))

    async def assert_together(self) -> None:
        """Both keys present with a TTL each, the set's no longer than the main key's; or both
        gone."""
        main, aux = await self.ttls()
        if main == -2:
            assert aux == -2, f"the lease set outlives its main key: {aux} ms left"
            return
        assert main > 0, main
        assert aux != -1, "the lease set has no TTL"
        assert aux != -2, "the main key is alone: its lease set is gone"
        assert aux <= main + TOLERANCE_MS, (main, aux)
        assert aux >= main - TOLERANCE_MS, (main, aux)

    async def aclose(self) -> None:
        if self.raw is not None:
            await self.raw.aclose()


@pytest.fixture
async def keys_of(url: str, prefix: str) -> AsyncIterator[Any]:
    opened: list[Keys] = []

    def make(limiter: Limiter, identifier: str = "u:1") -> Keys:
        keys = Keys(limiter, url, prefix, identifier)
        opened.append(keys)
        return keys

    yield make
    for keys in opened:
        await keys.aclose()


async def test_the_placeholder_is_never_a_held_lease(url: str, prefix: str, keys_of: Any) -> None:
    """After a release leaves only the placeholder, the identifier reads as idle everywhere
    (peek, an allowed acquire, a refusal's wait) and the placeholder goes with the next
    charge."""
    async with Limiter(url, [Concurrency(3, lease_ttl=30)], prefix=prefix) as lim:
        keys = keys_of(lim)
        first = await lim.try_acquire("u:1")
        assert first.lease is not None
        await first.lease.release()
        assert await keys.members() == [(PLACEHOLDER, -math.inf)]
        await keys.assert_together()

        idle = await lim.peek("u:1")
        assert idle.allowed and idle.remaining == 3
        assert idle.reset_after == 0 and idle.retry_after == 0
        taken = await lim.try_acquire("u:1", 3)
        assert taken.allowed and taken.remaining == 0
        assert 29 <= taken.reset_after <= 30
        members = await keys.members()
        assert PLACEHOLDER not in [m for m, _ in members] and len(members) == 3
        refused = await lim.try_acquire("u:1")
        assert not refused.allowed and refused.remaining == 0
        assert 29 <= refused.retry_after <= 30, refused
        assert taken.lease is not None
        await taken.lease.release()
        assert await keys.members() == [(PLACEHOLDER, -math.inf)]
        again = await lim.peek("u:1", 3)
        assert again.allowed and again.remaining == 3 and again.reset_after == 0
        await keys.assert_together()


async def test_renew_never_brings_back_the_placeholder(url: str, prefix: str, keys_of: Any) -> None:
    """A renew of a released op (sent again, as a retried renew would) holds nothing, and
    the placeholder stays an expired member."""
    async with Limiter(url, [Concurrency(2, lease_ttl=30)], prefix=prefix) as lim:
        keys = keys_of(lim)
        decision = await lim.try_acquire("u:1", 2)
        lease = decision.lease
        assert lease is not None
        await lease.release()
        renewed = await lim._protocol.lease_call(RENEW, lease._plans, lease._weight, lease._op)
        assert not renewed.allowed
        assert await keys.members() == [(PLACEHOLDER, -math.inf)]
        assert (await lim.peek("u:1")).remaining == 2


async def test_the_lease_set_never_empties(url: str, prefix: str, keys_of: Any) -> None:
    """Releases twice, after expiry, of the largest weight (one whole ZREM batch), of several
    ops in any order, and an undo, all leave the set with the placeholder (never deleted
    while its main key lives), and its TTL its main key's."""
    limits = [Concurrency(1000, lease_ttl=0.3)]
    async with Limiter(url, limits, prefix=prefix) as lim:
        keys = keys_of(lim)
        proto = lim._protocol

        big = await lim.try_acquire("u:1", 993)
        small = await lim.try_acquire("u:1", 7)
        assert big.lease is not None and small.lease is not None
        await big.lease.release()
        assert len(await keys.members()) == 7
        await small.lease.release()
        assert await keys.members() == [(PLACEHOLDER, -math.inf)]
        await keys.assert_together()
        # The same release again (as a background retry would send it): nothing changes.
        small_lease = small.lease
        await proto.lease_call(RELEASE, small_lease._plans, 7, small_lease._op)
        assert await keys.members() == [(PLACEHOLDER, -math.inf)]

        # Released after it expired.
        late = await lim.try_acquire("u:1", 2)
        assert late.lease is not None
        await asyncio.sleep(0.4)
        await late.lease.release()
        assert await keys.members() == [(PLACEHOLDER, -math.inf)]
        await keys.assert_together()

        # Several ops, released newest first; then one undone rather than released.
        held = [await lim.try_acquire("u:1", w) for w in (1, 996, 3)]
        for decision in reversed(held):
            assert decision.lease is not None
            await decision.lease.release()
            assert await keys.command("EXISTS", keys.aux) == 1
        assert await keys.members() == [(PLACEHOLDER, -math.inf)]
        undone = await lim.try_acquire("u:1", 1000)
        assert undone.lease is not None
        await proto.decide(UNDO, undone.lease._plans, 1000, undone.lease._op)
        assert await keys.members() == [(PLACEHOLDER, -math.inf)]
        await keys.assert_together()
        # An undo of that op again, and a release of it after the undo: nothing to drop.
        await proto.decide(UNDO, undone.lease._plans, 1000, undone.lease._op)
        await undone.lease.release()
        assert await keys.members() == [(PLACEHOLDER, -math.inf)]
        assert (await lim.peek("u:1")).remaining == 1000
        await keys.assert_together()


async def test_every_write_leaves_both_keys_with_one_ttl(
    url: str, prefix: str, keys_of: Any
) -> None:
    """Acquire, refund, release and a refused acquire, with a Concurrency limit next to an
    hour's window on one identifier: the lease set's TTL is its main key's after each."""
    limits = [Concurrency(2, lease_ttl=2), Limit(100, per=3600, precision=60)]
    async with Limiter(url, limits, prefix=prefix) as lim:
        keys = keys_of(lim)
        one = await lim.try_acquire("u:1")
        await keys.assert_together()
        assert (await keys.ttls())[0] > 3_000_000
        two = await lim.try_acquire("u:1")
        await keys.assert_together()
        assert not (await lim.try_acquire("u:1")).allowed
        await keys.assert_together()
        await lim.refund("u:1", decision=one)
        await keys.assert_together()
        for decision in (one, two):
            assert decision.lease is not None
            await decision.lease.release()
            await keys.assert_together()
        await lim.peek("u:1")
        await keys.assert_together()


async def test_a_renew_does_not_leave_the_lease_set_outliving_its_main_key(
    url: str, prefix: str, keys_of: Any
) -> None:
    """A ``Concurrency`` limit alone: the main key's TTL is the lease's (plus a second of
    step), set at the acquire. A renew more than that second later extends the lease set
    (``renew`` in ``lua/concurrency.lua`` PEXPIREs it) but not the main key (the renew
    stages no write on it, so ``flush`` skips it and ``mirror_leases`` never runs). The set
    then outlives its main key: here by ~1.5 s, with a live lease in it. While the slot of
    such an identifier migrates, every call on it names one absent key (the main) and one
    present (the set) and Redis answers TRYAGAIN: the very gap 9c62cb0 closes for releases.

    Expected: after the renew, the set's TTL is at most the main key's. Observed: the set's
    TTL is the renewed lease's (~3 s), the main key's what is left of the acquire's (~1.5 s).
    """
    async with Limiter(url, [Concurrency(2, lease_ttl=3)], prefix=prefix) as lim:
        keys = keys_of(lim)
        decision = await lim.try_acquire("u:1")
        assert decision.lease is not None
        await keys.assert_together()
        await asyncio.sleep(2.5)
        await decision.lease.renew()
        await keys.assert_together()
        await decision.lease.release()


@pytest.mark.xfail(
    strict=True,
    reason="known gap (README, migrations): a limiter whose rules lack the Concurrency "
    "limit extends the shared main key without its lease set",
)
async def test_a_call_without_the_lease_pair_does_not_outlive_the_lease_set(
    url: str, prefix: str, keys_of: Any
) -> None:
    """Two limiters on one prefix judge one identifier: one by ``Concurrency`` (a 1 s lease),
    the other by an hour's window. They share the main key (a HASH of every limit's fields).
    The concurrency limiter's acquire and release leave the lease set with the main key's TTL
    then (~2 s). The window limiter's acquire raises the main key's TTL to an hour, and
    ``mirror_leases`` does not run (its call has no lease pair: ``call_leases`` is false, and
    its block does not even name the set). Two seconds later the lease set has expired while
    the main key lives on: the state 9c62cb0 set out to remove (a migration of the slot then
    answers TRYAGAIN to every concurrency call on the identifier). The README's known gap
    names only a SlidingLog for this; it says a lease set "expires with its main key".

    Expected: the lease set lives as long as its main key. Observed: the main key alone."""
    if url == "memory://":
        pytest.skip("two memory:// limiters are two engines: nothing is shared")
    async with (
        Limiter(url, [Concurrency(2, lease_ttl=1)], prefix=prefix) as leases,
        Limiter(url, [Limit(100, per=3600, precision=60)], prefix=prefix) as window,
    ):
        keys = keys_of(leases)
        held = await leases.try_acquire("u:1")
        assert held.lease is not None
        await held.lease.release()
        await keys.assert_together()
        assert (await window.try_acquire("u:1")).allowed
        await keys.assert_together()


async def test_batched_acquires_and_releases_leave_the_keys_together(
    url: str, prefix: str, keys_of: Any
) -> None:
    """60 concurrent holders on one identifier (their acquires and releases batched into
    shared script runs, one key written several times a run): never more than 5 inside,
    and afterwards the set holds only the placeholder, with its main key's TTL."""
    limits = [Concurrency(5, lease_ttl=30), Limit(10_000, per=60)]
    inside = peak = 0
    async with Limiter(url, limits, prefix=prefix) as lim:
        keys = keys_of(lim)

        async def one(n: int) -> None:
            nonlocal inside, peak
            try:
                async with lim.limit("u:1", 1 + n % 2, timeout=0):
                    inside += 1 + n % 2
                    peak = max(peak, inside)
                    await asyncio.sleep(0.001 * (n % 3))
                    inside -= 1 + n % 2
            except RateLimited:
                pass

        await asyncio.wait_for(asyncio.gather(*(one(n) for n in range(60))), 20)
        assert peak <= 5
        assert await keys.members() == [(PLACEHOLDER, -math.inf)]
        await keys.assert_together()
        assert (await lim.peek("u:1")).details[0].remaining == 5
