"""KV transfer between bundled workers: a prefill worker's finished KV blocks move to a decode
worker, which pulls exactly the blocks it does not hold, verifies them and registers them in its
own prefix cache (its KV events then announce them, so the router's index learns them).

Pieces (one job each):
- ``workers.transfer.kv_layout``: ``Layout`` (what both sides must share) and ``TransferError``.
- The wire format (``encode_header`` / ``block_head`` / ``FrameReader``): a header, then per
  block ``key u64 | xxh3_64 u64 | payload``, then (a pull with ``state``, hybrid models) one
  frame of the same shape holding the recurrent state at the end of the transfer's last block
  (its key: that block's), then a trailer with the block count. Identical over HTTP
  (``POST /kv_transfer/pull``, a streamed binary body) and raw TCP.
- ``workers.transfer.block_ops.BlockOps``: everything that touches the block manager or the paged cache
  (engine thread only).
- ``TransferEngine``: ``AsyncLLMEngine`` plus a queue of calls run on the engine thread, and the
  prefill-side pin taken in the very step a prefill finishes (before any later step could evict
  its blocks).
- ``serve_pull`` (sender) and ``pull_blocks`` (receiver); ``workers.transfer.kv_ipc`` the same-host
  GPU-to-GPU path.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import queue
import struct
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import xxhash

from mesh.core.keys import block_keys, namespace_seed
from workers.engine.llm_engine import AsyncLLMEngine, EngineDeadError, LLMEngine, RequestOutput
from workers.transfer.block_ops import BlockOps, PinnedPrefix
from workers.transfer.kv_layout import Layout, TransferError

log = logging.getLogger(__name__)

T = TypeVar("T")
MAGIC = b"MKV1"
END = b"MEND"
_HEAD = struct.Struct("!4sI")  # magic, header length
_BLOCK = struct.Struct("!QQ")  # key, xxh3_64 of the payload
_TRAIL = struct.Struct("!4sI")  # END, number of blocks sent
_REQ = struct.Struct("!I")  # TCP request: length of the JSON request
MAX_HEADER = 64 << 20
checksum = xxhash.xxh3_64_intdigest


# ---- wire format ------------------------------------------------------------------------------


def encode_header(header: dict[str, Any]) -> bytes:
    body = json.dumps(header, separators=(",", ":")).encode()
    return _HEAD.pack(MAGIC, len(body)) + body


def block_head(key: int, payload: Any) -> bytes:
    """The 16 bytes before a block's payload on the wire: its key and the payload's xxh3."""
    return _BLOCK.pack(key, checksum(payload))


def encode_trailer(count: int) -> bytes:
    return _TRAIL.pack(END, count)


class ChunkSource:
    """A byte stream from an async iterator of chunks (HTTP bodies): ``readinto`` copies from
    the received chunks into the caller's buffer."""

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self._iter = chunks
        self._chunks: deque[memoryview] = deque()
        self.bytes_read = 0

    async def readinto(self, dst: memoryview) -> None:
        pos, n = 0, len(dst)
        while pos < n:
            if not self._chunks:
                try:
                    data = await self._iter.__anext__()
                except StopAsyncIteration:
                    raise _truncated(self.bytes_read) from None
                if data:
                    self._chunks.append(memoryview(data))
                    self.bytes_read += len(data)
                continue
            head = self._chunks[0]
            k = min(len(head), n - pos)
            dst[pos : pos + k] = head[:k]
            pos += k
            if k == len(head):
                self._chunks.popleft()
            else:
                self._chunks[0] = head[k:]

    async def aclose(self) -> None:
        await self._iter.aclose()  # type: ignore[attr-defined]


def _truncated(nbytes: int) -> TransferError:
    return TransferError(502, "kv_transfer_truncated", f"stream ended early ({nbytes} bytes read)", True)


