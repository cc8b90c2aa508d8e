"""What the disaggregated relay keeps across requests; its owner runs the relays (``DisaggProxy``).

``RelayConfig`` bounds each request's attempts and waits; ``DecodeQueue`` bounds the requests
waiting for decode headroom at once (each wait is bounded in time); ``RelayStats`` counts what
the relays did; ``Releases`` holds the transfer releases sent in the background, which its
``close`` ends, so no task outlives the owner; ``WorkerHealth`` is where attempts report on
workers (the registry's passive health); ``PendingLegs`` holds the legs waiting for a worker's
answer, which ``abort`` ends when that worker turns unhealthy; ``full_for_pairs`` and
``pd_profiles`` read what pairs may form. Everything here runs on the event loop thread.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from policies.base import Policy, Role, TargetState

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
    # server.first_byte_timeout_s / idle_timeout_s, as httpx's per-read bounds: the prefill leg
    # (one token: its answer's head is its first byte) reads within the first; a streamed decode
    # leg within the longer of the two, for its head, its first chunk and each gap. A non-streamed
    # decode answer's head waits for its whole generation: only timeout_s bounds it.
    first_byte_timeout_s: float = 60.0
    idle_timeout_s: float = 60.0


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


class Leg:
    """One relay leg waiting for its worker's answer (``PendingLegs.watch``)."""

    __slots__ = ("timeout", "aborted")

    def __init__(self, timeout: asyncio.Timeout) -> None:
        self.timeout = timeout
        self.aborted = False  # ended by ``PendingLegs.abort``: its worker turned unhealthy


class PendingLegs:
    """The relay legs (prefill answers, decode first bytes) waiting on each target now. ``abort``
    expires a leg's ``asyncio.Timeout`` at once: the leg sees a ``TimeoutError`` and, seeing
    ``Leg.aborted``, retries elsewhere without charging the worker (its health check did). One
    set entry per leg in flight; ``abort`` runs when a worker turns unhealthy, never per request."""

    def __init__(self) -> None:
        self._by_target: dict[str, set[Leg]] = {}

    @contextlib.asynccontextmanager
    async def watch(self, target_id: str, deadline: float | None) -> AsyncIterator[Leg]:
        """Bound the block by ``deadline`` (loop time; None: none) and by ``abort(target_id)``."""
        async with asyncio.timeout_at(deadline) as timeout:
            leg = Leg(timeout)
            legs = self._by_target.setdefault(target_id, set())
            legs.add(leg)
            try:
                yield leg
            finally:
                legs.discard(leg)
                if not legs:
                    self._by_target.pop(target_id, None)

    def abort(self, target_ids: Iterable[str]) -> int:
        """End every leg waiting on these targets now; returns how many."""
        now = asyncio.get_running_loop().time()
        aborted = 0
        for tid in target_ids:
            for leg in self._by_target.get(tid, ()):
                if not leg.timeout.expired():
                    leg.aborted = True
                    leg.timeout.reschedule(now)
                    aborted += 1
        return aborted


class NoHealth:
    """Reports to nobody (a relay run without a registry: tests, benchmarks)."""

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


def full_for_pairs(targets: Mapping[str, TargetState]) -> list[str]:
    """Targets a new pair must leave out: those at their admission limit (``max_in_flight``),
    except decode-role ones, which the relay checks itself (waiting in the decode queue)."""
    return [t.id for t in targets.values() if t.at_admission_limit and t.role != Role.DECODE]


def pd_profiles(policy: Policy) -> Any:
    """The policy's prefill/decode profiles (``Pipeline.pd``: prefill, decode, mixed fallback), or
    None for a policy that forms no pairs."""
    # A probe, not a typed field: ``Policy`` declares no ``pd``; a plugin says it forms pairs by
    # having one (``GuardedPolicy`` forwards it), and ``policies/`` is the interface's owner.
    return getattr(policy, "pd", None)
