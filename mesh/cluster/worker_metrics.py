"""A worker's load signals, read from its Prometheus ``/metrics`` text.

The gateway's registry scrapes every worker on its health schedule and hands the body to a
``MetricsScanner``; the result, per data-parallel rank, is what a router needs and cannot count
itself: the KV cache usage (0..1, the fraction of blocks held by requests), the KV capacity and
the engine's own running / waiting request counts. Three kinds of worker, their names:

| signal | vLLM | SGLang | bundled worker (``workers/server/app.py``) |
|---|---|---|---|
| KV usage | ``vllm:kv_cache_usage_perc`` (older: ``vllm:gpu_cache_usage_perc``) | ``sglang:token_usage`` | ``mesh_worker_kv_cache_usage`` |
| capacity | ``vllm:cache_config_info{num_gpu_blocks, block_size}`` | ``sglang:max_total_num_tokens`` (tokens) | ``mesh_worker_kv_blocks_total`` |
| running | ``vllm:num_requests_running`` | ``sglang:num_running_reqs`` | ``mesh_worker_num_requests_running`` |
| waiting | ``vllm:num_requests_waiting`` | ``sglang:num_queue_reqs`` | ``mesh_worker_num_requests_waiting`` |

Data-parallel ranks are told apart by a label: vLLM's ``engine`` (the engine index, ``PrometheusStatLogger``
in ``vllm/v1/metrics/loggers.py``), SGLang's ``dp_rank`` (its scheduler's collector labels). A
sample without either is rank ``None``. Several samples of one family and rank (SGLang's
``tp_rank`` / ``pp_rank``, a second ``model_name``) are combined by their maximum: the fullest
cache is the one that refuses work; but running / waiting counts split by a ``priority`` label
(SGLang with priority scheduling) are added up over the priorities (each priority's count is still
the maximum of its duplicates), unless the body has the total itself: SGLang writes it under
``priority=""`` beside the breakdown, and that line alone is read then.

vLLM's capacity: its API server sums ``num_gpu_blocks`` over the engines it manages at startup
("Sum values from all engines in DP case", ``vllm/v1/engine/utils.py``) and ``log_metrics_info``
writes that one total on the ``vllm:cache_config_info`` line of every engine it lists (each API
server lists only its local engines in the hybrid / external load-balancing modes). So one
engine's capacity is the total over the number of engines that the body lists there.

Hostile bodies: only lines starting with one of the few names above are parsed (one C-speed
``bytes.find`` per name over each chunk, no per-line Python work for the rest: a vLLM body is
mostly histogram buckets); a line that does not parse, a NaN or an infinite value is skipped.
The scanner keeps at most one unfinished line (``MAX_LINE_BYTES``) and refuses a body over
``MAX_BODY_BYTES`` (``MetricsError``): memory stays bounded whatever the worker sends.
"""

from __future__ import annotations

import asyncio
import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

    from mesh.gateway.upstream import UpstreamPool

MAX_BODY_BYTES = 16 << 20  # a vLLM body with 8 DP engines is under 1 MiB
MAX_LINE_BYTES = 64 << 10
MAX_RANK = 4096

USAGE = (b"vllm:kv_cache_usage_perc", b"vllm:gpu_cache_usage_perc", b"sglang:token_usage", b"mesh_worker_kv_cache_usage")
RUNNING = (b"vllm:num_requests_running", b"sglang:num_running_reqs", b"mesh_worker_num_requests_running")
WAITING = (b"vllm:num_requests_waiting", b"sglang:num_queue_reqs", b"mesh_worker_num_requests_waiting")
VLLM_CACHE_INFO = b"vllm:cache_config_info"  # an info gauge: the capacity is in its labels
SGLANG_TOKENS = b"sglang:max_total_num_tokens"
BUNDLED_BLOCKS = b"mesh_worker_kv_blocks_total"
NAMES = (*USAGE, *RUNNING, *WAITING, VLLM_CACHE_INFO, SGLANG_TOKENS, BUNDLED_BLOCKS)
# Names grouped by their engine's prefix: a chunk without the prefix skips the group's searches
# (a vLLM body pays 5 searches and 2 prefix checks, not 12 searches).
_GROUPS = tuple(
    (prefix, tuple(n for n in NAMES if n.startswith(prefix))) for prefix in (b"vllm:", b"sglang:", b"mesh_worker_")
)
RANK_LABELS = (b"engine", b"dp_rank")  # vLLM, SGLang

# name = "value" followed by "," or "}"; the value may hold escaped quotes, backslashes, newlines.
_LABEL = re.compile(rb'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\\n]|\\.)*)"[ \t]*([,}])')
PRIORITY_LABEL = b"priority"  # SGLang with priority scheduling: running / waiting per priority
_WANTED_LABELS = frozenset((*RANK_LABELS, PRIORITY_LABEL, b"num_gpu_blocks", b"block_size"))
_COUNTS = frozenset((*RUNNING, *WAITING))  # summed over priorities


class MetricsError(ValueError):
    """The body cannot be read as Prometheus text within the bounds (too large, a line too long)."""


