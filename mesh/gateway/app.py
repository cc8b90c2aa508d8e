"""The gateway application: ``create_app(config) -> FastAPI``, composed in one builder.

``build_gateway`` makes every part once and wires them explicitly; all state lives on the
``Gateway`` (``app.state.gateway``), none in module globals. Ownership:
- ``registry`` owns the workers and the ``targets`` dict the router reads; its listeners (the
  ``_Housekeeper``, metrics, prompts, ``ingest``) hear workers come and go.
- ``ingest`` writes worker KV events into ``index``; the ``router`` reads it and makes every
  decision. A reload swaps the router's ``policy`` only: load, bindings and index stay.
- ``sessions`` holds the bindings (with ``state.backend: redis``, a ``SharedSessionTable`` whose
  shared binding ``shared`` mirrors in before each decision).
- The lifespan (``_start``, ``_stop``) owns ``http``, the one pooled upstream client, and
  ``proxy``, the data plane built on it; ``MeshApp.__call__`` sends the completion routes there.
The routes live in ``data_routes``, ``ops_routes``, ``admin_routes``, ``debug_routes`` and
``dashboard_routes`` (the live view).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from fastapi import FastAPI
from pydantic import BaseModel

from mesh.cluster.kubernetes import KubernetesDiscovery
from mesh.cluster.registry import Worker, WorkerRegistry
from mesh.config import ConfigError, MeshConfig, load_config
from mesh.core.index import PrefixIndex
from mesh.core.retention import RetentionPlanner
from mesh.core.router import Router
from mesh.core.sessions import SessionTable
from mesh.errors import MeshError, install_handlers
from mesh.events.ingest import SCRUB_STEP, KvIngest
from mesh.gateway import disagg_proxy
from mesh.gateway.admin_routes import add_admin_routes
from mesh.gateway.admission_queue import AdmissionQueue
from mesh.gateway.client_io import BodyBuffer
from mesh.gateway.dashboard_routes import add_dashboard_routes
from mesh.gateway.data_routes import DATA_ROUTES, add_data_routes, serve_data
from mesh.gateway.debug_routes import add_debug_routes
from mesh.gateway.ops_routes import add_ops_routes
from mesh.gateway.proxy import Proxy
from mesh.gateway.upstream import UpstreamPool
from mesh.metrics import Metrics
from mesh.request.prompt import PromptProcessor

log = logging.getLogger("mesh.gateway.app")

if TYPE_CHECKING:  # redis is imported with its backend only (``_session_table``)
    from mesh.state.redis_state import SharedSessionTable, SharedState


@dataclass(eq=False)
class Gateway:
    """Everything the app owns; one per app (``app.state.gateway``)."""

    config: MeshConfig
    config_path: Path | None
    metrics: Metrics
    registry: WorkerRegistry
    index: PrefixIndex
    sessions: SessionTable
    router: Router
    prompts: PromptProcessor
    ingest: KvIngest
    admission: AdmissionQueue  # requests held while every worker of their model is full
    bodies: BodyBuffer  # the request body bytes held at once (proxy and /debug/route)
    shared: SharedState | None = None  # state.backend: redis
    proxy: Proxy | None = None  # built in the lifespan, on the pooled client
    http: UpstreamPool | None = None  # the one pooled upstream client (proxy and health checks)
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    handle_sighup: bool = False
    # what the command line set over the file (mesh serve's flags and environment), applied again
    # to each reloaded file: a reload must not drop a key or a worker given as a flag
    overrides: Callable[[MeshConfig], MeshConfig] | None = None
    unchecked: list[Worker] = field(default_factory=list)  # added by the last reload, not yet health-checked
    discovery: KubernetesDiscovery | None = None  # discovery.kubernetes: adds and removes workers at runtime

    async def mirror_session(self, session_id: str | None) -> None:
        """With shared state, copy the session's shared binding in before a decision."""
        if self.shared is not None and session_id:
            await self.shared.table.mirror(session_id, time.monotonic())

    def reload(self) -> dict[str, Any]:
        """Re-read the config file and apply it; a broken file keeps the old config (raises)."""
        if self.config_path is None:
            raise MeshError(400, "this gateway was started without a config file", code="no_config_file")
        try:
            new = load_config(self.config_path, allow_empty=False)
            if self.overrides is not None:
                new = self.overrides(new)
            policy = new.build_policy()
        except ConfigError as exc:
            self.metrics.config_reloads_total.labels("error").inc()
            raise MeshError(400, "config not reloaded: " + "; ".join(exc.errors), code="invalid_config") from exc
        # The listen address is restart-only as well; the command line's --host/--port are in
        # ``overrides``, so only the file's own change differs here.
        if changed := restart_only_changes(self.config, new):
            # Applying the rest would leave these looking applied (self.config) while the objects
            # built from them at startup (Redis client, load sync, index budget, upstream pool)
            # still run on the old values.
            self.metrics.config_reloads_total.labels("error").inc()
            raise MeshError(400, "config not reloaded: " + ", ".join(changed) + " take effect only at a restart "
                            "(restart the gateway, or revert them to reload the rest)", code="restart_required")
        self.router.policy = policy
        self.router.speculative_ttl_s = new.index.speculative_ttl_s
        self.sessions.idle_ttl_s = new.sessions.idle_ttl_s
        self.sessions.resize(new.sessions.max_sessions)
        before = set(self.registry.workers.values())
        self.registry.reconfigure(new)
        self.config = new
        self.metrics.config_reloads_total.labels("ok").inc()
        log.info("config reloaded from %s", self.config_path)
        self.unchecked = [w for w in self.registry.workers.values() if w not in before]
        return {"status": "reloaded", "policy": policy.describe(), "workers": sorted(self.registry.workers)}

    async def check_new_workers(self) -> None:
        """Health-check the workers the last reload added now, as ``POST /workers`` does (else
        they stay unhealthy, taking nothing, until the next round of ``health.interval_s``)."""
        workers, self.unchecked = self.unchecked, []
        if self.http is not None and workers:
            await asyncio.gather(*(self.registry.check(w, self.http) for w in workers))


