"""`python -m cluster up|down|status`: local servers that outlive the command.

`up` prints `export REDIS_URL=...` / `export REDIS_CLUSTER_URL=...` lines, so
`eval "$(python -m cluster up)"` points the test suite, demos and benchmarks at them.
`down` stops exactly the pids recorded in the state file, after checking that each one
is still a redis/valkey server on the recorded port.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import warnings
from pathlib import Path

from cluster._cluster import Cluster, start_cluster
from cluster._errors import ClusterToolingError
from cluster._process import is_server_process, pid_is_alive
from cluster._standalone import Standalone, start_standalone
from cluster._state import (
    ServerRecord,
    default_state_path,
    read_state,
    record_cluster,
    record_standalone,
    remove_directory,
    write_state,
)

_ENV_NAMES = {"standalone": "REDIS_URL", "cluster": "REDIS_CLUSTER_URL"}


def _alive(record: ServerRecord) -> list[int]:
    return [
        process["pid"]
        for process in record["processes"]
        if is_server_process(process["pid"], process["port"], record["binary"])
    ]


def _up(state_path: Path, *, standalone: bool, cluster: bool) -> int:
    existing = read_state(state_path)
    if any(_alive(record) for record in existing):
        print(
            f"servers from {state_path} are still running; run `python -m cluster down` first",
            file=sys.stderr,
        )
        return 1
    _down(state_path, quiet=True)  # a stale file: tidy its directories
    records: list[ServerRecord] = []
    started: list[Standalone | Cluster] = []
    try:
        if standalone:
            server = start_standalone(stop_at_exit=False)
            started.append(server)
            records.append(record_standalone(server))
        if cluster:
            nodes = start_cluster(stop_at_exit=False)
            started.append(nodes)
            records.append(record_cluster(nodes))
        write_state(state_path, records)
    except BaseException:
        for thing in started:
            thing.stop()
        raise
    # The servers are meant to outlive this process; their Popen objects are not.
    warnings.filterwarnings("ignore", "subprocess .* is still running", ResourceWarning)
    for record in records:
        print(f"export {_ENV_NAMES[record['kind']]}={record['url']}")
    print(f"state: {state_path}", file=sys.stderr)
    return 0


def _down(state_path: Path, *, quiet: bool = False) -> int:
    records = read_state(state_path)
    targets = [
        (process, record["binary"])
        for record in records
        for process in record["processes"]
        if is_server_process(process["pid"], process["port"], record["binary"])
    ]
    for process, _ in targets:
        os.kill(process["pid"], signal.SIGTERM)
    deadline = time.monotonic() + 5.0
    while any(pid_is_alive(p["pid"]) for p, _ in targets) and time.monotonic() < deadline:
        time.sleep(0.02)
    for process, binary in targets:
        # Check again right before SIGKILL: the pid must still be that same server.
        if is_server_process(process["pid"], process["port"], binary):
            os.kill(process["pid"], signal.SIGKILL)
    for record in records:
        remove_directory(record["directory"])
    state_path.unlink(missing_ok=True)
    if not quiet:
        print(f"stopped {len(targets)} server process(es)", file=sys.stderr)
    return 0


def _status(state_path: Path) -> int:
    records = read_state(state_path)
    if not records:
        print(f"nothing is up (no {state_path})")
        return 1
    all_up = True
    for record in records:
        alive = _alive(record)
        total = len(record["processes"])
        all_up = all_up and len(alive) == total
        pids = " ".join(str(process["pid"]) for process in record["processes"])
        print(f"{record['kind']}: {record['url']} ({len(alive)}/{total} alive; pids {pids})")
    return 0 if all_up else 1


def main(argv: list[str] | None = None) -> int:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--state-file",
        type=Path,
        default=default_state_path(),
        help="where `up` records pids and URLs (default: %(default)s)",
    )
    parser = argparse.ArgumentParser(prog="python -m cluster", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", parents=[common], help="start servers (default: both)")
    up.add_argument("--standalone", action="store_true", help="start a standalone server")
    up.add_argument("--cluster", action="store_true", help="start a 3+3 cluster")
    commands.add_parser("down", parents=[common], help="stop what `up` started")
    commands.add_parser("status", parents=[common], help="show what `up` started")
    args = parser.parse_args(argv)
    state_path: Path = args.state_file
    try:
        if args.command == "up":
            both = not args.standalone and not args.cluster
            return _up(state_path, standalone=both or args.standalone, cluster=both or args.cluster)
        if args.command == "down":
            return _down(state_path)
        return _status(state_path)
    except ClusterToolingError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
