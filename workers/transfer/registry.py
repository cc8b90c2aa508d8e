"""Ownership of KV blocks in flight between workers: no I/O, no clock (``now`` is passed in).

Prefill side, ``TransferRegistry`` (the multi-connector rule): the blocks of a finished prefill
(and, on a hybrid model, the checkpoint of its recurrent state at their end) stay pinned (one reference held by the transfer) until **every** consumer named at creation is
done (the decode pull; a CPU save when offload is on), or the transfer is cancelled, or its
deadline passes. Whatever comes first releases, and releases **exactly once**: a second release
of the same transfer only counts as a duplicate. A release that happens while a reader is still
streaming the blocks out is deferred until the last reader ends (otherwise the blocks could be
reused under the reader), but it is counted under the cause that triggered it.

Decode side, ``Admission``: a bounded number (and byte volume) of inbound transfers may be
pending at once; beyond that ``try_admit`` returns None and the worker refuses with a
retryable status. Each admitted ``Ticket`` is released exactly once.

Every counter here is exported on the worker's ``/metrics``; ``leaked`` invariants are checked
against the block manager's reference counts by ``workers.transfer.kv_transfer``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field


class Release(str, enum.Enum):
    CONSUMER = "consumer"  # every consumer reported done (success or its own failure)
    TIMEOUT = "timeout"  # the deadline passed first
    CANCEL = "cancel"  # the request was cancelled (client gone, gateway gave up)


class TransferGone(KeyError):
    """The transfer is unknown or already released (a late pull, after a cancel or timeout)."""


@dataclass(slots=True)
class Transfer:
    transfer_id: str
    block_ids: tuple[int, ...]  # pinned in the engine's block manager, chain order
    keys: tuple[int, ...]  # router keys of those blocks (same order)
    pending: set[str]  # consumers not done yet
    created: float
    deadline: float
    state_key: int | None = None  # hybrid models: the pinned state checkpoint (keys[-1])
    readers: int = 0  # pulls streaming the blocks out right now
    released_by: Release | None = None  # set once; the unpin may wait for readers
    unpinned: bool = False
    outcomes: dict[str, str] = field(default_factory=dict)  # consumer -> what it reported

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


@dataclass(slots=True)
class RegistryCounters:
    created: int = 0
    pinned_blocks_total: int = 0
    released: dict[Release, int] = field(default_factory=lambda: {r: 0 for r in Release})
    duplicate_releases: int = 0  # releases of an already released or unknown transfer
    late_pulls: int = 0  # pulls refused because the transfer was already released


class TransferRegistry:
    """Prefill-side transfers. ``unpin(block_ids)`` hands the blocks back to the block manager
    and ``unpin_state(key)`` a transfer's state checkpoint (both must be non-blocking: the engine
    thread does the work); they are called exactly once per transfer, never while a reader holds it."""

    def __init__(self, unpin: Callable[[tuple[int, ...]], None], ttl_s: float = 30.0,
                 unpin_state: Callable[[int], None] | None = None) -> None:
        if ttl_s <= 0:
            raise ValueError(f"transfer ttl must be positive, got {ttl_s}")
        self._unpin = unpin
        self._unpin_state = unpin_state
        self.ttl_s = ttl_s
        self._live: dict[str, Transfer] = {}  # not yet unpinned
        self.counters = RegistryCounters()

    # ---- lifecycle ---------------------------------------------------------------------------

    def add(
        self,
        transfer_id: str,
        block_ids: Iterable[int],
        keys: Iterable[int],
        consumers: Iterable[str],
        now: float,
        ttl_s: float | None = None,
        state_key: int | None = None,
    ) -> Transfer:
        """Take ownership of pinned blocks (and of a pinned state checkpoint: ``state_key``, the
        last block's key). With no consumer they are released at once."""
        if transfer_id in self._live:
            raise ValueError(f"duplicate transfer id {transfer_id!r}")
        bids, ks = tuple(block_ids), tuple(keys)
        if len(bids) != len(ks):
            raise ValueError("block_ids and keys must have the same length")
        if state_key is not None and (self._unpin_state is None or not ks or state_key != ks[-1]):
            raise ValueError("a transfer's state is the checkpoint of its last block, on a registry that unpins states")
        t = Transfer(transfer_id, bids, ks, set(consumers), now, now + (ttl_s or self.ttl_s), state_key)
        self._live[transfer_id] = t
        self.counters.created += 1
        self.counters.pinned_blocks_total += len(bids)
        if not t.pending:
            self._release(t, Release.CONSUMER)
        return t

    def get(self, transfer_id: str) -> Transfer:
        """A transfer that may still be read; raises ``TransferGone`` otherwise."""
        t = self._live.get(transfer_id)
        if t is None or t.released_by is not None:
            raise TransferGone(transfer_id)
        return t

    def consumer_done(self, transfer_id: str, consumer: str, outcome: str = "ok") -> bool:
        """``consumer`` is finished with the blocks (whatever its outcome). True when this call
        released the transfer (it was the last consumer)."""
        t = self._live.get(transfer_id)
        if t is None or t.released_by is not None or consumer not in t.pending:
            self.counters.duplicate_releases += 1
            return False
        t.pending.discard(consumer)
        t.outcomes[consumer] = outcome
        if t.pending:
            return False
        self._release(t, Release.CONSUMER)
        return True

    def cancel(self, transfer_id: str) -> bool:
        """Nobody will consume the blocks any more. True when this call released them."""
        t = self._live.get(transfer_id)
        if t is None or t.released_by is not None:
            self.counters.duplicate_releases += 1
            return False
        self._release(t, Release.CANCEL)
        return True

    def expire(self, now: float) -> int:
        """Release every transfer past its deadline; returns how many this call released."""
        due = [t for t in self._live.values() if t.released_by is None and t.deadline <= now]
        for t in due:
            self._release(t, Release.TIMEOUT)
        return len(due)

    def next_deadline(self) -> float | None:
        return min((t.deadline for t in self._live.values() if t.released_by is None), default=None)

    # ---- readers -------------------------------------------------------------------------

    def begin_read(self, transfer_id: str) -> Transfer:
        """Hold the blocks for one pull (a release waits for it). Raises ``TransferGone``."""
        try:
            t = self.get(transfer_id)
        except TransferGone:
            self.counters.late_pulls += 1
            raise
        t.readers += 1
        return t

    def end_read(self, t: Transfer) -> None:
        if t.readers <= 0:
            raise RuntimeError(f"end_read without begin_read on transfer {t.transfer_id}")
        t.readers -= 1
        if t.readers == 0 and t.released_by is not None:
            self._unpin_once(t)

    # ---- internals -------------------------------------------------------------------------

    def _release(self, t: Transfer, cause: Release) -> None:
        t.released_by = cause
        self.counters.released[cause] += 1
        if t.readers == 0:
            self._unpin_once(t)

    def _unpin_once(self, t: Transfer) -> None:
        if t.unpinned:
            return
        t.unpinned = True
        del self._live[t.transfer_id]
        self._unpin(t.block_ids)
        if t.state_key is not None and self._unpin_state is not None:
            self._unpin_state(t.state_key)

    # ---- views -----------------------------------------------------------------------------

    @property
    def active(self) -> int:
        """Transfers whose blocks are still pinned (including released ones awaiting a reader)."""
        return len(self._live)

    @property
    def pinned_blocks(self) -> int:
        return sum(t.num_blocks for t in self._live.values())

    def describe(self, now: float) -> list[dict[str, object]]:
        """The live transfers (debugging and tests)."""
        return [{"transfer_id": t.transfer_id, "num_blocks": t.num_blocks, "state": t.state_key is not None,
                 "pending": sorted(t.pending),
                 "readers": t.readers, "released_by": t.released_by.value if t.released_by else None,
                 "expires_in_s": round(t.deadline - now, 3)} for t in self._live.values()]

    def stats(self) -> dict[str, float]:
        c = self.counters
        return {
            "transfers_created": c.created,
            "transfers_active": self.active,
            "transfer_pinned_blocks": self.pinned_blocks,
            "transfer_pinned_states": sum(t.state_key is not None for t in self._live.values()),
            "transfer_pinned_blocks_total": c.pinned_blocks_total,
            "transfers_released_by_consumer": c.released[Release.CONSUMER],
            "transfers_released_by_timeout": c.released[Release.TIMEOUT],
            "transfers_released_by_cancel": c.released[Release.CANCEL],
            "transfer_duplicate_releases": c.duplicate_releases,
            "transfer_late_pulls": c.late_pulls,
        }


# ---- decode side: admission -----------------------------------------------------------------


@dataclass(slots=True)
class Ticket:
    """One admitted inbound transfer's share of the bounds; released exactly once."""

    nbytes: int
    owner: Admission
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.owner._give_back(self)


@dataclass(slots=True)
class AdmissionCounters:
    admitted: int = 0
    refused: int = 0
    peak_pending: int = 0
    peak_bytes: int = 0


class Admission:
    """Bounds pending inbound transfers by count and by bytes; the bounds are never exceeded
    (``peak_*`` <= ``max_*``). A transfer larger than ``max_bytes`` on its own can never be
    admitted: ``too_large`` tells it apart from a full queue (a permanent, not a retryable,
    refusal)."""

    def __init__(self, max_pending: int, max_bytes: int) -> None:
        if max_pending < 1 or max_bytes < 1:
            raise ValueError("max_pending and max_bytes must be at least 1")
        self.max_pending = max_pending
        self.max_bytes = max_bytes
        self.pending = 0
        self.pending_bytes = 0
        self.counters = AdmissionCounters()

    def too_large(self, nbytes: int) -> bool:
        return nbytes > self.max_bytes

    def try_admit(self, nbytes: int) -> Ticket | None:
        if self.pending >= self.max_pending or self.pending_bytes + nbytes > self.max_bytes:
            self.counters.refused += 1
            return None
        self.pending += 1
        self.pending_bytes += nbytes
        c = self.counters
        c.admitted += 1
        c.peak_pending = max(c.peak_pending, self.pending)
        c.peak_bytes = max(c.peak_bytes, self.pending_bytes)
        return Ticket(nbytes, self)

    def _give_back(self, ticket: Ticket) -> None:
        self.pending -= 1
        self.pending_bytes -= ticket.nbytes
        if self.pending < 0 or self.pending_bytes < 0:
            raise RuntimeError("admission accounting went negative")

    def stats(self) -> dict[str, float]:
        c = self.counters
        return {
            "admission_pending": self.pending,
            "admission_pending_bytes": self.pending_bytes,
            "admission_max_pending": self.max_pending,
            "admission_max_bytes": self.max_bytes,
            "admission_admitted": c.admitted,
            "admission_refused": c.refused,
            "admission_peak_pending": c.peak_pending,
            "admission_peak_bytes": c.peak_bytes,
        }
