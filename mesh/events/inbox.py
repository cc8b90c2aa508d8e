"""KV event frames off the request loop: one receiver thread, one bounded inbox per stream.

``Receiver`` is a thread that owns every stream's ZMQ SUB socket once the stream registered it:
it polls them, drains each ready socket with non-blocking receives (C calls that release the
GIL) and appends the frames to the stream's ``Inbox``; the gateway's loop takes them from there
(``Inbox.get``) and applies them in paced slices (``mesh.events.pacer``). The thread does no
decoding and no index work: its share of the GIL is a few microseconds a frame, and it sleeps
briefly after every ``_ROUND`` frames so that a flood never holds the GIL for long. The socket of
an overflowed inbox is not read until the loop reset its stream: ZMQ drops the flood in its own
queue (past its HWM), at no cost to the gateway. A socket handed over with a ``Watch`` has its
connection monitor read by the thread too: a lost connection is held until the socket's queue was
drained (``mesh.events.held``), then marked in the inbox (``DISCONNECTED``), after every frame
received before it, and told to the loop (``Watch.tell``: the health flags flip at once).

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
are atomic), and replaces ``frames`` only while overflowed, when the thread appends nothing; markers
are put by whoever appends the frames (the thread; the loop for the receiver process). Sockets
move between threads only through ``Receiver.add``/``remove`` (a locked hand-over queue), and the
thread alone closes a socket it was handed (a ``Watch``'s monitor too).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import zmq
import zmq.utils.monitor

from mesh.events.held import HeldEvents

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
        kept = deque(i for i in self.frames if not i[-1] and i in _MARKERS) if self.marked else deque()
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
        budget: the stream's task meets it in order, even after a ``discard``. (From the side that
        appends the frames: ``in_frames`` is its.)"""
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
    """Register ``item`` (its last element 0 or empty: no payload bytes) as a marker ``Inbox.mark``
    may put; the stream's task knows it by identity."""
    if item[-1]:
        raise ValueError("a marker carries no payload bytes")
    _MARKERS.append(item)
    return item


# put by the receiver thread after the frames a lost connection's socket received before it
DISCONNECTED: Frame = marker((b"mesh:disconnected", b""))


class Sink(Protocol):
    """Where the receiver thread puts a socket's frames: a stream's ``Inbox``, or the gateway's
    bound socket's ``mesh.events.bound.Demux`` (which puts each into the inbox its topic names)."""

    def put(self, frames: list[bytes]) -> bool: ...

    def wake(self) -> None: ...

    def overflowed(self) -> bool: ...


def _size(frames: Sequence[Any]) -> int:
    return len(frames[-1]) if frames else 0


@dataclass(frozen=True, slots=True, eq=False)
class Watch:
    """A SUB socket's connection monitor, read by the receiver thread with the socket's frames."""

    monitor: zmq.Socket[bytes]  # a PAIR connected to the SUB socket's monitor (``mesh.events.sockets.monitor_sub``)
    inbox: Inbox  # the socket's inbox, where a lost connection is marked in order
    tell: Callable[[int], None]  # each connection event, called on the thread (a disconnect once marked)


Sock = zmq.Socket[bytes]
Change = tuple[Sock, Sink | None, Watch | None]  # a socket handed over (None: to remove and close)


