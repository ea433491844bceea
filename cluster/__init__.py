"""Real local Redis servers for aiolimit's tests, demos and benchmarks.

No Docker and no redis-cli: plain redis-server (or valkey-server) processes on free
loopback ports, a Redis Cluster joined with CLUSTER commands, and fault helpers that send
real signals to pids this package started.

    with start_cluster() as cluster:
        primary = cluster.primaries()[0]
        primary.kill()
        cluster.wait_for_failover(primary)
"""

from cluster._binary import find_server_binary, find_valkey_binary, require_server_binary
from cluster._cluster import Cluster, start_cluster
from cluster._errors import (
    ClusterNotHealthy,
    ClusterToolingError,
    ServerBinaryNotFound,
    ServerStartError,
)
from cluster._node import Node
from cluster._process import is_server_process, pid_is_alive
from cluster._standalone import Standalone, start_standalone
from cluster._topology import SLOT_COUNT

__all__ = [
    "SLOT_COUNT",
    "Cluster",
    "ClusterNotHealthy",
    "ClusterToolingError",
    "Node",
    "ServerBinaryNotFound",
    "ServerStartError",
    "Standalone",
    "find_server_binary",
    "find_valkey_binary",
    "is_server_process",
    "pid_is_alive",
    "require_server_binary",
    "start_cluster",
    "start_standalone",
]
