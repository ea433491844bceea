"""Opening stores: the deadline a decision gets when the limiter is not told one."""

from __future__ import annotations

from aiolimit._stores import CLUSTER_DEFAULT_DEADLINE, DEFAULT_DEADLINE, default_deadline


def test_auto_deadline_rides_through_a_cluster_failover() -> None:
    """deadline="auto": 5 s on a cluster (failover takes 2-3 s), 1 s on a single server."""
    assert default_deadline("redis+cluster://127.0.0.1:7000") == CLUSTER_DEFAULT_DEADLINE == 5.0
    assert default_deadline("rediss+cluster://127.0.0.1:7000") == 5.0
    assert default_deadline("redis://127.0.0.1:6379/0") == DEFAULT_DEADLINE == 1.0
    assert default_deadline("memory://") == 1.0
