"""The worker registry: workers, their routable targets, health, circuit breakers and draining.

Ownership: the registry owns every ``TargetState`` of the live gateway and the ``targets`` dict
that ``mesh.router.Router`` reads (the same dict object for the app's whole life: workers added
or removed at runtime appear in, or vanish from, the router's view at once). Load fields
(``in_flight``, ``prefill_tokens``, ``decode_tokens``) are the total load on a target: this
replica's router leases add and remove their own share, and with ``state.backend: redis``
``mesh.shared_load.SharedLoad`` adds (by deltas) what the other gateway replicas report; the
registry writes the availability fields (``healthy``, ``draining``, ``circuit_open``, ``models``)
and the worker-reported KV fields (``kv_usage``, ``kv_capacity_blocks``: read from each worker's
``/metrics`` by ``read_metrics`` on the health schedule; 0 / 0 when unknown, which is what the
policies read as "no pressure" and "capacity not known").

Scrapes do not hold up health: a round starts each due worker's scrape as its own task (at most
one in flight per worker, owned by the registry in ``_scrapes``) and does not await it; a worker
added at runtime is scraped at once. A removed worker's task is cancelled, as are all of them by
``stop`` and by a reload that turns ``health.worker_metrics`` off (its values go to unknown).

Threading: everything here runs on the gateway's event loop; a probe or a scrape that awaits
re-checks that its worker is still registered (and scraping still on) before it writes anything.

Listeners (``add_listener``) hear ``on_worker_added(worker)`` / ``on_worker_removed(worker)``:
this is where KV event subscribers are started and stopped per worker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import msgspec
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from mesh.client_io import RateLimitedWarning
from mesh.config import CircuitBreakerConfig, MeshConfig, WorkerConfig, check_event_streams, check_worker_url
from mesh.metrics import Metrics
from mesh.upstream import UpstreamPool
from mesh.worker_metrics import METRICS_RESULTS, RankLoad, Scrape, scrape
from policies.base import TargetState, target_id

log = logging.getLogger("mesh.registry")


class RegistryError(ValueError):
    """An admin operation that cannot be done; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class RegistryListener(Protocol):
    """A listener may also define ``on_workers_removed(workers: list[Worker])``: it then hears a
    removal of several workers at once (``remove_many``, a reload) as one call, instead of one
    ``on_worker_removed`` per worker."""

    def on_worker_added(self, worker: Worker) -> None: ...

    def on_worker_removed(self, worker: Worker) -> None: ...


class CircuitBreaker:
    """Closed -> open after ``failure_threshold`` consecutive failures -> half-open after ``open_s``.

    Half-open lets traffic through again: the next success closes it, the next failure reopens it.
    An open circuit ignores successes: they come from requests sent before it opened (a long
    one finishing whole said nothing about the failures that opened it), and only ``open_s``
    moves it on, as in the usual breakers (resilience4j, Envoy's outlier ejection).
    """

    def __init__(self, config: CircuitBreakerConfig) -> None:
        self.config = config
        self.state: Literal["closed", "open", "half_open"] = "closed"
        self.failures = 0
        self.opened_at = 0.0

    @property
    def is_open(self) -> bool:
        return self.state == "open"

    def record_success(self) -> None:
        if self.state == "open":
            return
        self.failures = 0
        self.state = "closed"

    def record_failure(self, now: float) -> bool:
        """Count a failure; True when this failure opened the circuit."""
        self.failures += 1
        if self.state == "half_open" or (self.state == "closed" and self.failures >= self.config.failure_threshold):
            self.state = "open"
            self.opened_at = now
            return True
        return False

    def tick(self, now: float) -> None:
        if self.state == "open" and now - self.opened_at >= self.config.open_s:
            self.state = "half_open"


