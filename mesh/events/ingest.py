"""KV event ingestion in the gateway: keeps the prefix index in step with the workers.

``mesh.gateway.app.build_gateway`` builds one ``KvIngest``, registers it as a registry listener,
and starts and stops it in the gateway's lifespan. Ownership:

- ``KvIngest`` owns the gateway's one ``mesh.events.subscriber.KvEventSubscriber`` (created on the
  gateway's loop in ``start``, stopped in ``stop``) and is the only code that subscribes or
  unsubscribes workers. The subscriber's ``mesh_kv_events_*`` metrics live on the app's
  ``CollectorRegistry``. With ``index.ingest_process`` the subscriber's receiver process
  (``mesh.events.process``) starts in ``start`` and ends in ``stop``.
- Registry listeners run synchronously (config load, admin API, reload) while streams are loop
  tasks, so a listener only wakes the keeper task, which reconciles subscriptions one change at a
  time: a worker with ``kv_events`` and a known model namespace is subscribed (one stream per DP
  rank); a removed worker, or one whose config or namespace changed, is unsubscribed and its index
  entries dropped (``mesh.gateway.app._Housekeeper`` drops them at once too, before the stream stops).
- Stream health is copied into ``TargetState.index_healthy`` (``on_health``); a worker with
  ``kv_events`` that is not subscribed yet (model unknown) is not index-healthy.
- The same task warns about blind streams (``mesh.events.blindness``: a worker routed requests
  while its stream delivers nothing) and scrubs the slots of removed and reset targets in
  ``SCRUB_STEP`` steps paced with the event work (``mesh.events.pacer``), every ``TICK_S``.
  Speculative index entries end where they are read: ``Router.view``, before every decision.

Namespace (must equal what ``mesh.request.prompt`` seeds a request's keys with): the router keys a
worker's blocks with ``mesh.core.keys.namespace_seed(model)``, ``model`` being the name the worker
serves (the first of ``models`` when listed, else the one its ``/v1/models`` reports). The bundled
engine seeds its own keys with its served model name and the request's ``cache_salt``
(``workers.engine.llm_engine.LLMEngine._seed``), and a request naming that model is seeded the same way by
the gateway. A salted chain is keyed in its salt's namespace when its BlockStored carries the salt
(vLLM's ``extra_keys`` on the chain's first block, or a ``cache_salt`` field: ``mesh.events.wire``);
an engine that sends no salt has its salted chains indexed in the unsalted namespace (a salted
request is then routed by load; an unsalted one with the same tokens may be credited a hit the
engine does not have).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from mesh.cluster.registry import Worker, WorkerRegistry
from mesh.config import EventsConfig, IndexConfig
from mesh.core.index import PrefixIndex
from mesh.events.blindness import BlindWatch
from mesh.events.limits import SubscriberLimits
from mesh.events.subscriber import KvEventSubscriber, WorkerEvents
from mesh.metrics import Metrics

log = logging.getLogger("mesh.events.ingest")

TICK_S = 0.25  # keeper period: blind-stream checks, scrubbing, model discovery catch-up
SCRUB_STEP = 256  # nodes scrubbed at a time (~0.3 ms)


def namespace_model(worker: Worker) -> str | None:
    """The model name that seeds the router keys of ``worker``'s blocks; None while unknown."""
    if worker.config.models:
        return worker.config.models[0]
    found = worker.discovered_models
    if not found:
        return None
    if len(found) > 1:  # several base models (LoRA adapters are discovered apart: ``discovered_loras``)
        log.warning("worker %s serves several base models %s; keying its KV events as %r (list `models` "
                    "in its config, base model first, to choose)", worker.name, sorted(found), min(found))
    return min(found)


def events_spec(worker: Worker) -> WorkerEvents | None:
    """What to subscribe to for ``worker``; None when it publishes no events or its model is unknown."""
    kv = worker.config.kv_events
    model = namespace_model(worker) if kv is not None else None
    if kv is None or model is None:
        return None
    return WorkerEvents(
        worker=worker.name,
        endpoint=kv.endpoint,
        replay_endpoint=kv.replay_endpoint,
        dp_size=worker.config.dp_size,
        model=model,
        block_size=worker.config.block_size,
        topic=kv.topic,
        lookahead_tokens=kv.lookahead_tokens,
    )


