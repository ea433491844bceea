"""A decision whose call was never written (the connection could not be made: nothing
listens, AUTH or SELECT refused at the handshake) cannot have charged anywhere: its op is
settled at once, with no undo left retrying in the background and holding ``aclose`` for
its grace (5 s). A call that was written and lost its reply still gets its undo."""

from __future__ import annotations

import socket
import time

from aiolimit import BackendUnavailable, Limit, Limiter


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_a_refused_connection_leaves_no_undo_behind() -> None:
    limiter = Limiter(f"redis://127.0.0.1:{closed_port()}/0", [Limit(5, per=60)])
    try:
        for _ in range(3):
            try:
                await limiter.try_acquire("ip:1")
            except BackendUnavailable:
                pass
            else:  # pragma: no cover - nothing listens there
                raise AssertionError("a decision was made without a server")
        assert not limiter._protocol._tasks, "undos were started for calls never sent"
        assert limiter._protocol.ops.unsettled() == 0
    finally:
        started = time.monotonic()
        await limiter.aclose()
        took = time.monotonic() - started
    assert took < 1.0, f"aclose waited {took:.2f} s for undos of calls never sent"


async def test_a_handshake_refused_by_the_server_leaves_no_undo_behind(redis_url: str) -> None:
    """SELECT of a database the server does not have fails during the handshake, before
    any call is written."""
    url = redis_url.rsplit("/", 1)[0] + "/999"
    limiter = Limiter(url, [Limit(5, per=60)])
    try:
        try:
            await limiter.try_acquire("ip:1")
        except BackendUnavailable:
            pass
        except Exception:  # (named as a configuration problem: still nothing sent)
            pass
        assert not limiter._protocol._tasks
    finally:
        started = time.monotonic()
        await limiter.aclose()
        took = time.monotonic() - started
    assert took < 1.0, f"aclose waited {took:.2f} s"


async def test_a_cluster_that_cannot_be_reached_leaves_no_undo_behind() -> None:
    """No seed answers: the slot map never loads, so no call is ever written (each retry
    fails at the map's load, before sending)."""
    limiter = Limiter(
        f"redis+cluster://127.0.0.1:{closed_port()}", [Limit(5, per=60)], deadline=1.0
    )
    try:
        try:
            await limiter.try_acquire("ip:1")
        except BackendUnavailable:
            pass
        assert not limiter._protocol._tasks, "an undo was started for a call never sent"
        assert limiter._protocol.ops.unsettled() == 0
    finally:
        started = time.monotonic()
        await limiter.aclose()
        took = time.monotonic() - started
    assert took < 1.0, f"aclose waited {took:.2f} s"