class TcpSource(asyncio.BufferedProtocol):
    """A TCP byte stream whose ``readinto`` has the kernel write straight into the caller's
    buffer (``BufferedProtocol``): one copy per byte on receive, none in user space. Bytes that
    arrive while no read is pending wait in a small spill queue (reading pauses past 1 MiB)."""

    SPILL_LIMIT = 1 << 20

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.transport: asyncio.Transport | None = None
        self._target: memoryview | None = None
        self._pos = 0
        self._waiter: asyncio.Future[None] | None = None
        self._spill = bytearray(1 << 16)
        self._pending: deque[memoryview] = deque()
        self._pending_bytes = 0
        self._eof = False
        self._error: BaseException | None = None
        self.bytes_read = 0

    # -- protocol callbacks (event loop) --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview | bytearray:
        if self._target is not None:
            return self._target[self._pos :]
        return self._spill

    def buffer_updated(self, nbytes: int) -> None:
        self.bytes_read += nbytes
        if self._target is not None:
            self._pos += nbytes
            if self._pos == len(self._target):
                self._target = None
                self._wake()
            return
        self._pending.append(memoryview(bytes(self._spill[:nbytes])))
        self._pending_bytes += nbytes
        if self._pending_bytes > self.SPILL_LIMIT and self.transport is not None:
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        self._eof = True
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._eof = True
        self._error = exc
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # -- reader side --

    async def readinto(self, dst: memoryview) -> None:
        pos = self._drain_pending(dst)
        if pos == len(dst):
            return
        if self._eof:
            raise self._failure()
        self._target, self._pos = dst, pos
        self._waiter = asyncio.get_running_loop().create_future()
        if self.transport is not None:
            self.transport.resume_reading()
        try:
            await asyncio.wait_for(self._waiter, self.timeout)
        except asyncio.TimeoutError as exc:
            raise TransferError(502, "kv_transfer_failed", f"no data for {self.timeout} s", True) from exc
        finally:
            filled = self._target is None
            self._target = None
        if not filled:
            raise self._failure()

    def _drain_pending(self, dst: memoryview) -> int:
        pos = 0
        while self._pending and pos < len(dst):
            head = self._pending[0]
            k = min(len(head), len(dst) - pos)
            dst[pos : pos + k] = head[:k]
            pos += k
            self._pending_bytes -= k
            if k == len(head):
                self._pending.popleft()
            else:
                self._pending[0] = head[k:]
        return pos

    def _failure(self) -> TransferError:
        if self._error is not None:
            return TransferError(502, "kv_transfer_failed", f"connection lost: {self._error!r}", True)
        return _truncated(self.bytes_read)

    async def aclose(self) -> None:
        if self.transport is not None:
            self.transport.close()


