"""The registry's series on the gateway's ``/metrics``: per-target load, per-worker health,
circuit and draining, and what each worker's own ``/metrics`` reported.

Read-only: built from the workers at each collection, never cached. A value that is unknown
(no scrape has read it, or it went stale) has no series, rather than a 0 that reads as "idle".
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from mesh.cluster.worker import Worker
from mesh.cluster.worker_metrics import METRICS_RESULTS


def worker_families(workers: Iterable[Worker]) -> list[Metric]:
    """Every family of the registry, for ``WorkerRegistry.metric_families``."""
    workers = list(workers)
    in_flight = GaugeMetricFamily("mesh_worker_in_flight", "In-flight requests per target", labels=["target"])
    prefill = GaugeMetricFamily("mesh_worker_prefill_tokens", "Queued prefill tokens per target", labels=["target"])
    decode = GaugeMetricFamily("mesh_worker_decode_tokens", "Decoding context tokens per target", labels=["target"])
    sessions = GaugeMetricFamily("mesh_worker_live_sessions", "Session bindings per target", labels=["target"])
    healthy = GaugeMetricFamily("mesh_worker_healthy", "1 when the worker passes health checks", labels=["worker"])
    circuit = GaugeMetricFamily("mesh_circuit_open", "1 when the worker's circuit breaker is open", labels=["worker"])
    draining = GaugeMetricFamily("mesh_worker_draining", "1 when the worker is draining", labels=["worker"])
    for w in workers:
        healthy.add_metric([w.name], 1.0 if w.healthy else 0.0)
        circuit.add_metric([w.name], 1.0 if w.breaker.is_open else 0.0)
        draining.add_metric([w.name], 1.0 if w.draining else 0.0)
        for t in w.targets:
            in_flight.add_metric([t.id], t.in_flight)
            prefill.add_metric([t.id], t.prefill_tokens)
            decode.add_metric([t.id], t.decode_tokens)
            sessions.add_metric([t.id], t.live_sessions)
    return [in_flight, prefill, decode, sessions, healthy, circuit, draining, *reported_families(workers)]


def reported_families(workers: Iterable[Worker]) -> list[Metric]:
    """What the gateway believes of each worker's own load (its /metrics); unknown: no series."""
    usage = GaugeMetricFamily("mesh_worker_kv_usage", "KV usage (0-1) the worker reported, per target", labels=["target"])
    capacity = GaugeMetricFamily("mesh_worker_kv_capacity_blocks", "KV capacity the worker reported, in the "
                                 "gateway's blocks, per target", labels=["target"])
    running = GaugeMetricFamily("mesh_worker_reported_running", "Running requests the worker reported, per target",
                                labels=["target"])
    waiting = GaugeMetricFamily("mesh_worker_reported_waiting", "Waiting requests the worker reported, per target",
                                labels=["target"])
    age = GaugeMetricFamily("mesh_worker_metrics_age_seconds", "Seconds since the worker's /metrics last gave load "
                            "signals", labels=["worker"])
    scrapes = CounterMetricFamily("mesh_worker_metrics_scrapes", "Scrapes of workers' /metrics, by outcome",
                                  labels=["worker", "result"])
    now = time.monotonic()
    for w in workers:
        if w.metrics_ok_at:
            age.add_metric([w.name], now - w.metrics_ok_at)
        for result in METRICS_RESULTS:
            if result in w.metrics_counts:
                scrapes.add_metric([w.name, result], w.metrics_counts[result])
        for t, load in zip(w.targets, w.reported, strict=False):
            if load is None:
                continue
            if load.kv_usage is not None:
                usage.add_metric([t.id], t.kv_usage)
            if t.kv_capacity_blocks:
                capacity.add_metric([t.id], t.kv_capacity_blocks)
            if load.num_running is not None:
                running.add_metric([t.id], load.num_running)
            if load.num_waiting is not None:
                waiting.add_metric([t.id], load.num_waiting)
    return [usage, capacity, running, waiting, age, scrapes]
