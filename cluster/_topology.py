"""Parse CLUSTER NODES into plain values; pure functions, no I/O."""

from __future__ import annotations

from dataclasses import dataclass

SLOT_COUNT = 16384

#: A slot layout: sorted, merged (first_slot, last_slot, owner_node_id) ranges.
Layout = tuple[tuple[int, int, str], ...]

_FAILING_FLAGS = frozenset({"fail", "fail?", "handshake", "noaddr"})


@dataclass(frozen=True)
class NodeEntry:
    """One line of CLUSTER NODES, as seen by the node that was asked."""

    node_id: str
    port: int
    flags: frozenset[str]
    primary_id: str | None
    slot_ranges: tuple[tuple[int, int], ...]

    @property
    def is_primary(self) -> bool:
        return "master" in self.flags

    @property
    def is_failing(self) -> bool:
        """Suspected or confirmed failed, or not yet a full member."""
        return bool(self.flags & _FAILING_FLAGS)


def parse_cluster_nodes(text: str) -> dict[str, NodeEntry]:
    """Map node id to its entry. Migrating/importing markers like [5->-id] are skipped."""
    entries: dict[str, NodeEntry] = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 8:
            continue
        node_id, address, flags, primary = fields[:4]
        # address is "ip:port@busport[,hostname]"; ip may be empty for a handshake node.
        port_text = address.split("@", 1)[0].rsplit(":", 1)[-1]
        ranges = []
        for slot in fields[8:]:
            if slot.startswith("["):
                continue
            first, _, last = slot.partition("-")
            ranges.append((int(first), int(last or first)))
        entries[node_id] = NodeEntry(
            node_id=node_id,
            port=int(port_text) if port_text.isdigit() else 0,
            flags=frozenset(flags.split(",")),
            primary_id=None if primary == "-" else primary,
            slot_ranges=tuple(ranges),
        )
    return entries


def slot_layout(entries: dict[str, NodeEntry]) -> Layout:
    """Who owns which slots, in a form that compares equal across nodes that agree."""
    ranges = sorted(
        (first, last, entry.node_id)
        for entry in entries.values()
        if entry.is_primary
        for first, last in entry.slot_ranges
    )
    merged: list[tuple[int, int, str]] = []
    for first, last, owner in ranges:
        if merged and merged[-1][2] == owner and merged[-1][1] + 1 == first:
            merged[-1] = (merged[-1][0], last, owner)
        else:
            merged.append((first, last, owner))
    return tuple(merged)


def covered_slots(layout: Layout) -> int:
    return sum(last - first + 1 for first, last, _ in layout)


def owner_of(layout: Layout, slot: int) -> str | None:
    for first, last, owner in layout:
        if first <= slot <= last:
            return owner
    return None


def slots_of(layout: Layout, node_id: str) -> list[int]:
    return [
        slot for first, last, owner in layout if owner == node_id for slot in range(first, last + 1)
    ]


def even_slot_ranges(primaries: int) -> list[tuple[int, int]]:
    """Split the 16384 slots into `primaries` contiguous ranges, as redis-cli does."""
    if not 1 <= primaries <= SLOT_COUNT:
        raise ValueError(f"primaries must be between 1 and {SLOT_COUNT}, got {primaries}")
    bounds = [round(index * SLOT_COUNT / primaries) for index in range(primaries + 1)]
    return [(bounds[index], bounds[index + 1] - 1) for index in range(primaries)]
