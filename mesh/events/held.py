"""A SUB socket's connection events, held behind the frames it received before them.

ZMQ's monitor reports a lost connection as soon as the TCP connection drops, while the SUB
socket's queue may still hold frames the publisher sent before. Whoever receives a socket's
frames (the receiver thread, ``mesh.events.inbox.Receiver``; the receiver process,
``mesh.events.child``) holds a disconnect, and every connection event of that socket after it,
until the socket's queue has been drained, then tells them in order. The gateway meets the
disconnect in the stream's inbox as a marker after those frames (``Stream.lost``): they are
applied as the continuation they are, and the first frame after the marker must prove continuity.
Ownership: the receiving thread's (the thread or the process that drains the sockets).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

import zmq

K = TypeVar("K", bound=Hashable)  # what names a socket to its receiver (the socket, a stream id)


class HeldEvents(Generic[K]):
    """Connection events waiting for their socket's queue to be drained, per socket, in order."""

    __slots__ = ("pending",)

    def __init__(self) -> None:
        self.pending: dict[K, list[int]] = {}

    def hold(self, key: K, event: int) -> bool:
        """Whether ``event`` must wait (a disconnect, or any event behind one); ``due`` tells it."""
        if event == zmq.EVENT_DISCONNECTED or key in self.pending:
            self.pending.setdefault(key, []).append(event)
            return True
        return False

    def due(self, drained: Callable[[K], bool]) -> list[tuple[K, int]]:
        """The held events whose socket is now drained, in order; ``drained(key)`` receives what
        the socket's queue holds (or some of it) and says whether the queue was left empty (also
        when its frames no longer matter: a removed socket, an overflowed stream's)."""
        if not self.pending:
            return []
        out: list[tuple[K, int]] = []
        for key in [k for k in self.pending if drained(k)]:
            out.extend((key, event) for event in self.pending.pop(key))
        return out