@dataclass(eq=False)
class Worker:
    """One worker endpoint and its data-parallel targets."""

    config: WorkerConfig
    targets: list[TargetState]
    breaker: CircuitBreaker
    source: Literal["config", "admin"] = "config"
    healthy: bool = False  # unknown until the first check passes
    draining: bool = False
    ok_streak: int = 0
    fail_streak: int = 0
    last_error: str | None = None
    last_check: float = 0.0
    discovered_models: frozenset[str] = frozenset()  # base models only (never LoRA adapters)
    discovered_loras: dict[str, str] = field(default_factory=dict)  # adapter -> base; replaced, never mutated
    headers: list[bytes] = field(default_factory=list)  # header lines sent with every request to it
    # What its /metrics said, one entry per target (None: unknown); written by
    # ``WorkerRegistry.read_metrics`` only, with the targets' kv fields.
    reported: list[RankLoad | None] = field(default_factory=list)
    metrics_result: str = ""  # the last scrape's outcome (``METRICS_RESULTS``); "" before the first
    metrics_error: str | None = None
    metrics_ok_at: float = 0.0  # monotonic time of the last scrape that read load signals
    metrics_next_at: float = 0.0  # no scrape before this (backing off a worker that exports none)
    metrics_counts: dict[str, int] = field(default_factory=dict)  # outcome -> scrapes
    metrics_warnings: RateLimitedWarning | None = None  # its scrape problems, rate-limited
    metrics_info_at: float = float("-inf")  # monotonic time of its last INFO line about /metrics

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def url(self) -> str:
        return self.config.url

    @property
    def base_models(self) -> frozenset[str]:
        return frozenset(self.config.models) if self.config.models is not None else self.discovered_models

    @property
    def loras(self) -> dict[str, str]:
        """LoRA adapter -> its base model: configured, else discovered (``parent`` in /v1/models)."""
        return self.config.loras if self.config.loras is not None else self.discovered_loras

    @property
    def models(self) -> frozenset[str]:
        """Every model name a request may ask this worker for: base models and LoRA adapters."""
        loras = self.loras
        return self.base_models | frozenset(loras) if loras else self.base_models

    def sync(self) -> None:
        """Push availability into the targets (the policies' view)."""
        models, loras = self.models, frozenset(self.loras)
        for t in self.targets:
            t.healthy = self.healthy
            t.draining = self.draining
            t.circuit_open = self.breaker.is_open
            t.models = models
            t.loras = loras

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "url": self.url,
            "role": self.config.role.value,
            "source": self.source,
            "healthy": self.healthy,
            "draining": self.draining,
            "circuit": self.breaker.state,
            "models": sorted(self.models),
            "loras": dict(sorted(self.loras.items())),
            "dp_size": self.config.dp_size,
            "block_size": self.config.block_size,
            "last_error": self.last_error,
            "metrics": {
                "result": self.metrics_result or None,
                "error": self.metrics_error,
                "age_s": round(time.monotonic() - self.metrics_ok_at, 3) if self.metrics_ok_at else None,
            },
            "targets": [
                {
                    "id": t.id,
                    "in_flight": t.in_flight,
                    "prefill_tokens": t.prefill_tokens,
                    "decode_tokens": t.decode_tokens,
                    "live_sessions": t.live_sessions,
                    **_reported_fields(t, self.reported[i] if i < len(self.reported) else None),
                }
                for i, t in enumerate(self.targets)
            ],
        }

    def set_reported(self, loads: list[RankLoad | None]) -> None:
        """Push what the worker's /metrics said (one entry per target) into the targets."""
        self.reported = loads
        for t, load in zip(self.targets, loads, strict=True):
            t.kv_usage = load.kv_usage if load is not None and load.kv_usage is not None else 0.0
            t.kv_capacity_blocks = load.capacity_blocks(t.block_size) if load is not None else 0


