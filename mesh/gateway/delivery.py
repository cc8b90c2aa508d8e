"""Delivering a worker's answer to the client once its first bytes are in: relayed whole or as a
stream (``sse_relay``), a broken stream ended with an error event, and what the answer counts
for: the worker's success or failure (a stream's once it ended), the earlier attempts' suspects,
the prefix reuse predicted vs reported and the tokens it reported (``worker_answer.count_usage``).
The proxy owns one; ``shutting_down`` (set by the proxy's ``shut_down``) makes every break nobody's.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from mesh.cluster.registry import WorkerRegistry
from mesh.core.router import Lease
from mesh.gateway.client_io import Exchange
from mesh.gateway.headers import response_headers
from mesh.gateway.sse_relay import StreamBreak, ended_whole, is_sse, relay_stream
from mesh.gateway.upstream import UpstreamError, UpstreamResponse, UpstreamStalled, UpstreamTimeout
from mesh.gateway.verdicts import SHUTDOWN_MESSAGE, Failure
from mesh.gateway.worker_answer import count_usage, worker_error
from mesh.metrics import Metrics
from mesh.request_metrics import Series
from policies.base import TargetState


class Delivery:
    def __init__(self, registry: WorkerRegistry, metrics: Metrics) -> None:
        self.registry = registry
        self.metrics = metrics
        self.shutting_down = False
        self._prefix_children: dict[str, tuple[Any, Any]] = {}  # target -> (predicted, reported)

    async def deliver(
        self, resp: UpstreamResponse, first: bytes, stream: bool, state: Exchange, lease: Lease, deadline: float,
        suspects: list[Failure], series: Series,
    ) -> None:
        """Relay an answer whose first bytes are in, and count it: the worker's success (a stream
        once it ended whole, not at its first byte: a break counts as a failure, a client too slow
        to read as nobody's), the suspects' failures, the prefix reuse and tokens of a 200, a
        stream's gaps between chunks (``series``)."""
        target = lease.target
        resp.settle()  # its bytes go to the client from here: no abort any more
        streaming = stream and resp.status == 200 and is_sse(resp.headers)
        if not streaming:
            self.registry.record_success(target.id)
        for f in suspects:  # they failed where this worker does not
            self.registry.record_failure(f.suspect, time.monotonic(), f.message)  # type: ignore[arg-type]
        suspects.clear()
        out = response_headers(resp.headers)
        out.append((b"x-mesh-worker", target.id.encode()))
        if streaming:
            # a client that stops reading holds its lease only until the request timeout
            resp.on_stall(lease.finish)
            tail = await self._stream(resp, first, out, state, target, lease, deadline, is_sse(resp.headers), series)
            if tail:  # b"": it broke (counted there), or its client read too slowly (nobody's fault)
                self.registry.record_success(target.id)
        elif resp.status >= 400:
            await state.respond(resp.status, *worker_error(resp, first, target))
            tail = b""
        else:
            await state.respond(resp.status, out, first)
            tail = first
        if tail and resp.status == 200:
            cached = count_usage(tail, series, state)
            if cached is not None:
                self._count_prefix(lease, cached)

    async def _stream(
        self, resp: UpstreamResponse, first: bytes, headers: list[tuple[bytes, bytes]], state: Exchange,
        target: TargetState, lease: Lease, deadline: float, sse: bool, series: Series,
    ) -> bytes:
        """Relay the stream (``sse_relay.relay_stream``); returns its last chunks (where the usage
        chunk is), b"" if it broke. ``sse``: an OpenAI event stream, whose end without ``[DONE]``
        is a break.

        The lease ends at ``deadline`` (the request timeout) if the relay is still going: the
        upstream's timer covers an unfinished answer only, and a worker that sent its whole
        answer to a client that stopped reading is done with it (one timer, no task)."""
        data = first + resp.read_nowait()
        await state.start(200, headers)
        if resp.at_eof and (not sse or ended_whole(b"", data)):  # all here: one body write instead of two
            await state.last(data)
            return data
        timer = asyncio.get_running_loop().call_at(deadline, _finish_lease, lease)
        try:
            end = await relay_stream(state, data, resp.read_chunk, sse, UpstreamError, series.itl)
            if isinstance(end, StreamBreak):
                await self.end_broken_stream(state, target.id, target.worker, end)
                return b""
            return end
        finally:
            timer.cancel()

    async def end_broken_stream(self, state: Exchange, target_id: str, worker: str, broke: StreamBreak) -> None:
        """End a stream that broke after its first byte (whole events went out) with an error
        event, and count it (``mesh_stream_errors_total``, the worker's failure), unless the
        gateway's shutdown broke it, or the gateway had stopped reading the worker because the
        client read too slowly (the worker is not to blame: slow readers would open a healthy
        worker's circuit)."""
        if self.shutting_down:  # end_in_flight closed the upstream connections: nobody's failure, nothing counted
            await state.stream_error(SHUTDOWN_MESSAGE)
            return
        self.metrics.stream_errors_total.inc()
        exc = broke.error
        if exc is None:  # the body ended (a worker that delimits it by closing the connection died) before [DONE]
            self.registry.record_failure(target_id, time.monotonic(), "stream broke: it ended without data: [DONE]")
            await state.stream_error(f"worker {worker} failed mid-stream (its stream ended without [DONE])")
            return
        if isinstance(exc, UpstreamTimeout) and exc.reader_behind:
            await state.stream_error(f"request timed out: the client read the stream too slowly ({exc})")
            return
        if isinstance(exc, UpstreamStalled):
            self.registry.record_failure(target_id, time.monotonic(), f"stream stalled: {exc}")
            await state.stream_error(f"worker {worker} went silent for {exc.after_s:g} s mid-stream "
                                     "(server.idle_timeout_s)")
            return
        what = "timed out" if isinstance(exc, UpstreamTimeout) else "failed mid-stream"
        self.registry.record_failure(target_id, time.monotonic(), f"stream broke: {exc!r}")
        await state.stream_error(f"worker {worker} {what}")

    def _count_prefix(self, lease: Lease, cached: int) -> None:
        """Predicted vs reported cached tokens of one answered request whose answer says."""
        tid = lease.target.id
        pair = self._prefix_children.get(tid)
        if pair is None:
            if len(self._prefix_children) > 4096:
                self._prefix_children.clear()
            m = self.metrics
            pair = self._prefix_children[tid] = (
                m.prefix_predicted_tokens_total.labels(tid), m.prefix_reported_tokens_total.labels(tid)
            )
        pair[0].inc(lease.prompt_tokens - lease.uncached_tokens)
        pair[1].inc(cached)


def _finish_lease(lease: Lease) -> None:
    lease.finish(time.monotonic())
