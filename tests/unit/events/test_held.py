"""Connection events held behind their socket's frames (``mesh.events.held``)."""

from __future__ import annotations

import zmq

from mesh.events.held import HeldEvents

UP, DOWN = zmq.EVENT_CONNECTED, zmq.EVENT_DISCONNECTED


def test_a_disconnect_and_every_event_after_it_wait_until_the_socket_is_drained() -> None:
    held: HeldEvents[str] = HeldEvents()
    assert not held.hold("a", UP)  # nothing held before it: told at once
    assert held.hold("a", DOWN) and held.hold("a", UP) and held.hold("a", DOWN)  # in order behind it
    assert not held.hold("b", UP)
    queued = {"a": 2}  # frames still in a's queue; drained two rounds from now

    def drained(key: str) -> bool:
        queued[key] -= 1
        return queued[key] == 0

    assert held.due(drained) == []  # a's queue still held a frame
    assert held.due(drained) == [("a", DOWN), ("a", UP), ("a", DOWN)]
    assert held.due(drained) == [] and not held.hold("a", UP)  # nothing held any more


def test_only_the_sockets_with_held_events_are_drained() -> None:
    held: HeldEvents[int] = HeldEvents()
    asked: list[int] = []
    assert held.due(lambda k: asked.append(k) or True) == [] and asked == []
    held.hold(1, DOWN)
    held.hold(2, DOWN)
    assert held.due(lambda k: asked.append(k) or k == 2) == [(2, DOWN)]
    assert held.due(lambda k: asked.append(k) or True) == [(1, DOWN)]
    assert asked == [1, 2, 1]
