"""KV event subscriber: one ZMQ SUB stream per worker rank, feeding the prefix index.

Per stream (REFERENCE.md section 2):
- frames ``[topic, seq (8 bytes big-endian), payload]`` (``[seq, payload]`` accepted too);
- ``seq == last + 1``: apply; ``seq > last + 1``: a gap, repaired by replay over the DEALER
  socket (``[b"", start]`` -> ``[b"", topic, seq, payload]`` or ``[b"", seq, payload]`` per kept
  batch, then an end marker whose seq is -1);
- a sequence that goes backwards is a publisher restart: the stream's targets are dropped from
  the index and rebuilt from the replay buffer. Duplicates (a replayed batch that also arrives
  live) are told apart from restarts by a digest of the payload of each recent seq; a replay
  starts one batch early so that its first batch proves it comes from the same publisher;
- on connect, the stream asks for the whole replay buffer (ZMQ's slow joiner misses the start);
- a lost connection (a socket monitor sees it drop) makes the stream unhealthy until it is back
  and the first frame after it proved continuity through the replay socket (before it is applied;
  a restarted engine that stays idle holds none of the old incarnation's blocks):
  a publisher that restarted while disconnected may resume at exactly ``last + 1`` (its own seq
  from 0), which the sequence alone cannot tell from the old publisher's next batch.

A BlockRemoved's ``remaining_copy_counts`` (the copies of each hash the engine still holds) goes
to the index with it (``PrefixIndex.apply_removed``); a malformed one is counted
(``bad_copy_counts``) and the removal applied without it.

Whenever batches are lost for good (no replay socket, the replay buffer no longer reaches back,
a payload that cannot be decoded or exceeds ``max_frame_bytes``), the stream's targets are reset:
the index may then miss blocks the worker holds, but never claims blocks the worker dropped.

Ownership: the subscriber runs on the gateway's event loop and is the only writer of the index
for its targets' engine events (the router writes speculative entries on the same loop, so no
lock is needed). Frames are decoded and applied in bounded slices (``yield_every`` frames or
``_SLICE_BYTES`` of payload) so that a flooding publisher cannot starve the loop, and one frame is
sliced too (``_apply_frame``: ``_SLICE_EVENT_BYTES`` of events, ``_SLICE_BLOCKS`` blocks of one
event), its events applied in order before the next frame is read. A frame over
``max_frame_bytes`` (16 MiB: ~100x the largest batch a vLLM scheduler step publishes, and 2-3 s
of work on one core, in slices) is counted, logged and treated as lost: the target is reset.
Health per stream is exported as ``mesh_kv_events_*`` metrics on the ``CollectorRegistry`` passed
in, and as ``healthy(target)``, which the gateway copies into ``TargetState.index_healthy``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import xxhash
import zmq
import zmq.asyncio
import zmq.utils.monitor
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from mesh.core.index import PrefixIndex
from mesh.core.keys import namespace_seed
from mesh.events.wire import (AllBlocksCleared, Batch, BlockStored, DecodeError, Event, GroupFilter, decode_events,
                            decode_lazy)
from policies.base import Tier, target_id

log = logging.getLogger(__name__)


class LogLimiter:
    """At most ``burst`` log lines per key (a stream and a kind of trouble) per ``window_s``.

    A publisher that sends garbage or restarts in a loop would otherwise write a line per frame:
    the counters on ``/metrics`` count every occurrence; the log keeps a few lines and, when the
    window turns over, one line saying how many were left out."""

    def __init__(self, burst: int = 5, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.burst, self.window_s, self.clock = burst, window_s, clock
        self._windows: dict[tuple[str, str], list[float]] = {}  # key -> [window start, lines, left out]

    def log(self, level: int, key: tuple[str, str], msg: str, *args: object) -> None:
        now = self.clock()
        w = self._windows.get(key)
        if w is None or now - w[0] >= self.window_s:
            if w is not None and w[2]:
                log.log(level, "kv events %s: %d more %r lines left out in the last %.0f s", key[0], int(w[2]),
                        key[1], now - w[0])
            if len(self._windows) > 4096:  # bounded: keys come from config, but never trust that
                self._windows.clear()
            w = self._windows[key] = [now, 0, 0]
        if w[1] < self.burst:
            w[1] += 1
            log.log(level, msg, *args)
        else:
            w[2] += 1

_TIERS = {"GPU": Tier.GPU, "DEVICE": Tier.GPU, "CPU": Tier.CPU, "HOST": Tier.CPU}
_END_SEQ = -1
_SLICE_BYTES = 256 << 10  # a slice of frames also ends after this much payload (~0.1 s of events)
# Within one frame: a slice ends after this much event msgpack (~10 ms to decode and apply here)
# or this many blocks of one event. An event is decoded whole: the one stall left is the msgspec
# decode of the largest event (~40 ns a token: 0.2 s for one 16 MiB event of 5M tokens); a thread
# would not help, msgspec holds the GIL for the whole call (measured: the loop stalls as long).
_SLICE_EVENT_BYTES = 64 << 10
_SLICE_BLOCKS = 1024
_MAX_SEEDS = 4096  # cached (model, LoRA) seeds; LoRA names come from the publisher, unbounded in number
_digest = xxhash.xxh3_64_intdigest


@dataclass(frozen=True, slots=True)
class WorkerEvents:
    """Where one worker publishes its KV events (data-parallel rank r uses port + r)."""

    worker: str
    endpoint: str  # PUB address of rank 0, e.g. "tcp://10.0.0.5:5557"
    replay_endpoint: str | None = None  # ROUTER address of rank 0, e.g. "tcp://10.0.0.5:5558"
    dp_size: int = 1
    model: str = ""  # namespace of the router keys (``mesh.core.keys.namespace_seed(model, lora)``)
    block_size: int | None = None  # the pool's block size; events with another are skipped
    topic: str = ""

    def __post_init__(self) -> None:
        if self.dp_size < 1:
            raise ValueError(f"worker {self.worker!r}: dp_size must be >= 1, got {self.dp_size}")
        if self.block_size is not None and self.block_size <= 0:
            raise ValueError(f"worker {self.worker!r}: block_size must be positive")


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

    def bump(self, table: dict[str, int], key: str, n: int = 1) -> None:
        table[key] = table.get(key, 0) + n


class KvEventSubscriber:
    """Subscribes to every configured worker's KV events and keeps ``index`` in step.

    ``on_health(target, healthy)`` is called when a stream's health flips; ``on_reset(target,
    reason)`` after a target's index entries were dropped. Both run on the event loop and must
    not block.
    """

    def __init__(
        self,
        index: PrefixIndex,
        *,
        registry: CollectorRegistry | None = None,
        max_frame_bytes: int = 16 << 20,
        replay_timeout_s: float = 2.0,
        max_replay_batches: int = 200_000,
        max_replay_bytes: int = 1 << 30,
        unhealthy_after_bad_frames: int = 8,
        stale_after_s: float | None = None,
        yield_every: int = 64,
        digest_window: int = 4096,
        rcvhwm: int = 100_000,
        on_health: Callable[[str, bool], None] | None = None,
        on_reset: Callable[[str, str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.index = index
        self.max_frame_bytes = max_frame_bytes
        self.replay_timeout_s = replay_timeout_s
        self.max_replay_batches = max_replay_batches
        self.max_replay_bytes = max_replay_bytes
        # A replayed frame this large is refused by ZMQ itself (it drops the replay connection: the
        # replay fails, as an oversized batch would reset the stream): without it, a replay
        # socket's 2 GB frame was received whole. Not on the SUB socket: after refusing a frame
        # there, ZMQ did not reconnect (measured), so a giant live frame is still received whole.
        self.max_message_bytes = max(4 * max_frame_bytes, 64 << 20)
        self.unhealthy_after_bad_frames = unhealthy_after_bad_frames
        self.stale_after_s = stale_after_s
        self.yield_every = max(1, yield_every)
        self.digest_window = digest_window
        self.rcvhwm = rcvhwm
        self.on_health = on_health
        self.on_reset = on_reset
        self.clock = clock
        self._logs = LogLimiter(clock=clock)
        self._ctx = zmq.asyncio.Context()
        self._streams: dict[str, _Stream] = {}  # target -> stream
        self._by_worker: dict[str, list[str]] = {}
        self._seeds: dict[tuple[str, str | None], int] = {}
        self._registry = registry
        self._collector = _Collector(self)
        if registry is not None:
            registry.register(self._collector)
        self._closed = False

    # ------------------------------------------------------------------ lifecycle
    async def start(self, workers: Iterable[WorkerEvents] = ()) -> None:
        for w in workers:
            self.add_worker(w)

    def add_worker(self, spec: WorkerEvents) -> list[str]:
        """Start one stream per data-parallel rank (needs a running loop). Returns the targets."""
        if self._closed:
            raise RuntimeError("subscriber is stopped")
        if spec.worker in self._by_worker:
            raise ValueError(f"worker {spec.worker!r} is already subscribed")
        targets = []
        for rank in range(spec.dp_size):
            tid = target_id(spec.worker, rank, spec.dp_size)
            health = StreamHealth(
                spec.worker,
                tid,
                rank,
                offset_endpoint(spec.endpoint, rank),
                offset_endpoint(spec.replay_endpoint, rank) if spec.replay_endpoint else None,
            )
            stream = _Stream(spec, health)
            stream.task = asyncio.get_running_loop().create_task(self._run(stream), name=f"kv-events-{tid}")
            self._streams[tid] = stream
            targets.append(tid)
        self._by_worker[spec.worker] = targets
        return targets

    async def remove_worker(self, worker: str, *, clear_index: bool = True) -> None:
        for tid in self._by_worker.pop(worker, []):
            stream = self._streams.pop(tid)
            await _cancel(stream.task)
            if clear_index:
                self.index.clear_target(tid)

    async def stop(self) -> None:
        """Cancel every stream, close every socket and the context. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for worker in list(self._by_worker):
            await self.remove_worker(worker, clear_index=False)
        if self._registry is not None:
            with contextlib.suppress(KeyError):
                self._registry.unregister(self._collector)
        self._ctx.destroy(linger=0)

    # ------------------------------------------------------------------ queries
    def healthy(self, target: str) -> bool:
        stream = self._streams.get(target)
        return stream is not None and self._is_healthy(stream.health)

    def health(self) -> dict[str, StreamHealth]:
        return {tid: s.health for tid, s in self._streams.items()}

    def targets(self, worker: str) -> list[str]:
        return list(self._by_worker.get(worker, []))

    def _is_healthy(self, h: StreamHealth) -> bool:
        if not h.running or not h.connected or h.recovering or h.bad_streak >= self.unhealthy_after_bad_frames:
            return False
        stream = self._streams.get(h.target)
        if stream is not None and stream.lost and h.last_seq is not None:
            return False  # reconnected, continuity unproven: the publisher may have restarted
        if self.stale_after_s is not None:
            return h.last_event_at is not None and self.clock() - h.last_event_at <= self.stale_after_s
        return True

    # ------------------------------------------------------------------ stream task
    async def _run(self, stream: _Stream) -> None:
        h = stream.health
        sub = self._ctx.socket(zmq.SUB)
        monitor: zmq.asyncio.Socket | None = None
        watcher: asyncio.Task[None] | None = None
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, self.rcvhwm)
            sub.setsockopt(zmq.SUBSCRIBE, stream.spec.topic.encode())
            monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            watcher = asyncio.get_running_loop().create_task(self._watch_connection(stream, monitor))
            sub.connect(h.endpoint)
            self._set_running(stream, True)
            if h.replay_endpoint:
                await self._recover(stream, "connect")
            n = size = 0
            while True:
                frames = await sub.recv_multipart()
                await self._on_live(stream, frames)
                n += 1
                size += len(frames[-1])
                if n >= self.yield_every or size >= _SLICE_BYTES:
                    n = size = 0
                    await asyncio.sleep(0)  # a ready socket never suspends: let others run
        except asyncio.CancelledError:
            raise
        except zmq.ZMQError as exc:
            if not self._closed:
                log.error("kv events %s: socket error %s", h.target, exc)
        finally:
            self._set_running(stream, False)
            if watcher is not None:
                await _cancel(watcher)
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
            if monitor is not None:
                monitor.close(linger=0)
            sub.close(linger=0)
            if stream.dealer is not None:
                stream.dealer.close(linger=0)
                stream.dealer = None

    async def _watch_connection(self, stream: _Stream, monitor: zmq.asyncio.Socket) -> None:
        """Track the SUB connection: down = unhealthy, and the next frame must prove continuity."""
        h = stream.health
        while True:
            event = zmq.utils.monitor.parse_monitor_message(await monitor.recv_multipart())["event"]
            if event == zmq.EVENT_DISCONNECTED:
                h.connected = False
                h.disconnects += 1
                stream.lost = True
            elif event == zmq.EVENT_CONNECTED:
                h.connected = True
            self._notify(stream)

    async def _on_live(self, stream: _Stream, frames: list[bytes]) -> None:
        h = stream.health
        parsed = _split(frames)
        if parsed is None:
            h.bump(h.dropped, "malformed")
            self._bad(stream)
            return
        seq, payload = parsed
        if stream.lost:
            stream.lost = False  # cleared first: a disconnect during the check sets it again
            if h.last_seq is not None:
                await self._after_reconnect(stream)
            self._notify(stream)
        last = h.last_seq
        if last is None:
            if seq > 0 and h.replay_endpoint:  # batches before this one went by unseen
                await self._recover(stream, "late_join")
        elif seq == last + 1:
            pass
        elif seq > last + 1:
            h.gaps += 1
            await self._recover(stream, "gap")
        elif not self._restarted_at(stream, seq, payload):
            return  # a duplicate, or a stale frame queued before a rebuild
        else:
            self._reset(stream, "restart", forget_seq=True)
            if seq > 0 and h.replay_endpoint:
                await self._recover(stream, "restart")
        if h.last_seq is None or seq > h.last_seq:
            await self._apply_frame(stream, seq, payload)
        elif stream.digests.get(seq) == _digest(payload):
            h.duplicates += 1  # the replay already carried it

    def _restarted_at(self, stream: _Stream, seq: int, payload: bytes) -> bool:
        """A frame at or below the last applied seq: a duplicate, a stale frame, or a restart.

        Same seq, same payload digest: a duplicate. Same seq, another payload: a restart. Seq
        below the digest window (or forgotten by a rebuild): a restart only if the batch is newer
        than every batch applied (publisher time), else a stale frame still queued in the socket.
        """
        h = stream.health
        known = stream.digests.get(seq)
        if known is not None:
            if known == _digest(payload):
                h.duplicates += 1
                return False
            return True
        batch = decode_lazy(payload)  # the envelope only: its ts
        if not isinstance(batch, DecodeError) and batch.ts > stream.last_ts:
            return True
        h.stale += 1
        return False

    # ------------------------------------------------------------------ recovery
    async def _after_reconnect(self, stream: _Stream) -> None:
        """The connection dropped since the last frame: verify, through the replay socket, that
        the publisher is the same incarnation (else reset and rebuild); without one, reset."""
        if stream.health.replay_endpoint:
            await self._recover(stream, "reconnect")
        else:
            self._reset(stream, "stream_lost", forget_seq=True)

    async def _recover(self, stream: _Stream, reason: str) -> None:
        """Catch up from the replay buffer; reset the stream's targets if batches are lost."""
        h = stream.health
        self._set_recovering(stream, True)
        try:
            last = h.last_seq
            if not h.replay_endpoint:
                if reason == "gap":
                    self._reset(stream, "gap_no_replay")
                return
            start = 0 if last is None else (last if last in stream.digests else last + 1)
            frames = await self._fetch_replay(stream, start)
            if frames is None:
                if last is not None:  # after a reconnect continuity is unproven: start over
                    self._reset(stream, "replay_failed", forget_seq=reason == "reconnect")
                return
            if last is not None and not _continues(frames, start, last, stream.digests):
                # the buffer no longer reaches back, or another publisher incarnation answered
                everything = await self._fetch_replay(stream, 0)
                restarted = _restarted(frames, last, stream.digests) or _behind(everything or [], last) \
                    or _rewritten(everything or [], last, stream.digests)
                self._reset(stream, "restart" if restarted else "gap_lost", forget_seq=True)
                if everything is None:
                    return
                frames = everything
            n = size = 0
            for seq, payload in frames:
                if h.last_seq is None or seq > h.last_seq:
                    await self._apply_frame(stream, seq, payload)
                n += 1
                size += len(payload)
                if n >= self.yield_every or size >= _SLICE_BYTES:
                    n = size = 0
                    await asyncio.sleep(0)
        finally:
            self._set_recovering(stream, False)

    async def _fetch_replay(self, stream: _Stream, start: int) -> list[tuple[int, bytes]] | None:
        h = stream.health
        assert h.replay_endpoint is not None  # checked by the caller  # noqa: S101
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.replay_timeout_s
        out: list[tuple[int, bytes]] = []
        size = 0
        sock = stream.dealer
        try:
            if sock is None:
                sock = stream.dealer = self._ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
                # inside the try: an endpoint ZMQ refuses is a failed replay (it raised out of the
                # stream task, which ended: the worker's events were no longer read at all)
                sock.connect(h.replay_endpoint)
            # a DEALER without a connected peer blocks on send: bound it by the same deadline
            await asyncio.wait_for(sock.send_multipart([b"", start.to_bytes(8, "big")]), self.replay_timeout_s)
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0 or not await sock.poll(int(remaining * 1000) + 1, zmq.POLLIN):
                    raise TimeoutError(f"no end marker within {self.replay_timeout_s}s")
                frames = await sock.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                parsed = _split(frames, signed=True)
                if parsed is None:
                    h.bump(h.dropped, "malformed")
                    continue
                seq, payload = parsed
                if seq == _END_SEQ:
                    break
                out.append((seq, payload))
                size += len(payload)
                if len(out) > self.max_replay_batches or size > self.max_replay_bytes:
                    raise OverflowError(f"replay longer than {self.max_replay_batches} batches or {self.max_replay_bytes} bytes")
        except (TimeoutError, asyncio.TimeoutError, OverflowError, zmq.ZMQError) as exc:
            self._logs.log(logging.WARNING, (h.target, "replay failed"), "kv events %s: replay from %d failed: %s",
                           h.target, start, exc)
            h.bump(h.replays, "failed")
            if sock is not None:
                sock.close(linger=0)  # late replies must not mix into the next replay
            stream.dealer = None
            return None
        h.bump(h.replays, "ok")
        out.sort(key=lambda f: f[0])
        return out

    # ------------------------------------------------------------------ applying
    async def _apply_frame(self, stream: _Stream, seq: int, payload: bytes) -> None:
        """Apply one frame, in slices: the envelope is decoded at once (one pass over the bytes,
        no event objects), then events are decoded and applied in order, yielding to the loop
        after every ``_SLICE_EVENT_BYTES`` of events and every ``_SLICE_BLOCKS`` blocks of one
        event. The stream task awaits this, so the next frame is never applied before this one
        is done; ``last_seq`` moves first, so a cancelled frame is never applied twice."""
        h = stream.health
        h.last_seq = seq
        stream.remember(seq, payload, self.digest_window)
        if len(payload) > self.max_frame_bytes:
            h.bump(h.dropped, "oversized")
            self._logs.log(logging.WARNING, (h.target, "oversized"),
                           "kv events %s: seq %d is %d bytes, over max_frame_bytes %d: dropped as lost",
                           h.target, seq, len(payload), self.max_frame_bytes)
            self._bad(stream)
            self._reset(stream, "oversized")  # its events are lost: stop claiming anything
            return
        batch = decode_lazy(payload)
        if isinstance(batch, DecodeError):
            h.decode_errors += 1
            self._logs.log(logging.WARNING, (h.target, "undecodable"), "kv events %s: seq %d undecodable: %s",
                           h.target, seq, batch.reason)
            self._bad(stream)
            self._reset(stream, "undecodable")
            return
        h.last_event_at = self.clock()
        if batch.ts > stream.last_ts:
            stream.last_ts = batch.ts
        if h.bad_streak:
            h.bad_streak = 0
            self._notify(stream)
        if batch.data_parallel_rank is not None and batch.data_parallel_rank != h.rank and stream.spec.dp_size > 1:
            h.bump(h.events, "rank_mismatch")
        raws = batch.raw_events
        part = Batch(batch.ts, [], batch.data_parallel_rank)
        i = 0
        while i < len(raws):
            j, size = i, 0
            while j < len(raws) and size < _SLICE_EVENT_BYTES:
                size += len(raws[j])
                j += 1
            part.events.clear()
            decode_events(raws[i:j], part)
            for ev in part.events:
                for _ in self._apply_event(stream, ev):
                    await asyncio.sleep(0)  # between slices of one huge event
            i = j
            if i < len(raws):
                await asyncio.sleep(0)
        if part.unknown:
            h.bump(h.events, "unknown", part.unknown)
        if part.malformed:
            h.bump(h.events, "malformed", part.malformed)
        h.batches += 1  # counted once whole: a frame in progress is not an applied batch

    def _apply_event(self, stream: _Stream, ev: Event) -> Iterator[None]:
        """Apply one event; yields between slices of ``_SLICE_BLOCKS`` blocks (a long event is
        applied as consecutive stores of its chained parts, which is the same chain)."""
        h = stream.health
        spec = stream.spec
        target = h.target
        index = self.index
        if type(ev) is BlockStored:
            tier = _TIERS.get(ev.medium)
            if tier is None or not stream.filter.accept_stored(ev):
                h.bump(h.events, "filtered")
                return
            bs = ev.block_size or spec.block_size or 0
            # a store without tokens (a tier update by hash) needs no block size
            if (bs <= 0 and ev.token_ids) or (spec.block_size is not None and bs != spec.block_size):
                h.bump(h.events, "block_size_mismatch")
                return
            hashes, tokens = ev.block_hashes, ev.token_ids
            if tokens and len(tokens) != len(hashes) * bs:
                h.bump(h.events, "invalid")  # checked whole: a part must not be applied alone
                return
            seed = self._seed(spec.model, ev.lora_name, ev.cache_salt)
            parent, done, invalid = ev.parent_block_hash, 0, False
            for a in range(0, len(hashes), _SLICE_BLOCKS):
                if a:
                    yield
                b = min(len(hashes), a + _SLICE_BLOCKS)
                try:
                    done += index.apply_stored(target, hashes[a:b] if a or b < len(hashes) else hashes,
                                               parent if not a else hashes[a - 1],
                                               tokens[a * bs : b * bs] if tokens and (a or b < len(hashes)) else tokens,
                                               bs, seed, tier)
                except ValueError:  # a bad token id: the rest of the chain cannot be keyed either
                    invalid = True
                    break
            if invalid and not done:
                h.bump(h.events, "invalid")
                return
            h.bump(h.events, "invalid" if invalid else "stored")
            h.bump(h.blocks, "stored", done)
            if done < len(hashes):
                h.bump(h.blocks, "skipped", len(hashes) - done)
        elif type(ev) is AllBlocksCleared:
            index.apply_cleared(target)
            stream.filter = GroupFilter()
            h.bump(h.events, "cleared")
        else:  # BlockRemoved
            tier = _TIERS.get(ev.medium)
            if tier is None or not stream.filter.accept_removed(ev):
                h.bump(h.events, "filtered")
                return
            if ev.bad_copy_counts:  # applied as if absent (one copy per removal on the GPU)
                h.bump(h.events, "bad_copy_counts")
                self._logs.log(logging.WARNING, (target, "bad_copy_counts"),
                               "kv events %s: BlockRemoved with a malformed remaining_copy_counts, ignored", target)
            hashes, counts = ev.block_hashes, ev.remaining_copy_counts
            for a in range(0, len(hashes), _SLICE_BLOCKS):
                if a:
                    yield
                if len(hashes) <= _SLICE_BLOCKS:
                    part, rest = hashes, counts
                else:
                    part = hashes[a : a + _SLICE_BLOCKS]
                    rest = None if counts is None else counts[a : a + _SLICE_BLOCKS]
                h.bump(h.blocks, "removed", index.apply_removed(target, part, tier, rest))
            h.bump(h.events, "removed")

    def _seed(self, model: str, lora: str | None, salt: str | None = None) -> int:
        if salt:  # one per tenant, unbounded in number: computed, never cached
            return namespace_seed(model, lora, salt)
        seed = self._seeds.get((model, lora))
        if seed is None:
            if len(self._seeds) >= _MAX_SEEDS:  # a publisher naming a new LoRA per event grew it for good
                self._seeds.clear()
            seed = self._seeds[(model, lora)] = namespace_seed(model, lora)
        return seed

    # ------------------------------------------------------------------ state changes
    def _reset(self, stream: _Stream, reason: str, *, forget_seq: bool = False) -> None:
        h = stream.health
        h.bump(h.resets, reason)
        self._logs.log(logging.WARNING, (h.target, "reset"), "kv events %s: reset (%s)", h.target, reason)
        self.index.clear_target(h.target)
        if self.on_reset is not None:
            self.on_reset(h.target, reason)
        stream.filter = GroupFilter()
        if forget_seq:
            h.last_seq = None
            stream.digests.clear()
            stream.order.clear()

    def _bad(self, stream: _Stream) -> None:
        stream.health.bad_streak += 1
        if stream.health.bad_streak == self.unhealthy_after_bad_frames:
            self._notify(stream)

    def _set_running(self, stream: _Stream, running: bool) -> None:
        stream.health.running = running
        self._notify(stream)

    def _set_recovering(self, stream: _Stream, recovering: bool) -> None:
        stream.health.recovering = recovering
        self._notify(stream)

    def _notify(self, stream: _Stream) -> None:
        now = self._is_healthy(stream.health)
        if now != stream.reported_healthy:
            stream.reported_healthy = now
            if self.on_health is not None:
                self.on_health(stream.health.target, now)


