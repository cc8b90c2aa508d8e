"""Disaggregated serving in the gateway: a ``Proxy`` that sends a request whose decision names a
(prefill, decode) pair through ``mesh.gateway.disagg_relay.relay_disaggregated``, and every other
request down the ordinary proxy path.

``mesh.gateway.app`` builds a ``DisaggProxy`` instead of a plain ``Proxy`` when the config has
workers with roles or a policy with profiles (``wanted``); it owns the relay's client, decode
queue and background transfer releases, and ``aclose`` ends them at the lifespan's end. A
streamed decode answer goes through the proxy's own relay (``sse_relay``) and counts as the
proxy counts a stream; its TTFT, ITL, latency and tokens go to the decode target's series.

The pairs speak the config's ``disagg.protocol``: vLLM's (``disagg_relay``: the prefill first,
its ``kv_transfer_params`` to the decode worker) or SGLang's (``disagg_sglang``: one body with a
bootstrap room to both at once).

Cost for policies without prefill/decode profiles: one attribute check per request. With
profiles, ``Router.decide`` runs first (it commits nothing); a decision without a pair (the
pipeline's mixed-role fallback) goes down the ordinary path with that decision.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx

from mesh.cluster.registry import Worker
from mesh.config import MeshConfig
from mesh.gateway.admission_queue import OverCapacity
from mesh.gateway.client_io import Exchange
from mesh.gateway.disagg_relay import (
    DecodeQueue,
    PendingLegs,
    RelayClosed,
    RelayConfig,
    RelayError,
    RelayResponse,
    RelayStats,
    Releases,
    full_for_pairs,
    pd_profiles,
    relay_disaggregated,
)
from mesh.gateway.disagg_sglang import DEFAULT_BOOTSTRAP_PORT, relay_sglang
from mesh.gateway.headers import forwarded
from mesh.gateway.proxy import Proxy
from mesh.gateway.sse_relay import StreamBreak, is_sse, relay_stream
from mesh.gateway.verdicts import shutdown_error
from mesh.gateway.worker_answer import count_usage
from mesh.request.prompt import ParsedRequest
from mesh.request_metrics import Series
from policies.base import Decision, NoCandidate, Role

log = logging.getLogger("mesh.gateway.disagg_proxy")
PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
RELEASE_GRACE_S = 2.0  # at the lifespan's end, for transfer releases still in flight (then cancelled)


class DisaggProxy(Proxy):
    """``Proxy`` plus the relay for prefill/decode pairs. ``http`` is the relay's client."""

    def __init__(self, *args: Any, http: httpx.AsyncClient, queue: DecodeQueue | None = None,
                 config: RelayConfig | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.http = http
        self.decode_queue = queue or DecodeQueue()
        self.relay_config = config or RelayConfig()
        self.relay_stats = RelayStats()
        # Transfer releases of relays ended by their client or the shutdown: in the background (a
        # hung prefill worker must not hold the client's answer), closed by ``aclose``.
        self.releases = Releases()
        self.legs = PendingLegs()  # relay legs waiting on a worker: aborted when it turns unhealthy
        self._closing: asyncio.Task[None] | None = None

    def on_worker_unhealthy(self, worker: Worker) -> None:
        """As ``Proxy.on_worker_unhealthy``, and the relay legs waiting on the worker are aborted
        (each retried on another worker of its role)."""
        super().on_worker_unhealthy(worker)
        aborted = self.legs.abort(t.id for t in worker.targets)
        if aborted:
            log.warning("worker %s turned unhealthy: %d relay legs waiting on it are retried elsewhere",
                        worker.name, aborted)

    async def aclose(self) -> None:
        """At the lifespan's end: as ``Proxy.aclose``, close the relay's client, and end its background
        transfer releases (``RELEASE_GRACE_S`` for those in flight, then cancelled: no task outlives it)."""
        await super().aclose()
        await self.http.aclose()
        if self._closing is not None:
            await asyncio.gather(self._closing, return_exceptions=True)
        await self.releases.close(RELEASE_GRACE_S)

    def shut_down(self) -> None:
        """As ``Proxy.shut_down`` (the flag that charges no worker for what the close breaks), and
        the relay's client closes too: ``end_in_flight`` closes the ordinary proxy's pool only,
        and relayed requests would otherwise run on until uvicorn cancels them mid-answer."""
        super().shut_down()
        if self._closing is None:
            self._closing = asyncio.get_running_loop().create_task(self.http.aclose())

    async def _forward(self, parsed: ParsedRequest, client_headers: list[tuple[bytes, bytes]], state: Exchange,
                       route: str, start: float, first: Decision | None = None) -> None:
        if first is not None or pd_profiles(self.router.policy) is None:  # decided already, or no pairs to form
            await super()._forward(parsed, client_headers, state, route, start, first)
            return
        deadline = time.monotonic() + self.registry.config.server.request_timeout_s  # the wait counts against it
        decision = await self.admission.admit(lambda: self._decide_pair(parsed), deadline)
        if decision is None or decision.decode_target is None:  # this decision, not a second one
            await super()._forward(parsed, client_headers, state, route, start, first=decision)
            return
        await self._relay(parsed, client_headers, state, route, start, decision)

    def _decide_pair(self, parsed: ParsedRequest) -> Decision | None:
        """The pair's decision; None when no target can serve it. Prefill targets at their admission
        limit are left out (decode ones wait in the relay's queue); while every candidate is full
        it raises ``OverCapacity``: the request waits in the admission queue and is paired then."""
        now = time.monotonic()
        self.registry.tick(now)
        full = full_for_pairs(self.registry.targets) if self.registry.admission_limited else []
        try:
            return self.router.decide(parsed.info, now, exclude=full)
        except NoCandidate:
            if full:
                raise OverCapacity() from None
            return None

    async def _relay(self, parsed: ParsedRequest, client_headers: list[tuple[bytes, bytes]], state: Exchange,
                     route: str, start: float, decision: Decision) -> None:
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in forwarded(client_headers, self._forwarded_names())]
        protocol = self._protocol(decision.target)  # the prefill worker's: read per request, a reload switches it
        foreign = [tid for tid in self.registry.targets if self._protocol(tid) != protocol]
        common: dict[str, Any] = {
            "path": PATHS[parsed.kind], "headers": headers, "config": self.relay_config, "queue": self.decode_queue,
            "stats": self.relay_stats, "health": self.registry, "legs": self.legs, "foreign": foreign,
            "request_id": state.request_id.decode("ascii"),
        }
        try:
            if decision.decode_target in foreign:  # a pair across protocols cannot work: another of this one's
                decision = self._decide_within(parsed, decision, foreign)
            if protocol == "sglang":
                resp = await relay_sglang(self.http, self.router, parsed.info, parsed.body, decision,
                                          bootstrap_port=self._bootstrap_port, **common)
            else:
                resp = await relay_disaggregated(self.http, self.router, parsed.info, parsed.body, decision,
                                                 releases=self.releases, **common)
        except RelayClosed:
            raise shutdown_error() from None  # the proxy's answer: 503, "the gateway is shutting down"
        except RelayError as exc:
            out = [(b"content-type", b"application/json"), *((k.encode(), v.encode()) for k, v in exc.headers.items())]
            await state.respond(exc.status, out, exc.body)
            return
        series = self.series.series(parsed.info.model, resp.decode)
        try:
            ttft = time.perf_counter() - start
            self._ttfb_hist[route].observe(ttft)
            state.served_by = self.registry.targets.get(resp.decode)
            if resp.status == 200:
                series.ttft(ttft)
                state.ttft_s = ttft
            out = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in resp.headers if k.lower() != "x-request-id"]
            try:
                # The request timeout bounds the relay whether the worker or the client is slow:
                # a client that stops reading (socket open) would hold the decode lease forever.
                # Sooner, a write to the client waiting past client_write_timeout_s raises
                # ClientWriteTimeout (``Exchange``): the finally below ends the decode lease and
                # closes its connection, and ``Proxy.handle`` drops the client.
                async with asyncio.timeout_at(resp.deadline):
                    tail = await self._send_answer(resp, out, state, series)
                if tail and resp.status == 200:
                    count_usage(tail, series, state)
            except TimeoutError:
                # Lease and decode connection end first: the error event below waits on a client
                # that may never read again (its disconnect cancels that wait).
                await resp.aclose()
                if state.started and not state.done:
                    self.metrics.stream_errors_total.inc()  # an error event after the first byte, as the proxy counts it
                    await state.stream_error(f"request timed out after {self.relay_config.timeout_s:g} s")
            series.e2e(time.perf_counter() - start)
        finally:
            await resp.aclose()

    def _protocol(self, target_id: str | None) -> str:
        """A target's pair protocol: its worker's ``disagg_protocol``, else the config's ``disagg.protocol``."""
        worker = self.registry.worker_of(target_id) if target_id is not None else None
        own = worker.config.disagg_protocol if worker is not None else None
        return own or self.registry.config.disagg.protocol

    def _decide_within(self, parsed: ParsedRequest, decision: Decision, foreign: list[str]) -> Decision:
        """The request's pair again, without the targets of another protocol than its prefill
        worker's; raises ``RelayError`` (503) when no such pair can form."""
        try:
            again = self.router.decide(parsed.info, time.monotonic(), exclude=foreign + full_for_pairs(self.registry.targets))
        except NoCandidate:
            again = None
        if again is None or again.decode_target is None:
            protocol = self._protocol(decision.target)
            raise RelayError(503, f"no decode worker speaks the {protocol} protocol of prefill worker {decision.target}",
                             "no_decode_worker")
        return again

    def _bootstrap_port(self, target_id: str) -> int:
        """An SGLang prefill target's bootstrap port: its worker's ``bootstrap_port``, else SGLang's default."""
        worker = self.registry.worker_of(target_id)
        port = worker.config.bootstrap_port if worker is not None else None
        return port if port is not None else DEFAULT_BOOTSTRAP_PORT

    async def _send_answer(self, resp: RelayResponse, headers: list[tuple[bytes, bytes]], state: Exchange,
                           series: Series) -> bytes:
        """Relay the decode worker's answer; its last bytes (where the usage is), b"" if it broke."""
        if not resp.stream:
            await state.respond(resp.status, headers, resp.first)
            return resp.first
        await state.start(resp.status, headers)
        sse = is_sse([(k.lower(), v) for k, v in headers])
        end = await relay_stream(state, resp.first, resp.read_chunk, sse, httpx.HTTPError, series.itl)
        if not isinstance(end, StreamBreak):
            # A stream is its worker's success once it ended whole (as in the proxy), not at its
            # first bytes: a decode worker that breaks every stream must reach its failure threshold.
            self.registry.record_success(resp.decode)
            return end
        worker = self.registry.worker_of(resp.decode)
        await self.delivery.end_broken_stream(state, resp.decode, worker.name if worker is not None else resp.decode, end)
        return b""


def wanted(config: MeshConfig) -> bool:
    """A config that can form prefill/decode pairs: a worker with a role, or policy profiles."""
    roles = any(w.role != Role.MIXED for w in config.workers)
    policy = config.policy
    profiles = isinstance(policy, dict) and isinstance(policy.get("params"), dict) and "profiles" in policy["params"]
    return roles or profiles


def relay_client(timeout_s: float, connect_timeout_s: float) -> httpx.AsyncClient:
    """The relay's own pooled client (prefill and decode legs)."""
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=512)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s))
