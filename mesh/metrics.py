"""Prometheus metrics (``mesh_*``) on an app-owned registry, never the process-global one.

Two kinds of metric live here:
- event metrics (counters, histograms) updated through pre-bound children; those the request
  path writes are ``mesh.loop_metrics``' lock-free ones (``loop_counter``, ``loop_histogram``:
  written on the event loop's thread only), the others ``prometheus_client``'s;
- live gauges (in-flight, health, circuit state, ...) read from the owners' state at scrape time
  through collectors added with ``Metrics.add_collector``, so the hot path never writes them.

Other modules add their own metrics with ``metrics.counter(...)`` / ``metrics.histogram(...)`` /
``metrics.gauge(...)`` (same registry) or ``add_collector``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from mesh.loop_metrics import CounterChild, LoopCounter, LoopHistogram

LATENCY_BUCKETS = (0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
FAST_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# No ``*_created`` series (one per counter/histogram child: doubles the scrape for a timestamp
# no dashboard uses). Process-wide; the gateway owns its process.
disable_created_metrics()


class _FnCollector(Collector):
    def __init__(self, fn: Callable[[], Iterable[Metric]]) -> None:
        self._fn = fn

    def collect(self) -> Iterable[Metric]:
        return list(self._fn())

    def describe(self) -> Iterable[Metric]:
        return []


def _policy_fallbacks() -> list[Metric]:
    """``mesh_policy_fallbacks_total{reason}``: decisions a built-in made for a misbehaving plugin
    (``policies.guard``; process-wide, reasons a fixed set)."""
    from prometheus_client.core import CounterMetricFamily

    from policies.guard import FALLBACKS

    fam = CounterMetricFamily("mesh_policy_fallbacks", "Routing decisions or hooks of a policy plugin that raised or "
                              "chose no available candidate; a built-in policy answered", labels=["reason"])
    for reason, n in FALLBACKS.items():
        fam.add_metric([reason], n)
    return [fam]


def _remove_where(metric: Counter, label: str, values: set[str]) -> None:
    """Remove every child of ``metric`` whose ``label`` is in ``values`` (public API only)."""
    names = list(metric._labelnames)  # noqa: SLF001  (the names it was built with)
    doomed = set()
    for family in metric.collect():
        for sample in family.samples:
            if sample.labels.get(label) in values:
                doomed.add(tuple(sample.labels[n] for n in names))
    for labelvalues in doomed:
        try:
            metric.remove(*labelvalues)
        except KeyError:
            pass


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests_total = self.loop_counter(
            "mesh_requests_total", "Requests answered, by route and HTTP status", ["route", "status"]
        )
        self.request_latency = self.loop_histogram(
            "mesh_request_latency_seconds", "Gateway request latency until the last byte", ["route"]
        )
        self.ttfb = self.loop_histogram("mesh_ttfb_seconds", "Time to the first response byte from a worker", ["route"])
        self.retries_total = self.counter("mesh_retries_total", "Requests retried on another target", ["reason"])
        self.upstream_errors_total = self.counter(
            "mesh_upstream_errors_total", "Failed upstream attempts, by worker and kind", ["worker", "kind"]
        )
        self.stream_errors_total = self.counter(
            "mesh_stream_errors_total", "Streams ended with an error event after the first byte"
        )
        self.client_disconnects_total = self.counter(
            "mesh_client_disconnects_total", "Requests whose client went away before the end"
        )
        self.client_write_timeouts_total = self.counter(
            "mesh_client_write_timeouts_total",
            "Client connections dropped because a write to the client (or its buffered response) waited "
            "server.client_write_timeout_s",
        )
        self.routing_decision = self.loop_histogram(
            "mesh_routing_decision_seconds", "Time of one routing decision (policy + commit)", buckets=FAST_BUCKETS
        )
        self.prompt_seconds = self.loop_histogram(
            "mesh_prompt_processing_seconds", "Parse, render, tokenize and hash one request", buckets=FAST_BUCKETS
        )
        self.health_checks_total = self.counter(
            "mesh_health_checks_total", "Worker health checks, by worker and result", ["worker", "result"]
        )
        self.config_reloads_total = self.counter("mesh_config_reloads_total", "Config reloads", ["result"])
        # Prefix reuse, predicted by the router (its decision's overlap on the chosen target, in
        # tokens) vs reported by the worker (usage.prompt_tokens_details.cached_tokens); both are
        # counted only for answers that report it, so their ratio shows index drift.
        self.prefix_predicted_tokens_total = self.loop_counter(
            "mesh_prefix_predicted_tokens_total", "Cached prompt tokens the router predicted, by target", ["target"]
        )
        self.prefix_reported_tokens_total = self.loop_counter(
            "mesh_prefix_reported_tokens_total", "Cached prompt tokens the workers reported, by target", ["target"]
        )
        self._children: dict[tuple[str, int], CounterChild] = {}
        self.add_collector(_policy_fallbacks)

    # -- registration helpers for other modules --
    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(name, doc, list(labels), registry=self.registry)

    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        return Gauge(name, doc, list(labels), registry=self.registry)

    def histogram(
        self, name: str, doc: str, labels: Sequence[str] = (), buckets: Sequence[float] = LATENCY_BUCKETS
    ) -> Histogram:
        return Histogram(name, doc, list(labels), buckets=buckets, registry=self.registry)

    # The request path's metrics: written on the event loop's thread only (``mesh.loop_metrics``).
    def loop_counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> LoopCounter:
        metric = LoopCounter(name, doc, labels)
        self.registry.register(metric)
        return metric

    def loop_histogram(
        self, name: str, doc: str, labels: Sequence[str] = (), buckets: Sequence[float] = LATENCY_BUCKETS
    ) -> LoopHistogram:
        metric = LoopHistogram(name, doc, labels, buckets)
        self.registry.register(metric)
        return metric

    def add_collector(self, fn: Callable[[], Iterable[Metric]]) -> None:
        """``fn`` yields metric families at scrape time (live gauges read from their owner)."""
        self.registry.register(_FnCollector(fn))

    # -- hot path --
    def request_done(self, route: str, status: int) -> None:
        child = self._children.get((route, status))
        if child is None:
            child = self._children[(route, status)] = self.requests_total.labels(route, str(status))
        child.inc()

    # -- registry listener (``registry.add_listener(metrics)``): a removed worker's series leave --
    # Only the series written through ``.labels()`` at each use; ``mesh_prefix_*_tokens_total``
    # children are cached by the proxy per target, so removing them would orphan its cache.
    def on_worker_added(self, worker: object) -> None:
        return None

    def on_worker_removed(self, worker: object) -> None:
        self.on_workers_removed([worker])

    def on_workers_removed(self, workers: Iterable[object]) -> None:
        """Drop every series labelled with a removed worker: an autoscaler that names workers after
        pods (a new name each time) grew the registry by a few series per pod, for good."""
        names = {str(getattr(w, "name", w)) for w in workers}
        for metric in (self.health_checks_total, self.upstream_errors_total):
            _remove_where(metric, "worker", names)

    def render(self) -> bytes:
        return generate_latest(self.registry)
