"""Disaggregated serving in the gateway: a ``Proxy`` that sends a request whose decision names a
(prefill, decode) pair through ``mesh.gateway.disagg_relay.relay_disaggregated``, and every other request down
the ordinary proxy path.

``mesh.gateway.app`` builds a ``DisaggProxy`` instead of a plain ``Proxy`` when the config has
workers with roles or a policy with profiles (``wanted``); ``aclose`` ends its relay client and
background transfer releases at the lifespan's end.

Cost for policies without prefill/decode profiles: one attribute check per request. With
profiles, ``Router.decide`` runs first (it commits nothing); a decision without a pair (the
pipeline's mixed-role fallback) goes down the ordinary path, which decides again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from mesh.gateway.disagg_relay import (
    DecodeQueue, RelayClosed, RelayConfig, RelayError, RelayResponse, RelayStats, Releases, full_for_pairs,
    relay_disaggregated,
)
from mesh.request.prompt import ParsedRequest
from mesh.gateway.client_io import Exchange
from mesh.gateway.proxy import (
    HOP_BY_HOP, MAX_PENDING_EVENT, SHUTDOWN_MESSAGE, Proxy, _shutdown_error, _whole_events, ended_whole, is_sse,
)
from policies.base import NoCandidate

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
        self._closing: asyncio.Task[None] | None = None

    async def aclose(self) -> None:
        """At the lifespan's end: close the relay's client, and end its background transfer
        releases (``RELEASE_GRACE_S`` for those in flight, then cancelled: no task outlives it)."""
        await self.http.aclose()
        if self._closing is not None:
            await asyncio.gather(self._closing, return_exceptions=True)
        await self.releases.close(RELEASE_GRACE_S)

    def shut_down(self) -> None:
        """As ``Proxy.shut_down`` (the flag that charges no worker for what the close breaks), and
        the relay's client closes too: ``end_in_flight`` closes the ordinary proxy's pool only,
        so relayed requests ran on until uvicorn cancelled them and cut their clients off."""
        super().shut_down()
        if self._closing is None:
            self._closing = asyncio.get_running_loop().create_task(self.http.aclose())

    async def _forward(self, parsed: ParsedRequest, client_headers: list[tuple[bytes, bytes]], state: Exchange,
                       route: str, start: float) -> None:
        if getattr(self.router.policy, "pd", None) is None:  # no prefill/decode profiles
            await super()._forward(parsed, client_headers, state, route, start)
            return
        now = time.monotonic()
        self.registry.tick(now)
        # Prefill targets at their admission limit are left out (decode ones wait in the relay's
        # queue); with every one full the ordinary path answers 429, as for any full model.
        full = full_for_pairs(self.registry.targets) if self.registry.admission_limited else []
        try:
            decision = self.router.decide(parsed.info, now, exclude=full)
        except NoCandidate:
            decision = None
        if decision is None or decision.decode_target is None:  # this decision, not a second one
            await super()._forward(parsed, client_headers, state, route, start, first=decision)
            return
        await self._relay(parsed, client_headers, state, route, start, decision)

    async def _relay(self, parsed: ParsedRequest, client_headers: list[tuple[bytes, bytes]], state: Exchange,
                     route: str, start: float, decision: Any) -> None:
        forward = self.registry.config.server.forward_authorization
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in client_headers
                   if k not in HOP_BY_HOP and (forward or k != b"authorization")]
        try:
            resp = await relay_disaggregated(
                self.http, self.router, parsed.info, parsed.body, decision, path=PATHS[parsed.kind], headers=headers,
                config=self.relay_config, queue=self.decode_queue, stats=self.relay_stats, health=self.registry,
                releases=self.releases,
            )
        except RelayClosed:
            raise _shutdown_error() from None  # the proxy's answer: 503, "the gateway is shutting down"
        except RelayError as exc:
            out = [(b"content-type", b"application/json"), *((k.encode(), v.encode()) for k, v in exc.headers.items())]
            await state.respond(exc.status, out, exc.body)
            return
        try:
            self._ttfb_hist[route].observe(time.perf_counter() - start)
            out = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in resp.headers]
            try:
                # The request timeout bounds the relay whether the worker or the client is slow:
                # a client that stops reading (socket open) would hold the decode lease forever.
                # Sooner, a write to the client waiting past client_write_timeout_s raises
                # ClientWriteTimeout (``Exchange``): the finally below ends the decode lease and
                # closes its connection, and ``Proxy.handle`` drops the client.
                async with asyncio.timeout_at(resp.deadline):
                    await self._send_answer(resp, out, state)
            except TimeoutError:
                # Lease and decode connection end first: the error event below waits on a client
                # that may never read again (its disconnect cancels that wait).
                await resp.aclose()
                if state.started and not state.done:
                    self.metrics.stream_errors_total.inc()  # an error event after the first byte, as the proxy counts it
                    await state.stream_error(f"request timed out after {self.relay_config.timeout_s:g} s")
        finally:
            await resp.aclose()

    async def _send_answer(self, resp: RelayResponse, headers: list[tuple[bytes, bytes]], state: Exchange) -> None:
        if not resp.stream:
            await state.respond(resp.status, headers, resp.first)
            return
        await state.start(resp.status, headers)
        broke = await _relay_events(resp, state, is_sse([(k.lower(), v) for k, v in headers]))
        if broke is None:
            await state.end()
            # A stream is its worker's success once it ended whole (as in the proxy), not at its
            # first bytes: a decode worker that breaks every stream must reach its failure threshold.
            self.registry.record_success(resp.decode)
            return
        if self.shutting_down:  # the relay's client was closed under it: nobody's failure, nothing counted
            await state.stream_error(SHUTDOWN_MESSAGE)
            return
        # As ``Proxy._relay_stream`` treats a break: the client has whole events, then the error
        # event; the decode worker's failure counts toward its circuit breaker.
        self.metrics.stream_errors_total.inc()
        self.registry.record_failure(resp.decode, time.monotonic(), f"stream broke: {broke}")
        worker = self.registry.worker_of(resp.decode)
        await state.stream_error(f"worker {worker.name if worker is not None else resp.decode} failed mid-stream"
                                 + (" (its stream ended without [DONE])" if broke == _NO_DONE else ""))


_NO_DONE = "it ended without data: [DONE]"


async def _decode_chunks(resp: RelayResponse) -> AsyncIterator[bytes]:
    """The decode answer's bytes, its first ones included. A break raises ``httpx.HTTPError``
    (``RelayResponse.body()`` would turn it into an error event, unrecognizable as a break)."""
    yield resp.first
    if resp._chunks is not None:
        async for chunk in resp._chunks:
            yield chunk


async def _relay_events(resp: RelayResponse, state: Exchange, sse: bool) -> str | None:
    """Relay an OpenAI event stream, whole events only (an unfinished one waits for its end, so
    that a break leaves the client whole events); None when it ended whole, with ``[DONE]``,
    else what broke it (the unfinished event is then dropped). ``sse`` False: a streamed answer
    that is not an event stream (a worker's JSON), whose end needs no ``[DONE]``; a break of it is
    a break all the same (``RelayResponse.body()`` swallowed it: no worker charged)."""
    pending = before = last = b""  # the last two chunks, by reference: [DONE] ends the stream
    try:
        async for data in _decode_chunks(resp):
            if pending:
                data, pending = pending + data, b""
            before, last = last, data
            cut = _whole_events(data)
            if cut:
                await state.chunk(data if cut == len(data) else data[:cut])
            pending = data[cut:]
            if len(pending) > MAX_PENDING_EVENT:  # not SSE, or one huge event: relayed as it comes
                await state.chunk(pending)
                pending = b""
    except httpx.HTTPError as exc:
        if not pending and ended_whole(before, last):  # the client has it all: only the framing broke
            return None
        return repr(exc)
    if sse and not ended_whole(before, last):  # the body ended (a FIN ends a close-delimited one) before [DONE]
        return _NO_DONE
    if pending:  # a last event without its blank line: the worker's own, relayed as sent
        await state.chunk(pending)
    return None


def wanted(config: Any) -> bool:
    """A config that can form prefill/decode pairs: a worker with a role, or policy profiles."""
    roles = any(getattr(w.role, "value", w.role) != "mixed" for w in config.workers)
    policy = config.policy
    profiles = isinstance(policy, dict) and isinstance(policy.get("params"), dict) and "profiles" in policy["params"]
    return roles or profiles


def relay_client(timeout_s: float, connect_timeout_s: float) -> httpx.AsyncClient:
    """The relay's own pooled client (prefill and decode legs)."""
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=512)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s))