class WorkerRegistry:
    def __init__(self, config: MeshConfig) -> None:
        self.config = config
        self.targets: dict[str, TargetState] = {}  # the Router's view; never replaced
        self.workers: dict[str, Worker] = {}
        self._by_target: dict[str, Worker] = {}
        self._listeners: list[RegistryListener] = []
        self._task: asyncio.Task[None] | None = None
        self.any_circuit_open = False
        self.version = 0  # bumped whenever membership or a worker's model list changes
        self.admission_limited = False  # some target has a max_in_flight
        # One scrape task per worker at most (a worker's entry leaves when its task ends); the
        # pool is the last round's, for scraping a worker added between rounds at once.
        self._scrapes: dict[Worker, asyncio.Task[None]] = {}
        self._pool: UpstreamPool | None = None

    # -- membership --
    def add_listener(self, listener: RegistryListener) -> None:
        self._listeners.append(listener)

    def add(self, cfg: WorkerConfig, source: Literal["config", "admin"] = "admin") -> Worker:
        if cfg.name in self.workers:
            raise RegistryError(409, f"worker {cfg.name!r} already exists")
        try:
            check_worker_url(cfg.url, self.config.server)
            check_event_streams([*(w.config for w in self.workers.values()), cfg])
        except ValueError as exc:
            raise RegistryError(400, str(exc)) from exc
        ids = [target_id(cfg.name, r, cfg.dp_size) for r in range(cfg.dp_size)]
        if any(i in self.targets for i in ids):
            raise RegistryError(409, f"worker {cfg.name!r} collides with an existing target id")
        targets = [
            TargetState(
                id=tid,
                worker=cfg.name,
                dp_rank=rank,
                url=cfg.url,
                role=cfg.role,
                block_size=cfg.block_size,
                healthy=False,
                max_in_flight=cfg.max_in_flight,
            )
            for rank, tid in enumerate(ids)
        ]
        worker = Worker(cfg, targets, CircuitBreaker(self.config.circuit_breaker), source, headers=_auth_headers(cfg))
        worker.sync()
        self.workers[cfg.name] = worker
        for t in targets:
            self.targets[t.id] = t
            self._by_target[t.id] = worker
        self.version += 1
        self.admission_limited = any(t.max_in_flight for t in self.targets.values())
        for listener in self._listeners:
            listener.on_worker_added(worker)
        if self._pool is not None and self.config.health.worker_metrics:
            self._start_scrape(worker, self._pool)  # its KV known before the next round
        return worker

    def remove(self, name: str) -> Worker:
        return self.remove_many([name])[0]

    def remove_many(self, names: Iterable[str]) -> list[Worker]:
        """Remove several workers as one change: listeners with ``on_workers_removed`` hear it
        once (one pass over the session table for all of them), the others once per worker.
        Raises (404) before removing any when a name is unknown."""
        workers = [self.get(name) for name in dict.fromkeys(names)]
        for worker in workers:
            del self.workers[worker.name]
            self._cancel_scrape(worker)
            for t in worker.targets:
                # In-flight leases keep their TargetState object and release it normally.
                self.targets.pop(t.id, None)
                self._by_target.pop(t.id, None)
        if not workers:
            return workers
        self.version += 1
        self.admission_limited = any(t.max_in_flight for t in self.targets.values())
        for listener in self._listeners:
            bulk = getattr(listener, "on_workers_removed", None)
            if bulk is not None:
                bulk(workers)
            else:
                for worker in workers:
                    listener.on_worker_removed(worker)
        return workers

    def get(self, name: str) -> Worker:
        worker = self.workers.get(name)
        if worker is None:
            raise RegistryError(404, f"no worker named {name!r}")
        return worker

    def worker_of(self, tid: str) -> Worker | None:
        return self._by_target.get(tid)

    def drain(self, name: str, draining: bool = True) -> Worker:
        worker = self.get(name)
        worker.draining = draining
        worker.sync()
        return worker

    def reconfigure(self, config: MeshConfig) -> None:
        """Apply a reloaded config: settings now, static workers reconciled (admin-added kept)."""
        self.config = config
        for worker in self.workers.values():
            worker.breaker.config = config.circuit_breaker
        if not config.health.worker_metrics:
            self._metrics_off()
        wanted = {w.name: w for w in config.workers}
        for name, cfg in wanted.items():
            worker = self.workers.get(name)
            if worker is not None and worker.source == "config" and cfg != worker.config and _same_engine(cfg, worker.config):
                self._update(worker, cfg)
        # one removal event for all of them (a reload removing 100 workers scanned the session
        # table 100 times)
        self.remove_many(name for name, worker in self.workers.items()
                         if worker.source == "config" and (name not in wanted or wanted[name] != worker.config))
        for name, cfg in wanted.items():
            if name not in self.workers:
                self.add(cfg, source="config")

    def _update(self, worker: Worker, cfg: WorkerConfig) -> None:
        """A reloaded worker whose engine is the same (``_same_engine``) keeps its targets, their
        load, health, sessions and cached prefixes; only the settings change (was: removed and
        added, so its in-flight requests were forgotten and it answered 503 until its next health
        check)."""
        worker.config = cfg
        worker.headers = _auth_headers(cfg)
        for t in worker.targets:
            t.max_in_flight = cfg.max_in_flight
        worker.sync()
        self.version += 1
        self.admission_limited = any(t.max_in_flight for t in self.targets.values())

    def full_targets(self) -> list[str]:
        """Targets at their admission limit (``max_in_flight``): routing skips them."""
        if not self.admission_limited:
            return []
        return [t.id for t in self.targets.values() if t.max_in_flight and t.in_flight >= t.max_in_flight]

    # -- passive health (request outcomes) --
    def record_success(self, tid: str) -> None:
        worker = self._by_target.get(tid)
        if worker is not None and (worker.breaker.failures or worker.breaker.state != "closed"):
            worker.breaker.record_success()
            worker.sync()
            self._update_circuit_flag()

    def record_failure(self, tid: str, now: float, error: str) -> None:
        worker = self._by_target.get(tid)
        if worker is None:
            return
        worker.last_error = error
        if worker.breaker.record_failure(now):
            log.warning("circuit opened for worker %s after %d failures: %s", worker.name, worker.breaker.failures, error)
            worker.sync()
            self.any_circuit_open = True

    def tick(self, now: float) -> None:
        """Move open circuits to half-open once their time is up (cheap; called per request)."""
        if not self.any_circuit_open:
            return
        for worker in self.workers.values():
            if worker.breaker.is_open:
                worker.breaker.tick(now)
                if not worker.breaker.is_open:
                    worker.sync()
        self._update_circuit_flag()

    def _update_circuit_flag(self) -> None:
        self.any_circuit_open = any(w.breaker.is_open for w in self.workers.values())

    # -- active health --
    async def check(self, worker: Worker, pool: UpstreamPool) -> bool:
        cfg = self.config.health
        ok, error = await _probe(pool, worker.url + "/health", worker.headers, cfg.timeout_s)
        if worker.name not in self.workers or self.workers[worker.name] is not worker:
            return ok  # removed while the probe ran
        worker.last_check = time.monotonic()
        if ok:
            worker.ok_streak += 1
            worker.fail_streak = 0
            if not worker.healthy and worker.ok_streak >= cfg.healthy_threshold:
                worker.healthy = True
                log.info("worker %s is healthy", worker.name)
            if worker.healthy and worker.config.models is None and (worker.ok_streak == 1 or not worker.discovered_models):
                found = await discover_models(pool, worker, cfg.timeout_s)
                if found is not None and found != (worker.discovered_models, worker.discovered_loras):
                    worker.discovered_models, worker.discovered_loras = found
                    self.version += 1
        else:
            worker.fail_streak += 1
            worker.ok_streak = 0
            worker.last_error = error
            if worker.healthy and worker.fail_streak >= cfg.unhealthy_threshold:
                worker.healthy = False
                log.warning("worker %s is unhealthy: %s", worker.name, error)
        worker.sync()
        return ok

    async def check_all(self, pool: UpstreamPool, metrics: Metrics | None = None) -> None:
        """One round: every worker's health; each due worker's /metrics scrape is started as its
        own task (``_start_scrape``), not awaited: a slow /metrics never stretches the round."""
        workers = list(self.workers.values())
        if self.config.health.worker_metrics:
            self._pool = pool
            now = time.monotonic()
            for w in workers:
                if w.metrics_next_at <= now:
                    self._start_scrape(w, pool)
        else:
            self._metrics_off()
        results = await asyncio.gather(*(self.check(w, pool) for w in workers))
        if metrics is not None:
            for w, ok in zip(workers, results, strict=True):
                metrics.health_checks_total.labels(w.name, "ok" if ok else "fail").inc()
        self.tick(time.monotonic())

    # -- worker-reported load (/metrics) --
    def _start_scrape(self, worker: Worker, pool: UpstreamPool) -> None:
        """Start the worker's scrape unless one is in flight (needs a running loop)."""
        if worker in self._scrapes:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop (a worker added before the app runs): the first round scrapes it
        task = loop.create_task(self._scrape_task(worker, pool), name=f"mesh-scrape-{worker.name}")
        self._scrapes[worker] = task
        task.add_done_callback(lambda t, w=worker: self._scrapes.pop(w) if self._scrapes.get(w) is t else None)

    async def _scrape_task(self, worker: Worker, pool: UpstreamPool) -> None:
        try:
            await self.read_metrics(worker, pool)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug must not end as an unretrieved task exception
            log.exception("scraping worker %s's /metrics failed", worker.name)

    def _cancel_scrape(self, worker: Worker) -> None:
        task = self._scrapes.pop(worker, None)
        if task is not None:
            task.cancel()

    async def scrapes_done(self) -> None:
        """Wait for the scrapes in flight now (tests, tools)."""
        tasks = list(self._scrapes.values())
        if tasks:
            await asyncio.wait(tasks)

    async def stop(self) -> None:
        """Cancel every scrape in flight and wait for them to end; no scrape starts after this
        until the next ``check_all``."""
        self._pool = None
        tasks = list(self._scrapes.values())
        self._scrapes.clear()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    def _metrics_off(self) -> None:
        """``health.worker_metrics`` is off: no scrape runs, every reported value is unknown."""
        self._pool = None
        for worker in list(self._scrapes):
            self._cancel_scrape(worker)
        for worker in self.workers.values():
            if worker.metrics_result or any(r is not None for r in worker.reported):
                worker.set_reported([None] * len(worker.targets))
                worker.metrics_result, worker.metrics_error = "", None
                worker.metrics_ok_at = worker.metrics_next_at = 0.0

    async def read_metrics(self, worker: Worker, pool: UpstreamPool) -> str:
        """Scrape the worker's /metrics and set its targets' KV usage and capacity; returns the
        outcome. A worker that exports none (404, no known names) is asked again only after
        ``METRICS_ABSENT_RETRY_S``; one that fails keeps its last values for ``stale_after_s``,
        then reads as unknown. A scrape never changes a worker's health."""
        got = await scrape(pool, worker.url + "/metrics", worker.headers, self.config.health.timeout_s)
        if self.workers.get(worker.name) is not worker or not self.config.health.worker_metrics:
            return got.result  # removed (or scraping turned off) while the scrape ran
        self._apply_scrape(worker, got, time.monotonic())
        return got.result

    @property
    def stale_after_s(self) -> float:
        """Values older than this (no good scrape since) are dropped to unknown."""
        return max(METRICS_STALE_MIN_S, METRICS_STALE_ROUNDS * self.config.health.interval_s)

    def _apply_scrape(self, worker: Worker, got: Scrape, now: float) -> None:
        if got.result == "ok":
            loads = loads_for_targets(got.ranks, len(worker.targets))
            if loads is None:  # ranks that cannot be placed on the targets: an answer, not a reading
                listed = sorted(r for r in got.ranks if r is not None)
                got = Scrape("unmatched", error=f"/metrics lists ranks {listed} (and {int(None in got.ranks)} "
                             f"unlabelled), the worker has dp_size {len(worker.targets)}")
        worker.metrics_counts[got.result] = worker.metrics_counts.get(got.result, 0) + 1
        if got.result != worker.metrics_result:
            _log_scrape(worker, got, now)
        worker.metrics_result, worker.metrics_error = got.result, got.error
        if got.result == "ok":
            worker.metrics_ok_at = now
            worker.set_reported(loads)
            return
        if got.result in ("absent", "empty", "unmatched"):  # an answer: it does not report them (usably)
            worker.metrics_next_at = now + METRICS_ABSENT_RETRY_S
            worker.metrics_ok_at = 0.0
        if now - worker.metrics_ok_at > self.stale_after_s and any(r is not None for r in worker.reported):
            worker.set_reported([None] * len(worker.targets))

    # -- views --
    def models(self) -> list[str]:
        """The union of models served by healthy workers."""
        names: set[str] = set()
        for w in self.workers.values():
            if w.healthy:
                names |= w.models
        return sorted(names)

    def lora_base(self, model: str) -> str | None:
        """The base model of LoRA adapter ``model`` (first worker in registry order); None if not one."""
        for w in self.workers.values():
            base = w.loras.get(model)
            if base is not None:
                return base
        return None

    def knows_model(self, model: str) -> bool:
        """False only when every worker's model list is known and none serves ``model``."""
        return any(not w.models or model in w.models for w in self.workers.values())

    def metric_families(self) -> Iterable[Metric]:
        in_flight = GaugeMetricFamily("mesh_worker_in_flight", "In-flight requests per target", labels=["target"])
        prefill = GaugeMetricFamily("mesh_worker_prefill_tokens", "Queued prefill tokens per target", labels=["target"])
        decode = GaugeMetricFamily("mesh_worker_decode_tokens", "Decoding context tokens per target", labels=["target"])
        sessions = GaugeMetricFamily("mesh_worker_live_sessions", "Session bindings per target", labels=["target"])
        healthy = GaugeMetricFamily("mesh_worker_healthy", "1 when the worker passes health checks", labels=["worker"])
        circuit = GaugeMetricFamily("mesh_circuit_open", "1 when the worker's circuit breaker is open", labels=["worker"])
        draining = GaugeMetricFamily("mesh_worker_draining", "1 when the worker is draining", labels=["worker"])
        for w in self.workers.values():
            healthy.add_metric([w.name], 1.0 if w.healthy else 0.0)
            circuit.add_metric([w.name], 1.0 if w.breaker.is_open else 0.0)
            draining.add_metric([w.name], 1.0 if w.draining else 0.0)
            for t in w.targets:
                in_flight.add_metric([t.id], t.in_flight)
                prefill.add_metric([t.id], t.prefill_tokens)
                decode.add_metric([t.id], t.decode_tokens)
                sessions.add_metric([t.id], t.live_sessions)
        return [in_flight, prefill, decode, sessions, healthy, circuit, draining, *self._reported_families()]

    def _reported_families(self) -> list[Metric]:
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
        for w in self.workers.values():
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


