"""A vLLM-format KV event publisher for the subscriber's tests, written from REFERENCE.md section 2
alone (it shares no code with the bundled engine's publisher nor with ``mesh.events.wire``): PUB
frames ``[topic, seq, payload]``, a ROUTER replay socket answering ``[b"", start]`` in either
reply layout (served by its own thread), and ``encode_events``, which writes abstract events in
every event, batch and hash layout vLLM has used. Its blocks are ``BS`` tokens of model ``MODEL``.
Its PUB binds, or connects to a gateway's bound endpoint (``connect``: vLLM given a concrete
host, llm-d's layout); its replay socket may answer slowly (``replay_delay_s`` per batch).
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from typing import Any

import msgspec
import zmq

from mesh.core.keys import namespace_seed

MODEL = "toy"
SEED = namespace_seed(MODEL)
BS = 4
EVENT_LAYOUTS = ["map", "array"]
BATCH_LAYOUTS = ["array3", "array2", "map"]
HASH_MODES = ["uint", "int", "bytes"]


def _wire_hash(h: int, mode: str, rng: random.Random) -> Any:
    if mode == "int":
        return h - (1 << 64) if h >= 1 << 63 else h
    if mode == "bytes":
        return rng.randbytes(24) + h.to_bytes(8, "big")  # a 32-byte digest whose low 8 bytes are h
    return h


def encode_events(events: list[tuple], ev_layout: str, batch_layout: str, hash_mode: str,
                  rng: random.Random, ts: float | None = None, rank: int | None = 0) -> bytes:
    """Abstract events -> one msgpack payload in the requested layout."""
    ts = time.time() if ts is None else ts
    out = []
    for ev in events:
        kind = ev[0]
        if kind == "stored":
            _, hashes, parent, tokens, medium = ev
            wh = [_wire_hash(h, hash_mode, rng) for h in hashes]
            wp = None if parent is None else _wire_hash(parent, hash_mode, rng)
            if ev_layout == "map":
                d: dict[str, Any] = {"type": "BlockStored", "block_hashes": wh, "parent_block_hash": wp,
                                     "token_ids": tokens, "block_size": BS, "lora_id": None, "medium": medium}
                if rng.random() < 0.5:
                    d.update(lora_name=None, group_idx=0, kv_cache_spec_kind="full_attention", future_field=1)
                out.append(d)
            else:
                arr: list[Any] = ["BlockStored", wh, wp, tokens, BS, None, medium]
                if rng.random() < 0.5:
                    arr += [None, None, 0, "full_attention", None]
                out.append(arr)
        elif kind == "removed":
            _, hashes, medium = ev
            wh = [_wire_hash(h, hash_mode, rng) for h in hashes]
            out.append({"type": "BlockRemoved", "block_hashes": wh, "medium": medium}
                       if ev_layout == "map" else ["BlockRemoved", wh, medium])
        elif kind == "cleared":
            out.append({"type": "AllBlocksCleared"} if ev_layout == "map" else ["AllBlocksCleared"])
        else:
            blob = ev[1] if len(ev) > 1 else 1  # an unknown event type, possibly padded
            out.append({"type": kind, "x": blob} if ev_layout == "map" else [kind, blob])
    if batch_layout == "array3":
        body: Any = [ts, out, rank]
    elif batch_layout == "array2":
        body = [ts, out]
    else:
        body = {"ts": ts, "events": out, "data_parallel_rank": rank}
    return msgspec.msgpack.encode(body)


class Publisher:
    """PUB + ROUTER replay, the replay socket served by its own thread."""

    def __init__(self, pub_port: int | None = None, replay_port: int | None = None, *,
                 topic: bytes = b"kv", keep: int = 10_000, reply_layout: str = "4frame",
                 with_replay: bool = True, sndhwm: int = 1_000_000, connect: str | None = None,
                 replay_delay_s: float = 0.0) -> None:
        self.ctx = zmq.Context()
        self.topic = topic
        self.reply_layout = reply_layout
        self.replay_delay_s = replay_delay_s  # the replay thread sleeps this long before each batch
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, sndhwm)
        self.pub_port: int | None = None
        if connect is not None:
            self.pub.connect(connect)
        else:
            self.pub_port = _bind(self.pub, pub_port)
        self.kept: deque[tuple[int, bytes]] = deque(maxlen=keep)
        self.lock = threading.Lock()
        self.seq = 0
        self.replay_port: int | None = None
        self.stop_flag = threading.Event()
        self.thread: threading.Thread | None = None
        if with_replay:
            router = self.ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            self.replay_port = _bind(router, replay_port)
            self.thread = threading.Thread(target=self._serve, args=(router,), daemon=True)
            self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.pub_port}"

    @property
    def replay_endpoint(self) -> str | None:
        return None if self.replay_port is None else f"tcp://127.0.0.1:{self.replay_port}"

    def publish(self, payload: bytes, *, live: bool = True) -> int:
        seq = self.seq
        self.seq += 1
        with self.lock:
            self.kept.append((seq, payload))
        if live:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def send_raw(self, frames: list[bytes]) -> None:
        self.pub.send_multipart(frames)

    def _serve(self, router: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        while not self.stop_flag.is_set():
            if not poller.poll(20):
                continue
            frames = router.recv_multipart()
            if len(frames) != 3:
                continue
            ident, _, start = frames
            first = int.from_bytes(start, "big")
            with self.lock:
                kept = [item for item in self.kept if item[0] >= first]
            for seq, payload in kept:
                if self.replay_delay_s:
                    time.sleep(self.replay_delay_s)
                if self.reply_layout == "4frame":
                    router.send_multipart([ident, b"", self.topic, seq.to_bytes(8, "big"), payload])
                else:
                    router.send_multipart([ident, b"", seq.to_bytes(8, "big"), payload])
            end = [b"", (-1).to_bytes(8, "big", signed=True), b""]
            router.send_multipart([ident, b""] + ([self.topic] if self.reply_layout == "4frame" else []) + end[1:])
        router.close(linger=0)

    def close(self) -> None:
        self.stop_flag.set()
        if self.thread is not None:
            self.thread.join(2)
        self.pub.close(linger=0)
        self.ctx.term()


def _bind(sock: zmq.Socket, port: int | None) -> int:
    if port is None:
        sock.bind("tcp://127.0.0.1:*")
        return int(sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
    sock.bind(f"tcp://127.0.0.1:{port}")
    return port