class _Stream:
    __slots__ = ("spec", "health", "task", "dealer", "filter", "digests", "order", "last_ts", "reported_healthy", "lost")

    def __init__(self, spec: WorkerEvents, health: StreamHealth) -> None:
        self.spec = spec
        self.health = health
        self.task: asyncio.Task[None] | None = None
        self.dealer: zmq.asyncio.Socket | None = None
        self.filter = GroupFilter()
        self.digests: dict[int, int] = {}  # recent seq -> payload digest
        self.order: deque[int] = deque()
        self.last_ts = -math.inf  # publisher time of the newest batch applied
        self.reported_healthy: bool | None = None
        self.lost = False  # the connection dropped since the last frame (set by the socket monitor)

    def remember(self, seq: int, payload: bytes, window: int) -> None:
        if seq not in self.digests:
            self.order.append(seq)
        self.digests[seq] = _digest(payload)
        while len(self.order) > window:
            self.digests.pop(self.order.popleft(), None)


def _split(frames: list[bytes], *, signed: bool = False) -> tuple[int, bytes] | None:
    """``(seq, payload)`` of ``[topic, seq, payload]`` or ``[seq, payload]``; None if malformed."""
    if len(frames) == 3:
        seq_bytes, payload = frames[1], frames[2]
    elif len(frames) == 2:
        seq_bytes, payload = frames[0], frames[1]
    else:
        return None
    if len(seq_bytes) != 8:
        return None
    return int.from_bytes(seq_bytes, "big", signed=signed), payload


