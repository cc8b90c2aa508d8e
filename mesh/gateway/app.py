"""The gateway application: ``create_app(config) -> FastAPI``.

All state lives on ``app.state`` (``Gateway``), none in module globals:

- ``registry`` (``mesh.cluster.registry.WorkerRegistry``) owns workers and their ``TargetState``s and the
  ``targets`` dict the router reads; its listeners hear workers come and go (start/stop KV event
  subscribers there: ``app.state.gateway.registry.add_listener(...)``).
- ``index`` (``mesh.core.index.PrefixIndex``) is handed to the ``Router``; KV event subscribers write
  into it. A removed worker's entries are cleared by the ``_Housekeeper`` listener.
- ``ingest`` (``mesh.events.ingest.KvIngest``) owns the one ``KvEventSubscriber``: a registry
  listener and lifespan hook that subscribes every worker with ``kv_events`` (static or added at
  runtime), copies stream health into ``TargetState.index_healthy`` and ends speculative entries.
- ``sessions`` (``mesh.core.sessions.SessionTable``) holds session bindings; the router writes them.
  With ``state.backend: redis`` it is a ``mesh.state.redis_state.SharedSessionTable``: each request's
  shared binding is mirrored in before its decision, commits are written behind to Redis.
- ``router`` (``mesh.core.router.Router``) makes every routing decision; its ``policy`` is swapped on
  reload while load, bindings and index stay.
- ``http`` (``mesh.gateway.upstream.UpstreamPool``) is the one pooled upstream client, created in the
  lifespan (proxying, health checks, model discovery).
- ``proxy`` (``mesh.gateway.proxy.Proxy``, created in the lifespan with the pooled client) serves the
  data plane at raw ASGI level: ``MeshApp.__call__`` sends the two completion routes straight
  to it, bypassing FastAPI's routing (measured: that layer alone cost ~40% of the rate).
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
from typing import Any

import msgspec
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from mesh.events.ingest import KvIngest
from mesh.gateway import disagg_proxy
from mesh.config import ConfigError, MeshConfig, WorkerConfig, load_config
from mesh.errors import MeshError, install_handlers
from mesh.core.index import PrefixIndex
from mesh.metrics import CONTENT_TYPE, Metrics
from mesh.core.preview import unchanged
from mesh.request.prompt import PromptProcessor
from mesh.gateway.proxy import Proxy, check_bearer, read_body
from mesh.cluster.registry import RegistryError, Worker, WorkerRegistry
from mesh.core.router import Router
from mesh.core.sessions import SessionTable
from mesh.state.redis_state import SharedSessionTable, SharedState, shared_session_table
from mesh.gateway.upstream import UpstreamPool
from policies.base import NoCandidate

log = logging.getLogger("mesh.gateway.app")

# path -> (request kind, metrics route label)
DATA_ROUTES = {"/v1/chat/completions": ("chat", "chat"), "/v1/completions": ("completion", "completions")}


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
    shared: SharedState | None = None  # state.backend: redis
    proxy: Proxy | None = None  # built in the lifespan, on the pooled client
    http: UpstreamPool | None = None  # the one pooled upstream client (proxy and health checks)
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    handle_sighup: bool = False
    unchecked: list[Worker] = field(default_factory=list)  # added by the last reload, not yet health-checked

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
            policy = new.build_policy()
        except ConfigError as exc:
            self.metrics.config_reloads_total.labels("error").inc()
            raise MeshError(400, "config not reloaded: " + "; ".join(exc.errors), code="invalid_config") from exc
        # The listener stays where it is (host and port may also come from the command line).
        new = new.model_copy(update={"server": new.server.model_copy(
            update={"host": self.config.server.host, "port": self.config.server.port})})
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
        """Health-check the workers the last reload added now, as ``POST /workers`` does (they
        were unhealthy, answering nothing, until the next round of ``health.interval_s``)."""
        workers, self.unchecked = self.unchecked, []
        if self.http is not None and workers:
            await asyncio.gather(*(self.registry.check(w, self.http) for w in workers))


# Settings read once at startup; a reload cannot apply them (the listen address is not among
# them: a reload keeps the running one, which the command line may have set).
RESTART_ONLY = ("server.connect_timeout_s", "index.max_keys", "state")


def restart_only_changes(old: MeshConfig, new: MeshConfig) -> list[str]:
    """The ``RESTART_ONLY`` settings (dotted paths; a section means all of it) that differ."""
    def at(config: MeshConfig, path: str) -> Any:
        value: Any = config
        for part in path.split("."):
            value = getattr(value, part)
        return value

    changed = []
    for path in RESTART_ONLY:
        a, b = at(old, path), at(new, path)
        if a != b:
            fields = type(a).model_fields if hasattr(type(a), "model_fields") else {}
            changed += [f"{path}.{f}" for f in fields if getattr(a, f) != getattr(b, f)] or [path]
    return changed


class _Housekeeper:
    """Registry listener: forget a removed worker's prefix entries and session bindings."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    def on_worker_added(self, worker: Worker) -> None:
        return None

    def on_worker_removed(self, worker: Worker) -> None:
        self.on_workers_removed([worker])

    def on_workers_removed(self, workers: list[Worker]) -> None:
        """Several workers removed as one change (a reload): one pass over the session table
        for all their targets, not one per worker."""
        tids = [t.id for w in workers for t in w.targets]
        for tid in tids:
            self.gateway.index.clear_target(tid)
        self.gateway.sessions.unbind_targets(tids)


