"""Identifiers placed on chosen nodes of a local Redis Cluster, for tests that freeze, kill or
flood one node and watch the others."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Sequence
from typing import Any

from redis.crc import key_slot

import cluster
from aiolimit import Limit, Limiter
from aiolimit._keys import main_key


def on_node(nodes: cluster.Cluster, prefix: str, tag: str, node: cluster.Node) -> str:
    """The first identifier ``<tag>:<i>`` whose main key under ``prefix`` lives on ``node``."""
    return next(
        f"{tag}:{i}"
        for i in range(10_000)
        if nodes.node_for_slot(key_slot(main_key(prefix, f"{tag}:{i}").encode())).port == node.port
    )


async def settle(limiter: Limiter, within: float = 10.0) -> None:
    """Waits until the limiter's background undos, its refills ahead (prefetch) and the
    store's pipelines are done (those queued, in flight in a task, or waiting on a link for
    their replies; a standalone store keeps none of its own)."""
    protocol = limiter._protocol
    store = protocol._store
    stop = time.monotonic() + within
    while protocol._tasks or limiter._ahead or not getattr(store, "idle", True):
        assert time.monotonic() < stop, "background work did not settle"
        await asyncio.sleep(0.01)


def held(limiter: Limiter, ident: str) -> int:
    """The units a prefetching limiter holds on ``ident`` now (its live allowance's)."""
    assert limiter._prefetch is not None
    entry = limiter._prefetch._by_ids.get(ident)
    return 0 if entry is None or entry.turn is None else entry.left


def store_of(limiter: Limiter) -> Any:
    """The limiter's store (for its links and statistics)."""
    return limiter._protocol._store


async def stored(url: str, prefix: str, ident: str, limits: list[Limit]) -> int:
    """What a fresh limiter's peek reads for ``ident``: the units charged under the first
    limit (no ledger, no cache: what is stored now)."""
    async with Limiter(url, limits, prefix=prefix, deadline=2.0) as fresh:
        decision = await fresh.peek(ident)
        return limits[0].amount - decision.details[0].remaining


async def before_bucket_edge(node: cluster.Node, width: float, lead: float = 0.1) -> None:
    """Sleeps until ``lead`` seconds before ``node``'s clock (its TIME, which a limiter's
    scripts judge by, or an authority's) reaches the next multiple of ``width`` seconds: where
    a window's bucket of that width ends (windows are aligned to the epoch). A test that
    starts here crosses a bucket edge every run rather than once in a while: with a fixed
    window (``precision`` = ``per``) that edge empties the window, which a test of a few
    seconds under ``per=3600`` otherwise meets once a day at random (on the hour)."""
    seconds, micros = node.execute("TIME")
    now = int(seconds) + int(micros) / 1_000_000
    wait = (now // width + 1) * width - lead - now
    await asyncio.sleep(wait if wait > 0 else wait + width)


def kill_clients_repeatedly(
    nodes: list[cluster.Node], stop: threading.Event, rounds: int, every: float
) -> None:
    """Run in a thread: every ``every`` seconds (``rounds`` times, or until ``stop``), kills
    the normal clients of ``nodes`` (the limiter's links among them); every other round
    during a 30 ms DEBUG SLEEP of the first node, so that calls are queued, or ran with
    their replies lost, when their connection dies."""

    def sleep_briefly() -> None:
        with contextlib.suppress(Exception):  # (its own connection may be killed too)
            nodes[0].execute("DEBUG", "SLEEP", "0.03")

    for round_ in range(rounds):
        if stop.wait(every):
            return
        if round_ % 2:
            threading.Thread(target=sleep_briefly).start()
            time.sleep(0.005)
        for node in nodes:
            with contextlib.suppress(Exception):
                node.execute("CLIENT", "KILL", "TYPE", "normal")


async def warm_counted(
    limiters: Sequence[Limiter], idents: Sequence[str], admitted: dict[str, int], calls: int = 3
) -> None:
    """Warms each limiter (the slot map, the links, a first allowance) with ``calls`` rounds of
    one call per identifier, counting the admissions as told: on a loaded machine a first call
    may miss a short deadline, and under ``on_error="closed"`` it is refused, charging
    nothing."""
    for limiter in limiters:
        for _ in range(calls):
            for ident in idents:
                if (await limiter.try_acquire(ident)).allowed:
                    admitted[ident] += 1
