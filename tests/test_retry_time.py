"""A call the cluster store sends again later is judged at the time it is sent again (from an
adversarial review).

With a clock of the client's (a TIME authority, the local clock) a call carries its time. A
call whose node died is retried, with backoff, until a replica takes over (2-3 s here): sent
again with the time read before the first attempt, its charge would be dated seconds in the
past and leave its window that much early, so the identifier would admit again too soon.
"""

from __future__ import annotations

import time

import pytest
from redis.crc import key_slot

import cluster
from aiolimit import AuthorityClock, Limit, Limiter
from aiolimit._calls import ACQUIRE, Call, resend_args
from aiolimit._keys import main_key

pytestmark = [pytest.mark.cluster]


async def test_a_charge_retried_through_a_failover_is_dated_when_it_is_sent_again(
    fresh_cluster: cluster.Cluster, redis_url: str, prefix: str
) -> None:
    """Limit(1, per=2, precision=0.5): after an admission the identifier refuses for the next
    1.5 s at least. Its primary is killed; the decision is retried until the replica takes
    over and admits. A request right after must be refused: a charge judged at the time read
    before the first attempt (over 2 s earlier) would already have left the window."""
    identifier = "ip:198.51.100.7"
    node = fresh_cluster.node_for_slot(key_slot(main_key(prefix, identifier).encode()))
    clock = AuthorityClock(redis_url)  # (the authority is not the node that dies)
    limiter = Limiter(
        fresh_cluster.url, [Limit(1, per=2, precision=0.5)], prefix=prefix, clock=clock,
        deadline=10.0,
    )  # fmt: skip
    try:
        await limiter.peek(identifier)  # (slot map, connections, library)
        node.kill()
        started = time.monotonic()
        first = await limiter.try_acquire(identifier)
        took = time.monotonic() - started
        assert first.allowed and not first.degraded
        assert took > 1.0, f"the failover took {took:.2f} s: nothing was retried late"
        again = await limiter.try_acquire(identifier)
        assert not again.allowed, (
            f"admitted again right after an admission that took {took:.2f} s: the first "
            "charge was dated at its first attempt"
        )
        assert again.retry_after > 1.0
    finally:
        await limiter.aclose()
        await clock.aclose()


def test_resend_args_move_an_acquires_own_time_on_by_the_delay() -> None:
    """Pure logic: an acquire or check that carries its time is moved on by the clock's
    elapsed time; a call judged by the server's TIME (no time sent), and undo / refund calls
    (judged at the decision's time on purpose), are sent again as they were."""

    class Clock:
        now = 100.0

        def monotonic(self) -> float:
            return self.now

    clock = Clock()
    args = ["acquire", 1_700_000_000_000_000, 1, 1000, "c:1:", "", 1, b"1,1,0,sw,1,2,3"]
    call = Call(ACQUIRE, ["k"], list(args), (), clock.monotonic, 100.0)
    assert resend_args(call) == args  # (no time passed)
    clock.now = 102.5
    moved = resend_args(call)
    assert moved[1] == 1_700_000_002_500_000 and moved[2:] == args[2:] and call.args == args
    server_time = ["acquire", "", *args[2:]]
    assert resend_args(Call(ACQUIRE, ["k"], server_time, (), clock.monotonic, 100.0)) == server_time
    undo = ["undo", *args[1:]]
    assert resend_args(Call(ACQUIRE, ["k"], undo, (), clock.monotonic, 100.0)) == undo
    assert resend_args(Call(ACQUIRE, ["k"], list(args), ())) == args  # (no clock given)
