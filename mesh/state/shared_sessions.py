"""``SharedSessionTable`` and ``SharedState``: one gateway replica's session bindings, shared with
the other replicas through ``RedisStateBackend`` (``state.backend: redis``).

``SharedSessionTable`` is the local ``SessionTable`` that policies read (they never do I/O), plus:
``mirror`` copies the shared binding into it right before a decision (a named step of the proxy
and of ``/debug/route``), and ``bind`` / ``unbind`` / ``touch`` queue their write for the
write-behind flusher. ``SharedState`` runs it for one gateway: the flusher and the load sync
(``mesh.state.shared_load.SharedLoad``) from the lifespan, the error counter and the load
families on ``/metrics``.

Invariants: Redis is the shared truth while it answers and the local table the fallback; a read
never overwrites a local write Redis may not have yet; no write waits on the request path (the
table's docstring has the rules in full). Ownership: the table owns its write queue
(``_pending``) and the batches being written (``_flushing``); all of it runs on the gateway's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from typing import Any

from mesh.core.sessions import SessionTable, _norm
from mesh.state.redis_backend import OPS, Claim, RedisStateBackend, Refresh, Write
from mesh.state.shared_load import SharedLoad, load_families

log = logging.getLogger("mesh.state.redis_state")  # the Redis state's log channel (operators filter on it)

MAX_PENDING = 100_000  # queued binding writes kept while Redis is unreachable (newest kept)
# Bindings per write pipeline: ~25 ms of client work at 1000, well inside a call's 2 x timeout_s.
# One pipeline of every binding an outage queued (past ~10k) would take longer than that, fail,
# be queued again whole with the newer ones, and so never get through.
FLUSH_CHUNK = 1000
FLUSH_CHUNK_MIN = 16


# Why a replica's binding of a session changed to the shared one (mesh_session_replica_moves_total)
MOVE_REASONS = ("redis_unavailable", "replica_conflict")


def _target(write: Write) -> str | None:
    return write.target if isinstance(write, (Refresh, Claim)) else write


class SharedSessionTable(SessionTable):
    """The local ``SessionTable`` (read by policies), kept in step with a shared backend.

    - A shared binding overrides a different local one; a missing one keeps the local one (Redis
      restarted and lost its keys, or it is down): the next commit writes it back. Except while
      this replica's own write of the session is queued (``_pending``), in a batch being written
      (``_flushing``), or made while the read was in flight: the local binding is newer than what
      Redis answered, and ``mirror`` leaves it alone (else a move would route to the old target
      until the write lands, then flap back).
    - Write-behind: ``Router.commit`` is synchronous and does no I/O, and awaiting would add a
      Redis round trip to every session request's first byte. One flusher task drains
      ``_pending`` (last write per session wins), oldest first, at most ``_chunk`` bindings per
      pipeline (``FLUSH_CHUNK`` at most, halved after a failed one, doubled back after a good
      one), so a pipeline fits its call's time bound however many bindings an outage queued. A
      flush cancelled mid-write or failed puts its batch back (newer queued writes win; at most
      ``MAX_PENDING`` kept; bindings expired or moved locally meanwhile are not written) for the
      retry after ``retry_after_s``. The final flush (``SharedState.stop``, bounded by
      ``timeout_s``) ignores the back-off and stops at its first failed pipeline.
    - Outages (split brain and its end): a bind made while Redis is unreachable (``backend.down``:
      the decision could not see the shared binding) is queued as a ``Claim``, which never
      overwrites a shared binding. Once Redis answers, the shared binding wins wherever one
      exists: read by ``mirror`` before the session's next decision here, or found by the claim's
      write; the local binding is pointed at it (``_adopt``) and the move counted in
      ``replica_moves["redis_unavailable"]`` when it differs (the session ran on two workers
      during the outage). Where Redis holds none (it restarted empty, or the session is new), the
      first replica's claim is written and the others adopt it the same way. So after an outage
      every replica's binding of a session is the shared one by its next decision at the latest.
      A live local binding that ``mirror`` replaces outside an outage's claims (another replica
      moved the session since this one last read it) counts in ``replica_moves["replica_conflict"]``.
    - ``touch`` (a request's end: its idle time restarts) is queued as a ``Refresh`` (``SET NX``
      plus ``PEXPIRE``), which never overwrites another target: a turn ending here leaves alone a
      move another replica made and shared while it ran.
    - A session with a request in flight here (``SessionTable.begin`` .. ``end``) never expires
      locally, nor in Redis: the flusher queues a ``Refresh`` for every such session each
      ``idle_ttl_s / 2`` (``_keep_alive``), in its usual pipelines. Redis traffic stays bounded by
      the sessions in flight here, and the key keeps at least half its idle time while a turn runs.
    """

    def __init__(self, backend: RedisStateBackend, idle_ttl_s: float = 600.0, max_sessions: int = 1_000_000) -> None:
        super().__init__(idle_ttl_s, max_sessions)
        self.backend = backend
        self._pending: dict[str, Write] = {}  # session -> target to write, None to delete, or Refresh
        self._flushing: list[dict[str, Write]] = []  # batches taken from _pending, being written
        self._chunk = FLUSH_CHUNK  # bindings per pipeline now (halved after a failure)
        self._wake = asyncio.Event()
        self.mirrored = 0  # local bindings set or changed from the shared one
        self.replica_moves: dict[str, int] = dict.fromkeys(MOVE_REASONS, 0)  # live local bindings the shared one replaced
        self.shared_load: SharedLoad | None = None  # set by SharedState when state.load_sync_s > 0

    # -- the router's writes: local at once, shared by the flusher --
    def bind(self, session_id: str, target: str, now: float) -> bool:
        moved = super().bind(session_id, target, now)
        self._pending[session_id] = Claim(target) if self.backend.down else target
        self._wake.set()
        return moved

    def unbind(self, session_id: str) -> bool:
        done = super().unbind(session_id)
        if done:
            self._pending[session_id] = None
            self._wake.set()
        return done

    def touch(self, session_id: str, target: str, now: float) -> None:
        """``SessionTable.touch`` (a request on ``target`` ended), shared as a ``Refresh``: the
        idle time restarts in Redis too, without overwriting a move another replica made."""
        b = self._bindings.get(_norm(session_id))
        if b is not None and b[0] != target and b[1] + self.idle_ttl_s > now:
            return  # moved to another live target meanwhile (a later turn): left alone
        SessionTable.bind(self, session_id, target, now)  # local only: not queued as a bind
        if self._pending.get(session_id) not in (target, Claim(target)):  # a queued bind or claim of it says more: it stays
            self._pending[session_id] = Refresh(target)
            self._wake.set()

    # -- the gateway's read before a decision --
    async def mirror(self, session_id: str, now: float) -> str | None:
        """Copy the shared binding into the local table; returns it (None: keep the local one).

        Never over a local write that Redis may not have yet: one queued or being flushed (not
        even read then), or one made while the read was in flight.
        """
        if self._writing(session_id):
            return None
        local = self.bound_target(session_id, now)
        shared = await self.backend.get_session(session_id, now)
        after = self.bound_target(session_id, now)
        if self._writing(session_id) or (after is not None and after != local):
            return None  # this replica bound it meanwhile: its binding is newer than the read
        if shared is not None and shared != local:
            claim = self._pending.get(session_id)
            if isinstance(claim, Claim) and claim.target == local:  # bound here during the outage
                self._adopt(session_id, claim.target, shared)
            else:
                if local is not None:
                    self.replica_moves["replica_conflict"] += 1
                super().bind(session_id, shared, now)  # not queued: it came from the backend
            self.mirrored += 1
        return shared

    def _writing(self, session_id: str) -> bool:
        """True while a local bind or delete of the session is queued or in a batch not yet
        written (a ``Refresh`` or a ``Claim`` claims nothing newer than Redis: the shared binding
        still wins)."""
        return any(session_id in writes and not isinstance(writes[session_id], (Refresh, Claim))
                   for writes in (self._pending, *self._flushing))

    def _adopt(self, session_id: str, claimed: str, shared: str) -> None:
        """The shared binding won over this replica's ``Claim`` of ``claimed``: point the local
        binding at ``shared`` (its idle time and LRU place kept) and drop the queued claim, unless
        the session was bound elsewhere since (a newer decision: it stays)."""
        sid = _norm(session_id)
        b = self._bindings.get(sid)
        if self._pending.get(session_id) == Claim(claimed):
            del self._pending[session_id]
        if b is None or b[0] != claimed or shared == claimed:
            return
        self._dec(claimed)
        self._inc(shared)
        self._bindings[sid] = (shared, b[1], b[2])  # _order's (last_used, seq, sid) entry unchanged
        self.replica_moves["redis_unavailable"] += 1

    # -- write-behind --
    async def flush(self, *, final: bool = False) -> bool:
        """Write the queued bindings, a pipeline of at most ``_chunk`` at a time, until none is
        left or one fails (False); ``final`` (shutdown) ignores the back-off. A backend that
        refused its configuration (``local_only``) drops them: nothing is ever written."""
        if self.backend.local_only:
            self._pending.clear()
            return True
        while self._pending:
            if not await self._flush_chunk(final):
                return False
        return True

    async def _flush_chunk(self, final: bool) -> bool:
        """Write the oldest ``_chunk`` queued bindings in one pipeline.

        A batch that failed (Redis down, slow, or backing off) is queued again (newer writes win)
        for the flusher's retry, minus what has expired or moved locally meanwhile: a binding made
        during a blip of Redis is shared once Redis answers, not at its session's next request.
        """
        if len(self._pending) <= self._chunk:
            batch, self._pending = self._pending, {}
        else:
            batch = {sid: self._pending.pop(sid) for sid in list(itertools.islice(self._pending, self._chunk))}
        self.backend.idle_ttl_s = self.idle_ttl_s  # a config reload changes the table's TTL
        self._flushing.append(batch)
        lost: dict[str, str] = {}  # claims Redis held another binding of: that one wins
        try:
            ok = await self.backend.write_many(batch, backoff=not final, lost=lost)
        except asyncio.CancelledError:
            self._requeue(batch)  # back for the final flush
            raise
        finally:
            self._flushing.remove(batch)
        for sid, shared in lost.items():
            self._adopt(sid, _target(batch[sid]) or "", shared)
        self._chunk = min(FLUSH_CHUNK, self._chunk * 2) if ok else max(FLUSH_CHUNK_MIN, self._chunk // 2)
        if not ok and not final:
            self._requeue(batch)
        return ok

    def _requeue(self, batch: dict[str, Write]) -> None:
        """Put a batch back under the newer queued writes; the queue keeps its newest MAX_PENDING.

        A binding no longer held locally (expired, evicted or moved since) is not put back: a retry
        must not bring it back to life in Redis (the table's expiry passes remove idle bindings,
        so presence, whatever the clock, is what counts here).
        """
        held = {sid: t for sid, t in batch.items() if t is None or self.bound_target(sid, -math.inf) == _target(t)}
        self._pending = {**held, **self._pending}
        extra = len(self._pending) - MAX_PENDING
        if extra > 0:  # oldest first (insertion order): a long outage must not grow it without bound
            for sid in list(itertools.islice(self._pending, extra)):
                del self._pending[sid]

    def _keep_alive(self) -> int:
        """Queue a ``Refresh`` for each session with a request in flight here (not already queued:
        a queued write restarts its idle time too); returns how many. ``_active`` holds normalized
        ids, which are the gateway's (hashed, 32 chars) as they are."""
        queued = 0
        for sid in self._active:
            b = self._bindings.get(sid)
            if b is None or sid in self._pending:
                continue
            self._pending[sid] = Refresh(b[0])
            queued += 1
        if queued:
            self._wake.set()
        return queued

    async def run_flusher(self) -> None:
        keep_at = time.monotonic() + self.idle_ttl_s / 2
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, keep_at - time.monotonic())):
                    await self._wake.wait()
            now = time.monotonic()
            if now >= keep_at:  # in-flight sessions' shared bindings must outlive their turns
                self._keep_alive()
                keep_at = now + self.idle_ttl_s / 2  # a reload's new TTL applies from the next round
            self._wake.clear()
            if not await self.flush() and self._pending:
                await asyncio.sleep(self.backend.retry_after_s)  # retry once the back-off is over
                self._wake.set()

    def stats(self) -> dict[str, Any]:
        load = self.shared_load.stats() if self.shared_load is not None else None
        return {**super().stats(), "mirrored": self.mirrored, "replica_moves": dict(self.replica_moves),
                "backend": self.backend.stats(), "load": load}


