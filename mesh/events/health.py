"""KV event streams' health: per-stream counters, their ``mesh_kv_events_*`` metrics, bounded logs.

``StreamHealth`` holds one stream's (one worker rank's) counters and state; ``HealthCollector``
exports every stream's at scrape time (no per-event metric cost; the inbox backlog as well) on the ``CollectorRegistry``
the subscriber was given; ``LogLimiter`` keeps a few log lines per stream and kind of trouble
per window and counts the rest (a publisher sending garbage would otherwise write a line per
frame; ``/metrics`` counts every occurrence). Ownership: a ``StreamHealth`` is mutated only by
its stream's own tasks (``mesh.events.subscriber`` with the stream, sockets and apply modules);
the collector only reads. Logs go to the ``mesh.events.subscriber`` logger, on which operators
filter the subscriber's lines.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from mesh import log_limit

log = logging.getLogger("mesh.events.subscriber")


@dataclass(slots=True)
class StreamHealth:
    """Counters and state of one stream (one worker rank). Mutated only by its stream task."""

    worker: str
    target: str
    rank: int
    endpoint: str
    replay_endpoint: str | None
    last_seq: int | None = None
    last_event_at: float | None = None  # monotonic time of the last valid frame
    batches: int = 0
    events: dict[str, int] = field(default_factory=dict)  # stored/removed/cleared/unknown/...
    blocks: dict[str, int] = field(default_factory=dict)  # stored/removed/skipped
    gaps: int = 0
    duplicates: int = 0
    stale: int = 0  # frames older than a rebuild, still queued in the socket
    replays: dict[str, int] = field(default_factory=dict)  # ok/failed
    resets: dict[str, int] = field(default_factory=dict)  # reason -> count
    decode_errors: int = 0
    dropped: dict[str, int] = field(default_factory=dict)  # oversized/malformed
    recovering: bool = False
    connected: bool = False  # the SUB socket's connection is up (socket monitor)
    disconnects: int = 0
    bad_streak: int = 0  # consecutive frames that could not be used
    running: bool = False
    # Read from the gateway's bound endpoint (``mesh.events.bound``): ``endpoint`` is that address,
    # ``topic`` the topics naming this stream, and ``connected`` means the publisher has been heard
    # from (a frame of its topic, or an answer of its replay socket).
    bound: bool = False
    topic: str = ""

    def bump(self, table: dict[str, int], key: str, n: int = 1) -> None:
        table[key] = table.get(key, 0) + n


class LogLimiter(log_limit.LogLimiter):
    """``mesh.log_limit.LogLimiter`` for KV event streams, on this module's logger."""

    def __init__(self, burst: int = 5, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(log, "kv events", burst, window_s, clock)


class HealthCollector:
    """Exports every stream's health at scrape time: ``streams()`` gives them, ``healthy(h)``
    says whether a stream's index is trusted, ``clock()`` is the streams' monotonic clock."""

    def __init__(
        self,
        streams: Callable[[], Mapping[str, StreamHealth]],
        healthy: Callable[[StreamHealth], bool],
        clock: Callable[[], float],
        backlog: Callable[[str], int] = lambda target: 0,
    ) -> None:
        self.streams, self.healthy, self.clock, self.backlog = streams, healthy, clock, backlog

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        streams = list(self.streams().values())
        lbl = ["worker", "target"]

        def counter(name: str, doc: str, value: Callable[[StreamHealth], float]) -> CounterMetricFamily:
            fam = CounterMetricFamily(f"mesh_kv_events_{name}", doc, labels=lbl)
            for h in streams:
                fam.add_metric([h.worker, h.target], value(h))
            return fam

        def by_key(name: str, doc: str, key: str, table: Callable[[StreamHealth], dict[str, int]]) -> CounterMetricFamily:
            fam = CounterMetricFamily(f"mesh_kv_events_{name}", doc, labels=[*lbl, key])
            for h in streams:
                for k, v in sorted(table(h).items()):
                    fam.add_metric([h.worker, h.target, k], v)
            return fam

        yield counter("batches", "Event batches applied", lambda h: h.batches)
        yield by_key("events", "Events by outcome", "type", lambda h: h.events)
        yield by_key("blocks", "Blocks applied, by operation", "op", lambda h: h.blocks)
        yield counter("gaps", "Sequence gaps seen", lambda h: h.gaps)
        yield counter("disconnects", "Connections to the publisher lost", lambda h: h.disconnects)
        yield counter("duplicates", "Batches received twice (replay overlap)", lambda h: h.duplicates)
        yield counter("stale_frames", "Frames older than a rebuild, skipped", lambda h: h.stale)
        yield by_key("replays", "Replay requests, by outcome", "outcome", lambda h: h.replays)
        yield by_key("resets", "Index resets of a target, by reason", "reason", lambda h: h.resets)
        yield counter("decode_errors", "Payloads that could not be decoded", lambda h: h.decode_errors)
        yield by_key("dropped_frames", "Frames dropped, by reason", "reason", lambda h: h.dropped)
        yield from self._gauges(streams, lbl)

    def _gauges(self, streams: list[StreamHealth], lbl: list[str]) -> Iterator[Metric]:
        now = self.clock()
        age = GaugeMetricFamily("mesh_kv_events_last_event_age_seconds", "Seconds since the last valid batch",
                                labels=lbl)
        seq = GaugeMetricFamily("mesh_kv_events_last_seq", "Last applied sequence number", labels=lbl)
        ok = GaugeMetricFamily("mesh_kv_events_healthy", "1 while the stream's index is trusted", labels=lbl)
        backlog = GaugeMetricFamily("mesh_kv_events_backlog_frames", "Frames received, not applied yet", labels=lbl)
        for h in streams:
            backlog.add_metric([h.worker, h.target], self.backlog(h.target))
            age.add_metric([h.worker, h.target], math.nan if h.last_event_at is None else now - h.last_event_at)
            seq.add_metric([h.worker, h.target], -1 if h.last_seq is None else h.last_seq)
            ok.add_metric([h.worker, h.target], 1.0 if self.healthy(h) else 0.0)
        yield age
        yield seq
        yield ok
        yield backlog
