"""A KV event publisher as current vLLM and SGLang run it (their ``ZmqEventPublisher``), written
from the upstream sources and sharing no code with ``mesh``: PUB frames ``[topic, seq 8 bytes
big-endian, payload]``; the ROUTER replay answers ``[identity, b"", seq, payload]`` per kept batch,
then ``[identity, b"", -1 (signed), b""]``. A batch is a msgspec struct of the caller's (the
upstream struct mirrors live with the tests that send them), encoded as msgpack.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

import msgspec
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_enc = msgspec.msgpack.Encoder()


class UpstreamPublisher:
    """PUB + ROUTER replay as upstream's ``ZmqEventPublisher``: ``publish`` encodes one batch struct."""

    def __init__(self, topic: str = "") -> None:
        self.ctx = zmq.Context()
        self.topic = topic.encode()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind("tcp://127.0.0.1:*")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind("tcp://127.0.0.1:*")
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=10_000)
        self.seq = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._replay, daemon=True)
        self.thread.start()

    @staticmethod
    def _port(sock: zmq.Socket) -> int:
        return int(sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self._port(self.pub)}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self._port(self.router)}"

    def publish(self, batch: Any) -> None:
        payload = _enc.encode(batch)
        with self.lock:
            seq, self.seq = self.seq, self.seq + 1
            self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
            self.buffer.append((seq, payload))

    def _replay(self) -> None:
        while not self.stop.is_set():
            if not self.router.poll(20):
                continue
            frame = self.router.recv_multipart()
            if len(frame) != 3:
                continue
            client_id, _, start_bytes = frame
            start = int.from_bytes(start_bytes, "big")
            with self.lock:
                kept = [item for item in self.buffer if item[0] >= start]
            for seq, buf in kept:
                self.router.send_multipart((client_id, b"", seq.to_bytes(8, "big"), buf))
            self.router.send_multipart((client_id, b"", END_SEQ, b""))

    def close(self) -> None:
        self.stop.set()
        self.thread.join(2)
        self.router.close(linger=0)
        self.pub.close(linger=0)
        self.ctx.term()