class FrameReader:
    """Parses one pull response, verifying as it goes.

    ``source``: an object with ``async readinto(memoryview)`` (``TcpSource``, ``ChunkSource``)
    or an async iterator of byte chunks. ``blocks()`` yields ``(offset, keys, data)`` chunks of
    verified blocks (``data``: uint8 ``[n, block_bytes]``, at most ``chunk_bytes`` per chunk:
    on small hosts large fresh allocations page-fault at a fraction of copy speed). Payloads are
    read straight into ``data``. Raises ``TransferError`` (retryable) on a bad magic, a key other
    than expected, a checksum mismatch, or a stream that ends early.
    """

    def __init__(self, source: Any, chunk_bytes: int = 8 << 20) -> None:
        self.source = source if hasattr(source, "readinto") else ChunkSource(source)
        self.chunk_bytes = chunk_bytes
        self.header: dict[str, Any] = {}

    async def _take(self, n: int) -> bytes:
        out = bytearray(n)
        await self.source.readinto(memoryview(out))
        return bytes(out)

    async def read_header(self) -> dict[str, Any]:
        magic, length = _HEAD.unpack(await self._take(_HEAD.size))
        if magic != MAGIC or length > MAX_HEADER:
            raise TransferError(502, "kv_transfer_corrupt", f"bad stream header (magic {magic!r})", True)
        try:
            self.header = json.loads(await self._take(length))
        except ValueError as exc:
            raise TransferError(502, "kv_transfer_corrupt", f"bad stream header: {exc}", True) from exc
        if not isinstance(self.header, dict):
            raise TransferError(502, "kv_transfer_corrupt", "bad stream header", True)
        return self.header

    async def blocks(self, expected_keys: Sequence[int], block_bytes: int,
                     trailer: bool = True) -> AsyncIterator[tuple[int, list[int], np.ndarray]]:
        n = len(expected_keys)
        per_chunk = max(1, self.chunk_bytes // block_bytes)
        i = 0
        while i < n:
            k = min(per_chunk, n - i)
            data = np.empty((k, block_bytes), dtype=np.uint8)
            for j in range(k):
                key, cs = _BLOCK.unpack(await self._take(_BLOCK.size))
                if key != expected_keys[i + j]:
                    raise TransferError(502, "kv_transfer_corrupt", f"block {i + j}: key {key:#x}, expected {expected_keys[i + j]:#x}", True)
                await self.source.readinto(memoryview(data[j]))
                if checksum(data[j]) != cs:
                    raise TransferError(502, "kv_transfer_corrupt", f"block {i + j}: checksum mismatch", True)
            yield i, list(expected_keys[i : i + k]), data
            i += k
        if trailer:
            await self.read_trailer(n)

    async def read_state(self, key: int, nbytes: int) -> np.ndarray:
        """The recurrent-state frame (uint8 ``[nbytes]``), verified like a block's."""
        got, cs = _BLOCK.unpack(await self._take(_BLOCK.size))
        if got != key:
            raise TransferError(502, "kv_transfer_corrupt", f"state: key {got:#x}, expected {key:#x}", True)
        data = np.empty(nbytes, dtype=np.uint8)
        await self.source.readinto(data.data)
        if checksum(data.data) != cs:
            raise TransferError(502, "kv_transfer_corrupt", "state: checksum mismatch", True)
        return data

    async def read_trailer(self, n: int) -> None:
        end, count = _TRAIL.unpack(await self._take(_TRAIL.size))
        if end != END or count != n:
            raise TransferError(502, "kv_transfer_truncated", f"bad trailer ({end!r}, {count} of {n} blocks)", True)


# ---- the engine with transfer hooks ------------------------------------------------------------


@dataclass
class _Export:
    prompt_ids: list[int]
    seed: int
    pinned: PinnedPrefix | None = None


class TransferEngine(AsyncLLMEngine):
    """``AsyncLLMEngine`` + calls run on the engine thread + pin-on-finish for prefills.

    ``expect_export(rid, ...)`` before ``generate`` marks a request whose KV will be pulled: in
    the step that finishes it (on the engine thread, before any later step may evict) its full
    prompt blocks (all but the block of the last token, which the decode side recomputes) are
    pinned; on a hybrid model with the state checkpoint at their end (``BlockOps.pin_export``). ``take_export`` hands the pin to its owner; ``drop_export`` undoes it on any path
    that will not (cancel, error): exactly one of the two ends every ``expect_export``.
    """

    def __init__(self, engine: LLMEngine) -> None:
        super().__init__(engine)
        self.ops = BlockOps(engine)
        self.layout = self.ops.layout
        self._calls: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], concurrent.futures.Future[Any] | None]] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _exports between the loop and the engine thread
        self._exports: dict[str, _Export] = {}

    # -- engine-thread calls --

    async def call(self, fn: Callable[..., T], *args: Any, timeout: float = 60.0) -> T:
        """Run ``fn(*args)`` on the engine thread between steps; its result or exception."""
        if not self.alive:
            raise EngineDeadError(f"engine loop is not running: {self.error!r}")
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._calls.put((fn, args, fut))
        self._wake.set()
        return await asyncio.wait_for(asyncio.wrap_future(fut), timeout)

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Fire and forget on the engine thread (unpins: they cannot fail but by a bug)."""
        self._calls.put((fn, args, None))
        self._wake.set()

    def _drain_inbox(self) -> None:
        while True:
            try:
                fn, args, fut = self._calls.get_nowait()
            except queue.Empty:
                break
            if fut is not None and not fut.set_running_or_notify_cancel():
                continue  # the caller gave up (``call`` timed out): never run it nor resolve it
            try:
                result = fn(*args)
            except BaseException as exc:  # reported to the caller, never kills the loop
                if fut is None:
                    log.exception("engine-thread call %s failed", getattr(fn, "__name__", fn))
                else:
                    fut.set_exception(exc)
            else:
                if fut is not None:
                    fut.set_result(result)
        super()._drain_inbox()

    # -- prefill-side pin on finish --

    def expect_export(self, request_id: str, prompt_ids: list[int], cache_salt: str | None) -> None:
        seed = namespace_seed(self.engine.model_name, None, cache_salt)
        with self._lock:
            self._exports[request_id] = _Export(list(prompt_ids), seed)

    def take_export(self, request_id: str) -> tuple[PinnedPrefix | None, int]:
        """The pin of a finished export (None if it did not finish normally) and its seed."""
        with self._lock:
            exp = self._exports.pop(request_id, None)
        if exp is None:
            return None, 0
        return exp.pinned, exp.seed

    def drop_export(self, request_id: str) -> None:
        with self._lock:
            exp = self._exports.pop(request_id, None)
        if exp is not None and exp.pinned is not None and exp.pinned.block_ids:
            self.submit(self.ops.unpin, exp.pinned.block_ids)
        if exp is not None and exp.pinned is not None and exp.pinned.state_key is not None:
            self.submit(self.ops.unpin_state, exp.pinned.state_key)

    def _deliver(self, request_id: str, item: Any) -> None:
        if isinstance(item, RequestOutput) and item.finished and item.finish_reason != "abort":
            with self._lock:
                exp = self._exports.get(request_id)
                if exp is not None and exp.pinned is None:
                    exp.pinned = self._pin_export(exp)
        super()._deliver(request_id, item)

    def _pin_export(self, exp: _Export) -> PinnedPrefix:
        bs = self.layout.block_size
        n = (len(exp.prompt_ids) - 1) // bs  # the last token's block is recomputed by decode
        tokens = exp.prompt_ids[: n * bs]
        keys = block_keys(tokens, bs, exp.seed)
        blocks = [tokens[i * bs : (i + 1) * bs] for i in range(n)]
        return self.ops.pin_export(keys, blocks, exp.seed)


# ---- faults (tests only) ----------------------------------------------------------------------


@dataclass
class Faults:
    """Injected into the next pulls served (enabled by ``MESH_KV_TRANSFER_FAULTS=1`` only)."""

    corrupt: int = 0  # next N pulls: one payload byte flipped
    truncate: int = 0  # next N pulls: the stream stops after half the blocks
    delay_s: float = 0.0  # every block: sleep this long first (a slow link)
    layout_override: dict[str, Any] = field(default_factory=dict)  # header layout fields
    cpu_save_hold: bool = False  # the cpu_save consumer reports only once this is lifted (decode done first)


# ---- sender ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PullRequest:
    transfer_id: str
    first_block: int
    num_blocks: int
    layout: Layout
    state: bool = False  # also the recurrent state at the end of the transfer (hybrid models)

    @classmethod
    def parse(cls, d: Any) -> PullRequest:
        if not isinstance(d, dict):
            raise TransferError(400, "kv_pull_invalid", "pull request must be a JSON object")
        try:
            tid, first, n = str(d["transfer_id"]), int(d["first_block"]), int(d["num_blocks"])
        except (KeyError, TypeError, ValueError) as exc:
            raise TransferError(400, "kv_pull_invalid", f"bad pull request: {exc!r}") from exc
        if first < 0 or n < 0:
            raise TransferError(400, "kv_pull_invalid", "first_block and num_blocks must be >= 0")
        state = d.get("state", False)
        if not isinstance(state, bool):
            raise TransferError(400, "kv_pull_invalid", "state must be a boolean")
        return cls(tid, first, n, Layout.from_dict(d.get("layout")), state)


async def serve_pull(engine: TransferEngine, registry: Any, req: PullRequest, faults: Faults,
                     chunk_bytes: int = 8 << 20) -> AsyncIterator[Any]:
    """The frames of one pull (bytes-like items: per block its 16-byte head, then its payload;
    with ``req.state`` the state frame after the blocks).

    The read lease is taken and returned inside the generator, so a stream that never starts
    holds nothing. A transfer released before the read starts yields an error header (a late
    pull after a cancel or timeout).
    """
    from workers.transfer.registry import TransferGone

    try:
        t = registry.begin_read(req.transfer_id)
    except TransferGone:
        yield encode_header({"error": {"status": 410, "code": "kv_transfer_gone",
                                       "message": f"transfer {req.transfer_id} was released"}})
        return
    corrupt, truncate = faults.corrupt > 0, faults.truncate > 0
    faults.corrupt -= corrupt
    faults.truncate -= truncate
    try:
        stop = req.first_block + req.num_blocks
        error = _pull_refusal(t, req, stop)
        if error is not None:
            yield encode_header({"error": error})
            return
        layout = {**engine.layout.to_dict(), **faults.layout_override}
        yield encode_header({"transfer_id": t.transfer_id, "layout": layout, "first_block": req.first_block,
                             "num_blocks": req.num_blocks, "block_bytes": engine.layout.block_bytes,
                             "state_bytes": engine.layout.state_bytes if req.state else 0})
        limit = req.num_blocks // 2 if truncate else req.num_blocks
        per_chunk = max(1, chunk_bytes // engine.layout.block_bytes)
        sent = 0
        for i in range(req.first_block, stop, per_chunk):
            bids = t.block_ids[i : min(i + per_chunk, stop)]
            data = await engine.call(engine.ops.gather, bids)
            for j in range(len(bids)):
                if sent >= limit:
                    return  # truncated: no trailer
                if faults.delay_s:
                    await asyncio.sleep(faults.delay_s)
                payload: Any = data[j]
                head = block_head(t.keys[i + j], payload)
                if corrupt:
                    payload, corrupt = _flipped(payload), False
                yield head
                yield memoryview(payload)
                sent += 1
        if req.state:
            if truncate:
                return  # truncated before the state: no trailer
            state: Any = await engine.call(engine.ops.gather_state, t.state_key)
            head = block_head(t.state_key, state)
            yield head
            yield memoryview(_flipped(state) if corrupt else state)
        yield encode_trailer(sent)
    finally:
        registry.end_read(t)


def _pull_refusal(t: Any, req: PullRequest, stop: int) -> dict[str, Any] | None:
    """The error header of a pull this transfer cannot serve, or None."""
    if stop > t.num_blocks:
        return {"status": 416, "code": "kv_pull_range", "message": f"blocks [{req.first_block}, {stop}) of {t.num_blocks}"}
    if req.state and t.state_key is None:
        return {"status": 409, "code": "kv_state_missing", "message": f"transfer {t.transfer_id} carries no recurrent state"}
    return None


def _flipped(payload: Any) -> bytearray:
    """``payload`` with one byte flipped (the ``corrupt`` fault)."""
    out = bytearray(payload.tobytes())
    out[len(out) // 2] ^= 0xFF
    return out


# ---- receiver -------------------------------------------------------------------------------


async def _http_source(client: Any, url: str, body: dict[str, Any], timeout: float) -> AsyncIterator[bytes]:
    import httpx

    try:
        async with client.stream("POST", url, json=body, timeout=timeout) as resp:
            if resp.status_code != 200:
                text = (await resp.aread())[:2000].decode(errors="replace")
                raise _remote_error(resp.status_code, text)
            async for chunk in resp.aiter_raw():
                yield chunk
    except httpx.HTTPError as exc:
        raise TransferError(502, "kv_transfer_failed", f"pull from {url} failed: {exc!r}", True) from exc


async def _tcp_source(host: str, port: int, body: dict[str, Any], timeout: float) -> TcpSource:
    """Connect and send the pull request; the response is read through the returned source."""
    loop = asyncio.get_running_loop()
    try:
        _, source = await asyncio.wait_for(
            loop.create_connection(lambda: TcpSource(timeout), host, port), timeout)
    except (OSError, asyncio.TimeoutError) as exc:
        raise TransferError(502, "kv_transfer_failed", f"connect to {host}:{port} failed: {exc!r}", True) from exc
    req = json.dumps(body).encode()
    if source.transport is None:  # connection_made runs before create_connection returns
        raise TransferError(502, "kv_transfer_failed", f"connect to {host}:{port}: no transport", True)
    source.transport.write(_REQ.pack(len(req)) + req)
    return source


def _remote_error(status: int, text: str) -> TransferError:
    try:
        err = json.loads(text)["error"]
        code, message = str(err.get("code") or "kv_transfer_failed"), str(err.get("message"))
    except (ValueError, KeyError, TypeError):
        code, message = "kv_transfer_failed", text
    return TransferError(status, code, message, retryable=status >= 500 and status != 507)


async def _open_pull(params: dict[str, Any], body: dict[str, Any], layout: Layout, http: Any, timeout: float,
                     chunk_bytes: int) -> FrameReader:
    """Send one pull request (TCP or HTTP, as ``params`` say) and read its checked header."""
    host = str(params["remote_host"])
    source: Any
    if params.get("transport") == "tcp" and params.get("remote_tcp_port"):
        source = await _tcp_source(host, int(params["remote_tcp_port"]), body, timeout)
    else:
        url = f"http://{_host_for_url(host)}:{int(params['remote_port'])}/kv_transfer/pull"
        source = ChunkSource(_http_source(http, url, body, timeout))
    reader = FrameReader(source, chunk_bytes)
    try:
        header = check_header(await reader.read_header(), layout)
        if (header.get("block_bytes") != layout.block_bytes or header.get("num_blocks") != body["num_blocks"]
                or header.get("state_bytes", 0) != (layout.state_bytes if body.get("state") else 0)):
            raise TransferError(502, "kv_transfer_corrupt", "header does not match the pull request", True)
    except BaseException:
        await source.aclose()
        raise
    return reader


async def pull_blocks(
    params: dict[str, Any],
    first_block: int,
    keys: Sequence[int],
    layout: Layout,
    *,
    http: Any,
    timeout: float,
    chunk_bytes: int = 8 << 20,
) -> AsyncIterator[tuple[int, list[int], np.ndarray]]:
    """Verified chunks ``(offset, keys, data)`` of blocks ``first_block..`` of a remote
    transfer (``params``: the prefill's ``kv_transfer_params``). Raises ``TransferError``."""
    body = {"transfer_id": params["transfer_id"], "first_block": first_block, "num_blocks": len(keys),
            "layout": layout.to_dict()}
    reader = await _open_pull(params, body, layout, http, timeout, chunk_bytes)
    try:
        async for chunk in reader.blocks(keys, layout.block_bytes):
            yield chunk
    finally:
        await reader.source.aclose()


async def pull_state(params: dict[str, Any], key: int, layout: Layout, *, http: Any, timeout: float) -> np.ndarray:
    """The verified recurrent state (uint8 ``[layout.state_bytes]``) at the end of a remote
    transfer whose last block's key is ``key``. Raises ``TransferError``."""
    body = {"transfer_id": params["transfer_id"], "first_block": 0, "num_blocks": 0, "layout": layout.to_dict(),
            "state": True}
    reader = await _open_pull(params, body, layout, http, timeout, 8 << 20)
    try:
        data = await reader.read_state(key, layout.state_bytes)
        await reader.read_trailer(0)
        return data
    finally:
        await reader.source.aclose()


def check_header(header: dict[str, Any], layout: Layout) -> dict[str, Any]:
    """A pull's (or lease's) response header, or the ``TransferError`` it reports or implies."""
    if "error" in header:
        err = header["error"] if isinstance(header["error"], dict) else {}
        raise TransferError(int(err.get("status", 502)), str(err.get("code")), str(err.get("message")), False)
    mismatch = layout.mismatch(Layout.from_dict(header.get("layout")))
    if mismatch:
        raise TransferError(409, "kv_layout_mismatch", f"KV layout mismatch: {mismatch}")
    return header


def _host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


_SLICE = 256 << 10


async def _send(writer: asyncio.StreamWriter, data: memoryview) -> None:
    """Write in slices, draining whenever the transport had to buffer: on Python 3.11 a large
    transport buffer is shifted (``del buf[:n]``) on every send, quadratic in its size."""
    for i in range(0, len(data), _SLICE):
        writer.write(data[i : i + _SLICE])
        if writer.transport.get_write_buffer_size():
            await writer.drain()


async def serve_tcp(engine: TransferEngine, registry: Any, faults: Faults, host: str, port: int,
                    chunk_bytes: int = 8 << 20, lease_timeout: float = 30.0) -> asyncio.AbstractServer:
    """The raw TCP pull server: one request (length-prefixed JSON) per connection: a byte
    stream of blocks, or (``"mode": "ipc"``) a read lease held while a peer copies them."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            (length,) = _REQ.unpack(await reader.readexactly(_REQ.size))
            if length > MAX_HEADER:
                return
            try:
                raw = json.loads(await reader.readexactly(length))
                req = PullRequest.parse(raw)
            except (TransferError, ValueError) as exc:
                code = exc.code if isinstance(exc, TransferError) else "kv_pull_invalid"
                writer.write(encode_header({"error": {"status": 400, "code": code, "message": str(exc)}}))
                return
            if raw.get("mode") == "ipc":  # a read lease for a same-host peer copy (workers.transfer.kv_ipc)
                from workers.transfer.kv_ipc import serve_lease

                await serve_lease(engine, registry, req, reader, writer, lease_timeout)
                return
            async for frame in serve_pull(engine, registry, req, faults, chunk_bytes):
                await _send(writer, memoryview(frame).cast("B"))
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, host, port, limit=1 << 20)
