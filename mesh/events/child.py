"""The KV event receiver process: owns the SUB sockets, hands the loop prepared frames.

``main(link, parent_pid)`` runs in a child process of the gateway (``mesh.events.process`` spawns
it). It connects a PAIR socket to ``link`` (the gateway binds it), says hello, and from then on
owns every stream's SUB socket (connected to a worker's PUB, or the gateway's one bound SUB,
demultiplexed by topic with ``mesh.events.bound.Demux``): it receives each frame and prepares it
(``mesh.events.prepare``: split, digested, decoded, keyed) and sends the gateway, after every poll
round, one message of every frame prepared in it (``F``: ``_message``; each frame a ``Prepared``
pickled as a tuple, which the gateway keeps as bytes, never scanned by its garbage collector,
until it applies it). It also forwards each SUB socket's connection events (``C``), when they
changed the bound socket's unknown-topic counts (``U``), and its log records (``L``: logged
again by the gateway, through its own handlers).

Control messages from the gateway (pickled tuples): ``("bind", address, rcvhwm)`` (answered ``B``
with the resolved address, or the ZMQ error), ``("own", sid, endpoint, topic, rcvhwm, model,
block_size, max_frame_bytes)``, ``("bound", sid, topics, model, block_size, max_frame_bytes)``,
``("remove", sid)``, ``("pause", sid)`` (its socket is not read: ZMQ drops the flood in its own
queue past its HWM, seen later as a gap) and ``("resume", sid)``, ``("stop",)``.

The process ends on ``stop``, when the gateway's process is gone (its parent pid changes: checked
every ``_POLL_MS``) or when the link breaks; it never touches the index. Ownership: everything
here is the process's main thread's.
"""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import sys
import time
from array import array
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.utils.monitor

from mesh.events.bound import Demux
from mesh.events.held import HeldEvents
from mesh.events.ops import Prepared
from mesh.events.prepare import Preparer

log = logging.getLogger("mesh.events.subscriber")

_ROUND = 64  # frames received from one socket per poll round (then the others' turn, and a send)
_POLL_MS = 100
_UNKNOWN_EVERY_S = 0.1
_SEND_TIMEOUT_MS = 1000


@dataclass(slots=True)
class _Own:
    """A stream with its own SUB socket."""

    sub: zmq.Socket[bytes]
    monitor: zmq.Socket[bytes]
    preparer: Preparer
    paused: bool = False


@dataclass(slots=True, eq=False)  # hashed by identity (``Demux`` keeps a set of the sinks it touched)
class _Routed:
    """A stream of the bound socket: where ``Demux`` puts its topics' frames."""

    sid: int
    preparer: Preparer
    out: dict[int, list[tuple[bytes, int]]]

    def put(self, frames: list[bytes]) -> bool:
        self.out.setdefault(self.sid, []).append(_packed(self.preparer.prepare(frames)))
        return True

    def wake(self) -> None:
        pass

    def overflowed(self) -> bool:
        return False


