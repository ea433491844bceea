"""The benchmark keeps running: every contender, a few decisions, on the test server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

from bench import bench
from bench._measure import Measurement, percentile


def test_bench_runs_every_contender_and_cleans_up(redis_url: str, tmp_path: Path) -> None:
    """A tiny 1x1 + 2x3 run measures all four libraries and leaves no key behind."""
    report_path = tmp_path / "report.json"
    argv = ["--redis-url", redis_url, "--count", "16", "--concurrency", "4", "--rounds", "1"]
    argv += ["--warmup", "0.05", "--quiet", "--memory", "--json", str(report_path)]
    assert bench.main(argv) == 0

    report = json.loads(report_path.read_text())
    assert [(r["ids"], len(r["limits"])) for r in report["results"]] == [(1, 1), (2, 3)]
    for result in report["results"]:
        for name in ("aiolimit", "limits", "pyrate", "throttled"):
            outcome = result["contenders"][name]
            assert outcome["status"] == "ok", (name, outcome["status"])
            assert outcome["decisions"] == 16 and outcome["errors"] == 0, (name, outcome)
            assert outcome["admitted"] == 16, (name, outcome)
            assert outcome["commands_per_decision"] > 0, (name, outcome)
        # aiolimit decides every pair in one script call on a standalone server, and
        # concurrent decisions share pipelines: at most one round trip each.
        assert 0 < result["contenders"]["aiolimit"]["round_trips_per_decision"] <= 1.0
    for row in report["memory"]:
        assert row.get("status", "ok") == "ok" and row["bytes"] > 0, row
        assert row["admitted"] == 240 and row["next_refused"], row

    client = redis.Redis.from_url(redis_url)
    try:
        assert list(client.scan_iter(match="bench-*", count=1000)) == []
    finally:
        client.close()


def test_server_time_counts_script_commands_once() -> None:
    """Commands run inside a script are in its usec already; only client-sent ones add."""
    measurement = Measurement(
        decisions=10,
        client_commands={"evalsha": 10, "get": 5},
        # 10 EVALSHA (their usec includes the 20 HGETALL they ran) and 15 GET, 5 of them sent
        # by the client and 10 run by scripts.
        server={"evalsha": (10, 300), "hgetall": (20, 100), "get": (15, 30), "info": (2, 50)},
    )
    assert measurement.server_us_per_decision == (300 + 30 * 5 / 15) / 10
    assert measurement.server_us_per_call == 30.0
    assert measurement.commands_per_decision == 1.5
    assert measurement.server_commands_per_decision == 4.5


def test_percentile_is_nearest_rank() -> None:
    """p50 of 1..100 is 50, p99 is 99, p100 the maximum."""
    values = list(range(1, 101))
    assert [percentile(values, q) for q in (50, 99, 100)] == [50, 99, 100]


def test_rules_scale_and_middleware_cpu_benches_run(capsys: pytest.CaptureFixture[str]) -> None:
    """The two operations benches run to the end on tiny counts (they start their own server)."""
    from bench import middleware_cpu, rules_scale

    assert rules_scale.main(["--overrides", "300", "--decisions", "50"]) == 0
    assert middleware_cpu.main(["--requests", "50", "--rounds", "1"]) == 0
    printed = capsys.readouterr().out
    assert "300 overrides" in printed and "behind RateLimitMiddleware" in printed
    assert "with prefetch=256" in printed and "decision and fields alone" in printed


def test_script_cost_measures_each_scenario_of_two_libraries(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """bench.script_cost on this tree's scripts twice (an A/B of a tree against itself): a
    figure for every scenario and library, and a ratio."""
    from bench import script_cost

    scripts = str(Path(__file__).resolve().parents[1] / "lua")
    assert (
        script_cost.main(["--rounds", "1", "--count", "40", "--lua", scripts, "--lua", scripts])
        == 0
    )
    lines = capsys.readouterr().out.splitlines()[1:]
    assert [line.split()[0] for line in lines] == [
        "check", "acquire+op", "acquire+16", "2x3+op", "many", "many", "many", "many", "fleet",
        "lease", "floor",
    ]  # fmt: skip
    assert "best" in lines[-1]
    for line in lines[:-1]:
        assert line.count("best") == 2 and "second/first" in line, line


def test_failover_bench_compares_stored_charges_with_admissions() -> None:
    """bench.failover on a 3+3 cluster it starts (a primary killed, no full coverage): the
    healthy shard stores exactly what it admitted, the dead one never more, and the stall is
    timed from a decision sent after the kill (so it includes the replica's promotion)."""
    import asyncio
    import math

    from bench import failover

    result = asyncio.run(failover.measure(1000, full_coverage=False))
    assert result["healthy_over_charged"] == 0, result
    assert result["doomed_over_charged"] <= 0, result
    assert result["healthy_errors"] == 0 and result["doomed_errors"] == 0, result
    assert not math.isnan(result["stall_s"]) and result["stall_s"] >= 0.5, result


def test_client_ab_compares_two_trees(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """bench.client_ab runs each tree in a child process of its own and prints their ratio
    (here this checkout against itself, a few decisions)."""
    from bench import client_ab

    here = str(Path(__file__).resolve().parent.parent)
    argv = ["--tree", here, "--tree", here, "--shape", "1x1", "--rounds", "1"]
    argv += ["--concurrency", "2", "--count", "5", "--redis-url", redis_url]
    assert client_ab.main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("cpu µs/dec best") == 2 and "second/first (median cpu):" in out


def test_web_bench_times_the_middleware_in_situ() -> None:
    """bench/web_bench.py on one FastAPI row, briefly: every request answered 200, and the
    in-situ table gives the middleware's own time less the timing's (both positive, and well
    under a whole request's CPU)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    argv = [sys.executable, str(root / "bench" / "web_bench.py"), "--seconds", "0.3"]
    argv += ["--rounds", "1", "--variants", "fastapi-aiolimit-prefetch"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    first, _, second = done.stdout.partition("timed in situ")
    rows = {line.split()[0]: line.split() for line in first.splitlines() if line.strip()}
    # (A bare row has no "vs bare" column: its non-200 count is one column to the left.)
    assert rows["fastapi"][3] == "0" and rows["fastapi-aiolimit-prefetch"][4] == "0"
    timed = [line.split() for line in second.splitlines()]
    own_row = next(row for row in timed if row and row[0] == "fastapi-aiolimit-prefetch")
    measured, timing, own = (float(value) for value in own_row[1:4])
    bare_cpu = float(rows["fastapi"][4])
    assert 0 < timing < measured < bare_cpu, own_row
    assert own == round(measured - timing, 2) or abs(own - (measured - timing)) < 0.02