class KvIngest:
    """Registry listener + lifespan hooks that keep one subscriber in step with the registry."""

    def __init__(self, index: PrefixIndex, registry: WorkerRegistry, metrics: Metrics,
                 settings: IndexConfig | None = None, events: EventsConfig | None = None) -> None:
        self.index = index
        self.settings = settings or IndexConfig()
        self.events = events or EventsConfig()  # the bound endpoint and replay timing, read at start
        self.registry = registry
        self.metrics = metrics
        self.subscriber: KvEventSubscriber | None = None
        self._subscribed: dict[str, tuple[Worker, WorkerEvents]] = {}  # name -> (worker, spec)
        self._wake = asyncio.Event()
        self._seen_version = -1
        self._task: asyncio.Task[None] | None = None
        self.blind = BlindWatch()  # loud and visible when a worker serves requests but sends no event

    # -- registry listener (synchronous; may run before the loop exists) --
    def on_worker_added(self, worker: Worker) -> None:
        self._wake.set()

    def on_worker_removed(self, worker: Worker) -> None:
        self._wake.set()

    # -- lifespan --
    async def start(self) -> None:
        cfg, ev = self.settings, self.events
        limits = SubscriberLimits(max_backlog_frames=cfg.max_backlog_frames, backlog_bytes=cfg.max_backlog_bytes,
                                  slice_s=cfg.ingest_slice_ms / 1000, share=cfg.ingest_share,
                                  replay_timeout_s=ev.replay_idle_timeout_s, replay_total_s=ev.max_replay_s)
        self.subscriber = KvEventSubscriber(self.index, limits, registry=self.metrics.registry, bind=ev.bind,
                                            on_health=self._on_health, on_reset=self._on_reset,
                                            process=cfg.ingest_process)
        await self.subscriber.start()  # binds kv_events.bind (a port in use fails the start, loudly)
        await self.reconcile()  # static workers are subscribed before the first request
        self._task = asyncio.get_running_loop().create_task(self._keep(), name="mesh-kv-ingest")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.subscriber is not None:
            await self.subscriber.stop()
            self.subscriber = None
        self._subscribed.clear()

    # -- the keeper --
    async def _keep(self) -> None:
        registry = self.registry
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), TICK_S)
            try:
                now = time.monotonic()
                await self._scrub()
                if self.subscriber is not None:
                    self.blind.check(now, self.subscriber.health(), self.registry.workers)
                if self._wake.is_set() or registry.version != self._seen_version:
                    await self.reconcile()
            except asyncio.CancelledError:
                raise
            except Exception:  # one bad round must not end ingestion
                log.exception("kv ingest round failed")

    async def _scrub(self) -> None:
        """Finish scrubbing reset targets' slots in short steps paced with the event work (one
        step of a few thousand nodes held the loop for ~5 ms; a flood resets streams often)."""
        sub = self.subscriber
        if sub is None:
            return
        while self.index.scrub(SCRUB_STEP):
            await sub.pacer.turn()

    async def reconcile(self) -> None:
        """Subscribe, resubscribe and unsubscribe until subscriptions match the registry."""
        sub, registry = self.subscriber, self.registry
        if sub is None:
            return
        self._wake.clear()
        self._seen_version = registry.version
        wanted: dict[str, tuple[Worker, WorkerEvents]] = {}
        for name, worker in registry.workers.items():
            spec = events_spec(worker)
            if spec is not None:
                wanted[name] = (worker, spec)
            elif worker.config.kv_events is not None:
                self._set_index_health(worker, False)  # events configured, namespace not known yet
        for name, (worker, spec) in list(self._subscribed.items()):
            want = wanted.get(name)
            if want is None or want[0] is not worker or want[1] != spec:
                del self._subscribed[name]
                await sub.remove_worker(name, clear_index=True)
                log.info("kv events of worker %s unsubscribed", name)
        for name, (worker, spec) in wanted.items():
            if name in self._subscribed or registry.workers.get(name) is not worker:
                continue  # (a removal may have run while this loop awaited)
            try:
                sub.add_worker(spec)
            except ValueError as exc:  # e.g. a DP endpoint without a port to offset; tried again on the next change
                log.error("kv events of worker %s cannot be subscribed: %s", name, exc)
                self._set_index_health(worker, False)
                continue
            self._subscribed[name] = (worker, spec)
            for t in worker.targets:
                t.index_healthy = sub.healthy(t.id)
            where = spec.endpoint or f"topic {' | '.join(spec.bound_topics())} at {sub.bound_address}"
            log.info("kv events of worker %s: %s (model %r, block size %d)", name, where, spec.model,
                     spec.block_size or 0)

    # -- subscriber callbacks (on the loop) --
    def _on_health(self, target: str, healthy: bool) -> None:
        state = self.registry.targets.get(target)
        if state is not None:
            state.index_healthy = healthy
        if not healthy:
            log.info("kv events of target %s not trusted for now (routing falls back to load)", target)

    def _on_reset(self, target: str, reason: str) -> None:
        log.debug("prefix index of target %s reset (%s)", target, reason)  # the subscriber logs it (rate-limited)

    @staticmethod
    def _set_index_health(worker: Worker, healthy: bool) -> None:
        for t in worker.targets:
            t.index_healthy = healthy