# Settings read once at startup; a reload cannot apply them.
RESTART_ONLY = ("server.host", "server.port", "server.connect_timeout_s", "server.max_head_bytes", "server.head_timeout_s",
                "index.max_keys", "index.ingest_slice_ms", "index.ingest_share", "index.max_backlog_frames", "index.max_backlog_bytes",
                "state", "discovery", "kv_events")


def restart_only_changes(old: MeshConfig, new: MeshConfig) -> list[str]:
    """The ``RESTART_ONLY`` settings (dotted paths; a section means all of it) that differ."""
    def at(config: MeshConfig, path: str) -> Any:
        value: Any = config
        for part in path.split("."):
            value = getattr(value, part)  # a field named by a RESTART_ONLY path
        return value

    changed = []
    for path in RESTART_ONLY:
        a, b = at(old, path), at(new, path)
        if a != b:
            fields = type(a).model_fields if isinstance(a, BaseModel) else {}  # a section: name its fields
            changed += [f"{path}.{f}" for f in fields if getattr(a, f) != getattr(b, f)] or [path]  # by field name
    return changed


class _Housekeeper:
    """Registry listener: forget a removed worker's prefix entries and session bindings."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    def on_worker_added(self, worker: Worker) -> None:
        if worker.config.hybrid:  # matches need a recurrent-state checkpoint from the start
            for t in worker.targets:
                self.gateway.index.mark_hybrid(t.id)

    def on_worker_removed(self, worker: Worker) -> None:
        self.on_workers_removed([worker])

    def on_workers_removed(self, workers: list[Worker]) -> None:
        """Several workers removed as one change (a reload): one pass over the session table
        for all their targets, not one per worker."""
        tids = [t.id for w in workers for t in w.targets]
        retention = self.gateway.router.retention
        for tid in tids:
            self.gateway.index.clear_target(tid)
            self.gateway.index.mark_hybrid(tid, False)
            if retention is not None:
                retention.forget_target(tid)
        self.gateway.sessions.unbind_targets(tids)


class MeshApp(FastAPI):
    """FastAPI with a fast path: the completion routes go straight to the proxy."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            route = DATA_ROUTES.get(scope["path"])
            if route is not None:
                await serve_data(self.state.gateway, scope, receive, send, route)
                return
        await super().__call__(scope, receive, send)


def _session_table(config: MeshConfig) -> SessionTable:
    if config.state.backend == "redis":  # bindings shared by replicas (mesh.state.redis_state)
        from mesh.state.redis_state import shared_session_table  # redis is imported for this backend only

        return shared_session_table(config)
    return SessionTable(idle_ttl_s=config.sessions.idle_ttl_s, max_sessions=config.sessions.max_sessions)


def _retention(config: MeshConfig) -> RetentionPlanner:
    r = config.retention
    return RetentionPlanner(r.fill, r.active_s, spill_hint=r.spill_hint, idle_factor=r.idle_factor)


