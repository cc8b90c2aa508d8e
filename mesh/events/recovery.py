"""The replay side of the KV event subscriber: catching a stream up, and retrying a failed replay.

``Recovery`` is a base of ``mesh.events.subscriber.KvEventSubscriber`` and runs on its stream
tasks (the same ownership: a stream's state is changed by its own task only). A replay asks the
publisher's ROUTER (``mesh.events.sockets.fetch_replay``) for the batches after the last applied
one and applies them; one that does not join the stream resets it and rebuilds it from the whole
buffer. From the moment a replay is needed until one completed, ``Stream.replay_due`` holds and
the stream is not trusted; a failed replay (``replay_timeout_s`` without a message, or
``max_replay_s`` in all) is retried from the whole buffer after ``replay_retry_s`` (doubling, at
most ``MAX_RETRY_S``), and after ``MAX_REPLAY_TRIES`` failures in a row the stream is trusted on
its live batches alone (a WARNING: the index may then miss blocks, never claims dropped ones), as
a stream without a replay socket is.
"""

from __future__ import annotations

import asyncio
import logging

import zmq.asyncio

from mesh.events.health import LogLimiter
from mesh.events.inbox import Inbox, Item
from mesh.events.limits import SubscriberLimits
from mesh.events.pacer import Pacer
from mesh.events.sockets import ReplayLimits, fetch_replay
from mesh.events.stream import Stream, continues, restarted

MAX_RETRY_S = 30.0  # the longest wait before a failed replay is tried again
MAX_REPLAY_TRIES = 3  # failed replays in a row before a stream is trusted on live frames alone


class Recovery:
    """Replay and retry for the subscriber's streams; the subscriber provides the state below."""

    limits: SubscriberLimits
    pacer: Pacer
    _ctx: zmq.asyncio.Context
    _logs: LogLimiter

    def _reset(self, stream: Stream, reason: str, *, forget_seq: bool = False) -> None:
        raise NotImplementedError

    async def _apply_frame(self, stream: Stream, seq: int, payload: bytes) -> None:
        raise NotImplementedError

    def _set_recovering(self, stream: Stream, recovering: bool) -> None:
        raise NotImplementedError

    def _heard(self, stream: Stream) -> None:
        raise NotImplementedError

    async def _after_reconnect(self, stream: Stream) -> None:
        """The connection dropped since the last frame: verify, through the replay socket, that
        the publisher is the same incarnation (else reset and rebuild); without one, reset."""
        if stream.health.replay_endpoint:
            await self._recover(stream, "reconnect")
        else:
            self._reset(stream, "stream_lost", forget_seq=True)

    async def _recover(self, stream: Stream, reason: str) -> None:
        """Catch up from the replay buffer; reset the stream's targets if batches are lost."""
        h = stream.health
        self._set_recovering(stream, True)
        try:
            if not h.replay_endpoint:
                if reason == "gap":
                    self._reset(stream, "gap_no_replay")
                return
            stream.replay_due = True  # until the replay completed: not trusted
            frames = await self._replayed(stream, reason)
            if frames is None:
                self._replay_failed(stream)
                return
            await self._apply_replayed(stream, frames)
            self._replay_done(stream)
        finally:
            self._set_recovering(stream, False)

    def _replay_done(self, stream: Stream) -> None:
        stream.replay_due, stream.replay_failures = False, 0
        if stream.health.bound and not stream.health.connected:
            self._heard(stream)  # its replay socket answered: the publisher is up

    def _replay_failed(self, stream: Stream) -> None:
        """Schedule the retry of a failed replay (the stream stays untrusted until one completes)."""
        stream.replay_failures += 1
        if stream.replay_failures >= MAX_REPLAY_TRIES:
            stream.replay_due = False
            h = stream.health
            self._logs.log(logging.WARNING, (h.target, "replay given up"),
                           "kv events %s: %d replays from %s failed in a row: the stream is trusted on its live "
                           "batches alone (the index misses what the worker stored before)", h.target,
                           stream.replay_failures, h.replay_endpoint)
            return
        delay = min(MAX_RETRY_S, self.limits.replay_retry_s * 2 ** (stream.replay_failures - 1))
        stream.retry_at = asyncio.get_running_loop().time() + delay

    async def _replayed(self, stream: Stream, reason: str) -> list[tuple[int, bytes]] | None:
        """The batches a replay brings to apply (None: none). A replay that does not join the
        stream (the buffer no longer reaches back, or another publisher incarnation answered)
        resets the stream's targets and rebuilds them from the whole buffer."""
        last = stream.health.last_seq
        start = stream.replay_start()
        frames = await self._fetch_replay(stream, start)
        if frames is None:
            if last is not None:  # after a reconnect continuity is unproven: start over
                self._reset(stream, "replay_failed", forget_seq=reason == "reconnect")
            return None
        if last is None or continues(frames, start, last, stream.digests):
            return frames
        everything = await self._fetch_replay(stream, 0)
        lost = "restart" if restarted(frames, everything or [], last, stream.digests) else "gap_lost"
        self._reset(stream, lost, forget_seq=True)
        return everything

    async def _apply_replayed(self, stream: Stream, frames: list[tuple[int, bytes]]) -> None:
        h = stream.health
        for seq, payload in frames:
            await self.pacer.turn()
            if h.last_seq is None or seq > h.last_seq:
                await self._apply_frame(stream, seq, payload)

    async def _fetch_replay(self, stream: Stream, start: int) -> list[tuple[int, bytes]] | None:
        limits = ReplayLimits(self.limits.replay_timeout_s, self.limits.max_replay_s, self.limits.max_replay_batches,
                              self.limits.max_replay_bytes, self.limits.max_message_bytes)
        return await fetch_replay(self._ctx, stream, start, limits, self._logs)

    @staticmethod
    async def _next(stream: Stream, inbox: Inbox, loop: asyncio.AbstractEventLoop) -> Item | None:
        """The next frame; None when a failed replay's retry comes due first."""
        if not stream.replay_due:
            return await inbox.get()
        try:
            return await asyncio.wait_for(inbox.get(), max(0.0, stream.retry_at - loop.time()))
        except (TimeoutError, asyncio.TimeoutError):
            return None

    async def _retry(self, stream: Stream) -> None:
        """Try a failed replay again: the whole buffer, once received, replaces the stream's
        targets (the live batches applied since the failure are in it too)."""
        self._set_recovering(stream, True)
        try:
            everything = await self._fetch_replay(stream, 0)
            if everything is None:
                self._replay_failed(stream)
                return
            self._reset(stream, "replay_retry", forget_seq=True)
            await self._apply_replayed(stream, everything)
            self._replay_done(stream)
        finally:
            self._set_recovering(stream, False)
