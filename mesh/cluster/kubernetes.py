"""Worker discovery from Kubernetes: EndpointSlices (or Pods) by label selector become workers.

Ownership: ``KubernetesDiscovery`` owns the objects it last saw (``objects``, keyed by
namespace/name) and the workers it added to the ``WorkerRegistry`` (``owned``, source
``discovery``); it never touches a worker of the config or the admin API, and a reload leaves
its workers alone (``WorkerRegistry.reconfigure`` reconciles config workers only).

The loop (``_run``): list (``KubeApi.list_objects``), then watch from the list's
resourceVersion, applying each event to ``objects`` and reconciling the registry after it.
A watch the API server ends is resumed from the last resourceVersion seen (events or
bookmarks); one that breaks is resumed the same way after a backoff (0.2 s doubling to
``backoff_max_s``, reset by the next event); a 410 Gone lists again, and the relist is
reconciled like any event: workers still there stay as they are (their health, load, sessions
and cached prefixes), only what changed is added or removed.

Reconciling (``desired_workers``, then ``reconcile``): every ready endpoint (EndpointSlice
``conditions.ready``, unset counting as ready; a pod's Ready condition) is a worker named after
its pod, at ``scheme://address:port``; a terminating one that still serves is drained; any
other, and one that leaves, is removed. A new worker is health-checked at once, as ``POST
/workers`` does. An address the connect policy refuses, a name a config or admin worker
already has, or metadata that makes no valid worker, is left out with a WARNING (once per
reason) and shown in ``describe()["refused"]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import ValidationError

from mesh.cluster.kube_api import Gone, KubeApi, KubeApiError, WatchEvent
from mesh.cluster.registry import RegistryError, Worker, WorkerRegistry
from mesh.config import WORKER_NAME, KubernetesDiscoveryConfig, WorkerConfig

if TYPE_CHECKING:
    from mesh.gateway.upstream import UpstreamPool

log = logging.getLogger("mesh.cluster.kubernetes")

ROLE_KEY, MODELS_KEY, BLOCK_SIZE_KEY = "mesh.dev/role", "mesh.dev/models", "mesh.dev/block-size"
BACKOFF_FIRST_S = 0.2
QUICK_END_S = 1.0  # a watch that ends this soon without an event is treated as a failure (backoff)


@dataclass(frozen=True)
class Endpoint:
    """One address of one object, as a worker candidate."""

    name: str
    address: str
    port: int | None  # None: the object names no such port
    kv_events_port: int | None
    ready: bool
    draining: bool  # terminating, still serving
    meta: dict[str, str]  # labels, then annotations over them
    kv_replay_port: int | None = None  # the KV event replay socket's port (None: the object names none)


def object_key(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def _meta(obj: dict[str, Any]) -> dict[str, str]:
    meta = obj.get("metadata") or {}
    return {**(meta.get("labels") or {}), **(meta.get("annotations") or {})}


def _named_port(ports: list[dict[str, Any]], want: str | int | None, name_key: str, port_key: str) -> int | None:
    """``want``'s number: a number as given; a name looked up in ``ports`` (a lone unnamed port
    answers any name: a Service with one port need not name it)."""
    if want is None or isinstance(want, int):
        return want
    for p in ports:
        if p.get(name_key) == want and isinstance(p.get(port_key), int):
            return int(p[port_key])
    if len(ports) == 1 and not ports[0].get(name_key) and isinstance(ports[0].get(port_key), int):
        return int(ports[0][port_key])
    return None


def slice_endpoints(obj: dict[str, Any], cfg: KubernetesDiscoveryConfig) -> list[Endpoint]:
    """The endpoints of an EndpointSlice (discovery.k8s.io/v1), one per address."""
    ports = [p for p in obj.get("ports") or [] if isinstance(p, dict)]
    port = _named_port(ports, cfg.port, "name", "port")
    kv_port = _named_port(ports, cfg.kv_events_port, "name", "port")
    replay_port = _named_port(ports, cfg.kv_events_replay_port, "name", "port")
    meta = _meta(obj)
    out = []
    for ep in obj.get("endpoints") or []:
        if not isinstance(ep, dict):
            continue
        cond = ep.get("conditions") or {}
        ready = cond.get("ready") is not False  # unset: ready (the API's rule for consumers)
        draining = not ready and bool(cond.get("terminating")) and bool(cond.get("serving"))
        ref = ep.get("targetRef") or {}
        for address in ep.get("addresses") or []:
            name = ref.get("name") if ref.get("kind") == "Pod" else ep.get("hostname")
            out.append(Endpoint(str(name or address).replace(":", "-"), str(address), port, kv_port,
                                ready, draining, meta, replay_port))
    return out


def pod_endpoints(obj: dict[str, Any], cfg: KubernetesDiscoveryConfig) -> list[Endpoint]:
    """A pod (v1) as one endpoint: its podIP, ready by its Ready condition."""
    status, spec = obj.get("status") or {}, obj.get("spec") or {}
    address = status.get("podIP")
    if not address or status.get("phase") in ("Succeeded", "Failed"):
        return []
    ports = [p for c in spec.get("containers") or [] for p in c.get("ports") or [] if isinstance(p, dict)]
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    terminating = bool((obj.get("metadata") or {}).get("deletionTimestamp"))
    return [Endpoint(str((obj.get("metadata") or {}).get("name") or address), str(address),
                     _named_port(ports, cfg.port, "name", "containerPort"),
                     _named_port(ports, cfg.kv_events_port, "name", "containerPort"),
                     ready and not terminating, ready and terminating, _meta(obj),
                     _named_port(ports, cfg.kv_events_replay_port, "name", "containerPort"))]


def _kv_events(ep: Endpoint, cfg: KubernetesDiscoveryConfig, host: str) -> dict[str, str] | None:
    """The discovered worker's ``kv_events``: the gateway connects to its publisher (``kv_events_port``),
    or its publisher connects to the gateway's bound endpoint (``kv_events_connect``: named by its
    pod name, llm-d's topic ``kv@POD@MODEL``); None: no events."""
    kv: dict[str, str] = {}
    if ep.kv_events_port is not None:
        kv["endpoint"] = f"tcp://{host}:{ep.kv_events_port}"
    elif cfg.kv_events_port is not None:
        raise ValueError(f"no port {cfg.kv_events_port!r} (kv_events_port) on its object")
    elif not cfg.kv_events_connect:
        return None
    if ep.kv_replay_port is not None:
        kv["replay_endpoint"] = f"tcp://{host}:{ep.kv_replay_port}"
    elif cfg.kv_events_replay_port is not None:
        raise ValueError(f"no port {cfg.kv_events_replay_port!r} (kv_events_replay_port) on its object")
    return kv