def _continues(frames: list[tuple[int, bytes]], start: int, last: int, digests: dict[int, int]) -> bool:
    """Whether a replay asked from ``start`` joins the stream applied up to ``last``."""
    if not frames:
        return False  # not even the last applied batch was kept
    seq, payload = frames[0]
    if seq != start:
        return False
    return start != last or digests.get(last) == _digest(payload)


def _restarted(frames: list[tuple[int, bytes]], last: int, digests: dict[int, int]) -> bool:
    return any(seq <= last and digests.get(seq, -1) != _digest(p) for seq, p in frames[:1])


def _rewritten(frames: list[tuple[int, bytes]], last: int, digests: dict[int, int]) -> bool:
    """A whole replay buffer holding another payload at a seq already applied: a new incarnation
    (it may have passed ``last`` between the two replay requests, so ``_behind`` cannot tell)."""
    return any(seq <= last and seq in digests and digests[seq] != _digest(p) for seq, p in frames)


def _behind(frames: list[tuple[int, bytes]], last: int) -> bool:
    """A whole replay buffer that ends before ``last``: its publisher never sent ``last`` (a
    new incarnation: the one that did keeps its newest batches)."""
    return bool(frames) and frames[-1][0] < last


def offset_endpoint(endpoint: str, rank: int) -> str:
    """vLLM's convention: rank r of a tcp endpoint listens on port + r; other transports get a
    ``_dp{r}`` suffix."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        if port.isdigit():
            return f"{host}:{int(port) + rank}"
        raise ValueError(f"endpoint {endpoint!r} has no numeric port to offset by rank {rank}")
    return f"{endpoint}_dp{rank}"


async def _cancel(task: asyncio.Task[None] | None) -> None:
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


class _Collector:
    """Exports every stream's health at scrape time (no per-event metric cost)."""

    def __init__(self, sub: KvEventSubscriber) -> None:
        self.sub = sub

    def describe(self) -> Iterator[object]:
        return iter(())

    def collect(self) -> Iterator[object]:
        streams = list(self.sub.health().values())
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
        now = self.sub.clock()
        age = GaugeMetricFamily("mesh_kv_events_last_event_age_seconds", "Seconds since the last valid batch",
                                labels=lbl)
        seq = GaugeMetricFamily("mesh_kv_events_last_seq", "Last applied sequence number", labels=lbl)
        ok = GaugeMetricFamily("mesh_kv_events_healthy", "1 while the stream's index is trusted", labels=lbl)
        for h in streams:
            age.add_metric([h.worker, h.target], math.nan if h.last_event_at is None else now - h.last_event_at)
            seq.add_metric([h.worker, h.target], -1 if h.last_seq is None else h.last_seq)
            ok.add_metric([h.worker, h.target], 1.0 if self.sub._is_healthy(h) else 0.0)
        yield age
        yield seq
        yield ok
