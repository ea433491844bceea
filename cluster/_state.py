"""The state file that lets `python -m cluster down` find what `up` started."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TypedDict

from cluster._cluster import TEMP_PREFIX as CLUSTER_PREFIX
from cluster._cluster import Cluster
from cluster._standalone import TEMP_PREFIX as STANDALONE_PREFIX
from cluster._standalone import Standalone

REPO_ROOT = Path(__file__).resolve().parent.parent


class ProcessRecord(TypedDict):
    pid: int
    port: int


class ServerRecord(TypedDict):
    kind: str  # "standalone" or "cluster"
    url: str
    seed_url: str
    binary: str
    directory: str
    processes: list[ProcessRecord]


def default_state_path() -> Path:
    return REPO_ROOT / ".cluster" / "state.json"


def record_standalone(server: Standalone) -> ServerRecord:
    return ServerRecord(
        kind="standalone",
        url=server.url,
        seed_url=server.url,
        binary=server.binary,
        directory=str(server.root),
        processes=[ProcessRecord(pid=server.pid, port=server.port)],
    )


def record_cluster(cluster: Cluster) -> ServerRecord:
    return ServerRecord(
        kind="cluster",
        url=cluster.url,
        seed_url=cluster.seed_url,
        binary=cluster.nodes[0].binary,
        directory=str(cluster.root),
        processes=[ProcessRecord(pid=node.pid, port=node.port) for node in cluster.nodes],
    )


def write_state(path: Path, records: list[ServerRecord]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_suffix(".tmp")
    scratch.write_text(json.dumps({"servers": records}, indent=2) + "\n")
    os.replace(scratch, path)


def read_state(path: Path) -> list[ServerRecord]:
    """The records in `path`, or [] when there is no state file."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    servers: list[ServerRecord] = data["servers"]
    return servers


def remove_directory(directory: str) -> None:
    """Delete a server directory, but only one that this package created in the temp dir."""
    path = Path(directory)
    ours = path.name.startswith((STANDALONE_PREFIX, CLUSTER_PREFIX))
    if ours and path.parent == Path(tempfile.gettempdir()):
        shutil.rmtree(path, ignore_errors=True)
