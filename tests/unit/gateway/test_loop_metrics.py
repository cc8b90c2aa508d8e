"""``mesh.loop_metrics`` against ``prometheus_client`` as the oracle: the same updates expose the
same samples (names, labels, ``le`` bounds, cumulative counts, sums)."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from mesh.loop_metrics import LoopCounter, LoopHistogram
from mesh.metrics import FAST_BUCKETS, LATENCY_BUCKETS


def exposed(registry: CollectorRegistry) -> list[str]:
    return sorted(generate_latest(registry).decode().splitlines())


@pytest.mark.parametrize("buckets", [LATENCY_BUCKETS, FAST_BUCKETS])
def test_histograms_expose_what_prometheus_client_would(buckets: tuple[float, ...]) -> None:
    oracle, mine = CollectorRegistry(), CollectorRegistry()
    theirs = Histogram("h_seconds", "doc", ["route"], buckets=buckets, registry=oracle)
    ours = LoopHistogram("h_seconds", "doc", ["route"], buckets)
    mine.register(ours)
    plain_theirs = Histogram("p_seconds", "doc", buckets=buckets, registry=oracle)
    plain_ours = LoopHistogram("p_seconds", "doc", (), buckets)
    mine.register(plain_ours)
    rng = random.Random(7)
    values = [rng.choice(buckets) for _ in range(50)] + [rng.uniform(0, 2 * buckets[-1]) for _ in range(500)]
    for i, value in enumerate(values):  # bounds themselves fall in their own bucket (le is <=)
        route = ("chat", "completions")[i % 2]
        theirs.labels(route).observe(value)
        ours.labels(route).observe(value)
        plain_theirs.observe(value)
        plain_ours.observe(value)
    assert exposed(mine) == exposed(oracle)


def test_counters_expose_what_prometheus_client_would() -> None:
    oracle, mine = CollectorRegistry(), CollectorRegistry()
    theirs = Counter("mesh_things_total", "doc", ["target", "status"], registry=oracle)
    ours = LoopCounter("mesh_things_total", "doc", ["target", "status"])
    plain_theirs = Counter("mesh_plain_total", "doc", registry=oracle)
    plain_ours = LoopCounter("mesh_plain_total", "doc")
    mine.register(ours)
    mine.register(plain_ours)
    for i in range(100):
        theirs.labels("w%d" % (i % 3), 200).inc(i)
        ours.labels("w%d" % (i % 3), 200).inc(i)
        plain_theirs.inc()
        plain_ours.inc()
    assert exposed(mine) == exposed(oracle)
    family = next(iter(ours.collect()))
    assert family.name == "mesh_things"  # as prometheus_client names a counter's family


def test_wrong_label_counts_and_unsorted_buckets_are_refused() -> None:
    with pytest.raises(ValueError, match="takes labels"):
        LoopCounter("c_total", "doc", ["a", "b"]).labels("x")
    with pytest.raises(ValueError, match="ascending"):
        LoopHistogram("h", "doc", (), (0.1, 0.01))