@dataclass(frozen=True, slots=True)
class RankLoad:
    """What one data-parallel rank of a worker reported; ``None``: not reported."""

    kv_usage: float | None = None  # 0..1, KV blocks held by requests
    kv_blocks: int | None = None  # capacity, in blocks of ``kv_block_size`` tokens
    kv_block_size: int | None = None  # None: the gateway's block size for the worker (bundled worker)
    num_running: int | None = None
    num_waiting: int | None = None

    def capacity_blocks(self, block_size: int) -> int:
        """The capacity in blocks of ``block_size`` tokens (the gateway's unit); 0 = unknown."""
        if not self.kv_blocks:
            return 0
        if self.kv_block_size is None or self.kv_block_size == block_size or block_size <= 0:
            return self.kv_blocks
        return self.kv_blocks * self.kv_block_size // block_size

    @property
    def empty(self) -> bool:
        return self.kv_usage is None and not self.kv_blocks and self.num_running is None and self.num_waiting is None


class MetricsScanner:
    """Feed a ``/metrics`` body chunk by chunk (``feed``), then read it per rank (``result``).

    Chunks may split lines anywhere: the unfinished last line is kept for the next chunk.
    """

    __slots__ = ("max_bytes", "_seen", "_tail", "_values", "_capacity", "skipped")

    def __init__(self, max_bytes: int = MAX_BODY_BYTES) -> None:
        self.max_bytes = max_bytes
        self._seen = 0
        self._tail = b""
        # family -> rank -> priority label (None: none) -> max value
        self._values: dict[bytes, dict[int | None, dict[bytes | None, float]]] = {}
        # vLLM cache info, per listed engine: (the API server's total blocks, block size)
        self._capacity: dict[int | None, tuple[int, int | None]] = {}
        self.skipped = 0  # matched lines that did not parse

    def feed(self, chunk: bytes) -> None:
        self._seen += len(chunk)
        if self._seen > self.max_bytes:
            raise MetricsError(f"metrics body over {self.max_bytes} bytes")
        data = self._tail + chunk if self._tail else chunk
        cut = data.rfind(b"\n")
        if cut >= 0:
            self._scan(data, cut)
            data = data[cut + 1:]
        if len(data) > MAX_LINE_BYTES:
            raise MetricsError(f"a metrics line over {MAX_LINE_BYTES} bytes")
        self._tail = data

    def result(self) -> dict[int | None, RankLoad]:
        """Per rank (``None``: samples without a rank label), what the body reported."""
        if self._tail:
            tail, self._tail = self._tail + b"\n", b""
            self._scan(tail, len(tail) - 1)
        ranks = set(self._capacity)
        for per_rank in self._values.values():
            ranks |= per_rank.keys()
        out = {}
        for rank in ranks:
            load = self._rank(rank)
            if not load.empty:
                out[rank] = load
        return out

    def _rank(self, rank: int | None) -> RankLoad:
        usage = self._first(USAGE, rank)
        blocks, block_size = self._capacity.get(rank, (0, None))
        blocks //= max(1, len(self._capacity))  # the total over the engines listed (module doc)
        if not blocks and (tokens := self._first((SGLANG_TOKENS,), rank)):
            blocks, block_size = int(tokens), 1
        if not blocks and (total := self._first((BUNDLED_BLOCKS,), rank)):
            blocks, block_size = int(total), None
        running, waiting = self._first(RUNNING, rank), self._first(WAITING, rank)
        return RankLoad(
            kv_usage=None if usage is None else min(1.0, max(0.0, usage)),
            kv_blocks=blocks if blocks > 0 else None,
            kv_block_size=block_size,
            num_running=None if running is None else int(running),
            num_waiting=None if waiting is None else int(waiting),
        )

    def _first(self, names: tuple[bytes, ...], rank: int | None) -> float | None:
        for name in names:
            per_priority = self._values.get(name, {}).get(rank)
            if per_priority:
                if name not in _COUNTS:
                    return max(per_priority.values())
                total = per_priority.get(b"")  # SGLang writes the total under priority="" beside the breakdown
                return total if total is not None else sum(per_priority.values())
        return None

    # -- scanning --
    def _scan(self, data: bytes, end: int) -> None:
        """The complete lines of ``data[:end + 1]`` (``data`` starts at a line start)."""
        for prefix, names in _GROUPS:
            if data.find(prefix, 0, end) < 0:
                continue
            for name in names:
                if data.startswith(name, 0, end):
                    self._line(data, 0, name)
                pattern = b"\n" + name
                i = data.find(pattern, 0, end)
                while i >= 0:
                    self._line(data, i + 1, name)
                    i = data.find(pattern, i + 1, end)

    def _line(self, data: bytes, start: int, name: bytes) -> None:
        pos = start + len(name)
        stop = data.find(b"\n", pos)
        if stop < 0:
            stop = len(data)
        nxt = data[pos:pos + 1]
        labels: dict[bytes, bytes] = {}
        if nxt == b"{":
            parsed = _labels(data, pos + 1, stop)
            if parsed is None:
                self.skipped += 1
                return
            labels, pos = parsed
        elif nxt not in (b" ", b"\t"):
            return  # a longer name that starts with this one (vllm:num_requests_running_x)
        fields = data[pos:stop].split()
        rank = _rank(labels)
        if not fields or rank == _BAD_RANK:
            self.skipped += 1
            return
        try:
            value = float(fields[0])
        except ValueError:
            self.skipped += 1
            return
        if not math.isfinite(value):
            return  # NaN / +Inf: the engine does not know yet
        if name == VLLM_CACHE_INFO:
            self._cache_info(rank, labels)
        elif value < 0:
            self.skipped += 1
        else:
            per_priority = self._values.setdefault(name, {}).setdefault(rank, {})
            priority = labels.get(PRIORITY_LABEL)
            old = per_priority.get(priority)
            per_priority[priority] = value if old is None else max(old, value)

    def _cache_info(self, rank: int | None, labels: dict[bytes, bytes]) -> None:
        blocks = _int(labels.get(b"num_gpu_blocks"))  # "None" until the engine has profiled memory
        if not blocks:
            return
        block_size = _int(labels.get(b"block_size"))
        old = self._capacity.get(rank)
        if old is None or blocks > old[0]:
            self._capacity[rank] = (blocks, block_size or None)


