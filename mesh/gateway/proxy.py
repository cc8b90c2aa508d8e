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
  an SSE error event (``delivery``, ``sse_relay``). Each attempt's target comes from ``route_step``. A retry moves the session only once its target served it.
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
import time
from collections.abc import MutableMapping
from typing import Any, Protocol

from mesh.cluster.registry import Worker, WorkerRegistry
from mesh.core.retention import RETENTION_HEADER, SPILL
from mesh.core.router import Lease, Router
from mesh.errors import MeshError, bad_request
from mesh.gateway.access_log import AccessLog, access_entry
from mesh.gateway.admission_queue import AdmissionQueue
from mesh.gateway.client_io import (
    WATCH_AFTER_S,
    BodyBuffer,
    ClientWriteTimeout,
    Exchange,
    Receive,
    Send,
    WriteWatch,
    abort_client,
    client_label,
    client_left,
    read_body,
    watch_disconnect,
)
from mesh.gateway.delivery import Delivery
from mesh.gateway.headers import (
    JSON_HEADERS,
    check_bearer,
    forwarded_names,
    header,
    upstream_headers,
)
from mesh.gateway.request_id import RequestIds
from mesh.gateway.route_step import RouteStep
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
    Failure,
    UpstreamFailed,
    shutdown_error,
)
from mesh.gateway.worker_answer import first_bytes
from mesh.log_limit import LogLimiter, RateLimitedWarning
from mesh.metrics import Metrics
from mesh.request.prompt import ParsedRequest, PromptProcessor
from mesh.request_metrics import RequestSeries
from policies.base import Decision, TargetState

log = logging.getLogger("mesh.gateway.proxy")

Scope = MutableMapping[str, Any]

RETENTION_SPILL = f"{RETENTION_HEADER}: {SPILL}\r\n".encode()  # the retention hint
# An answer's usage, searched from its (last) ``"usage"`` key: the keys' order differs by engine.



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
        self.routing = RouteStep(registry, router, metrics)
        self.mirror = mirror  # shared state (Redis): a session's binding copied in before its decision
        # the request bodies held at once (server.max_buffered_body_bytes), shared with /debug/route
        self.bodies = bodies or BodyBuffer(lambda: registry.config.server.max_buffered_body_bytes)
        self._urls: dict[tuple[str, str], tuple[str, str, int, bytes]] = {}
        self._sessions_config: object = None
        self._session_header_name = b""
        self._route_hist = {r: metrics.request_latency.labels(r) for r in ("chat", "completions")}
        self._ttfb_hist = {r: metrics.ttfb.labels(r) for r in ("chat", "completions")}
        self.delivery = Delivery(registry, metrics)
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
        self.delivery.shutting_down = True

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
                self.access_log.record(access_entry(scope, state, parsed, took))

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
                if not self.routing.retry_has_a_target(parsed, excluded):
                    break  # no back-off (and no retry counted) when nowhere is left to go
                self.metrics.retries_total.labels(failure.kind if failure else "error").inc()
                await asyncio.sleep(_backoff(attempt, retries.backoff_base_s, retries.backoff_max_s))
            if attempt:
                lease = self.routing.lease(parsed, excluded, failure)
            else:
                arrived = time.monotonic()
                lease = await self.admission.admit(lambda: self.routing.lease(parsed, excluded, None, first, arrived), deadline)
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
                    # a retry commits without the session (``RouteStep.lease``): bound once it served it
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
        headers = _attempt_headers(lease, worker, headers)
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
                first = await first_bytes(resp, parsed.stream, target)
            except UpstreamTimeout:  # the request's deadline: the worker is too slow, not broken
                raise self._timed_out(target) from None
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
            await self.delivery.deliver(resp, first, parsed.stream, state, lease, deadline, suspects, series)
            series.e2e(time.perf_counter() - start)
            return None
        except UpstreamFailed as exc:
            if self.shutting_down and exc.body is None:  # e.g. "closed the stream before any data"
                raise shutdown_error() from None
            return self._failure(exc, target, state.request_id)
        finally:
            if resp is not None:
                resp.close()  # back to the pool if complete; else the socket closes and the worker sees it

    def _timed_out(self, target: TargetState) -> MeshError:
        """The error of an attempt cut by the request's deadline, charged to ``target`` (a slow
        worker, not a broken one); the shutdown's error when the pool closed under it."""
        if self.shutting_down:  # not the worker's doing
            return shutdown_error()
        self.registry.record_failure(target.id, time.monotonic(), "timeout")
        self.metrics.upstream_errors_total.labels(target.worker, "timeout").inc()
        timeout_s = self.registry.config.server.request_timeout_s
        return MeshError(504, f"worker {target.worker} did not answer within what was left of the request's "
                              f"{timeout_s:g} s (server.request_timeout_s)", code="upstream_timeout")

    def _failure(self, exc: UpstreamFailed, target: TargetState, request_id: bytes) -> Failure:
        """A failed attempt, counted and charged to its worker (unless only suspect)."""
        if exc.detail is None:  # not logged yet (``_attempt_failed`` logs the others)
            self._attempt_log.warning("request %s: %s", request_id.decode(), exc)
        self.metrics.upstream_errors_total.labels(target.worker, exc.kind).inc()
        suspect = exc.suspect
        if exc.worker_fault and not suspect:
            self.registry.record_failure(target.id, time.monotonic(), exc.detail or str(exc))
        return Failure(exc.kind, exc.status, str(exc), exc.body, exc.headers, target.id if suspect else None)

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


def _attempt_headers(lease: Lease, worker: Worker | None, headers: list[bytes]) -> list[bytes]:
    """The request's header lines for this attempt: the worker's own, its data-parallel rank, the
    retention hint."""
    if worker is not None and (worker.headers or worker.config.dp_size > 1):
        headers = headers + worker.headers
        if worker.config.dp_size > 1:
            headers.append(b"x-data-parallel-rank: %d\r\n" % lease.target.dp_rank)
    if lease.spill:
        headers = headers + [RETENTION_SPILL]
    return headers


def _backoff(attempt: int, base: float, cap: float) -> float:
    return min(cap, base * (2 ** (attempt - 1))) * random.uniform(0.5, 1.0)
