"""The one relay of a streamed upstream answer to its client, whole SSE events at a time.

Both data planes use it: ``Proxy`` (a pooled ``UpstreamResponse``) and ``DisaggProxy`` (the
decode worker's httpx stream); each passes its own read and its own break exceptions.

Invariants:
- Only whole events are relayed: the start of one not yet ended waits for its end, so a worker
  dying mid-event leaves the client whole events, then the caller's error event. An unfinished
  event longer than ``MAX_PENDING_EVENT`` (not SSE, or one huge event) is relayed as it comes.
- An event stream (``text/event-stream``) ends whole only with ``data: [DONE]`` or an error event
  of its worker's own (``ended_whole``); a body that ends otherwise broke. Other streamed answers
  (a worker's JSON) end when their body ends. A break after a whole stream is an end.
- On an end the relay ends the response; on a break it leaves the response open for the
  caller's error event. No chunk is parsed on the way through; the gaps between chunks are timed
  (one clock read and one call per chunk) for the inter-token latency histogram.
"""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from mesh.gateway.client_io import Exchange

MAX_PENDING_EVENT = 1 << 20  # an unfinished SSE event held back longer than this is relayed as is
Read = Callable[[], Awaitable[bytes]]  # the next chunk, b"" at the body's end; raises on a break


@dataclass(frozen=True, slots=True)
class StreamBreak:
    """How a relayed stream broke: ``error`` raised by its read, or None when an event stream's
    body ended without ``[DONE]`` (its unfinished event, if any, was dropped)."""

    error: Exception | None


async def relay_stream(
    state: Exchange, data: bytes, read: Read, sse: bool, breaks: type[Exception] | tuple[type[Exception], ...],
    gap: Callable[[float], None] | None = None,
) -> bytes | StreamBreak:
    """Relay ``data`` (the first bytes, not empty), then every chunk ``read`` gives; ``gap`` is
    told the seconds between successive chunks (the first measured from this call).

    Returns the stream's last chunks (where the usage chunk and ``[DONE]`` are) once it ended
    and the response is complete; a ``StreamBreak`` when it broke (an exception of ``breaks``
    from ``read``, or an event stream that ended without ``[DONE]``): the response is then
    still open. ``sse``: an OpenAI event stream (``is_sse``)."""
    # The last four chunks, kept by reference (no copy per chunk): the usage chunk and [DONE]
    # end the stream, however the reads split them.
    c4 = c3 = c2 = b""
    c1 = data
    pending = b""  # the start of an event not ended yet
    clock = time.perf_counter
    last = clock()
    try:
        while True:
            cut = whole_events(data)
            if cut == len(data):
                await state.chunk(data)
            else:
                if cut:
                    await state.chunk(data[:cut])
                pending = data[cut:]
                if len(pending) > MAX_PENDING_EVENT:  # not SSE, or one huge event: relayed as it comes
                    await state.chunk(pending)
                    pending = b""
            data = await read()
            if not data:
                break
            if gap is not None:
                now = clock()
                gap(now - last)
                last = now
            if pending:
                data, pending = pending + data, b""
            c4, c3, c2, c1 = c3, c2, c1, data
    except breaks as exc:
        if pending or not ended_whole(c2, c1):
            return StreamBreak(exc)
        await state.end()  # the client has it all: only the framing broke
        return b"".join((c4, c3, c2, c1))
    if sse and not ended_whole(c2, c1):  # the body ended (a FIN ends a close-delimited one) before [DONE]
        return StreamBreak(None)
    if pending:  # a last event without its blank line: the worker's own, relayed as sent
        await state.last(pending)
    else:
        await state.end()
    return b"".join((c4, c3, c2, c1))


def whole_events(data: bytes) -> int:
    """How many leading bytes of ``data`` are whole SSE events (each ends with a blank line)."""
    if data.endswith((b"\n\n", b"\r\n\r\n")):  # the common case: a worker writes whole events
        return len(data)
    lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


_DONE_AT_END = re.compile(rb"\ndata: ?\[DONE\][ \t\r\n]*\Z")
_ERROR_AT_END = re.compile(rb'(?:\A|\n)data: ?\{\s*"error"\s*:[^\n]*[\r\n]*\Z')
_DONE_TAIL = 64  # bytes of a stream's end searched for [DONE] (and its trailing blank lines)


def ended_whole(before: bytes, last: bytes) -> bool:
    """Whether an OpenAI event stream whose last two chunks are ``before`` and ``last`` ended as
    its worker meant: with ``data: [DONE]`` (with or without the blank line that ends it), or with
    an error event of its own (the bundled worker sends no [DONE] after one: the request was
    rejected or its engine died, and the worker said so)."""
    end = last if len(last) >= _DONE_TAIL else before[-_DONE_TAIL:] + last
    if _DONE_AT_END.search(b"\n" + end if len(end) < _DONE_TAIL else end) is not None:
        return True
    return _ERROR_AT_END.search(before + last) is not None  # rare: a stream without [DONE]


def is_sse(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether a response is an event stream (a worker may answer a stream request with JSON:
    that is relayed as is, with no ``[DONE]`` to wait for). Header names are lower-case."""
    for key, value in headers:
        if key == b"content-type":
            return value[:17].lower() == b"text/event-stream"
    return False