class MeshApp(FastAPI):
    """FastAPI with a fast path: the completion routes go straight to the proxy."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            route = DATA_ROUTES.get(scope["path"])
            if route is not None:
                await _serve_data(self.state.gateway, scope, receive, send, route)
                return
        await super().__call__(scope, receive, send)


async def _serve_data(gateway: Gateway, scope: Any, receive: Any, send: Any, route: tuple[str, str]) -> None:
    proxy = gateway.proxy
    if proxy is None:
        response = MeshError(503, "gateway is starting or stopping", code="not_ready").response()
        await response(scope, receive, send)
        return
    await proxy.handle(scope, receive, send, route[0], route[1])


class _ProxyResponse(Response):
    """Hands the untouched ASGI exchange to the proxy (the request body is still unread)."""

    def __init__(self, gateway: Gateway, route: tuple[str, str]) -> None:
        super().__init__()
        self.gateway = gateway
        self.route = route

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await _serve_data(self.gateway, scope, receive, send, self.route)


_BODY_SCHEMA = {
    "chat": {
        "type": "object",
        "required": ["model", "messages"],
        "properties": {
            "model": {"type": "string"},
            "messages": {"type": "array", "items": {"type": "object"}},
            "stream": {"type": "boolean"},
            "max_tokens": {"type": "integer"},
            "user": {"type": "string"},
        },
    },
    "completion": {
        "type": "object",
        "required": ["model", "prompt"],
        "properties": {
            "model": {"type": "string"},
            "prompt": {"oneOf": [{"type": "string"}, {"type": "array"}]},
            "stream": {"type": "boolean"},
            "max_tokens": {"type": "integer"},
            "user": {"type": "string"},
        },
    },
}


def _add_data_routes(app: FastAPI, gateway: Gateway) -> None:
    """Documented in the OpenAPI schema; ``MeshApp.__call__`` serves them before FastAPI routing."""
    def endpoint_for(route: tuple[str, str]) -> Any:
        async def endpoint() -> Response:
            return _ProxyResponse(gateway, route)

        return endpoint

    for path, route in DATA_ROUTES.items():
        app.add_api_route(
            path,
            endpoint_for(route),
            methods=["POST"],
            tags=["openai"],
            summary=f"OpenAI {route[0]} completion, proxied to the chosen worker (streaming or not)",
            openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": _BODY_SCHEMA[route[0]]}}}},
        )


def _session_table(config: MeshConfig) -> SessionTable:
    if config.state.backend == "redis":  # bindings shared by replicas (mesh.state.redis_state)
        return shared_session_table(config)
    return SessionTable(idle_ttl_s=config.sessions.idle_ttl_s, max_sessions=config.sessions.max_sessions)


def build_gateway(config: MeshConfig, config_path: str | Path | None = None) -> Gateway:
    metrics = Metrics()
    registry = WorkerRegistry(config)
    index = PrefixIndex(max_keys=config.index.max_keys)
    sessions = _session_table(config)
    router = Router(
        config.build_policy(),
        registry.targets,
        index=index,
        sessions=sessions,
        speculative_ttl_s=config.index.speculative_ttl_s,
    )
    gateway = Gateway(
        config=config,
        config_path=Path(config_path) if config_path else None,
        metrics=metrics,
        registry=registry,
        index=index,
        sessions=sessions,
        router=router,
        prompts=PromptProcessor(registry),
        ingest=KvIngest(index, registry, metrics),
    )
    if isinstance(sessions, SharedSessionTable):
        gateway.shared = SharedState(sessions, registry.targets, metrics, config.state.load_sync_s)
    registry.add_listener(_Housekeeper(gateway))
    registry.add_listener(metrics)  # a removed worker's labelled series leave /metrics with it
    registry.add_listener(gateway.prompts)  # a worker's tokenizer is loaded when it joins
    registry.add_listener(gateway.ingest)  # before the static workers: it hears them too
    for worker in config.workers:
        registry.add(worker, source="config")
    metrics.add_collector(registry.metric_families)
    metrics.add_collector(lambda: _router_families(gateway))
    return gateway


def _router_families(gateway: Gateway) -> list[Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    moves = CounterMetricFamily("mesh_session_moves", "Sessions re-bound to another target", value=gateway.router.session_moves)
    out = [moves]
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


def create_app(config: MeshConfig | None = None, *, config_path: str | Path | None = None, handle_sighup: bool = False) -> FastAPI:
    """The gateway app. ``config_path`` enables ``POST /admin/reload`` (and SIGHUP when asked)."""
    config = config or (load_config(config_path) if config_path else MeshConfig())
    gateway = build_gateway(config, config_path)
    gateway.handle_sighup = handle_sighup

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await _start(gateway)
        try:
            yield
        finally:
            await _stop(gateway)

    app = MeshApp(title="Mesh", version="0.1.0", lifespan=lifespan, docs_url="/docs", redoc_url=None)
    app.state.gateway = gateway
    install_handlers(app)
    _add_data_routes(app, gateway)
    _add_routes(app, gateway)
    return app


async def _start(gateway: Gateway) -> None:
    gateway.http = UpstreamPool(connect_timeout_s=gateway.config.server.connect_timeout_s)
    gateway.proxy = _build_proxy(gateway, gateway.http)
    await gateway.registry.check_all(gateway.http, gateway.metrics)  # usable at once, not after one interval
    if gateway.shared is not None:
        await gateway.shared.start()
    await gateway.ingest.start()
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
    args = (pool, gateway.registry, gateway.router, gateway.prompts, gateway.metrics)
    if not disagg_proxy.wanted(gateway.config):
        return Proxy(*args, mirror=mirror)
    server = gateway.config.server
    return disagg_proxy.DisaggProxy(
        *args, mirror=mirror, http=disagg_proxy.relay_client(server.request_timeout_s, server.connect_timeout_s),
        config=disagg_proxy.RelayConfig(timeout_s=server.request_timeout_s, connect_timeout_s=server.connect_timeout_s))


async def _stop(gateway: Gateway) -> None:
    # In reverse order of _start; one failing step must not keep the others from running.
    steps: list[Callable[[], Awaitable[None]]] = []
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


def _add_routes(app: FastAPI, gateway: Gateway) -> None:
    def data_auth(request: Request) -> None:
        keys = gateway.config.server.api_keys
        if keys:
            check_bearer(request.scope["headers"], keys, "API key")

    def admin_auth(request: Request) -> None:
        key = gateway.config.server.admin_key
        if not key:
            raise MeshError(403, "the admin API is disabled: set server.admin_key", code="admin_disabled")
        check_bearer(request.scope["headers"], [key], "admin key")

    @app.get("/health", tags=["ops"])
    async def health() -> dict[str, Any]:
        workers = gateway.registry.workers.values()
        healthy = sum(1 for w in workers if w.healthy)
        return {"status": "ok" if healthy else "no_healthy_workers", "workers": len(workers), "healthy_workers": healthy}

    @app.get("/ready", tags=["ops"])
    async def ready() -> Response:
        healthy = any(w.healthy and not w.draining for w in gateway.registry.workers.values())
        body = {"ready": healthy}
        return JSONResponse(body, status_code=200 if healthy else 503)

    @app.get("/metrics", tags=["ops"])
    async def metrics() -> Response:
        return Response(gateway.metrics.render(), media_type=CONTENT_TYPE)

    def model_card(model: str) -> dict[str, Any]:
        return {"id": model, "object": "model", "created": 0, "owned_by": "mesh"}

    @app.get("/v1/models", tags=["openai"], dependencies=[Depends(data_auth)])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(m) for m in gateway.registry.models()]}

    @app.get("/v1/models/{model:path}", tags=["openai"], dependencies=[Depends(data_auth)])
    async def model(model: str) -> dict[str, Any]:
        """One model (the openai client's ``models.retrieve``); ids may hold slashes."""
        if model not in gateway.registry.models():
            raise MeshError(404, f"the model {model!r} does not exist", code="model_not_found", param="model")
        return model_card(model)

    @app.post("/debug/route", tags=["debug"], dependencies=[Depends(data_auth)])
    async def debug_route(request: Request) -> dict[str, Any]:
        """The decision the router would make for this completion body; forwards and commits nothing."""
        server = gateway.config.server
        raw = await read_body(request.receive, request.scope["headers"], server.max_body_bytes, server.body_idle_timeout_s)
        kind = request.query_params.get("kind") or _body_kind(raw)
        if kind not in ("chat", "completion"):
            raise MeshError(400, "kind must be 'chat' or 'completion'", param="kind")
        header = request.headers.get(gateway.config.sessions.header)
        parsed = await gateway.prompts.process(raw, kind, header.encode("latin-1") if header is not None else None)
        await gateway.mirror_session(parsed.info.session_id)
        now = time.monotonic()
        gateway.registry.tick(now)
        try:  # as the proxy routes: targets at their admission limit are skipped
            with unchanged(gateway.router.policy):  # the next live request decides as shown
                decision = gateway.router.decide(parsed.info, now, exclude=gateway.registry.full_targets())
        except NoCandidate as exc:
            raise MeshError(503, f"no healthy worker: {exc}", code="no_healthy_worker") from exc
        info = parsed.info
        out = {
            "decision": decision.explain(),
            "policy": gateway.router.policy.describe(),
            "request": {
                "kind": kind,
                "model": info.model,
                "lora": info.lora,  # the adapter whose key namespace the prompt is hashed in, if any
                "stream": parsed.stream,
                "prompt_tokens": info.prompt_tokens,
                "block_size": info.block_size,
                "blocks": len(info.block_keys),
                "max_tokens": info.max_tokens,
                "session_id": info.session_id,
            },
            "session": _session_state(gateway, info.session_id, now),
        }
        inner = _inner_decision(gateway, info, decision, now)
        if inner is not None:
            out["inner_decision"] = inner
        return out

    @app.get("/workers", tags=["admin"], dependencies=[Depends(admin_auth)])
    async def list_workers() -> dict[str, Any]:
        return {"workers": [w.describe() for w in gateway.registry.workers.values()]}

    @app.post("/workers", tags=["admin"], status_code=201, dependencies=[Depends(admin_auth)])
    async def add_worker(cfg: WorkerConfig) -> dict[str, Any]:
        worker = _registry_call(gateway.registry.add, cfg, "admin")
        if gateway.http is not None:
            await gateway.registry.check(worker, gateway.http)
        return worker.describe()

    @app.delete("/workers/{name}", tags=["admin"], dependencies=[Depends(admin_auth)])
    async def remove_worker(name: str) -> dict[str, Any]:
        worker = _registry_call(gateway.registry.remove, name)
        return {"removed": worker.name}

    @app.post("/workers/{name}/drain", tags=["admin"], dependencies=[Depends(admin_auth)])
    async def drain_worker(name: str, undo: bool = False) -> dict[str, Any]:
        return _registry_call(gateway.registry.drain, name, not undo).describe()

    @app.post("/admin/reload", tags=["admin"], dependencies=[Depends(admin_auth)])
    async def reload() -> dict[str, Any]:
        out = gateway.reload()
        await gateway.check_new_workers()
        return out


def _session_state(gateway: Gateway, session_id: str | None, now: float) -> dict[str, Any]:
    """The request's binding as the router sees it now (an idle-expired one is ``None``)."""
    sessions = gateway.sessions
    bound = sessions.bound_target(session_id, now) if session_id else None
    return {
        "enabled": True,
        "bound_target": bound,
        "idle_ttl_s": sessions.idle_ttl_s,
        "max_sessions": sessions.max_sessions,
        "live_sessions": len(sessions),
    }


def _inner_decision(gateway: Gateway, info: Any, decision: Any, now: float) -> dict[str, Any] | None:
    """For a wrapper policy whose decision skipped its inner policy (a session kept on its bound
    target), the inner policy's dry run: every candidate's overlap and cost, for debugging only."""
    inner = getattr(gateway.router.policy, "inner", None)
    if inner is None or not hasattr(inner, "decide") or not decision.scores or any(len(s) > 1 for s in decision.scores.values()):
        return None
    try:
        return inner.decide(info, gateway.router.view(now)).explain()  # type: ignore[no-any-return]
    except NoCandidate:
        return None


def _registry_call(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except RegistryError as exc:
        raise MeshError(exc.status, str(exc), code="worker_error") from exc


class _TopLevelKeys(msgspec.Struct):
    messages: msgspec.Raw = msgspec.Raw(b"")  # not decoded: only its presence matters


def _body_kind(raw: bytes) -> str:
    """``chat`` when the body's top-level object has ``messages`` (what ``/v1/chat/completions``
    takes), else ``completion``; a body that is not an object is left to the prompt parser."""
    try:
        return "chat" if len(msgspec.json.decode(raw, type=_TopLevelKeys).messages) else "completion"
    except msgspec.MsgspecError:
        return "completion"
