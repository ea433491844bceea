"""One redis-server process that this package started: spawn, readiness, signals, stop."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from cluster._errors import ServerStartError
from cluster._ports import LOOPBACK

_PORT_TAKEN_MARKERS = ("Address already in use", "EADDRINUSE")
_SERVER_NAMES = frozenset({"redis-server", "valkey-server"})


def common_server_args(port: int, directory: Path) -> list[str]:
    """Arguments every server gets: loopback, no persistence, foreground, DEBUG allowed."""
    return [
        "--bind", LOOPBACK,
        "--port", str(port),
        "--save", "",
        "--appendonly", "no",
        "--daemonize", "no",
        "--enable-debug-command", "local",
        "--dir", str(directory),
        "--logfile", str(directory / "redis.log"),
    ]  # fmt: skip


class ServerProcess:
    """A redis-server child process on a loopback port, with an admin client.

    Signals always go to the pid this object started, never to a process found by name.
    """

    host = LOOPBACK

    def __init__(self, *, binary: str, port: int, directory: Path) -> None:
        self.port = port
        self.directory = directory
        self._binary = binary
        self._popen: subprocess.Popen[bytes] | None = None
        self._paused = False
        self._client: redis.Redis | None = None

    def __repr__(self) -> str:
        pid = self._popen.pid if self._popen else None
        return f"{type(self).__name__}({self.host}:{self.port}, pid={pid})"

    # --- what to run -------------------------------------------------------------------

    def server_args(self) -> list[str]:
        """Command-line arguments after the binary; subclasses add to them."""
        return common_server_args(self.port, self.directory)

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.directory / "redis.log"

    @property
    def binary(self) -> str:
        return self._binary

    # --- lifecycle ------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        """Pid of the process most recently started for this server."""
        if self._popen is None:
            raise RuntimeError(f"{self!r} was never started")
        return self._popen.pid

    def is_running(self) -> bool:
        """True while the started process has not exited (a paused one is running)."""
        return self._popen is not None and self._popen.poll() is None

    @property
    def paused(self) -> bool:
        return self._paused

    def spawn(self) -> None:
        """Start the process without waiting; wait_ready() does the waiting."""
        self.directory.mkdir(parents=True, exist_ok=True)
        # stdout/stderr go to a file, never to our pipes: the server may outlive us, and
        # early errors (before --logfile is opened) still land somewhere readable.
        with open(self.directory / "stdout.log", "ab") as output:
            self._popen = subprocess.Popen(
                [self._binary, *self.server_args()],
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._paused = False

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Poll until the server answers, and checks that the answer comes from our pid.

        The pid check matters: if another server squats on the port, it would answer PING
        while ours is failing to bind.
        """
        popen = self._popen
        if popen is None:
            raise RuntimeError(f"{self!r} was never started")
        deadline = time.monotonic() + timeout
        delay = 0.005
        while True:
            code = popen.poll()
            if code is not None:
                tail = self.log_tail()
                raise ServerStartError(
                    f"{self.binary} on port {self.port} exited with code {code} during "
                    f"startup. Log tail:\n{tail}",
                    port_in_use=any(marker in tail for marker in _PORT_TAKEN_MARKERS),
                )
            try:
                info = self.client.info("server")
                if int(info["process_id"]) == popen.pid:
                    return
            except redis.RedisError:
                pass
            if time.monotonic() >= deadline:
                self._stop_process()
                raise ServerStartError(
                    f"{self.binary} on port {self.port} did not answer within {timeout:g} s. "
                    f"Log tail:\n{self.log_tail()}"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def kill(self) -> None:
        """SIGKILL the process (a crash: no shutdown, no config save) and reap it."""
        self.send_signal(signal.SIGKILL)
        self._reap(timeout=None)

    def pause(self) -> None:
        """SIGSTOP: the port still accepts TCP connections, but nothing is answered.

        Returns once the kernel reports the process stopped (signals are asynchronous).
        """
        self.send_signal(signal.SIGSTOP)
        self._paused = True
        self._wait_for_state(lambda state: state in ("T", None))

    def resume(self) -> None:
        """SIGCONT after pause(); returns once the process runs again."""
        self.send_signal(signal.SIGCONT)
        self._paused = False
        self._wait_for_state(lambda state: state != "T")

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL if still alive after `timeout`. Safe to call twice."""
        self._stop_process(timeout)

    def _stop_process(self, timeout: float = 5.0) -> None:
        if self.is_running():
            if self._paused:
                self.resume()  # a stopped process cannot act on SIGTERM
            self.send_signal(signal.SIGTERM)
            try:
                self._reap(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.send_signal(signal.SIGKILL)
                self._reap(timeout=None)
        self._drop_client()

    def restart(self, timeout: float = 10.0) -> None:
        """Start again on the same port (and the same config): stop first if running."""
        self.restart_process(timeout)

    def restart_process(self, timeout: float = 10.0) -> None:
        """Stop if running, start on the same port, wait until it answers.

        The port may briefly be taken by someone else's connection; that is retried until
        `timeout`, since a cluster node cannot move to another port.
        """
        self._stop_process()
        deadline = time.monotonic() + timeout
        while True:
            self.spawn()
            try:
                self.wait_ready(timeout=max(deadline - time.monotonic(), 0.5))
                return
            except ServerStartError as error:
                if not error.port_in_use or time.monotonic() >= deadline:
                    raise
                time.sleep(0.1)

    # --- admin ----------------------------------------------------------------------------

    @property
    def client(self) -> redis.Redis:
        """A sync admin client: str replies, no retries (faults must show, not be hidden).

        `surrogateescape` makes binary keys round-trip through str unchanged, which matters
        for MIGRATE of keys read from GETKEYSINSLOT.
        """
        if self._client is None:
            self._client = redis.Redis(
                host=self.host,
                port=self.port,
                decode_responses=True,
                encoding_errors="surrogateescape",
                socket_connect_timeout=2.0,
                socket_timeout=10.0,
                retry=Retry(NoBackoff(), 0),
            )
        return self._client

    def execute(self, *args: str | int | float) -> Any:
        """Run one command on this server through the admin client, e.g. DEBUG SLEEP 1."""
        return self.client.execute_command(*args)  # type: ignore[no-untyped-call]

    def log_tail(self, lines: int = 25) -> str:
        chunks = []
        for path in (self.directory / "stdout.log", self.log_path):
            try:
                text = path.read_text(errors="replace")
            except OSError:
                continue
            if text.strip():
                chunks.extend(text.splitlines()[-lines:])
        return "\n".join(chunks) or "(no log output)"

    # --- internals ------------------------------------------------------------------------

    def send_signal(self, signum: signal.Signals) -> None:
        """Send `signum` to our process if it is still running; never to anything else."""
        if self._popen is None or self._popen.poll() is not None:
            return
        try:
            os.kill(self._popen.pid, signum)
        except ProcessLookupError:
            pass

    def _wait_for_state(self, done: Callable[[str | None], bool], timeout: float = 2.0) -> None:
        if self._popen is None:
            return
        deadline = time.monotonic() + timeout
        while not done(process_state(self._popen.pid)) and time.monotonic() < deadline:
            time.sleep(0.001)

    def _reap(self, timeout: float | None) -> None:
        if self._popen is not None:
            self._popen.wait(timeout=timeout)
        self._paused = False
        self._drop_client()

    def _drop_client(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def process_state(pid: int) -> str | None:
    """The state letter from /proc/<pid>/stat (R, S, T, Z, ...), or None if no such pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 3, after the parenthesised command name (which may itself contain spaces).
    return stat.rsplit(")", 1)[1].split()[0]


def pid_is_alive(pid: int) -> bool:
    """True if `pid` exists and is not a zombie (a zombie is dead, just not yet reaped)."""
    return process_state(pid) not in (None, "Z", "X")


def is_server_process(pid: int, port: int, binary: str | None = None) -> bool:
    """True if `pid` is a live redis/valkey server listening on 127.0.0.1:`port`.

    Redis rewrites its command line to "<binary> 127.0.0.1:<port> [cluster]", so the name
    and the address are both checked; a recycled pid fails at least one of them.
    """
    if not pid_is_alive(pid):
        return False
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    words = raw.replace(b"\0", b" ").decode(errors="replace").split()
    if not words:
        return False
    names = set(_SERVER_NAMES)
    if binary:
        names.add(os.path.basename(binary))
    return os.path.basename(words[0]) in names and f"{LOOPBACK}:{port}" in words[1:]