# Worker-reported load: a module setting until the config has a field for it (the lead's call).
METRICS_ABSENT_RETRY_S = 10.0  # a worker whose /metrics answered 404 or held no load signals
METRICS_STALE_ROUNDS = 3  # values survive this many failed health rounds...
METRICS_STALE_MIN_S = 5.0  # ...and at least this long


def loads_for_targets(ranks: dict[int | None, RankLoad], n_targets: int) -> list[RankLoad | None] | None:
    """A worker's per-rank readings -> one per target (target ``i`` is ``worker@i``); None when
    they cannot be placed.

    A single-target worker takes its only reading whatever its rank label (vLLM's external
    load-balancing mode numbers each server's one engine by its global rank), or, when its
    engine runs several ranks behind one target, their sum (usage weighted by capacity). A
    multi-rank worker needs exactly ``n_targets`` labelled ranks: ``0..n-1`` map to themselves;
    other ranks (vLLM's hybrid / external load-balancing: an API server managing engines 2 and 3
    labels them 2, 3) map in sorted order. Another count (or unlabelled readings) cannot be
    placed."""
    if n_targets == 1:
        labelled = [load for rank, load in ranks.items() if rank is not None]
        if len(ranks) == 1:
            return list(ranks.values())
        return [combine(labelled) if labelled else None]
    listed = sorted(r for r in ranks if r is not None)
    if len(listed) != n_targets:
        return None
    return [ranks[r] for r in listed]


