"""The receiver thread and a stream's bounded inbox (``mesh.events.inbox``), over real ZMQ sockets."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq

from mesh.events.inbox import DISCONNECTED, Inbox, Receiver, Watch
from mesh.events.sockets import monitor_sub
from tests.procs import free_port


async def joined(pub: zmq.Socket, inbox: Inbox) -> None:
    """Past ZMQ's slow joiner: publish a hello until the first frame reaches ``inbox``."""
    deadline = time.monotonic() + 10
    while inbox.backlog == 0:
        assert time.monotonic() < deadline
        pub.send_multipart([b"", (0).to_bytes(8, "big"), b"hello"])
        await asyncio.sleep(0.02)


async def test_an_inbox_keeps_order_and_counts_what_is_received_and_taken() -> None:
    inbox = Inbox(max_frames=10, max_bytes=1 << 20)
    for i in range(3):
        assert inbox.put([b"", i.to_bytes(8, "big"), b"x" * 10])
    assert inbox.backlog == 3 and inbox.backlog_bytes == 30
    taken = [await inbox.get() for _ in range(3)]
    assert [int.from_bytes(f[1], "big") for f in taken] == [0, 1, 2]
    assert inbox.backlog == 0 and inbox.take() is None


async def test_an_inbox_over_its_frame_budget_overflows_and_refuses_until_discarded() -> None:
    inbox = Inbox(max_frames=4, max_bytes=1 << 20)
    assert all(inbox.put([b"p"]) for _ in range(4))
    assert not inbox.overflowed()
    assert not inbox.put([b"p"])  # the fifth: over the budget
    assert inbox.overflowed() and not inbox.put([b"p"])  # refused until the loop has reset the stream
    assert inbox.dropped == 2
    assert inbox.discard() == 4
    assert not inbox.overflowed() and inbox.backlog == 0
    assert inbox.put([b"p"]) and inbox.backlog == 1  # received again


async def test_an_inbox_over_its_byte_budget_overflows() -> None:
    inbox = Inbox(max_frames=1000, max_bytes=100)
    assert inbox.put([b"x" * 60])
    assert not inbox.put([b"x" * 60]) and inbox.overflowed()


def test_an_inbox_needs_a_budget() -> None:
    async def make() -> None:
        Inbox(max_frames=0, max_bytes=1)

    with pytest.raises(ValueError):
        asyncio.run(make())


async def test_the_receiver_thread_fills_inboxes_and_wakes_the_loop_then_closes_its_sockets() -> None:
    ctx = zmq.Context()
    port = free_port()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    receiver = Receiver()
    inbox = Inbox(max_frames=100_000, max_bytes=1 << 30)
    receiver.add(sub, inbox)
    try:
        await joined(pub, inbox)
        while inbox.take() is not None:
            pass
        for i in range(1, 501):
            pub.send_multipart([b"", i.to_bytes(8, "big"), b"payload"])
        got = [int.from_bytes((await asyncio.wait_for(inbox.get(), 10))[1], "big") for _ in range(500)]
        assert got == list(range(1, 501))  # every frame, in order, through a waiting get
    finally:
        receiver.remove(sub)
        await asyncio.get_running_loop().run_in_executor(None, receiver.stop)
        assert sub.closed  # the thread closed the socket it was handed
        pub.close(linger=0)
        ctx.term()


async def test_the_receiver_leaves_an_overflowed_stream_in_zmq_until_it_is_discarded() -> None:
    ctx = zmq.Context()
    port = free_port()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    receiver = Receiver()
    inbox = Inbox(max_frames=50, max_bytes=1 << 30)
    receiver.add(sub, inbox)
    try:
        deadline = time.monotonic() + 10
        while not inbox.overflowed():
            assert time.monotonic() < deadline
            for _ in range(100):
                pub.send_multipart([b"", b"\0" * 8, b"flood"])
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)
        assert inbox.backlog == 50  # nothing more taken in while overflowed
        assert inbox.discard() == 50
        deadline = time.monotonic() + 10
        while inbox.backlog == 0:  # receiving again
            assert time.monotonic() < deadline
            pub.send_multipart([b"", b"\0" * 8, b"after"])
            await asyncio.sleep(0.02)
    finally:
        receiver.remove(sub)
        await asyncio.get_running_loop().run_in_executor(None, receiver.stop)
        pub.close(linger=0)
        ctx.term()


async def test_a_lost_connection_is_marked_after_every_frame_received_before_it() -> None:
    """The monitor reports the disconnect while the SUB socket's queue may still hold frames the
    publisher sent before closing: the thread drains them into the inbox first, then marks the
    loss there and only then tells it."""
    ctx = zmq.Context()
    port = free_port()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 10_000)  # closed with every frame sent
    pub.setsockopt(zmq.SNDHWM, 0)  # and none dropped at the publisher (its default 1,000 drops on a slow I/O thread)
    pub.bind(f"tcp://127.0.0.1:{port}")
    sub = ctx.socket(zmq.SUB)
    monitor = monitor_sub(sub, "", 100_000)
    sub.connect(f"tcp://127.0.0.1:{port}")
    receiver = Receiver()
    inbox = Inbox(max_frames=100_000, max_bytes=1 << 30)
    told: list[tuple[int, bool]] = []  # (event, whether the inbox ended with the marker then)
    receiver.add(sub, inbox, Watch(monitor, inbox, lambda e: told.append((e, bool(inbox.frames) and inbox.frames[-1] is DISCONNECTED))))
    try:
        await joined(pub, inbox)
        for i in range(1, 2001):
            pub.send_multipart([b"", i.to_bytes(8, "big"), b"payload" * 20])
        pub.close()
        deadline = time.monotonic() + 10
        while (zmq.EVENT_DISCONNECTED, True) not in told:
            assert time.monotonic() < deadline and (zmq.EVENT_DISCONNECTED, False) not in told
            await asyncio.sleep(0.01)
        assert told[0] == (zmq.EVENT_CONNECTED, False)
        items = [inbox.take() for _ in range(inbox.backlog)]
        assert items[-1] is DISCONNECTED and inbox.backlog == 0 and inbox.backlog_bytes == 0
        seqs = [int.from_bytes(f[1], "big") for f in items[:-1] if f is not None]
        assert seqs[-2000:] == list(range(1, 2001))  # every frame sent, in order, before the marker
    finally:
        receiver.remove(sub)
        await asyncio.get_running_loop().run_in_executor(None, receiver.stop)
        assert sub.closed and monitor.closed  # the thread closed the sockets it was handed
        ctx.term()
