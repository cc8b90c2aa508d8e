"""The KV event subscriber's streams as the receiver process feeds them (``index.ingest_process``).

``ChildStreams`` is a base of ``mesh.events.subscriber.KvEventSubscriber`` (as ``Recovery`` is) and
holds what differs when ``mesh.events.process.ProcessReceiver`` owns the SUB sockets: a stream
registers its socket with the child under a stream id (``sid``) instead of handing it to the
receiver thread; the gateway's bound socket is bound there; the child's connection events,
unknown-topic counts and death come back here. A lost connection and a dead child reach a stream
as markers in its inbox (``_DISCONNECTED``, ``_LOST``), met in order after the frames received
before them; the health flags flip at once. Ownership: the loop's; a stream's state is changed by
its own task, its connection flags by the link's reader as the connection watcher does.
"""

from __future__ import annotations

import logging

import zmq
from prometheus_client import CollectorRegistry

from mesh.events.bound import Demux
from mesh.events.inbox import Inbox, Item, marker
from mesh.events.limits import SubscriberLimits
from mesh.events.ops import LOST, Prepared
from mesh.events.process import ProcessReceiver, packed
from mesh.events.sockets import close_stream, connection_event
from mesh.events.stream import Stream

log = logging.getLogger("mesh.events.subscriber")

_LOST = marker(packed(Prepared(-2, 0, 0, 0.0, None, [], 0, 0, LOST)))  # put in every inbox when the receiver process died
# put in a stream's inbox when the receiver process's SUB socket lost its connection: met in order,
# after the frames received before it (those are no proof of a reconnected publisher's continuity)
_DISCONNECTED = marker(packed(Prepared(-3, 0, 0, 0.0, None, [], 0, 0, "disconnected")))


def prepared_size(item: Item) -> int:
    """An inbox item's payload bytes, as the receiver process's inboxes hold them."""
    return item[1]  # type: ignore[no-any-return]  # ``mesh.events.process.packed``: (pickled frame, size)


class ChildStreams:
    """The receiver process's side of the subscriber; the subscriber (and ``Recovery``, a base before
    this one) provide the state and methods below."""

    limits: SubscriberLimits
    bound_address: str | None
    _child: ProcessReceiver | None
    _sids: dict[int, Stream]
    _sid_of: dict[str, int]
    _next_sid: int
    _closed: bool
    _demux: Demux | None
    _registry: CollectorRegistry | None

    @property
    def receiver_pid(self) -> int | None:
        """The receiver process's pid (None: the receiver thread, or between two children)."""
        return self._child.pid if self._child is not None else None

    def _new_inbox(self) -> Inbox:
        raise NotImplementedError

    def _set_running(self, stream: Stream, running: bool) -> None:
        raise NotImplementedError

    def _notify(self, stream: Stream) -> None:
        raise NotImplementedError

    def _reset(self, stream: Stream, reason: str, *, forget_seq: bool = False) -> None:
        raise NotImplementedError

    async def _recover(self, stream: Stream, reason: str) -> None:
        raise NotImplementedError

    async def _receive(self, stream: Stream, inbox: Inbox) -> None:
        raise NotImplementedError

    async def _open_bound_child(self, bind: str) -> None:
        assert self._child is not None
        self.bound_address = await self._child.bind(bind, self.limits.rcvhwm)  # raises ZMQError as a bind here would
        self._demux = Demux(bind)  # here: the unknown-topic counts the child reports, for the metric
        if self._registry is not None:
            self._registry.register(self._demux)
        log.info("kv events: bound %s (in the receiver process) for the workers whose publishers connect to the "
                 "gateway", self.bound_address)

    def _sid(self, stream: Stream) -> int:
        self._next_sid += 1
        self._sids[self._next_sid] = stream
        self._sid_of[stream.health.target] = self._next_sid
        return self._next_sid

    def _forget_sid(self, stream: Stream) -> None:
        sid = self._sid_of.pop(stream.health.target, None)
        if sid is not None:
            del self._sids[sid]
            if self._child is not None:
                self._child.remove(sid)

    async def _run_child(self, stream: Stream) -> None:
        """A stream of its own SUB socket in the receiver process, connected to the worker's PUB
        (its connection events come from there: ``_child_connection``)."""
        h = stream.health
        assert h.endpoint and self._child is not None
        try:
            inbox = stream.inbox = self._new_inbox()
            # ZMQ's queue holds no more than the budget (as ``_run_own``'s)
            self._child.add_own(self._sid(stream), inbox, h.endpoint, stream.spec.topic,
                                min(self.limits.rcvhwm, self.limits.max_backlog_frames), stream.spec.model,
                                stream.spec.block_size, self.limits.max_frame_bytes)
            await self._child.start()  # the child is up and was told: the SUB connects before the replay
            self._set_running(stream, True)
            if h.replay_endpoint:
                await self._recover(stream, "connect")
            await self._receive(stream, inbox)
        except zmq.ZMQError as exc:
            if not self._closed:
                log.error("kv events %s: socket error %s", h.target, exc)
        finally:
            self._forget_sid(stream)
            self._set_running(stream, False)
            close_stream(stream)
            stream.inbox = None

    def _child_connection(self, sid: int, event: int) -> None:
        stream = self._sids.get(sid)
        if stream is None:
            return
        if event == zmq.EVENT_DISCONNECTED and stream.inbox is not None:
            stream.inbox.mark(_DISCONNECTED)  # ``lost`` in order; the flags flip at once
            stream.inbox.wake()
        connection_event(stream, event, self._notify)

    def _child_unknown(self, unknown: dict[str, int]) -> None:
        if self._demux is not None:
            self._demux.unknown = unknown

    def _child_lost(self) -> None:
        """The receiver process died: each stream learns it in order, from its inbox."""
        for stream in self._sids.values():
            if stream.inbox is not None:
                stream.inbox.mark(_LOST)
                stream.inbox.wake()

    async def _receiver_lost(self, stream: Stream) -> None:
        """What the dead child held (frames received, the connection) is gone: reset, rebuild."""
        h = stream.health
        h.connected = False
        stream.lost = False
        self._reset(stream, "receiver_lost", forget_seq=True)
        self._notify(stream)
        if h.replay_endpoint:
            await self._recover(stream, "receiver_lost")
