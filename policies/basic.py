"""Load-only policies: round_robin, random, least_load, power_of_two (for comparison)."""

from __future__ import annotations

import random

from policies.base import ClusterView, Decision, NoCandidate, Policy, RequestInfo, TargetState
from policies.registry import register


def load_of(t: TargetState) -> float:
    """In-flight requests, tie-broken by queued prefill work (tokens, scaled small)."""
    return t.in_flight + (t.prefill_tokens + t.decode_tokens) * 1e-9


def candidates(request: RequestInfo, cluster: ClusterView) -> list[TargetState]:
    found = cluster.available(request)
    if not found:
        raise NoCandidate(f"no healthy worker serves model {request.model!r}")
    return found


@register("policy", "round_robin")
class RoundRobin(Policy):
    def __init__(self) -> None:
        self._cursor = 0

    def decide(self, request: RequestInfo, cluster: ClusterView) -> Decision:
        found = candidates(request, cluster)
        pick = found[self._cursor % len(found)]
        self._cursor += 1
        return Decision(pick.id, "round robin")


@register("policy", "random")
class Random(Policy):
    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def decide(self, request: RequestInfo, cluster: ClusterView) -> Decision:
        return Decision(self._rng.choice(candidates(request, cluster)).id, "uniform random")


@register("policy", "least_load")
class LeastLoad(Policy):
    """Fewest in-flight requests; ties broken at random (never 'always the first')."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def decide(self, request: RequestInfo, cluster: ClusterView) -> Decision:
        found = candidates(request, cluster)
        loads = {t.id: load_of(t) for t in found}
        best = min(loads.values())
        pick = self._rng.choice([tid for tid, v in loads.items() if v == best])
        return Decision(pick, "least in-flight load", {tid: {"load": v} for tid, v in loads.items()})


@register("policy", "power_of_two")
class PowerOfTwo(Policy):
    """Two random candidates, the less loaded wins."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def decide(self, request: RequestInfo, cluster: ClusterView) -> Decision:
        found = candidates(request, cluster)
        pair = self._rng.sample(found, 2) if len(found) >= 2 else found
        pick = min(pair, key=load_of)
        scores = {t.id: {"load": load_of(t)} for t in pair}
        return Decision(pick.id, "less loaded of two random candidates", scores)
