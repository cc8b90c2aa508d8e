"""The gateway's HTTP/1.1 server protocol: uvicorn's httptools protocol with bounded request heads.

uvicorn parses a head without bound in size or time: one connection sending an endless header
stalled every other client (the parser's cost grows with the square of the header), and a
connection that never finished its head held a descriptor forever. This protocol:

- answers a head longer than ``max_head_bytes`` with 431 and closes (nginx answers 400 or 494
  past its 8-32 KiB buffers; the limit is of that order);
- closes a connection whose head is not complete ``head_timeout_s`` after it opened or after the
  head's first byte (a 408 when some bytes came);
- answers every parser rejection, and every ``Upgrade`` request (Mesh serves no WebSocket), in
  the OpenAI error shape.

A client that shuts its sending side (``SHUT_WR``) has left, as nginx and hyper take it: a FIN
cannot be told from a close, and a closed client's request must free its worker. The proxy does
not start a request whose client left (``mesh.gateway.client_io.client_left``).

Invariant: ``_head_bytes`` counts the bytes fed to the parser since the current head began
(``_in_head``, at ``_head_since``); a head ends at the parser's ``on_headers_complete`` and the
next one begins after ``on_message_complete``. One timer per connection, not per request: it fires
at most every ``head_timeout_s`` and judges the head then in progress (a keep-alive connection's
requests arm nothing). Ownership: one instance per connection, on the server's loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from mesh.errors import MeshError

log = logging.getLogger("mesh.gateway.http")


def protocol_class(max_head_bytes: int, head_timeout_s: float) -> type[HttpToolsProtocol]:
    """uvicorn's ``http`` protocol class for the gateway, with these bounds."""

    class Protocol(MeshHttpProtocol):
        pass

    Protocol.max_head_bytes = max_head_bytes
    Protocol.head_timeout_s = head_timeout_s
    return Protocol


class MeshHttpProtocol(HttpToolsProtocol):
    max_head_bytes = 32 * 1024
    head_timeout_s = 5.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # a connection starts by sending a head
        self._head_bytes = 0
        self._head_since = 0.0  # loop time the current head (or the connection) began
        self._head_timer: asyncio.TimerHandle | None = None

    # -- connection --
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_since = self.loop.time()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._check_head)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._in_head:
            super().data_received(data)
            return
        if self._head_bytes == 0 and data:
            self._head_since = self.loop.time()  # the head's first byte: its clock starts
        room = self.max_head_bytes - self._head_bytes
        if len(data) <= room:
            self._head_bytes += len(data)
            super().data_received(data)
            return
        # The head may end inside ``room`` (a body follows in the same read): feed up to the
        # limit, and only the rest once the head is complete.
        self._head_bytes += room
        super().data_received(data[:room])
        if self.transport.is_closing():
            return
        if self._in_head:
            self._reject(431, f"request head larger than {self.max_head_bytes} bytes", "request_header_too_large")
            return
        super().data_received(data[room:])

    # -- parser callbacks --
    def on_headers_complete(self) -> None:
        self._in_head = False
        if self.parser.should_upgrade():
            self._reject(400, "protocol upgrades are not supported (Mesh serves HTTP/1.1 only)", "upgrade_not_supported")
            return
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if self.cycle is not None:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self.cycle is not None:
            super().on_message_complete()
        self._in_head = True
        self._head_bytes = 0
        self._head_since = math.inf  # idle between requests: uvicorn's keep-alive timeout governs

    def send_400_response(self, msg: str) -> None:
        self._reject(400, msg, "invalid_http")

    def _unsupported_upgrade_warning(self) -> None:
        """Quiet: the upgrade was answered with a 400 in ``on_headers_complete``."""

    # -- internals --
    def _reject(self, status: int, message: str, code: str) -> None:
        """Answer ``status`` in the OpenAI shape and close; nothing of the request reaches the app."""
        self._cancel_head_timer()
        self.cycle = None  # type: ignore[assignment]
        body = MeshError(status, message, code=code).to_bytes()
        content = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            content.extend([name, b": ", value, b"\r\n"])
        content += [b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body), body]
        self.transport.write(b"".join(content))
        self.transport.close()

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _check_head(self) -> None:
        """The connection's head timer: a head in progress past ``head_timeout_s`` ends the
        connection (a 408 when some of it came); else the timer comes back when the current head
        (or the next one, at the earliest) could be late."""
        self._head_timer = None
        if self.transport.is_closing():
            return
        late = self.loop.time() - self._head_since
        if self._in_head and late >= self.head_timeout_s:
            if self._head_bytes:
                self._reject(408, f"request head not complete within {self.head_timeout_s:g} s", "head_timeout")
            else:
                self.transport.close()  # opened (or idle after an answer) and silent: nothing to answer
            return
        wait = self.head_timeout_s - late if self._in_head and late > 0 else self.head_timeout_s
        self._head_timer = self.loop.call_later(wait, self._check_head)
