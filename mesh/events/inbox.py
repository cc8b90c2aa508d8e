"""KV event frames off the request loop: one receiver thread, one bounded inbox per stream.

``Receiver`` is a thread that owns every stream's ZMQ SUB socket once the stream registered it:
it polls them, drains each ready socket with non-blocking receives (C calls that release the
GIL) and appends the frames to the stream's ``Inbox``; the gateway's loop takes them from there
(``Inbox.get``) and applies them in paced slices (``mesh.events.pacer``). The thread does no
decoding and no index work: its share of the GIL is a few microseconds a frame, and it sleeps
briefly after every ``_ROUND`` frames so that a flood never holds the GIL for long. The socket of
an overflowed inbox is not read until the loop reset its stream: ZMQ drops the flood in its own
queue (past its HWM), at no cost to the gateway.

With ``index.ingest_process`` the receiver process (``mesh.events.process``) fills the same inboxes
from the loop itself, with prepared frames kept as bytes (``Inbox(size_of=...)`` reads their payload
size); ``mark`` puts a marker the stream's task meets in order (a lost connection, a dead child).

The budget: an inbox whose backlog (frames received, not yet taken) exceeds ``max_frames`` or
``max_bytes`` overflows: the thread receives no further frame of it until the loop has noticed
(``Inbox.overflowed``), discarded the backlog and reset the stream (``KvEventSubscriber``: the
target's entries dropped and rebuilt from replay, as for any lost batch). Dropped frames are
counted (``dropped``); nothing is dropped silently.

Ownership (single writer per field, no lock on the hot path): the thread writes ``in_frames``,
``in_bytes``, ``overflows`` and ``dropped`` and appends to ``frames``; the loop writes
``out_frames``, ``out_bytes`` and ``handled`` and pops from ``frames`` (a deque: append and popleft
are atomic), and replaces ``frames`` only while overflowed, when the thread appends nothing. Sockets move between threads only through ``Receiver.add``/``remove`` (a locked
hand-over queue), and the thread alone closes a socket it was handed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import zmq

log = logging.getLogger("mesh.events.subscriber")

# Frames received before the thread sleeps a moment, handing the GIL to the loop: a thread that only
# releases it inside C calls keeps it (the loop's thread, woken too late, waits the whole switch
# interval, 5 ms); 64 frames are ~0.2 ms of receiving.
_ROUND = 64
_NAP_S = 0.0002
_POLL_MS = 20  # how long the thread waits for frames before it looks at hand-overs again

# A frame's parts as kept: a tuple of bytes holds no reference the garbage collector must follow,
# so after its first collection it is no longer tracked, and a backlog of thousands of frames adds
# nothing to a full collection (as lists, 10,000-frame backlogs made pauses of 7-12 ms; as tuples
# under 1.5 ms, ``bench/kv_ingest_loop_lag.py`` at 30,000 events/s over 4 streams).
Frame = tuple[bytes, ...]
# What an inbox holds: received frames (the thread's), or ``mesh.events.ops.Prepared`` frames (the
# receiver process's, put by ``mesh.events.process`` on the loop).
Item = tuple[Any, ...]


class Inbox:
    """One stream's frames between the receiver thread and the loop, bounded by a budget."""

    __slots__ = ("max_frames", "max_bytes", "frames", "in_frames", "in_bytes", "out_frames", "out_bytes",
                 "overflows", "handled", "dropped", "size_of", "marked", "_event", "_loop", "_waiting")

    def __init__(self, max_frames: int, max_bytes: int, size_of: Callable[[Item], int] | None = None) -> None:
        if max_frames < 1 or max_bytes < 1:
            raise ValueError("an inbox needs a budget of at least one frame and one byte")
        self.max_frames, self.max_bytes = max_frames, max_bytes
        self.size_of = size_of or _size  # an item's payload bytes (a frame's: its last part)
        self.frames: deque[Item] = deque()
        self.in_frames = self.in_bytes = self.overflows = self.dropped = 0  # the thread's
        self.out_frames = self.out_bytes = self.handled = 0  # the loop's
        self.marked = False  # a marker was ever put (``discard`` then keeps markers)
        self._loop = asyncio.get_running_loop()
        self._event = asyncio.Event()
        self._waiting = False

    # -- the loop's side --
    @property
    def backlog(self) -> int:
        """Frames received and not yet taken."""
        return self.in_frames - self.out_frames

    @property
    def backlog_bytes(self) -> int:
        return self.in_bytes - self.out_bytes

    def overflowed(self) -> bool:
        return self.overflows != self.handled

    def take(self) -> Item | None:
        """The oldest frame, None when empty (never waits)."""
        try:
            frames = self.frames.popleft()
        except IndexError:
            return None
        self.out_frames += 1
        self.out_bytes += self.size_of(frames)
        return frames

    async def get(self) -> Item:
        """The oldest frame; waits for one."""
        while True:
            frames = self.take()
            if frames is not None:
                return frames
            self._waiting = True  # set before the re-check: a frame appended now wakes us
            frames = self.take()
            if frames is not None:
                self._waiting = False
                return frames
            await self._event.wait()
            self._event.clear()

    def discard(self) -> int:
        """After an overflow: drop the backlog at once and resume receiving. Returns the frames
        dropped. (The thread appends nothing while overflowed: the deque is the loop's to swap.)"""
        if not self.overflowed():
            raise RuntimeError("discard() is for an overflowed inbox only")
        kept = deque(i for i in self.frames if i[-1] == 0 and i in _MARKERS) if self.marked else deque()
        n = self.in_frames - self.out_frames - len(kept)
        self.frames = kept  # (markers stay: the stream's task must still meet them)
        self.out_frames, self.out_bytes = self.in_frames - len(kept), self.in_bytes
        self.handled = self.overflows
        return n

    # -- the thread's side --
    def put(self, frames: list[bytes]) -> bool:
        """Append a received frame; False when it was dropped (over budget, or overflowed)."""
        return self.add(tuple(frames), _size(frames))

    def add(self, item: Item, size: int) -> bool:
        """Append ``item`` of ``size`` payload bytes (``size_of(item)``); False when it was
        dropped (over budget, or overflowed)."""
        if self.overflows != self.handled:
            self.dropped += 1
            return False
        if (self.in_frames - self.out_frames >= self.max_frames
                or self.in_bytes - self.out_bytes + size > self.max_bytes):
            self.overflows += 1
            self.dropped += 1
            return False
        self.frames.append(item)
        self.in_frames += 1
        self.in_bytes += size
        return True

    def mark(self, item: Item) -> None:
        """Append a marker (an item of ``size_of`` 0, registered with ``marker``) whatever the
        budget: the stream's task meets it in order, even after a ``discard``."""
        if item not in _MARKERS:
            raise ValueError("not a registered marker")
        self.marked = True
        self.frames.append(item)
        self.in_frames += 1

    def wake(self) -> None:
        """Wake the loop's waiting ``get`` (from the thread; once per round, not per frame)."""
        if self._waiting or self.overflows != self.handled:
            self._waiting = False
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                self._loop.call_soon_threadsafe(self._event.set)


