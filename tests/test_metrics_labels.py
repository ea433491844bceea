"""Metrics labels: every distinct limit is its own series, and no two series of one scrape
share a label set (Prometheus would drop one: counts lost)."""

from __future__ import annotations

import collections
from typing import Any

import prometheus_client
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client.parser import text_string_to_metric_families

from aiolimit import Limiter, RuleSet
from aiolimit.metrics import OpenTelemetryMetrics, PrometheusMetrics

#: Limits that all print as "2 per minute" one way or another.
ALIKE: dict[str, Any] = {
    "user:window": "2/minute",
    "user:fixed": [{"type": "fixed_window", "amount": 2, "per": 60}],
    "user:log": [{"type": "sliding_log", "amount": 2, "per": 60}],
    "user:bucket": [{"type": "token_bucket", "rate": 2, "per": 60, "burst": 2}],
    "user:burst": [{"type": "token_bucket", "rate": 2, "per": 60, "burst": 5}],
    "user:precise": [{"type": "window", "amount": 2, "per": 60, "precision": 6}],
    "user:lease": [{"type": "concurrency", "max": 2}],
    "user:apart": [{"type": "min_interval", "seconds": 30}],
}
#: Enough to be refused under each (burst 5 included).
TRIES = 6
RULES = RuleSet.from_mapping(
    {
        "kinds": {"user": "100/minute"},
        "overrides": {identifier: {"limits": limits} for identifier, limits in ALIKE.items()},
    }
)


async def exercise(limiter: Limiter) -> None:
    for identifier in ALIKE:
        for _ in range(TRIES):
            decision = await limiter.try_acquire(identifier)  # leases are left to expire
            assert decision.identifier == identifier or decision.allowed


async def test_a_prometheus_scrape_has_one_sample_per_label_set() -> None:
    registry = prometheus_client.CollectorRegistry()
    async with Limiter("memory://", RULES, metrics=PrometheusMetrics(registry)) as limiter:
        await exercise(limiter)
    text = prometheus_client.generate_latest(registry).decode()
    samples = collections.Counter(
        tuple(sorted(sample.labels.items()))
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "aiolimit_decisions_total"
    )
    assert samples and max(samples.values()) == 1, text
    refused = {dict(labels)["limit"] for labels in samples if dict(labels)["outcome"] == "refused"}
    assert len(refused) == len(ALIKE), refused  # each limit refused under a label of its own
    assert "2/1m" in refused  # the plain window keeps its short label


async def test_opentelemetry_has_one_point_per_attribute_set() -> None:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    async with Limiter("memory://", RULES, metrics=OpenTelemetryMetrics(provider)) as limiter:
        await exercise(limiter)
        data = reader.get_metrics_data()
    points = [
        point
        for resource in data.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
        if metric.name == "aiolimit.decisions"
        for point in metric.data.data_points
    ]
    attributes = collections.Counter(tuple(sorted(p.attributes.items())) for p in points)
    assert attributes and max(attributes.values()) == 1, attributes
    assert sum(p.value for p in points) == TRIES * len(ALIKE)
    refused = {p.attributes["limit"] for p in points if p.attributes["outcome"] == "refused"}
    assert len(refused) == len(ALIKE), refused
    provider.shutdown()
