"""A local Redis Cluster built from plain redis-server processes, with fault helpers."""

from __future__ import annotations

import shutil
import signal
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType

import redis

from cluster import _cleanup
from cluster._binary import require_server_binary
from cluster._health import ClusterView, inspect, read_entries
from cluster._launch import launch
from cluster._node import Node
from cluster._polling import poll_until
from cluster._resharding import move_slots
from cluster._topology import Layout, even_slot_ranges, owner_of, slot_layout, slots_of

TEMP_PREFIX = "aiolimit-cluster-"


class Cluster:
    """A running cluster: `.nodes`, `.url`, `.seed_url`, `.startup_nodes`, faults, `stop()`.

    Roles change under failover, so primaries(), replicas() and node_for_slot() ask the
    cluster each time instead of remembering what was true at startup.
    """

    def __init__(self, nodes: list[Node], root: Path) -> None:
        self.nodes = nodes
        self.root = root
        self._layout: Layout = ()
        for node in nodes:
            node._cluster = self

    def __repr__(self) -> str:
        return f"Cluster({len(self.nodes)} nodes, seed={self.seed_url})"

    @property
    def url(self) -> str:
        """aiolimit's URL for a cluster seed: redis+cluster://127.0.0.1:<port>."""
        return f"redis+cluster://{self.nodes[0].host}:{self.nodes[0].port}"

    @property
    def seed_url(self) -> str:
        """A plain redis:// URL of one node, for redis-py's RedisCluster.from_url()."""
        return f"redis://{self.nodes[0].host}:{self.nodes[0].port}"

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        return [(node.host, node.port) for node in self.nodes]

    # --- topology, asked live -------------------------------------------------------------

    def live_nodes(self) -> list[Node]:
        """Nodes whose process runs and is not paused by us, i.e. nodes that can answer."""
        return [node for node in self.nodes if node.is_running() and not node.paused]

    def node_by_id(self, node_id: str) -> Node:
        for node in self.nodes:
            if node.node_id == node_id:
                return node
        raise KeyError(f"no node with id {node_id!r} in {self!r}")

    def view(self) -> ClusterView:
        """The cluster as the first live node that answers sees it (may lag during faults)."""
        errors = []
        for node in self.live_nodes():
            try:
                entries = read_entries(node)
            except redis.RedisError as error:
                errors.append(f"{node!r}: {error!r}")
                continue
            return ClusterView(layout=slot_layout(entries), entries=entries)
        raise redis.ConnectionError(f"no live node answered CLUSTER NODES: {errors}")

    def primaries(self) -> list[Node]:
        """Running nodes the cluster currently treats as primaries (not flagged fail)."""
        return self._members(primary=True)

    def replicas(self) -> list[Node]:
        """Running nodes the cluster currently treats as replicas (not flagged fail)."""
        return self._members(primary=False)

    def node_for_slot(self, slot: int) -> Node:
        """The primary that owns `slot` now."""
        owner = owner_of(self.view().layout, slot)
        if owner is None:
            raise KeyError(f"slot {slot} is not assigned")
        return self.node_by_id(owner)

    def _members(self, *, primary: bool) -> list[Node]:
        entries = self.view().entries
        return [
            node
            for node in self.nodes
            if node.is_running()
            and node.node_id in entries
            and entries[node.node_id].is_primary == primary
            and "fail" not in entries[node.node_id].flags
        ]

    # --- waiting --------------------------------------------------------------------------

    def wait_healthy(self, timeout: float = 10.0) -> None:
        """Poll until every live node says cluster_state:ok, knows every live node as
        healthy, agrees on a full slot layout, and every live replica's link is up."""

        def check() -> str | None:
            result = inspect(self.live_nodes(), require_replicas_linked=True)
            if isinstance(result, str):
                return result
            self._layout = result.layout
            return None

        poll_until(check, timeout=timeout, what="a healthy cluster")

    def wait_for_failover(self, old_primary: Node, timeout: float = 10.0) -> Node:
        """Poll until another live node owns all slots `old_primary` owned at the last
        healthy check and the live nodes agree with cluster_state:ok; return that node."""
        old_slots = slots_of(self._layout, old_primary.node_id)
        if not old_slots:
            raise ValueError(f"{old_primary!r} owned no slots at the last healthy check")
        promoted: list[Node] = []

        def check() -> str | None:
            live = [node for node in self.live_nodes() if node is not old_primary]
            result = inspect(live, require_replicas_linked=False)
            if isinstance(result, str):
                return result
            owners = {owner_of(result.layout, slot) for slot in old_slots}
            if old_primary.node_id in owners:
                return f"{old_primary!r} still owns its slots"
            live_ids = {node.node_id for node in live}
            if not owners <= live_ids:
                return "its slots are owned by a node that is not live"
            self._layout = result.layout
            promoted.append(self.node_by_id(owner_of(result.layout, old_slots[0]) or ""))
            return None

        poll_until(check, timeout=timeout, what=f"failover of {old_primary!r}")
        return promoted[-1]

    # --- operations -----------------------------------------------------------------------

    def migrate_slots(
        self,
        slots: Iterable[int],
        target_node: Node,
        batch: int = 10,
        keys_per_batch: int = 10,
        *,
        timeout_ms: int = 5000,
        timeout: float = 10.0,
    ) -> int:
        """Live-reshard `slots` to `target_node`; return the number of keys moved.

        `batch` slots are open (MIGRATING/IMPORTING) at a time and keys move
        `keys_per_batch` per MIGRATE, so concurrent clients see ASK and TRYAGAIN. Returns
        once every live node agrees on the new owner.
        """
        wanted = list(slots)
        moved = move_slots(
            self,
            self.view(),
            wanted,
            target_node,
            batch=batch,
            keys_per_batch=keys_per_batch,
            timeout_ms=timeout_ms,
        )

        def check() -> str | None:
            result = inspect(self.live_nodes(), require_replicas_linked=False)
            if isinstance(result, str):
                return result
            if any(owner_of(result.layout, slot) != target_node.node_id for slot in wanted):
                return "not every node sees the new owner yet"
            self._layout = result.layout
            return None

        poll_until(check, timeout=timeout, what="agreement on the migrated slots")
        return moved

    def flush_scripts(self) -> None:
        """SCRIPT FLUSH and FUNCTION FLUSH on every live primary: a client's loaded code is
        gone (replicas never hold loaded scripts; they follow their primary's functions)."""
        for node in self.primaries():
            node.client.script_flush()
            node.client.function_flush()

    def flushall(self) -> None:
        """FLUSHALL on every live primary; replicas follow through replication."""
        for node in self.primaries():
            node.client.flushall()

    def heal(self, timeout: float = 20.0) -> None:
        """Resume paused nodes, restart dead ones, then wait_healthy(): a fault test's undo."""
        for node in self.nodes:
            if node.paused:
                node.resume()
        for node in self.nodes:
            if not node.is_running():
                node.restart_process(timeout)
        self.wait_healthy(timeout)

    def stop(self) -> None:
        """Stop every node this object started (SIGTERM all, then wait), delete the files."""
        deadline = time.monotonic() + 5.0
        for node in self.nodes:
            if node.paused:
                node.resume()
            node.send_signal(signal.SIGTERM)
        for node in self.nodes:
            node.stop(timeout=max(deadline - time.monotonic(), 0.1))
        shutil.rmtree(self.root, ignore_errors=True)
        _cleanup.forget(self)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


