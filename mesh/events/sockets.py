"""The ZMQ side of a KV event stream: the SUB socket and its monitor, and the replay socket.

The SUB socket receives live frames and its monitor reports the connection going down (the stream
is unhealthy at once, and the first frame after those received before it must prove continuity)
and coming back, both read by the receiver thread (``mesh.events.inbox``), which tells the loop
each connection event after the frames received before it (``mesh.events.held``). The replay socket (a
DEALER, opened on a stream's first replay and kept) asks the publisher's ROUTER for every kept
batch from a seq: ``[b"", start]`` -> ``[b"", topic, seq, payload]`` or ``[b"", seq, payload]``
per batch, then an end marker whose seq is -1. A replay is bounded in batches and bytes (ZMQ
itself refuses a message over ``max_message_bytes``) and in time: it fails when the publisher
sends nothing for ``idle_s`` (the wait extends with every batch, so a big buffer is rebuilt
whole, however long it takes) or past ``max_s`` in all; a failed one closes the socket, so
late replies never mix into the next replay. Ownership: each stream task owns its replay socket
and closes it when it ends, and hands its SUB socket and monitor to the receiver thread, which
closes them; the ``zmq.asyncio.Context`` is the subscriber's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from mesh.events.health import LogLimiter
from mesh.events.stream import Stream, split_frame

END_SEQ = -1


@dataclass(frozen=True, slots=True)
class ReplayLimits:
    idle_s: float  # the longest wait for the next message (a batch or the end marker)
    max_s: float  # from the request to the end marker
    max_batches: int
    max_bytes: int  # payload bytes in all
    max_message_bytes: int  # one message; ZMQ drops the connection over it


def monitor_sub(sub: zmq.Socket[bytes], topic: str, rcvhwm: int) -> zmq.Socket[bytes]:
    """Set the SUB socket's options and subscription; returns its connection monitor, a PAIR of
    the same context (both are read by the receiver thread, ``mesh.events.inbox.Watch``)."""
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVHWM, rcvhwm)
    sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
    addr = f"inproc://mesh-kv-monitor-{id(sub)}"
    sub.monitor(addr, zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    monitor: zmq.Socket[bytes] = sub.context.socket(zmq.PAIR)
    monitor.connect(addr)
    return monitor


def connection_event(stream: Stream, event: int, notify: Callable[[Stream], None]) -> None:
    """One event of the SUB socket's monitor, told by the receiver (thread or process): the
    health flags flip at once. A disconnect's ``Stream.lost`` is not set here: the stream's task
    sets it when it meets the disconnect's marker, after the frames received before it."""
    h = stream.health
    if event == zmq.EVENT_DISCONNECTED:
        h.connected = False
        h.disconnects += 1
    elif event == zmq.EVENT_CONNECTED:
        h.connected = True
    notify(stream)


def close_stream(stream: Stream) -> None:
    """Close the loop's socket of ``stream`` (the replay socket); its SUB socket and monitor are
    the receiver's to close (``mesh.events.inbox.Receiver.remove``)."""
    if stream.dealer is not None:
        stream.dealer.close(linger=0)
        stream.dealer = None


async def fetch_replay(
    ctx: zmq.asyncio.Context, stream: Stream, start: int, limits: ReplayLimits, logs: LogLimiter
) -> list[tuple[int, bytes]] | None:
    """Every batch the publisher kept from ``start``, by seq; None when the replay failed."""
    h = stream.health
    if h.replay_endpoint is None:
        raise ValueError(f"kv events {h.target}: no replay endpoint")
    sock = stream.dealer
    try:
        if sock is None:
            sock = stream.dealer = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, limits.max_message_bytes)
            # inside the try: an endpoint ZMQ refuses is a failed replay (it raised out of the
            # stream task, which ended: the worker's events were no longer read at all)
            sock.connect(h.replay_endpoint)
        out = await _request(sock, stream, start, limits)
    except (TimeoutError, asyncio.TimeoutError, OverflowError, zmq.ZMQError) as exc:
        logs.log(logging.WARNING, (h.target, "replay failed"), "kv events %s: replay from %d failed: %s",
                 h.target, start, exc)
        h.bump(h.replays, "failed")
        if sock is not None:
            sock.close(linger=0)  # late replies must not mix into the next replay
        stream.dealer = None
        return None
    h.bump(h.replays, "ok")
    out.sort(key=lambda f: f[0])
    return out


async def _request(
    sock: zmq.asyncio.Socket, stream: Stream, start: int, limits: ReplayLimits
) -> list[tuple[int, bytes]]:
    """Send the replay request and receive batches up to the end marker, within ``limits``."""
    h = stream.health
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limits.max_s
    out: list[tuple[int, bytes]] = []
    size = 0
    # a DEALER without a connected peer blocks on send: bound it by the idle wait
    await asyncio.wait_for(sock.send_multipart([b"", start.to_bytes(8, "big")]), limits.idle_s)
    while True:
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise TimeoutError(f"no end marker within max_replay_s {limits.max_s}s ({len(out)} batches received)")
        wait = min(limits.idle_s, remaining)
        if not await sock.poll(int(wait * 1000) + 1):  # POLLIN, the default
            raise TimeoutError(f"nothing received for {wait:.1f}s ({len(out)} batches received, no end marker)")
        frames = await sock.recv_multipart()
        if frames and frames[0] == b"":
            frames = frames[1:]
        parsed = split_frame(frames, signed=True)
        if parsed is None:
            h.bump(h.dropped, "malformed")
            continue
        seq, payload = parsed
        if seq == END_SEQ:
            return out
        out.append((seq, payload))
        size += len(payload)
        if len(out) > limits.max_batches or size > limits.max_bytes:
            raise OverflowError(f"replay longer than {limits.max_batches} batches or {limits.max_bytes} bytes")


async def cancel(task: asyncio.Task[None] | None) -> None:
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
