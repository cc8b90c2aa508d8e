"""The gateway's side of the KV event receiver process (``mesh.events.child``).

``ProcessReceiver`` runs ``python -m mesh.events.child`` and owns its link (a PAIR socket the
gateway binds on an ipc path of its own, one per incarnation of the child): it tells the child
which sockets to own (``bind``, ``add_own``, ``add_bound``, ``remove``) and puts every prepared
frame it sends into its stream's ``mesh.events.inbox.Inbox`` (the backlog budget counts them as
frames and payload bytes). A frame the inbox refuses (over budget) pauses the stream's socket in
the child until the stream was reset (``resume``): the flood is dropped in ZMQ's queue there,
at no cost to the gateway, as the receiver thread leaves it. Connection events and the bound
socket's unknown-topic counts go to the subscriber's callbacks, its log records to the gateway's
loggers.

A child that exits without being asked to is an ERROR: ``on_lost`` runs at once (the subscriber
resets every stream: whatever the child held is gone) and a new child is started (after a pause
that doubles with each death within a minute, at most ``MAX_RESTART_S``), told every socket again,
and the streams rebuild from replay. The child ends with the gateway's process (``stop``; a child
whose parent is gone exits by itself). Ownership: the loop's; the link is read by one task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import shutil
import sys
import tempfile
import time
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from mesh.events.inbox import Inbox, Item
from mesh.events.ops import Prepared

log = logging.getLogger("mesh.events.subscriber")

HELLO_TIMEOUT_S = 60.0  # a child's start (a Python interpreter importing the event modules)
MAX_RESTART_S = 30.0
_ROOT = str(Path(__file__).resolve().parent.parent.parent)  # where ``mesh`` and ``policies`` are imported from


class ProcessReceiver:
    def __init__(self, ctx: zmq.asyncio.Context, *, on_connection: Callable[[int, int], None],
                 on_lost: Callable[[], None], on_unknown: Callable[[dict[str, int]], None]) -> None:
        self._ctx = ctx
        self._on_connection, self._on_lost, self._on_unknown = on_connection, on_lost, on_unknown
        self._inboxes: dict[int, Inbox] = {}  # sid -> its stream's inbox
        self._told: dict[int, tuple[Any, ...]] = {}  # sid -> the message that gave the child its socket
        self._bind_msg: tuple[Any, ...] | None = None
        self._paused: set[int] = set()
        self._bound: asyncio.Future[tuple[str | None, int, str]] | None = None
        self._link: zmq.asyncio.Socket | None = None
        self._dir = tempfile.mkdtemp(prefix="mesh-kv-")
        self._proc: asyncio.subprocess.Process | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._deaths: list[float] = []
        self._stopping = False
        self._spawned = 0
        self._up: asyncio.Task[None] | None = None  # the first start
        self._ready = False  # the running child said hello and was told every socket
        self.restarts = 0

    @property
    def pid(self) -> int | None:
        """The running child's pid (None between incarnations)."""
        return self._proc.pid if self._proc is not None and self._proc.returncode is None else None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start the child (if not started yet); returns once it said hello (raises RuntimeError
        if it never does). ``bind`` and the first ``add_*`` start it too."""
        await self._ensure()

    def _ensure(self) -> asyncio.Task[None]:
        if self._up is None:
            self._up = asyncio.get_running_loop().create_task(self._spawn(), name="kv-events-child-start")
        return self._up

    async def _spawn(self) -> None:
        self._spawned += 1
        address = f"ipc://{self._dir}/link-{self._spawned}"
        link = self._link = self._ctx.socket(zmq.PAIR)
        link.setsockopt(zmq.LINGER, 0)
        link.bind(address)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p))
        proc = self._proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "mesh.events.child", address, str(os.getpid()), stdin=asyncio.subprocess.DEVNULL, env=env)
        try:
            kind, _ = await asyncio.wait_for(link.recv_multipart(), HELLO_TIMEOUT_S)
        except (TimeoutError, asyncio.TimeoutError):
            proc.kill()
            raise RuntimeError(f"the kv event receiver process did not start within {HELLO_TIMEOUT_S:.0f}s") from None
        if kind != b"H":
            raise RuntimeError(f"the kv event receiver process said {kind!r} first")
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._read(link), name="kv-events-link"),
                       loop.create_task(self._watch(proc), name="kv-events-child")]
        self._ready = True
        if self._bind_msg is not None:  # a restarted child: the same address again, nobody awaits it
            self._bound = loop.create_future()
            self._bound.add_done_callback(_rebound)
            self._send(self._bind_msg)
        for msg in self._told.values():
            self._send(msg)

    async def stop(self) -> None:
        """Ask the child to end (killed past 5 s), close the link. Idempotent."""
        if self._stopping:
            return
        self._stopping = True
        proc = self._proc
        if self._up is not None and not self._up.done():
            self._up.cancel()
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(zmq.ZMQError):
                self._send(("stop",))
            try:
                await asyncio.wait_for(proc.wait(), 5.0)
            except (TimeoutError, asyncio.TimeoutError):
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._link is not None:
            self._link.close(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)

    # ------------------------------------------------------------------ sockets
    async def bind(self, address: str, rcvhwm: int) -> str:
        """Bind the gateway's one SUB socket in the child; its resolved address (raises
        ZMQError as a bind on the loop would: a port in use)."""
        await self._ensure()
        self._bind_msg = ("bind", address, rcvhwm)
        self._bound = asyncio.get_running_loop().create_future()
        self._send(self._bind_msg)
        resolved, errno, why = await self._bound
        if resolved is None:
            self._bind_msg = None
            raise zmq.ZMQError(errno, why)
        self._bind_msg = ("bind", resolved, rcvhwm)  # a restarted child binds the same port again
        return resolved

    def add_own(self, sid: int, inbox: Inbox, endpoint: str, topic: str, rcvhwm: int, model: str,
                block_size: int | None, max_frame_bytes: int) -> None:
        self._add(sid, inbox, ("own", sid, endpoint, topic, rcvhwm, model, block_size, max_frame_bytes))

    def add_bound(self, sid: int, inbox: Inbox, topics: list[str], model: str, block_size: int | None,
                  max_frame_bytes: int) -> None:
        self._add(sid, inbox, ("bound", sid, topics, model, block_size, max_frame_bytes))

    def _add(self, sid: int, inbox: Inbox, msg: tuple[Any, ...]) -> None:
        self._inboxes[sid], self._told[sid] = inbox, msg
        self._ensure()
        self._send(msg)

    def remove(self, sid: int) -> None:
        self._inboxes.pop(sid, None)
        self._paused.discard(sid)
        if self._told.pop(sid, None) is not None:
            self._send(("remove", sid))

    def resume(self, sid: int) -> None:
        """After an overflowed stream was reset: its socket is read again."""
        if sid in self._paused:
            self._paused.discard(sid)
            self._send(("resume", sid))

    def _send(self, msg: tuple[Any, ...]) -> None:
        link, proc = self._link, self._proc
        if not self._ready or link is None or proc is None or proc.returncode is not None:
            return  # not started, or between incarnations: the next one is told everything in ``_told``
        try:
            link.send(pickle.dumps(msg), zmq.NOBLOCK)
        except zmq.Again:  # only when the child is gone (a live one reads controls every round)
            log.warning("kv events: the receiver process did not take a control message %r", msg[0])

    # ------------------------------------------------------------------ the link
    async def _read(self, link: zmq.asyncio.Socket) -> None:
        while True:
            kind, *parts = await link.recv_multipart()
            try:
                self._dispatch(kind, parts)
            except Exception:  # one bad message must not end the link: every stream would go quiet
                log.exception("kv events: a message of the receiver process could not be handled")

    def _dispatch(self, kind: bytes, parts: list[bytes]) -> None:
        if kind == b"F":
            self._frames(parts)
            return
        body = parts[0]
        if kind == b"C":
            self._on_connection(*pickle.loads(body))
        elif kind == b"U":
            self._on_unknown(pickle.loads(body))
        elif kind == b"L":
            level, name, text = pickle.loads(body)
            logging.getLogger(name).log(level, "%s", text)
        elif kind == b"B" and self._bound is not None and not self._bound.done():
            self._bound.set_result(pickle.loads(body))

    def _frames(self, parts: list[bytes]) -> None:
        """Each frame into its stream's inbox as ``(pickled Prepared, size)`` (``unpack`` on take);
        the message's layout is ``mesh.events.child._message``'s."""
        counts, ends, sizes = (array("Q", part).tolist() for part in parts[:3])
        blob, at, start = parts[3], 0, 0
        for i in range(0, len(counts), 2):
            sid, n = counts[i], counts[i + 1]
            inbox = self._inboxes.get(sid)
            if inbox is not None:  # (else removed since)
                for j in range(at, at + n):
                    end, size = ends[j], sizes[j]
                    if not inbox.add((blob[start:end], size), size) and sid not in self._paused \
                            and self._told[sid][0] == "own":
                        self._paused.add(sid)  # over budget: the child leaves its frames in ZMQ's queue
                        self._send(("pause", sid))
                    start = end
                inbox.wake()
            else:
                start = ends[at + n - 1] if n else start
            at += n

    async def _watch(self, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        if self._stopping:
            return
        now = time.monotonic()
        self._deaths = [t for t in self._deaths if now - t < 60.0] + [now]
        delay = min(MAX_RESTART_S, 0.25 * 2 ** (len(self._deaths) - 1)) if len(self._deaths) > 1 else 0.0
        log.error("kv events: the receiver process (pid %d) exited with code %s: every stream is reset and "
                  "rebuilt from replay; restarting it in %.2fs", proc.pid, code, delay)
        self._ready = False
        self._paused.clear()
        self._on_lost()
        self._tasks[0].cancel()
        if self._link is not None:
            self._link.close(linger=0)
            self._link = None
        self.restarts += 1
        await asyncio.sleep(delay)
        while not self._stopping:
            try:
                await self._spawn()
                return
            except (RuntimeError, OSError) as exc:
                log.error("kv events: the receiver process could not be restarted: %s; trying again", exc)
                await asyncio.sleep(MAX_RESTART_S)


def _rebound(done: asyncio.Future[tuple[str | None, int, str]]) -> None:
    if not done.cancelled() and done.result()[0] is None:
        log.error("kv events: the restarted receiver process could not bind the gateway's endpoint again (%s): "
                  "the workers whose publishers connect to it are not heard from", done.result()[2])


def unpack(item: Item) -> Prepared:
    """A frame as an inbox of this receiver holds it -> the ``Prepared`` frame."""
    return Prepared._make(pickle.loads(item[0]))


def packed(frame: Prepared) -> Item:
    """``frame`` as an inbox of this receiver holds it (markers put by the gateway itself)."""
    return pickle.dumps(tuple(frame), pickle.HIGHEST_PROTOCOL), frame.size
