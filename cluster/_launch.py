"""Start several servers at once on free ports, retrying any that lost its port."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from cluster._errors import ServerStartError
from cluster._ports import free_ports
from cluster._process import ServerProcess

ServerT = TypeVar("ServerT", bound=ServerProcess)

_ATTEMPTS = 5


def launch(
    build: Callable[[list[int]], ServerT],
    *,
    count: int,
    ports_each: int,
    timeout: float = 10.0,
) -> list[ServerT]:
    """Build `count` servers from fresh free ports, spawn them all, then wait for each.

    Spawning everything before waiting lets the servers boot in parallel. A server that
    fails because its port was taken in the meantime is rebuilt on new ports; any other
    failure stops everything started so far and propagates.
    """
    ports = free_ports(count * ports_each)
    servers: list[ServerT] = []
    try:
        for index in range(count):
            server = build(ports[index * ports_each : (index + 1) * ports_each])
            servers.append(server)
            server.spawn()
        for index in range(count):
            for attempt in range(_ATTEMPTS):
                try:
                    servers[index].wait_ready(timeout)
                    break
                except ServerStartError as error:
                    if not error.port_in_use or attempt == _ATTEMPTS - 1:
                        raise
                    servers[index] = build(free_ports(ports_each))
                    servers[index].spawn()
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers
