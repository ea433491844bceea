"""A single standalone redis-server on a free loopback port."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from types import TracebackType

from cluster import _cleanup
from cluster._binary import require_server_binary
from cluster._launch import launch
from cluster._process import ServerProcess

TEMP_PREFIX = "aiolimit-redis-"


class Standalone(ServerProcess):
    """A standalone server: `.host`, `.port`, `.pid`, `.url`, `.client`, faults, `stop()`.

    Besides stop(), the fault helpers inherited from ServerProcess are real signals:
    kill() (SIGKILL), pause()/resume() (SIGSTOP/SIGCONT), restart() (same port, empty data).
    """

    def __init__(self, *, binary: str, port: int, root: Path) -> None:
        super().__init__(binary=binary, port=port, directory=root / f"server-{port}")
        self.root = root

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the server and delete its temporary directory."""
        super().stop(timeout)
        shutil.rmtree(self.root, ignore_errors=True)
        _cleanup.forget(self)

    def __enter__(self) -> Standalone:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


def start_standalone(
    *, timeout: float = 10.0, stop_at_exit: bool = True, binary: str | None = None
) -> Standalone:
    """Start one redis-server (or ``binary``, e.g. a valkey-server) on a free 127.0.0.1 port
    and wait until it answers.

    `stop_at_exit=False` is for servers meant to outlive this process (`python -m cluster
    up`); otherwise an atexit hook stops whatever the caller forgot to stop.
    """
    binary = binary or require_server_binary()
    root = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX))
    try:
        (server,) = launch(
            lambda ports: Standalone(binary=binary, port=ports[0], root=root),
            count=1,
            ports_each=1,
            timeout=timeout,
        )
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    if stop_at_exit:
        _cleanup.stop_at_exit(server)
    return server
