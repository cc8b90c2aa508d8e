"""KV event subscriber: one stream per worker rank, feeding the prefix index.

A stream reads either a SUB socket of its own, connected to the worker's bound PUB, or, for a
worker whose publisher connects to the gateway (no ``endpoint``), the frames of its topic on the
gateway's one bound SUB socket (``bind``; ``mesh.events.bound``); either way its seqs, gaps,
replay and health are its own.

Per stream (REFERENCE.md section 2): the next seq is applied; a gap is repaired by replay
(``mesh.events.sockets``); a publisher restart (``mesh.events.stream`` tells it from duplicates
and stale frames) drops the stream's targets from the index, rebuilt from the replay buffer. On
connect a stream asks for the whole replay buffer (ZMQ's slow joiner misses the start); after a
lost connection it is unhealthy until the first frame proved continuity through the replay
socket, before it is applied (a publisher that restarted while disconnected may resume at exactly
``last + 1``). Whenever batches are lost for good (no replay socket, a buffer that no longer
reaches back, a payload that cannot be decoded or exceeds ``max_frame_bytes``), the stream's
targets are reset: the index may then miss blocks the worker holds, never claim dropped ones.
A stream is not trusted from the moment it needs a replay until one completed; a failed one is
retried (``mesh.events.recovery``).
Off the request loop: a receiver thread (``mesh.events.inbox``) receives every stream's frames
into the stream's bounded inbox; or, with ``process=True``, a receiver process
(``mesh.events.child``, run by ``mesh.events.process``) owns the SUB sockets and puts each frame
there decoded and keyed (``mesh.events.prepare``), leaving only index mutation to the loop (a
child that dies is restarted and every stream reset: reason ``receiver_lost``); a stream whose backlog exceeds its budget (``max_backlog_frames``
or ``max_backlog_bytes``: ingestion cannot keep up) is reset (reason ``backlog``, a loud,
rate-limited WARNING), its backlog discarded, and rebuilt from replay like any lost batch.
Ownership: the stream tasks run on the gateway's event loop and are the only writers of the index
for their targets' engine events (the router writes speculative entries on the same loop: no
lock; the receiver thread never touches the index nor a ``Stream``'s protocol state). Frames are
applied in paced slices (``mesh.events.pacer``: ``slice_s`` of work at a time, at most ``share``
of the loop while a flood lasts; within a frame, ``mesh.events.apply``), so that a flooding
publisher cannot starve the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable

import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from mesh.core.index import PrefixIndex
from mesh.events.apply import MAX_SEEDS, Seeds, apply_batch, apply_ops
from mesh.events.bound import Demux
from mesh.events.child_streams import ChildStreams, prepared_size
from mesh.events.health import HealthCollector, LogLimiter, StreamHealth
from mesh.events.inbox import DISCONNECTED, Inbox, Item, Receiver, Watch
from mesh.events.limits import SubscriberLimits
from mesh.events.ops import LOST, Prepared
from mesh.events.pacer import Pacer
from mesh.events.process import ProcessReceiver, unpack
from mesh.events.recovery import MAX_REPLAY_TRIES, MAX_RETRY_S, Recovery
from mesh.events.sockets import cancel, close_stream, connection_event, monitor_sub
from mesh.events.stream import Payload, Stream, Verdict, WorkerEvents, digest_of, offset_endpoint, split_frame
from mesh.events.wire import DecodeError, GroupFilter, LazyBatch, decode_lazy
from policies.base import target_id

__all__ = ["MAX_REPLAY_TRIES", "MAX_RETRY_S", "KvEventSubscriber", "LogLimiter", "StreamHealth", "WorkerEvents", "offset_endpoint"]

log = logging.getLogger(__name__)

_MAX_SEEDS = MAX_SEEDS  # the bound of the (model, LoRA) seed cache (``mesh.events.apply.Seeds``)


def _parsed(frames: Item) -> tuple[int, Payload] | None:
    """``(seq, payload)`` of a live frame (a prepared one is its own payload); None if malformed."""
    if type(frames) is Prepared:
        return None if frames.error == "malformed" else (frames.seq, frames)
    return split_frame(frames)


class KvEventSubscriber(Recovery, ChildStreams):
    """Subscribes to every configured worker's KV events and keeps ``index`` in step.

    ``on_health(target, healthy)`` is called when a stream's health flips; ``on_reset(target,
    reason)`` after a target's index entries were dropped. Both run on the event loop and must
    not block. Health per stream is exported as ``mesh_kv_events_*`` metrics on ``registry``.
    """

    def __init__(
        self,
        index: PrefixIndex,
        limits: SubscriberLimits = SubscriberLimits(),
        *,
        registry: CollectorRegistry | None = None,
        bind: str | None = None,
        on_health: Callable[[str, bool], None] | None = None,
        on_reset: Callable[[str, str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        process: bool = False,
    ) -> None:
        self.index = index
        self.limits = limits
        self.bind = bind
        self.pacer = Pacer(limits.slice_s, limits.share, clock=time.perf_counter)
        self.on_health = on_health
        self.on_reset = on_reset
        self.clock = clock
        self._logs = LogLimiter(clock=clock)
        self._ctx = zmq.asyncio.Context()
        self._sync_ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.shadow(self._ctx.underlying)
        self._receiver = Receiver()
        # with ``process``: the receiver process in the thread's place (started by ``start``)
        self._child = ProcessReceiver(self._ctx, on_connection=self._child_connection, on_lost=self._child_lost,
                                      on_unknown=self._child_unknown) if process else None
        self._sids: dict[int, Stream] = {}  # the receiver process's stream ids
        self._sid_of: dict[str, int] = {}  # target -> sid
        self._next_sid = 0
        self._streams: dict[str, Stream] = {}  # target -> stream
        self._by_worker: dict[str, list[str]] = {}
        self._seeds = Seeds()
        self._registry = registry
        self._collector = HealthCollector(self.health, self._is_healthy, clock, self._backlog)
        if registry is not None:
            registry.register(self._collector)
        self._closed = False
        self._demux: Demux | None = None
        self.bound_address: str | None = None  # where the bound socket listens (a port 0 resolved)

    # ------------------------------------------------------------------ lifecycle
    async def start(self, workers: Iterable[WorkerEvents] = ()) -> None:
        """Bind the gateway's endpoint when ``bind`` is set (raises ZMQError when it cannot: a
        port in use), then subscribe ``workers``."""
        if self._child is not None:
            await self._child.start()
        if self.bind is not None and self._demux is None:
            if self._child is not None:
                await self._open_bound_child(self.bind)
            else:
                self._open_bound(self.bind)
        for w in workers:
            self.add_worker(w)

    def _open_bound(self, bind: str) -> None:
        sub = self._sync_ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, self.limits.rcvhwm)
            sub.setsockopt(zmq.SUBSCRIBE, b"")  # every topic: frames are told apart by ``Demux``
            sub.bind(bind)
            self.bound_address = sub.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError:
            sub.close(linger=0)
            raise
        self._demux = Demux(bind)
        if self._registry is not None:
            self._registry.register(self._demux)
        self._receiver.add(sub, self._demux)  # the receiver thread's socket from here on
        log.info("kv events: bound %s for the workers whose publishers connect to the gateway", self.bound_address)

    def _new_inbox(self) -> Inbox:
        return Inbox(self.limits.max_backlog_frames, self.limits.max_backlog_bytes,
                     prepared_size if self._child is not None else None)

    def add_worker(self, spec: WorkerEvents) -> list[str]:
        """Start one stream per data-parallel rank (needs a running loop). Returns the targets."""
        if self._closed:
            raise RuntimeError("subscriber is stopped")
        if spec.worker in self._by_worker:
            raise ValueError(f"worker {spec.worker!r} is already subscribed")
        if spec.endpoint is None and self._demux is None:
            raise ValueError(f"worker {spec.worker!r} has no kv_events endpoint and the gateway binds none "
                             "(kv_events.bind): its events cannot be received")
        targets = []
        for rank in range(spec.dp_size):
            tid = target_id(spec.worker, rank, spec.dp_size)
            health = StreamHealth(
                spec.worker,
                tid,
                rank,
                offset_endpoint(spec.endpoint, rank) if spec.endpoint else self._bound_name(),
                offset_endpoint(spec.replay_endpoint, rank) if spec.replay_endpoint else None,
                bound=spec.endpoint is None,
                topic=" | ".join(spec.bound_topics()) if spec.endpoint is None else spec.topic,
            )
            stream = Stream(spec, health)
            if spec.endpoint is None and self._demux is not None:  # routed now: frames sent from here on are its
                stream.inbox = self._new_inbox()
                if self._child is not None:
                    self._child.add_bound(self._sid(stream), stream.inbox, spec.bound_topics(), spec.model,
                                          spec.block_size, self.limits.max_frame_bytes)
                else:
                    self._demux.route(spec.bound_topics(), stream.inbox)
            stream.task = asyncio.get_running_loop().create_task(self._run(stream), name=f"kv-events-{tid}")
            self._streams[tid] = stream
            targets.append(tid)
        self._by_worker[spec.worker] = targets
        return targets

    async def remove_worker(self, worker: str, *, clear_index: bool = True) -> None:
        for tid in self._by_worker.pop(worker, []):
            stream = self._streams.pop(tid)
            if self._demux is not None and stream.inbox is not None:
                self._demux.unroute(stream.inbox)  # (its task may be cancelled before it ever ran)
            self._forget_sid(stream)  # (likewise: the receiver process routes it from ``add_worker`` on)
            await cancel(stream.task)
            if clear_index:
                self.index.clear_target(tid)

    async def stop(self) -> None:
        """Cancel every stream, close every socket and the context. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for worker in list(self._by_worker):
            await self.remove_worker(worker, clear_index=False)
        await asyncio.get_running_loop().run_in_executor(None, self._receiver.stop)
        if self._child is not None:
            await self._child.stop()
        if self._registry is not None:
            for collector in (self._collector, self._demux):
                if collector is not None:
                    with contextlib.suppress(KeyError):
                        self._registry.unregister(collector)
        self._ctx.destroy(linger=0)

    # ------------------------------------------------------------------ queries
    def healthy(self, target: str) -> bool:
        """Whether ``target``'s index entries are trusted (the gateway copies it into
        ``TargetState.index_healthy``)."""
        stream = self._streams.get(target)
        return stream is not None and self._is_healthy(stream.health)

    def settled(self, target: str) -> bool:
        """Whether ``target``'s stream has applied every frame it received (none in its inbox,
        none half-applied): what a reader of the index waits for in tests and benchmarks."""
        stream = self._streams.get(target)
        return stream is not None and not stream.applying and (stream.inbox is None or not stream.inbox.backlog)

    def health(self) -> dict[str, StreamHealth]:
        return {tid: s.health for tid, s in self._streams.items()}

    def targets(self, worker: str) -> list[str]:
        return list(self._by_worker.get(worker, []))

    def _backlog(self, target: str) -> int:
        """Frames of ``target``'s stream received and not applied yet (0 while it is not running)."""
        stream = self._streams.get(target)
        return stream.inbox.backlog if stream is not None and stream.inbox is not None else 0

    def _bound_name(self) -> str:
        """The bound endpoint as configured (as ZMQ resolved it when its port was left to it)."""
        bind = self.bind or ""
        return self.bound_address or bind if bind.endswith(":*") else bind

    def unknown_topics(self) -> dict[str, int]:
        """Frames at the bound endpoint whose topic names no worker, by topic."""
        return dict(self._demux.unknown) if self._demux is not None else {}

    def _is_healthy(self, h: StreamHealth) -> bool:
        if not h.running or not h.connected or h.recovering or h.bad_streak >= self.limits.unhealthy_after_bad_frames:
            return False
        stream = self._streams.get(h.target)
        if stream is not None and stream.replay_due:
            return False  # a replay is needed and has not completed
        if stream is not None and stream.lost and h.last_seq is not None:
            return False  # reconnected, continuity unproven: the publisher may have restarted
        if self.limits.stale_after_s is not None:
            return h.last_event_at is not None and self.clock() - h.last_event_at <= self.limits.stale_after_s
        return True

    # ------------------------------------------------------------------ stream task
    async def _run(self, stream: Stream) -> None:
        if stream.spec.endpoint is None:
            await self._run_bound(stream)
        else:
            await self._run_own(stream)

    async def _run_bound(self, stream: Stream) -> None:
        """A stream of the bound endpoint: its inbox receives the frames its topics name."""
        demux, inbox = self._demux, stream.inbox
        assert demux is not None and inbox is not None  # routed by add_worker
        try:
            self._set_running(stream, True)
            if stream.health.replay_endpoint:
                await self._recover(stream, "connect")
            await self._receive(stream, inbox)
        except zmq.ZMQError as exc:
            if not self._closed:
                log.error("kv events %s: socket error %s", stream.health.target, exc)
        finally:
            demux.unroute(inbox)
            self._forget_sid(stream)
            self._set_running(stream, False)
            close_stream(stream)
            stream.inbox = None

    async def _run_own(self, stream: Stream) -> None:
        """A stream of its own SUB socket, connected to the worker's PUB."""
        if self._child is not None:
            return await self._run_child(stream)
        h = stream.health
        assert h.endpoint
        sub = self._sync_ctx.socket(zmq.SUB)
        monitor: zmq.Socket[bytes] | None = None
        handed = False
        try:
            # ZMQ's queue holds no more than the budget: what queues there while the stream is
            # being reset is dropped by ZMQ (seen as a gap), not received to be discarded
            monitor = monitor_sub(sub, stream.spec.topic, min(self.limits.rcvhwm, self.limits.max_backlog_frames))
            sub.connect(h.endpoint)
            inbox = stream.inbox = Inbox(self.limits.max_backlog_frames, self.limits.max_backlog_bytes)
            self._receiver.add(sub, inbox, Watch(monitor, inbox, self._connection_teller(stream)))
            handed = True  # from here on the receiver thread's sockets
            self._set_running(stream, True)
            if h.replay_endpoint:
                await self._recover(stream, "connect")
            await self._receive(stream, inbox)
        except asyncio.CancelledError:
            raise
        except zmq.ZMQError as exc:
            if not self._closed:
                log.error("kv events %s: socket error %s", h.target, exc)
        finally:
            self._set_running(stream, False)
            if handed:
                self._receiver.remove(sub)  # (and its monitor)
            else:
                sub.close(linger=0)
                if monitor is not None:
                    monitor.close(linger=0)
            close_stream(stream)
            stream.inbox = None

    def _connection_teller(self, stream: Stream) -> Callable[[int], None]:
        """How the receiver thread tells the loop ``stream``'s connection events (a disconnect
        once its marker is in the inbox): applied on the loop while the stream runs."""
        loop = asyncio.get_running_loop()

        def connection(event: int) -> None:
            if stream.inbox is not None:  # (else the stream ended since)
                connection_event(stream, event, self._notify)

        def tell(event: int) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens
                loop.call_soon_threadsafe(connection, event)

        return tell

    async def _receive(self, stream: Stream, inbox: Inbox) -> None:
        pacer = self.pacer
        loop = asyncio.get_running_loop()
        n = 0
        while True:
            if stream.replay_due and not stream.health.recovering and loop.time() >= stream.retry_at:
                await self._retry(stream)
            frames = inbox.take()
            if frames is None:
                pacer.idle()
                frames = await self._next(stream, inbox, loop)
                if frames is None:
                    continue  # a failed replay's retry is due
            if inbox.overflowed():
                await self._overflow(stream, inbox)
                continue
            await pacer.turn()
            await self._on_live(stream, frames)
            n += 1
            if n >= self.limits.frames_per_yield:  # between slices too: other streams' turns interleave
                n = 0
                await asyncio.sleep(0)

    async def _overflow(self, stream: Stream, inbox: Inbox) -> None:
        """The backlog went over the budget: ingestion cannot keep up with this stream. Its
        backlog is discarded and its targets reset, then rebuilt from replay (frames arriving
        meanwhile were dropped by the receiver: the index may miss blocks, never claim them)."""
        h = stream.health
        frames, size = inbox.backlog, inbox.backlog_bytes
        refused = inbox.dropped  # frames the receiver refused since the overflow (and before, unseen)
        dropped = inbox.discard() + refused - stream.dropped_seen
        stream.dropped_seen = refused
        h.bump(h.dropped, "backlog", dropped)
        self._logs.log(logging.WARNING, (h.target, "backlog"),
                       "kv events %s: backlog of %d frames (%d bytes) over the budget (%d frames, %d bytes): "
                       "events arrive faster than the gateway applies them; the stream is reset and rebuilt "
                       "from replay", h.target, frames, size, self.limits.max_backlog_frames, self.limits.max_backlog_bytes)
        self._reset(stream, "backlog", forget_seq=True)
        sid = self._sid_of.get(h.target)
        if self._child is not None and sid is not None:
            self._child.resume(sid)  # its socket is read again
        if h.replay_endpoint:
            await self._recover(stream, "backlog")

    async def _on_live(self, stream: Stream, frames: Item) -> None:
        h = stream.health
        if self._child is not None:
            frames = unpack(frames)
            if frames.seq < -1:  # a marker
                if frames.error == LOST:
                    return await self._receiver_lost(stream)
                return self._lost(stream)
        elif frames is DISCONNECTED:
            return self._lost(stream)
        parsed = _parsed(frames)
        if parsed is None:
            h.bump(h.dropped, "malformed")
            self._bad(stream)
            return
        seq, payload = parsed
        if h.bound and not h.connected:
            self._heard(stream)
        if stream.lost:
            stream.lost = False  # (a disconnect during the check comes as another marker, after this frame)
            if h.last_seq is not None:
                await self._after_reconnect(stream)
            self._notify(stream)
        verdict = stream.classify(seq, payload)
        if verdict is Verdict.OLD:
            return  # a duplicate, or a stale frame queued before a rebuild
        if verdict is Verdict.FIRST:
            if seq > 0 and h.replay_endpoint and not stream.replay_due:  # batches before it went by unseen
                await self._recover(stream, "late_join")  # (a failed replay's own retry is timed)
        elif verdict is Verdict.GAP:
            await self._recover(stream, "gap")
        elif verdict is Verdict.RESTART:
            self._reset(stream, "restart", forget_seq=True)
            if seq > 0 and h.replay_endpoint:
                await self._recover(stream, "restart")
        if h.last_seq is None or seq > h.last_seq:
            await self._apply_frame(stream, seq, payload)
        elif stream.digests.get(seq) == digest_of(payload):
            h.duplicates += 1  # the replay already carried it

    # ------------------------------------------------------------------ applying
    async def _apply_frame(self, stream: Stream, seq: int, payload: Payload) -> None:
        """Apply one frame, in slices: the envelope is decoded at once (one pass over the bytes,
        no event objects), then events are decoded and applied in order (``apply_batch``). The
        stream task awaits this, so the next frame is never applied before this one is done;
        ``last_seq`` moves first, so a cancelled frame is never applied twice."""
        h = stream.health
        h.last_seq = seq
        stream.remember(seq, payload, self.limits.digest_window)
        batch = self._admit(stream, seq, payload)
        if batch is None:
            return
        h.last_event_at = self.clock()
        if batch.ts > stream.last_ts:
            stream.last_ts = batch.ts
        if h.bad_streak:
            h.bad_streak = 0
            self._notify(stream)
        if batch.data_parallel_rank is not None and batch.data_parallel_rank != h.rank and stream.spec.dp_size > 1:
            h.bump(h.events, "rank_mismatch")
        stream.applying = True
        try:
            if type(batch) is Prepared:
                await apply_ops(self.index, stream, batch.ops, self._seeds, self._logs, self.pacer.turn)
                if batch.unknown:
                    h.bump(h.events, "unknown", batch.unknown)
                if batch.malformed:
                    h.bump(h.events, "malformed", batch.malformed)
            else:
                await apply_batch(self.index, stream, batch, self._seeds, self._logs, self.pacer.turn)  # type: ignore[arg-type]
        finally:
            stream.applying = False
        h.batches += 1  # counted once whole: a frame in progress is not an applied batch

    def _admit(self, stream: Stream, seq: int, payload: Payload) -> LazyBatch | Prepared | None:
        """The frame's envelope (or the prepared frame); None when it is oversized or undecodable
        (its events are lost: the stream's targets are reset, to stop claiming anything)."""
        h = stream.health
        size = payload.size if type(payload) is Prepared else len(payload)
        if size > self.limits.max_frame_bytes:
            h.bump(h.dropped, "oversized")
            self._logs.log(logging.WARNING, (h.target, "oversized"),
                           "kv events %s: seq %d is %d bytes, over max_frame_bytes %d: dropped as lost",
                           h.target, seq, size, self.limits.max_frame_bytes)
            self._bad(stream)
            self._reset(stream, "oversized")
            return None
        if type(payload) is Prepared:
            batch: LazyBatch | Prepared | DecodeError = (
                payload if payload.error is None else DecodeError(payload.error.removeprefix("undecodable: ")))
        else:
            batch = decode_lazy(payload)  # type: ignore[arg-type]
        if isinstance(batch, DecodeError):
            h.decode_errors += 1
            self._logs.log(logging.WARNING, (h.target, "undecodable"), "kv events %s: seq %d undecodable: %s",
                           h.target, seq, batch.reason)
            self._bad(stream)
            self._reset(stream, "undecodable")
            return None
        return batch

    # ------------------------------------------------------------------ state changes
    def _lost(self, stream: Stream) -> None:
        """The connection dropped after the frames met before its marker: the next frame must
        prove continuity (``_after_reconnect``)."""
        stream.lost = True
        self._notify(stream)

    def _reset(self, stream: Stream, reason: str, *, forget_seq: bool = False) -> None:
        h = stream.health
        h.bump(h.resets, reason)
        self._logs.log(logging.WARNING, (h.target, "reset"), "kv events %s: reset (%s)", h.target, reason)
        self.index.clear_target(h.target)
        if self.on_reset is not None:
            self.on_reset(h.target, reason)
        stream.filter = GroupFilter()
        if forget_seq:
            stream.forget_seq()

    def _bad(self, stream: Stream) -> None:
        stream.health.bad_streak += 1
        if stream.health.bad_streak == self.limits.unhealthy_after_bad_frames:
            self._notify(stream)

    def _set_running(self, stream: Stream, running: bool) -> None:
        stream.health.running = running
        self._notify(stream)

    def _heard(self, stream: Stream) -> None:
        """A bound stream's publisher was heard from (its first frame or a replay answer)."""
        stream.health.connected = True
        self._notify(stream)

    def _set_recovering(self, stream: Stream, recovering: bool) -> None:
        stream.health.recovering = recovering
        self._notify(stream)

    def _notify(self, stream: Stream) -> None:
        now = self._is_healthy(stream.health)
        if now != stream.reported_healthy:
            stream.reported_healthy = now
            if self.on_health is not None:
                self.on_health(stream.health.target, now)
