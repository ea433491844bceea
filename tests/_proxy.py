"""A loopback TCP proxy in front of one Redis server, with network faults a test switches on.

There is no tc/netem here, so faults between a client and a server are made by putting this
proxy between them (``redis://127.0.0.1:<proxy.port>``; for a cluster client,
``RedisCluster(address_remap=proxies.remap)`` sends every node's traffic through its proxy):

- ``delay``: every server->client chunk read from now on is delivered that many seconds late
  (in order). The server ran the command on time; only its reply is late.
- ``partition()`` / ``heal()``: bytes read in either direction are lost (never delivered,
  as when packets are dropped until the sender gives up); ``heal()`` lets new bytes through
  again and resets every connection that lost bytes (its stream is out of step).
- hooks: ``on_request(link, data)`` runs before a client->server chunk is forwarded and
  ``on_reply(link, data)`` before a server->client chunk is; either may be async (forwarding
  on that link waits for it, so a hook can act *between* a request and the server seeing it)
  and may ``link.abort()`` the connection (the chunk is then not forwarded: a reply lost after
  the server ran the command), or return bytes, forwarded instead of the chunk.

Everything runs on the test's event loop, on 127.0.0.1 ports the OS picks; ``aclose()`` stops
every task and connection the proxy made.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

Hook = Callable[["Link", bytes], Awaitable[bytes | None] | bytes | None]

CHUNK = 65536


def script_calls(data: bytes) -> int:
    """Script calls (FCALL / EVALSHA / EVAL commands) in a client->server chunk of RESP."""
    return (
        data.count(b"\r\nFCALL\r\n") + data.count(b"\r\nEVALSHA\r\n") + data.count(b"\r\nEVAL\r\n")
    )


class Link:
    """One proxied connection: the client side, the server side and two pumps."""

    def __init__(self, proxy: Proxy, client: tuple[Any, Any], server: tuple[Any, Any]) -> None:
        self.proxy = proxy
        self.client_reader, self.client_writer = client
        self.server_reader, self.server_writer = server
        self.closed = False
        #: Bytes were lost on this link (partition): heal() resets it.
        self.lost = False
        #: Free for hooks: per-connection marks.
        self.marks: dict[str, Any] = {}
        self._replies: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
        self.tasks: list[asyncio.Task[None]] = []

    def abort(self) -> None:
        """Resets both sides at once (RST): whatever is in flight is lost."""
        if self.closed:
            return
        self.closed = True
        for writer in (self.client_writer, self.server_writer):
            transport = writer.transport
            if not transport.is_closing():
                transport.abort()
        self._replies.put_nowait(None)

    async def _call(self, hook: Hook | None, data: bytes) -> bytes:
        """Runs ``hook`` on a chunk; returns what to forward (bytes the hook returned, else
        the chunk itself)."""
        if hook is None:
            return data
        result = hook(self, data)
        if inspect.isawaitable(result):
            result = await result
        return result if isinstance(result, bytes) else data

    async def pump_requests(self) -> None:
        try:
            while not self.closed:
                data = await self.client_reader.read(CHUNK)
                if not data:
                    break
                data = await self._call(self.proxy.on_request, data)
                if self.closed:
                    break
                if self.proxy.partitioned:
                    self.lost = True
                    continue
                self.server_writer.write(data)
                await self.server_writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            self.abort()

    async def pump_replies(self) -> None:
        try:
            while not self.closed:
                data = await self.server_reader.read(CHUNK)
                if not data:
                    break
                data = await self._call(self.proxy.on_reply, data)
                if self.closed:
                    break
                if self.proxy.partitioned:
                    self.lost = True
                    continue
                self._replies.put_nowait((time.monotonic() + self.proxy.delay, data))
        except (ConnectionError, OSError):
            pass
        finally:
            self.abort()

    async def deliver_replies(self) -> None:
        """Writes replies to the client in order, each at its due time."""
        try:
            while True:
                item = await self._replies.get()
                if item is None or self.closed:
                    return
                due, data = item
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                if self.closed:
                    return
                self.client_writer.write(data)
                await self.client_writer.drain()
        except (ConnectionError, OSError):
            self.abort()


class Proxy:
    """A TCP proxy from 127.0.0.1:<port> to ``target``; see the module docstring."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self.delay = 0.0
        self.partitioned = False
        self.on_request: Hook | None = None
        self.on_reply: Hook | None = None
        self.links: list[Link] = []
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def __repr__(self) -> str:
        return f"Proxy(127.0.0.1:{self.port} -> {self.target[0]}:{self.target[1]})"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> Proxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            server = await asyncio.wait_for(asyncio.open_connection(*self.target), 2.0)
        except (OSError, TimeoutError):
            writer.transport.abort()
            return
        link = Link(self, (reader, writer), server)
        self.links.append(link)
        for pump in (link.pump_requests, link.pump_replies, link.deliver_replies):
            task = asyncio.ensure_future(pump())
            link.tasks.append(task)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def partition(self) -> None:
        """From now on, bytes in either direction are lost."""
        self.partitioned = True

    def heal(self) -> None:
        """Bytes flow again; connections that lost bytes are reset."""
        self.partitioned = False
        for link in self.links:
            if link.lost:
                link.abort()

    def abort_all(self) -> None:
        """Resets every open connection."""
        for link in self.links:
            link.abort()

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        self.abort_all()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()


class Proxies:
    """One proxy per server address; ``remap`` is a ``RedisCluster(address_remap=...)``."""

    def __init__(self) -> None:
        self.by_target: dict[tuple[str, int], Proxy] = {}

    async def start(self, targets: Iterable[tuple[str, int]]) -> Proxies:
        for host, port in targets:
            self.by_target[(host, port)] = await Proxy(host, port).start()
        return self

    def __getitem__(self, port: int) -> Proxy:
        """The proxy in front of the server on 127.0.0.1:``port``."""
        return self.by_target[("127.0.0.1", port)]

    def remap(self, address: tuple[str, int]) -> tuple[str, int]:
        proxy = self.by_target.get(address)
        if proxy is None:  # a node we have no proxy for: talk to it directly
            return address
        return ("127.0.0.1", proxy.port)

    async def aclose(self) -> None:
        for proxy in self.by_target.values():
            await proxy.aclose()


def drop_first_script_reply(proxy: Proxy) -> list[int]:
    """Arms ``proxy``: the reply to the next script call is lost with its connection (the
    server ran the call). Returns a list that counts the connections dropped."""
    dropped: list[int] = []

    def on_request(link: Link, data: bytes) -> None:
        if script_calls(data) and not dropped and "doomed" not in link.marks:
            link.marks["doomed"] = True

    def on_reply(link: Link, data: bytes) -> None:
        if link.marks.get("doomed") and not dropped:
            dropped.append(1)
            link.abort()

    proxy.on_request, proxy.on_reply = on_request, on_reply
    return dropped
