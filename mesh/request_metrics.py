"""The per-(model, target) serving metrics a dashboard reads: time to first token, inter-token
latency, end-to-end latency, and the prompt / cached-prompt / generation tokens workers report.

The histograms are ``mesh.loop_metrics``' lock-free ones (the inter-token histogram is observed
once per relayed chunk): the event loop's thread is the only writer and ``/metrics`` renders in
that same thread.

Ownership and cardinality:
- ``RequestSeries`` owns every ``Series``. The proxy asks ``series(model, target)`` once per
  answered request and gets the same object for the same pair (one dict lookup on a hit).
- ``model`` is the request's model when some registered worker lists it (base model or LoRA
  adapter), else ``other``: a client's made-up names never become series. ``target`` is a
  registry target id (a lease's). A removed worker's series leave with it (``drop_targets``).
- The cache starts over when the registry's ``version`` moves (a model discovered later gets
  its own series from then on) or past ``_MAX_CACHED`` pairs (made-up model names).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

from mesh.loop_metrics import HistogramChild, cumulative

# Engines' own TTFT buckets reach minutes (long prompts, queueing); ITL is tens of milliseconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0)
OTHER_MODEL = "other"
_MAX_CACHED = 4096  # (model, target) pairs remembered; past it the cache starts over


class Series:
    """The serving metrics of one (model, target): three histograms and token counters. Mutated
    only by the event loop's thread."""

    __slots__ = ("ttft_hist", "itl_hist", "e2e_hist", "prompt_tokens", "cached_tokens", "generation_tokens")

    def __init__(self) -> None:
        self.ttft_hist = HistogramChild(TTFT_BUCKETS)
        self.itl_hist = HistogramChild(ITL_BUCKETS)
        self.e2e_hist = HistogramChild(E2E_BUCKETS)
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.generation_tokens = 0

    def ttft(self, seconds: float) -> None:
        self.ttft_hist.observe(seconds)

    def itl(self, seconds: float) -> None:
        """One gap between two chunks of a stream (``sse_relay.relay_stream``'s ``gap``)."""
        self.itl_hist.observe(seconds)

    def e2e(self, seconds: float) -> None:
        self.e2e_hist.observe(seconds)

    def usage(self, prompt: int, cached: int, generated: int) -> None:
        self.prompt_tokens += prompt
        self.cached_tokens += cached
        self.generation_tokens += generated


class Registry(Protocol):
    """What ``RequestSeries`` reads of ``WorkerRegistry``."""

    version: int  # bumped whenever membership or a worker's model list changes

    @property
    def workers(self) -> Mapping[str, Any]: ...  # name -> Worker (its ``models``)


class RequestSeries:
    """Every ``Series``, by (model label, target). A registry listener: a removed worker's
    series leave ``/metrics`` (an autoscaler naming workers after pods would grow it forever)."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self._by_label: dict[tuple[str, str], Series] = {}
        self._cache: dict[tuple[str, str], Series] = {}  # (request's model, target) -> its series
        self._version = -1  # the registry's version ``_cache`` was filled under

    def series(self, model: str, target: str) -> Series:
        """The series of a request for ``model`` answered by ``target``: one lookup when cached."""
        if self._version != self.registry.version or len(self._cache) >= _MAX_CACHED:
            self._cache.clear()  # models came or went: labels are decided again
            self._version = self.registry.version
        key = (model, target)
        found = self._cache.get(key)
        if found is None:
            found = self._cache[key] = self._resolve(model, target)
        return found

    def _resolve(self, model: str, target: str) -> Series:
        known = any(model in w.models for w in self.registry.workers.values())
        label = (model if known else OTHER_MODEL, target)
        found = self._by_label.get(label)
        if found is None:
            found = self._by_label[label] = Series()
        return found

    # -- registry listener --
    def on_worker_added(self, worker: Any) -> None:
        return None

    def on_worker_removed(self, worker: Any) -> None:
        self.on_workers_removed([worker])

    def on_workers_removed(self, workers: Iterable[Any]) -> None:
        gone = {t.id for w in workers for t in w.targets}
        for label in [k for k in self._by_label if k[1] in gone]:
            del self._by_label[label]
        self._cache.clear()

    def families(self) -> list[Metric]:
        """The Prometheus families, read at scrape time."""
        names = ["model", "target"]
        ttft = HistogramMetricFamily("mesh_time_to_first_token_seconds", "Seconds from the request's arrival to "
                                     "its first token: a stream's first chunk from the worker; a non-streamed "
                                     "answer's whole body", labels=names)
        itl = HistogramMetricFamily("mesh_inter_token_latency_seconds", "Seconds between two successive chunks "
                                    "of a streamed answer (a chunk is usually one token)", labels=names)
        e2e = HistogramMetricFamily("mesh_e2e_request_latency_seconds", "Seconds from the request's arrival to "
                                    "its answer's last byte, for answers a worker gave", labels=names)
        prompt = CounterMetricFamily("mesh_prompt_tokens", "Prompt tokens workers reported (usage)", labels=names)
        cached = CounterMetricFamily("mesh_cached_prompt_tokens", "Prompt tokens workers reported served from "
                                     "their prefix cache (usage.prompt_tokens_details.cached_tokens)", labels=names)
        generated = CounterMetricFamily("mesh_generation_tokens", "Completion tokens workers reported (usage)",
                                        labels=names)
        for (model, target), s in self._by_label.items():
            values = [model, target]
            for family, hist in ((ttft, s.ttft_hist), (itl, s.itl_hist), (e2e, s.e2e_hist)):
                family.add_metric(values, cumulative(hist.bounds, hist.counts), hist.sum)
            prompt.add_metric(values, s.prompt_tokens)
            cached.add_metric(values, s.cached_tokens)
            generated.add_metric(values, s.generation_tokens)
        return [ttft, itl, e2e, prompt, cached, generated]

