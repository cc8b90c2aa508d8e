"""One upstream HTTP/1.1 connection (an asyncio protocol with the httptools response parser),
and the errors of an exchange. ``mesh.gateway.upstream`` pools these and is the API.

A ``Connection`` carries one request at a time (``UpstreamPool`` owns it while busy, its idle
list between requests); its timers (the exchange's whole-time bound and the silence watch: the
``mesh.gateway.upstream`` docstring) are cancelled by ``cancel_timers`` whenever it leaves a request.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from typing import Any

import httptools

HIGH_WATER = 1 << 20
MAX_HEAD_BYTES = 64 * 1024  # a response head longer than this is refused (uvicorn/h11 limits are similar)


class UpstreamError(ConnectionError):
    """The exchange with the worker failed. ``got_response``: some response bytes had arrived."""

    def __init__(self, message: str, *, got_response: bool = False) -> None:
        super().__init__(message)
        self.got_response = got_response


class ConnectError(UpstreamError):
    """The TCP (or TLS) connection could not be made; nothing was sent."""


class UpstreamTimeout(UpstreamError):
    """The whole exchange took longer than its timeout (the connection is closed).
    ``reader_behind``: body bytes were waiting for the reader when it fired (its client read
    too slowly to keep up: the worker was not the slow one)."""

    def __init__(self, message: str, *, got_response: bool = False, reader_behind: bool = False) -> None:
        super().__init__(message, got_response=got_response)
        self.reader_behind = reader_behind


class UpstreamStalled(UpstreamError):
    """The worker went silent past a bound: no first body byte within ``first_byte_s`` (``phase``
    "first_byte") or no byte for ``idle_s`` once its answer started ("idle")."""

    def __init__(self, message: str, *, phase: str, after_s: float, got_response: bool = False) -> None:
        super().__init__(message, got_response=got_response)
        self.phase = phase
        self.after_s = after_s


class UpstreamAborted(UpstreamError):
    """The exchange was failed from outside before it reached a client (``abort_unanswered``)."""


class Connection(asyncio.Protocol):
    __slots__ = (
        "transport", "parser", "pool_key", "status", "headers", "chunks", "buffered", "complete",
        "error", "waiter", "got_bytes", "keep_alive", "paused", "closed", "idle_since", "until_close",
        "headers_done", "timer", "head_bytes", "interim", "stray", "on_stall",
        "watch", "first_s", "first_by", "idle_s", "last_at", "got_body", "abortable",
    )  # fmt: skip

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.pool_key: tuple[str, str, int] = ("", "", 0)
        self.closed = False
        self.idle_since = 0.0
        self._reset()

    def _reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.complete = False
        self.headers_done = False
        self.error: BaseException | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.got_bytes = False
        self.keep_alive = True
        self.paused = False
        self.until_close = False
        self.timer: asyncio.TimerHandle | None = None
        self.head_bytes = 0
        self.interim = False  # parsing a 1xx response (skipped: the answer follows it)
        self.stray = False  # the worker sent a response after the answer (dropped; no reuse)
        self.on_stall: Callable[[float], None] | None = None  # called (with now) on a timeout while the reader is behind
        self.watch: asyncio.TimerHandle | None = None  # the silence bound's one timer (the module docstring)
        self.first_s = 0.0  # the first-byte bound, and the monotonic time by which that byte must be in
        self.first_by: float | None = None
        self.idle_s: float | None = None
        self.last_at = 0.0  # monotonic time of the last bytes received
        self.got_body = False
        self.abortable = False

    # -- asyncio.Protocol --
    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        self.last_at = time.monotonic()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"invalid HTTP response from worker: {exc}", got_response=True))
            self.transport.close()  # type: ignore[union-attr]
            return
        if not self.headers_done:
            # httptools buffers a header without bound: a worker streaming an endless head would
            # grow the gateway's memory, and a client could not parse the head if relayed.
            self.head_bytes += len(data)
            if self.head_bytes > MAX_HEAD_BYTES:
                self._fail(UpstreamError(f"worker's response head is over {MAX_HEAD_BYTES} bytes", got_response=True))
                self.transport.close()  # type: ignore[union-attr]
                return
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.complete:
            return
        if self.headers_done and self.until_close and exc is None:
            self.complete = True  # a body delimited by the end of the connection
            self._wake()
            return
        self._fail(UpstreamError(f"worker closed the connection{': ' + str(exc) if exc else ''}", got_response=self.got_bytes))

    # -- httptools callbacks --
    def on_message_begin(self) -> None:
        if self.complete:  # a response nobody asked for: never relayed, and the connection is not reused
            self.stray = True
            self.keep_alive = False

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.stray:
            self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        if self.stray:
            return
        status = self.parser.get_status_code()
        if 100 <= status < 200 and status != 101:  # 100 Continue, 103 Early Hints: the answer follows
            self.interim = True
            self.headers = []
            return
        self.status = status
        self.keep_alive = self.parser.should_keep_alive()
        delimited = self.status in (204, 304)
        for name, _ in self.headers:
            if name == b"content-length" or name == b"transfer-encoding":
                delimited = True
                break
        self.until_close = not delimited
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        if self.stray:
            return
        self.chunks.append(body)
        self.buffered += len(body)
        if not self.got_body:
            self.got_body = True
            if self.first_by is not None and self.watch is not None:  # the first-byte bound is met: idle from now
                self.watch.cancel()
                self.watch = None
                if self.idle_s is not None:
                    self._arm(self.idle_s)
        self._wake()

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        if self.stray:
            return
        self.complete = True
        self._wake()

    # -- helpers --
    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _arm(self, delay: float) -> None:
        self.watch = asyncio.get_running_loop().call_later(max(delay, 0.0), self._on_watch)

    def _on_watch(self) -> None:
        """The silence timer: fail the exchange if the worker is past its bound, else re-arm."""
        self.watch = None
        if self.complete or self.error is not None or self.closed:
            return
        now = time.monotonic()
        if self.first_by is not None and not self.got_body:
            if now < self.first_by:
                self._arm(self.first_by - now)
                return
            bound, phase = self.first_s, "first_byte"
        elif self.idle_s is not None:
            if self.paused or self.chunks:  # the reader is behind: the silence is not the worker's
                self._arm(self.idle_s)
                return
            if now - self.last_at < self.idle_s:
                self._arm(self.last_at + self.idle_s - now)
                return
            bound, phase = self.idle_s, "idle"
        else:
            return
        what = "no first byte" if phase == "first_byte" else "no data"
        self._fail(UpstreamStalled(f"{what} from the worker within {bound:g} s", phase=phase, after_s=bound,
                                   got_response=self.got_bytes))
        if self.transport is not None:
            self.transport.close()

    def on_timeout(self, timeout_s: float) -> None:
        self.timer = None
        if not self.complete:
            behind = self.paused or bool(self.chunks)
            self._fail(UpstreamTimeout(f"no complete answer within {timeout_s:g} s", got_response=self.got_bytes,
                                       reader_behind=behind))
            if self.transport is not None:
                self.transport.close()
            if behind and self.on_stall is not None:
                # The reader waits on its own client, maybe for good: the worker is done with now.
                self.on_stall(time.monotonic())

    async def wait(self) -> None:
        if self.watch is None and self.idle_s is not None and self.headers_done:
            # the reader waits for more of an answer whose head is in: silence counts from here
            # (armed only now, so an answer that came whole in one read arms no timer at all)
            self._arm(self.idle_s)
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None


def cancel_timers(conn: Connection) -> None:
    for timer in (conn.timer, conn.watch):
        if timer is not None:
            timer.cancel()
    conn.timer = conn.watch = None
