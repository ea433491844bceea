"""The cluster benchmark keeps running, and its figures show aiolimit's routing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import cluster_bench

pytestmark = pytest.mark.cluster


def test_cluster_bench_runs_and_routes_as_designed(
    redis_cluster_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A tiny run measures every contender (the ceiling client too) in both layouts without
    errors, and says how aiolimit stands against the targets and the ceiling; one decision at a
    time, aiolimit sends one write per decision when the identifiers share a slot, and a check
    and a commit to each of the two primaries when they do not (concurrent decisions share
    those writes: see test_cluster_store)."""
    report_path = tmp_path / "cluster.json"
    argv = ["--redis-url", redis_cluster_url, "--count", "32", "--concurrency", "1"]
    argv += ["--rounds", "1", "--warmup", "0.05", "--id-pool", "2", "--json", str(report_path)]
    assert cluster_bench.main(argv) == 0
    report = json.loads(report_path.read_text())
    assert [result["scenario"] for result in report["results"]] == list(cluster_bench.SCENARIOS)
    for result in report["results"]:
        assert set(result["contenders"]) == set(cluster_bench.CONTENDERS)  # (ceiling included)
        for name, outcome in result["contenders"].items():
            assert outcome["status"] == "ok", (name, outcome["status"])
            assert outcome["decisions"] == 32 and outcome["errors"] == 0, (name, outcome)
    one_slot, two_primaries = (r["contenders"]["aiolimit"] for r in report["results"])
    # (A connection opened mid-run adds a handshake write or two; hence round().)
    assert round(one_slot["round_trips_per_decision"]) == 1
    assert round(two_primaries["round_trips_per_decision"]) == 4
    printed = capsys.readouterr().out
    assert "two primaries: aiolimit client CPU" in printed
    assert "two primaries: aiolimit makes" in printed and "of the ceiling client's" in printed