def _labels(data: bytes, pos: int, stop: int) -> tuple[dict[bytes, bytes], int] | None:
    """The wanted labels of ``{...}`` starting after the brace, and the position after ``}``."""
    labels: dict[bytes, bytes] = {}
    while True:
        while pos < stop and data[pos] in b" \t":
            pos += 1
        if pos < stop and data[pos] == 0x7D:  # "}": no (more) labels
            return labels, pos + 1
        m = _LABEL.match(data, pos, stop)
        if m is None:
            return None
        if m.group(1) in _WANTED_LABELS:
            labels[m.group(1)] = _unescape(m.group(2))
        pos = m.end()
        if m.group(3) == b"}":
            return labels, pos


def _unescape(value: bytes) -> bytes:
    if b"\\" not in value:
        return value
    return re.sub(rb"\\(.)", lambda m: b"\n" if m.group(1) == b"n" else m.group(1), value)


_BAD_RANK = -1


def _rank(labels: dict[bytes, bytes]) -> int | None:
    """The sample's data-parallel rank; None without a rank label; ``_BAD_RANK`` for a bad one."""
    for label in RANK_LABELS:
        raw = labels.get(label)
        if raw is not None:
            rank = _int(raw)
            return rank if rank is not None and rank < MAX_RANK else _BAD_RANK
    return None


def _int(raw: bytes | None) -> int | None:
    if raw is None or not raw.isdigit() or len(raw) > 15:
        return None
    return int(raw)


def parse(body: bytes, max_bytes: int = MAX_BODY_BYTES) -> dict[int | None, RankLoad]:
    """A whole body at once (tests, tools); raises ``MetricsError`` as ``MetricsScanner`` does."""
    scanner = MetricsScanner(max_bytes)
    scanner.feed(body)
    return scanner.result()


# Outcomes of one scrape: ``ok`` (load signals read), ``empty`` (200, none of the names),
# ``absent`` (404: no /metrics), ``http_error`` (another status), ``unreachable`` (connection
# refused or broken, timeout), ``invalid`` (over the size bounds); the registry adds ``unmatched``
# (load signals whose ranks cannot be placed on the worker's ``dp_size`` targets).
METRICS_RESULTS = ("ok", "empty", "absent", "http_error", "unreachable", "invalid", "unmatched")


@dataclass(frozen=True, slots=True)
class Scrape:
    result: str
    ranks: dict[int | None, RankLoad] = field(default_factory=dict)
    error: str | None = None


async def scrape(pool: UpstreamPool, url: str, headers: Iterable[bytes], timeout_s: float,
                 max_bytes: int = MAX_BODY_BYTES) -> Scrape:
    """GET ``url`` and scan the body as it arrives; never raises (but for cancellation).

    ``timeout_s`` bounds the whole exchange, body included (``UpstreamPool.request``); a body
    over ``max_bytes`` ends the read and the connection (the pool does not reuse it)."""
    try:
        resp = await pool.request("GET", url, [*headers, b"accept: text/plain\r\n"], timeout_s=timeout_s)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # refused, timed out, broken: the health check says the rest
        return Scrape("unreachable", error=f"GET /metrics failed: {exc}")
    try:
        if resp.status != 200:
            return Scrape("absent" if resp.status == 404 else "http_error", error=f"GET /metrics answered {resp.status}")
        scanner = MetricsScanner(max_bytes)
        while chunk := await resp.read_chunk():
            scanner.feed(chunk)
        ranks = scanner.result()
    except asyncio.CancelledError:
        raise
    except MetricsError as exc:
        return Scrape("invalid", error=str(exc))
    except Exception as exc:
        return Scrape("unreachable", error=f"GET /metrics failed: {exc}")
    finally:
        resp.close()
    if not ranks:
        return Scrape("empty", error="no load signals in /metrics")
    return Scrape("ok", ranks)
