"""Exactness and resilience at the edges of the scripts, on real Redis and memory://.

Large weights and argument lists, numbers past 1e14, penalties beside leases, refunds beside
reserved turns: each test pins what the caller is told and what stays stored.
"""

from __future__ import annotations

from aiolimit import Concurrency, Decision, Limiter, SlidingLog


def by_limit(decision: Decision) -> dict[str, int]:
    """remaining per limit (its str) of a one-identifier decision."""
    return {str(pair.limit): pair.remaining for pair in decision.details}


# --- item 8: large argument lists, no error after a write ------------------------------------


async def test_a_large_concurrency_weight_beside_a_sliding_log(store_url: str, prefix: str) -> None:
    """Weight 5,000 takes 5,000 leases and logs 5,000 units; renew and release handle them all."""
    limits = [SlidingLog(10_000, per=60), Concurrency(10_000)]
    async with Limiter(store_url, limits, prefix=prefix) as limiter:
        decision = await limiter.try_acquire("ip:1", 5_000)
        assert decision.allowed
        assert by_limit(decision) == {str(limits[0]): 5_000, str(limits[1]): 5_000}
        assert decision.lease is not None
        await decision.lease.renew()
        assert by_limit(await limiter.peek("ip:1", 1)) == {
            str(limits[0]): 4_999,
            str(limits[1]): 4_999,
        }
        await decision.lease.release()
        assert by_limit(await limiter.peek("ip:1", 1)) == {
            str(limits[0]): 4_999,
            str(limits[1]): 9_999,
        }
        assert (await limiter.try_acquire("ip:1", 5_000)).allowed
        assert not (await limiter.try_acquire("ip:1", 1)).allowed  # the log is full
