"""The local server tooling: real processes, real signals, real resharding."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis
import redis.asyncio
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot
from redis.retry import Retry

import cluster
from cluster import Cluster, Standalone

REPO_ROOT = Path(__file__).resolve().parent.parent


def _process_state(pid: int) -> str | None:
    """The one-letter state in /proc/<pid>/stat, or None if there is no such process.

    Deliberately not cluster.process_state: the tests check the package independently.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def _alive(pid: int) -> bool:
    # A zombie has exited; it only waits for a parent (maybe init) to reap it.
    return _process_state(pid) not in (None, "Z", "X")


def _listening_addresses(port: int) -> set[str]:
    """Local addresses with a TCP socket in LISTEN state on `port`, from /proc/net."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, port_hex = local.rsplit(":", 1)
            if state == "0A" and int(port_hex, 16) == port:
                if len(address) == 8:  # IPv4, little-endian hex
                    found.add(".".join(str(int(address[i : i + 2], 16)) for i in (6, 4, 2, 0)))
                else:
                    found.add(f"ipv6:{address}")
    return found


def _cluster_client(nodes: Cluster) -> RedisCluster:
    live = [ClusterNode(node.host, node.port) for node in nodes.live_nodes()]
    return RedisCluster(startup_nodes=live, decode_responses=True, reinitialize_steps=0)


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cluster", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_standalone_answers_ping_on_its_port_bound_to_loopback(
    fresh_standalone: Standalone,
) -> None:
    """A standalone server answers PING on its reported port and listens on 127.0.0.1 only."""
    port = fresh_standalone.port
    assert fresh_standalone.url == f"redis://127.0.0.1:{port}/0"
    with redis.Redis(host="127.0.0.1", port=port) as client:
        assert client.ping()
        assert client.info("server")["process_id"] == fresh_standalone.pid
    assert _listening_addresses(port) == {"127.0.0.1"}


def test_pause_and_resume_are_real_signals(fresh_standalone: Standalone) -> None:
    """pause() SIGSTOPs the server (it stops answering) and resume() brings it back."""
    no_retry = Retry(NoBackoff(), 0)
    with redis.Redis(port=fresh_standalone.port, socket_timeout=0.3, retry=no_retry) as client:
        fresh_standalone.pause()
        assert _process_state(fresh_standalone.pid) == "T"
        with pytest.raises(redis.TimeoutError):
            client.ping()
        fresh_standalone.resume()
        assert _process_state(fresh_standalone.pid) in ("S", "R")
        assert client.ping()


def test_restart_keeps_the_port_with_a_new_process(fresh_standalone: Standalone) -> None:
    """restart() starts a new process on the same port; clients can reconnect to it."""
    old_pid, port = fresh_standalone.pid, fresh_standalone.port
    fresh_standalone.restart()
    assert fresh_standalone.pid != old_pid and not _alive(old_pid)
    with redis.Redis(port=port) as client:
        assert client.info("server")["process_id"] == fresh_standalone.pid


async def test_redis_url_fixture_points_at_a_live_server(redis_url: str, prefix: str) -> None:
    """The session redis_url serves reads and writes."""
    client = redis.asyncio.from_url(redis_url)
    try:
        await client.set(f"{prefix}:k", "v")
        assert await client.get(f"{prefix}:k") == b"v"
    finally:
        await client.aclose()


@pytest.mark.cluster
def test_cluster_has_three_primaries_covering_all_slots_each_replicated(
    local_cluster: Cluster,
) -> None:
    """The shared cluster is ok: 3 primaries cover all 16384 slots, each with a linked replica."""
    for node in local_cluster.nodes:
        with redis.Redis(port=node.port, decode_responses=True) as client:
            assert "cluster_state:ok" in client.execute_command("CLUSTER", "INFO")
            if client.execute_command("ROLE")[0] == "slave":
                assert client.info("replication")["master_link_status"] == "up"
    with redis.Redis(port=local_cluster.nodes[0].port) as client:
        ranges = client.execute_command("CLUSTER", "SLOTS")
    covered = sum(int(entry[1]) - int(entry[0]) + 1 for entry in ranges)
    assert covered == cluster.SLOT_COUNT
    primaries = {int(entry[2][1]) for entry in ranges}
    assert primaries == {node.port for node in local_cluster.primaries()}
    assert len(primaries) == 3
    assert all(len(entry) == 4 for entry in ranges), "each range has exactly one replica"
    assert len(local_cluster.replicas()) == 3


@pytest.mark.cluster
async def test_cluster_url_fixtures_serve_a_cluster_client(
    redis_cluster_url: str, redis_cluster_seed_url: str, prefix: str
) -> None:
    """redis_cluster_url uses aiolimit's scheme; its seed form works with redis-py."""
    assert redis_cluster_url.startswith("redis+cluster://")
    client = redis.asyncio.RedisCluster.from_url(redis_cluster_seed_url)
    try:
        for index in range(20):  # keys spread over every primary
            await client.set(f"{prefix}:{index}", index)
        assert await client.get(f"{prefix}:7") == b"7"
    finally:
        await client.aclose()