_MARKERS: list[Item] = []


def marker(item: Item) -> Item:
    """Register ``item`` (its last element 0: no payload bytes) as a marker ``Inbox.mark`` may put."""
    if item[-1] != 0:
        raise ValueError("a marker carries no payload bytes")
    _MARKERS.append(item)
    return item


class Sink(Protocol):
    """Where the receiver thread puts a socket's frames: a stream's ``Inbox``, or the gateway's
    bound socket's ``mesh.events.bound.Demux`` (which puts each into the inbox its topic names)."""

    def put(self, frames: list[bytes]) -> bool: ...

    def wake(self) -> None: ...

    def overflowed(self) -> bool: ...


def _size(frames: Sequence[Any]) -> int:
    return len(frames[-1]) if frames else 0


class Receiver:
    """The thread that receives every stream's frames into its inbox (started on first use)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changes: list[tuple[zmq.Socket[bytes], Sink | None]] = []  # None: remove and close
        self._thread: threading.Thread | None = None
        self._stop = False

    def add(self, sock: zmq.Socket[bytes], inbox: Sink) -> None:
        """Hand ``sock`` (connected, options set) to the thread; the caller never touches it again."""
        with self._lock:
            self._changes.append((sock, inbox))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mesh-kv-receiver", daemon=True)
                self._thread.start()

    def remove(self, sock: zmq.Socket[bytes]) -> None:
        """Ask the thread to stop receiving from ``sock`` and close it (within ``_POLL_MS``)."""
        with self._lock:
            if self._thread is None:
                sock.close(linger=0)
                return
            self._changes.append((sock, None))

    def stop(self) -> None:
        """Close every socket and end the thread (joins it)."""
        with self._lock:
            self._stop = True
            thread = self._thread
        if thread is not None:
            thread.join(5.0)

    def _run(self) -> None:
        poller = zmq.Poller()
        inboxes: dict[zmq.Socket[bytes], Sink] = {}
        try:
            while not self._stop:
                self._hand_over(poller, inboxes, self._changed())
                if not inboxes:
                    time.sleep(_POLL_MS / 1000)
                    continue
                n = 0
                ready = poller.poll(_POLL_MS)
                each = max(1, _ROUND // max(1, len(ready)))  # one budget a round, shared fairly
                for sock, _ in ready:
                    inbox = inboxes[sock]
                    if inbox.overflowed():  # left in ZMQ's queue (dropped there past its HWM, at no cost
                        inbox.wake()        # here) until the loop has reset the stream
                        continue
                    n += self._drain(sock, inbox, each)
                if n >= _ROUND:
                    time.sleep(_NAP_S)
                elif n == 0 and any(i.overflowed() for i in inboxes.values()):
                    time.sleep(_POLL_MS / 1000)  # only overflowed streams are ready: wait for the loop
        except Exception:  # a receiver that dies must say so: every stream goes quiet
            log.exception("kv events receiver thread failed; KV events are no longer received")
        finally:
            with self._lock:
                self._hand_over(poller, inboxes, self._changes)
                self._changes = []
                for sock in inboxes:
                    _close(sock)
                self._thread = None

    def _changed(self) -> list[tuple[zmq.Socket[bytes], Sink | None]]:
        with self._lock:
            changes, self._changes = self._changes, []
        return changes

    @staticmethod
    def _hand_over(poller: zmq.Poller, inboxes: dict[zmq.Socket[bytes], Sink],
                   changes: list[tuple[zmq.Socket[bytes], Sink | None]]) -> None:
        for sock, inbox in changes:
            if inbox is None:
                if sock in inboxes:
                    poller.unregister(sock)
                    del inboxes[sock]
                _close(sock)
            else:
                inboxes[sock] = inbox
                poller.register(sock, zmq.POLLIN)

    @staticmethod
    def _drain(sock: zmq.Socket[bytes], inbox: Sink, most: int) -> int:
        n = 0
        try:
            while n < most:
                n += 1
                if not inbox.put(sock.recv_multipart(zmq.NOBLOCK)):
                    break  # over budget: the loop resets the stream
        except zmq.Again:
            pass
        except zmq.ZMQError as exc:
            log.warning("kv events receive failed: %s", exc)
        if n:
            inbox.wake()
        return n


def _close(sock: zmq.Socket[bytes]) -> None:
    with contextlib.suppress(zmq.ZMQError):
        sock.disable_monitor()
    sock.close(linger=0)
