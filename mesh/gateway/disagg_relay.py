"""The gateway's relay for a disaggregated request: prefill on one worker, decode on another,
one ordinary OpenAI response (streaming or not) to the client (the messages: ``disagg_wire``).

Invariants:
- Every failure before the decode worker's first bytes is retried (``Relay`` says where) and
  charged to a worker's passive health as the ordinary proxy charges (``verdicts``), so one
  request counts once for each worker; a streamed answer's success is its relayer's to tell.
- Every lease is finished exactly once (``try/finally``, ``RelayResponse.aclose``).
- A transfer the relay gives up on is released at its prefill worker (best effort; the worker's
  deadline frees what a release misses): awaited before a new pair or an error answer, in the
  background (``Releases``) when the client went away or at shutdown. A decode worker that
  imported the blocks releases them itself.
- Once the relay's client is closed (the gateway's shutdown), whatever breaks is nobody's
  failure: ``RelayClosed`` at once, no retry, no worker charged.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import httpx

from mesh.core.router import Lease, Router
from mesh.gateway.disagg_bookkeeping import (
    DecodeQueue,
    NoHealth,
    PendingLegs,
    RelayConfig,
    RelayStats,
    Releases,
    WorkerHealth,
    full_for_pairs,
    pd_profiles,
    release_transfer,
)
from mesh.gateway.disagg_wire import (
    ADMISSION_CODES,
    HOP_BY_HOP,
    PREFILL_SIDE_CODES,
    TRANSFER_CHARGED,
    TRANSFER_SUSPECT,
    Full,
    NewPair,
    RelayClosed,
    RelayError,
    RelayResponse,
    Retry,
    TooLarge,
    decode_body,
    default_code,
    error_code,
    first_bytes,
    forward_headers,
    named_headers,
    prefill_body,
    read_bounded,
    relay_inputs,
    what_failed,
)
from mesh.gateway.sse_relay import is_sse
from mesh.gateway.verdicts import StatusVerdict, answer_problem, status_verdict
from policies.base import Decision, NoCandidate, RequestInfo

__all__ = [  # what callers import from here (the relay's parts live in disagg_bookkeeping and disagg_wire)
    "DecodeQueue", "PendingLegs", "RelayClosed", "RelayConfig", "RelayError", "RelayResponse", "RelayStats", "Releases",
    "decode_body", "full_for_pairs", "pd_profiles", "prefill_body", "relay_disaggregated",
]


class Relay:
    """One request's relay; all state of its attempts lives here.

    Retried while nothing has reached the client:
    - a prefill that fails (connect error, 429, 500/502/503/504, a 200 without a JSON object):
      another pair, that prefill worker excluded;
    - a decode worker that refuses admission (429, or 503 with a ``kv_*`` code), or is at the
      gateway's admission limit for it (``max_in_flight``, checked before committing): another
      decode worker; with every one full, the request waits in the bounded ``DecodeQueue``;
    - a decode worker that dies or cannot take the blocks (connect error, 500/502/503/504, a 5xx
      with a ``kv_*`` code, 409 layout/key mismatch, 413), or answers 200 with nothing: another
      decode worker, with the same prefill (its blocks stay pinned there);
    - a transfer that fails on the prefill side (``PREFILL_SIDE_CODES``): a new pair, that prefill
      worker excluded; with no pair left, the last decode worker's error, naming that pair.
    A 4xx that is the client's fault, or another 5xx (501, ...), is answered as is, with the
    worker's name and its own ``retry-after`` (so is the last retryable answer).
    """

    def __init__(self, client: httpx.AsyncClient, router: Router, info: RequestInfo, body: dict[str, Any],
                 path: str, headers: dict[str, str], config: RelayConfig, queue: DecodeQueue,
                 stats: RelayStats, now: Callable[[], float], health: WorkerHealth,
                 releases: Releases | None = None, legs: PendingLegs | None = None, foreign: Iterable[str] = ()) -> None:
        self.client, self.router, self.info, self.body = client, router, info, body
        self.foreign = list(foreign)  # targets of another pair protocol: never part of this request's pairs
        self.health, self.releases = health, releases
        self.legs = legs if legs is not None else PendingLegs()
        # Per role, the 500s met so far, (target id, message): charged once another worker of
        # that role answers the request, forgotten if none does (``status_verdict``).
        self.prefill_suspects: list[tuple[str, str]] = []
        self.decode_suspects: list[tuple[str, str]] = []
        # Failed pulls (prefill id, decode id, message) charged to their prefill worker once the
        # same decode worker takes another prefill worker's transfer (``transfer_taken``).
        self.transfer_suspects: list[tuple[str, str, str]] = []
        self.failed_transfers: list[str] = []  # "prefill -> decode" of each failed transfer, in order
        self.path, self.headers, self.config, self.queue, self.stats, self.now = path, headers, config, queue, stats, now
        self.stream = bool(body.get("stream"))
        # httpx bounds each read (``RelayConfig``); ``timeout_s`` bounds the decode answer whole.
        self.prefill_timeout = httpx.Timeout(config.timeout_s, connect=config.connect_timeout_s,
                                             read=min(config.first_byte_timeout_s, config.timeout_s))
        read = max(config.first_byte_timeout_s, config.idle_timeout_s) if self.stream else config.timeout_s
        self.decode_timeout = httpx.Timeout(config.timeout_s, connect=config.connect_timeout_s,
                                            read=min(read, config.timeout_s))
        self.bad_prefill: list[str] = []
        self.bad_decode: list[str] = []  # failed: excluded for the whole request
        self.full_decode: list[str] = []  # refused admission: excluded until the next wait
        self.prefill_usage: dict[str, Any] | None = None

    def url(self, target_id: str) -> str:
        return self.router.targets[target_id].url.rstrip("/") + self.path

    def decide(self, exclude: list[str]) -> Decision:
        return self.router.decide(self.info, self.now(), exclude=exclude + self.foreign + full_for_pairs(self.router.targets))

    async def run(self, decision: Decision) -> RelayResponse:
        last: Retry | None = None
        for _ in range(self.config.max_pairs):
            prefill_id = decision.target
            if decision.decode_target is None or prefill_id is None:
                if last is None:
                    raise RelayError(503, f"no prefill/decode pair ({decision.reason})", "no_decode_worker")
                break
            try:
                kv, self.prefill_usage = await self.prefill(prefill_id)
            except Retry as exc:
                self.stats.prefill_failures += 1
                last = exc
                self.bad_prefill.append(prefill_id)
            else:
                try:
                    return await self.decode(prefill_id, kv, decision.decode_target)
                except NewPair as exc:
                    self.stats.transfer_failures += 1
                    self.failed_transfers.append(f"{prefill_id} -> {exc.headers.get('x-mesh-worker')}")
                    last = exc
                    self.bad_prefill.append(prefill_id)
                    await self.cancel(prefill_id, kv)
                except (asyncio.CancelledError, RelayClosed):  # the client went away, or the shutdown
                    if not self.cancel_later(prefill_id, kv):  # do not wait on anything, unless no owner
                        await self.cancel(prefill_id, kv)
                    raise
                except BaseException:
                    await self.cancel(prefill_id, kv)
                    raise
            try:
                decision = self.decide(self.bad_prefill + self.bad_decode)
            except NoCandidate:
                break
        message = str(last)
        if isinstance(last, NewPair):  # every pair's transfer failed: name them all
            message = f"no transfer reached a decode worker ({', '.join(self.failed_transfers)}): {last}"
        if last is not None and last.body is not None and 400 <= last.status < 600:
            raise RelayError(last.status, message, last.code, last.body, last.headers)
        raise RelayError(502, f"disaggregated request failed: {message}", "upstream_error",
                         headers=last.headers if last is not None else None)

    # -- prefill --

    async def prefill(self, target_id: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """The prefill answer's ``kv_transfer_params`` (None: an engine without a KV connector,
        the decode side computes everything) and ``usage``."""
        self.check_open()
        lease = self.router.commit_prefill(self.info, target_id, self.now())
        resp, content = await self.send_prefill(target_id, prefill_body(self.body), lease, Retry)
        status = resp.status_code
        if status != 200:
            message = f"prefill worker {target_id} answered {status}"
            named = named_headers(resp, "x-mesh-prefill-worker", target_id)
            verdict = status_verdict(status)
            if verdict.retry:
                self.charge(target_id, verdict, message, self.prefill_suspects)
                raise Retry(message, status, content, headers=named)
            self.served(self.prefill_suspects)
            raise RelayError(status, message, error_code(content) or default_code(status), content, named)
        try:
            answer = json.loads(content)
            kv, usage = answer.get("kv_transfer_params"), answer.get("usage")
        except (ValueError, AttributeError) as exc:  # an empty 200 too: the proxy charges that at once
            message = f"prefill worker {target_id} answered 200 without a JSON object"
            self.health.record_failure(target_id, self.now(), message)
            raise Retry(message, headers={"x-mesh-prefill-worker": target_id}) from exc
        # Its 500s' suspects were theirs. Its own success waits for its transfer (``transfer_taken``).
        self.served(self.prefill_suspects)
        if not isinstance(kv, dict):
            self.stats.fallbacks += 1
            kv = None
        return kv, usage if isinstance(usage, dict) else None

    # -- decode --

    async def decode(self, prefill_id: str, kv: dict[str, Any] | None, first_choice: str) -> RelayResponse:
        body = decode_body(self.body, kv)
        choice: str | None = first_choice
        deadline = self.now() + self.config.queue_wait_s
        attempts = 0
        last: Retry | None = None
        while attempts < self.config.max_decode_attempts:
            if choice is None:
                choice = self.next_decode(prefill_id)
            if choice is None:  # every decode worker is full (or failed): wait for headroom
                if not self.full_decode:
                    break
                delay = min(self.config.retry_after_cap_s, deadline - self.now())
                if delay <= 0 or not await self.queue.wait(delay):
                    raise RelayError(429, "every decode worker is at its admission limit", "over_capacity",
                                     headers={"retry-after": "1"})
                self.full_decode.clear()
                continue
            decode_id, choice = choice, None
            try:
                return await self.try_decode(prefill_id, decode_id, kv, body)
            except Full:
                self.stats.decode_refusals += 1
                self.full_decode.append(decode_id)
            except NewPair:
                raise
            except Retry as exc:
                self.stats.decode_failures += 1
                attempts += 1
                last = exc
                self.bad_decode.append(decode_id)
        if last is not None:  # every decode worker failed: answer the last one's error
            raise RelayError(last.status, f"no decode worker could take the request: {last}", last.code, last.body,
                             last.headers)
        raise RelayError(503, "no decode worker can take the request", "no_decode_worker")

    def next_decode(self, prefill_id: str) -> str | None:
        """Another decode worker: the policy's decode profile alone when it has one (the prefill
        is done, so prefill availability must not matter), else a whole decision's decode side."""
        exclude = self.bad_decode + self.full_decode + self.foreign
        now = self.now()
        profiles = pd_profiles(self.router.policy)
        try:
            if profiles is not None:
                return str(profiles[1].run(self.info, self.router.view(now, exclude)).target)
            return self.decide(exclude).decode_target
        except NoCandidate:
            return None

    async def try_decode(self, prefill_id: str, decode_id: str, kv: dict[str, Any] | None,
                         body: dict[str, Any]) -> RelayResponse:
        """One decode attempt: the decode worker's answer, its first bytes in; else ``Retry``
        (``Full``: it refused admission; ``NewPair``: the transfer failed on the prefill side)."""
        blocks = len(kv.get("remote_block_keys") or kv.get("remote_block_ids") or []) if kv else 0
        self.check_decode_target(decode_id)
        self.check_open()
        lease = self.router.commit_decode(self.info, decode_id, blocks, self.now())
        deadline = asyncio.get_running_loop().time() + self.config.timeout_s
        resp: httpx.Response | None = None
        handed_over = False
        try:
            request = self.client.build_request("POST", self.url(decode_id), json=body, headers=self.headers,
                                                timeout=self.decode_timeout)
            try:
                async with self.legs.watch(decode_id, deadline) as leg:  # httpx's timeouts bound each read, not the whole
                    resp = await self.client.send(request, stream=True)
                    if resp.status_code != 200:
                        content = await read_bounded(resp)
                        self.classify(resp, content, prefill_id, decode_id)
                    chunks = resp.aiter_raw() if self.stream else None
                    first = await first_bytes(chunks) if chunks is not None else await read_bounded(resp)
            except (httpx.HTTPError, TooLarge) as exc:
                self.check_open()  # closed under it: not the worker's failure
                self.health.record_failure(decode_id, self.now(), f"decode failed: {exc!r}")  # the detail: /workers
                raise Retry(f"decode worker {decode_id} failed ({what_failed(exc)})") from exc
            except TimeoutError as exc:
                if leg.aborted:  # its health check failed meanwhile: health already took it out
                    raise Retry(f"decode worker {decode_id} turned unhealthy before it answered", 503,
                                code="upstream_error") from exc
                self.health.record_failure(decode_id, self.now(), "decode timed out")
                raise Retry(f"decode worker {decode_id} timed out after {self.config.timeout_s:g} s", 504,
                            code="upstream_timeout") from exc
            if not first:  # nothing to relay: the worker's failure at once, as the proxy has it
                self.check_open()
                message = f"decode worker {decode_id} " + ("closed the stream before any data" if self.stream
                                                           else "answered 200 with an empty body")
                self.health.record_failure(decode_id, self.now(), message)
                raise Retry(message, headers={"x-mesh-worker": decode_id})
            self.check_answer(decode_id, resp, first)
            out = self.hand_over(prefill_id, decode_id, kv, resp, first, chunks, lease, deadline)
            handed_over = True  # the response and the lease belong to the RelayResponse now
            return out
        finally:
            if not handed_over:
                lease.finish(self.now())
                if resp is not None:
                    await resp.aclose()

    def check_answer(self, decode_id: str, resp: httpx.Response, first: bytes) -> None:
        """A decode 200 that is not what was asked for (an event stream for a stream; else a JSON
        object, ``answer_problem``) is the worker's failure at once, retried: never relayed."""
        headers = [(k.lower(), v) for k, v in resp.headers.raw]
        if not self.stream:
            problem = answer_problem(headers, first, False)
        elif is_sse(headers) or b"json" in resp.headers.get("content-type", "").encode("latin-1").lower():
            problem = None  # an event stream; or a JSON answer, relayed as sent
        else:
            problem = "a body that is neither an event stream nor JSON"
        if problem is not None:
            self.check_open()
            message = f"decode worker {decode_id} answered 200 with {problem}"
            self.health.record_failure(decode_id, self.now(), message)
            raise Retry(message, headers={"x-mesh-worker": decode_id})

    def check_decode_target(self, decode_id: str) -> None:
        """The pair was chosen before the prefill: its decode worker may have been removed (or
        drained, or marked unhealthy) meanwhile, skipped like a failed one; or it may be at the
        gateway's own admission limit, skipped like a worker refusing admission."""
        state = self.router.targets.get(decode_id)
        if state is None or not state.available:
            raise Retry(f"decode worker {decode_id} was {'removed' if state is None else 'taken out of routing'}"
                        " during the prefill", 503, code="no_decode_worker")
        if state.at_admission_limit:
            raise Full(f"decode worker {decode_id} is at its in-flight limit ({state.max_in_flight})", 429,
                       code="over_capacity")

    def hand_over(self, prefill_id: str, decode_id: str, kv: dict[str, Any] | None, resp: httpx.Response,
                  first: bytes, chunks: Any, lease: Lease, deadline: float) -> RelayResponse:
        """The decode worker answers the request: count what that says of both workers, bind the
        session to it, and hand its response and the lease to a ``RelayResponse``."""
        self.served(self.decode_suspects)  # their 500s were theirs: this worker answers the request
        self.transfer_taken(prefill_id, decode_id, kv)
        if not self.stream:  # a stream is a success once it ended whole: its relayer says so
            self.health.record_success(decode_id)
        lease.first_token()
        self.router.decode_answered(lease, self.info.session_id, self.now())
        headers = [(k, v) for k, v in resp.headers.items() if k.lower() not in HOP_BY_HOP]
        headers += [("x-mesh-worker", decode_id), ("x-mesh-prefill-worker", prefill_id)]
        return RelayResponse(resp.status_code, headers, first, self.stream, prefill_id, decode_id, kv,
                             self.prefill_usage, resp, chunks, lease, self.now, deadline, self.client)

    async def send_prefill(self, target_id: str, body: dict[str, Any], lease: Lease,
                           retry: type[Retry]) -> tuple[httpx.Response, bytes]:
        """POST the prefill request and read its answer whole; ``lease`` ends either way. Raises
        ``retry`` when the worker failed (charged to its health) or turned unhealthy first."""
        try:
            request = self.client.build_request("POST", self.url(target_id), json=body, headers=self.headers,
                                                timeout=self.prefill_timeout)
            async with self.legs.watch(target_id, None):  # aborted if its worker turns unhealthy
                resp = await self.client.send(request, stream=True)
                try:
                    content = await read_bounded(resp)
                finally:
                    await resp.aclose()
        except TimeoutError as exc:  # only ``PendingLegs.abort`` ends it so: not charged, health did
            raise retry(f"prefill worker {target_id} turned unhealthy before it answered") from exc
        except (httpx.HTTPError, TooLarge) as exc:
            self.check_open()  # closed under it: not the worker's failure
            self.health.record_failure(target_id, self.now(), f"prefill failed: {exc!r}")  # the detail: /workers
            raise retry(f"prefill worker {target_id} failed ({what_failed(exc)})") from exc
        finally:
            lease.finish(self.now())
        return resp, content

    def check_open(self) -> None:
        """Raise ``RelayClosed`` once the relay's client is closed: before an attempt (a closed
        client raises RuntimeError on send), and when one broke (the close broke it)."""
        if self.client.is_closed:
            raise RelayClosed()

    def classify(self, resp: httpx.Response, content: bytes, prefill_id: str, decode_id: str) -> None:
        """Raise what a non-200 decode answer means for the relay, charging the worker as the
        proxy would (``status_verdict``) unless the answer names a transfer problem (``kv_*``):
        one of the prefill side's is charged to the prefill worker (``transfer_failed``)."""
        status, code = resp.status_code, error_code(content)
        message = f"decode worker {decode_id} answered {status}" + (f" ({code})" if code else "")
        named = named_headers(resp, "x-mesh-worker", decode_id)
        if status == 429 or (status == 503 and code in ADMISSION_CODES) or code in ADMISSION_CODES:
            raise Full(message, status, content, code or "over_capacity")
        if code in PREFILL_SIDE_CODES:
            code = code or "kv_transfer_failed"  # (it is one of them: for the type checker)
            self.transfer_failed(prefill_id, decode_id, code, message)
            raise NewPair(message, status, content, code, {**named, "x-mesh-prefill-worker": prefill_id})
        transfer = status >= 500 and code is not None and code.startswith("kv_")
        verdict = status_verdict(status)
        if verdict.retry and not transfer:
            self.charge(decode_id, verdict, message, self.decode_suspects)
        if verdict.retry or transfer or status in (409, 413):
            raise Retry(message, status, content, code or "upstream_error", named)
        self.served(self.decode_suspects)
        raise RelayError(status, message, code or default_code(status), content, named)

    def transfer_failed(self, prefill_id: str, decode_id: str, code: str, message: str) -> None:
        """A pull from ``prefill_id`` failed at ``decode_id``: charge the prefill worker for what is
        its fault (``TRANSFER_CHARGED`` at once, ``TRANSFER_SUSPECT`` once confirmed). Its answer
        was not counted a success, so one request counts once for it."""
        message = f"{message}: the transfer from {prefill_id} failed"
        if code in TRANSFER_CHARGED:
            self.health.record_failure(prefill_id, self.now(), message)
        elif code in TRANSFER_SUSPECT:
            self.transfer_suspects.append((prefill_id, decode_id, message))

    def transfer_taken(self, prefill_id: str, decode_id: str, kv: dict[str, Any] | None) -> None:
        """``decode_id`` answered with ``prefill_id``'s transfer (or, without params, after its
        prefill): the prefill answer is its worker's success now, and a failed pull into this same
        decode worker before it was that other prefill worker's (this decode worker and its
        network pull fine). Suspects of another decode worker are forgotten (maybe its network)."""
        if kv is not None:
            for suspect, decode, message in self.transfer_suspects:
                if decode == decode_id:
                    self.health.record_failure(suspect, self.now(), message)
        self.transfer_suspects.clear()
        self.health.record_success(prefill_id)

    def charge(self, target_id: str, verdict: StatusVerdict, message: str, suspects: list[tuple[str, str]]) -> None:
        """A worker's retryable answer, as the proxy charges it: at once, or as a suspect."""
        if verdict.charge:
            self.health.record_failure(target_id, self.now(), message)
        elif verdict.suspect:
            suspects.append((target_id, message))

    def served(self, suspects: list[tuple[str, str]]) -> None:
        """Another worker of the role answered the request: the 500s before it were those workers'."""
        for target_id, message in suspects:
            self.health.record_failure(target_id, self.now(), message)
        suspects.clear()

    # -- cleanup --

    def _release_url(self, prefill_id: str, kv: dict[str, Any] | None) -> str | None:
        if not kv or not kv.get("transfer_id") or prefill_id not in self.router.targets:
            return None  # not a bundled worker's transfer (vLLM's connectors time out by themselves)
        return self.router.targets[prefill_id].url.rstrip("/") + "/kv_transfer/release"

    async def cancel(self, prefill_id: str, kv: dict[str, Any] | None) -> None:
        """Release the transfer at its prefill worker (``release_transfer``), awaited."""
        url = self._release_url(prefill_id, kv)
        if url is None:
            return
        self.stats.cancels_sent += 1
        await release_transfer(url, kv["transfer_id"])  # type: ignore[index]

    def cancel_later(self, prefill_id: str, kv: dict[str, Any] | None) -> bool:
        """``cancel`` in the background, in the caller's ``Releases``; False when it gave none."""
        if self.releases is None:
            return False
        url = self._release_url(prefill_id, kv)
        if url is not None:
            self.stats.cancels_sent += 1
            self.releases.start(url, kv["transfer_id"])  # type: ignore[index]
        return True


