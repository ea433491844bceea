"""Review of the "unsent" marks (``mark_unsent``): a mark must never stand for a call (or an
earlier try of it) that may have been written, nor be read as something it does not say."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import pytest

from aiolimit import BackendUnavailable, Limit, Limiter
from aiolimit._protocol import Protocol
from tests._proxy import Proxy


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def drained(limiter: Limiter, within: float = 8.0) -> None:
    give_up = time.monotonic() + within
    while limiter._protocol._tasks:
        assert time.monotonic() < give_up, "background work did not finish"
        await asyncio.sleep(0.05)


async def test_a_refund_never_written_is_not_given_back_twice(
    standalone_proxy: Proxy, prefix: str
) -> None:
    """A refund by decision whose connection could not be made (the store marks its error
    unsent) goes on in the background, as every failed refund does: the caller must not be
    told it may refund that decision again, or its charge is given back twice."""
    proxy = standalone_proxy
    target = proxy.target
    limiter = Limiter(proxy.url, [Limit(2, per=60)], prefix=prefix)
    try:
        first = await limiter.try_acquire("ip:1")
        second = await limiter.try_acquire("ip:1")
        assert first.allowed and second.allowed
        proxy.target = ("127.0.0.1", closed_port())  # new connections are reset at once
        proxy.abort_all()
        with pytest.raises(BackendUnavailable):
            await limiter.refund("ip:1", decision=first)
        proxy.target = target
        await drained(limiter)  # (a failed refund is sent again in the background)
        try:
            await limiter.refund("ip:1", decision=first)  # may be refused: given back already
        except Exception:
            pass
        await drained(limiter)
        allowed = [(await limiter.try_acquire("ip:1")).allowed for _ in range(3)]
        assert allowed == [True, False, False], f"one charge given back twice: {allowed}"
    finally:
        proxy.target = target
        await limiter.aclose()


ROOMY = Limit(1_000_000, per=3600, precision=60)


@pytest.mark.cluster
@pytest.mark.parametrize("stuck", [False, True])
async def test_a_cross_slot_commit_whose_undo_could_not_be_sent_is_still_undone(
    calm: Any, prefix: str, monkeypatch: pytest.MonkeyPatch, stuck: bool
) -> None:
    """Commits across slots are written and their replies lost (every node then refuses new
    connections, so redis-py drops its slot map). The compensation's undo cannot load the map:
    its error is marked unsent, which says nothing of the commits. The caller is told the
    decision failed: the commits must still be undone once the cluster answers again.

    ``stuck``: the compensation outlives its own budget (``UNDO_BUDGET``), as it did on a
    loaded machine in redis-py's slot map reload, which no deadline of ours bounds (its
    connect to a node stalled). The caller must still be told ``BackendUnavailable``, as the
    failure policy answers it: a bare ``TimeoutError`` went past the policy to the caller."""
    from redis.asyncio.cluster import RedisCluster
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    from tests._nodes import on_node
    from tests._proxy import Link, Proxies, script_calls

    nodes = calm
    a = on_node(nodes, prefix, "a", nodes.nodes[0])
    b = on_node(nodes, prefix, "b", nodes.nodes[1])
    proxies = await Proxies().start((node.host, node.port) for node in nodes.nodes)
    targets = {proxy: proxy.target for proxy in proxies.by_target.values()}
    seed = nodes.nodes[0]
    client = RedisCluster(
        host=seed.host, port=seed.port, address_remap=proxies.remap, reinitialize_steps=0,
        retry=Retry(NoBackoff(), 0), socket_timeout=None, socket_connect_timeout=2.0,
        health_check_interval=0,
    )  # fmt: skip
    # count_refused: no check phase, the commits are the first script calls
    limiter = Limiter(client, [ROOMY], prefix=prefix, count_refused=True, deadline=None)
    # No decision deadline, so the caller waits for the compensation's answer; the store's
    # retries and the compensation's budget are cut to a second, to keep the test short.
    limiter._protocol._store.deadline = 1.0  # type: ignore[attr-defined]
    monkeypatch.setattr("aiolimit._protocol.UNDO_BUDGET", 1.0)
    if stuck:
        compensate = Protocol._compensate

        async def stuck_compensate(self: Protocol, *args: Any) -> None:
            await asyncio.sleep(1.5)  # (past the budget: the wait is cut, the undo with it)
            await compensate(self, *args)

        monkeypatch.setattr(Protocol, "_compensate", stuck_compensate)
    refused = closed_port()
    armed: list[bool] = []

    def on_request(link: Link, data: bytes) -> None:
        if armed and script_calls(data):
            link.marks["commit"] = True

    def on_reply(link: Link, data: bytes) -> None:
        if link.marks.get("commit") and armed[0]:
            armed[0] = False  # a commit ran: its reply is lost, and every node refuses
            for proxy in targets:
                proxy.target = ("127.0.0.1", refused)
            for proxy in targets:
                proxy.abort_all()

    try:
        warm = await limiter.try_acquire([a, b])  # (links and the slot map in place)
        assert warm.allowed
        for proxy in targets:
            proxy.on_request, proxy.on_reply = on_request, on_reply
        armed.append(True)
        with pytest.raises(BackendUnavailable):
            await limiter.try_acquire([a, b])
        assert not armed[0], "no commit reply was seen"
        for proxy, target in targets.items():
            proxy.target = target
            proxy.on_request = proxy.on_reply = None
        await drained(limiter, within=15.0)
        stored = {}
        for identifier in (a, b):
            async with Limiter(nodes.url, [ROOMY], prefix=prefix, deadline=5.0) as reader:
                stored[identifier] = ROOMY.amount - (await reader.peek(identifier)).remaining
        assert stored == {a: 1, b: 1}, f"a failed decision left its charges: {stored}"
    finally:
        for proxy, target in targets.items():
            proxy.target = target
        await limiter.aclose()
        await client.aclose()
        await proxies.aclose()
