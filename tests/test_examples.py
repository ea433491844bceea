"""The demos in examples/ run against a real Redis and show what they promise: they cannot rot."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def load_web_demo() -> ModuleType:
    spec = importlib.util.spec_from_file_location("web_demo", EXAMPLES / "web_demo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_demo_runs_and_refuses_the_scraper(redis_url: str) -> None:
    """``bash dev.sh demo``'s script, shortened: the table shows refusals, then HTTP 429s."""
    env = {**os.environ, "REDIS_URL": redis_url, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, str(EXAMPLES / "demo.py"), "--seconds", "1"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "notice" not in out  # it used the Redis it was given, not memory://
    row = re.search(r"^user:eve\s+(\d+)\s+(\d+)\s+(.*)$", out, re.MULTILINE)
    assert row is not None, out
    attempts, admitted = int(row[1]), int(row[2])
    assert 0 < admitted < attempts and "refused" not in row[3] and "/second" in row[3]
    assert "--- over HTTP ---" in out
    assert re.search(r"^429 /hello$", out, re.MULTILINE), out
    assert re.search(r"^\s+RateLimit-Policy: \"ip-5-per-10s\";q=5;w=10", out, re.MULTILINE)
    assert re.search(r"^\s+Retry-After: \d+$", out, re.MULTILINE)
    assert "--- Redis Cluster" in out and "killed the primary" in out
    pair = re.search(r"^(\S+)\+(\S+): (\d+) admitted", out, re.MULTILINE)
    stored = re.search(r"stored now: \S+ (\d+), \S+ (\d+) \(admitted (\d+)\)", out)
    assert pair and stored, out
    assert int(stored[1]) == int(stored[2]) == int(stored[3]) == int(pair[3]) > 0


async def test_web_demo_answers_429_with_headers(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The web demo alone: real HTTP through FastAPI, RateLimit fields, 429s, an exempt route."""
    await load_web_demo().run_web_demo(redis_url)
    out = capsys.readouterr().out
    statuses = re.findall(r"^(\d{3}) (/\w+)$", out, re.MULTILINE)
    assert ("429", "/report") in statuses and ("200", "/health") in statuses
    assert statuses.count(("200", "/report")) == 2
    assert "violated ['report-2-per-60s']" in out
    assert re.search(r"^\s+RateLimit: \"report-2-per-60s\";r=0;t=\d+$", out, re.MULTILINE)


async def test_outgoing_api_example_stays_within_the_third_partys_quota(redis_url: str) -> None:
    """examples/outgoing_api.py: 12 calls to a server that answers 429 past 5/s all get 200,
    because @limiter.limited spaces them (about 2 s of waiting)."""
    spec = importlib.util.spec_from_file_location("outgoing_api", EXAMPLES / "outgoing_api.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    statuses = await module.run(redis_url, calls=12)
    assert statuses == [200] * 12


async def test_cluster_failover_example_keeps_counts_exact_through_a_killed_primary() -> None:
    """examples/cluster_failover.py: decisions across two slots go on after their primary is
    killed; what is stored equals what was admitted; the other shard keeps deciding, every
    decision of it admitted. (With Redis' default ``cluster-require-full-coverage yes`` every
    primary answers CLUSTERDOWN from the moment the dead one is marked failed until its replica
    is promoted, 0.6-1.4 s here, longer than the demo's 0.5 s deadline: one decision of the
    other shard failed in about three runs of four.)"""
    spec = importlib.util.spec_from_file_location(
        "cluster_failover", EXAMPLES / "cluster_failover.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    counts = await module.run_cluster_demo(seconds=3.5)
    assert counts["admitted"] > 0 and counts["failed"] > 0  # the kill was felt, then survived
    assert counts["stored_first"] == counts["stored_second"] == counts["admitted"]
    assert counts["bystander_admitted"] > 0
    assert counts["bystander_failed"] == 0


async def test_aiohttp_example_limits_with_route_weights_and_one_field_set(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """examples/aiohttp_app.py: /search costs 5 of 10, five more requests pass, the next is a
    429 with Retry-After, /health is exempt; every limited response carries one field set."""
    spec = importlib.util.spec_from_file_location("aiohttp_app", EXAMPLES / "aiohttp_app.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    seen = await module.run_aiohttp_demo(redis_url)
    assert [status for _, status in seen] == [200] * 6 + [429, 200]
    out = capsys.readouterr().out
    assert out.count("RateLimit-Policy:") == 7  # once per limited response, never on /health
    assert out.count("Retry-After: ") == 1


def test_the_example_rules_file_is_valid() -> None:
    """examples/rules.toml (the README's rules format) reads without an error."""
    from aiolimit import RuleSet

    rules = RuleSet.from_file(Path(__file__).resolve().parent.parent / "examples" / "rules.toml")
    assert set(rules.kinds) == {"ip", "*", "user", "api"}
    assert rules.shadow_kinds == {"api"}
    assert rules.override_for("ip:10.1.2.3") is not None
    assert rules.override_for("ip:203.0.113.9").deny  # type: ignore[union-attr]
