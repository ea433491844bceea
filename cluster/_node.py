"""One cluster node: a server process plus its cluster identity and bus port."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from cluster._process import ServerProcess

if TYPE_CHECKING:
    from cluster._cluster import Cluster


class Node(ServerProcess):
    """A cluster node we started: `.host`, `.port`, `.bus_port`, `.pid`, `.node_id`, `.url`.

    Fault helpers are real signals to this node's pid: kill() (SIGKILL), pause()/resume()
    (SIGSTOP/SIGCONT), restart() (same ports and nodes.conf, then wait until it rejoins).
    """

    def __init__(
        self, *, binary: str, port: int, bus_port: int, root: Path, node_timeout_ms: int
    ) -> None:
        super().__init__(binary=binary, port=port, directory=root / f"node-{port}")
        self.bus_port = bus_port
        self.node_timeout_ms = node_timeout_ms
        #: Stable across restarts (it lives in nodes.conf); set once the node is up.
        self.node_id = ""
        self._cluster: Cluster | None = None

    def __repr__(self) -> str:
        pid = self._popen.pid if self._popen else None
        return f"Node({self.host}:{self.port}, id={self.node_id[:8]}, pid={pid})"

    @property
    def config_path(self) -> Path:
        return self.directory / f"nodes-{self.port}.conf"

    def server_args(self) -> list[str]:
        return [
            *super().server_args(),
            "--cluster-enabled", "yes",
            "--cluster-port", str(self.bus_port),
            "--cluster-node-timeout", str(self.node_timeout_ms),
            "--cluster-config-file", str(self.config_path),
            "--repl-diskless-sync-delay", "0",
        ]  # fmt: skip

    @property
    def role(self) -> str:
        """Either "primary" or "replica", asked of the node itself right now (ROLE)."""
        reply = self.execute("ROLE")
        return "primary" if reply[0] == "master" else "replica"

    def restart(self, timeout: float = 15.0) -> None:
        """Start again with the same ports and nodes.conf, and wait until the cluster is
        healthy with this node back in it (a demoted old primary comes back as a replica).
        """
        self.restart_process(timeout)
        if self._cluster is not None:
            self._cluster.wait_healthy(timeout)
