"""The gateway's relay for a disaggregated request: prefill on one worker, decode on another,
one ordinary OpenAI response (streaming or not) to the client.

Flow (vLLM's ``kv_transfer_params`` convention, so it drives vLLM P/D deployments as well as the
bundled workers):

1. The decision names a pair: ``Decision.target`` (prefill) and ``Decision.decode_target``.
2. Prefill: the client's body with ``max_tokens: 1`` (and ``max_completion_tokens`` when given),
   ``stream: false``, no ``stream_options``/``min_tokens``, and ``kv_transfer_params:
   {do_remote_decode: true, ...}``. Its answer carries the ``kv_transfer_params`` the decode
   worker needs (where to pull from, which blocks).
3. Decode: the client's own body plus those ``kv_transfer_params``; its answer is the client's.
   Both requests carry the same ``X-Request-Id``.

Failures before the first byte reached the client are retried:
- the prefill fails (connect error, 429, 500/502/503/504, a 200 without a JSON object): another
  pair, that prefill worker excluded;
- the decode worker refuses admission (429, or 503 with a ``kv_*`` code), or is at the gateway's
  admission limit for it (``max_in_flight``, checked before committing): another decode worker;
  when every decode worker is full the request waits in a bounded queue (``DecodeQueue``: at most
  ``max_waiting`` requests, each at most ``queue_wait_s``) and tries again;
- the decode worker dies or cannot take the blocks (connect error, 500/502/503/504, a 5xx with a
  ``kv_*`` code, 409 layout/key mismatch, 413): another decode worker, with the same prefill (its
  blocks stay pinned there);
- the transfer itself fails (``kv_transfer_failed``/``_corrupt``/``_truncated``/``_gone``: the
  prefill side's): a new pair, that prefill worker excluded; when no pair is left, the last
  decode worker's error, naming that pair (``x-mesh-prefill-worker``, ``x-mesh-worker``);
- the decode worker answers 200 with nothing (a stream closed before any data, an empty body):
  another decode worker.
A 4xx that is the client's fault, or another 5xx (501, ...), is answered as is, with the worker's
name and its own ``retry-after`` (so is the last retryable answer when no retry is left).

Charged to a worker's passive health as the ordinary proxy charges (``mesh.gateway.proxy.status_verdict``,
one rule for both): connect errors, resets, timeouts, a 502/503/504 answer and a 200 with nothing
in it at once; a 500 only once another worker of the same role then answers the request (a
request that makes every worker answer 500 charges none); a 429 or an admission refusal never; an
answer as a success (a streamed decode answer once it ended whole: its relayer says so). A decode
5xx with a ``kv_*`` code is the transfer's, not the decode worker's. A failed transfer is charged
to its prefill worker when it is that worker's fault (``TRANSFER_CHARGED``, ``TRANSFER_SUSPECT``),
and a prefill answer is its worker's success only once the decode worker answered with its
transfer: so one request counts once for each worker (a success at the prefill's 200 reset the
failures of a worker whose transfers all fail).

Closed under it: a caller ends every relay in flight by closing the relay's client (the gateway's
shutdown timeout). Whatever breaks once the client is closed is the caller's doing: ``RelayClosed``
at once (503 ``shutting_down``), no retry, no worker charged; its transfer's release goes out in
the background (``Releases``), so a hung prefill worker cannot hold the client's answer.

Exactly once: every lease is finished exactly once (``try/finally``, ``RelayResponse.aclose``);
a transfer the relay gives up on (a new pair, an error answer, a client that went away, the
gateway's shutdown) is cancelled at its prefill worker (``POST /kv_transfer/release {cancel:
true}``, best effort: the prefill worker's deadline releases it otherwise): awaited before a new
pair or an error answer; in the background when the client went away or at shutdown, in the
caller's ``Releases`` (which ``close`` ends), or in line when the caller gives none. A decode
worker that imported the blocks releases them itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import httpx

from mesh.errors import openai_error_bytes, sse_error_event
from mesh.gateway.proxy import MAX_ANSWER_BYTES, SHUTDOWN_MESSAGE, StatusVerdict, status_verdict
from mesh.core.router import Lease, Router
from policies.base import Decision, NoCandidate, Overlap, RequestInfo, TargetState

log = logging.getLogger("mesh.gateway.disagg_relay")

HOP_BY_HOP = frozenset(
    "connection keep-alive proxy-authenticate proxy-authorization te trailer transfer-encoding upgrade host "
    "content-length content-encoding".split()
)
ADMISSION_CODES = frozenset({"kv_admission_full", "kv_no_space"})
PREFILL_SIDE_CODES = frozenset({"kv_transfer_failed", "kv_transfer_corrupt", "kv_transfer_truncated", "kv_transfer_gone"})
# Of those, what the prefill worker is charged for (``_Relay.transfer_failed``): bytes it sent that
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
RELEASE_TIMEOUT_S = 5.0  # one release request to a prefill worker, whole


@dataclass(frozen=True)
class RelayConfig:
    max_pairs: int = 3  # prefill attempts, each on another prefill worker
    max_decode_attempts: int = 4  # decode attempts per prefill (a full queue's retries not counted)
    queue_wait_s: float = 10.0  # longest a request waits for decode headroom
    retry_after_cap_s: float = 1.0  # longest single wait, whatever Retry-After says
    # Each upstream request, streaming included: a decode answer still being relayed this long
    # after its request was sent ends there (``RelayResponse.deadline``), whether the worker or
    # the client is the slow side.
    timeout_s: float = 600.0
    connect_timeout_s: float = 5.0


class DecodeQueue:
    """Requests waiting for decode headroom: bounded in number; each wait is bounded in time."""

    def __init__(self, max_waiting: int = 64) -> None:
        self.max_waiting = max_waiting
        self.waiting = 0
        self.peak = 0
        self.waits = 0  # waits that happened
        self.rejected = 0  # requests turned away because the queue was full

    async def wait(self, seconds: float) -> bool:
        """Sleep ``seconds`` holding a queue slot; False at once when the queue is full."""
        if self.waiting >= self.max_waiting:
            self.rejected += 1
            return False
        self.waiting += 1
        self.peak = max(self.peak, self.waiting)
        self.waits += 1
        try:
            await asyncio.sleep(seconds)
        finally:
            self.waiting -= 1
        return True


@dataclass
class RelayStats:
    requests: int = 0
    prefill_failures: int = 0
    decode_refusals: int = 0  # admission refusals (429/503 kv_*)
    decode_failures: int = 0  # decode worker died or could not take the blocks
    transfer_failures: int = 0  # the pull failed on the prefill side: new pair
    cancels_sent: int = 0
    fallbacks: int = 0  # prefill answered without kv_transfer_params: decode computed it all


class WorkerHealth(Protocol):
    """Where the relay reports what its attempts say about a worker (the registry's passive
    health: consecutive failures open a worker's circuit)."""

    def record_failure(self, tid: str, now: float, error: str) -> None: ...

    def record_success(self, tid: str) -> None: ...


class _NoHealth:
    def record_failure(self, tid: str, now: float, error: str) -> None:
        return None

    def record_success(self, tid: str) -> None:
        return None


class Releases:
    """Transfer releases sent in the background, owned by whoever runs relays (``DisaggProxy``):
    ``close`` (its shutdown) gives them ``grace_s``, then cancels the rest, so no task outlives
    the owner. A release is best effort: the prefill worker's deadline frees what it misses."""

    def __init__(self, timeout_s: float = RELEASE_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self.tasks: set[asyncio.Task[None]] = set()  # in flight; each removes itself when done
        self.closed = False
        self.dropped = 0  # asked for after ``close``: left to the prefill worker's deadline

    def start(self, url: str, transfer_id: str) -> None:
        if self.closed:
            self.dropped += 1
            return
        task = asyncio.get_running_loop().create_task(release_transfer(url, transfer_id, self.timeout_s))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def close(self, grace_s: float) -> None:
        """Wait up to ``grace_s`` for the releases in flight, then cancel (and await) the rest."""
        self.closed = True
        if not self.tasks:
            return
        _, pending = await asyncio.wait(set(self.tasks), timeout=grace_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


async def release_transfer(url: str, transfer_id: str, timeout_s: float = RELEASE_TIMEOUT_S) -> None:
    """Tell a prefill worker nobody will pull this transfer (``POST /kv_transfer/release {cancel:
    true}``), best effort. Its own client: the relay's may be closing."""
    with contextlib.suppress(Exception):
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            await client.post(url, json={"transfer_id": transfer_id, "cancel": True})


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


class _Retry(Exception):
    def __init__(self, message: str, status: int = 502, body: bytes | None = None, code: str = "upstream_error",
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.body, self.code = status, body, code
        self.headers = dict(headers or {})  # the answering worker's name, for the client if no retry is left


class _NewPair(_Retry):
    """The transfer failed on the prefill side: another pair, that prefill excluded."""


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

    async def aclose(self) -> None:
        """Close the upstream and finish the decode lease; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._resp.aclose()
        finally:
            self._lease.finish(self._now())


def prefill_body(body: Mapping[str, Any]) -> dict[str, Any]:
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
    out = dict(body)
    if kv is not None:
        out["kv_transfer_params"] = kv
    else:
        out.pop("kv_transfer_params", None)
    return out


def _forward_headers(headers: Iterable[tuple[str, str]] | None, request_id: str) -> dict[str, str]:
    out = {k: v for k, v in (headers or ()) if k.lower() not in HOP_BY_HOP and k.lower() != "x-request-id"}
    out["x-request-id"] = request_id
    out["content-type"] = "application/json"
    return out


def _error_code(body: bytes) -> str | None:
    try:
        err = json.loads(body).get("error")
        return str(err.get("code")) if isinstance(err, dict) and err.get("code") else None
    except (ValueError, AttributeError):
        return None


def _retry_after(resp: httpx.Response, cap: float) -> float:
    try:
        return max(0.01, min(cap, float(resp.headers.get("retry-after", "0.1"))))
    except ValueError:
        return min(cap, 0.1)


class _Relay:
    """One request's relay; all state of its attempts lives here."""

    def __init__(self, client: httpx.AsyncClient, router: Router, info: RequestInfo, body: dict[str, Any],
                 path: str, headers: dict[str, str], config: RelayConfig, queue: DecodeQueue,
                 stats: RelayStats, now: Callable[[], float], health: WorkerHealth,
                 releases: Releases | None = None) -> None:
        self.client, self.router, self.info, self.body = client, router, info, body
        self.health, self.releases = health, releases
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
        self.timeout = httpx.Timeout(config.timeout_s, connect=config.connect_timeout_s)
        self.bad_prefill: list[str] = []
        self.bad_decode: list[str] = []  # failed: excluded for the whole request
        self.full_decode: list[str] = []  # refused admission: excluded until the next wait
        self.prefill_usage: dict[str, Any] | None = None

    def url(self, target_id: str) -> str:
        return self.router.targets[target_id].url.rstrip("/") + self.path

    def decide(self, exclude: list[str]) -> Decision:
        return self.router.decide(self.info, self.now(), exclude=exclude + full_for_pairs(self.router.targets))

    async def run(self, decision: Decision) -> RelayResponse:
        last: _Retry | None = None
        for _ in range(self.config.max_pairs):
            prefill_id = decision.target
            if decision.decode_target is None or prefill_id is None:
                if last is None:
                    raise RelayError(503, f"no prefill/decode pair ({decision.reason})", "no_decode_worker")
                break
            try:
                kv, self.prefill_usage = await self.prefill(prefill_id)
            except _Retry as exc:
                self.stats.prefill_failures += 1
                last = exc
                self.bad_prefill.append(prefill_id)
            else:
                try:
                    return await self.decode(prefill_id, kv, decision.decode_target)
                except _NewPair as exc:
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
        if isinstance(last, _NewPair):  # every pair's transfer failed: name them all
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
        lease = self.router.commit(replace(self.info, session_id=None), Decision(target_id, "prefill"), self.now())
        try:
            request = self.client.build_request("POST", self.url(target_id), json=prefill_body(self.body),
                                                headers=self.headers, timeout=self.timeout)
            resp = await self.client.send(request, stream=True)
            try:
                content = await _read_bounded(resp)
            finally:
                await resp.aclose()
        except (httpx.HTTPError, _TooLarge) as exc:
            self.check_open()  # closed under it: not the worker's failure
            self.health.record_failure(target_id, self.now(), f"prefill failed: {exc!r}")
            raise _Retry(f"prefill worker {target_id} failed: {exc!r}") from exc
        finally:
            lease.finish(self.now())
        status = resp.status_code
        if status != 200:
            message = f"prefill worker {target_id} answered {status}"
            named = _named(resp, "x-mesh-prefill-worker", target_id)
            verdict = status_verdict(status)
            if verdict.retry:
                self.charge(target_id, verdict, message, self.prefill_suspects)
                raise _Retry(message, status, content, headers=named)
            self.served(self.prefill_suspects)
            raise RelayError(status, message, _error_code(content) or _default_code(status), content, named)
        try:
            answer = json.loads(content)
            kv, usage = answer.get("kv_transfer_params"), answer.get("usage")
        except (ValueError, AttributeError) as exc:  # an empty 200 too: the proxy charges that at once
            message = f"prefill worker {target_id} answered 200 without a JSON object"
            self.health.record_failure(target_id, self.now(), message)
            raise _Retry(message, headers={"x-mesh-prefill-worker": target_id}) from exc
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
        last: _Retry | None = None
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
            except _Full:
                self.stats.decode_refusals += 1
                self.full_decode.append(decode_id)
            except _NewPair:
                raise
            except _Retry as exc:
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
        exclude = self.bad_decode + self.full_decode
        now = self.now()
        profiles = getattr(self.router.policy, "pd", None)
        try:
            if profiles is not None:
                return str(profiles[1].run(self.info, self.router.view(now, exclude)).target)
            return self.decide(exclude).decode_target
        except NoCandidate:
            return None

    async def try_decode(self, prefill_id: str, decode_id: str, kv: dict[str, Any] | None,
                         body: dict[str, Any]) -> RelayResponse:
        blocks = len(kv.get("remote_block_keys") or kv.get("remote_block_ids") or []) if kv else 0
        # The pair was chosen before the prefill: its decode worker may have been removed (or
        # drained, or marked unhealthy) meanwhile. Skipped like a failed one: another takes it.
        state = self.router.targets.get(decode_id)
        if state is None or not state.available:
            raise _Retry(f"decode worker {decode_id} was {'removed' if state is None else 'taken out of routing'}"
                         " during the prefill", 503, code="no_decode_worker")
        if _at_limit(state):  # the gateway's own admission limit: like the worker refusing admission
            raise _Full(f"decode worker {decode_id} is at its in-flight limit ({state.max_in_flight})", 429,
                        code="over_capacity")
        # Committed without the session: a decode worker that refuses or fails must not take it
        # (each refusal moved it); it is bound to the worker whose answer the client gets.
        info = replace(self.info, session_id=None) if self.info.session_id else self.info
        self.check_open()
        lease = self.router.commit(info, Decision(decode_id, "decode", overlaps={decode_id: Overlap(blocks)}), self.now())
        deadline = asyncio.get_running_loop().time() + self.config.timeout_s
        resp: httpx.Response | None = None
        handed_over = False
        try:
            request = self.client.build_request("POST", self.url(decode_id), json=body, headers=self.headers,
                                                timeout=self.timeout)
            try:
                async with asyncio.timeout_at(deadline):  # httpx's timeouts bound each read, not the whole
                    resp = await self.client.send(request, stream=True)
                    if resp.status_code != 200:
                        content = await _read_bounded(resp)
                        self.classify(resp, content, prefill_id, decode_id)
                    chunks = resp.aiter_raw() if self.stream else None
                    first = await _first_bytes(chunks) if chunks is not None else await _read_bounded(resp)
            except (httpx.HTTPError, _TooLarge) as exc:
                self.check_open()  # closed under it: not the worker's failure
                self.health.record_failure(decode_id, self.now(), f"decode failed: {exc!r}")
                raise _Retry(f"decode worker {decode_id} failed: {exc!r}") from exc
            except TimeoutError as exc:
                self.health.record_failure(decode_id, self.now(), "decode timed out")
                raise _Retry(f"decode worker {decode_id} timed out after {self.config.timeout_s:g} s", 504,
                             code="upstream_timeout") from exc
            if not first:  # nothing to relay: the worker's failure at once, as the proxy has it
                self.check_open()
                message = f"decode worker {decode_id} " + ("closed the stream before any data" if self.stream
                                                           else "answered 200 with an empty body")
                self.health.record_failure(decode_id, self.now(), message)
                raise _Retry(message, headers={"x-mesh-worker": decode_id})
            self.served(self.decode_suspects)  # their 500s were theirs: this worker answers the request
            self.transfer_taken(prefill_id, decode_id, kv)
            if not self.stream:  # a stream is a success once it ended whole: its relayer says so
                self.health.record_success(decode_id)
            lease.first_token()
            if self.info.session_id:
                self.router.bind_session(self.info.session_id, decode_id, self.now())
                lease.on_end = self.session_request_ended  # the lease itself was committed without it
            headers = [(k, v) for k, v in resp.headers.items() if k.lower() not in HOP_BY_HOP]
            headers += [("x-mesh-worker", decode_id), ("x-mesh-prefill-worker", prefill_id)]
            out = RelayResponse(resp.status_code, headers, first, self.stream, prefill_id, decode_id, kv,
                                self.prefill_usage, resp, chunks, lease, self.now, deadline, self.client)
            handed_over = True  # the response and the lease belong to the RelayResponse now
            return out
        finally:
            if not handed_over:
                lease.finish(self.now())
                if resp is not None:
                    await resp.aclose()

    def check_open(self) -> None:
        """Raise ``RelayClosed`` once the relay's client is closed: before an attempt (a closed
        client raises RuntimeError on send), and when one broke (the close broke it)."""
        if self.client.is_closed:
            raise RelayClosed()

    def session_request_ended(self, lease: Lease, now: float) -> None:
        """Restart the session's idle time when the answer ends (a session is not idle while a
        request of it runs), unless its decode worker left the registry meanwhile."""
        touch = getattr(self.router.sessions, "touch", None)
        if touch is not None and self.info.session_id and self.router.targets.get(lease.target.id) is lease.target:
            touch(self.info.session_id, lease.target.id, now)

    def classify(self, resp: httpx.Response, content: bytes, prefill_id: str, decode_id: str) -> None:
        """Raise what a non-200 decode answer means for the relay, charging the worker as the
        proxy would (``status_verdict``) unless the answer names a transfer problem (``kv_*``):
        one of the prefill side's is charged to the prefill worker (``transfer_failed``)."""
        status, code = resp.status_code, _error_code(content)
        message = f"decode worker {decode_id} answered {status}" + (f" ({code})" if code else "")
        named = _named(resp, "x-mesh-worker", decode_id)
        if status == 429 or (status == 503 and code in ADMISSION_CODES) or code in ADMISSION_CODES:
            raise _Full(message, status, content, code or "over_capacity")
        if code in PREFILL_SIDE_CODES:
            code = code or "kv_transfer_failed"  # (it is one of them: for the type checker)
            self.transfer_failed(prefill_id, decode_id, code, message)
            raise _NewPair(message, status, content, code, {**named, "x-mesh-prefill-worker": prefill_id})
        transfer = status >= 500 and code is not None and code.startswith("kv_")
        verdict = status_verdict(status)
        if verdict.retry and not transfer:
            self.charge(decode_id, verdict, message, self.decode_suspects)
        if verdict.retry or transfer or status in (409, 413):
            raise _Retry(message, status, content, code or "upstream_error", named)
        self.served(self.decode_suspects)
        raise RelayError(status, message, code or _default_code(status), content, named)

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


def _at_limit(target: TargetState) -> bool:
    return bool(target.max_in_flight) and target.in_flight >= target.max_in_flight


def full_for_pairs(targets: Mapping[str, TargetState]) -> list[str]:
    """Targets a new pair must leave out: those at their admission limit (``max_in_flight``),
    except decode-role ones, which the relay checks itself (waiting in the decode queue)."""
    return [t.id for t in targets.values() if _at_limit(t) and getattr(t.role, "value", t.role) != "decode"]


def _named(resp: httpx.Response, header: str, target_id: str) -> dict[str, str]:
    """An error answer's headers for the client: the worker's name, and its own ``retry-after``."""
    out = {header: target_id}
    retry_after = resp.headers.get("retry-after")
    if retry_after is not None:
        out["retry-after"] = retry_after
    return out


def _default_code(status: int) -> str:
    return "upstream_error" if status >= 500 else "invalid_request"


class _Full(_Retry):
    """The decode worker refused admission (retryable: another worker, or later)."""


class _TooLarge(Exception):
    """A worker's answer over ``MAX_ANSWER_BYTES`` (the relay holds a non-streamed answer whole)."""


async def _read_bounded(resp: httpx.Response) -> bytes:
    """The whole body of a response sent with ``stream=True``, at most ``MAX_ANSWER_BYTES`` (the
    proxy's bound): a worker answering without end cannot grow the gateway's memory."""
    if resp.is_stream_consumed:  # a transport that hands over whole responses (httpx.MockTransport)
        if len(resp.content) > MAX_ANSWER_BYTES:
            raise _TooLarge(f"answered over {MAX_ANSWER_BYTES >> 20} MiB")
        return resp.content
    parts: list[bytes] = []
    size = 0
    async for chunk in resp.aiter_raw():
        size += len(chunk)
        if size > MAX_ANSWER_BYTES:
            raise _TooLarge(f"answered over {MAX_ANSWER_BYTES >> 20} MiB")
        parts.append(chunk)
    return b"".join(parts)


async def _first_bytes(chunks: AsyncIterator[bytes]) -> bytes:
    async for chunk in chunks:  # not closed on return: the caller goes on with the same iterator
        if chunk:
            return chunk
    return b""


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
) -> RelayResponse:
    """Serve one request through a (prefill, decode) pair; see the module docstring.

    ``decision`` comes from ``router.decide`` (it commits nothing); the relay commits a lease per
    attempt. Returns once the decode worker's first bytes are in (every retry happens before):
    stream ``RelayResponse.body()`` to the client and call ``aclose()`` in a ``finally``.
    Raises ``RelayError`` (status, OpenAI-shaped body, headers) when no pair could serve it.
    ``health``: told of failures and successes per worker as the proxy tells them (the module
    docstring). A streamed decode answer's success is not told here: whoever relays it tells it
    once the stream ended whole (``DisaggProxy``), since a success at its first bytes reset the
    failures of a worker that breaks every stream.
    ``releases``: where transfer releases go in the background when the client went away or the
    relay's client was closed (the caller closes it at its shutdown); None: they are awaited.
    """
    data = json.loads(body) if isinstance(body, (bytes, bytearray, str)) else dict(body)
    if not isinstance(data, dict):
        raise RelayError(400, "request body must be a JSON object", "invalid_request")
    rid = request_id or f"mesh-{uuid.uuid4().hex}"
    stats = stats if stats is not None else RelayStats()
    stats.requests += 1
    relay = _Relay(client, router, request_info, data, path, _forward_headers(headers, rid), config or RelayConfig(),
                   queue if queue is not None else DecodeQueue(), stats, now, health or _NoHealth(), releases)
    return await relay.run(decision)