def build_gateway(config: MeshConfig, config_path: str | Path | None = None) -> Gateway:
    metrics = Metrics()
    registry = WorkerRegistry(config)
    index = PrefixIndex(max_keys=config.index.max_keys, scrub_budget=SCRUB_STEP)  # the keeper scrubs the rest
    sessions = _session_table(config)
    admission = AdmissionQueue(lambda: registry.config.admission, metrics)
    router = Router(
        config.build_policy(),
        registry.targets,
        index=index,
        sessions=sessions,
        speculative_ttl_s=config.index.speculative_ttl_s,
        on_release=admission.released,
        retention=_retention(config),
        seed=config.seed,
    )
    gateway = Gateway(
        config=config,
        config_path=Path(config_path) if config_path else None,
        metrics=metrics,
        registry=registry,
        index=index,
        sessions=sessions,
        router=router,
        admission=admission,
        bodies=BodyBuffer(lambda: registry.config.server.max_buffered_body_bytes),
        prompts=PromptProcessor(registry),
        ingest=KvIngest(index, registry, metrics, config.index, config.kv_events),
    )
    if config.state.backend == "redis":
        from mesh.state.redis_state import SharedState

        gateway.shared = SharedState(cast("SharedSessionTable", sessions), registry.targets, metrics,
                                     config.state.load_sync_s)
    registry.add_listener(_Housekeeper(gateway))
    registry.add_listener(metrics)  # a removed worker's labelled series leave /metrics with it
    registry.add_listener(gateway.prompts)  # a worker's tokenizer is loaded when it joins
    registry.add_listener(gateway.ingest)  # before the static workers: it hears them too
    for worker in config.workers:
        registry.add(worker, source="config")
    if config.discovery.kubernetes is not None:
        gateway.discovery = KubernetesDiscovery(config.discovery.kubernetes, registry)
        metrics.add_collector(gateway.discovery.metric_families)
    metrics.add_collector(registry.metric_families)
    metrics.add_collector(lambda: _router_families(gateway))
    metrics.add_collector(lambda: _index_families(index))
    return gateway


