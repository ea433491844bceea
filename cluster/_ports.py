"""Free loopback ports, taken from the OS rather than guessed."""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def free_ports(count: int) -> list[int]:
    """Return `count` distinct ports that were free a moment ago.

    All sockets are held open until every port is chosen, so the ports are distinct. Another
    process can still take one before the server binds it; callers retry on other ports.
    """
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((LOOPBACK, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()
