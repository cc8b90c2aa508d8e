"""Session-aware retention: which sessions a worker keeps cached when its sessions do not all fit.

Agentic sessions come back turn after turn. When the prompts of the sessions active on a worker
add up to more than its GPU KV capacity, an LRU cache thrashes: each session returns after the
others and finds its own blocks evicted, since they are the least recently used. Keeping the
sessions that fit resident, and having the rest evicted first, turns that cycle of misses into
hits for most sessions at the cost of the few that did not fit.

The planner keeps, per target, the footprint of each active session routed there (the blocks of
its last prompt plus its output) in seniority order (first routed there first). The senior
sessions whose footprints fit within ``fill`` of the target's KV capacity are kept; a request of
any other session is marked *spill*, and the gateway asks the worker to evict that request's
blocks before any other once it ends (``x-mesh-retention: spill``; the bundled worker honours
it, other workers ignore it). A session counts while a request of it runs and, once none does,
for ``idle_factor`` times the longest think gap it has shown (from a request's end to its next
request; sessions without one yet: the typical gap of all sessions), at least ``MIN_IDLE_S`` and
at most ``active_s``: a session that ended, or paused for far longer than its turns, must not keep
the room of the sessions still working. It leaves the target's plan when it moves. Targets of
unknown capacity spill nothing.

The same plans give every target its *session footprint* (``TargetState.session_blocks``: the
blocks its active sessions need, whether they fit or not), which placement reads to tell a worker
with room for one more session from one already over-committed. The planner keeps it current at
every commit (the old and the new home of the session) and at ``refresh`` (idle sessions leave).

Owned by the ``Router`` (gateway and simulator alike); the plan of a target is recomputed at most
every ``REPLAN_S`` (footprints grow by a turn at a time), so a request costs a dict lookup.
With ``spill_hint`` off the footprints are kept and no request is marked.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from policies.base import TargetState

REPLAN_S = 0.1
MIN_IDLE_S = 0.5  # the shortest idle time after which a session stops counting
GAP_EWMA = 0.1  # weight of a new think gap in the typical gap of all sessions
# How often ``refresh`` drops idle sessions from every plan: a scan of all active sessions, so
# seldom next to ``active_s`` (30 s by default) rather than at every decision
REFRESH_S = 1.0
RETENTION_HEADER = "x-mesh-retention"  # the hint's header, sent by the gateway, read by the bundled worker
SPILL = "spill"  # its one value: evict this request's blocks first


@dataclass(slots=True)
class _TargetPlan:
    blocks: dict[str, int] = field(default_factory=dict)  # session -> footprint, in seniority order
    seen: dict[str, float] = field(default_factory=dict)  # session -> its last request's start
    spill: frozenset[str] = frozenset()
    planned_at: float = float("-inf")
    capacity: int = 0  # the capacity the plan was made for
    total: int = 0  # sum of ``blocks``: the footprint of every active session here


class RetentionPlanner:
    """Marks the requests of sessions that do not fit their target's cache (the module docstring)."""

    def __init__(self, fill: float = 0.9, active_s: float = 30.0, spill_hint: bool = True,
                 idle_factor: float = 3.0) -> None:
        if not 0 < fill <= 1:
            raise ValueError(f"retention fill must be in (0, 1], got {fill}")
        if not active_s > 0:
            raise ValueError(f"retention active_s must be > 0, got {active_s}")
        if not idle_factor >= 0:
            raise ValueError(f"retention idle_factor must be >= 0, got {idle_factor}")
        self.fill = fill
        self.active_s = active_s
        self.spill_hint = spill_hint
        self.idle_factor = idle_factor  # 0: a session counts for active_s after its last request started
        self._refreshed_at = float("-inf")
        self._plans: dict[str, _TargetPlan] = {}
        self._home: dict[str, str] = {}  # session -> the target whose plan holds it
        # Idle time, per session of some plan: requests running; since when none runs; the
        # longest think gap seen. Entries leave with the session (``_drop``).
        self._running: dict[str, int] = {}
        self._idle_since: dict[str, float] = {}
        self._gap: dict[str, float] = {}
        self._typical_gap: float | None = None  # over every session's gaps (GAP_EWMA)
        self.spilled = 0  # requests marked spill

    def spill(self, session_id: str, target: TargetState, blocks: int, now: float,
              targets: Mapping[str, TargetState]) -> bool:
        """Record a request of ``session_id`` routed to ``target`` (``blocks``: its footprint) and
        say whether its blocks should be evicted before others' once it ends. ``targets`` (the
        router's) get their ``session_blocks`` updated: the session's old home and its new one.
        Pair every call with ``ended`` when the request ends."""
        self._started(session_id, now)
        home = self._home.get(session_id)
        if home != target.id:
            if home is not None:
                self._leave(session_id, home, targets)
            self._home[session_id] = target.id
        plan = self._plans.setdefault(target.id, _TargetPlan())
        plan.total += blocks - plan.blocks.get(session_id, 0)
        plan.blocks[session_id] = blocks
        plan.seen[session_id] = now
        if now - plan.planned_at >= REPLAN_S or plan.capacity != target.kv_capacity_blocks or home != target.id:
            self._replan(plan, target.kv_capacity_blocks, now)
        target.session_blocks = plan.total
        if target.kv_capacity_blocks <= 0 or not self.spill_hint:
            return False
        if session_id in plan.spill:
            self.spilled += 1
            return True
        return False

    def ended(self, session_id: str, now: float) -> None:
        """A request of ``session_id`` ended: once none runs, the session is idle from ``now``."""
        running = self._running.pop(session_id, 0) - 1
        if running > 0:
            self._running[session_id] = running
        elif session_id in self._home:
            self._idle_since[session_id] = now

    def _started(self, session_id: str, now: float) -> None:
        """A request of ``session_id`` starts: the think gap since its last one ended is measured."""
        since = self._idle_since.pop(session_id, None)
        if since is not None:
            gap = now - since
            self._gap[session_id] = max(self._gap.get(session_id, 0.0), gap)
            typical = self._typical_gap
            self._typical_gap = gap if typical is None else typical + GAP_EWMA * (gap - typical)
        self._running[session_id] = self._running.get(session_id, 0) + 1

    def _idle_out(self, session_id: str, started: float, now: float) -> bool:
        """Whether ``session_id`` (its last request started at ``started``) stopped counting."""
        if self._running.get(session_id):
            return False
        if self.idle_factor <= 0:
            return now - started > self.active_s
        since = self._idle_since.get(session_id, started)
        gap = self._gap.get(session_id, self._typical_gap)
        limit = self.active_s if gap is None else min(self.active_s, max(MIN_IDLE_S, self.idle_factor * gap))
        return now - since > limit

    def _drop(self, session_id: str) -> None:
        """``session_id`` left every plan: its idle-time state goes with it (running requests
        stay counted until they end)."""
        self._home.pop(session_id, None)
        self._idle_since.pop(session_id, None)
        self._gap.pop(session_id, None)

    def refresh(self, targets: Mapping[str, TargetState], now: float) -> None:
        """Every ``REFRESH_S`` at most: idle sessions (the module docstring) leave every plan, and each
        target's ``session_blocks`` is set from its plan (a target no request reached since
        its sessions went idle must not look full)."""
        if now - self._refreshed_at < REFRESH_S:
            return
        self._refreshed_at = now
        for tid, plan in self._plans.items():
            state = targets.get(tid)
            if state is not None:
                self._replan(plan, state.kv_capacity_blocks, now)
                state.session_blocks = plan.total

    def forget_target(self, target: str) -> None:
        """``target`` left the registry: its plan goes with it."""
        plan = self._plans.pop(target, None)
        for sid in plan.blocks if plan is not None else ():
            if self._home.get(sid) == target:
                self._drop(sid)

    def spilling(self, target: str) -> int:
        """Sessions the target's current plan marks spill."""
        plan = self._plans.get(target)
        return len(plan.spill) if plan is not None else 0

    def _leave(self, session_id: str, target: str, targets: Mapping[str, TargetState]) -> None:
        plan = self._plans.get(target)
        if plan is not None:
            plan.total -= plan.blocks.pop(session_id, 0)
            plan.seen.pop(session_id, None)
            state = targets.get(target)
            if state is not None:
                state.session_blocks = plan.total

    def _replan(self, plan: _TargetPlan, capacity: int, now: float) -> None:
        """Drop idle sessions; keep the senior ones that fit, spill the rest."""
        idle = [sid for sid, t in plan.seen.items() if self._idle_out(sid, t, now)]
        for sid in idle:
            plan.total -= plan.blocks.pop(sid)
            del plan.seen[sid]
            self._drop(sid)
        budget = self.fill * capacity if capacity > 0 else float("inf")  # unknown capacity spills nothing
        used = 0
        spill = []
        for sid, blocks in plan.blocks.items():
            if used + blocks <= budget:
                used += blocks
            else:
                spill.append(sid)
        plan.spill = frozenset(spill)
        plan.planned_at = now
        plan.capacity = capacity