@dataclass
class _Child:
    link: zmq.Socket[bytes]
    ctx: zmq.Context[zmq.Socket[bytes]]
    poller: zmq.Poller = field(default_factory=zmq.Poller)
    own: dict[int, _Own] = field(default_factory=dict)
    by_sock: dict[zmq.Socket[bytes], int] = field(default_factory=dict)  # SUB -> sid
    by_monitor: dict[zmq.Socket[bytes], int] = field(default_factory=dict)
    bound: zmq.Socket[bytes] | None = None
    demux: Demux | None = None
    out: dict[int, list[tuple[bytes, int]]] = field(default_factory=dict)  # sid -> (pickled frame, size)
    unknown_sent: dict[str, int] = field(default_factory=dict)
    held: HeldEvents[int] = field(default_factory=HeldEvents)  # by sid: connection events not told yet
    stopped: bool = False

    # -- control --
    def control(self, msg: tuple[Any, ...]) -> None:
        op = msg[0]
        if op == "bind":
            self._bind(msg[1], msg[2])
        elif op == "own":
            self._add_own(*msg[1:])
        elif op == "bound":
            sid, topics, model, block_size, max_frame_bytes = msg[1:]
            assert self.demux is not None, "a bound stream before the bound socket"
            self.demux.route(topics, _Routed(sid, Preparer(model, block_size, max_frame_bytes), self.out))  # type: ignore[arg-type]
        elif op == "remove":
            self._remove(msg[1])
        elif op in ("pause", "resume"):
            self._pause(msg[1], op == "pause")
        elif op == "stop":
            self.stopped = True

    def _bind(self, address: str, rcvhwm: int) -> None:
        sub = self.ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, rcvhwm)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.bind(address)
        except zmq.ZMQError as exc:
            sub.close(linger=0)
            self.tell(b"B", (None, exc.errno, str(exc)))
            return
        self.bound, self.demux = sub, Demux(address)
        self.poller.register(sub, zmq.POLLIN)
        self.tell(b"B", (sub.getsockopt_string(zmq.LAST_ENDPOINT), 0, ""))

    def _add_own(self, sid: int, endpoint: str, topic: str, rcvhwm: int, model: str, block_size: int | None,
                 max_frame_bytes: int) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, rcvhwm)
        sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        addr = f"inproc://mesh-kv-monitor-{sid}"
        sub.monitor(addr, zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        monitor = self.ctx.socket(zmq.PAIR)
        monitor.connect(addr)
        try:
            sub.connect(endpoint)
        except zmq.ZMQError as exc:  # the gateway validated it; a refusal still must not end the process
            log.error("kv events: cannot connect %s: %s", endpoint, exc)
        self.own[sid] = _Own(sub, monitor, Preparer(model, block_size, max_frame_bytes))
        self.by_sock[sub], self.by_monitor[monitor] = sid, sid
        self.poller.register(sub, zmq.POLLIN)
        self.poller.register(monitor, zmq.POLLIN)

    def _pause(self, sid: int, paused: bool) -> None:
        """A paused socket is not polled (not read: ZMQ drops the flood past its HWM, seen later
        as a gap) until resumed."""
        stream = self.own.get(sid)
        if stream is None or stream.paused == paused:
            return
        stream.paused = paused
        if paused:
            self.poller.unregister(stream.sub)
        else:
            self.poller.register(stream.sub, zmq.POLLIN)

    def _remove(self, sid: int) -> None:
        stream = self.own.pop(sid, None)
        if stream is None:
            if self.demux is not None:
                self.demux.routes = {t: r for t, r in self.demux.routes.items() if getattr(r, "sid", None) != sid}
            return
        for sock in (stream.monitor,) if stream.paused else (stream.sub, stream.monitor):
            self.poller.unregister(sock)
        del self.by_sock[stream.sub], self.by_monitor[stream.monitor]
        stream.sub.disable_monitor()
        stream.sub.close(linger=0)
        stream.monitor.close(linger=0)
        self.out.pop(sid, None)

    # -- one poll round --
    def round(self) -> None:
        for sock, _ in self.poller.poll(_POLL_MS):
            if sock is self.link:
                while not self.stopped and self.link.poll(0):
                    self.control(pickle.loads(self.link.recv()))
            elif sock is self.bound:
                self._drain_bound()
            elif sock in self.by_monitor:
                self._connection(sock)
            elif sock in self.by_sock:
                self._drain(self.by_sock[sock])
        # a lost connection is told after every frame received before it (``mesh.events.held``):
        # they go in this round's ``F`` message, before it
        told = self.held.due(self._drained)
        if self.out:
            self.send(b"F", *_message(self.out))
            self.out.clear()  # (the same dict: ``_Routed`` sinks hold it)
        for sid, event in told:
            self.tell(b"C", (sid, event))

    def tell(self, kind: bytes, body: object) -> None:
        self.send(kind, pickle.dumps(body, pickle.HIGHEST_PROTOCOL))

    def send(self, kind: bytes, *parts: bytes) -> None:
        """One message to the gateway; dropped when it has not read for ``_SEND_TIMEOUT_MS`` (lost
        frames are gaps there, repaired by replay)."""
        try:
            self.link.send_multipart([kind, *parts])
        except zmq.Again:
            log.warning("kv events: the gateway has not read for %d ms; a message (%s) was dropped",
                        _SEND_TIMEOUT_MS, kind.decode())

    def _drained(self, sid: int) -> bool:
        """Whether ``sid``'s socket holds no frame received before its held connection events
        (a removed or paused socket's frames are not read: they go with it, or as a gap)."""
        return sid not in self.own or self.own[sid].paused or self._drain(sid)

    def _drain(self, sid: int) -> bool:
        """Receive and prepare up to ``_ROUND`` frames; whether the socket's queue is empty."""
        stream = self.own[sid]
        batch = self.out.setdefault(sid, [])
        prepare = stream.preparer.prepare
        empty = False
        try:
            for _ in range(_ROUND):
                batch.append(_packed(prepare(stream.sub.recv_multipart(zmq.NOBLOCK))))
        except zmq.Again:
            empty = True
        if not batch:
            del self.out[sid]
        return empty

    def _drain_bound(self) -> None:
        assert self.bound is not None and self.demux is not None
        try:
            for _ in range(_ROUND * 4):
                self.demux.put(self.bound.recv_multipart(zmq.NOBLOCK))
        except zmq.Again:
            pass

    def _connection(self, monitor: zmq.Socket[bytes]) -> None:
        event = zmq.utils.monitor.parse_monitor_message(monitor.recv_multipart())["event"]
        sid = self.by_monitor[monitor]
        if not self.held.hold(sid, event):  # (else told in order once its queue is drained)
            self.tell(b"C", (sid, event))

    def report_unknown(self) -> None:
        if self.demux is not None and self.demux.unknown != self.unknown_sent:
            self.unknown_sent = dict(self.demux.unknown)
            self.tell(b"U", self.unknown_sent)

    def close(self) -> None:
        for sid in list(self.own):
            self._remove(sid)
        if self.bound is not None:
            self.bound.close(linger=0)
        self.link.close(linger=0)


def _message(out: dict[int, list[tuple[bytes, int]]]) -> list[bytes]:
    """One round's frames as an ``F`` message's parts: ``[sid, count]`` pairs, each frame's end
    offset in the blob and its payload size (u64 arrays), the blob of every pickled frame."""
    counts = array("Q", [x for sid, frames in out.items() for x in (sid, len(frames))])
    blobs = [blob for frames in out.values() for blob, _ in frames]
    ends = array("Q", itertools.accumulate(map(len, blobs)))
    sizes = array("Q", [size for frames in out.values() for _, size in frames])
    return [counts.tobytes(), ends.tobytes(), sizes.tobytes(), b"".join(blobs)]


def _packed(frame: Prepared) -> tuple[bytes, int]:
    return pickle.dumps(tuple(frame), pickle.HIGHEST_PROTOCOL), frame.size


class _LinkHandler(logging.Handler):
    """The child's log records, sent to the gateway (which logs them as its own)."""

    def __init__(self, child: _Child) -> None:
        super().__init__(logging.WARNING)
        self.child = child

    def emit(self, record: logging.LogRecord) -> None:
        self.child.tell(b"L", (record.levelno, record.name, record.getMessage()))


def main(link: str, parent_pid: int) -> None:
    """The child process's body: ``python -m mesh.events.child LINK PARENT_PID``."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, _SEND_TIMEOUT_MS)
    sock.connect(link)
    child = _Child(sock, ctx)
    child.poller.register(sock, zmq.POLLIN)
    logging.basicConfig(level=logging.WARNING, handlers=[_LinkHandler(child)], force=True)
    sock.send_multipart([b"H", str(os.getpid()).encode()])
    next_report = time.monotonic() + _UNKNOWN_EVERY_S
    try:
        while not child.stopped and os.getppid() == parent_pid:
            child.round()
            if time.monotonic() >= next_report:
                child.report_unknown()
                next_report = time.monotonic() + _UNKNOWN_EVERY_S
    except Exception:
        log.exception("kv events: the receiver process failed")  # (to the gateway's log, then the exit)
        raise
    finally:
        child.close()
        ctx.term()


if __name__ == "__main__":  # python -m mesh.events.child LINK PARENT_PID (``mesh.events.process`` runs it)
    main(sys.argv[1], int(sys.argv[2]))
