"""SGLang's prefill/decode protocol for the gateway's relay (``disagg.protocol: sglang``).

SGLang pairs a prefill and a decode request by a *bootstrap room*: the router adds
``bootstrap_host`` and ``bootstrap_port`` (the prefill worker's bootstrap server: its URL's host,
its ``bootstrap_port``, SGLang's default 8998) and a random 63-bit ``bootstrap_room`` to the
client's body and sends that same body to both workers at once. The decode worker bootstraps
with the prefill worker by the room, receives the prompt's KV, and its answer is the client's;
the prefill worker's answer (one token) is read and dropped. An SGLang worker in a
disaggregation mode refuses a request without a room (400), and each side waits for the other,
so the two legs must run concurrently.

Invariants:
- Every pair attempt has its own fresh room (never missing; a retry never reuses one: the old
  prefill may still hold it). A client cannot set the bootstrap fields (``mesh.request.prompt``).
- Each leg's lease (``Router.commit_prefill``, ``commit_decode``) is finished exactly once; the
  session binds to the decode worker once it answers (``Router.decode_answered``).
- A leg that fails before the decode's first bytes ends the other (its connection closed: SGLang
  aborts a request whose client left) and is charged as the proxy charges (``Relay.charge``);
  the other leg is not. A prefill failure retries with a new pair, that prefill worker excluded;
  a decode failure with a new pair, that decode worker excluded. The client's disconnect (the
  relay cancelled) or the handed-over answer's ``aclose`` ends whatever still runs.
- Once the decode answered, the prefill leg still running goes with the answer
  (``RelayResponse._companion``): it finishes its lease and reports its worker's health itself.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NoReturn

import httpx

from mesh.core.router import Router
from mesh.gateway.disagg_bookkeeping import DecodeQueue, NoHealth, PendingLegs, RelayConfig, RelayStats, WorkerHealth
from mesh.gateway.disagg_relay import Relay
from mesh.gateway.disagg_wire import (
    HOP_BY_HOP,
    Full,
    RelayError,
    RelayResponse,
    Retry,
    TooLarge,
    default_code,
    error_code,
    first_bytes,
    forward_headers,
    named_headers,
    read_bounded,
    relay_inputs,
    what_failed,
)
from mesh.gateway.verdicts import status_verdict
from policies.base import Decision, NoCandidate, RequestInfo, TargetState

__all__ = ["DEFAULT_BOOTSTRAP_PORT", "SglangRelay", "leg_bodies", "new_room", "relay_sglang", "sglang_body"]

DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's --disaggregation-bootstrap-port default
# Rooms are drawn below 2**63 minus this: SGLang gives sequence i of a request (``n``, a prompt
# list) room + i, which must stay a signed 64-bit value.
ROOM_HEADROOM = 1 << 16

DecodeLeg = tuple[httpx.Response, bytes, Any, float]  # response, first bytes, rest (a stream's), deadline


class PrefillRetry(Retry):
    """The prefill leg failed: another pair, that prefill worker excluded."""


def new_room() -> int:
    """A fresh bootstrap room: uniform below 2**63 (less ``ROOM_HEADROOM``), unguessable."""
    return secrets.randbelow((1 << 63) - ROOM_HEADROOM)


def sglang_body(body: dict[str, Any], host: str, port: int, room: int) -> dict[str, Any]:
    """The body both workers get: the client's, plus the pair's bootstrap fields."""
    return {**body, "bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room}


def leg_bodies(body: dict[str, Any], prefill: TargetState, decode: TargetState) -> tuple[dict[str, Any], dict[str, Any]]:
    """The pair's body as each leg gets it. For a data-parallel worker (a target ``worker@rank``)
    the leg names its rank (``routed_dp_rank``, SGLang's pin), and the decode worker is told which
    prefill rank holds the KV (``disagg_prefill_dp_rank``: else it asks the prefill worker's
    bootstrap server, or guesses ``room % dp_size``, which need not be the rank Mesh chose)."""
    pre, dec = dict(body), dict(body)
    if _data_parallel(prefill):
        pre["routed_dp_rank"] = prefill.dp_rank
        pre["disagg_prefill_dp_rank"] = dec["disagg_prefill_dp_rank"] = prefill.dp_rank
    if _data_parallel(decode):
        dec["routed_dp_rank"] = decode.dp_rank
    return pre, dec


def _data_parallel(target: TargetState) -> bool:
    return target.id != target.worker  # ``policies.base.target_id``: a rank of a multi-rank worker


def stream_error(first: bytes) -> tuple[int, bytes] | None:
    """SGLang's error event at the head of a stream (an abort with a status: a failed transfer),
    as (status, its JSON); None when the stream starts with data."""
    line = first.split(b"\n", 1)[0].strip()
    if not line.startswith(b"data:"):
        return None
    try:
        event = json.loads(line[5:])
    except ValueError:
        return None
    if not isinstance(event, dict) or not (event.get("object") == "error" or isinstance(event.get("error"), dict)):
        return None
    code = event.get("code", (event.get("error") or {}).get("code") if isinstance(event.get("error"), dict) else None)
    status = code if isinstance(code, int) and 400 <= code < 600 else 502
    return status, line[5:].strip()


class SglangRelay(Relay):
    """One request's relay over SGLang pairs. It shares ``Relay``'s bookkeeping (exclusions,
    suspects, the choice of another decode worker, the checks of an answer); the legs are its own."""

    def __init__(self, *args: Any, bootstrap_port: Callable[[str], int]) -> None:
        super().__init__(*args)
        self.bootstrap_port = bootstrap_port  # a prefill target's bootstrap port (its worker's config)

    async def run(self, decision: Decision) -> RelayResponse:
        last: Retry | None = None
        for _ in range(self.config.max_pairs):
            prefill_id, first_decode = decision.target, decision.decode_target
            if first_decode is None or prefill_id is None:
                if last is None:
                    raise RelayError(503, f"no prefill/decode pair ({decision.reason})", "no_decode_worker")
                break
            decode_id = await self.admit_decode(prefill_id, first_decode)
            try:
                return await self.pair(prefill_id, decode_id)
            except PrefillRetry as exc:
                self.stats.prefill_failures += 1
                last = exc
                self.bad_prefill.append(prefill_id)
            except Retry as exc:
                self.stats.decode_failures += 1
                last = exc
                self.bad_decode.append(decode_id)
            try:
                decision = self.decide(self.bad_prefill + self.bad_decode)
            except NoCandidate:
                break
        assert last is not None  # the loop ran at least once (max_pairs >= 1) and did not return
        if last.body is not None and 400 <= last.status < 600:
            raise RelayError(last.status, str(last), last.code, last.body, last.headers)
        raise RelayError(502, f"disaggregated request failed: {last}", "upstream_error", headers=last.headers)

    async def admit_decode(self, prefill_id: str, choice: str | None) -> str:
        """A decode worker that can take the request now (``check_decode_target``); with every one
        at its admission limit the request waits in the ``DecodeQueue`` (bounded, as ``Relay``)."""
        deadline = self.now() + self.config.queue_wait_s
        while True:
            if choice is None:
                choice = self.next_decode(prefill_id)
            if choice is None:
                if not self.full_decode:
                    raise RelayError(503, "no decode worker can take the request", "no_decode_worker")
                delay = min(self.config.retry_after_cap_s, deadline - self.now())
                if delay <= 0 or not await self.queue.wait(delay):
                    raise RelayError(429, "every decode worker is at its admission limit", "over_capacity",
                                     headers={"retry-after": "1"})
                self.full_decode.clear()
                continue
            try:
                self.check_decode_target(choice)
                return choice
            except Full:
                self.stats.decode_refusals += 1
                self.full_decode.append(choice)
            except Retry:  # removed or taken out of routing during the wait
                self.bad_decode.append(choice)
            choice = None

    async def pair(self, prefill_id: str, decode_id: str) -> RelayResponse:
        """Both legs at once with one fresh room; the decode's answer once its first bytes are in."""
        self.check_open()
        host = urllib.parse.urlsplit(self.router.targets[prefill_id].url).hostname or ""
        body = sglang_body(self.body, host, self.bootstrap_port(prefill_id), new_room())
        prefill_body, decode_body = leg_bodies(body, self.router.targets[prefill_id], self.router.targets[decode_id])
        prefill_lease = self.router.commit_prefill(self.info, prefill_id, self.now())
        prefill = asyncio.create_task(self.prefill_leg(prefill_id, prefill_body, prefill_lease))
        prefill.add_done_callback(_retrieve)  # its failure after the hand-over is reported by itself
        # The decode worker receives the whole prompt's KV: the prompt counts as its cached prefix.
        decode_lease = self.router.commit_decode(self.info, decode_id, len(self.info.block_keys), self.now())
        decode = asyncio.create_task(self.decode_leg(decode_id, decode_body))
        handed_over = False
        try:
            await asyncio.wait({prefill, decode}, return_when=asyncio.FIRST_COMPLETED)
            if not decode.done():  # the prefill ended first: failed, the decode cannot get its KV
                failure = prefill.exception()
                if failure is not None:
                    raise failure
            resp, first, chunks, deadline = await decode
            out = self.hand_over_pair(prefill_id, decode_id, resp, first, chunks, decode_lease, deadline, prefill)
            handed_over = True  # the response, the decode lease and the prefill leg are the answer's now
            return out
        finally:
            if not handed_over:
                for task in (prefill, decode):
                    task.cancel()
                await asyncio.gather(prefill, decode, return_exceptions=True)
                decode_lease.finish(self.now())
                if decode.done() and not decode.cancelled() and decode.exception() is None:
                    await decode.result()[0].aclose()

    async def prefill_leg(self, target_id: str, body: dict[str, Any], lease: Any) -> None:
        """The prefill request: its answer read whole and dropped; raises ``PrefillRetry`` (or
        ``RelayError`` for an answer that is the client's fault) when it failed."""
        resp, content = await self.send_prefill(target_id, body, lease, PrefillRetry)
        status = resp.status_code
        if status == 200 and body.get("stream"):
            event = stream_error(content)
            if event is not None:
                status, content = event
        if status != 200:
            self.refused(target_id, status, content, resp, "x-mesh-prefill-worker", self.prefill_suspects, PrefillRetry)
        self.served(self.prefill_suspects)
        self.health.record_success(target_id)

    async def decode_leg(self, target_id: str, body: dict[str, Any]) -> DecodeLeg:
        """The decode request, up to its first bytes (every failure a ``Retry``, charged as the proxy
        charges it); its response is closed on any failure or cancellation."""
        deadline = asyncio.get_running_loop().time() + self.config.timeout_s
        request = self.client.build_request("POST", self.url(target_id), json=body, headers=self.headers,
                                            timeout=self.decode_timeout)
        resp: httpx.Response | None = None
        try:
            try:
                async with self.legs.watch(target_id, deadline) as leg:
                    resp = await self.client.send(request, stream=True)
                    if resp.status_code != 200:
                        content = await read_bounded(resp)
                        self.refused(target_id, resp.status_code, content, resp, "x-mesh-worker", self.decode_suspects)
                    chunks = resp.aiter_raw() if self.stream else None
                    first = await first_bytes(chunks) if chunks is not None else await read_bounded(resp)
            except (httpx.HTTPError, TooLarge) as exc:
                self.check_open()
                self.health.record_failure(target_id, self.now(), f"decode failed: {exc!r}")
                raise Retry(f"decode worker {target_id} failed ({what_failed(exc)})") from exc
            except TimeoutError as exc:
                if leg.aborted:
                    raise Retry(f"decode worker {target_id} turned unhealthy before it answered", 503,
                                code="upstream_error") from exc
                self.health.record_failure(target_id, self.now(), "decode timed out")
                raise Retry(f"decode worker {target_id} timed out after {self.config.timeout_s:g} s", 504,
                            code="upstream_timeout") from exc
            self.check_first(target_id, resp, first)
            return resp, first, chunks, deadline
        except BaseException:
            if resp is not None:
                await resp.aclose()
            raise

    def check_first(self, target_id: str, resp: httpx.Response, first: bytes) -> None:
        """A decode answer's first bytes: nothing, or not what was asked for, is its worker's failure
        at once (``check_answer``); a stream that opens with SGLang's error event (a transfer that
        failed) is its status, charged as such."""
        if not first:
            self.check_open()
            message = f"decode worker {target_id} " + ("closed the stream before any data" if self.stream
                                                       else "answered 200 with an empty body")
            self.health.record_failure(target_id, self.now(), message)
            raise Retry(message, headers={"x-mesh-worker": target_id})
        self.check_answer(target_id, resp, first)
        event = stream_error(first) if self.stream else None
        if event is not None:
            self.refused(target_id, event[0], event[1], resp, "x-mesh-worker", self.decode_suspects)

    def refused(self, target_id: str, status: int, content: bytes, resp: httpx.Response, header: str,
                suspects: list[tuple[str, str]], retry: type[Retry] = Retry) -> NoReturn:
        """Raise what a worker's error answer means, charging it as the proxy would: retryable
        (``retry``), or the client's answer as is (``RelayError``)."""
        code = error_code(content)
        message = f"{'prefill' if retry is PrefillRetry else 'decode'} worker {target_id} answered {status}"
        named = named_headers(resp, header, target_id)
        verdict = status_verdict(status)
        if verdict.retry:
            self.charge(target_id, verdict, message, suspects)
            raise retry(message, status, content, code or "upstream_error", named)
        self.served(suspects)
        raise RelayError(status, message, code or default_code(status), content, named)

    def hand_over_pair(self, prefill_id: str, decode_id: str, resp: httpx.Response, first: bytes, chunks: Any,
                       lease: Any, deadline: float, prefill: asyncio.Task[None]) -> RelayResponse:
        """The decode worker answers the request: count it, bind the session to it, and hand its
        response, its lease and the prefill leg (if still running) to a ``RelayResponse``."""
        self.served(self.decode_suspects)
        if not self.stream:  # a stream is a success once it ended whole: its relayer says so
            self.health.record_success(decode_id)
        lease.first_token()
        self.router.decode_answered(lease, self.info.session_id, self.now())
        headers = [(k, v) for k, v in resp.headers.items() if k.lower() not in HOP_BY_HOP]
        headers += [("x-mesh-worker", decode_id), ("x-mesh-prefill-worker", prefill_id)]
        return RelayResponse(resp.status_code, headers, first, self.stream, prefill_id, decode_id, None, None, resp,
                             chunks, lease, self.now, deadline, self.client, prefill)


def _retrieve(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()


async def relay_sglang(
    client: httpx.AsyncClient,
    router: Router,
    request_info: RequestInfo,
    body: bytes | Mapping[str, Any],
    decision: Decision,
    *,
    bootstrap_port: Callable[[str], int] = lambda _: DEFAULT_BOOTSTRAP_PORT,
    path: str = "/v1/completions",
    headers: Iterable[tuple[str, str]] | None = None,
    config: RelayConfig | None = None,
    queue: DecodeQueue | None = None,
    stats: RelayStats | None = None,
    now: Callable[[], float] = time.monotonic,
    request_id: str | None = None,
    health: WorkerHealth | None = None,
    legs: PendingLegs | None = None,
    foreign: Iterable[str] = (),
) -> RelayResponse:
    """Serve one request through an SGLang (prefill, decode) pair: ``relay_disaggregated``'s
    contract (its arguments, ``RelayResponse``, ``RelayError``), over this module's protocol.
    ``bootstrap_port``: a prefill target's bootstrap port. Nothing to release at a worker: an
    SGLang leg whose connection closes is aborted by its engine."""
    data, rid, stats = relay_inputs(body, request_id, stats)
    relay = SglangRelay(client, router, request_info, data, path, forward_headers(headers, rid), config or RelayConfig(),
                        queue if queue is not None else DecodeQueue(), stats, now, health or NoHealth(), None, legs,
                        foreign, bootstrap_port=bootstrap_port)
    return await relay.run(decision)
