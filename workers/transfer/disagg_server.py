"""Prefill/decode disaggregation on the worker's HTTP server: an ASGI layer around the worker app
(``workers.server.app.create_app``) that leaves every other request untouched.

- Prefill: a completion or chat request whose body carries ``kv_transfer_params:
  {do_remote_decode: true}`` (vLLM's convention; the gateway sends ``max_tokens: 1``) runs as
  usual; its prompt blocks are pinned in the step that finishes it, handed to the
  ``TransferRegistry``, and the answer carries ``kv_transfer_params`` for the decode worker
  (``remote_host``/``remote_port``, ``transfer_id``, block keys, layout, transport).
- Decode: a request whose ``kv_transfer_params`` say ``do_remote_prefill: true`` is checked
  (layout, keys), admitted (bounded pending transfers: count and bytes, else 429 + Retry-After),
  pulls exactly the blocks its own prefix cache lacks, imports them (prefix cache + KV events),
  tells the prefill worker it is done, and then runs as an ordinary request whose prompt is
  cached. Its pins are dropped when the response ends (the sequence holds its own references).
- Hybrid models: the transfer also carries the recurrent state at the end of its last block (a
  pinned checkpoint on the prefill side). A decode worker without that checkpoint pulls it
  (``pull_state``) and files it as its own checkpoint, pinned like the blocks; the ordinary
  request then resumes from it (the engine copies it into the request's state slot).
- ``n`` > 1: the prefill computes the prompt's KV once (one sequence, one transfer, whatever
  ``n``); the decode side runs the ``n`` choices, each admitted on the transferred prompt.
- ``POST /kv_transfer/pull`` (streamed binary) and a raw TCP port serve the blocks; on one host
  the decode worker copies them GPU to GPU over CUDA IPC under a read lease instead
  (``workers.transfer.kv_ipc``), falling back to the TCP pull when that is not possible;
  ``POST /kv_transfer/release`` ends a consumer's (or the gateway's: ``cancel``) interest;
  ``GET /kv_transfer/status`` and ``/metrics`` (``mesh_worker_kv_transfer_*``) show counters.

Exactly-once: a prefill's pin passes to the registry (``take_export``) or is dropped
(``drop_export``) on every path; a decode's ``Hold`` and admission ``Ticket`` are released in
``finally`` blocks. ``leaked_blocks`` re-derives every block's reference count: on each
``/kv_transfer/status``, and on ``/metrics`` at most every ``LEAK_CHECK_EVERY_S``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from mesh.core.keys import block_keys, namespace_seed
from workers.engine.llm_engine import EngineDeadError
from workers.server.app import (
    APIError,
    CacheHints,
    ChatRequest,
    CompletionRequest,
    WorkerAPI,
    check_choices,
    error_body,
    field_errors,
    special_tokens,
)
from workers.transfer.auth import SECRET_ENV, SIGNATURE, sign, verify
from workers.transfer.disagg_config import TransferConfig, transfer_config
from workers.transfer.kv_ipc import PeerCaches, export_cache, lease_blocks
from workers.transfer.kv_layout import Layout, TransferError
from workers.transfer.kv_transfer import (
    Faults,
    PullRequest,
    TransferEngine,
    pull_blocks,
    pull_state,
    serve_pull,
    serve_tcp,
)
from workers.transfer.registry import Admission, Ticket, TransferRegistry

log = logging.getLogger(__name__)

DATA_PATHS = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}
LEAK_CHECK_EVERY_S = 30.0  # /metrics' leaked_blocks: at most one walk over every block this often


class ClientGone(Exception):
    pass


@dataclass
class Hold:
    """Decode-side pins of one request (its own cached prefix and what it imported)."""

    engine: TransferEngine
    block_ids: list[int] = field(default_factory=list)
    state_keys: list[int] = field(default_factory=list)  # hybrid models: pinned state checkpoints
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            if self.block_ids:
                self.engine.submit(self.engine.ops.unpin, tuple(self.block_ids))
            for key in self.state_keys:
                self.engine.submit(self.engine.ops.unpin_state, key)


@dataclass(frozen=True)
class Chain:
    """The transferred prefix of one decode request: its blocks' keys and tokens, in the
    namespace of ``seed`` (model and cache salt: the salt is announced with imported blocks)."""

    keys: list[int]
    blocks: list[list[int]]
    seed: int
    salt: str | None


@dataclass
class DecodeCounters:
    requests: int = 0
    blocks_pulled: int = 0
    blocks_local: int = 0  # found in this worker's own prefix cache: not pulled
    blocks_copied_ipc: int = 0  # of blocks_pulled: copied GPU to GPU from a same-host peer
    states_pulled: int = 0  # hybrid models: recurrent states pulled
    states_local: int = 0  # hybrid models: already checkpointed here, not pulled
    bytes_pulled: int = 0
    pull_retries: int = 0
    failures: dict[str, int] = field(default_factory=dict)  # error code -> count


class DisaggService:
    """The transfer state of one worker process (prefill registry, decode admission, faults)."""

    def __init__(self, engine: TransferEngine, api: WorkerAPI, config: TransferConfig) -> None:
        self.engine = engine
        self.api = api
        self.config = config
        self.layout = engine.layout
        self.engine_id = uuid.uuid4().hex
        self._leak: dict[str, int] | None = None  # the last leak check (``stats``) and when it ran
        self._leak_at = 0.0
        self.registry = TransferRegistry(self._unpin, config.ttl_s, self._unpin_state)
        # With a CPU offload tier the multi-connector rule is real: a prefill's transferred blocks
        # are also saved to the CPU tier, and freed only when the decode pull AND that save are done.
        self.cpu_offload = engine.engine.block_manager.cpu is not None
        self.consumers = tuple(dict.fromkeys(config.consumers + (("cpu_save",) if self.cpu_offload else ())))
        self.cpu_saves: dict[str, int] = {"ok": 0, "partial": 0, "failed": 0}
        kv_bytes = engine.engine.runner.num_blocks * self.layout.block_bytes
        self.admission = Admission(config.max_pending, config.max_pending_bytes or max(kv_bytes // 2, 1))
        self.faults = Faults()
        if config.secret is None and config.role != "mixed":
            log.warning("%s is not set: this worker trusts kv_transfer_params from any client that reaches it "
                        "(keep it on a private network) and copies no KV over CUDA IPC", SECRET_ENV)
        self.ipc_export = self._export_cache() if config.ipc and config.transport == "tcp" else None
        self.peers = PeerCaches()
        self.decode = DecodeCounters()
        self.prefills = 0
        self.http: Any = None
        self.tcp: asyncio.AbstractServer | None = None
        self.tcp_port = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._reaper: asyncio.Task[None] | None = None

    def _export_cache(self) -> dict[str, Any] | None:
        try:
            return export_cache(self.engine.engine.runner.kv_cache)
        except Exception as exc:  # e.g. an allocator without IPC support: TCP pulls only
            log.warning("KV cache cannot be exported over CUDA IPC (%r): peers pull over TCP", exc)
            return None

    def _unpin(self, block_ids: tuple[int, ...]) -> None:
        if block_ids:
            self.engine.submit(self.engine.ops.unpin, block_ids)

    def _unpin_state(self, key: int) -> None:
        self.engine.submit(self.engine.ops.unpin_state, key)

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        import httpx

        self.http = httpx.AsyncClient(timeout=httpx.Timeout(self.config.pull_timeout_s, connect=5.0))
        if self.config.transport == "tcp":
            self.tcp = await serve_tcp(self.engine, self.registry, self.faults, self.config.bind_host,
                                       self.config.tcp_port, self.config.chunk_bytes, self.config.pull_timeout_s)
            self.tcp_port = int(self.tcp.sockets[0].getsockname()[1])
        self._reaper = asyncio.create_task(self._reap())

    async def stop(self) -> None:
        for task in [self._reaper, *self._tasks]:
            if task is not None:
                task.cancel()
        if self.tcp is not None:
            self.tcp.close()
        if self.http is not None:
            await self.http.aclose()

    async def _reap(self) -> None:
        while True:
            nxt = self.registry.next_deadline()
            now = time.monotonic()
            await asyncio.sleep(min(1.0, max(0.05, (nxt - now) if nxt else 1.0)))
            self.registry.expire(time.monotonic())

    def _background(self, work: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- requests ------------------------------------------------------------------------------

    def parse(self, kind: str, body: dict[str, Any]) -> tuple[Any, list[int]]:
        """The request model and its single prompt's token ids (400 on anything else)."""
        try:
            req = (ChatRequest if kind == "chat" else CompletionRequest).model_validate(body)
        except ValidationError as exc:  # named as the ordinary routes name it
            raise APIError(400, *field_errors(exc.errors())) from exc
        self.api.check_model(req.model)
        if kind == "chat":
            ids = self.api.chat_prompt(req.messages, body)
        else:
            prompts = self.api.completion_prompts(req.prompt, special_tokens(body, default=True))
            if len(prompts) != 1:
                raise APIError(400, "disaggregated requests take exactly one prompt", "prompt")
            ids = prompts[0]
        return req, ids

    async def prefill(self, kind: str, body: dict[str, Any], scope: Any, receive: Any) -> dict[str, Any]:
        req, ids = self.parse(kind, body)
        if getattr(req, "stream", False):
            raise APIError(400, "a prefill with do_remote_decode must not stream", "stream")
        check_choices(req, 1)  # the choices are the decode side's; this one sequence serves them all
        max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens
        params = self.api.params(req, max_tokens if max_tokens is not None else 1, len(ids))
        self.api.validate(ids, params, "messages" if kind == "chat" else "prompt")
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        self.engine.expect_export(rid, ids, req.cache_salt)
        try:
            text, reason, out = await _watch(receive, self.api.collect(rid, ids, params, CacheHints(req.cache_salt), stops))
            pinned, _ = self.engine.take_export(rid)  # ownership passes here, no await in between
        except BaseException:
            self.engine.drop_export(rid)
            raise
        tid: str | None = None
        keys: tuple[int, ...] = ()
        if pinned is not None and pinned.block_ids:
            tid = uuid.uuid4().hex
            self.registry.add(tid, pinned.block_ids, pinned.keys, self.consumers, time.monotonic(),
                              state_key=pinned.state_key)
            keys = pinned.keys
            if self.cpu_offload:
                self._start_cpu_save(tid, pinned.block_ids, pinned.keys)
        self.prefills += 1
        host = self.config.advertise_host or (scope.get("server") or ("127.0.0.1", 0))[0]
        kv = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_host": host,
            "remote_port": int((scope.get("server") or ("", 0))[1]),
            "remote_request_id": rid,
            "remote_block_ids": list(pinned.block_ids) if pinned else [],
            "remote_block_keys": [f"{k:016x}" for k in keys],
            "transfer_id": tid,
            "layout": self.layout.to_dict(),
            "transport": self.config.transport,
            "remote_tcp_port": self.tcp_port or None,
            "expires_in_s": self.config.ttl_s,
        }
        if self.ipc_export is not None:
            kv["ipc"] = self.ipc_export
        if self.config.secret is not None:
            kv[SIGNATURE] = sign(kv, self.config.secret)
        created = int(time.time())
        usage = {"prompt_tokens": out.num_prompt_tokens, "completion_tokens": out.num_output_tokens,
                 "total_tokens": out.num_prompt_tokens + out.num_output_tokens,
                 "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}
        if kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
            obj = "text_completion"
        return {"id": rid, "object": obj, "created": created, "model": self.api.model_name, "choices": [choice],
                "usage": usage, "kv_transfer_params": kv}

    def _start_cpu_save(self, tid: str, block_ids: tuple[int, ...], keys: tuple[int, ...]) -> None:
        """The ``cpu_save`` consumer: queued on the engine thread now (so it runs before any
        later unpin of these blocks, which goes through the same FIFO), reported to the registry
        on this loop when the copies are done, whatever the outcome (exactly once per transfer:
        a report after a cancel or the deadline counts as a duplicate)."""
        loop = asyncio.get_running_loop()

        def save() -> None:  # engine thread
            try:  # "partial": the CPU tier had no room for some (every block pinned by restores)
                outcome = "ok" if self.engine.ops.save_to_cpu(block_ids, keys) == len(block_ids) else "partial"
            except Exception:  # the transfer must still be released
                log.exception("CPU save of transfer %s failed", tid)
                outcome = "failed"
            try:
                loop.call_soon_threadsafe(self._report_cpu_save, loop, tid, outcome)
            except RuntimeError:  # the loop is closed: the process is going away
                pass

        self.engine.submit(save)

    def _report_cpu_save(self, loop: asyncio.AbstractEventLoop, tid: str, outcome: str) -> None:
        if self.faults.cpu_save_hold:  # tests only: report once the fault is lifted
            loop.call_later(0.05, self._report_cpu_save, loop, tid, outcome)
            return
        self._cpu_saved(tid, outcome)

    def _cpu_saved(self, tid: str, outcome: str) -> None:
        self.cpu_saves[outcome] += 1
        self.registry.consumer_done(tid, "cpu_save", outcome)

    async def receive_kv(self, kind: str, body: dict[str, Any]) -> Hold:
        """Decode side: hold (pinned) the whole transferred prefix of this request's prompt,
        pulling what is not cached here. Raises ``TransferError`` or ``APIError``."""
        params = body.get("kv_transfer_params")
        if not isinstance(params, dict):
            raise TransferError(400, "kv_params_invalid", "kv_transfer_params must be an object")
        if self.config.secret is not None and not verify(params, self.config.secret):
            raise TransferError(403, "kv_params_forged", "kv_transfer_params are not signed by a prefill worker "
                                "of this deployment (MESH_KV_TRANSFER_SECRET)")
        req, ids = self.parse(kind, body)
        self.decode.requests += 1
        remote = Layout.from_dict(params.get("layout"))
        mismatch = self.layout.mismatch(remote)
        if mismatch:
            raise TransferError(409, "kv_layout_mismatch", f"KV layout mismatch with the prefill worker: {mismatch}")
        try:
            remote_keys = [int(k, 16) for k in params.get("remote_block_keys") or []]
        except (TypeError, ValueError) as exc:
            raise TransferError(400, "kv_params_invalid", f"bad remote_block_keys: {exc}") from exc
        bs = self.layout.block_size
        n = len(remote_keys)
        if n > (len(ids) - 1) // bs:
            raise TransferError(409, "kv_key_mismatch", f"{n} blocks offered for a {len(ids)}-token prompt")
        seed = namespace_seed(self.engine.engine.model_name, None, req.cache_salt)
        tokens = ids[: n * bs]
        keys = block_keys(tokens, bs, seed)
        if keys != remote_keys:
            raise TransferError(409, "kv_key_mismatch", "the prefill worker's block keys differ from this "
                                "worker's (another model name, tokenizer or cache salt)")
        if n:
            _check_peer(params)  # before any pull or release reads them
        chain = Chain(keys, [tokens[i * bs : (i + 1) * bs] for i in range(n)], seed, req.cache_salt)
        hold = Hold(self.engine)
        try:
            own = await self.engine.call(self.engine.ops.pin_prefix, keys, chain.blocks, seed)
            hold.block_ids += own.block_ids
            h = len(own.block_ids)
            self.decode.blocks_local += h
            need_state = await self._hold_local_state(chain, hold)
            if h < n or need_state:
                await self._pull(params, chain, h, hold, need_state)
        except BaseException:
            hold.release()
            raise
        if n:
            self._background(self._release_remote(params, "decode", "ok"))
        return hold

    async def _hold_local_state(self, chain: Chain, hold: Hold) -> bool:
        """Hybrid models: pin this worker's own checkpoint at the end of the chain if it has one;
        True when the state must be pulled."""
        if self.layout.state is None or not chain.keys:
            return False
        key = chain.keys[-1]
        if await self.engine.call(self.engine.ops.pin_state, key):
            hold.state_keys.append(key)
            self.decode.states_local += 1
            return False
        return True

    async def _pull(self, params: dict[str, Any], chain: Chain, h: int, hold: Hold, need_state: bool = False) -> None:
        n = len(chain.keys)
        nbytes = (n - h) * self.layout.block_bytes + (self.layout.state_bytes if need_state else 0)
        if self.admission.too_large(nbytes):
            raise TransferError(413, "kv_transfer_too_large",
                                f"{nbytes} bytes of KV exceed this worker's inbound bound {self.admission.max_bytes}")
        ticket: Ticket | None = self.admission.try_admit(nbytes)
        if ticket is None:
            raise TransferError(429, "kv_admission_full", "too many pending inbound KV transfers; retry later", True)
        try:
            if h < n:
                await self._pull_blocks(params, chain, h, hold)
            if need_state:  # after its block: a checkpoint is filed only under a cached block
                await self._pull_state(params, chain, hold)
        finally:
            ticket.release()

    async def _pull_blocks(self, params: dict[str, Any], chain: Chain, h: int, hold: Hold) -> None:
        peer_kv = self._peer_cache(params)
        if peer_kv is not None:
            try:
                await self._copy_from_peer(params, peer_kv, chain, h, hold)
                return
            except (TransferError, RuntimeError) as exc:  # the network path still works
                if isinstance(exc, TransferError) and not exc.retryable:
                    raise
                self._count(exc.code if isinstance(exc, TransferError) else "kv_ipc_failed")
                log.warning("peer copy of %s failed (%r): pulling the rest over the network",
                            params.get("transfer_id"), exc)
        # invariant: hold.block_ids are exactly the chain's first len(hold.block_ids) blocks
        await self._pull_over_network(params, chain, len(hold.block_ids), hold)

    async def _pull_state(self, params: dict[str, Any], chain: Chain, hold: Hold) -> None:
        """The recurrent state at the end of the chain, pulled over the network (also after a
        peer copy of the blocks) and filed as this worker's checkpoint, pinned in ``hold``."""
        i = len(chain.keys) - 1
        for attempt in range(self.config.pull_attempts):
            try:
                data = await pull_state(params, chain.keys[i], self.layout, http=self.http,
                                        timeout=self.config.pull_timeout_s)
                await settled(self.engine, hold.state_keys.append, self.engine.ops.import_state, chain.keys[i],
                              chain.keys[i - 1] if i else None, chain.blocks[i], i, chain.salt, data)
                self.decode.states_pulled += 1
                self.decode.bytes_pulled += data.nbytes
                return
            except TransferError as exc:
                self._retry_or_raise(exc, attempt, params, "retrying")

    def _peer_cache(self, params: dict[str, Any]) -> Any:
        """The prefill worker's KV cache mapped over CUDA IPC, or None (use the network). Only
        signed parameters may name an allocation to map (``workers.transfer.auth``)."""
        export = params.get("ipc")
        kv = self.engine.engine.runner.kv_cache
        if not self.config.ipc or self.config.secret is None or not self.peers.usable(export, kv.device):
            return None
        return self.peers.open(export, kv)

    async def _copy_from_peer(self, params: dict[str, Any], peer_kv: Any, chain: Chain, h: int, hold: Hold) -> None:
        keys = chain.keys
        per_call = max(1, self.config.ipc_chunk_bytes // self.layout.block_bytes)
        async with lease_blocks(params, h, keys[h:], self.layout, self.config.pull_timeout_s,
                                num_peer_blocks=int(peer_kv.shape[2])) as lease:
            for i in range(h, len(keys), per_call):
                j = min(i + per_call, len(keys))
                parent = keys[i - 1] if i else None
                await settled_import(self.engine, hold, self.engine.ops.import_from_peer, keys[i:j], chain.blocks[i:j],
                                     chain.seed, parent, peer_kv, lease.block_ids[i - h : j - h], chain.salt,
                                     lease.deadline)
                self.decode.blocks_pulled += j - i
                self.decode.blocks_copied_ipc += j - i
                self.decode.bytes_pulled += (j - i) * self.layout.block_bytes

    async def _pull_over_network(self, params: dict[str, Any], chain: Chain, h: int, hold: Hold) -> None:
        keys, done = chain.keys, h
        for attempt in range(self.config.pull_attempts):
            try:
                async for _, ks, data in pull_blocks(params, done, keys[done:], self.layout, http=self.http,
                                                     timeout=self.config.pull_timeout_s,
                                                     chunk_bytes=self.config.chunk_bytes):
                    parent = keys[done - 1] if done else None
                    await settled_import(self.engine, hold, self.engine.ops.import_blocks, ks,
                                         chain.blocks[done : done + len(ks)], chain.seed, parent, data, chain.salt)
                    done += len(ks)
                    self.decode.blocks_pulled += len(ks)
                    self.decode.bytes_pulled += data.nbytes
                return
            except TransferError as exc:
                self._retry_or_raise(exc, attempt, params, f"resuming at block {done}")

    def _retry_or_raise(self, exc: TransferError, attempt: int, params: dict[str, Any], then: str) -> None:
        """A failed pull: re-raised when it is not retryable or the attempts are spent, else
        counted and logged (``then``: what the next attempt does)."""
        if not exc.retryable or attempt + 1 >= self.config.pull_attempts:
            raise exc
        self.decode.pull_retries += 1
        self._count(exc.code)
        log.warning("pull of %s failed (%s), %s", params.get("transfer_id"), exc, then)

    def _count(self, code: str) -> None:
        self.decode.failures[code] = self.decode.failures.get(code, 0) + 1

    async def _release_remote(self, params: dict[str, Any], consumer: str, outcome: str) -> None:
        url = f"http://{params['remote_host']}:{int(params['remote_port'])}/kv_transfer/release"
        body = {"transfer_id": params.get("transfer_id"), "consumer": consumer, "outcome": outcome}
        try:
            await self.http.post(url, json=body, timeout=5.0)
        except Exception as exc:  # the prefill side's deadline releases it anyway
            log.warning("release of transfer %s at %s failed: %r", params.get("transfer_id"), url, exc)

    # ---- metrics -------------------------------------------------------------------------------

    async def stats(self, fresh_leak_check: bool = True) -> dict[str, float]:
        """Counters for ``/kv_transfer/status`` (``fresh_leak_check``: re-derive every block's
        reference count now) and ``/metrics`` (the last check, redone at most every
        ``LEAK_CHECK_EVERY_S``: it walks every block on the engine thread, ~0.1 s for the
        650k blocks of a 0.5B model on an H200, and the gateway scrapes ``/metrics`` every round)."""
        now = time.monotonic()
        if fresh_leak_check or self._leak is None or now - self._leak_at >= LEAK_CHECK_EVERY_S:
            self._leak = await self.engine.call(self.engine.ops.leak_check)
            self._leak_at = now
        leak = self._leak
        owned = self.registry.pinned_blocks
        d = self.decode
        out: dict[str, float] = {
            **self.registry.stats(),
            **self.admission.stats(),
            "leaked_blocks": leak["leaked_blocks"],
            "pinned_blocks": leak["pinned_blocks"],
            "pinned_states": leak["pinned_states"],
            "prefills": self.prefills,
            "decode_requests": d.requests,
            "decode_blocks_pulled": d.blocks_pulled,
            "decode_blocks_local": d.blocks_local,
            "decode_blocks_copied_ipc": d.blocks_copied_ipc,
            "decode_states_pulled": d.states_pulled,
            "decode_states_local": d.states_local,
            "decode_bytes_pulled": d.bytes_pulled,
            "decode_pull_retries": d.pull_retries,
            "blocks_imported": self.engine.ops.num_imported,
            "blocks_import_reused": self.engine.ops.num_import_reused,
            "states_imported": self.engine.ops.num_states_imported,
            "states_import_reused": self.engine.ops.num_states_reused,
            "cpu_saves_ok": self.cpu_saves["ok"],
            "cpu_saves_partial": self.cpu_saves["partial"],
            "cpu_saves_failed": self.cpu_saves["failed"],
        }
        out["prefill_owned_blocks"] = owned
        return out

    def metrics_text(self, stats: dict[str, float]) -> bytes:
        """Prometheus text: ``mesh_worker_kv_transfer_<name>`` (counters end in ``_total``)."""
        lines = []
        for key, value in stats.items():
            counter = key in _COUNTERS
            name = f"mesh_worker_kv_transfer_{key}" + ("_total" if counter and not key.endswith("_total") else "")
            lines += [f"# TYPE {name} {'counter' if counter else 'gauge'}", f"{name} {float(value)}"]
        lines.append("# TYPE mesh_worker_kv_transfer_decode_failures_total counter")
        for code, count in sorted(self.decode.failures.items()):
            lines.append(f'mesh_worker_kv_transfer_decode_failures_total{{code="{code}"}} {float(count)}')
        return ("\n".join(lines) + "\n").encode()


_COUNTERS = frozenset({
    "transfers_created", "transfer_pinned_blocks_total", "transfers_released_by_consumer",
    "transfers_released_by_timeout", "transfers_released_by_cancel", "transfer_duplicate_releases",
    "transfer_late_pulls", "admission_admitted", "admission_refused", "prefills", "decode_requests",
    "decode_blocks_pulled", "decode_blocks_local", "decode_blocks_copied_ipc", "decode_bytes_pulled", "decode_pull_retries",
    "decode_states_pulled", "decode_states_local", "blocks_imported", "blocks_import_reused", "states_imported",
    "states_import_reused", "cpu_saves_ok", "cpu_saves_partial", "cpu_saves_failed",
})


async def settled_import(engine: TransferEngine, hold: Hold, fn: Any, *args: Any) -> None:
    """``settled`` for a block import: its pinned block ids join ``hold``."""
    await settled(engine, hold.block_ids.extend, fn, *args)


async def settled(engine: TransferEngine, keep: Callable[[Any], None], fn: Any, *args: Any) -> None:
    """Run an import on the engine thread; its result (what it pinned) goes to ``keep`` even when
    the calling task is cancelled meanwhile (the import may already be running there). Every
    cancel, however many, waits for the import to end, so no pin leaks and a peer copy never
    outlives its read lease; the cancel is then re-raised."""
    call = asyncio.ensure_future(engine.call(fn, *args))
    cancelled = False
    while not call.done():
        try:
            await asyncio.shield(call)
        except asyncio.CancelledError:
            cancelled = True
        except Exception:  # noqa: BLE001 (re-raised below)
            break
    if not call.cancelled() and call.exception() is None:
        keep(call.result())
    if cancelled:
        raise asyncio.CancelledError
    call.result()  # the import's own error


# ---- the ASGI layer ------------------------------------------------------------------------------


async def _watch(receive: Any, work: Awaitable[Any]) -> Any:
    """Await ``work``; cancel it (aborting what it started) if the client disconnects."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


def _error(status: int, message: str, code: str | None = None, headers: dict[str, str] | None = None,
           param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


class DisaggApp:
    """The worker app with disaggregation in front (see the module docstring)."""

    def __init__(self, app: Any, service: DisaggService) -> None:
        self.app = app
        self.service = service

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, method = scope["path"], scope["method"]
        if method == "POST" and path in DATA_PATHS:
            await self._data(scope, receive, send, DATA_PATHS[path])
        elif path.startswith("/kv_transfer/"):
            await self._transfer_route(scope, receive, send, path, method)
        elif path == "/metrics" and method == "GET":
            await self._metrics(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _lifespan(self, scope: Any, receive: Any, send: Any) -> None:
        service = self.service

        async def wrapped_send(message: Any) -> None:
            if message["type"] == "lifespan.startup.complete":
                await service.start()
            await send(message)

        async def wrapped_receive() -> Any:
            message = await receive()
            if message["type"] == "lifespan.shutdown":
                await service.stop()
            return message

        await self.app(scope, wrapped_receive, wrapped_send)

    async def _data(self, scope: Any, receive: Any, send: Any, kind: str) -> None:
        raw, more = await _read_body(receive)
        replay = _replaying(raw, receive, more)
        if more or b"kv_transfer_params" not in raw:
            await self.app(scope, replay, send)
            return
        try:
            body = json.loads(raw)
        except ValueError:
            await self.app(scope, replay, send)  # the worker answers its own 400
            return
        params = body.get("kv_transfer_params") if isinstance(body, dict) else None
        if not isinstance(params, dict):
            await self.app(scope, replay, send)
            return
        if params.get("do_remote_decode"):
            response = await self._respond(self.service.prefill(kind, body, scope, receive))
        elif params.get("do_remote_prefill"):
            await self._decode(scope, receive, send, kind, body, raw)
            return
        else:
            await self.app(scope, replay, send)
            return
        if response is not None:
            await response(scope, receive, send)

    async def _respond(self, work: Awaitable[dict[str, Any]]) -> Response | None:
        try:
            return JSONResponse(await work)
        except ClientGone:
            return None
        except APIError as exc:
            return _error(exc.status, exc.message, exc.code, param=exc.param)
        except EngineDeadError as exc:
            return _error(503, str(exc))

    async def _decode(self, scope: Any, receive: Any, send: Any, kind: str, body: dict[str, Any], raw: bytes) -> None:
        service = self.service
        try:
            hold = await _watch(receive, service.receive_kv(kind, body))
        except ClientGone:
            return
        except TransferError as exc:
            service._count(exc.code)
            headers = {"retry-after": str(service.config.retry_after_s)} if exc.status in (429, 503) else None
            await _error(exc.status, exc.message, exc.code, headers)(scope, receive, send)
            return
        except APIError as exc:
            await _error(exc.status, exc.message, exc.code, param=exc.param)(scope, receive, send)
            return
        except EngineDeadError as exc:
            await _error(503, str(exc))(scope, receive, send)
            return
        try:
            await self.app(scope, _replaying(raw, receive), send)  # an ordinary, now cached, request
        finally:
            hold.release()

    async def _transfer_route(self, scope: Any, receive: Any, send: Any, path: str, method: str) -> None:
        service = self.service
        if path == "/kv_transfer/status" and method == "GET":
            response: Response = JSONResponse({"role": service.config.role, "engine_id": service.engine_id,
                                               "layout": service.layout.to_dict(), "transport": service.config.transport,
                                               "tcp_port": service.tcp_port, "consumers": list(service.consumers),
                                               **(await service.stats())})
        elif path == "/kv_transfer/transfers" and method == "GET":
            response = JSONResponse({"transfers": service.registry.describe(time.monotonic())})
        elif method != "POST":
            response = _error(405, "method not allowed")
        else:
            raw, _ = await _read_body(receive)
            try:
                body = json.loads(raw or b"{}")
            except ValueError:
                body = None
            if not isinstance(body, dict):
                response = _error(400, "body must be a JSON object")
            elif path == "/kv_transfer/pull":
                response = self._pull_response(body)
            elif path == "/kv_transfer/release":
                response = self._release(body)
            elif path == "/kv_transfer/faults" and service.config.faults:
                for k, v in body.items():
                    if hasattr(service.faults, k):
                        setattr(service.faults, k, v)
                response = JSONResponse({"faults": vars(service.faults)})
            else:
                response = _error(404, f"no route {path}")
        await response(scope, receive, send)

    def _pull_response(self, body: dict[str, Any]) -> Response:
        service = self.service
        try:
            req = PullRequest.parse(body)
        except TransferError as exc:
            return _error(exc.status, exc.message, exc.code)
        mismatch = service.layout.mismatch(req.layout)
        if mismatch:
            return _error(409, f"KV layout mismatch: {mismatch}", "kv_layout_mismatch")
        frames = serve_pull(service.engine, service.registry, req, service.faults, service.config.chunk_bytes)
        return StreamingResponse(frames, media_type="application/octet-stream")

    def _release(self, body: dict[str, Any]) -> Response:
        registry = self.service.registry
        tid = str(body.get("transfer_id"))
        if body.get("cancel"):
            released = registry.cancel(tid)
        else:
            released = registry.consumer_done(tid, str(body.get("consumer", "decode")), str(body.get("outcome", "ok")))
        return JSONResponse({"transfer_id": tid, "released": released})

    async def _metrics(self, scope: Any, receive: Any, send: Any) -> None:
        parts: list[bytes] = []
        start: dict[str, Any] = {}

        async def capture(message: Any) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
            elif message["type"] == "http.response.body":
                parts.append(message.get("body", b""))

        await self.app(scope, receive, capture)
        try:
            extra = self.service.metrics_text(await self.service.stats(fresh_leak_check=False))
        except (EngineDeadError, asyncio.TimeoutError):
            extra = b""
        body = b"".join(parts) + extra
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": start.get("status", 200), "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _is_port(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value < 65536


def _check_peer(params: dict[str, Any]) -> None:
    """The prefill worker's address and transfer id, as a pull and a release read them: a malformed
    one is a 400 here (it was a bare 500 from deep in the pull, or a crashed release task)."""
    tcp_port = params.get("remote_tcp_port")
    if not isinstance(params.get("remote_host"), str) or not params["remote_host"]:
        raise TransferError(400, "kv_params_invalid", "remote_host must be a non-empty string")
    if not _is_port(params.get("remote_port")) or (tcp_port is not None and not _is_port(tcp_port)):
        raise TransferError(400, "kv_params_invalid", "remote_port and remote_tcp_port must be ports (1-65535)")
    if not isinstance(params.get("transfer_id"), str):
        raise TransferError(400, "kv_params_invalid", "transfer_id must be a string")


async def _read_body(receive: Any, limit: int = 64 << 20) -> tuple[bytes, bool]:
    """The request body (True when it was larger than ``limit`` and only a prefix was read)."""
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(parts), False
        chunk = message.get("body", b"")
        parts.append(chunk)
        size += len(chunk)
        if not message.get("more_body"):
            return b"".join(parts), False
        if size > limit:
            return b"".join(parts), True


def _replaying(raw: bytes, receive: Any, more: bool = False) -> Any:
    """A ``receive`` that yields the already-read body once (``more``: only its first part was
    read, the rest is still the client's), then the client's own messages."""
    sent = False

    async def replay() -> Any:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": more}
        return await receive()

    return replay


# ---- the worker process -----------------------------------------------------------------------------


def build_app(args: argparse.Namespace) -> tuple[Any, DisaggService, str, dict[str, Any]]:
    """The worker of ``workers.server.cli.build`` with a ``TransferEngine`` and the disaggregation layer:
    the ASGI app to serve, its transfer service, the served model name and the /health info."""
    from workers.server.app import create_app
    from workers.server.cli import build

    config = transfer_config(args)
    base, tokenizer, name, info = build(args)
    states = base.engine.block_manager.states
    if states is not None and not states.num_checkpoints and config.role != "mixed":
        # a transferred prefix resumes only at a state checkpoint: without any, nothing would move
        raise ValueError(f"--role {config.role}: a hybrid model (recurrent layers) moves its recurrent state as a "
                         "checkpoint; it needs --state-checkpoints > 0 and the prefix cache")
    engine = TransferEngine(base.engine)  # base was never started: only its LLMEngine is kept
    info = {**info, "role": config.role, "kv_transfer": {"transport": config.transport, "layout": engine.layout.to_dict()}}
    app = create_app(engine, tokenizer, name, info, content_format=info["chat_template_content_format"])
    service = DisaggService(engine, app.state.api, config)
    return DisaggApp(app, service), service, name, info


def main(argv: list[str] | None = None) -> int:
    """``python -m workers.transfer.disagg_server`` is ``mesh worker`` (``workers.server.cli``)."""
    from workers.server.cli import main as worker_main

    return worker_main(argv)


if __name__ == "__main__":
    sys.exit(main())
