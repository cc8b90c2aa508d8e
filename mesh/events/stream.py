"""One KV event stream's protocol state: sequence numbers, gaps, duplicates, restarts.

Frames are ``[topic, seq (8 bytes big-endian), payload]`` (``[seq, payload]`` accepted too).
``seq == last + 1`` is the next batch; ``seq > last + 1`` a gap (repaired by replay); a seq at or
below the last is a duplicate (same payload digest as the batch applied at that seq), a stale
frame (older than a rebuild, still queued in the socket) or a publisher restart (another payload
at a remembered seq, or a batch newer than every batch applied). A replay asked from ``start``
joins the stream when its first batch is ``start`` and, when ``start`` is the last applied seq,
carries the same payload (proof of the same publisher). Invariant: ``digests`` holds the digest
of each of the last ``digest_window`` seqs applied, ``order`` their order. Ownership: a
``Stream`` is mutated only by its own tasks on the subscriber's loop (the stream task of
``mesh.events.subscriber`` and its connection watcher, ``mesh.events.sockets``); its ``inbox`` is
shared with the receiver thread under the rules of ``mesh.events.inbox``.
"""

from __future__ import annotations

import asyncio
import enum
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash
import zmq.asyncio

from mesh.config.workers import bound_topics
from mesh.events.health import StreamHealth
from mesh.events.inbox import Inbox
from mesh.events.ops import Prepared
from mesh.events.wire import DecodeError, GroupFilter, decode_lazy

digest = xxhash.xxh3_64_intdigest
Payload = bytes | Prepared  # a frame's payload as received, or as the receiver process prepared it


def digest_of(payload: Payload) -> int:
    return payload.digest if isinstance(payload, Prepared) else digest(payload)


def _ts_of(payload: Payload) -> float:
    """The batch's publisher time (-inf when it has none)."""
    if isinstance(payload, Prepared):
        return payload.ts
    batch = decode_lazy(payload)  # the envelope only: its ts
    return -math.inf if isinstance(batch, DecodeError) else batch.ts


@dataclass(frozen=True, slots=True)
class WorkerEvents:
    """Where one worker publishes its KV events (data-parallel rank r uses port + r)."""

    worker: str
    endpoint: str | None  # PUB address of rank 0, e.g. "tcp://10.0.0.5:5557"; None: the gateway's bound endpoint
    replay_endpoint: str | None = None  # ROUTER address of rank 0, e.g. "tcp://10.0.0.5:5558"
    dp_size: int = 1
    model: str = ""  # namespace of the router keys (``mesh.core.keys.namespace_seed(model, lora)``)
    block_size: int | None = None  # the pool's block size; events with another are skipped
    topic: str = ""
    # tokens past each block that the engine's hashes cover (speculative decoding, ``mesh.core.lookahead``);
    # None: as its events show (vLLM's lookahead_token_ids, SGLang's bigram pages)
    lookahead_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.dp_size < 1:
            raise ValueError(f"worker {self.worker!r}: dp_size must be >= 1, got {self.dp_size}")
        if self.block_size is not None and self.block_size <= 0:
            raise ValueError(f"worker {self.worker!r}: block_size must be positive")
        if self.endpoint is None and self.dp_size != 1:
            raise ValueError(f"worker {self.worker!r}: events from the gateway's bound endpoint need dp_size 1")

    def bound_topics(self) -> list[str]:
        """On the gateway's bound endpoint: the topics that name this worker."""
        return bound_topics(self.worker, self.topic)


class Verdict(enum.Enum):
    """What a live frame is, against the seqs applied so far."""

    FIRST = "first"  # no seq applied yet
    NEXT = "next"  # last + 1
    GAP = "gap"  # beyond last + 1: batches were missed
    RESTART = "restart"  # the publisher restarted: its seqs started over
    OLD = "old"  # a duplicate or a stale frame: skipped