class Receiver:
    """The thread that receives every stream's frames into its inbox (started on first use)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changes: list[Change] = []
        self._thread: threading.Thread | None = None
        self._stop = False

    def add(self, sock: Sock, inbox: Sink, watch: Watch | None = None) -> None:
        """Hand ``sock`` (connected, options set) and its ``watch`` (``watch.inbox`` is ``inbox``)
        to the thread; the caller never touches them again."""
        with self._lock:
            self._changes.append((sock, inbox, watch))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mesh-kv-receiver", daemon=True)
                self._thread.start()

    def remove(self, sock: Sock) -> None:
        """Ask the thread to stop receiving from ``sock`` and close it (within ``_POLL_MS``)."""
        with self._lock:
            if self._thread is None:
                sock.close(linger=0)
                return
            self._changes.append((sock, None, None))

    def stop(self) -> None:
        """Close every socket and end the thread (joins it)."""
        with self._lock:
            self._stop = True
            thread = self._thread
        if thread is not None:
            thread.join(5.0)

    def _run(self) -> None:
        socks = _Sockets()
        try:
            while not self._stop:
                socks.hand_over(self._changed())
                if not socks.inboxes:
                    time.sleep(_POLL_MS / 1000)
                    continue
                n = socks.receive()
                if n >= _ROUND:
                    time.sleep(_NAP_S)
                elif n == 0 and any(i.overflowed() for i in socks.inboxes.values()):
                    time.sleep(_POLL_MS / 1000)  # only overflowed streams are ready: wait for the loop
        except Exception:  # a receiver that dies must say so: every stream goes quiet
            log.exception("kv events receiver thread failed; KV events are no longer received")
        finally:
            with self._lock:
                socks.hand_over(self._changes)
                self._changes = []
                socks.close()
                self._thread = None

    def _changed(self) -> list[Change]:
        with self._lock:
            changes, self._changes = self._changes, []
        return changes


class _Sockets:
    """The receiver thread's sockets and one poll round over them (the thread's alone)."""

    def __init__(self) -> None:
        self.poller = zmq.Poller()
        self.inboxes: dict[Sock, Sink] = {}
        self.watches: dict[Sock, Watch] = {}  # SUB socket -> its monitor
        self.watched: dict[Sock, Sock] = {}  # monitor -> its SUB socket
        self.held: HeldEvents[Sock] = HeldEvents()

    def hand_over(self, changes: list[Change]) -> None:
        for sock, inbox, watch in changes:
            if inbox is not None:
                self.inboxes[sock] = inbox
                self.poller.register(sock, zmq.POLLIN)
                if watch is not None:
                    self.watches[sock], self.watched[watch.monitor] = watch, sock
                    self.poller.register(watch.monitor, zmq.POLLIN)
                continue
            if sock in self.inboxes:
                self.poller.unregister(sock)
                del self.inboxes[sock]
            watch = self.watches.pop(sock, None)
            _close(sock)
            if watch is not None:
                self.poller.unregister(watch.monitor)
                del self.watched[watch.monitor]
                watch.monitor.close(linger=0)

    def receive(self) -> int:
        """One poll round: frames received (each ready socket's share of ``_ROUND``), connection
        events read and told once their socket is drained. Returns the frames received."""
        n = 0
        ready = self.poller.poll(_POLL_MS)
        each = max(1, _ROUND // max(1, len(ready)))  # one budget a round, shared fairly
        for sock, _ in ready:
            sub = self.watched.get(sock)
            if sub is not None:
                self._connection(sub, sock)
                continue
            inbox = self.inboxes[sock]
            if inbox.overflowed():  # left in ZMQ's queue (dropped there past its HWM, at no cost
                inbox.wake()        # here) until the loop has reset the stream
                continue
            n += _drain(sock, inbox, each)[0]
        for sub, event in self.held.due(self._drained):
            self._tell(sub, event)
        return n

    def _connection(self, sub: Sock, monitor: Sock) -> None:
        try:
            while True:
                event = zmq.utils.monitor.parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))["event"]
                if not self.held.hold(sub, event):  # (else told once the socket's queue is drained)
                    self._tell(sub, event)
        except zmq.Again:
            pass

    def _drained(self, sub: Sock) -> bool:
        """Whether ``sub``'s queue holds no frame received before its held connection events (an
        overflowed stream's frames are not read: past its reset they are a gap)."""
        inbox = self.inboxes.get(sub)
        return inbox is None or inbox.overflowed() or _drain(sub, inbox, _ROUND)[1]

    def _tell(self, sub: Sock, event: int) -> None:
        watch = self.watches.get(sub)
        if watch is None:
            return  # removed since
        if event == zmq.EVENT_DISCONNECTED:
            watch.inbox.mark(DISCONNECTED)
            watch.inbox.wake()
        watch.tell(event)

    def close(self) -> None:
        self.hand_over([(sock, None, None) for sock in list(self.inboxes)])


def _drain(sock: Sock, inbox: Sink, most: int) -> tuple[int, bool]:
    """Receive up to ``most`` frames into ``inbox``: how many, and whether the queue was left empty."""
    n, empty = 0, False
    try:
        while n < most:
            frames = sock.recv_multipart(zmq.NOBLOCK)
            n += 1
            if not inbox.put(frames):
                break  # over budget: the loop resets the stream
    except zmq.Again:
        empty = True
    except zmq.ZMQError as exc:  # nothing more to receive from it (a held event is not kept waiting)
        log.warning("kv events receive failed: %s", exc)
        empty = True
    if n:
        inbox.wake()
    return n, empty


def _close(sock: zmq.Socket[bytes]) -> None:
    with contextlib.suppress(zmq.ZMQError):
        sock.disable_monitor()
    sock.close(linger=0)
