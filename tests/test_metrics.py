"""Metrics read back as their users read them: OpenTelemetry's in-memory reader, and a
Prometheus scrape of a real HTTP endpoint. Real Redis; a stopped port for degraded ones."""

from __future__ import annotations

import logging
import socket
from typing import Any

import httpx
import prometheus_client
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client.parser import text_string_to_metric_families

from aiolimit import ConfigurationError, Limiter, RuleSet
from aiolimit.metrics import OpenTelemetryMetrics, PrometheusMetrics


def dead_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"redis://127.0.0.1:{port}/0"


RULES = RuleSet.from_mapping(
    {
        "kinds": {"user": "3/hour", "beta": {"limits": "1/hour", "shadow": True}},
        "deny": ["user:banned"],
    }
)


async def exercise(limiter: Limiter) -> None:
    for _ in range(5):  # 3 allowed, 2 refused
        await limiter.try_acquire("user:1")
    await limiter.try_acquire("user:banned")
    for _ in range(2):  # the second is a shadow refusal
        await limiter.try_acquire("beta:1")


def otel_points(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    found: dict[str, list[Any]] = {}
    data = reader.get_metrics_data()
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                found.setdefault(metric.name, []).extend(metric.data.data_points)
    return found


async def test_opentelemetry_counts_decisions_by_kind_outcome_and_limit(
    redis_url: str, prefix: str
) -> None:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    async with Limiter(
        redis_url, RULES, prefix=prefix, metrics=OpenTelemetryMetrics(provider)
    ) as limiter:
        await exercise(limiter)
        points = otel_points(reader)
    decisions = {
        (p.attributes["kind"], p.attributes["outcome"], p.attributes["limit"]): p.value
        for p in points["aiolimit.decisions"]
    }
    assert decisions == {
        ("user", "allowed", "3/1h"): 3,
        ("user", "refused", "3/1h"): 2,
        ("user", "denied", "none"): 1,
        # beta is in shadow: its decisions name no enforced limit (one had room, one was
        # admitted although the shadow rule refused), and count under its kind.
        ("beta", "allowed", "none"): 2,
    }
    durations = {p.attributes["outcome"]: p for p in points["aiolimit.decision.duration"]}
    assert durations["allowed"].count == 5 and durations["refused"].count == 2
    assert 0 < durations["allowed"].sum < 5
    assert [p.value for p in points["aiolimit.shadow_refusals"]] == [1]
    assert [p.value for p in points["aiolimit.breaker.state"]] == [0]
    assert [p.value for p in points["aiolimit.refusal_cache.hits"]] == [0]
    provider.shutdown()


async def test_opentelemetry_degraded_decisions_and_open_breaker(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="aiolimit")
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    async with Limiter(
        dead_url(), {"user": "3/hour"}, on_error="open", failure_threshold=2, deadline=0.2,
        metrics=OpenTelemetryMetrics(provider),
    ) as limiter:  # fmt: skip
        for _ in range(4):
            assert (await limiter.try_acquire("user:1")).degraded
        points = otel_points(reader)
    outcomes = {p.attributes["outcome"]: p.value for p in points["aiolimit.decisions"]}
    assert outcomes == {"degraded_allowed": 4}
    assert [p.value for p in points["aiolimit.breaker.state"]] == [2]
    degraded_logs = [r for r in caplog.records if "aiolimit degraded" in r.getMessage()]
    assert len(degraded_logs) == 1  # four degraded decisions, one line
    assert degraded_logs[0].aiolimit_event == "degraded"  # type: ignore[attr-defined]
    provider.shutdown()


async def test_prometheus_scrape_over_http(redis_url: str, prefix: str) -> None:
    registry = prometheus_client.CollectorRegistry()
    server, thread = prometheus_client.start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        port = server.server_address[1]
        async with Limiter(
            redis_url, RULES, prefix=prefix, metrics=PrometheusMetrics(registry)
        ) as limiter:
            await exercise(limiter)
            async with httpx.AsyncClient() as client:
                scraped = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(scraped)
        for s in family.samples
    }
    key = (("kind", "user"), ("limit", "3/1h"), ("outcome", "allowed"))
    assert samples[("aiolimit_decisions_total", key)] == 3
    refused = (("kind", "user"), ("limit", "3/1h"), ("outcome", "refused"))
    assert samples[("aiolimit_decisions_total", refused)] == 2
    assert samples[("aiolimit_decision_duration_seconds_count", (("outcome", "allowed"),))] == 5
    assert samples[("aiolimit_shadow_refusals_total", (("kind", "beta"),))] == 1
    assert samples[("aiolimit_breaker_state", ())] == 0
    assert samples[("aiolimit_rules_reloads_total", ())] == 0


def test_metrics_must_be_a_metrics_object(redis_url: str) -> None:
    with pytest.raises(ConfigurationError, match="metrics must be"):
        Limiter(redis_url, {"user": "1/s"}, metrics=object())  # type: ignore[arg-type]
