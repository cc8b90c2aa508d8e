"""The data-plane proxy: one OpenAI request in, one worker's answer out, at raw ASGI level.

Why raw ASGI (measured, see BENCHMARKS.md): on this 2-core machine Starlette's routing and
middleware alone cost about 40% of a minimal proxy's rate, so the hot routes bypass FastAPI
(``MeshApp.__call__`` dispatches them here). Upstream requests go through the one pooled
``mesh.gateway.upstream.UpstreamPool`` (why not httpx/aiohttp: see that module).

Invariants:
- The body is forwarded byte for byte; routing reads a decoded copy.
- Every routed attempt holds a ``Lease`` that is finished exactly once on every path (success,
  upstream failure, retry, client disconnect, cancellation): ``try/finally`` around each attempt.
- Until the first byte has gone to the client, a failed attempt is retried on another worker
  (``Router.route(..., exclude=...)``) with backoff; after it, the stream ends with an SSE error
  event and ``[DONE]``. A retry moves the request's session only once its target served it.
- A client disconnect cancels the upstream request: a watcher task reads the ASGI ``receive``
  channel and cancels the handler, whose ``finally`` blocks close the upstream response.
- A stream relays whole SSE events only (an unfinished one waits for its end), so a stream that
  breaks ends with whole events, the error event and ``[DONE]``. It counts as its worker's
  success once it ended whole; a break counts as a failure, a client too slow to read does not,
  and that client's lease ends at the request timeout even if it never reads again. An event
  stream (``text/event-stream``) whose body ends without the ``data: [DONE]`` every OpenAI
  server sends last broke (a worker that delimits its body by closing the connection and dies
  mid-stream just ends it); other streamed answers (a worker's JSON) are relayed as they come.
- No write to the client waits longer than ``server.client_write_timeout_s`` (``WriteWatch``,
  up to ``mesh.gateway.client_io.WRITE_CHECK_S`` late; the server's flow control makes a write wait while its client
  reads nothing): past it the client is abandoned (``ClientWriteTimeout``) as if it had left:
  the upstream response is closed, the lease ends, the connection is dropped, and the worker's
  health is not touched (logged at most once per ``mesh.gateway.client_io.LOG_EVERY_S``, the rest summed up; the metric
  counts each). A finished response whose bytes the client leaves buffered (a large
  non-streamed answer is one write that returns at once) has its connection dropped alike once
  none of them is taken for that long (``WriteWatch.drain``).
- Prefix reuse is counted twice, for answers that report it: the router's prediction (the lease's
  cached tokens, from the decision's overlap on the chosen target) and the worker's
  ``usage.prompt_tokens_details.cached_tokens``. Only the end of the answer is searched (a JSON
  body's tail; a stream's last chunks, where the usage chunk comes before ``[DONE]``): no chunk is
  parsed on the way through.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import random
import re
import time
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any, Protocol


from mesh.gateway.client_io import (
    WATCH_AFTER_S, ClientWriteTimeout, Exchange, Receive, Send, WriteWatch, abort_client, client_label,
    watch_disconnect,
)
from mesh.errors import MeshError, openai_error_bytes
from mesh.metrics import Metrics
from mesh.request.prompt import ParsedRequest, PromptProcessor
from mesh.cluster.registry import WorkerRegistry
from mesh.core.router import Lease, Router
from mesh.gateway.upstream import ConnectError, UpstreamError, UpstreamPool, UpstreamResponse, UpstreamTimeout, split_url
from policies.base import Decision, NoCandidate, TargetState

log = logging.getLogger("mesh.gateway.proxy")

Scope = MutableMapping[str, Any]

# Never forwarded in either direction (RFC 9110 hop-by-hop, plus what the proxy recomputes).
HOP_BY_HOP = frozenset(
    b"connection keep-alive proxy-authenticate proxy-authorization proxy-connection te trailer trailers "
    b"transfer-encoding upgrade host content-length expect".split()
)
RESPONSE_DROP = HOP_BY_HOP | {b"server", b"date"}
# Set by the proxy, never taken from the client: a client's data-parallel rank would come first
# and a vLLM worker would follow it over the router's choice.
ROUTER_SET = frozenset({b"content-type", b"x-data-parallel-rank"})
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
_BAD_HEADER_BYTES = re.compile(rb"[\r\n\0]")
JSON_HEADERS = [(b"content-type", b"application/json")]
_CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
MAX_PENDING_EVENT = 1 << 20  # an unfinished SSE event held back longer than this is relayed as is
MAX_ANSWER_BYTES = 64 << 20  # a non-streamed answer (held whole before it is relayed) larger than this is a 502


SHUTDOWN_MESSAGE = "the gateway is shutting down: the request was ended at its shutdown timeout"


@dataclass(frozen=True, slots=True)
class StatusVerdict:
    """What a worker's answer status means while nothing has reached the client yet."""

    retry: bool  # another worker may serve the request
    charge: bool  # a failure of the worker's at once (its circuit breaker)
    suspect: bool  # a failure of the worker's only once another worker serves the same request