def combine(loads: list[RankLoad]) -> RankLoad:
    """Several ranks read as one pool: capacities and counts add, usage is capacity-weighted."""
    def total(values: list[int | None]) -> int | None:
        return None if any(v is None for v in values) else sum(v for v in values if v is not None)

    sizes = {load.kv_block_size for load in loads}
    blocks = total([load.kv_blocks for load in loads]) if len(sizes) == 1 else None
    usages = [load.kv_usage for load in loads]
    usage = None
    if all(u is not None for u in usages):
        weights = [load.kv_blocks or 0 for load in loads] if blocks else [1] * len(loads)
        usage = sum(u * w for u, w in zip(usages, weights, strict=True) if u is not None) / (sum(weights) or 1)
    return RankLoad(kv_usage=usage, kv_blocks=blocks, kv_block_size=sizes.pop() if blocks else None,
                    num_running=total([load.num_running for load in loads]),
                    num_waiting=total([load.num_waiting for load in loads]))


def _reported_fields(t: TargetState, load: RankLoad | None) -> dict[str, Any]:
    """A target's worker-reported load for ``GET /workers`` (None: unknown)."""
    known = load is not None
    return {
        "kv_usage": t.kv_usage if known and load.kv_usage is not None else None,  # type: ignore[union-attr]
        "kv_capacity_blocks": t.kv_capacity_blocks or None,
        "reported_running": load.num_running if known else None,  # type: ignore[union-attr]
        "reported_waiting": load.num_waiting if known else None,  # type: ignore[union-attr]
    }


