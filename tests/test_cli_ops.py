"""The command line against a server that misbehaves, and its one-JSON-document promise.
Real servers, the CLI as a subprocess; every fault bounded in time."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from aiolimit import Limiter
from aiolimit._follow import publish, rules_keys
from aiolimit._ruleset import RuleSet
from cluster import Standalone

ROOT = Path(__file__).resolve().parent.parent
RULES = '[kinds]\nuser = "5/hour"\n'
LOG_RULES = '[kinds]\nuser = [{ type = "sliding_log", amount = 2, per = 3600 }]\n'
#: A document this version cannot read (as a newer aiolimit might leave).
NEWER = {"format": 2, "version": "f" * 64, "rules": {"kinds": {"user": "1/s"}}}


def cli(*args: str, url: str, prefix: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "AIOLIMIT_URL": url, "AIOLIMIT_PREFIX": prefix, "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "aiolimit.cli", *args],
        cwd=ROOT, env=env, input="", capture_output=True, text=True, timeout=timeout,
        check=False,
    )  # fmt: skip


def one_json_document(done: subprocess.CompletedProcess[str]) -> dict:
    assert "Traceback" not in done.stderr, done.stderr[-800:]
    document = json.loads(done.stdout)  # exactly one: "Extra data" otherwise
    assert isinstance(document, dict)
    return document


@pytest.fixture
def rules_file(tmp_path: Path) -> Path:
    path = tmp_path / "rules.toml"
    path.write_text(RULES, encoding="utf-8")
    return path


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never answers (a hung proxy or balancer)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        for conn in accepted:
            conn.close()
        listener.close()


# -- an invalid document in Redis ----------------------------------------------------------


def test_push_replaces_an_invalid_document(rules_file: Path, redis_url: str, prefix: str) -> None:
    raw = redis.Redis.from_url(redis_url)
    try:
        raw.set(rules_keys(prefix).doc, json.dumps(NEWER))
        done = cli(
            "--json", "rules", "push", str(rules_file), "--yes", url=redis_url, prefix=prefix
        )
        assert done.returncode == 0, (done.stdout, done.stderr)
        pushed = one_json_document(done)
        assert any(line.startswith("-") and "invalid" in line for line in pushed["diff"])
        shown = one_json_document(cli("--json", "rules", "show", url=redis_url, prefix=prefix))
        assert shown["version"] == pushed["version"]
    finally:
        raw.close()


async def test_replacing_an_invalid_document_still_compares_and_sets(
    redis_url: str, prefix: str
) -> None:
    """The push names the invalid document it saw: one changed meanwhile is not replaced."""
    raw = json.dumps(NEWER).encode()
    seen = "sha1:" + hashlib.sha1(raw).hexdigest()
    rules = RuleSet.from_mapping({"kinds": {"user": "5/hour"}})
    async with Limiter(redis_url, {"user": "1/hour"}, prefix=prefix) as limiter:
        await limiter.store.command("SET", rules_keys(prefix).doc, raw + b" ")  # changed
        assert not await publish(limiter.store, prefix, rules, expect=seen)
        await limiter.store.command("SET", rules_keys(prefix).doc, raw)
        assert await publish(limiter.store, prefix, rules, expect=seen)


# -- reset ---------------------------------------------------------------------------------


async def test_reset_forgets_state_under_the_pushed_rules(
    tmp_path: Path, redis_url: str, prefix: str
) -> None:
    path = tmp_path / "log.toml"
    path.write_text(LOG_RULES, encoding="utf-8")
    assert cli("rules", "push", str(path), "--yes", url=redis_url, prefix=prefix).returncode == 0
    async with Limiter(redis_url, {"user": "1/hour"}, prefix=prefix, follow_rules=True) as limiter:
        assert [(await limiter.try_acquire("user:42")).allowed for _ in range(3)] == [
            True,
            True,
            False,
        ]
    assert cli("reset", "user:42", "--yes", url=redis_url, prefix=prefix).returncode == 0
    shown = one_json_document(cli("--json", "inspect", "user:42", url=redis_url, prefix=prefix))
    assert [pair["remaining"] for pair in shown["identifiers"][0]["pairs"]] == [2]


# -- a server that does not answer ---------------------------------------------------------

COMMANDS = [
    ("rules", "show"),
    ("rules", "push", "RULES", "--yes"),
    ("reset", "user:1", "--yes"),
    ("inspect", "user:1", "--limits", "5/hour"),
    ("bench", "--seconds", "0.2"),
]


@pytest.mark.parametrize("args", COMMANDS, ids=lambda args: " ".join(args[:2]))
def test_a_frozen_server_is_exit_3_within_the_timeout(
    fresh_standalone: Standalone, rules_file: Path, prefix: str, args: tuple[str, ...]
) -> None:
    args = tuple(str(rules_file) if arg == "RULES" else arg for arg in args)
    fresh_standalone.pause()
    try:
        started = time.monotonic()
        done = cli("--json", "--timeout", "1", *args, url=fresh_standalone.url, prefix=prefix,
                   timeout=30)  # fmt: skip
        took = time.monotonic() - started
    finally:
        fresh_standalone.resume()
    assert done.returncode == 3, (done.stdout, done.stderr[-800:])
    assert one_json_document(done)["exit_code"] == 3
    assert took < 6, took  # --timeout 1: one second per unanswered request, a few at most


def test_a_silent_port_is_exit_3_within_the_default_timeout(silent_port: int, prefix: str) -> None:
    started = time.monotonic()
    done = cli("--json", "rules", "show", url=f"redis://127.0.0.1:{silent_port}/0",
               prefix=prefix, timeout=30)  # fmt: skip
    took = time.monotonic() - started
    assert done.returncode == 3, (done.stdout, done.stderr[-800:])
    assert one_json_document(done)["exit_code"] == 3
    assert took < 12, took


@pytest.mark.parametrize("command", [("rules", "show"), ("reset", "user:1", "--yes")])
def test_a_silent_cluster_seed_is_exit_3_within_the_timeout(
    silent_port: int, prefix: str, command: tuple[str, ...]
) -> None:
    """On a cluster URL --timeout bounds the cluster client's own retries too (they took
    their default 5 s budget: 5.4 s with --timeout 0.3)."""
    started = time.monotonic()
    url = f"redis+cluster://127.0.0.1:{silent_port}"
    done = cli("--json", "--timeout", "0.3", *command, url=url, prefix=prefix, timeout=30)
    took = time.monotonic() - started
    assert done.returncode == 3, (done.stdout, done.stderr[-800:])
    assert one_json_document(done)["exit_code"] == 3
    assert took < 3.5, took  # (the interpreter's start included)


# -- one JSON document on every path -------------------------------------------------------


def test_a_push_not_confirmed_is_one_json_document(
    rules_file: Path, redis_url: str, prefix: str
) -> None:
    done = cli("--json", "rules", "push", str(rules_file), url=redis_url, prefix=prefix)
    assert done.returncode == 4
    document = one_json_document(done)
    assert document["exit_code"] == 4 and document["pushed"] is False and document["diff"]


@pytest.mark.parametrize(
    "args",
    [
        ("inspect", "user:1", "--limits", "ten per sec"),
        ("inspect", "user:1", "--rules", "/nonexistent.toml"),
        ("bench", "--seconds", "0.2", "--limits", "ten per sec"),
        ("rules", "check", "/nonexistent.toml"),
        ("rules", "push", "/nonexistent.toml", "--yes"),
    ],
    ids=lambda args: " ".join(args),
)
def test_bad_option_values_are_exit_1_and_one_json_error(
    redis_url: str, prefix: str, args: tuple[str, ...]
) -> None:
    done = cli("--json", *args, url=redis_url, prefix=prefix)
    assert done.returncode == 1, (done.stdout, done.stderr[-800:])
    document = one_json_document(done)
    assert document["exit_code"] == 1 and document["error"]
    assert not document["error"].startswith("/nonexistent.toml: /nonexistent.toml")
