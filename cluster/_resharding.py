"""Live resharding: move slots, with their keys, from their owners to a target primary.

This is the same dance redis-cli --cluster reshard does, in small steps so that clients
writing at the same time see ASK and TRYAGAIN redirections, which is the point of it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from cluster._health import ClusterView
from cluster._node import Node
from cluster._topology import SLOT_COUNT, owner_of

if TYPE_CHECKING:
    from cluster._cluster import Cluster


def move_slots(
    cluster: Cluster,
    view: ClusterView,
    slots: Iterable[int],
    target: Node,
    *,
    batch: int,
    keys_per_batch: int,
    timeout_ms: int,
) -> int:
    """Move `slots` to `target`, `batch` slots open at a time; return how many keys moved.

    For each group of `batch` slots: mark them IMPORTING on the target and MIGRATING on
    their owners, move their keys `keys_per_batch` at a time with MIGRATE, then assign
    them with SETSLOT NODE on the target, the source and every other live primary.
    """
    if batch < 1 or keys_per_batch < 1:
        raise ValueError(f"batch and keys_per_batch must be >= 1, got {batch}, {keys_per_batch}")
    target_entry = view.entries.get(target.node_id)
    if target_entry is None or not target_entry.is_primary:
        raise ValueError(f"{target!r} is not a primary of this cluster")
    moves: list[tuple[int, Node]] = []
    for slot in slots:
        if not 0 <= slot < SLOT_COUNT:
            raise ValueError(f"slot must be in 0..{SLOT_COUNT - 1}, got {slot}")
        owner = owner_of(view.layout, slot)
        if owner is not None and owner != target.node_id:
            moves.append((slot, cluster.node_by_id(owner)))
    primaries = [node for node in cluster.live_nodes() if view.entries[node.node_id].is_primary]
    moved = 0
    for start in range(0, len(moves), batch):
        group = moves[start : start + batch]
        for slot, source in group:
            target.execute("CLUSTER", "SETSLOT", slot, "IMPORTING", source.node_id)
            source.execute("CLUSTER", "SETSLOT", slot, "MIGRATING", target.node_id)
        for slot, source in group:
            moved += _move_keys(source, target, slot, keys_per_batch, timeout_ms)
        for slot, source in group:
            _assign(slot, target, [target, source, *primaries])
    return moved


def _move_keys(source: Node, target: Node, slot: int, keys_per_batch: int, timeout_ms: int) -> int:
    # While the slot is MIGRATING, the source refuses to create keys in it (clients get
    # ASK), so this loop ends even under a steady stream of writes.
    moved = 0
    while True:
        keys = source.execute("CLUSTER", "GETKEYSINSLOT", slot, keys_per_batch)
        if not keys:
            return moved
        source.execute("MIGRATE", target.host, target.port, "", 0, timeout_ms, "KEYS", *keys)
        moved += len(keys)


def _assign(slot: int, target: Node, nodes: Sequence[Node]) -> None:
    # Target first (it bumps its config epoch and stops answering ASK-only), then the
    # source, then the others, so that no node points clients at a node that disowns it.
    done: set[int] = set()
    for node in nodes:
        if id(node) not in done:
            done.add(id(node))
            node.execute("CLUSTER", "SETSLOT", slot, "NODE", target.node_id)