class Stream:
    __slots__ = ("spec", "health", "task", "dealer", "inbox", "dropped_seen", "applying", "filter", "digests", "order", "last_ts",
                 "reported_healthy", "lost", "replay_due", "replay_failures", "retry_at")

    def __init__(self, spec: WorkerEvents, health: StreamHealth) -> None:
        self.spec = spec
        self.health = health
        self.task: asyncio.Task[None] | None = None
        self.dealer: zmq.asyncio.Socket | None = None  # the replay socket, opened on first use
        self.inbox: Inbox | None = None  # live frames from the receiver thread, while the stream runs
        self.applying = False  # a frame is being applied (in slices: the loop may run between them)
        self.dropped_seen = 0  # the inbox's refused frames already counted in ``health.dropped``
        self.filter = GroupFilter()
        self.digests: dict[int, int] = {}  # recent seq -> payload digest
        self.order: deque[int] = deque()
        self.last_ts = -math.inf  # publisher time of the newest batch applied
        self.reported_healthy: bool | None = None
        self.lost = False  # the connection dropped since the last frame (set when its inbox's marker is met)
        # A replay is needed and has not completed (running, or failed and waiting to be retried at
        # ``retry_at``, loop time): the stream is not trusted meanwhile.
        self.replay_due = False
        self.replay_failures = 0
        self.retry_at = 0.0

    def remember(self, seq: int, payload: Payload, window: int) -> None:
        if seq not in self.digests:
            self.order.append(seq)
        self.digests[seq] = digest_of(payload)
        while len(self.order) > window:
            self.digests.pop(self.order.popleft(), None)

    def forget_seq(self) -> None:
        """Start over: the next frame is the first (after a restart or lost continuity)."""
        self.health.last_seq = None
        self.digests.clear()
        self.order.clear()

    def classify(self, seq: int, payload: Payload) -> Verdict:
        """The verdict on a live frame at ``seq``; counts gaps, duplicates and stale frames."""
        h = self.health
        last = h.last_seq
        if last is None:
            return Verdict.FIRST
        if seq == last + 1:
            return Verdict.NEXT
        if seq > last + 1:
            h.gaps += 1
            return Verdict.GAP
        return Verdict.RESTART if self._restarted_at(seq, payload) else Verdict.OLD

    def _restarted_at(self, seq: int, payload: Payload) -> bool:
        """A frame at or below the last applied seq: a duplicate, a stale frame, or a restart.

        Same seq, same payload digest: a duplicate. Same seq, another payload: a restart. Seq
        below the digest window (or forgotten by a rebuild): a restart only if the batch is newer
        than every batch applied (publisher time), else a stale frame still queued in the socket.
        """
        h = self.health
        known = self.digests.get(seq)
        if known is not None:
            if known == digest_of(payload):
                h.duplicates += 1
                return False
            return True
        if _ts_of(payload) > self.last_ts:
            return True
        h.stale += 1
        return False

    def replay_start(self) -> int:
        """The first seq to ask a replay for: one batch early when the last one's digest is kept,
        so that the replay's first batch proves it comes from the same publisher."""
        last = self.health.last_seq
        return 0 if last is None else (last if last in self.digests else last + 1)


def split_frame(frames: Sequence[bytes], *, signed: bool = False) -> tuple[int, bytes] | None:
    """``(seq, payload)`` of ``[topic, seq, payload]`` or ``[seq, payload]``; None if malformed."""
    if len(frames) == 3:
        seq_bytes, payload = frames[1], frames[2]
    elif len(frames) == 2:
        seq_bytes, payload = frames[0], frames[1]
    else:
        return None
    if len(seq_bytes) != 8:
        return None
    return int.from_bytes(seq_bytes, "big", signed=signed), payload


def continues(frames: list[tuple[int, bytes]], start: int, last: int, digests: dict[int, int]) -> bool:
    """Whether a replay asked from ``start`` joins the stream applied up to ``last``."""
    if not frames:
        return False  # not even the last applied batch was kept
    seq, payload = frames[0]
    if seq != start:
        return False
    return start != last or digests.get(last) == digest(payload)


def restarted(
    frames: list[tuple[int, bytes]], everything: list[tuple[int, bytes]], last: int, digests: dict[int, int]
) -> bool:
    """After a replay from ``start`` that does not join the stream (``frames``) and one of the
    whole buffer (``everything``): whether the publisher is a new incarnation (else batches were
    lost for good)."""
    return _first_differs(frames, last, digests) or _behind(everything, last) or _rewritten(everything, last, digests)


def _first_differs(frames: list[tuple[int, bytes]], last: int, digests: dict[int, int]) -> bool:
    return any(seq <= last and digests.get(seq, -1) != digest(p) for seq, p in frames[:1])


def _rewritten(frames: list[tuple[int, bytes]], last: int, digests: dict[int, int]) -> bool:
    """A whole replay buffer holding another payload at a seq already applied: a new incarnation
    (it may have passed ``last`` between the two replay requests, so ``_behind`` cannot tell)."""
    return any(seq <= last and seq in digests and digests[seq] != digest(p) for seq, p in frames)


def _behind(frames: list[tuple[int, bytes]], last: int) -> bool:
    """A whole replay buffer that ends before ``last``: its publisher never sent ``last`` (a
    new incarnation: the one that did keeps its newest batches)."""
    return bool(frames) and frames[-1][0] < last


def offset_endpoint(endpoint: str, rank: int) -> str:
    """vLLM's convention: rank r of a tcp endpoint listens on port + r; other transports get a
    ``_dp{r}`` suffix."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        if port.isdigit():
            return f"{host}:{int(port) + rank}"
        raise ValueError(f"endpoint {endpoint!r} has no numeric port to offset by rank {rank}")
    return f"{endpoint}_dp{rank}"
