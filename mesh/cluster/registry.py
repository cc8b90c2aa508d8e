"""The worker registry: workers and their routable targets, membership changes and draining,
and the schedules of health checks and ``/metrics`` scrapes.

Ownership: the registry owns every ``Worker`` (``mesh.cluster.worker``) and the ``targets`` dict
that ``mesh.core.router.Router`` reads (one dict object for the app's whole life, so workers
added or removed at runtime appear in, or vanish from, the router's view at once). It writes the
targets' availability (``mesh.cluster.health``, ``mesh.cluster.discovery``) and their
worker-reported KV fields (``mesh.cluster.worker_load``; 0 / 0 when unknown, which policies read
as "no pressure" and "capacity not known"); the load fields (total load on a target) are this
replica's router leases' and, with ``state.backend: redis``, ``SharedLoad``'s. Scrapes never hold
up health: each runs as its own task (at most one per worker, in ``_scrapes``; a worker added at
runtime is scraped at once), cancelled when its worker leaves, at ``stop``, and when a reload
turns ``health.worker_metrics`` off (its values go to unknown).

Threading: everything runs on the gateway's event loop; a probe or a scrape that awaits re-checks
that its worker is still registered (and scraping still on) before it writes anything. Listeners
(``add_listener``) hear ``on_worker_added`` / ``on_worker_removed``: KV event subscribers start
and stop there. Health listeners (``add_health_listener``) hear ``on_worker_unhealthy`` when a
probe turns a worker unhealthy: the proxy aborts the requests on it that no client saw a byte of.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Literal, Protocol

from prometheus_client.core import Metric

from mesh.cluster.discovery import discover_models, split_models
from mesh.cluster.families import worker_families
from mesh.cluster.health import CircuitBreaker, apply_probe, probe
from mesh.cluster.worker import Worker, auth_headers
from mesh.cluster.worker_load import apply_scrape, loads_for_targets, stale_after
from mesh.cluster.worker_metrics import Scrape, scrape
from mesh.config import MeshConfig, WorkerConfig, check_bound_workers, check_event_streams, check_worker_addresses
from mesh.gateway.upstream import UpstreamPool
from mesh.metrics import Metrics
from policies.base import TargetState, target_id

# What other modules and tests import from here (the rest lives in the modules named above).
__all__ = ["CircuitBreaker", "HealthListener", "RegistryError", "RegistryListener", "Worker", "WorkerRegistry",
           "discover_models", "loads_for_targets", "split_models"]

log = logging.getLogger("mesh.cluster.registry")


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


class HealthListener(Protocol):
    """Told, on the loop, when a health probe has just turned a registered worker unhealthy."""

    def on_worker_unhealthy(self, worker: Worker) -> None: ...


class WorkerRegistry:
    """Every worker of the gateway, the router's ``targets`` view of them, and their health and
    scrape schedules (see the module docstring for who writes what)."""

    def __init__(self, config: MeshConfig) -> None:
        self.config = config
        self.targets: dict[str, TargetState] = {}  # the Router's view; never replaced
        self.workers: dict[str, Worker] = {}
        self._by_target: dict[str, Worker] = {}
        self._listeners: list[RegistryListener] = []
        self._health_listeners: list[HealthListener] = []
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

    def add_health_listener(self, listener: HealthListener) -> None:
        self._health_listeners.append(listener)

    def add(self, cfg: WorkerConfig, source: Literal["config", "admin", "discovery"] = "admin") -> Worker:
        if cfg.name in self.workers:
            raise RegistryError(409, f"worker {cfg.name!r} already exists")
        try:
            check_worker_addresses(cfg, self.config.server)  # url and kv_events: mesh.connect_policy
            check_event_streams([*(w.config for w in self.workers.values()), cfg])
            check_bound_workers([cfg], self.config.kv_events.bind)
        except ValueError as exc:
            raise RegistryError(400, str(exc)) from exc
        targets = _new_targets(cfg)
        if any(t.id in self.targets for t in targets):
            raise RegistryError(409, f"worker {cfg.name!r} collides with an existing target id")
        worker = Worker(cfg, targets, CircuitBreaker(self.config.circuit_breaker), source, headers=auth_headers(cfg))
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
        # one removal event for all of them: the session table is scanned once, not per worker
        self.remove_many(name for name, worker in self.workers.items()
                         if worker.source == "config" and (name not in wanted or wanted[name] != worker.config))
        for name, cfg in wanted.items():
            if name not in self.workers:
                self.add(cfg, source="config")

    def _update(self, worker: Worker, cfg: WorkerConfig) -> None:
        """A reloaded worker whose engine is the same (``_same_engine``) keeps its targets, their
        load, health, sessions and cached prefixes (its in-flight requests stay counted, and it
        stays routable); only the settings change."""
        worker.config = cfg
        worker.headers = auth_headers(cfg)
        for t in worker.targets:
            t.max_in_flight = cfg.max_in_flight
        worker.sync()
        self.version += 1
        self.admission_limited = any(t.max_in_flight for t in self.targets.values())

    def full_targets(self) -> list[str]:
        """Targets at their admission limit (``max_in_flight``): routing skips them."""
        if not self.admission_limited:
            return []
        return [t.id for t in self.targets.values() if t.at_admission_limit]

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
        """Probe the worker's ``/health`` and count the outcome; a healthy worker without
        configured models has them discovered (again, while none were found)."""
        cfg = self.config.health
        ok, error = await probe(pool, worker.url + "/health", worker.headers, cfg.timeout_s)
        if worker.name not in self.workers or self.workers[worker.name] is not worker:
            return ok  # removed while the probe ran
        was_healthy = worker.healthy
        apply_probe(worker, ok, error, cfg, time.monotonic())
        if was_healthy and not worker.healthy:
            worker.sync()  # out of routing before its requests are retried
            for listener in self._health_listeners:
                listener.on_worker_unhealthy(worker)
        if ok and worker.healthy and worker.config.models is None and (worker.ok_streak == 1 or not worker.discovered_models):
            found = await discover_models(pool, worker, cfg.timeout_s)
            if found is not None and found != (worker.discovered_models, worker.discovered_loras):
                worker.discovered_models, worker.discovered_loras = found
                self.version += 1
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
        return stale_after(self.config.health.interval_s)

    def _apply_scrape(self, worker: Worker, got: Scrape, now: float) -> None:
        apply_scrape(worker, got, now, self.stale_after_s)

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
        return worker_families(self.workers.values())


# What names a worker's engine and its KV state: a change of any of these is a new worker.
_ENGINE_FIELDS = ("url", "role", "dp_size", "block_size", "kv_events", "hybrid")


def _same_engine(a: WorkerConfig, b: WorkerConfig) -> bool:
    return all(getattr(a, f) == getattr(b, f) for f in _ENGINE_FIELDS)


def _new_targets(cfg: WorkerConfig) -> list[TargetState]:
    """The worker's data-parallel targets, unhealthy until its first check passes."""
    return [
        TargetState(
            id=target_id(cfg.name, rank, cfg.dp_size),
            worker=cfg.name,
            dp_rank=rank,
            url=cfg.url,
            role=cfg.role,
            block_size=cfg.block_size,
            healthy=False,
            max_in_flight=cfg.max_in_flight,
        )
        for rank in range(cfg.dp_size)
    ]