def _index_families(index: PrefixIndex) -> list[Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    return [GaugeMetricFamily("mesh_index_keys", "Blocks (router keys) in the prefix index", value=len(index)),
            GaugeMetricFamily("mesh_index_max_keys", "The index's bound, index.max_keys (0: unbounded)",
                              value=index.max_keys),
            CounterMetricFamily("mesh_index_evicted", "Keys evicted by index.max_keys, least recently used first",
                                value=index.evicted)]


def _router_families(gateway: Gateway) -> list[Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    moves = CounterMetricFamily("mesh_session_moves", "Sessions re-bound to another target", value=gateway.router.session_moves)
    out: list[Any] = [moves]
    retention = gateway.router.retention
    out.append(CounterMetricFamily("mesh_retention_spilled", "Requests sent with the retention hint x-mesh-retention: spill",
                                   value=retention.spilled if retention is not None else 0))
    sessions = gateway.sessions
    # Bindings still held: idle ones are expired first (else they counted until the next
    # decision or housekeeping round); mesh_sessions is the older name of the same gauge.
    sessions.expire(time.monotonic())
    live = len(sessions)
    out.append(GaugeMetricFamily("mesh_sessions_live", "Session bindings held", value=live))
    out.append(GaugeMetricFamily("mesh_sessions", "Session bindings held (alias of mesh_sessions_live)", value=live))
    out.append(CounterMetricFamily("mesh_session_created", "Sessions bound for the first time", value=sessions.created))
    out.append(CounterMetricFamily("mesh_session_expired", "Bindings dropped after their idle time", value=sessions.expired))
    out.append(CounterMetricFamily("mesh_session_evicted", "Bindings evicted beyond sessions.max_sessions",
                                   value=sessions.evicted))
    return out


def create_app(config: MeshConfig | None = None, *, config_path: str | Path | None = None, handle_sighup: bool = False,
               overrides: Callable[[MeshConfig], MeshConfig] | None = None) -> FastAPI:
    """The gateway app. ``config_path`` enables ``POST /admin/reload`` (and SIGHUP when asked);
    ``overrides`` (raising ``ConfigError``) is applied to each reloaded file."""
    config = config or (load_config(config_path) if config_path else MeshConfig())
    gateway = build_gateway(config, config_path)
    gateway.handle_sighup = handle_sighup
    gateway.overrides = overrides

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await _start(gateway)
        try:
            yield
        finally:
            await _stop(gateway)

    # The docs routes are ops routes (behind the API key); no trailing-slash redirects (their
    # Location would carry the client's Host header).
    app = MeshApp(title="Mesh", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  redirect_slashes=False)
    app.state.gateway = gateway
    install_handlers(app)
    add_data_routes(app, gateway)
    add_ops_routes(app, gateway)
    add_debug_routes(app, gateway)
    add_admin_routes(app, gateway)
    add_dashboard_routes(app, gateway)
    return app


async def _start(gateway: Gateway) -> None:
    gateway.http = UpstreamPool(connect_timeout_s=gateway.config.server.connect_timeout_s)
    gateway.proxy = _build_proxy(gateway, gateway.http)
    await gateway.registry.check_all(gateway.http, gateway.metrics)  # usable at once, not after one interval
    if gateway.shared is not None:
        await gateway.shared.start()
    await gateway.ingest.start()
    if gateway.discovery is not None:
        await gateway.discovery.start(gateway.http)
    gateway.tasks.append(asyncio.create_task(_housekeeping(gateway)))
    # Everything allocated so far lives as long as the app: keep it out of the cyclic GC's scans,
    # so that full collections stay short on the request path.
    gc.collect()
    gc.freeze()
    if gateway.handle_sighup:
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signal.SIGHUP, _reload_on_signal, gateway)


def _build_proxy(gateway: Gateway, pool: UpstreamPool) -> Proxy:
    """The data plane: a ``DisaggProxy`` when the config can form prefill/decode pairs (workers
    with roles or policy profiles; workers added later do not change that), else a ``Proxy``."""
    mirror = gateway.shared.table.mirror if gateway.shared is not None else None
    args = (pool, gateway.registry, gateway.router, gateway.prompts, gateway.metrics, gateway.admission)
    if not disagg_proxy.wanted(gateway.config):
        return Proxy(*args, mirror=mirror, bodies=gateway.bodies)
    server = gateway.config.server
    return disagg_proxy.DisaggProxy(
        *args, mirror=mirror, bodies=gateway.bodies, http=disagg_proxy.relay_client(server.request_timeout_s, server.connect_timeout_s),
        config=disagg_proxy.RelayConfig(timeout_s=server.request_timeout_s, connect_timeout_s=server.connect_timeout_s,
                                        first_byte_timeout_s=server.first_byte_timeout_s,
                                        idle_timeout_s=server.idle_timeout_s))


async def _stop(gateway: Gateway) -> None:
    # In reverse order of _start; one failing step must not keep the others from running.
    steps: list[Callable[[], Awaitable[None]]] = []
    if gateway.discovery is not None:
        steps.append(gateway.discovery.stop)
    if gateway.proxy is not None:
        steps.append(gateway.proxy.aclose)
    steps.append(gateway.ingest.stop)
    if gateway.shared is not None:
        steps.append(gateway.shared.stop)
    for step in steps:
        try:
            await step()
        except Exception:
            log.exception("shutdown step failed")
    for task in gateway.tasks:
        task.cancel()
    for task in gateway.tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
    gateway.tasks.clear()
    await gateway.registry.stop()  # the /metrics scrapes in flight (the health loop is stopped: none starts)
    gateway.proxy = None
    if gateway.http is not None:
        await gateway.http.close()
        gateway.http = None


async def end_in_flight(gateway: Gateway) -> None:
    """A shutdown's drain timed out: close every upstream connection, so that each request still
    in flight ends as a broken upstream does (a stream with whole events, then an error event; an
    unanswered request with an error answer, its retries refused by the closed pool) rather than
    being cut off mid-write. The lifespan's shutdown closes the pool again (a no-op)."""
    if gateway.proxy is not None:
        gateway.proxy.shut_down()  # first: the breaks the close causes are not the workers' failures
    if gateway.http is not None:
        await gateway.http.close()


def _reload_on_signal(gateway: Gateway) -> None:
    try:
        gateway.reload()
    except MeshError as exc:
        log.error("SIGHUP reload failed, keeping the old config: %s", exc.message)
        return
    gateway.tasks[:] = [t for t in gateway.tasks if not t.done()]
    gateway.tasks.append(asyncio.create_task(gateway.check_new_workers()))


async def _housekeeping(gateway: Gateway) -> None:
    """Health checks and session expiry, every ``health.interval_s``."""
    while True:
        await asyncio.sleep(gateway.config.health.interval_s)
        try:
            if gateway.http is not None:
                await gateway.registry.check_all(gateway.http, gateway.metrics)
                gateway.http.prune()
            gateway.sessions.expire(time.monotonic())
        except asyncio.CancelledError:
            raise
        except Exception:  # one bad round must not end health checking
            log.exception("housekeeping round failed")