def start_cluster(
    primaries: int = 3,
    replicas_per_primary: int = 1,
    node_timeout_ms: int = 1000,
    *,
    timeout: float = 20.0,
    stop_at_exit: bool = True,
    binary: str | None = None,
) -> Cluster:
    """Start and join `primaries * (1 + replicas_per_primary)` nodes (of redis-server, or of
    `binary`, e.g. a valkey-server); return when healthy.

    The slots are split evenly over the primaries. Without redis-cli: ADDSLOTSRANGE,
    SET-CONFIG-EPOCH, MEET, REPLICATE, then poll until healthy.
    """
    if primaries < 1 or replicas_per_primary < 0:
        raise ValueError(
            f"need primaries >= 1 and replicas_per_primary >= 0, "
            f"got {primaries} and {replicas_per_primary}"
        )
    binary = binary or require_server_binary()
    root = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX))
    deadline = time.monotonic() + timeout
    try:
        nodes = launch(
            lambda ports: Node(
                binary=binary,
                port=ports[0],
                bus_port=ports[1],
                root=root,
                node_timeout_ms=node_timeout_ms,
            ),
            count=primaries * (1 + replicas_per_primary),
            ports_each=2,
        )
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    cluster = Cluster(nodes, root)
    try:
        _join(cluster, primaries, deadline)
    except BaseException:
        cluster.stop()
        raise
    if stop_at_exit:
        _cleanup.stop_at_exit(cluster)
    return cluster


def _join(cluster: Cluster, primary_count: int, deadline: float) -> None:
    nodes = cluster.nodes
    primaries, replicas = nodes[:primary_count], nodes[primary_count:]
    for epoch, node in enumerate(nodes, start=1):
        node.node_id = node.execute("CLUSTER", "MYID")
        # Distinct epochs before MEET, so no epoch collision has to be resolved later.
        node.execute("CLUSTER", "SET-CONFIG-EPOCH", epoch)
    for node, (first, last) in zip(primaries, even_slot_ranges(primary_count), strict=True):
        node.execute("CLUSTER", "ADDSLOTSRANGE", first, last)
    for node in nodes[1:]:
        nodes[0].execute("CLUSTER", "MEET", node.host, node.port, node.bus_port)

    all_ids = {node.node_id for node in nodes}

    def everyone_knows_everyone() -> str | None:
        for node in nodes:
            entries = read_entries(node)
            if entries.keys() != all_ids or any(e.is_failing for e in entries.values()):
                return f"{node!r} knows {len(entries)} of {len(nodes)} nodes"
        return None

    poll_until(
        everyone_knows_everyone,
        timeout=max(deadline - time.monotonic(), 0.1),
        what="nodes meeting each other",
    )
    for index, replica in enumerate(replicas):
        primary = primaries[index % primary_count]
        replica.execute("CLUSTER", "REPLICATE", primary.node_id)

    def replicas_linked() -> str | None:
        for replica in replicas:
            if replica.client.info("replication").get("master_link_status") != "up":
                return f"{replica!r} is not linked to its primary yet"
        return None

    poll_until(
        replicas_linked,
        timeout=max(deadline - time.monotonic(), 0.1),
        what="replication links",
    )
    # Redis 7 leaves a replica out of CLUSTER SLOTS (where clients discover replicas)
    # until its replication offset is non-zero; an empty FLUSHALL moves the offset.
    for primary in primaries:
        if replicas:
            primary.client.flushall()
    cluster.wait_healthy(max(deadline - time.monotonic(), 0.1))