METRICS_LOG_EVERY_S = 60.0  # per worker: at most one INFO line and one WARNING line per this


def _log_scrape(worker: Worker, got: Scrape, now: float) -> None:
    """Logged when a worker's scrape outcome changes, rate-limited per worker: a flapping
    /metrics writes a WARNING (then a count of the ones held) and an INFO at most once per
    ``METRICS_LOG_EVERY_S``, not every round."""
    if got.result in ("ok", "absent", "empty"):
        if now - worker.metrics_info_at < METRICS_LOG_EVERY_S:
            return
        worker.metrics_info_at = now
        if got.result == "ok":
            log.info("worker %s reports its load on /metrics", worker.name)
        else:
            log.info("worker %s reports no load on /metrics (%s): its KV usage is unknown", worker.name, got.error)
        return
    if worker.metrics_warnings is None:
        worker.metrics_warnings = RateLimitedWarning(log, f"worker {worker.name}: /metrics failures",
                                                     every_s=METRICS_LOG_EVERY_S)
    worker.metrics_warnings.warning("worker %s: /metrics %s: %s", worker.name, got.result, got.error)


# What names a worker's engine and its KV state: a change of any of these is a new worker.
_ENGINE_FIELDS = ("url", "role", "dp_size", "block_size", "kv_events")


