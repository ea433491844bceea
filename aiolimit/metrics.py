"""Metrics: what the limiter decides, for OpenTelemetry or for ``prometheus_client``.

Off by default, and free when off (the limiter checks one attribute). Turn on with
``Limiter(..., metrics=OpenTelemetryMetrics())`` (``pip install 'aiolimit-redis[otel]'``) or
``Limiter(..., metrics=PrometheusMetrics())`` (``pip install 'aiolimit-redis[prometheus]'``).
One metrics object may serve several limiters; its observed values add theirs up.

Instruments (OpenTelemetry names; Prometheus replaces the dots by ``_``, counters end in
``_total``):

======================================  =========  ========================================
``aiolimit.decisions``                  counter    by ``kind``, ``outcome``, ``limit``
``aiolimit.decision.duration``          histogram  seconds per decision, by ``outcome``
``aiolimit.shadow_refusals``            counter    admitted although a shadow rule refused,
                                                   by ``kind``
``aiolimit.breaker.state``              gauge      0 closed, 1 half open, 2 open
``aiolimit.compensations``              counter    two-phase commits undone (cluster)
``aiolimit.refusal_cache.hits``         counter    refusals answered by the local cache
``aiolimit.rules.reloads``              counter    rules replaced (``follow_rules``)
======================================  =========  ========================================

``outcome`` is ``allowed``, ``refused``, ``denied`` (deny list), ``degraded_allowed`` or
``degraded_refused`` (the store failed and ``on_error`` decided). ``kind`` is the binding
pair's identifier kind as the rules name it (a kind without a rule of its own counts as
``*``, so a client cannot create label values), ``limit`` the binding limit: ``100/1m`` for a
sliding window, the algorithm and its parameters for the others (``100/1m sliding_log``,
``10/1s token_bucket burst 50``, ``min_interval 2s``, ``concurrency 5 lease 1m``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from aiolimit._algorithms import Concurrency, FixedWindow, MinInterval, SlidingLog, TokenBucket
from aiolimit._decision import Decision
from aiolimit._errors import ConfigurationError
from aiolimit._limits import BaseLimit, Limit

if TYPE_CHECKING:
    from aiolimit._limiter import Limiter

__all__ = ["Metrics", "OpenTelemetryMetrics", "PrometheusMetrics"]

#: Decision latency buckets in seconds (a decision takes 0.1-2 ms on a healthy store).
BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_BREAKER = {"closed": 0, "half_open": 1, "open": 2}
#: Label sets kept at most (kinds x outcomes x limits is small; overrides can add limits).
MAX_SERIES = 2000


def outcome(decision: Decision) -> str:
    if decision.denied:
        return "denied"
    if decision.degraded:
        return "degraded_allowed" if decision.allowed else "degraded_refused"
    return "allowed" if decision.allowed else "refused"


def _limit_text(decision: Decision) -> str:
    limit = decision.limit
    if limit is None:
        return "none"
    return limit_label(limit)


def limit_label(limit: BaseLimit) -> str:
    """The ``limit`` label: distinct for every distinct limit (algorithm and parameters),
    short for the common sliding window (``100/1m``)."""
    if isinstance(limit, Limit):
        text = f"{limit.amount}/{_seconds(limit.per)}"
        if limit.precision is not None and limit.precision != limit.per:
            text += f" precision {_seconds(limit.precision)}"
        return text
    if isinstance(limit, FixedWindow):
        return f"{limit.amount}/{_seconds(limit.per)} fixed_window"
    if isinstance(limit, SlidingLog):
        return f"{limit.amount}/{_seconds(limit.per)} sliding_log"
    if isinstance(limit, TokenBucket):
        return f"{limit.rate}/{_seconds(limit.per)} token_bucket burst {limit.amount}"
    if isinstance(limit, MinInterval):
        return f"min_interval {_seconds(limit.seconds)}"
    if isinstance(limit, Concurrency):
        return f"concurrency {limit.max} lease {_seconds(limit.lease_ttl)}"
    return str(limit)  # pragma: no cover - every limit type aiolimit ships is named above


def _seconds(per: float) -> str:
    for size, unit in ((86400, "d"), (3600, "h"), (60, "m")):
        if per >= size and per % size == 0:
            return f"{int(per // size)}{unit}"
    return f"{per:g}s"


class Metrics:
    """What a limiter reports to; subclass to send the numbers anywhere else."""

    def __init__(self) -> None:
        self._limiters: list[Limiter] = []
        # Counted here, read when the exporter collects: a dict increment per decision
        # instead of a synchronous instrument call (measured: ~5 µs each on the OTel SDK).
        self._labels: dict[tuple[str, str, Any], list[Any]] = {}
        # Series by label text: limits that print alike (if any) share one series, never
        # two samples with one label set.
        self._series: dict[tuple[str, str, str], list[Any]] = {}
        self._shadow_counts: dict[str, int] = {}

    def bind(self, limiter: Limiter) -> None:
        """Called by the limiter that takes this object (for the observed values)."""
        self._limiters.append(limiter)

    def unbind(self, limiter: Limiter) -> None:
        if limiter in self._limiters:
            self._limiters.remove(limiter)

    def record(self, decision: Decision, seconds: float, kind: str) -> None:
        """One decision, ``seconds`` long, bound by an identifier of rule kind ``kind``."""
        key = (kind, outcome(decision), decision.limit)
        entry = self._labels.get(key)
        if entry is None:
            if len(self._labels) >= MAX_SERIES:
                key = (kind, key[1], None)  # past the bound, limits fold into "other"
                entry = self._labels.get(key)
            if entry is None:
                limit = "other" if key[2] is None and decision.limit is not None else (
                    _limit_text(decision)
                )  # fmt: skip
                entry = self._series.get((kind, key[1], limit))
                if entry is None:
                    entry = [0, {"kind": kind, "outcome": key[1], "limit": limit},
                             {"outcome": key[1]}]  # fmt: skip
                    self._series[(kind, key[1], limit)] = entry
                self._labels[key] = entry
        entry[0] += 1
        self.observe(seconds, entry[2])
        if decision.shadow_refusals:
            self._shadow_counts[kind] = self._shadow_counts.get(kind, 0) + 1

    def observe(self, seconds: float, labels: dict[str, str]) -> None:
        """The decision's duration (the exporters' histograms)."""

    def decision_counts(self) -> list[tuple[int, dict[str, str]]]:
        return [(entry[0], entry[1]) for entry in list(self._series.values())]

    def shadow_counts(self) -> list[tuple[int, dict[str, str]]]:
        return [(count, {"kind": kind}) for kind, count in list(self._shadow_counts.items())]

    # -- observed from the limiters' statistics -------------------------------------------

    def _statistics(self) -> Iterator[Any]:
        for limiter in list(self._limiters):
            yield limiter.statistics()

    def breaker_state(self) -> int:
        return max((_BREAKER[s.breaker.state] for s in self._statistics()), default=0)

    def compensations(self) -> int:
        return sum(s.compensations for s in self._statistics())

    def cache_hits(self) -> int:
        return sum(s.cached_refusals for s in self._statistics())

    def rules_reloads(self) -> int:
        return sum(s.rules_reloads for s in self._statistics())


class OpenTelemetryMetrics(Metrics):
    """Instruments on an OpenTelemetry meter (the global provider's unless one is given).

    ``latency=False`` leaves out the duration histogram, the one instrument recorded per
    decision (the counters are counted locally and observed at collection).
    """

    def __init__(self, meter_provider: Any = None, *, latency: bool = True) -> None:
        super().__init__()
        try:
            from opentelemetry import metrics as otel
            from opentelemetry.metrics import Observation
        except ImportError as exc:  # pragma: no cover - depends on what is installed
            raise ConfigurationError(
                "OpenTelemetryMetrics needs opentelemetry-api: pip install 'aiolimit-redis[otel]'"
            ) from exc
        from aiolimit import __version__

        provider = meter_provider if meter_provider is not None else otel.get_meter_provider()
        meter = provider.get_meter("aiolimit", __version__)

        def many(read: Any) -> Any:
            return lambda options: [Observation(value, labels) for value, labels in read()]

        def one(read: Any) -> Any:
            return lambda options: [Observation(read())]

        meter.create_observable_counter(
            "aiolimit.decisions", [many(self.decision_counts)], unit="{decision}",
            description="Rate-limit decisions",
        )  # fmt: skip
        self._duration = (
            meter.create_histogram(
                "aiolimit.decision.duration",
                unit="s",
                description="Time to decide",
                explicit_bucket_boundaries_advisory=list(BUCKETS),
            )
            if latency
            else None
        )
        meter.create_observable_counter(
            "aiolimit.shadow_refusals", [many(self.shadow_counts)], unit="{decision}",
            description="Admitted although a shadow rule refused",
        )  # fmt: skip
        meter.create_observable_gauge(
            "aiolimit.breaker.state", [one(self.breaker_state)],
            description="Circuit breaker: 0 closed, 1 half open, 2 open",
        )  # fmt: skip
        meter.create_observable_counter(
            "aiolimit.compensations", [one(self.compensations)],
            description="Two-phase commits undone",
        )  # fmt: skip
        meter.create_observable_counter(
            "aiolimit.refusal_cache.hits", [one(self.cache_hits)],
            description="Refusals answered by the local refusal cache",
        )  # fmt: skip
        meter.create_observable_counter(
            "aiolimit.rules.reloads", [one(self.rules_reloads)],
            description="Rules replaced while following the rules in Redis",
        )  # fmt: skip

    def observe(self, seconds: float, labels: dict[str, str]) -> None:
        if self._duration is not None:
            self._duration.record(seconds, labels)


class PrometheusMetrics(Metrics):
    """Collectors on a ``prometheus_client`` registry (its default registry unless given).

    Serve them as you serve your other metrics (``prometheus_client.start_http_server``,
    ``make_asgi_app``, ``generate_latest``). ``latency=False`` leaves out the histogram.
    """

    def __init__(self, registry: Any = None, *, latency: bool = True) -> None:
        super().__init__()
        try:
            import prometheus_client as prom
        except ImportError as exc:  # pragma: no cover - depends on what is installed
            raise ConfigurationError(
                "PrometheusMetrics needs prometheus-client: "
                "pip install 'aiolimit-redis[prometheus]'"
            ) from exc
        registry = prom.REGISTRY if registry is None else registry
        self._duration = (
            prom.Histogram(
                "aiolimit_decision_duration_seconds",
                "Time to decide",
                ["outcome"],
                buckets=BUCKETS,
                registry=registry,
            )
            if latency
            else None
        )
        self._children: dict[str, Any] = {}
        registry.register(_Observed(self))

    def observe(self, seconds: float, labels: dict[str, str]) -> None:
        if self._duration is None:
            return
        result = labels["outcome"]
        child = self._children.get(result)
        if child is None:
            child = self._children[result] = self._duration.labels(result)
        child.observe(seconds)


class _Observed:
    """The values read from the limiters at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        metrics = self._metrics
        decisions = CounterMetricFamily(
            "aiolimit_decisions", "Rate-limit decisions", labels=["kind", "outcome", "limit"]
        )
        for value, labels in metrics.decision_counts():
            decisions.add_metric([labels["kind"], labels["outcome"], labels["limit"]], value)
        yield decisions
        shadow = CounterMetricFamily(
            "aiolimit_shadow_refusals", "Admitted although a shadow rule refused", labels=["kind"]
        )
        for value, labels in metrics.shadow_counts():
            shadow.add_metric([labels["kind"]], value)
        yield shadow
        yield GaugeMetricFamily(
            "aiolimit_breaker_state",
            "Circuit breaker: 0 closed, 1 half open, 2 open",
            value=metrics.breaker_state(),
        )
        yield CounterMetricFamily(
            "aiolimit_compensations", "Two-phase commits undone", value=metrics.compensations()
        )
        yield CounterMetricFamily(
            "aiolimit_refusal_cache_hits",
            "Refusals answered by the local refusal cache",
            value=metrics.cache_hits(),
        )
        yield CounterMetricFamily(
            "aiolimit_rules_reloads",
            "Rules replaced while following the rules in Redis",
            value=metrics.rules_reloads(),
        )
