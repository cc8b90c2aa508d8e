"""Session-sticky data-parallel routing (ATOM Mesh ``dp_sticky``, made cache-aware).

A request with a session id goes back to the target (worker, DP rank) its session is bound to,
while that target is available, serves the model and is under the load ceiling. A session whose
home evicted its blocks stays there too, unless another target has room for it: recomputing at
home pollutes no other worker's cache, while moving into room the session's new home can keep
turns its old one cannot (``rehome_below``). Otherwise the session is (re)bound:

- a new session is spread: it goes among the targets under the ceiling within ``session_slack``
  of the fewest live sessions and, among those, the ones with room for it (KV capacity less the
  footprint of the sessions active there, ``TargetState.session_blocks``), the inner policy
  choosing among those (by queued work and prefix). What a new session matches elsewhere is
  recomputed once where it lands (a shared system prompt is then cached there for every later
  session too), while a session placed on a crowded worker crowds it for its whole life: a
  system prompt that is most of a first turn must not pull every new session to the first
  worker that cached it;
- a moving session goes where the inner policy puts it over the other targets under the ceiling
  (an evicted one: over those with room for it).

Reads bindings only through ``cluster.sessions.bound_target``; the ``Router`` writes them
(``SessionStore.bind``) after the decision and counts a move when a live binding changes target.
``Decision.reason`` starts with ``bound``, ``new session`` or ``rebound: <why>``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from policies import registry
from policies.base import ClusterView, Decision, NoCandidate, Overlap, Policy, RequestInfo, TargetState
from policies.params import number
from policies.registry import PluginError, register

# The inner policy when the precise kv_aware policy is not installed: prefix, live sessions, load.
FALLBACK_INNER: dict[str, Any] = {
    "name": "pipeline",
    "params": {
        "scorers": [
            {"name": "prefix", "weight": 3.0},
            {"name": "live_sessions", "weight": 2.0},
            {"name": "load", "weight": 1.0},
        ],
        "picker": "lexicographic",
    },
}


REMEMBERED_SESSIONS = 1_000_000  # last prompts (length, last key) kept for rehoming (~150 bytes each)
SPREAD_BY = ("footprint", "sessions", "kv_room")
OWNER = "policy 'session_sticky'"


def default_inner() -> str | dict[str, Any]:
    return "kv_aware" if "kv_aware" in registry.names("policy") else FALLBACK_INNER


@register("policy", "session_sticky")
class SessionSticky(Policy):
    """Sticky sessions with a load ceiling.

    Params: ``inner`` (a policy spec; default ``kv_aware`` if installed, else a lexicographic
    pipeline prefix > live_sessions > load), ``max_in_flight`` (absolute ceiling on the bound
    target's in-flight requests; 0 = none), ``load_factor`` and ``load_slack`` (relative ceiling:
    ``in_flight <= load_factor * mean in-flight + load_slack``; factor 0 = none),
    ``spread_new`` (true: a new session goes among the targets within ``session_slack`` (1) of
    the fewest live sessions, the inner policy choosing by load and prefix among them; false:
    where the inner policy puts it), ``spread_by`` (``footprint``: among those, the ones whose
    active sessions leave room for the new one's footprint, else the most room;
    ``sessions``: no further cut; ``kv_room``: the least context in flight),
    ``rehome_below`` (0.5: a session whose prompt extends its last one, and whose home holds less
    than this share of that one's blocks, moves to a target with room for its footprint, if
    there is one; 0: never), ``rebalance_margin`` (0: off; M > 0, with ``inner: kv_aware``: a
    session moves when its request's kv_aware cost at home exceeds another target's by more than M
    whole prompts, e.g. 1: its home's queue outweighs recomputing the prompt elsewhere).
    A target at its own admission ceiling (``TargetState.max_in_flight``) is over the ceiling too.

    Example::

        policy:
          name: session_sticky
          params: {inner: kv_aware, load_factor: 1.5, load_slack: 4, spread_new: true}
    """

    def __init__(
        self,
        inner: str | dict[str, Any] | None = None,
        max_in_flight: int = 0,
        load_factor: float = 1.5,
        load_slack: float = 4.0,
        spread_new: bool = True,
        session_slack: int = 1,
        spread_by: str = "footprint",
        rehome_below: float = 0.5,
        rebalance_margin: float = 0.0,
    ) -> None:
        spec = default_inner() if inner is None else inner
        self.inner: Policy = registry.create("policy", spec)
        self.max_in_flight = int(number(OWNER, "max_in_flight", max_in_flight, 0))
        self.load_factor = number(OWNER, "load_factor", load_factor, 0)
        self.load_slack = number(OWNER, "load_slack", load_slack, 0)
        if not isinstance(spread_new, bool):
            raise PluginError(f"policy 'session_sticky': spread_new must be true or false, got {spread_new!r}")
        self.spread_new = spread_new
        self.session_slack = int(number(OWNER, "session_slack", session_slack, 0))
        if spread_by not in SPREAD_BY:
            raise PluginError(f"policy 'session_sticky': spread_by must be one of {', '.join(SPREAD_BY)}, got {spread_by!r}")
        self.spread_by = spread_by
        self.rehome_below = number(OWNER, "rehome_below", rehome_below, 0.0, 1.0)
        self.rebalance_margin = number(OWNER, "rebalance_margin", rebalance_margin, 0.0)
        # the inner policy's cost of a request at a target (kv_aware's), for rebalancing
        self._inner_cost: Callable[[TargetState, float, Overlap | None, int], float] | None = \
            getattr(self.inner, "cost", None)
        if self.rebalance_margin > 0 and not callable(self._inner_cost):
            raise PluginError(f"{OWNER}: rebalance_margin needs an inner policy with a cost (kv_aware), "
                              f"got {self.inner.name!r}")
        # session -> (full blocks, last block's key) of its last prompt routed here (``on_routed``):
        # what its home should hold at a next turn that extends it; bounded, oldest forgotten
        # first (a forgotten session never rehomes)
        self._last_prompt: OrderedDict[str, tuple[int, int]] = OrderedDict()

    def decide(self, request: RequestInfo, cluster: ClusterView) -> Decision:
        sid, store = request.session_id, cluster.sessions
        if not sid:
            return self.inner.decide(request, cluster)
        if store is None:
            d = self.inner.decide(request, cluster)
            d.reason = f"no session store; {d.reason}"
            return d
        usable = [t for t in cluster.targets if t.available and (not t.models or request.model in t.models)]
        ceiling = self._ceiling(usable)
        bound = store.bound_target(sid, cluster.now)
        why = "new session"
        # New or moving session: the best target under the ceiling (all usable ones if none is).
        under = [t for t in usable if t.id != bound and not self._over(t, ceiling)]
        if bound is not None:
            state = next((t for t in cluster.targets if t.id == bound), None)
            refusal = self._why_not(request, state, usable, ceiling) if state is not None else _gone(cluster, bound)
            if refusal is None:
                move = None if state is None else self._move_for(request, cluster, state, under)
                if move is None:
                    return self._bound(request, cluster, bound)
                refusal, under = move
            why = f"rebound: {refusal}"
        narrowed = under or [t for t in usable if t.id != bound] or usable
        if not narrowed:  # every target excluded (all at their admission limit) or none serves the model
            raise NoCandidate(f"no healthy worker serves model {request.model!r}")
        if bound is None and self.spread_new:
            narrowed, why = self._spread(narrowed, request)
        view = ClusterView(narrowed, cluster.now, cluster.index, cluster.sessions, cluster.explain, cluster.rng)
        view._overlaps, view._overlaps_for = cluster.overlaps(request), request.block_keys
        d = self.inner.decide(request, view)
        d.reason = f"{why} ({d.reason})"
        return d

    def _move_for(self, request: RequestInfo, cluster: ClusterView, home: TargetState,
                  under: list[TargetState]) -> tuple[str, list[TargetState]] | None:
        """Why a session its home can serve should move anyway, and where to; None: it stays."""
        roomy = self._rehome_candidates(request, cluster, home.id, under)
        if roomy:
            return "evicted at home, room elsewhere", roomy
        cheaper = self._cheaper_elsewhere(request, cluster, home, under)
        if cheaper:
            return f"queued at home, cheaper elsewhere by over {self.rebalance_margin:g} prompts", cheaper
        return None

    def _cheaper_elsewhere(self, request: RequestInfo, cluster: ClusterView, home: TargetState,
                           under: list[TargetState]) -> list[TargetState]:
        """With ``rebalance_margin`` > 0: the targets of ``under`` where the inner ``kv_aware``
        cost of this request (its wait for a first token, prefix credit included) is lower than at
        home by more than ``rebalance_margin`` times the whole prompt: waiting at home costs more
        than recomputing the prompt there would."""
        cost = self._inner_cost
        if self.rebalance_margin <= 0 or cost is None or not under:
            return []
        get = cluster.overlaps(request).get
        bs = max(request.block_size, 1)
        prompt = request.prompt_tokens / bs
        limit = cost(home, prompt, get(home.id), bs) - self.rebalance_margin * prompt
        return [t for t in under if cost(t, prompt, get(t.id), bs) < limit]

    def _rehome_candidates(self, request: RequestInfo, cluster: ClusterView, bound: str,
                           under: list[TargetState]) -> list[TargetState]:
        """Where a session its home can serve should move anyway: the targets of ``under`` with
        room for its footprint, when this prompt extends the session's last one and home holds
        under ``rehome_below`` of that one's blocks: they were evicted (a prompt that does not
        extend the last one matches less anywhere, and proves nothing); else none (with no room
        elsewhere, recomputing at home is best)."""
        n, last_key = self._last_prompt.get(request.session_id or "", (0, 0))
        keys = request.block_keys
        if self.rehome_below <= 0 or n == 0 or len(keys) < n or keys[n - 1] != last_key:
            return []
        ov = cluster.overlaps(request).get(bound)
        if ov is not None and ov.gpu_blocks + ov.cpu_blocks >= self.rehome_below * n:
            return []
        need = request.footprint_blocks
        return [t for t in under if _room(t) >= need]

    def _spread(self, candidates: list[TargetState], request: RequestInfo) -> tuple[list[TargetState], str]:
        """A new session's candidates: within ``session_slack`` of the fewest live sessions and,
        with ``spread_by: footprint``, among those the ones with room for the request's footprint
        (none: the ones with the most room; no capacity known: no cut); with ``kv_room``, the least context in flight (the KV
        its running sessions hold now: prompt work queued plus context decoding)."""
        cap = min(t.live_sessions for t in candidates) + self.session_slack
        out = [t for t in candidates if t.live_sessions <= cap]
        if self.spread_by == "footprint":
            need = request.footprint_blocks
            fits = [t for t in out if _room(t) >= need]
            if fits:
                return fits, f"new session, spread (<= {cap} live sessions, room for {need} blocks)"
            most = max(_room(t) for t in out)
            if most > -math.inf:  # some capacity known: the most room
                out = [t for t in out if _room(t) == most]
                return out, f"new session, spread (<= {cap} live sessions, none with room for {need} blocks)"
        if self.spread_by == "kv_room":
            room = min(t.prefill_tokens + t.decode_tokens for t in out)
            out = [t for t in out if t.prefill_tokens + t.decode_tokens == room]
            return out, f"new session, spread (<= {cap} live sessions, {room} tokens in flight)"
        return out, f"new session, spread (<= {cap} live sessions)"

    def _bound(self, request: RequestInfo, cluster: ClusterView, bound: str) -> Decision:
        ov = cluster.overlaps(request)
        return Decision(bound, "bound", {bound: {"session_affinity": 1.0}}, ov if type(ov) is dict else dict(ov))

    def _ceiling(self, usable: list[TargetState]) -> float:
        ceiling = float(self.max_in_flight) if self.max_in_flight > 0 else math.inf
        if self.load_factor > 0 and usable:
            mean = sum(t.in_flight for t in usable) / len(usable)
            ceiling = min(ceiling, self.load_factor * mean + self.load_slack)
        return ceiling

    @staticmethod
    def _over(t: TargetState, ceiling: float) -> bool:
        return t.in_flight > ceiling or t.at_admission_limit

    def _why_not(
        self, request: RequestInfo, state: TargetState | None, usable: list[TargetState], ceiling: float
    ) -> str | None:
        """Why the bound target cannot take this turn, or None when it can."""
        if state is None:
            return "bound target gone"
        if not state.available:
            return _unavailable(state)
        if state.models and request.model not in state.models:
            return "bound target does not serve the model"
        if self._over(state, ceiling):
            # Moving only helps when some other target is under the ceiling.
            if any(t is not state and not self._over(t, ceiling) for t in usable):
                if state.at_admission_limit:
                    return f"bound target at its admission limit ({state.in_flight}/{state.max_in_flight})"
                return f"bound target over load ceiling (in_flight {state.in_flight} > {ceiling:.1f})"
        return None

    def on_routed(self, request: RequestInfo, target: str, now: float) -> None:
        sid, keys = request.session_id, request.block_keys
        if sid and self.rehome_below > 0 and len(keys):
            last = self._last_prompt
            last[sid] = (len(keys), int(keys[-1]))
            last.move_to_end(sid)
            if len(last) > REMEMBERED_SESSIONS:
                last.popitem(last=False)
        self.inner.on_routed(request, target, now)

    def on_finished(self, request: RequestInfo, target: str, now: float) -> None:
        self.inner.on_finished(request, target, now)

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "inner": self.inner.describe(),
            "max_in_flight": self.max_in_flight,
            "load_factor": self.load_factor,
            "load_slack": self.load_slack,
            "spread_new": self.spread_new,
            "session_slack": self.session_slack,
            "spread_by": self.spread_by,
            "rehome_below": self.rehome_below,
            "rebalance_margin": self.rebalance_margin,
        }


def _room(t: TargetState) -> float:
    """KV blocks the target's active sessions leave free; unknown capacity: none."""
    return t.kv_capacity_blocks - t.session_blocks if t.kv_capacity_blocks > 0 else -math.inf


def _gone(cluster: ClusterView, bound: str) -> str:
    """Why the bound target is not in the view: excluded by the caller (``mesh.core.router.RoutedView``:
    at its admission limit, or failed this request), else removed."""
    state = next((t for t in getattr(cluster, "excluded", ()) if t.id == bound), None)
    if state is None:
        return "bound target gone"
    if state.at_admission_limit:
        return f"bound target at its admission limit ({state.in_flight}/{state.max_in_flight})"
    return "bound target excluded (it failed this request)"


def _unavailable(t: TargetState) -> str:
    if not t.healthy:
        return "bound target unhealthy"
    if t.draining:
        return "bound target draining"
    return "bound target circuit open"
