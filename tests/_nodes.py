"""Identifiers placed on chosen nodes of a local Redis Cluster, for tests that freeze, kill or
flood one node and watch the others."""

from __future__ import annotations

from redis.crc import key_slot

import cluster
from aiolimit._keys import main_key


def on_node(nodes: cluster.Cluster, prefix: str, tag: str, node: cluster.Node) -> str:
    """The first identifier ``<tag>:<i>`` whose main key under ``prefix`` lives on ``node``."""
    return next(
        f"{tag}:{i}"
        for i in range(10_000)
        if nodes.node_for_slot(key_slot(main_key(prefix, f"{tag}:{i}").encode())).port == node.port
    )
