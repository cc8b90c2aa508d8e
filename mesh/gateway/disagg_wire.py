"""The messages of a disaggregated exchange: the bodies sent, the answers read, the errors.

vLLM's ``kv_transfer_params`` convention, so the relay drives vLLM P/D deployments as well as the
bundled workers: the prefill worker gets the client's body cut to one token (``prefill_body``),
and its answer's ``kv_transfer_params`` go with the client's own body to the decode worker
(``decode_body``), whose answer (``RelayResponse``) is the client's. Both requests carry the same
``X-Request-Id``. Every answer is read bounded (``MAX_ANSWER_BYTES``); what a failed attempt means
for the relay is an exception here (``Retry``, ``NewPair``, ``Full``; ``RelayError`` for the client).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from mesh.core.router import Lease
from mesh.errors import openai_error_bytes, sse_error_event
from mesh.gateway.disagg_bookkeeping import RelayStats
from mesh.gateway.verdicts import MAX_ANSWER_BYTES, SHUTDOWN_MESSAGE

log = logging.getLogger("mesh.gateway.disagg_relay")

HOP_BY_HOP = frozenset(
    "connection keep-alive proxy-authenticate proxy-authorization te trailer transfer-encoding upgrade host "
    "content-length content-encoding".split()
)

# Error codes of a decode worker's answer to a transfer (the bundled worker's and vLLM's).
ADMISSION_CODES = frozenset({"kv_admission_full", "kv_no_space"})
PREFILL_SIDE_CODES = frozenset({"kv_transfer_failed", "kv_transfer_corrupt", "kv_transfer_truncated", "kv_transfer_gone"})
# Of those, what the prefill worker is charged for (``Relay.transfer_failed``): bytes it sent that
# failed verification or ended early, at once; a pull that could not connect or broke (its transfer
# server, or the network between), once the same decode worker took another prefill worker's
# transfer for the request. ``kv_transfer_gone`` (released before the pull: its deadline, a cancel)
# is no fault of a worker's.
TRANSFER_CHARGED = frozenset({"kv_transfer_corrupt", "kv_transfer_truncated"})
TRANSFER_SUSPECT = frozenset({"kv_transfer_failed"})

PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}


class RelayError(Exception):
    """No pair could serve the request; answer ``status``/``body`` (OpenAI error shape)."""

    def __init__(self, status: int, message: str, code: str, body: bytes | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code
        self.headers = dict(headers or {})
        self.body = openai_error_bytes(status, message, body, code)


class RelayClosed(RelayError):
    """The relay's client was closed under the request (the gateway's shutdown ends what is in
    flight that way): nothing is retried and no worker is charged."""

    def __init__(self) -> None:
        super().__init__(503, "the relay's connections were closed (the gateway is shutting down)", "shutting_down")


class Retry(Exception):
    """An attempt failed before anything reached the client: the relay tries another worker."""

    def __init__(self, message: str, status: int = 502, body: bytes | None = None, code: str = "upstream_error",
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.body, self.code = status, body, code
        self.headers = dict(headers or {})  # the answering worker's name, for the client if no retry is left


class NewPair(Retry):
    """The transfer failed on the prefill side: another pair, that prefill excluded."""


class Full(Retry):
    """The decode worker refused admission (retryable: another worker, or later)."""


@dataclass
class RelayResponse:
    """The decode worker's answer, first bytes already read; stream it, then ``aclose``."""

    status: int
    headers: list[tuple[str, str]]
    first: bytes
    stream: bool
    prefill: str
    decode: str
    kv_transfer_params: dict[str, Any] | None
    prefill_usage: dict[str, Any] | None  # the prefill answer's usage (its own prefix-cache hits)
    _resp: httpx.Response
    _chunks: AsyncIterator[bytes] | None  # the rest of a streamed body (one iterator: httpx allows one)
    _lease: Lease
    _now: Callable[[], float]
    deadline: float  # event-loop time at which the relay of this answer must have ended
    _client: httpx.AsyncClient | None = None  # the relay's: closed under the stream = shutdown
    # The other leg still running when the answer is handed over (SGLang's prefill, sent beside
    # the decode): it finishes its own lease; ``aclose`` ends it if it outlives the answer.
    _companion: asyncio.Task[None] | None = None
    _closed: bool = field(default=False)

    async def body(self) -> AsyncIterator[bytes]:
        """The whole body: the first bytes, then the rest (an SSE error event if it breaks: the
        shutdown's when the relay's client was closed under it, else one naming the worker)."""
        yield self.first
        if self._chunks is None:
            return
        try:
            async for chunk in self._chunks:
                yield chunk
        except httpx.HTTPError as exc:
            if self._client is not None and self._client.is_closed:
                yield sse_error_event(SHUTDOWN_MESSAGE, "shutting_down")
                return
            log.warning("decode stream from %s broke: %r", self.decode, exc)
            err = {"error": {"message": f"worker {self.decode} failed mid-stream", "type": "server_error",
                             "param": None, "code": "upstream_error"}}
            yield b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n"

    async def read_chunk(self) -> bytes:
        """The next bytes of a streamed body after ``first``; b"" at its end. A break raises
        ``httpx.HTTPError`` (``body()`` would turn it into an error event, unrecognizable as one)."""
        if self._chunks is not None:
            async for chunk in self._chunks:  # not closed on return: the next call goes on with it
                if chunk:
                    return chunk
        return b""

    async def aclose(self) -> None:
        """Close the upstream and finish the decode lease; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._resp.aclose()
        finally:
            self._lease.finish(self._now())
            if self._companion is not None and not self._companion.done():
                self._companion.cancel()
                await asyncio.gather(self._companion, return_exceptions=True)


def prefill_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill worker's body: the client's with ``max_tokens: 1`` (and ``max_completion_tokens``
    when given), ``stream: false``, no ``stream_options``/``min_tokens``/``n``, and
    ``kv_transfer_params: {do_remote_decode: true, ...}``: its answer says where the blocks are."""
    out = dict(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    # one sequence computes the prompt for every choice (``n`` runs on the decode side)
    for key in ("stream_options", "min_tokens", "min_completion_tokens", "n", "best_of"):
        out.pop(key, None)
    out["kv_transfer_params"] = dict(PREFILL_PARAMS)
    return out


def decode_body(body: Mapping[str, Any], kv: dict[str, Any] | None) -> dict[str, Any]:
    """The decode worker's body: the client's own, plus the prefill answer's ``kv_transfer_params``
    (None: an engine without a KV connector; the decode worker computes the prompt itself)."""
    out = dict(body)
    if kv is not None:
        out["kv_transfer_params"] = kv
    else:
        out.pop("kv_transfer_params", None)
    return out


def forward_headers(headers: Iterable[tuple[str, str]] | None, request_id: str) -> dict[str, str]:
    out = {k: v for k, v in (headers or ()) if k.lower() not in HOP_BY_HOP and k.lower() != "x-request-id"}
    out["x-request-id"] = request_id
    out["content-type"] = "application/json"
    return out


def error_code(body: bytes) -> str | None:
    try:
        err = json.loads(body).get("error")
        return str(err.get("code")) if isinstance(err, dict) and err.get("code") else None
    except (ValueError, AttributeError):
        return None


def named_headers(resp: httpx.Response, header: str, target_id: str) -> dict[str, str]:
    """An error answer's headers for the client: the worker's name, and its own ``retry-after``."""
    out = {header: target_id}
    retry_after = resp.headers.get("retry-after")
    if retry_after is not None:
        out["retry-after"] = retry_after
    return out


def default_code(status: int) -> str:
    return "upstream_error" if status >= 500 else "invalid_request"


class TooLarge(Exception):
    """A worker's answer over ``MAX_ANSWER_BYTES`` (the relay holds a non-streamed answer whole)."""


async def read_bounded(resp: httpx.Response) -> bytes:
    """The whole body of a response sent with ``stream=True``, at most ``MAX_ANSWER_BYTES`` (the
    proxy's bound): a worker answering without end cannot grow the gateway's memory."""
    if resp.is_stream_consumed:  # a transport that hands over whole responses (httpx.MockTransport)
        if len(resp.content) > MAX_ANSWER_BYTES:
            raise TooLarge(f"answered over {MAX_ANSWER_BYTES >> 20} MiB")
        return resp.content
    parts: list[bytes] = []
    size = 0
    async for chunk in resp.aiter_raw():
        size += len(chunk)
        if size > MAX_ANSWER_BYTES:
            raise TooLarge(f"answered over {MAX_ANSWER_BYTES >> 20} MiB")
        parts.append(chunk)
    return b"".join(parts)


async def first_bytes(chunks: AsyncIterator[bytes]) -> bytes:
    async for chunk in chunks:  # not closed on return: the caller goes on with the same iterator
        if chunk:
            return chunk
    return b""


def what_failed(exc: Exception) -> str:
    """An httpx failure for a client: its kind, never its text (which may name the worker's address)."""
    if isinstance(exc, httpx.TimeoutException):
        return "timed out: " + ("could not connect" if isinstance(exc, httpx.ConnectTimeout) else "no data in time")
    if isinstance(exc, httpx.ConnectError):
        return "could not connect"
    if isinstance(exc, TooLarge):
        return str(exc)
    return "the connection broke"


def relay_inputs(body: bytes | Mapping[str, Any], request_id: str | None,
                 stats: RelayStats | None) -> tuple[dict[str, Any], str, RelayStats]:
    """What every relay starts from: the body as a JSON object (else ``RelayError`` 400), the
    request id (a fresh one when the caller has none), and the stats the request is counted in."""
    data = json.loads(body) if isinstance(body, (bytes, bytearray, str)) else dict(body)
    if not isinstance(data, dict):
        raise RelayError(400, "request body must be a JSON object", "invalid_request")
    stats = stats if stats is not None else RelayStats()
    stats.requests += 1
    return data, request_id or f"mesh-{uuid.uuid4().hex}", stats
