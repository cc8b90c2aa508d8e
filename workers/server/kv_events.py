"""KV cache events in vLLM's wire format (``shared/REFERENCE.md`` section 2), over ZMQ.

- Live stream (PUB): multipart ``[topic, seq (8 bytes big-endian), payload]``, payload =
  msgpack ``[ts, events, data_parallel_rank]``; each event a map with a ``"type"`` key, as
  current vLLM encodes it (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``). ``medium``
  is ``"GPU"``, or ``"CPU"`` for the offload tier, whose stores carry no tokens (vLLM's
  offloading connector's shape: a tier update of blocks already announced on the GPU). A salted
  request's chain carries its salt as vLLM does: ``extra_keys`` with ``[salt]`` for the chain's
  first block (``None`` for the others), so a subscriber keys it in the salt's namespace.
- Hybrid models (``workers.engine.state_checkpoints``), as vLLM publishes its KV cache groups:
  attention blocks carry ``group_idx`` 0 and ``kv_cache_spec_kind`` ``"full_attention"``;
  recurrent-state checkpoints are group 1, kind ``"mamba"`` (vLLM's ``KVCacheSpecKind.MAMBA``): a
  BlockStored naming the one block a checkpoint covers (its key, its parent's, its tokens) and a
  BlockRemoved with ``group_idx`` 1 when the checkpoint pool evicts it.
- Replay (ROUTER): a request ``[b"", start_seq (8 bytes)]`` is answered with
  ``[b"", topic, seq, payload]`` for every kept batch with ``seq >= start_seq``, then
  ``[b"", topic, -1 (8 bytes, signed), b""]``.

The engine never blocks on this: ``publish`` appends to a bounded queue that a publisher thread
drains (the thread owns both sockets; ZMQ sockets are not thread-safe). When the queue is full
the oldest batch is dropped and counted. Sequence numbers are assigned at ``publish`` time, so a
dropped batch leaves a gap that a subscriber sees (and cannot repair from replay: it must
resynchronize).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

from workers.engine.block_manager import MEDIUM_CPU, MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

__all__ = ["MEDIUM_CPU", "MEDIUM_GPU", "KVEventPublisher", "encode_event"]

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def encode_event(event: KVEvent) -> dict[str, Any]:
    """One event as vLLM's tagged map (fields in vLLM's order; defaults omitted as vLLM does)."""
    if isinstance(event, BlockStored):
        out: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": event.block_hashes,
            "parent_block_hash": event.parent_block_hash,
            "token_ids": event.token_ids,
            "block_size": event.block_size,
            "lora_id": None,
            "medium": event.medium,
            "lora_name": None,
        }
        if event.extra_keys is not None:
            out["extra_keys"] = [list(k) if k is not None else None for k in event.extra_keys]
        if event.group_idx is not None:  # a hybrid model's KV cache group (vLLM annotates stores with its kind)
            out["group_idx"] = event.group_idx
            out["kv_cache_spec_kind"] = event.kind
        return out
    if isinstance(event, BlockRemoved):
        removed: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": event.block_hashes, "medium": event.medium}
        if event.group_idx is not None:
            removed["group_idx"] = event.group_idx
        return removed
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV event: {event!r}")


class KVEventPublisher:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        buffer_steps: int = 10_000,
        max_queue_size: int = 100_000,
        data_parallel_rank: int = 0,
        bind_host: str | None = None,
    ) -> None:
        import msgspec
        import zmq

        self._zmq = zmq
        self._encode = msgspec.msgpack.Encoder().encode
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.bind_host = bind_host  # what the ``*`` of a wildcard endpoint binds (None: every interface)
        self._topic = topic.encode("utf-8")
        self._dp_rank = data_parallel_rank
        self._queue: deque[tuple[int, float, list[KVEvent]]] = deque()
        self._max_queue = max_queue_size
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)  # (seq, payload)
        self._lock = threading.Lock()  # guards _queue's bound check + append/popleft pairs
        self._next_seq = 0
        self.num_published = 0  # batches sent on the PUB socket
        self.num_dropped = 0  # batches dropped because the queue was full
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            raise ValueError(f"cannot bind KV event sockets: {self._startup_error}") from self._startup_error

    # ---- engine side (never blocks) -------------------------------------------------------

    def publish(self, events: list[KVEvent]) -> int:
        """Queue one batch (one engine step's events); returns its sequence number."""
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
            if len(self._queue) >= self._max_queue:
                self._queue.popleft()
                self.num_dropped += 1
            self._queue.append((seq, time.time(), list(events)))
        return seq

    @property
    def last_seq(self) -> int:
        """The sequence number of the last batch queued (-1 before the first)."""
        return self._next_seq - 1

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    def close(self, timeout: float = 2.0) -> None:
        """Flush what is queued (up to ``timeout``), then close the sockets."""
        deadline = time.monotonic() + timeout
        while self._queue and time.monotonic() < deadline:
            time.sleep(0.01)
        self._stop.set()
        self._thread.join(timeout=timeout)

    # ---- publisher thread -------------------------------------------------------------------

    def _run(self) -> None:
        zmq = self._zmq
        ctx = zmq.Context.instance()
        pub = replay = None
        try:
            pub = ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, 100_000)
            _bind_or_connect(pub, self.endpoint, self.bind_host)
            if self.replay_endpoint:
                replay = ctx.socket(zmq.ROUTER)
                replay.bind(_at_host(replay, self.replay_endpoint, self.bind_host))
        except Exception as exc:  # reported to the constructor
            self._startup_error = exc
            for s in (pub, replay):
                if s is not None:
                    s.close(linger=0)
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        if replay is not None:
            poller.register(replay, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                sent = self._send_queued(pub)
                if replay is not None and poller.poll(0 if sent else 5):
                    self._serve_replay(replay)
                elif replay is None and not sent:
                    time.sleep(0.005)
        except Exception:
            log.exception("KV event publisher failed")
        finally:
            self._send_queued(pub)
            pub.close(linger=500)
            if replay is not None:
                replay.close(linger=0)

    def _send_queued(self, pub: Any) -> int:
        sent = 0
        while True:
            with self._lock:
                if not self._queue:
                    return sent
                seq, ts, events = self._queue.popleft()
            payload = self._encode([ts, [encode_event(e) for e in events], self._dp_rank])
            pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload])
            self._buffer.append((seq, payload))
            self.num_published += 1
            sent += 1

    def _serve_replay(self, replay: Any) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                replay.send_multipart([client, b"", self._topic, seq.to_bytes(8, "big"), payload])
        replay.send_multipart([client, b"", self._topic, END_SEQ, b""])


def _bind_or_connect(sock: Any, endpoint: str, bind_host: str | None = None) -> None:
    """vLLM's convention: bind a wildcard, ipc or inproc address, connect to anything else. The
    ``*`` of a wildcard binds ``bind_host`` when one is given (the worker's own listen address)."""
    if "*" in endpoint and bind_host:
        sock.bind(_at_host(sock, endpoint, bind_host))
    elif "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        sock.bind(endpoint)
    else:
        log.warning("KV events: %s is a concrete address, so this worker CONNECTS to it (vLLM's rule) and "
                    "publishes only to a subscriber that binds there; for a gateway that connects to the "
                    "worker (Mesh's kv_events.endpoint), give tcp://*:%s instead", endpoint, endpoint.rpartition(":")[2])
        sock.connect(endpoint)


def _at_host(sock: Any, endpoint: str, host: str | None) -> str:
    """``endpoint`` with its wildcard ``*`` replaced by ``host`` (None: kept, every interface)."""
    if "*" not in endpoint or not host:
        return endpoint
    if ":" in host:  # IPv6: zmq needs the socket option and brackets
        import zmq

        sock.setsockopt(zmq.IPV6, 1)
        host = f"[{host.strip('[]')}]"
    return endpoint.replace("*", host, 1)
