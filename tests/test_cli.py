"""The ``aiolimit`` command line, run as a subprocess against real servers."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from aiolimit import Limiter

ROOT = Path(__file__).resolve().parent.parent

RULES = """
deny = ["user:banned"]

[kinds]
# Sliding windows: what a test charged is still counted when it reads it back, whenever it runs
# ("5/hour" is a calendar-aligned window that starts afresh on the hour).
user = [
    { type = "window", amount = 5, per = 3600, precision = 60 },
    { type = "window", amount = 100, per = 86400, precision = 3600 },
]
ip = "10/minute"

[overrides]
"user:vip" = { scale = 10 }
"""
HOURLY, DAILY = "5/hour (precision 60s)", "100/day (precision 3600s)"  # as the CLI names them


def cli(
    *args: str, url: str, prefix: str, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "AIOLIMIT_URL": url, "AIOLIMIT_PREFIX": prefix, "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "aiolimit.cli", *args],
        cwd=ROOT, env=env, input=stdin if stdin is not None else "", capture_output=True,
        text=True, timeout=60, check=False,
    )  # fmt: skip


@pytest.fixture
def rules_file(tmp_path: Path) -> Path:
    path = tmp_path / "rules.toml"
    path.write_text(RULES, encoding="utf-8")
    return path


def test_rules_check(rules_file: Path, tmp_path: Path, redis_url: str, prefix: str) -> None:
    ok = cli("--json", "rules", "check", str(rules_file), url=redis_url, prefix=prefix)
    assert ok.returncode == 0, ok.stderr
    report = json.loads(ok.stdout)
    assert report["valid"] is True
    assert report["kinds"] == {"user": [HOURLY, DAILY], "ip": ["10/minute"]}
    assert report["overrides"] == 2  # user:vip, and user:banned from the deny list
    bad = tmp_path / "bad.toml"
    bad.write_text('[kinds]\nuser = "5/hour"\n[overrides]\n"user:1" = { scale = "lots" }\n')
    failed = cli("rules", "check", str(bad), url=redis_url, prefix=prefix)
    assert failed.returncode == 1
    assert 'overrides."user:1".scale' in failed.stderr
    table = cli("rules", "check", str(rules_file), url=redis_url, prefix=prefix)
    assert table.returncode == 0 and "valid" in table.stdout and "5/hour" in table.stdout


async def test_push_show_and_a_follower_sees_it(
    rules_file: Path, tmp_path: Path, redis_url: str, prefix: str
) -> None:
    unconfirmed = cli("rules", "push", str(rules_file), url=redis_url, prefix=prefix)
    assert unconfirmed.returncode == 4, unconfirmed.stderr  # not at a terminal, no --yes
    assert "+" in unconfirmed.stdout  # the diff was shown
    assert cli("rules", "show", url=redis_url, prefix=prefix).returncode == 1  # nothing pushed
    pushed = cli("--json", "rules", "push", str(rules_file), "--yes", url=redis_url, prefix=prefix)
    assert pushed.returncode == 0, pushed.stderr
    version = json.loads(pushed.stdout)["version"]
    shown = cli("--json", "rules", "show", "--overrides", url=redis_url, prefix=prefix)
    assert shown.returncode == 0
    document = json.loads(shown.stdout)
    assert document["version"] == version
    assert document["identifier_overrides"]["user:vip"] == {"scale": 10.0}
    again = cli("--json", "rules", "push", str(rules_file), "--yes", url=redis_url, prefix=prefix)
    assert json.loads(again.stdout)["unchanged"] is True
    async with Limiter(redis_url, {"*": "1/hour"}, prefix=prefix, follow_rules=True) as limiter:
        assert [(await limiter.try_acquire("user:1")).allowed for _ in range(6)] == [True] * 5 + [
            False
        ]
        assert (await limiter.try_acquire("user:banned")).denied
        assert (await limiter.peek("user:vip")).remaining == 50
    # An invalid file changes nothing.
    bad = tmp_path / "bad.json"
    bad.write_text('{"kinds": {"user": "5/fortnight"}}')
    failed = cli("rules", "push", str(bad), "--yes", url=redis_url, prefix=prefix)
    assert failed.returncode == 1 and "kinds.user" in failed.stderr
    after = json.loads(cli("--json", "rules", "show", url=redis_url, prefix=prefix).stdout)
    assert after["version"] == version


async def test_inspect_and_reset(rules_file: Path, redis_url: str, prefix: str) -> None:
    assert (
        cli("rules", "push", str(rules_file), "--yes", url=redis_url, prefix=prefix).returncode == 0
    )
    async with Limiter(redis_url, {"*": "1/hour"}, prefix=prefix, follow_rules=True) as limiter:
        for _ in range(3):
            assert (await limiter.try_acquire("user:7")).allowed
    shown = cli("--json", "inspect", "user:7", "user:banned", url=redis_url, prefix=prefix)
    assert shown.returncode == 0, shown.stderr
    user, banned = json.loads(shown.stdout)["identifiers"]
    assert [(p["limit"], p["remaining"]) for p in user["pairs"]] == [(HOURLY, 2), (DAILY, 97)]
    assert user["keys"][0]["ttl_ms"] > 0 and user["keys"][0]["memory_bytes"] > 0
    assert banned["denied"] is True
    table = cli("inspect", "user:7", url=redis_url, prefix=prefix)
    assert "2 / 5" in table.stdout and "97 / 100" in table.stdout
    assert cli("reset", "user:7", url=redis_url, prefix=prefix).returncode == 4  # not confirmed
    assert cli("reset", "user:7", "--yes", url=redis_url, prefix=prefix).returncode == 0
    shown = cli("--json", "inspect", "user:7", url=redis_url, prefix=prefix)
    pairs = json.loads(shown.stdout)["identifiers"][0]["pairs"]
    assert [p["remaining"] for p in pairs] == [5, 100]
    # Without a rules document, inspect needs limits to judge by.
    other = prefix + "-empty"
    assert cli("inspect", "user:7", url=redis_url, prefix=other).returncode == 1
    with_limits = cli(
        "--json", "inspect", "user:7", "--limits", "3/minute", url=redis_url, prefix=other
    )
    assert json.loads(with_limits.stdout)["identifiers"][0]["pairs"][0]["remaining"] == 3


def test_bench_runs_a_short_load(redis_url: str, prefix: str) -> None:
    done = cli("--json", "bench", "--seconds", "0.5", "--concurrency", "8", "--identifiers", "50",
               url=redis_url, prefix=prefix)  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["decisions"] > 100 and summary["errors"] == 0
    assert summary["allowed"] + summary["refused"] == summary["decisions"]
    assert 0 < summary["p50_ms"] <= summary["p99_ms"]
    table = cli("bench", "--seconds", "0.3", url=redis_url, prefix=prefix)
    assert table.returncode == 0 and "decisions per second" in table.stdout


def test_an_unreachable_server_is_exit_3(prefix: str) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"redis://127.0.0.1:{port}/0"
    for args in (
        ("rules", "show"),
        ("inspect", "user:1", "--limits", "1/s"),
        ("bench", "--seconds", "0.2"),
    ):
        done = cli("--json", *args, url=url, prefix=prefix)
        assert done.returncode == 3, (args, done.stdout, done.stderr)
        assert json.loads(done.stdout)["exit_code"] == 3


def test_usage_errors_are_exit_2(redis_url: str, prefix: str) -> None:
    assert cli("inspect", url=redis_url, prefix=prefix).returncode == 2
    assert cli("bench", "--seconds", "-1", url=redis_url, prefix=prefix).returncode == 2