def worker_config(ep: Endpoint, cfg: KubernetesDiscoveryConfig) -> WorkerConfig:
    """The worker an endpoint is (raises ValueError with the reason it cannot be one)."""
    if ep.port is None:
        raise ValueError(f"no port {cfg.port!r} on its object")
    if not WORKER_NAME.match(ep.name):
        raise ValueError(f"{ep.name!r} is not a worker name")
    host = f"[{ep.address}]" if ":" in ep.address else ep.address
    data: dict[str, Any] = {"name": ep.name, "url": f"{cfg.scheme}://{host}:{ep.port}",
                            "block_size": ep.meta.get(BLOCK_SIZE_KEY, cfg.block_size)}
    if ROLE_KEY in ep.meta:
        data["role"] = ep.meta[ROLE_KEY]
    if MODELS_KEY in ep.meta:
        data["models"] = [m.strip() for m in ep.meta[MODELS_KEY].split(",") if m.strip()]
    kv = _kv_events(ep, cfg, host)
    if kv is not None:
        data["kv_events"] = kv
    try:
        return WorkerConfig.model_validate(data)
    except ValidationError as exc:
        raise ValueError("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())) from None


def desired_workers(objects: dict[str, dict[str, Any]], cfg: KubernetesDiscoveryConfig
                    ) -> tuple[dict[str, tuple[WorkerConfig, bool]], dict[str, str]]:
    """(worker name -> (its config, draining), endpoint -> why it is left out) of ``objects``.
    An endpoint neither ready nor draining is absent; of two with one name (a dual-stack pod in
    two slices) the ready one, else the first by object key, is taken."""
    extract = slice_endpoints if cfg.resource == "endpointslices" else pod_endpoints
    wanted: dict[str, tuple[WorkerConfig, bool]] = {}
    refused: dict[str, str] = {}
    for key in sorted(objects):
        for ep in extract(objects[key], cfg):
            if not (ep.ready or ep.draining) or (ep.name in wanted and not wanted[ep.name][1]):
                continue
            try:
                wanted[ep.name] = (worker_config(ep, cfg), not ep.ready)
            except ValueError as exc:
                refused[f"{ep.name} ({ep.address})"] = str(exc)
    return wanted, refused


class KubernetesDiscovery:
    """Keeps the registry's discovered workers equal to the ready endpoints the API shows."""

    def __init__(self, cfg: KubernetesDiscoveryConfig, registry: WorkerRegistry) -> None:
        self.cfg = cfg
        self.registry = registry
        self.objects: dict[str, dict[str, Any]] = {}
        self.owned: set[str] = set()
        self._drained: set[str] = set()  # owned workers this drained (terminating endpoints)
        self.refused: dict[str, str] = {}
        self.resource_version: str | None = None
        self.state = "starting"  # starting, watching, backoff
        self.last_error: str | None = None
        self.lists = 0
        self.events = 0
        self.restarts = {"ended": 0, "error": 0, "gone": 0}
        self._api: KubeApi | None = None
        self._pool: UpstreamPool | None = None
        self._task: asyncio.Task[None] | None = None
        self._checks: set[asyncio.Task[bool]] = set()

    async def start(self, pool: UpstreamPool) -> None:
        """Begin listing and watching (raises ``ConfigError`` when no API server is known)."""
        self._api = KubeApi(self.cfg)
        self._pool = pool
        log.info("discovering workers from %s", self._api.where)
        self._task = asyncio.create_task(self._run(self._api), name="mesh-kubernetes-discovery")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._checks) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._task = None
        if self._api is not None:
            await self._api.aclose()

    async def _run(self, api: KubeApi) -> None:
        backoff = BACKOFF_FIRST_S
        while True:
            events, listed = self.events, self.resource_version is None
            try:
                rv = self.resource_version
                if rv is None:
                    rv = await self._relist(api)
                if await self._watch(api, rv):
                    backoff = BACKOFF_FIRST_S
                    self.restarts["ended"] += 1
                    continue
                raise KubeApiError("the watch ended at once without an event")
            except asyncio.CancelledError:
                raise
            except Gone as exc:
                self.restarts["gone"] += 1
                self.resource_version = None
                if not listed or self.events > events:  # an old resourceVersion expired: list again at once
                    log.info("kubernetes discovery: %s; listing again", exc)
                    continue
                self._failed(f"410 Gone right after a list: {exc}", backoff)  # never spin on a server that always says it
            except (KubeApiError, httpx.HTTPError, OSError) as exc:
                self.restarts["error"] += 1
                self._failed(f"{type(exc).__name__}: {exc}", backoff)
            except Exception as exc:  # a bug must not end discovery silently
                log.exception("kubernetes discovery failed; retrying")
                self._failed(f"{type(exc).__name__}: {exc}", backoff)
            if self.events > events:  # the watch ran a while before it broke: a fresh backoff
                backoff = BACKOFF_FIRST_S
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.cfg.backoff_max_s)

    def _failed(self, error: str, backoff: float) -> None:
        level = logging.WARNING if error != self.last_error else logging.INFO
        log.log(level, "kubernetes discovery: %s; retrying in %.1f s (workers kept as last seen)", error, backoff)
        self.last_error, self.state = error, "backoff"

    async def _relist(self, api: KubeApi) -> str:
        items, rv = await api.list_objects()
        self.objects = {object_key(o): o for o in items}
        self.resource_version = rv
        self.lists += 1
        self.reconcile()
        return rv

    async def _watch(self, api: KubeApi, rv: str) -> bool:
        """One watch from ``rv`` until it ends; True when it was a normal one (an event came, or it lasted)."""
        began, seen = time.monotonic(), False
        self.state = "watching"
        async for event in api.watch(rv):
            seen = True
            self.apply(event)
        return seen or time.monotonic() - began >= QUICK_END_S

    def apply(self, event: WatchEvent) -> None:
        """One watch event into ``objects`` (a bookmark moves the resourceVersion only)."""
        if event.resource_version is not None:
            self.resource_version = event.resource_version
        if event.type == "BOOKMARK":
            return
        self.events += 1
        self.last_error = None
        key = object_key(event.object)
        if event.type == "DELETED":
            self.objects.pop(key, None)
        else:
            self.objects[key] = event.object
        self.reconcile()

    def reconcile(self) -> None:
        """Make the registry's discovered workers what ``objects`` say (see the module docstring)."""
        wanted, refused = desired_workers(self.objects, self.cfg)
        gone = [n for n in self.owned if n not in wanted or self._changed(n, wanted[n][0])]
        for name in gone:
            self.owned.discard(name)
        present = [n for n in gone if n in self.registry.workers]
        if present:
            self.registry.remove_many(present)
            log.info("kubernetes discovery: removed %s", ", ".join(sorted(present)))
        self._drained &= self.owned
        for name, (cfg, draining) in wanted.items():
            if name not in self.owned and self._add(cfg, refused) is None:
                continue
            if draining != (name in self._drained):  # as last set here: an admin's drain stays until this changes
                self.registry.drain(name, draining)
                (self._drained.add if draining else self._drained.discard)(name)
        for what, why in refused.items():
            if self.refused.get(what) != why:
                log.warning("kubernetes discovery: endpoint %s left out: %s", what, why)
        self.refused = refused

    def _changed(self, name: str, cfg: WorkerConfig) -> bool:
        worker = self.registry.workers.get(name)
        return worker is None or worker.config != cfg

    def _add(self, cfg: WorkerConfig, refused: dict[str, str]) -> Worker | None:
        try:
            worker = self.registry.add(cfg, source="discovery")
        except RegistryError as exc:  # the connect policy, a name taken by a config or admin worker
            refused[f"{cfg.name} ({cfg.url})"] = str(exc)
            return None
        self.owned.add(cfg.name)
        log.info("kubernetes discovery: added worker %s at %s", cfg.name, cfg.url)
        if self._pool is not None:  # health-checked at once: it takes traffic without waiting a round
            task = asyncio.get_running_loop().create_task(self.registry.check(worker, self._pool))
            self._checks.add(task)
            task.add_done_callback(self._checks.discard)
        return worker

    def describe(self) -> dict[str, Any]:
        """The discovery's state for ``GET /workers``."""
        return {"kubernetes": {"watching": self._api.where if self._api else None, "state": self.state,
                               "resource_version": self.resource_version, "objects": len(self.objects),
                               "workers": sorted(self.owned), "refused": dict(sorted(self.refused.items())),
                               "last_error": self.last_error, "lists": self.lists, "events": self.events,
                               "watch_restarts": dict(self.restarts)}}

    def metric_families(self) -> list[Any]:
        restarts = CounterMetricFamily("mesh_discovery_watch_restarts", "Kubernetes discovery watches restarted, by "
                                       "reason (ended: by the API server; error: broken or refused; gone: 410, listed again)",
                                       labels=["reason"])
        for reason, n in self.restarts.items():
            restarts.add_metric([reason], n)
        return [GaugeMetricFamily("mesh_discovery_workers", "Workers added by Kubernetes discovery", value=len(self.owned)),
                GaugeMetricFamily("mesh_discovery_refused", "Discovered endpoints left out (connect policy, name taken, "
                                  "invalid metadata)", value=len(self.refused)),
                CounterMetricFamily("mesh_discovery_lists", "Kubernetes discovery lists (the first, and each after a 410)",
                                    value=self.lists),
                restarts]
