"""The data-plane proxy: one OpenAI request in, one worker's answer out, at raw ASGI level.

The completion routes bypass FastAPI (``MeshApp.__call__`` sends them here: Starlette's routing
alone cost ~40% of the rate, see BENCHMARKS.md); upstream requests go through the one pooled
``UpstreamPool``. Invariants:
- The body is forwarded byte for byte; routing reads a decoded copy.
- Every routed attempt holds a ``Lease``, finished exactly once on every path (``try/finally``).
- A request that finds every worker of its model at its in-flight ceiling waits in the admission
  queue (late binding) and is decided once one has room (``admission_queue``).
- One deadline per request (``server.request_timeout_s``, from before the admission queue): the
  queue's wait, every attempt and its retries count against it. Within it each attempt's worker
  has a first-byte bound (streams) and an idle bound (``UpstreamPool``'s one timer per request).
- Until the first byte reached the client, a failed attempt is retried on another worker with
  backoff (``verdicts`` says what a failure counts for); after it, a stream that breaks ends with
  an SSE error event (``sse_relay``). A retry moves the session only once its target served it.
  A worker the health check marks unhealthy has its unanswered attempts aborted (``on_worker_unhealthy``)
  and retried; a 200 that is not what was asked for (``answer_problem``) is a failure, retried.
- Errors for clients name the worker, never its address (that goes to the log and ``/workers``).
- A client that leaves cancels the handler, closing the upstream response; one that takes no
  bytes for ``server.client_write_timeout_s`` is abandoned alike. Neither charges the worker.
- Prefix reuse is counted as predicted (the lease) and as reported (the answer's usage, found in
  its tail: no chunk is parsed on the way through); the same one parse of the usage feeds the
  token counters (``mesh.request_metrics``).
- Every request has an id (``request_id``): the worker gets it, the client gets it back
  (``x-request-id``), and it names the request in the log lines about it and its access log line.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import time
from collections.abc import MutableMapping
from typing import Any, Protocol

from mesh.cluster.registry import Worker, WorkerRegistry
from mesh.core.retention import RETENTION_HEADER, SPILL
from mesh.core.router import Lease, Router
from mesh.errors import MeshError, bad_request, openai_error_bytes
from mesh.gateway.access_log import AccessLog, Entry
from mesh.gateway.admission_queue import AdmissionQueue, OverCapacity
from mesh.gateway.client_io import (
    WATCH_AFTER_S,
    BodyBuffer,
    ClientWriteTimeout,
    Exchange,
    RateLimitedWarning,
    Receive,
    Send,
    WriteWatch,
    abort_client,
    client_label,
    client_left,
    read_body,
    watch_disconnect,
)
from mesh.gateway.headers import (
    JSON_HEADERS,
    check_bearer,
    forwarded_names,
    header,
    response_headers,
    upstream_headers,
)
from mesh.gateway.request_id import RequestIds
from mesh.gateway.sse_relay import StreamBreak, ended_whole, is_sse, relay_stream
from mesh.gateway.upstream import (
    ConnectError,
    UpstreamAborted,
    UpstreamError,
    UpstreamPool,
    UpstreamResponse,
    UpstreamStalled,
    UpstreamTimeout,
    split_url,
)
from mesh.gateway.verdicts import (
    MAX_ANSWER_BYTES,
    SHUTDOWN_MESSAGE,
    Failure,
    UpstreamFailed,
    answer_problem,
    shutdown_error,
    status_verdict,
)
from mesh.log_limit import LogLimiter
from mesh.metrics import Metrics
from mesh.request.prompt import ParsedRequest, PromptProcessor
from mesh.request_metrics import RequestSeries, Series
from policies.base import Decision, NoCandidate, RequestInfo, TargetState
from policies.filters import blocks_needed

log = logging.getLogger("mesh.gateway.proxy")

Scope = MutableMapping[str, Any]

RETENTION_SPILL = f"{RETENTION_HEADER}: {SPILL}\r\n".encode()  # the retention hint
# An answer's usage, searched from its (last) ``"usage"`` key: the keys' order differs by engine.
_PROMPT_TOKENS = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')


class SessionMirror(Protocol):
    """Copies a session's shared binding into the local table (``SharedSessionTable.mirror``)."""

    async def __call__(self, session_id: str, now: float) -> object: ...


