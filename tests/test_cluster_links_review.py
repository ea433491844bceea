"""Adversarial checks of the cluster store's links (``aiolimit/_stores/link.py``)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.asyncio.cluster import RedisCluster

import cluster
from aiolimit import Limit, Limiter
from tests._nodes import on_node

pytestmark = [pytest.mark.cluster]


def store_of(limiter: Limiter) -> Any:
    return limiter._protocol._store


async def stored(url: str, prefix: str, ident: str, limits: list[Limit]) -> int:
    async with Limiter(url, limits, prefix=prefix, deadline=2.0) as fresh:
        decision = await fresh.peek(ident)
        return limits[0].amount - decision.details[0].remaining


@pytest.mark.parametrize("pool", [1, 2])
async def test_a_user_client_with_a_small_pool_keeps_serving(
    calm: cluster.Cluster, prefix: str, pool: int
) -> None:
    """A user's ``RedisCluster(max_connections=1)``: a link must not hold the node's only
    connection for good (every retry, and the app's own commands, would then meet
    MaxConnectionsError until the deadline)."""
    client = RedisCluster.from_url(
        calm.url.replace("redis+cluster://", "redis://"), max_connections=pool
    )
    node = calm.primaries()[0]
    ident = on_node(calm, prefix, "m", node)
    limits = [Limit(1000, per=60)]
    limiter = Limiter(client, limits, prefix=prefix, deadline=1.0)
    admitted = 0
    try:
        for _ in range(10):
            admitted += (await limiter.try_acquire(ident)).allowed
            await asyncio.sleep(0.01)
        await client.set(f"{prefix}:{ident}:x", "1")  # the user's own use of its client
        assert admitted == 10
    finally:
        await limiter.aclose()
        await client.aclose()
    assert await stored(calm.url, prefix, ident, limits) == 10