def _same_engine(a: WorkerConfig, b: WorkerConfig) -> bool:
    return all(getattr(a, f) == getattr(b, f) for f in _ENGINE_FIELDS)


def _auth_headers(cfg: WorkerConfig) -> list[bytes]:
    return [f"authorization: Bearer {cfg.api_key}\r\n".encode()] if cfg.api_key else []


async def _probe(pool: UpstreamPool, url: str, headers: list[bytes], timeout_s: float) -> tuple[bool, str | None]:
    try:
        status, _ = await pool.get(url, headers, timeout_s)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # connection refused, timeout, bad response: all mean "not healthy"
        return False, f"GET /health failed: {exc}"
    if status == 200:
        return True, None
    return False, f"GET /health answered {status}"


async def discover_models(
    pool: UpstreamPool, worker: Worker, timeout_s: float
) -> tuple[frozenset[str], dict[str, str]] | None:
    """(base models, LoRA adapter -> base) from the worker's ``/v1/models``; None when it cannot say."""
    try:
        status, body = await pool.get(worker.url + "/v1/models", worker.headers, timeout_s)
        if status != 200:
            return None
        data = msgspec.json.decode(body)
        found = split_models(data.get("data", []) if isinstance(data, dict) else [])
        return found if found[0] or found[1] else None
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        log.warning("model discovery failed for worker %s: %s", worker.name, exc)
        return None


def split_models(entries: Any) -> tuple[frozenset[str], dict[str, str]]:
    """/v1/models entries -> (base models, LoRA adapter -> base).

    vLLM lists an adapter under its own id with ``parent`` = the base model's id (and ``root`` =
    the adapter path); a base model has ``parent`` null. An entry whose parent is not another
    listed id (or is itself) is taken as a base model: nothing serves the base it names here.
    """
    rows = [m for m in entries if isinstance(m, dict) and isinstance(m.get("id"), str) and m["id"]] \
        if isinstance(entries, list) else []
    ids = {m["id"] for m in rows}
    loras = {m["id"]: m["parent"] for m in rows
             if isinstance(m.get("parent"), str) and m["parent"] in ids and m["parent"] != m["id"]}
    loras = {a: b for a, b in loras.items() if b not in loras}  # an adapter's parent is a base model
    return frozenset(ids - loras.keys()), loras
