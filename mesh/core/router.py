"""The decision core shared by the live gateway and the simulator.

``Router.route`` builds the cluster view, asks the policy, and commits the bookkeeping that
follows a real decision: the policy's own learning hook, the session binding, the speculative
prefix-index entry and the target's load. It returns a ``Lease`` that the caller (gateway proxy or
simulated worker) releases exactly once, whatever the outcome: every path that ends a request calls
``Lease.finish`` (it is idempotent), so in-flight load can never leak or go negative.

Nothing here does I/O or reads a clock: ``now`` is passed in (simulated or wall time).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Iterable, MutableMapping
from dataclasses import dataclass, replace
from functools import partial
from typing import Protocol

from mesh.core.retention import RetentionPlanner
from policies.base import ClusterView, Decision, NoCandidate, Overlap, Policy, RequestInfo, TargetState


class SessionStore(Protocol):
    """Session bindings (``mesh.core.sessions``): read by policies, written by the router only."""

    def bound_target(self, session_id: str, now: float) -> str | None: ...

    def bind(self, session_id: str, target: str, now: float) -> bool:
        """Bind (or refresh) a session; True when it moved from another live target."""
        ...

    def touch(self, session_id: str, target: str, now: float) -> None:
        """A request of the session on ``target`` ended: its idle time starts now (optional)."""
        ...

    # Optional: ``begin`` when a request of the session is committed, ``end`` when it ends (one
    # each): the session never expires while a request of it runs (``mesh.core.sessions``).

    def live_sessions(self, target: str) -> int: ...

    def expire(self, now: float) -> int:
        """Drop bindings idle for the TTL (ordered, so it costs only what expires)."""
        ...


@dataclass(slots=True)
class RoutedView(ClusterView):
    """The view of one decision that excluded some targets (the proxy's: those at their
    admission limit, and a retry's failed workers). ``excluded`` holds their states, so that a
    policy can say why a target it looked for is not a candidate (``session_sticky``: a session
    leaving a target at its admission limit is not a session whose target is gone)."""

    excluded: tuple[TargetState, ...] = ()


class SpeculativeIndex(Protocol):
    """What the router writes to the prefix index (``mesh.core.index.PrefixIndex``): a routed
    request's blocks, assumed on its target until ``expires_at`` unless an event confirms them,
    and the expiry of those assumptions, run before every decision."""

    def store_speculative(self, target: str, keys: list[int] | tuple[int, ...], expires_at: float) -> None: ...

    def expire_speculative(self, now: float) -> int: ...


@dataclass(slots=True)
class Lease:
    """One routed request's claim on a target's load; released exactly once."""

    target: TargetState
    uncached_tokens: int
    prompt_tokens: int
    policy: Policy
    request: RequestInfo
    _phase: int = 0  # 0 prefill, 1 decode, 2 finished
    # Set for a request with a session id: the router's hook that restarts the session's idle
    # time when the request ends (a session is not idle while a request of it runs).
    on_end: Callable[[Lease, float], None] | None = None
    # The router's release hook (``Router.on_release``): capacity freed on ``target``.
    on_release: Callable[[TargetState], None] | None = None
    # Retention hint (``RetentionPlanner``): the session does not fit its target's cache, so the
    # worker should evict this request's blocks before others' once it ends.
    spill: bool = False

    @property
    def decode_tokens(self) -> int:
        """The context this request decodes over once its first token is out: the prompt, once
        per choice (each of OpenAI's ``n`` sequences reads it at every step)."""
        return self.prompt_tokens * self.request.choices

    def first_token(self) -> None:
        if self._phase == 0:
            self.target.prefill_tokens -= self.uncached_tokens
            self.target.decode_tokens += self.decode_tokens
            self._phase = 1

    def finish(self, now: float) -> None:
        if self._phase == 2:
            return
        if self._phase == 0:
            self.target.prefill_tokens -= self.uncached_tokens
        else:
            self.target.decode_tokens -= self.decode_tokens
        self.target.in_flight -= 1
        self._phase = 2
        self.policy.on_finished(self.request, self.target.id, now)
        if self.on_end is not None:
            self.on_end(self, now)
        if self.on_release is not None:
            self.on_release(self.target)

    @property
    def finished(self) -> bool:
        return self._phase == 2


# One committed decision, as ``Router.recent`` keeps it: (now, model, session id, target, reason,
# predicted cached blocks on the target, a retry's commit). Cheap fields only, no explain().
RecentDecision = tuple[float, str, str | None, str, str, int, bool]
RECENT_DECISIONS = 200


class Router:
    def __init__(
        self,
        policy: Policy,
        targets: MutableMapping[str, TargetState],
        *,
        index: object | None = None,
        sessions: SessionStore | None = None,
        speculative_ttl_s: float = 2.0,
        on_release: Callable[[TargetState], None] | None = None,
        retention: RetentionPlanner | None = None,
        seed: int | None = None,
    ) -> None:
        self.policy = policy  # swapped whole on config reload; bindings and load stay here
        self.targets = targets  # owned by the registry (gateway) or the simulator
        self.index = index
        # Optional in an index (a test's stand-in may only be read): speculative entries.
        self._store_speculative = getattr(index, "store_speculative", None)
        self._expire_speculative = getattr(index, "expire_speculative", None)
        self.sessions = sessions
        self.speculative_ttl_s = speculative_ttl_s
        self.on_release = on_release  # told after every lease's release (the gateway's admission queue)
        self.retention = retention  # session footprints per target; marks the sessions that do not fit
        self.session_moves = 0
        self.rng = random.Random(seed)  # every decision's randomness (``ClusterView.rng``)
        # The last committed decisions, newest last (the gateway's /dashboard reads them); bounded.
        self.recent: deque[RecentDecision] = deque(maxlen=RECENT_DECISIONS)
        self._touch = getattr(sessions, "touch", None)  # optional in a SessionStore
        self._begin = getattr(sessions, "begin", None)
        self._end = getattr(sessions, "end", None) if self._begin is not None else None
        if sessions is not None and hasattr(sessions, "count_listener"):
            sessions.count_listener = self._on_session_count

    def _on_session_count(self, target: str, count: int) -> None:
        state = self.targets.get(target)
        if state is not None:
            state.live_sessions = count

    def view(self, now: float, exclude: Iterable[str] = (), explain: bool = True,
             rng: random.Random | None = None) -> ClusterView:
        """The cluster as a policy sees it now; its RNG is the router's unless ``rng`` is given."""
        rng = rng or self.rng
        targets = list(self.targets.values())
        if self.sessions is not None:
            self.sessions.expire(now)  # exact idle expiry before anyone reads a binding
        if self._expire_speculative is not None:
            self._expire_speculative(now)  # likewise for blocks assumed on a target, never confirmed
        if self.retention is not None:
            self.retention.refresh(self.targets, now)  # session footprints without the idle sessions
        if exclude:
            excluded = set(exclude)
            out = [t for t in targets if t.id in excluded]
            if out:
                targets = [t for t in targets if t.id not in excluded]
                return RoutedView(targets, now, self.index, self.sessions, explain, rng, excluded=tuple(out))  # type: ignore[arg-type]
        return ClusterView(targets, now, self.index, self.sessions, explain, rng)  # type: ignore[arg-type]

    def decide(
        self, request: RequestInfo, now: float, exclude: Iterable[str] = (), explain: bool = True
    ) -> Decision:
        """The decision alone (``/debug/route``): commits nothing. Raises ``NoCandidate``.

        ``explain=False`` (the request path) lets policies skip other candidates' explanations.
        """
        return self._checked(self.policy.decide(request, self.view(now, exclude, explain)))

    def preview(self, request: RequestInfo, now: float, exclude: Iterable[str] = ()) -> Decision:
        """The decision ``decide`` would make now, leaving no trace: the policy draws from a copy
        of the router's RNG (and changes no state of its own while deciding), so the next live
        request decides as this said. Raises ``NoCandidate``."""
        return self._checked(self.policy.decide(request, self.view(now, exclude, True, self.preview_rng())))

    def preview_rng(self) -> random.Random:
        """A copy of the router's RNG in its current state (drawing from it moves the original not)."""
        rng = random.Random()
        rng.setstate(self.rng.getstate())
        return rng

    def _checked(self, decision: Decision) -> Decision:
        if decision.target is None or decision.target not in self.targets:
            raise NoCandidate(decision.reason or "policy chose no target")
        return decision

    def route(self, request: RequestInfo, now: float, exclude: Iterable[str] = ()) -> tuple[Decision, Lease]:
        """Decide and commit. The caller must eventually call ``lease.finish(now)``."""
        decision = self.decide(request, now, exclude, explain=False)
        return decision, self.commit(request, decision, now)

    def commit(self, request: RequestInfo, decision: Decision, now: float, *, bind: bool = True) -> Lease:
        """Claim the decided target's load. ``bind=False`` (a retry) leaves the session's binding
        as it is, but the session is still pinned (not idle) until the lease ends."""
        target = self.targets[decision.target]  # type: ignore[index]
        self.policy.on_routed(request, target.id, now)
        if request.session_id and bind:
            self.bind_session(request.session_id, target.id, now)
        cached = decision.overlaps.get(target.id)
        cached_tokens = min(cached.blocks * request.block_size, request.prompt_tokens) if cached else 0
        self.recent.append((now, request.model, request.session_id, target.id, decision.reason,
                            cached.blocks if cached else 0, not bind))
        if self._store_speculative is not None and request.block_keys and self.speculative_ttl_s > 0:
            self._store_speculative(target.id, request.block_keys, now + self.speculative_ttl_s)
        target.in_flight += 1
        target.routed_blocks += len(request.block_keys)
        uncached = request.prompt_tokens - cached_tokens
        target.prefill_tokens += uncached
        lease = Lease(target, uncached, request.prompt_tokens, self.policy, request, on_release=self.on_release)
        if self.retention is not None and request.session_id:
            lease.spill = self.retention.spill(request.session_id, target, request.footprint_blocks, now, self.targets)
        if request.session_id and (self._touch is not None or self._end is not None or self.retention is not None):
            if self._end is not None:
                self._begin(request.session_id, now)  # type: ignore[misc]
            lease.on_end = self._session_request_ended
        return lease

    def bind_session(self, session_id: str, target: str, now: float) -> None:
        """Bind ``session_id`` to ``target`` (``commit`` does it; a caller that committed without
        the session, a retry, binds once the target has served it); counts a move."""
        if self.sessions is not None and self.sessions.bind(session_id, target, now):
            self.session_moves += 1

    # -- a prefill -> decode pair, served so by the relay (``mesh.gateway.disagg_relay``) and the simulator --

    def commit_prefill(self, request: RequestInfo, target: str, now: float) -> Lease:
        """The prefill leg's lease on ``target``, committed without the session: the session
        binds to the worker whose answer the client gets (``decode_answered``)."""
        return self.commit(_without_session(request), Decision(target, "prefill"), now)

    def commit_decode(self, request: RequestInfo, target: str, transferred_blocks: int, now: float) -> Lease:
        """The decode leg's lease on ``target``, the blocks handed over by the prefill counted as
        its cached prefix; committed without the session (a decode worker that refuses or fails
        must not take it: each refusal would move it)."""
        decision = Decision(target, "decode", overlaps={target: Overlap(transferred_blocks)})
        return self.commit(_without_session(request), decision, now)

    def decode_answered(self, lease: Lease, session_id: str | None, now: float) -> None:
        """The decode worker of ``lease`` answers the request: the session binds to it, and is in
        use (never idle, never expired) until the lease ends."""
        if not session_id:
            return
        self.bind_session(session_id, lease.target.id, now)
        if self._begin is not None:
            self._begin(session_id, now)
        if self._touch is not None or self._end is not None:
            lease.on_end = partial(self._request_ended, session_id)

    def _session_request_ended(self, lease: Lease, now: float) -> None:
        if lease.request.session_id:
            self._request_ended(lease.request.session_id, lease, now)

    def _request_ended(self, sid: str, lease: Lease, now: float) -> None:
        """A request of session ``sid`` ended: it is idle from now (``end``; for the retention planner,
        once no other request of it runs), and its binding to the lease's target is refreshed
        (``touch``) unless that target left the registry meanwhile (its bindings were dropped with
        it: never bound again)."""
        target = lease.target
        if self.retention is not None:
            self.retention.ended(sid, now)
        if self._end is not None:
            self._end(sid, now)
        if self._touch is not None and self.targets.get(target.id) is target:
            self._touch(sid, target.id, now)


def _without_session(request: RequestInfo) -> RequestInfo:
    return replace(request, session_id=None) if request.session_id else request
