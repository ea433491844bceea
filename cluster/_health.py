"""Inspect a cluster as its live nodes see it, and say what is not right yet."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import redis

from cluster._node import Node
from cluster._topology import (
    SLOT_COUNT,
    Layout,
    NodeEntry,
    covered_slots,
    parse_cluster_nodes,
    slot_layout,
)


@dataclass(frozen=True)
class ClusterView:
    """What every live node agreed on: the slot layout, and the first node's entries."""

    layout: Layout
    entries: dict[str, NodeEntry]


def read_entries(node: Node) -> dict[str, NodeEntry]:
    return parse_cluster_nodes(node.execute("CLUSTER", "NODES"))


def inspect(live: Sequence[Node], *, require_replicas_linked: bool) -> ClusterView | str:
    """Return the agreed view, or a short description of the first thing that is wrong.

    Right means, on every live node: cluster_state:ok, every live node known and not
    flagged failing, the same full slot layout, the same role for every live node (an old
    primary restarted after a failover is a master with no slots in some views for a while
    before they all see it as a replica), and (if asked) replication links up.
    """
    if not live:
        return "no live nodes"
    live_ids = {node.node_id for node in live}
    layouts: dict[Layout, Node] = {}
    roles: set[frozenset[tuple[str, bool, str | None]]] = set()
    first_entries: dict[str, NodeEntry] | None = None
    for node in live:
        try:
            info = node.execute("CLUSTER", "INFO")
            entries = read_entries(node)
            if "cluster_state:ok" not in info:
                return f"{node!r} reports cluster_state:fail"
            missing = live_ids - entries.keys()
            if missing:
                return f"{node!r} does not know {len(missing)} live node(s) yet"
            for entry in entries.values():
                if entry.is_failing and (entry.node_id in live_ids or "handshake" in entry.flags):
                    return f"{node!r} flags {entry.node_id[:8]} as {','.join(sorted(entry.flags))}"
            if require_replicas_linked:
                problem = _replication_problem(node, entries, live_ids)
                if problem:
                    return problem
        except redis.RedisError as error:
            return f"{node!r} did not answer: {error!r}"
        layouts.setdefault(slot_layout(entries), node)
        roles.add(
            frozenset(
                (entry.node_id, entry.is_primary, entry.primary_id)
                for entry in entries.values()
                if entry.node_id in live_ids
            )
        )
        first_entries = first_entries or entries
    if len(layouts) > 1:
        return f"{len(layouts)} different slot layouts among live nodes"
    if len(roles) > 1:
        return "live nodes do not agree yet on which nodes are primaries"
    (layout,) = layouts
    if covered_slots(layout) != SLOT_COUNT:
        return f"only {covered_slots(layout)} of {SLOT_COUNT} slots are assigned"
    assert first_entries is not None
    return ClusterView(layout=layout, entries=first_entries)


def _replication_problem(node: Node, entries: dict[str, NodeEntry], live_ids: set[str]) -> str:
    """Why replication is not yet usable as `node` sees it, or "" if it is.

    Besides the link, every live replica of a slot owner must appear in CLUSTER SLOTS:
    Redis 7 hides replicas whose replication offset is still 0 there, and that is where
    clients discover replicas.
    """
    if not entries[node.node_id].is_primary:
        replication = node.client.info("replication")
        if replication.get("master_link_status") != "up":
            return f"replica {node!r} has master_link_status:down"
    listed = {
        member[2] for slot_range in node.execute("CLUSTER", "SLOTS") for member in slot_range[3:]
    }
    owners = {entry.node_id for entry in entries.values() if entry.slot_ranges}
    for entry in entries.values():
        if entry.node_id in live_ids and entry.primary_id in owners:
            if entry.node_id not in listed:
                return f"{node!r} does not list replica {entry.node_id[:8]} in CLUSTER SLOTS"
    return ""
