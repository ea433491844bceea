"""Errors raised by the local server tooling.

ClusterToolingError (RuntimeError)
├── ServerBinaryNotFound     no redis-server / valkey-server to run
├── ServerStartError         a server exited or never answered during startup
└── ClusterNotHealthy        a wait_* deadline passed (also a TimeoutError)
"""

from __future__ import annotations


class ClusterToolingError(RuntimeError):
    """Root of every error raised by the ``cluster`` package."""


class ServerBinaryNotFound(ClusterToolingError):
    """No server binary: set REDIS_SERVER_BIN or put redis-server/valkey-server on PATH."""


class ServerStartError(ClusterToolingError):
    """A server did not come up; the message carries the tail of its log."""

    def __init__(self, message: str, *, port_in_use: bool = False) -> None:
        super().__init__(message)
        #: True when the server lost a race for its port, so a retry on other ports may work.
        self.port_in_use = port_in_use


class ClusterNotHealthy(ClusterToolingError, TimeoutError):
    """A cluster did not reach the awaited state before the deadline; says what was missing."""