def shared_session_table(config: Any) -> SharedSessionTable:
    """The gateway's session table for ``state.backend: redis`` (``config``: a ``MeshConfig``)."""
    state, sessions = config.state, config.sessions
    backend = RedisStateBackend(state.url, sessions.idle_ttl_s, key_prefix=state.key_prefix, timeout_s=state.timeout_s,
                                cluster=state.cluster, seeds=tuple(state.cluster_seeds))
    return SharedSessionTable(backend, sessions.idle_ttl_s, sessions.max_sessions)


def replica_moves_family(table: SharedSessionTable) -> Any:
    """``mesh_session_replica_moves_total{reason}``: this replica's live bindings that the shared
    one replaced (the table's ``replica_moves``)."""
    from prometheus_client.core import CounterMetricFamily

    family = CounterMetricFamily("mesh_session_replica_moves", "Sessions whose binding on this replica was replaced "
                                 "by a different shared one (another replica's decision), by reason", labels=["reason"])
    for reason, n in table.replica_moves.items():
        family.add_metric([reason], n)
    return family


class SharedState:
    """The Redis side of one gateway replica: the shared table's flusher, load sync and metrics.

    Built by ``mesh.gateway.app.build_gateway`` when ``state.backend: redis``; the gateway calls
    ``start`` and ``stop`` in its lifespan. The per-request step (``table.mirror`` of a parsed
    request's session before its decision) is the proxy's, named there.
    """

    def __init__(self, table: SharedSessionTable, targets: Any, metrics: Any, load_sync_s: float) -> None:
        self.table = table
        self.backend = table.backend
        errors = metrics.counter(
            "mesh_state_backend_errors", "State backend (Redis) calls that failed or timed out; the gateway went local", ["op"]
        )
        for op in OPS:
            errors.labels(op)
        self.backend.on_error = lambda op: errors.labels(op).inc()
        metrics.add_collector(lambda: [replica_moves_family(table)])
        self.load = SharedLoad(self.backend, targets, load_sync_s) if load_sync_s > 0 else None
        table.shared_load = self.load  # read by tests and stats; None when load sharing is off
        if self.load is not None:
            load = self.load
            metrics.add_collector(lambda: load_families(load))
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        if not await self.backend.ping() and not self.backend.local_only:  # local_only: an ERROR said why
            log.warning("state backend %s not reachable at start; using local session bindings and load until it is",
                        self.backend.url)  # redacted
        self._tasks.append(asyncio.create_task(self.table.run_flusher(), name="mesh-state-flusher"))
        if self.load is not None:
            self._tasks.append(asyncio.create_task(self.load.run(), name="mesh-load-sync"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        if self.load is not None:
            await self.load.leave()  # other replicas drop this one's load now, not after its TTL
        await self.table.flush(final=True)  # the last bindings, even right after an error; bounded by timeout_s
        await self.backend.aclose()