class Proxy:
    """Serves the completion routes: parse, route, forward, retry, relay (the module docstring)."""

    def __init__(
        self,
        pool: UpstreamPool,
        registry: WorkerRegistry,
        router: Router,
        prompts: PromptProcessor,
        metrics: Metrics,
        admission: AdmissionQueue,
        mirror: SessionMirror | None = None,
        bodies: BodyBuffer | None = None,
    ) -> None:
        self.pool = pool
        self.registry = registry
        self.router = router
        self.prompts = prompts
        self.metrics = metrics
        self.admission = admission  # where a request waits while every worker of its model is full
        self.mirror = mirror  # shared state (Redis): a session's binding copied in before its decision
        # the request bodies held at once (server.max_buffered_body_bytes), shared with /debug/route
        self.bodies = bodies or BodyBuffer(lambda: registry.config.server.max_buffered_body_bytes)
        self._urls: dict[tuple[str, str], tuple[str, str, int, bytes]] = {}
        self._sessions_config: object = None
        self._session_header_name = b""
        self._route_hist = {r: metrics.request_latency.labels(r) for r in ("chat", "completions")}
        self._ttfb_hist = {r: metrics.ttfb.labels(r) for r in ("chat", "completions")}
        self._prefix_children: dict[str, tuple[Any, Any]] = {}  # target -> (predicted, reported)
        # TTFT, ITL, end-to-end latency and reported tokens per (model, target); its own cheap
        # histograms (``mesh.request_metrics``), rendered by /metrics, pruned with removed workers
        self.series = RequestSeries(registry)
        metrics.add_collector(self.series.families)
        registry.add_listener(self.series)
        self._ids = RequestIds()
        self.access_log = AccessLog()  # server.access_log: json (its thread starts with the first line)
        self._write_watch = WriteWatch(metrics.client_write_timeouts_total)  # client writes past server.client_write_timeout_s
        # Set by ``shut_down`` (the gateway's shutdown timeout, right before it closes the pool):
        # from then on an upstream break is the gateway's doing, charged to no worker.
        self.shutting_down = False
        self._forward_config: object = None  # the config ``_forward_names`` was computed for
        self._forward_names: frozenset[bytes] = frozenset()
        self._unexpected = LogLimiter(log, "unexpected errors on")  # a traceback per bug and route, not per request
        self._attempt_log = RateLimitedWarning(log, "failed upstream attempts")  # their details (addresses)
        registry.add_health_listener(self)

    def on_worker_unhealthy(self, worker: Worker) -> None:
        """The health check marked ``worker`` unhealthy: its attempts whose answer has not reached
        a client are aborted now (each retried elsewhere by its ``_forward``), not left to hang."""
        aborted = self.pool.abort_unanswered(worker.url, f"worker {worker.name} turned unhealthy")
        if aborted:
            log.warning("worker %s turned unhealthy: %d unanswered requests on it are retried elsewhere",
                        worker.name, aborted)

    async def aclose(self) -> None:
        """At the lifespan's end, before the pool closes: the access log's pending lines are written."""
        await asyncio.to_thread(self.access_log.close)

    def shut_down(self) -> None:
        """The gateway is about to close every upstream connection (``app.end_in_flight``): the
        requests it cuts end with "the gateway is shutting down", and no worker's circuit breaker,
        health or ``mesh_stream_errors_total`` is charged (the workers are healthy)."""
        self.shutting_down = True

    # -- ASGI entry --
    async def handle(self, scope: Scope, receive: Receive, send: Send, kind: str, route: str) -> None:
        """Serve one data-plane request end to end. Never raises (except real cancellation)."""
        start = time.perf_counter()
        task = asyncio.current_task()
        state = Exchange(send, self.registry.config.server.client_write_timeout_s, self._write_watch, task)
        watcher: asyncio.TimerHandle | None = None
        held = 0  # body bytes taken from ``bodies``
        parsed: ParsedRequest | None = None
        headers = scope["headers"]
        state.request_id = self._ids.of(headers)
        try:
            self._check_auth(headers)
            server = self.registry.config.server
            raw = await read_body(receive, headers, server.max_body_bytes, server.body_idle_timeout_s, self.bodies)
            held = len(raw)
            watcher = state.loop.call_later(WATCH_AFTER_S, watch_disconnect, receive, state, task)
            t0 = time.perf_counter()
            parsed = await self.prompts.process(raw, kind, header(headers, self._session_header()))
            self.metrics.prompt_seconds.observe(time.perf_counter() - t0)
            if self.mirror is not None and parsed.info.session_id:
                await self.mirror(parsed.info.session_id, time.monotonic())
            if client_left(send):  # it sent its request and left (or shut its side): not started
                state.status = 499
                self.metrics.client_disconnects_total.inc()
                return
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
        except RecursionError:  # a body nested deeper than the request's processing can walk
            await self._error(state, bad_request("request body is nested too deeply", code="too_deeply_nested"), scope)
        except Exception as exc:  # a bug must never surface as a traceback to the client
            self._unexpected.log(logging.ERROR, (route, type(exc).__name__), "request %s: unexpected error in proxy: %s",
                                 state.request_id.decode(), exc, exc_info=True)
            await self._error(state, MeshError(500, "internal gateway error", code="internal_error"), scope)
        finally:
            self.bodies.give(held)
            state.finish()
            if watcher is not None:
                watcher.cancel()
            if state.watch_task is not None:
                state.watch_task.cancel()
            self.metrics.request_done(route, state.status)
            took = time.perf_counter() - start
            self._route_hist[route].observe(took)
            if self.registry.config.server.access_log == "json":
                self.access_log.record(_entry(scope, state, parsed, took))

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
            "request %s: client write timeout: a write to %s waited %g s (it stopped reading); response abandoned, "
            "worker freed", state.request_id.decode(), client_label(scope.get("client")), state.write_timeout_s)
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

    def _forwarded_names(self) -> frozenset[bytes]:
        """The client headers workers see, for the config in force (recomputed after a reload)."""
        config = self.registry.config
        if config is not self._forward_config:
            self._forward_config = config
            server = config.server
            self._forward_names = forwarded_names(server.forward_headers, config.sessions.header,
                                                  server.forward_authorization)
        return self._forward_names

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
        deadline = time.monotonic() + config.server.request_timeout_s  # the request's one deadline
        out_headers = upstream_headers(client_headers, self._forwarded_names(), state.request_id)
        excluded: list[str] = []
        suspects: list[Failure] = []
        failure: Failure | None = None
        for attempt in range(retries.max_attempts):
            if attempt:
                if not self._retry_has_a_target(parsed, excluded):
                    break  # no back-off (and no retry counted) when nowhere is left to go
                self.metrics.retries_total.labels(failure.kind if failure else "error").inc()
                await asyncio.sleep(_backoff(attempt, retries.backoff_base_s, retries.backoff_max_s))
            if attempt:
                lease = self._route(parsed, excluded, failure)
            else:
                arrived = time.monotonic()
                lease = await self.admission.admit(lambda: self._route(parsed, excluded, None, first, arrived), deadline)
            if lease is None:
                break
            target = lease.target
            worker = self.registry.worker_of(target.id)
            # A failed worker is excluded with all its data-parallel ranks.
            excluded.extend([t.id for t in worker.targets] if worker is not None else [target.id])
            try:
                failure = await self._attempt(parsed, lease, out_headers, state, route, start, suspects, deadline)
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
            await state.respond(failure.status, failure.headers or list(JSON_HEADERS), failure.body)
        else:
            raise MeshError(failure.status, failure.message, code="upstream_error")

    def _route(self, parsed: ParsedRequest, excluded: list[str], failure: Failure | None,
               first: Decision | None = None, arrived: float | None = None) -> Lease | None:
        """A lease on the next target, or None when a retry has nowhere left to go. Raises
        ``OverCapacity`` (the request waits in the admission queue) while every candidate is full,
        and, for ``admission.home_wait_s`` after it ``arrived``, while its session's worker is full:
        its cache is there, and a slot frees sooner than another worker recomputes the prefix.

        A retry does not move the session: the request may be what fails everywhere (a worker's
        500 is only suspect), and a session must not leave its cache for it. ``_forward`` binds it
        to the retry's target once that target served it; until then the session stays pinned,
        not idle, as for any request of it in flight."""
        now = time.monotonic()
        self.registry.tick(now)
        full = self.registry.full_targets()
        t0 = time.perf_counter()
        info = parsed.info
        if full and arrived is not None and self._home_is_full(info.session_id, full, now, arrived):
            raise OverCapacity()
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
            if (too_large := self._never_fits(info)) is not None:
                raise too_large from exc
            if full:
                raise OverCapacity() from exc
            raise MeshError(503, f"no healthy worker: {exc}", code="no_healthy_worker") from exc
        self.metrics.routing_decision.observe(time.perf_counter() - t0)
        return lease

    def _never_fits(self, info: RequestInfo) -> MeshError | None:
        """The 400 for a request larger than the KV cache of every worker of its model (known
        capacities only): no wait or retry would serve it, so it must not be a retryable 503."""
        serving = [t for t in self.registry.targets.values()
                   if t.available and (not t.models or info.model in t.models)]
        if not serving or any(t.kv_capacity_blocks <= 0 for t in serving):
            return None
        needs = [blocks_needed(info, t.block_size or info.block_size or 1) for t in serving]
        if any(need <= t.kv_capacity_blocks for need, t in zip(needs, serving, strict=True)):
            return None
        largest = max(t.kv_capacity_blocks for t in serving)
        return MeshError(
            400, f"the request needs {min(needs)} KV blocks ({info.prompt_tokens} prompt tokens + {info.choices} x "
                 f"{info.max_tokens} max_tokens) and the largest worker of {info.model!r} holds {largest}: shorten "
                 "the prompt or lower max_tokens", code="context_length_exceeded")

    def _home_is_full(self, session_id: str | None, full: list[str], now: float, arrived: float) -> bool:
        """Whether the request should wait for its session's worker, at its in-flight limit."""
        sessions = self.router.sessions
        if not session_id or sessions is None or now - arrived >= self.registry.config.admission.home_wait_s:
            return False
        return sessions.bound_target(session_id, now) in full

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
        suspects: list[Failure],
        request_deadline: float,
    ) -> Failure | None:
        """One upstream attempt. None when the client got its answer, else the failure.
        ``suspects``: earlier attempts' 500s, blamed on their workers (and cleared) once this
        worker answers the same request. ``request_deadline``: the request's (monotonic)."""
        target = lease.target
        worker = self.registry.worker_of(target.id)
        if worker is not None and (worker.headers or worker.config.dp_size > 1):
            headers = headers + worker.headers
            if worker.config.dp_size > 1:
                headers.append(b"x-data-parallel-rank: %d\r\n" % target.dp_rank)
        if lease.spill:
            headers = headers + [RETENTION_SPILL]
        path = "/v1/chat/completions" if parsed.kind == "chat" else "/v1/completions"
        server = self.registry.config.server
        timeout = request_deadline - time.monotonic()  # what is left of the request's deadline
        if timeout <= 0:
            raise MeshError(504, f"request timed out after {server.request_timeout_s:g} s (server.request_timeout_s)",
                            code="upstream_timeout")
        deadline = asyncio.get_running_loop().time() + timeout  # the upstream's own timer's, or a hair before
        cfg = worker.config if worker is not None else None
        first_byte_s = (cfg and cfg.first_byte_timeout_s) or server.first_byte_timeout_s
        idle_s = (cfg and cfg.idle_timeout_s) or server.idle_timeout_s
        resp: UpstreamResponse | None = None
        try:
            try:
                # The timeout bounds the whole exchange, streaming included.
                resp = await self.pool.request("POST", self._url(target, path), headers, parsed.raw, timeout,
                                               first_byte_s=first_byte_s if parsed.stream else None, idle_s=idle_s,
                                               abortable=True)
                first = await _first_bytes(resp, parsed.stream, target)
            except UpstreamTimeout:  # the request's deadline: the worker is too slow, not broken
                if self.shutting_down:  # the pool closed under it: not the worker's doing
                    raise shutdown_error() from None
                self.registry.record_failure(target.id, time.monotonic(), "timeout")
                self.metrics.upstream_errors_total.labels(target.worker, "timeout").inc()
                raise MeshError(504, f"worker {target.worker} did not answer within what was left of the request's "
                                     f"{server.request_timeout_s:g} s (server.request_timeout_s)",
                                code="upstream_timeout") from None
            except UpstreamError as exc:  # connect errors, resets, stalls, bad responses: retryable
                if self.shutting_down:  # the pool closed under it (or refuses): no retry, no worker charged
                    raise shutdown_error() from None
                raise self._attempt_failed(target, exc, state.request_id) from exc
            lease.first_token()
            ttft = time.perf_counter() - start
            self._ttfb_hist[route].observe(ttft)
            series = self.series.series(parsed.info.model, target.id)
            state.served_by = target
            if resp.status == 200:
                series.ttft(ttft)
                state.ttft_s = ttft
            await self._deliver(resp, first, parsed.stream, state, lease, deadline, suspects, series)
            series.e2e(time.perf_counter() - start)
            return None
        except UpstreamFailed as exc:
            if self.shutting_down and exc.body is None:  # e.g. "closed the stream before any data"
                raise shutdown_error() from None
            if exc.detail is None:  # not logged yet (``_attempt_failed`` logs the others)
                self._attempt_log.warning("request %s: %s", state.request_id.decode(), exc)
            self.metrics.upstream_errors_total.labels(target.worker, exc.kind).inc()
            suspect = exc.suspect
            if exc.worker_fault and not suspect:
                self.registry.record_failure(target.id, time.monotonic(), exc.detail or str(exc))
            return Failure(exc.kind, exc.status, str(exc), exc.body, exc.headers, target.id if suspect else None)
        finally:
            if resp is not None:
                resp.close()  # back to the pool if complete; else the socket closes and the worker sees it

    def _attempt_failed(self, target: TargetState, exc: UpstreamError, request_id: bytes) -> UpstreamFailed:
        """What an upstream error before the client's first byte means: its kind, the client's
        message (the worker's name, not its address) and the detail (the log, ``/workers``)."""
        if isinstance(exc, ConnectError):
            kind, what = "connect", "could not be connected to"
        elif isinstance(exc, UpstreamStalled):
            kind = "first_byte_timeout" if exc.phase == "first_byte" else "idle_timeout"
            what = (f"sent no first byte within {exc.after_s:g} s" if exc.phase == "first_byte"
                    else f"went silent for {exc.after_s:g} s before its answer was complete")
        elif isinstance(exc, UpstreamAborted):  # its health check failed: health already took it out
            failed = UpstreamFailed("unhealthy", f"worker {target.worker} turned unhealthy before it answered",
                                    worker_fault=False)
            return failed
        else:
            kind, what = "disconnect", f"failed: {exc}"  # the pool's own messages carry no address
        self._attempt_log.warning("request %s: worker %s: %s attempt failed: %s", request_id.decode(), target.worker,
                                  kind, exc)
        return UpstreamFailed(kind, f"worker {target.worker} {what}", detail=f"{kind}: {exc}")

    async def _deliver(
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
            await state.respond(resp.status, *_worker_error(resp, first, target))
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
                await self._end_broken_stream(state, target.id, target.worker, end)
                return b""
            return end
        finally:
            timer.cancel()

    async def _end_broken_stream(self, state: Exchange, target_id: str, worker: str, broke: StreamBreak) -> None:
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


def count_usage(tail: bytes, series: Series, state: Exchange) -> int | None:
    """Count the tokens an answer's worker reported (its last ``usage``: a stream's usage chunk)
    in ``series`` and ``state``; the cached tokens when it reported them, else None."""
    at = tail.rfind(b'"usage"')
    if at < 0:
        return None
    prompt = _PROMPT_TOKENS.search(tail, at)
    completion = _COMPLETION_TOKENS.search(tail, at)
    if prompt is None and completion is None:  # "usage": null
        return None
    found = _CACHED_TOKENS.search(tail, at)
    usage = (int(prompt.group(1)) if prompt else 0, int(found.group(1)) if found else 0,
             int(completion.group(1)) if completion else 0)
    series.usage(*usage)
    state.usage = usage
    return usage[1] if found is not None else None


def _entry(scope: Scope, state: Exchange, parsed: ParsedRequest | None, took: float) -> Entry:
    """The access log's entry of one request (``server.access_log: json``)."""
    target = state.served_by
    usage = state.usage or (None, None, None)
    client = scope.get("client")
    return (time.time(), state.request_id, scope.get("method", ""), scope.get("path", ""), state.status,
            parsed.info.model if parsed is not None else None, target.worker if target is not None else None,
            target.id if target is not None else None, parsed.info.session_id if parsed is not None else None,
            usage[0], usage[1], usage[2], state.ttft_s, took, f"{client[0]}:{client[1]}" if client else None)


def _finish_lease(lease: Lease) -> None:
    lease.finish(time.monotonic())


def _worker_error(resp: UpstreamResponse, body: bytes, target: TargetState) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """A worker's error answer for the client, in the OpenAI shape (``openai_error_bytes``)."""
    headers = [*response_headers(resp.headers), (b"x-mesh-worker", target.id.encode())]
    out = openai_error_bytes(resp.status, f"worker {target.worker} answered {resp.status}", body)
    if out is body:
        return headers, body
    headers = [(k, v) for k, v in headers if k not in (b"content-type", b"content-encoding")]
    headers.append((b"content-type", b"application/json"))
    return headers, out


async def _first_bytes(resp: UpstreamResponse, stream: bool, target: TargetState) -> bytes:
    """What the client gets first: a stream's first chunk, else the whole answer. Raises
    ``UpstreamFailed`` for a status another worker may serve, and for an empty answer."""
    verdict = status_verdict(resp.status)
    if verdict.retry:
        error_headers, error_body = _worker_error(resp, await _read_answer(resp, target), target)
        raise UpstreamFailed(
            f"status_{resp.status}",
            f"worker {target.worker} answered {resp.status}",
            status=resp.status,
            body=error_body,
            headers=error_headers,
            worker_fault=verdict.charge or verdict.suspect,
            suspect=verdict.suspect,
        )
    sse = resp.status == 200 and is_sse(resp.headers)
    if stream and sse:
        first = await resp.read_chunk()
        if not first:
            raise UpstreamFailed("empty", f"worker {target.worker} closed the stream before any data")
        return first
    first = await _read_answer(resp, target)
    if resp.status == 200:
        if not first:  # no answer to relay: another worker may give one
            raise UpstreamFailed("empty", f"worker {target.worker} answered 200 with an empty body")
        problem = answer_problem(resp.headers, first, stream)
        if problem is not None:  # not what was asked for: another worker may give it; never relayed
            raise UpstreamFailed("bad_answer", f"worker {target.worker} answered 200 with {problem}")
    return first




async def _read_answer(resp: UpstreamResponse, target: TargetState) -> bytes:
    """A whole (non-streamed) answer, which the gateway holds before relaying it: bounded, so a
    worker sending an endless body cannot grow the gateway's memory until the request timeout."""
    parts: list[bytes] = []
    size = 0
    while data := await resp.read_chunk():
        size += len(data)
        if size > MAX_ANSWER_BYTES:
            raise UpstreamFailed("too_large", f"worker {target.worker} answered over {MAX_ANSWER_BYTES >> 20} MiB")
        parts.append(data)
    return b"".join(parts)


def _backoff(attempt: int, base: float, cap: float) -> float:
    return min(cap, base * (2 ** (attempt - 1))) * random.uniform(0.5, 1.0)