async def relay_disaggregated(
    client: httpx.AsyncClient,
    router: Router,
    request_info: RequestInfo,
    body: bytes | Mapping[str, Any],
    decision: Decision,
    *,
    path: str = "/v1/completions",
    headers: Iterable[tuple[str, str]] | None = None,
    config: RelayConfig | None = None,
    queue: DecodeQueue | None = None,
    stats: RelayStats | None = None,
    now: Callable[[], float] = time.monotonic,
    request_id: str | None = None,
    health: WorkerHealth | None = None,
    releases: Releases | None = None,
    legs: PendingLegs | None = None,
    foreign: Iterable[str] = (),
) -> RelayResponse:
    """Serve one request through a (prefill, decode) pair (the module docstring, ``Relay``).

    ``decision`` comes from ``router.decide`` (it commits nothing); the relay commits a lease per
    attempt. Returns once the decode worker's first bytes are in (every retry happens before):
    stream ``RelayResponse.body()`` to the client and call ``aclose()`` in a ``finally``.
    Raises ``RelayError`` (status, OpenAI-shaped body, headers) when no pair could serve it.
    ``health``: told of failures and successes per worker as the proxy tells them; a streamed
    decode answer's success is told by its relayer once the stream ended whole (``DisaggProxy``).
    ``releases``: where transfer releases go in the background when the client went away or the
    relay's client was closed (the caller closes it at its shutdown); None: they are awaited.
    ``legs``: where the legs waiting for an answer are kept, for the caller to abort those of a
    worker that turns unhealthy (``PendingLegs.abort``: retried elsewhere); None: not abortable.
    ``foreign``: targets that speak another pair protocol (``disagg_protocol``): left out of every
    retry's pair (``decision`` has none of them).
    """
    data, rid, stats = relay_inputs(body, request_id, stats)
    relay = Relay(client, router, request_info, data, path, forward_headers(headers, rid), config or RelayConfig(),
                   queue if queue is not None else DecodeQueue(), stats, now, health or NoHealth(), releases, legs, foreign)
    return await relay.run(decision)
