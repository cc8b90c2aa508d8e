"""Session bindings with idle expiry: which target a returning session goes back to.

``SessionTable`` implements ``mesh.core.router.SessionStore``. Ownership: the ``Router`` writes
bindings (``bind``, after a real decision); policies only read them (``bound_target``), through
``ClusterView.sessions``; the gateway's housekeeping calls ``expire(now)`` (``bind`` does too).

Invariants:
- A binding is live while ``last_used + idle_ttl_s > now``; ``bound_target`` answers exactly
  that, whether or not ``expire`` has run yet. ``last_used`` is the latest routing of a request
  of the session (``bind``) or end of one (``touch``, from the router's lease).
- A session is not idle while a request of it runs: between ``begin`` (the router's commit) and
  the matching ``end`` (its lease's end) its ``last_used`` is ``inf``, so it neither expires
  (however long the turn streams) nor goes before an idle session in LRU eviction; the last
  ``end`` of its concurrent requests sets ``last_used`` to that end's time. ``_active`` counts
  the requests in flight per session (bounded by the gateway's in-flight requests).
- ``_order`` holds one ``(last_used, seq, session)`` entry per binding, sorted, so expiry pops
  from the front: O(log n) per expired binding, never a scan.
- ``_counts[target]`` is the number of bindings pointing at ``target`` (live, or expired but not
  yet popped by ``expire``); it is O(1) to read and never negative.
- At most ``max_sessions`` bindings: binding a new session beyond that evicts the least recently
  used one, so memory stays bounded under millions of one-shot sessions.
- Session ids are already hashed by the gateway (``session_key``); an id longer than
  ``MAX_ID_CHARS`` is hashed here too, so a hostile id cannot take more than a fixed size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import xxhash
from sortedcontainers import SortedList

MAX_ID_CHARS = 64


def session_key(raw: str | bytes | None, salt: str = "") -> str | None:
    """The bounded, hashed form of a client's session id; None when empty or absent.

    A fixed 32-hex-char digest (xxh3-128, salted per deployment): never the raw id, so a huge or
    hostile id costs nothing to store and is never logged.
    """
    if raw is None:
        return None
    data = raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogatepass")
    data = data.strip()
    if not data:
        return None
    return xxhash.xxh3_128_hexdigest(data, seed=xxhash.xxh3_64_intdigest(salt.encode()))


class SessionTable:
    """In-memory session -> target bindings, expired after ``idle_ttl_s`` without use."""

    def __init__(self, idle_ttl_s: float = 600.0, max_sessions: int = 1_000_000) -> None:
        if isinstance(idle_ttl_s, bool) or not isinstance(idle_ttl_s, (int, float)) \
                or not math.isfinite(idle_ttl_s) or idle_ttl_s <= 0:
            raise ValueError(f"idle_ttl_s must be finite and > 0, got {idle_ttl_s!r}")
        if isinstance(max_sessions, bool) or not isinstance(max_sessions, int) or max_sessions < 1:
            raise ValueError(f"max_sessions must be an integer >= 1, got {max_sessions!r}")
        self.idle_ttl_s = float(idle_ttl_s)
        self.max_sessions = max_sessions
        self._bindings: dict[str, tuple[str, float, int]] = {}  # session -> (target, last_used, seq)
        self._order: SortedList = SortedList()  # (last_used, seq, session)
        self._counts: dict[str, int] = {}
        # Called with (target, live sessions) whenever a target's count changes; the Router sets
        # it to keep TargetState.live_sessions current without a per-decision scan.
        self.count_listener: Callable[[str, int], None] | None = None
        self._active: dict[str, int] = {}  # session -> its requests in flight (begin .. end)
        self._seq = 0
        self.created = 0
        self.moves = 0
        self.expired = 0
        self.evicted = 0
        self.unbound = 0
        self.scans = 0  # passes over every binding (``unbind_targets``): one per removal event

    # -- reads (policies) --
    def bound_target(self, session_id: str, now: float) -> str | None:
        if not session_id:
            return None
        b = self._bindings.get(_norm(session_id))
        if b is None or b[1] + self.idle_ttl_s <= now:
            return None
        return b[0]

    def live_sessions(self, target: str) -> int:
        return self._counts.get(target, 0)

    def __len__(self) -> int:
        return len(self._bindings)

    # -- writes (router, housekeeping) --
    def bind(self, session_id: str, target: str, now: float) -> bool:
        """Bind or refresh ``session_id`` on ``target``; True when it moved from another live target."""
        if not session_id:
            raise ValueError("empty session id")
        sid = _norm(session_id)
        self.expire(now)
        old = self._bindings.get(sid)
        moved = False
        if old is None:
            if len(self._bindings) >= self.max_sessions:
                self._evict_lru()
            self._inc(target)
            self.created += 1
            last = math.inf if sid in self._active else now
        else:
            old_target, last, seq = old
            self._order.remove((last, seq, sid))
            if old_target != target:
                self._dec(old_target)
                self._inc(target)
                self.moves += 1
                moved = True
            last = max(last, now)  # a late-arriving, older timestamp never shortens a binding
        self._seq += 1
        self._order.add((last, self._seq, sid))
        self._bindings[sid] = (target, last, self._seq)
        return moved

    def touch(self, session_id: str, target: str, now: float) -> None:
        """A request of the session on ``target`` ended at ``now``: a session is not idle while
        a request of it runs, so its idle time starts now. A binding moved to another live target
        meanwhile (a later turn) is left alone; one that expired or was evicted while the request
        ran is bound again (it was in use)."""
        b = self._bindings.get(_norm(session_id))
        if b is not None and b[0] != target and b[1] + self.idle_ttl_s > now:
            return
        self.bind(session_id, target, now)

    def begin(self, session_id: str, now: float) -> None:
        """A request of the session was routed (after ``bind``): it is not idle until its ``end``."""
        sid = _norm(session_id)
        n = self._active[sid] = self._active.get(sid, 0) + 1
        if n == 1:
            self._rekey(sid, math.inf)

    def end(self, session_id: str, now: float) -> None:
        """A request of the session ended at ``now`` (every ``begin`` has exactly one): once none
        is left in flight, its idle time starts now."""
        sid = _norm(session_id)
        n = self._active.get(sid, 0) - 1
        if n > 0:
            self._active[sid] = n
            return
        self._active.pop(sid, None)
        self._rekey(sid, now)

    def _rekey(self, sid: str, last: float) -> None:
        b = self._bindings.get(sid)
        if b is None:
            return
        target, old, seq = b
        self._order.remove((old, seq, sid))
        self._order.add((last, seq, sid))
        self._bindings[sid] = (target, last, seq)

    def expire(self, now: float) -> int:
        """Drop every binding idle for ``idle_ttl_s`` or longer; returns how many."""
        order, ttl, n = self._order, self.idle_ttl_s, 0
        while order and order[0][0] + ttl <= now:
            _, _, sid = order.pop(0)
            self._dec(self._bindings.pop(sid)[0])
            n += 1
        self.expired += n
        return n

    def unbind(self, session_id: str) -> bool:
        sid = _norm(session_id)
        b = self._bindings.pop(sid, None)
        if b is None:
            return False
        self._order.remove((b[1], b[2], sid))
        self._dec(b[0])
        self.unbound += 1
        return True

    def unbind_target(self, target: str) -> int:
        return self.unbind_targets((target,))

    def unbind_targets(self, targets: Iterable[str]) -> int:
        """Drop every binding of removed targets (a worker's ranks, or every worker a reload
        removed) in one pass over the bindings: O(bindings), an admin event, not a hot path.
        Callers gather all the targets of one change into one call (``scans`` counts passes)."""
        gone = frozenset(targets)
        if not gone.intersection(self._counts):
            return 0
        self.scans += 1
        doomed = [sid for sid, b in self._bindings.items() if b[0] in gone]
        if len(doomed) * 8 >= len(self._bindings) and type(self).unbind is SessionTable.unbind:
            self._unbind_bulk(doomed, gone)  # a large share: rebuild the order once
        else:
            for sid in doomed:
                self.unbind(sid)
        return len(doomed)

    def _unbind_bulk(self, doomed: list[str], gone: frozenset[str]) -> None:
        """``unbind`` of each of ``doomed`` (every binding of ``gone``), with ``_order`` rebuilt
        from the survivors (already sorted: no sort, no per-entry search)."""
        bindings = self._bindings
        for sid in doomed:
            del bindings[sid]
        self._order = SortedList(e for e in self._order if e[2] in bindings)
        self.unbound += len(doomed)
        for target in gone.intersection(self._counts):
            del self._counts[target]
            if self.count_listener is not None:
                self.count_listener(target, 0)

    def resize(self, max_sessions: int) -> int:
        """A new ``max_sessions`` (config reload): evicts least recently used bindings down to it;
        returns how many."""
        if isinstance(max_sessions, bool) or not isinstance(max_sessions, int) or max_sessions < 1:
            raise ValueError(f"max_sessions must be an integer >= 1, got {max_sessions!r}")
        self.max_sessions = max_sessions
        n = 0
        while len(self._bindings) > max_sessions:
            self._evict_lru()
            n += 1
        return n

    def stats(self) -> dict[str, Any]:
        return {
            "sessions": len(self._bindings),
            "max_sessions": self.max_sessions,
            "idle_ttl_s": self.idle_ttl_s,
            "created": self.created,
            "moves": self.moves,
            "expired": self.expired,
            "evicted": self.evicted,
            "unbound": self.unbound,
            "in_use": len(self._active),
            "per_target": dict(self._counts),
        }

    def next_expiries(self, n: int) -> list[tuple[str, str, float]]:
        """The ``n`` bindings that expire first, as (session, target, expiry time): the front of
        ``_order`` (O(log size + n)); a session with a request in flight never expires, so none
        is listed."""
        out = []
        for last, _, sid in self._order[:n]:
            if last == math.inf:
                break
            out.append((sid, self._bindings[sid][0], last + self.idle_ttl_s))
        return out

    # -- internals --
    def _evict_lru(self) -> None:
        _, _, sid = self._order.pop(0)
        self._dec(self._bindings.pop(sid)[0])
        self.evicted += 1

    def _inc(self, target: str) -> None:
        count = self._counts[target] = self._counts.get(target, 0) + 1
        if self.count_listener is not None:
            self.count_listener(target, count)

    def _dec(self, target: str) -> None:
        left = self._counts[target] - 1
        if left:
            self._counts[target] = left
        else:
            del self._counts[target]
        if self.count_listener is not None:
            self.count_listener(target, left)


def _norm(session_id: str) -> str:
    return session_id if len(session_id) <= MAX_ID_CHARS else session_key(session_id) or ""


class StateBackend(Protocol):
    """Where session bindings live, shared by every gateway replica (config: ``state.backend``).

    ``MemoryStateBackend`` (one process, the default) wraps the ``SessionTable``;
    ``mesh.state.redis_state.RedisStateBackend`` keeps one key per session, ``{prefix}s:{session} =
    target``, written with ``SET ... PX idle_ttl_ms`` on every use (Redis expires an idle binding)
    and read with ``GET``. The methods are async because Redis is network I/O; policies never do
    I/O, so the gateway mirrors a request's binding into its local ``SessionTable`` before the
    decision (``SharedSessionTable.mirror``) and writes the router's binding behind it. Every set
    refreshes the binding's idle TTL. A backend never raises on a backend failure: it counts it
    and answers "no shared binding" (``get``) or "not moved" (``set``), and the local table
    decides.
    """

    idle_ttl_s: float

    async def get_session(self, session_id: str, now: float) -> str | None: ...

    async def set_session(self, session_id: str, target: str, now: float) -> bool: ...

    async def delete_session(self, session_id: str) -> None: ...


class MemoryStateBackend:
    """``StateBackend`` over one process's ``SessionTable``."""

    def __init__(self, table: SessionTable) -> None:
        self.table = table
        self.idle_ttl_s = table.idle_ttl_s

    async def get_session(self, session_id: str, now: float) -> str | None:
        return self.table.bound_target(session_id, now)

    async def set_session(self, session_id: str, target: str, now: float) -> bool:
        return self.table.bind(session_id, target, now)

    async def delete_session(self, session_id: str) -> None:
        self.table.unbind(session_id)