def status_verdict(status: int) -> StatusVerdict:
    """The proxy's rule for a worker's answer status, shared by the disaggregated relay (its
    prefill and decode attempts alike): 502/503/504 are retried elsewhere and charged at once; a
    500 is retried and only suspect (it may be the request's fault: an input that crashes any
    worker must not open every circuit), charged once another worker serves the request; a 429
    is retried, never charged (a busy worker is not a broken one); any other status is the answer."""
    return _VERDICTS.get(status, _ANSWER)


_ANSWER = StatusVerdict(retry=False, charge=False, suspect=False)
_VERDICTS = {s: StatusVerdict(retry=True, charge=s in (502, 503, 504), suspect=s == 500) for s in RETRY_STATUSES}


def _shutdown_error() -> MeshError:
    return MeshError(503, SHUTDOWN_MESSAGE, code="shutting_down")


class _UpstreamFailed(Exception):
    """An attempt failed before anything reached the client: retry elsewhere."""

    def __init__(
        self,
        kind: str,
        message: str,
        *,
        status: int = 502,
        body: bytes | None = None,
        headers: list[tuple[bytes, bytes]] | None = None,
        worker_fault: bool = True,
        suspect: bool = False,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status
        self.body = body  # a worker's own error answer, passed through if no retry is left
        self.headers = headers
        # Counts toward the circuit breaker at once, unless only suspect (a 500: see ``_Failure``).
        self.worker_fault = worker_fault
        self.suspect = suspect


@dataclass(slots=True)
class _Failure:
    """The last failed attempt, answered to the client when no retry is left."""

    kind: str
    status: int
    message: str
    body: bytes | None = None
    headers: list[tuple[bytes, bytes]] | None = None
    # A worker's 500 may be the request's fault (an input that crashes any worker): it counts
    # toward that worker's circuit breaker only if another worker then serves the same request,
    # so one poison request retried everywhere cannot open every circuit.
    suspect: str | None = None  # target id


class SessionMirror(Protocol):
    """Copies a session's shared binding into the local table (``SharedSessionTable.mirror``)."""

    async def __call__(self, session_id: str, now: float) -> object: ...


class Proxy:
    def __init__(
        self,
        pool: UpstreamPool,
        registry: WorkerRegistry,
        router: Router,
        prompts: PromptProcessor,
        metrics: Metrics,
        mirror: SessionMirror | None = None,
    ) -> None:
        self.pool = pool
        self.registry = registry
        self.router = router
        self.prompts = prompts
        self.metrics = metrics
        self.mirror = mirror  # shared state (Redis): a session's binding copied in before its decision
        self._urls: dict[tuple[str, str], tuple[str, str, int, bytes]] = {}
        self._sessions_config: object = None
        self._session_header_name = b""
        self._route_hist = {r: metrics.request_latency.labels(r) for r in ("chat", "completions")}
        self._ttfb_hist = {r: metrics.ttfb.labels(r) for r in ("chat", "completions")}
        self._prefix_children: dict[str, tuple[Any, Any]] = {}  # target -> (predicted, reported)
        self._write_watch = WriteWatch(metrics.client_write_timeouts_total)  # client writes past server.client_write_timeout_s
        # Set by ``shut_down`` (the gateway's shutdown timeout, right before it closes the pool):
        # from then on an upstream break is the gateway's doing, charged to no worker.
        self.shutting_down = False

    async def aclose(self) -> None:
        """At the lifespan's end, before the pool closes: nothing of its own to close here."""
        return None

    def shut_down(self) -> None:
        """The gateway is about to close every upstream connection (``app.end_in_flight``): the
        requests it cuts end with "the gateway is shutting down", and no worker's circuit breaker,
        health or ``mesh_stream_errors_total`` is charged (they said "worker X failed mid-stream"
        and counted a failure of a healthy worker)."""
        self.shutting_down = True

    # -- ASGI entry --
    async def handle(self, scope: Scope, receive: Receive, send: Send, kind: str, route: str) -> None:
        """Serve one data-plane request end to end. Never raises (except real cancellation)."""
        start = time.perf_counter()
        task = asyncio.current_task()
        state = Exchange(send, self.registry.config.server.client_write_timeout_s, self._write_watch, task)
        watcher: asyncio.TimerHandle | None = None
        try:
            headers = scope["headers"]
            self._check_auth(headers)
            server = self.registry.config.server
            raw = await read_body(receive, headers, server.max_body_bytes, server.body_idle_timeout_s)
            watcher = state.loop.call_later(WATCH_AFTER_S, watch_disconnect, receive, state, task)
            t0 = time.perf_counter()
            parsed = await self.prompts.process(raw, kind, _header(headers, self._session_header()))
            self.metrics.prompt_seconds.observe(time.perf_counter() - t0)
            if self.mirror is not None and parsed.info.session_id:
                await self.mirror(parsed.info.session_id, time.monotonic())
            await self._forward(parsed, headers, state, route, start)
        except ClientWriteTimeout:
            await self._abandon(state, scope)
        except MeshError as exc:
            await self._error(state, exc, scope)
        except asyncio.CancelledError:
            if not state.disconnected:
                raise
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            state.status = 499
            self.metrics.client_disconnects_total.inc()
        except Exception as exc:  # a bug must never surface as a traceback to the client
            log.exception("unexpected error in proxy: %s", exc)
            await self._error(state, MeshError(500, "internal gateway error", code="internal_error"), scope)
        finally:
            state.finish()
            if watcher is not None:
                watcher.cancel()
            if state.watch_task is not None:
                state.watch_task.cancel()
            self.metrics.request_done(route, state.status)
            self._route_hist[route].observe(time.perf_counter() - start)

    async def _error(self, state: Exchange, exc: MeshError, scope: Scope) -> None:
        try:
            await state.error(exc)
        except ClientWriteTimeout:
            await self._abandon(state, scope)

    async def _abandon(self, state: Exchange, scope: Scope) -> None:
        """The client accepted nothing for ``client_write_timeout_s``: it is the client's fault
        (no worker is charged). The upstream response and the lease were closed on the way out
        of ``_forward``; the connection is dropped here (answered 499, like a client that left)."""
        state.done = True  # from here the disconnect watcher cancels nothing
        state.status = 499
        self.metrics.client_write_timeouts_total.inc()
        self._write_watch.log.warning(
            "client write timeout: a write to %s waited %g s (it stopped reading); response abandoned, worker freed",
            client_label(scope.get("client")), state.write_timeout_s)
        if abort_client(state.send):
            # one loop turn, so that the server sees the connection lost before the handler
            # returns (else uvicorn logs "ASGI callable returned without completing response")
            try:
                await asyncio.sleep(0)
            except asyncio.CancelledError:  # the client left in the same turn
                if not state.disconnected:
                    raise
                asyncio.current_task().uncancel()  # type: ignore[union-attr]

    def _session_header(self) -> bytes:
        sessions = self.registry.config.sessions
        if sessions is not self._sessions_config:
            self._sessions_config = sessions
            self._session_header_name = sessions.header.encode()
        return self._session_header_name

    def _check_auth(self, headers: list[tuple[bytes, bytes]]) -> None:
        keys = self.registry.config.server.api_keys
        if not keys:
            return
        check_bearer(headers, keys, "API key")

    # -- routing and attempts --
    async def _forward(
        self, parsed: ParsedRequest, client_headers: list[tuple[bytes, bytes]], state: Exchange, route: str, start: float,
        first: Decision | None = None,
    ) -> None:
        """``first``: the decision already made for this request (the disaggregated gateway's
        "prefill here" on a decode worker), committed as is rather than decided again."""
        config = self.registry.config
        retries = config.retries
        out_headers = upstream_headers(client_headers, config.server.forward_authorization)
        excluded: list[str] = []
        suspects: list[_Failure] = []
        failure: _Failure | None = None
        for attempt in range(retries.max_attempts):
            if attempt:
                if not self._retry_has_a_target(parsed, excluded):
                    break  # no back-off (and no retry counted) when nowhere is left to go
                self.metrics.retries_total.labels(failure.kind if failure else "error").inc()
                await asyncio.sleep(_backoff(attempt, retries.backoff_base_s, retries.backoff_max_s))
            lease = self._route(parsed, excluded, failure, first if not attempt else None)
            if lease is None:
                break
            target = lease.target
            worker = self.registry.worker_of(target.id)
            # A failed worker is excluded with all its data-parallel ranks.
            excluded.extend([t.id for t in worker.targets] if worker is not None else [target.id])
            try:
                failure = await self._attempt(parsed, lease, out_headers, state, route, start, suspects)
            finally:
                lease.finish(time.monotonic())
            if failure is None:
                if attempt and parsed.info.session_id and self.registry.targets.get(target.id) is target:
                    # a retry commits without the session (``_route``): bound once it served it
                    self.router.bind_session(parsed.info.session_id, target.id, time.monotonic())
                return
            if failure.suspect is not None:
                suspects.append(failure)
        if failure is None:  # no attempt could be routed at all
            raise MeshError(503, "no healthy worker is available", code="no_healthy_worker")
        if failure.body is not None:
            await state.respond(failure.status, failure.headers or JSON_HEADERS, failure.body)
        else:
            raise MeshError(failure.status, failure.message, code="upstream_error")

    def _route(self, parsed: ParsedRequest, excluded: list[str], failure: _Failure | None,
               first: Decision | None = None) -> Lease | None:
        """A lease on the next target, or None when a retry has nowhere left to go.

        A retry does not move the session: the request may be what fails everywhere (a worker's
        500 is only suspect), and a session must not leave its cache for it. ``_forward`` binds it
        to the retry's target once that target served it; until then the session stays pinned,
        not idle, as for any request of it in flight."""
        now = time.monotonic()
        self.registry.tick(now)
        full = self.registry.full_targets()
        t0 = time.perf_counter()
        info = parsed.info
        try:
            if first is not None and first.target not in full:
                decision = first
            else:
                decision = self.router.decide(info, now, excluded + full if full else excluded, explain=False)
            decision = decision.served_whole()
            if decision.target not in self.router.targets:  # a plugin's decode_target that is no target
                raise NoCandidate(f"the policy named an unknown decode target {decision.target!r}")
            lease = self.router.commit(info, decision, now, bind=failure is None)
        except NoCandidate as exc:
            if failure is not None:
                return None
            if full:
                raise MeshError(
                    429, "every worker serving this model is at its in-flight limit", code="over_capacity",
                    headers={"retry-after": "1"},
                ) from exc
            raise MeshError(503, f"no healthy worker: {exc}", code="no_healthy_worker") from exc
        self.metrics.routing_decision.observe(time.perf_counter() - t0)
        return lease

    def _retry_has_a_target(self, parsed: ParsedRequest, excluded: list[str]) -> bool:
        """Whether some available target of the request's model is not excluded yet (it may be
        full now and free after the back-off: routing decides that)."""
        gone = set(excluded)
        model = parsed.info.model
        return any(t.available and t.id not in gone and (not t.models or model in t.models)
                   for t in self.registry.targets.values())

    def _url(self, target: TargetState, path: str) -> tuple[str, str, int, bytes]:
        key = (target.url, path)
        url = self._urls.get(key)
        if url is None:
            if len(self._urls) > 4096:
                self._urls.clear()
            url = self._urls[key] = split_url(target.url + path)
        return url

    async def _attempt(
        self,
        parsed: ParsedRequest,
        lease: Lease,
        headers: list[bytes],
        state: Exchange,
        route: str,
        start: float,
        suspects: list[_Failure],
    ) -> _Failure | None:
        """One upstream attempt. None when the client got its answer, else the failure.
        ``suspects``: earlier attempts' 500s, blamed on their workers (and cleared) once this
        worker answers the same request."""
        target = lease.target
        worker = self.registry.worker_of(target.id)
        if worker is not None and (worker.headers or worker.config.dp_size > 1):
            headers = headers + worker.headers
            if worker.config.dp_size > 1:
                headers.append(b"x-data-parallel-rank: %d\r\n" % target.dp_rank)
        path = "/v1/chat/completions" if parsed.kind == "chat" else "/v1/completions"
        timeout = self.registry.config.server.request_timeout_s
        deadline = asyncio.get_running_loop().time() + timeout  # the upstream's own timer's, or a hair before
        resp: UpstreamResponse | None = None
        try:
            try:
                # The timeout bounds the whole exchange, streaming included.
                resp = await self.pool.request("POST", self._url(target, path), headers, parsed.raw, timeout)
                verdict = status_verdict(resp.status)
                if verdict.retry:
                    error_headers, error_body = _worker_error(resp, await _read_answer(resp, target), target)
                    raise _UpstreamFailed(
                        f"status_{resp.status}",
                        f"worker {target.worker} answered {resp.status}",
                        status=resp.status,
                        body=error_body,
                        headers=error_headers,
                        worker_fault=verdict.charge or verdict.suspect,
                        suspect=verdict.suspect,
                    )
                if parsed.stream and resp.status == 200:
                    first = await resp.read_chunk()
                    if not first:
                        raise _UpstreamFailed("empty", f"worker {target.worker} closed the stream before any data")
                else:
                    first = await _read_answer(resp, target)
                    if not first and resp.status == 200:  # no answer to relay: another worker may give one
                        raise _UpstreamFailed("empty", f"worker {target.worker} answered 200 with an empty body")
            except UpstreamTimeout:  # the request timeout: the worker is too slow, not broken
                if self.shutting_down:  # the pool closed under it: not the worker's doing
                    raise _shutdown_error() from None
                self.registry.record_failure(target.id, time.monotonic(), "timeout")
                self.metrics.upstream_errors_total.labels(target.worker, "timeout").inc()
                raise MeshError(504, f"worker {target.worker} timed out after {timeout:g} s", code="upstream_timeout") from None
            except UpstreamError as exc:  # connect errors, resets, bad responses: retryable
                if self.shutting_down:  # the pool closed under it (or refuses): no retry, no worker charged
                    raise _shutdown_error() from None
                kind = "connect" if isinstance(exc, ConnectError) else "disconnect"
                raise _UpstreamFailed(kind, f"worker {target.worker} failed: {exc}") from exc
            lease.first_token()
            self._ttfb_hist[route].observe(time.perf_counter() - start)
            streaming = parsed.stream and resp.status == 200
            if not streaming:  # a stream is a success once it ended whole (below), not at its first byte
                self.registry.record_success(target.id)
            for f in suspects:  # they failed where this worker does not
                self.registry.record_failure(f.suspect, time.monotonic(), f.message)  # type: ignore[arg-type]
            suspects.clear()
            out = _response_headers(resp)
            out.append((b"x-mesh-worker", target.id.encode()))
            if streaming:
                # a client that stops reading holds its lease only until the request timeout
                resp.on_stall(lease.finish)
                tail = await self._stream(resp, first, out, state, target, lease, deadline, is_sse(resp.headers))
                if tail:  # b"": it broke (counted there), or its client read too slowly (nobody's fault)
                    self.registry.record_success(target.id)
            elif resp.status >= 400:
                await state.respond(resp.status, *_worker_error(resp, first, target))
                tail = b""
            else:
                await state.respond(resp.status, out, first)
                tail = first
            if tail and resp.status == 200:
                self._count_prefix(lease, tail)
            return None
        except _UpstreamFailed as exc:
            if self.shutting_down and exc.body is None:  # e.g. "closed the stream before any data"
                raise _shutdown_error() from None
            self.metrics.upstream_errors_total.labels(target.worker, exc.kind).inc()
            suspect = exc.suspect
            if exc.worker_fault and not suspect:
                self.registry.record_failure(target.id, time.monotonic(), str(exc))
            return _Failure(exc.kind, exc.status, str(exc), exc.body, exc.headers, target.id if suspect else None)
        finally:
            if resp is not None:
                resp.close()  # back to the pool if complete; else the socket closes and the worker sees it

    async def _stream(
        self, resp: UpstreamResponse, first: bytes, headers: list[tuple[bytes, bytes]], state: Exchange,
        target: TargetState, lease: Lease, deadline: float, sse: bool,
    ) -> bytes:
        """Relay the stream; returns its last chunks (where the usage chunk is), b"" if it broke.
        ``sse``: an OpenAI event stream, whose end without ``[DONE]`` is a break.

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
            return await self._relay_stream(resp, data, state, target, sse)
        finally:
            timer.cancel()

    async def _relay_stream(
        self, resp: UpstreamResponse, data: bytes, state: Exchange, target: TargetState, sse: bool,
    ) -> bytes:
        # The last four chunks, kept by reference (no copy per chunk): the usage chunk and
        # [DONE] end the stream, however the reads split them.
        c4 = c3 = c2 = b""
        c1 = data
        # Only whole SSE events are relayed: the start of one not yet ended waits for its end, so
        # that a worker dying mid-event leaves the client whole events, then the error event.
        pending = b""
        try:
            while True:
                cut = _whole_events(data)
                if cut == len(data):
                    await state.chunk(data)
                else:
                    if cut:
                        await state.chunk(data[:cut])
                    pending = data[cut:]
                    if len(pending) > MAX_PENDING_EVENT:  # not SSE, or one huge event: relayed as it comes
                        await state.chunk(pending)
                        pending = b""
                data = await resp.read_chunk()
                if not data:
                    break
                if pending:
                    data, pending = pending + data, b""
                c4, c3, c2, c1 = c3, c2, c1, data
        except UpstreamError as exc:
            if not pending and c1.endswith(b"data: [DONE]\n\n"):  # the client has it all: only the framing broke
                await state.end()
                return b"".join((c4, c3, c2, c1))
            if self.shutting_down:  # end_in_flight closed the pool: nobody's failure, nothing counted
                await state.stream_error(SHUTDOWN_MESSAGE)
                return b""
            self.metrics.stream_errors_total.inc()
            if isinstance(exc, UpstreamTimeout) and exc.reader_behind:
                # The gateway had stopped reading the worker because this client did not read:
                # the worker is not to blame (slow readers would open a healthy worker's circuit).
                await state.stream_error(f"request timed out: the client read the stream too slowly ({exc})")
                return b""
            what = "timed out" if isinstance(exc, UpstreamTimeout) else "failed mid-stream"
            self.registry.record_failure(target.id, time.monotonic(), f"stream broke: {exc!r}")
            await state.stream_error(f"worker {target.worker} {what}")
            return b""
        if sse and not ended_whole(c2, c1) and self.shutting_down:
            await state.stream_error(SHUTDOWN_MESSAGE)
            return b""
        if sse and not ended_whole(c2, c1):
            # The body ended (a FIN ends a close-delimited one) before the [DONE] every OpenAI
            # server sends last: the worker died mid-stream. Treated as a reset is, above; the
            # unfinished event (``pending``) is dropped.
            self.metrics.stream_errors_total.inc()
            self.registry.record_failure(target.id, time.monotonic(), "stream broke: it ended without data: [DONE]")
            await state.stream_error(f"worker {target.worker} failed mid-stream (its stream ended without [DONE])")
            return b""
        if pending:  # a last event without its blank line: the worker's own, relayed as sent
            await state.last(pending)
        else:
            await state.end()
        return b"".join((c4, c3, c2, c1))

    def _count_prefix(self, lease: Lease, tail: bytes) -> None:
        """Predicted vs reported cached tokens of one answered request (when the answer says)."""
        at = tail.rfind(b'"cached_tokens"')
        if at < 0:
            return
        found = _CACHED_TOKENS.match(tail, at)
        if found is None:
            return
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
        pair[1].inc(int(found.group(1)))


def _finish_lease(lease: Lease) -> None:
    lease.finish(time.monotonic())


async def read_body(receive: Receive, headers: list[tuple[bytes, bytes]], limit: int, idle_s: float) -> bytes:
    """The whole request body: 413 past ``limit`` bytes, 408 when no bytes come for ``idle_s``."""
    declared = _header(headers, b"content-length")
    if declared is not None:
        if not declared.isdigit():
            raise MeshError(400, "invalid Content-Length header", code="invalid_header")
        if int(declared) > limit:
            raise MeshError(413, f"request body larger than {limit} bytes", code="body_too_large")
    try:
        # A client that stops sending mid-body (or never ends a chunked body) would hold the
        # request forever: each wait for body bytes is bounded.
        async with asyncio.timeout(idle_s) as idle:
            return await _receive_body(receive, limit, idle, idle_s)
    except TimeoutError:
        raise MeshError(  # the rest of the body may still come: the connection cannot be reused
            408, f"no request body bytes arrived for {idle_s:g} s", code="body_timeout",
            headers={"connection": "close"},
        ) from None


async def _receive_body(receive: Receive, limit: int, idle: asyncio.Timeout, idle_s: float) -> bytes:
    message = await receive()
    body = message.get("body", b"")
    if not message.get("more_body"):
        if len(body) > limit:
            raise MeshError(413, f"request body larger than {limit} bytes", code="body_too_large")
        return body
    parts = [body]
    size = len(body)
    loop = asyncio.get_running_loop()
    while message.get("more_body"):
        idle.reschedule(loop.time() + idle_s)
        message = await receive()
        if message["type"] == "http.disconnect":
            raise MeshError(400, "client disconnected while sending the body", code="client_disconnected")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise MeshError(413, f"request body larger than {limit} bytes", code="body_too_large")
        parts.append(chunk)
    return b"".join(parts)


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for key, value in headers:
        if key == name:  # ASGI servers give lower-case names
            return value
    return None


def check_bearer(headers: list[tuple[bytes, bytes]], keys: list[str], what: str) -> None:
    """Raise 401 unless ``Authorization: Bearer <one of keys>`` is present (constant-time compare)."""
    value = _header(headers, b"authorization")
    token = value[7:].strip() if value is not None and value[:7].lower() == b"bearer " else b""
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(token, key.encode())
    if not token or not ok:
        raise MeshError(401, f"missing or invalid {what} (send 'Authorization: Bearer <key>')", code="invalid_api_key",
                        headers={"www-authenticate": "Bearer"})


def upstream_headers(client: list[tuple[bytes, bytes]], forward_authorization: bool) -> list[bytes]:
    """Client headers as request lines, minus hop-by-hop ones (RFC 9110: the fixed set and any
    named in ``Connection``) and Authorization unless configured; rejects CR/LF/NUL (injection)."""
    out = [b"content-type: application/json\r\n"]
    named: frozenset[bytes] = frozenset()
    for key, value in client:
        if key == b"connection":
            named = named | {t.strip().lower() for t in value.split(b",")}
    for key, value in client:
        if key in HOP_BY_HOP or key in ROUTER_SET or (key == b"authorization" and not forward_authorization):
            continue
        if named and key in named:
            continue
        if _BAD_HEADER_BYTES.search(value) or _BAD_HEADER_BYTES.search(key):
            raise MeshError(400, "header contains a control character", code="invalid_header")
        out.append(b"%s: %s\r\n" % (key, value))
    return out




def _worker_error(resp: UpstreamResponse, body: bytes, target: TargetState) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """A worker's error answer for the client, in the OpenAI shape (``openai_error_bytes``)."""
    headers = [*_response_headers(resp), (b"x-mesh-worker", target.id.encode())]
    out = openai_error_bytes(resp.status, f"worker {target.worker} answered {resp.status}", body)
    if out is body:
        return headers, body
    headers = [(k, v) for k, v in headers if k not in (b"content-type", b"content-encoding")]
    headers.append((b"content-type", b"application/json"))
    return headers, out


async def _read_answer(resp: UpstreamResponse, target: TargetState) -> bytes:
    """A whole (non-streamed) answer, which the gateway holds before relaying it: bounded, so a
    worker sending an endless body cannot grow the gateway's memory until the request timeout."""
    parts: list[bytes] = []
    size = 0
    while data := await resp.read_chunk():
        size += len(data)
        if size > MAX_ANSWER_BYTES:
            raise _UpstreamFailed("too_large", f"worker {target.worker} answered over {MAX_ANSWER_BYTES >> 20} MiB")
        parts.append(data)
    return b"".join(parts)


def _whole_events(data: bytes) -> int:
    """How many leading bytes of ``data`` are whole SSE events (each ends with a blank line)."""
    if data.endswith(b"\n\n") or data.endswith(b"\r\n\r\n"):  # the common case: a worker writes whole events
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


def _response_headers(resp: UpstreamResponse) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in resp.headers if k not in RESPONSE_DROP]


def _backoff(attempt: int, base: float, cap: float) -> float:
    return min(cap, base * (2 ** (attempt - 1))) * random.uniform(0.5, 1.0)