@pytest.mark.cluster
def test_stop_leaves_no_process_alive() -> None:
    """stop() ends every process a Standalone and a Cluster started and deletes their files."""
    standalone = cluster.start_standalone()
    small = cluster.start_cluster(primaries=1, replicas_per_primary=1)
    pids = [standalone.pid, *(node.pid for node in small.nodes)]
    roots = [standalone.root, small.root]
    assert all(_alive(pid) for pid in pids)
    standalone.stop()
    small.stop()
    assert not [pid for pid in pids if _alive(pid)]
    assert not [root for root in roots if root.exists()]


@pytest.mark.cluster
def test_cli_up_then_down_leaves_no_process_alive(tmp_path: Path) -> None:
    """`python -m cluster up` starts servers that outlive it; `down` stops exactly those."""
    state_file = tmp_path / "state.json"
    up = _run_cli("up", "--state-file", str(state_file))
    assert up.returncode == 0, up.stderr
    records = json.loads(state_file.read_text())["servers"]
    pids = [process["pid"] for record in records for process in record["processes"]]
    try:
        assert len(pids) == 7 and all(_alive(pid) for pid in pids)
        assert {line.split("=")[0] for line in up.stdout.splitlines()} == {
            "export REDIS_URL",
            "export REDIS_CLUSTER_URL",
        }
        status = _run_cli("status", "--state-file", str(state_file))
        assert status.returncode == 0, status.stdout
    finally:
        down = _run_cli("down", "--state-file", str(state_file))
    assert down.returncode == 0, down.stderr
    assert not [pid for pid in pids if _alive(pid)]
    assert not state_file.exists()
    assert not [r["directory"] for r in records if os.path.exists(r["directory"])]


@pytest.mark.cluster
@pytest.mark.slow
def test_killed_primary_fails_over_and_rejoins_as_replica(fresh_cluster: Cluster) -> None:
    """SIGKILL on a primary: its replica takes over within 10 s, writes work, and the
    restarted old primary rejoins as a replica."""
    key = "failover:{k}"
    victim = fresh_cluster.node_for_slot(key_slot(key.encode()))
    victim.kill()
    assert not _alive(victim.pid)
    started = time.monotonic()
    promoted = fresh_cluster.wait_for_failover(victim, timeout=10)
    assert time.monotonic() - started < 10
    assert promoted is not victim and promoted.role == "primary"
    with _cluster_client(fresh_cluster) as client:
        assert client.set(key, "after") and client.get(key) == "after"
    victim.restart()
    assert victim.role == "replica"
    assert victim in fresh_cluster.replicas()


@pytest.mark.cluster
def test_migrate_slots_moves_keys_while_clients_write() -> None:
    """migrate_slots moves a populated slot to another primary under concurrent INCRs,
    losing no acknowledged write, and a cluster client reads every key afterwards."""
    keys = [f"{{migrate}}:{index}" for index in range(200)]
    with cluster.start_cluster(replicas_per_primary=0) as nodes, _cluster_client(nodes) as client:
        for key in keys:
            client.set(key, 0)
        slot = client.keyslot(keys[0])
        source = nodes.node_for_slot(slot)
        target = next(node for node in nodes.primaries() if node is not source)
        acknowledged, failed = [0], [0]
        done = threading.Event()

        def write() -> None:
            with _cluster_client(nodes) as writer:
                index = 0
                while not done.is_set():
                    try:
                        writer.incr(keys[index % len(keys)])
                        acknowledged[0] += 1
                    except redis.RedisError:
                        failed[0] += 1
                    index += 1

        thread = threading.Thread(target=write)
        thread.start()
        try:
            deadline = time.monotonic() + 5
            while acknowledged[0] < 50 and time.monotonic() < deadline:
                time.sleep(0.005)
            assert acknowledged[0] >= 50, f"the writer is stuck ({failed[0]} errors)"
            moved = nodes.migrate_slots([slot], target, keys_per_batch=7)
        finally:
            done.set()
            thread.join()
        assert moved == len(keys)
        assert nodes.node_for_slot(slot) is target
        with _cluster_client(nodes) as reader:
            total = sum(int(reader.get(key)) for key in keys)
        # An INCR that raised may or may not have been applied; none acknowledged is lost.
        assert acknowledged[0] <= total <= acknowledged[0] + failed[0]


def test_missing_binary_error_names_every_option(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Without any server binary, starting fails with a message naming the three options."""
    monkeypatch.delenv("REDIS_SERVER_BIN", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert cluster.find_server_binary() is None
    with pytest.raises(cluster.ServerBinaryNotFound) as caught:
        cluster.start_standalone()
    for option in ("REDIS_SERVER_BIN", "redis-server", "valkey-server"):
        assert option in str(caught.value)


def test_redis_server_bin_takes_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    """REDIS_SERVER_BIN wins over PATH, and a wrong value is reported, not ignored."""
    real = cluster.find_server_binary()
    assert real is not None
    monkeypatch.setenv("REDIS_SERVER_BIN", real)
    assert cluster.find_server_binary() == real
    monkeypatch.setenv("REDIS_SERVER_BIN", "/nonexistent/redis-server")
    assert cluster.find_server_binary() is None
    with pytest.raises(cluster.ServerBinaryNotFound, match="/nonexistent/redis-server"):
        cluster.require_server_binary()
