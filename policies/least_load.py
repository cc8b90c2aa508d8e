"""Policy ``least_load``: each request to the target with the fewest requests in flight.

What it does: least in-flight requests, then least queued work (``load_only.load_of``); ties
broken at random, never "always the first". Ignores the cache. Parameters: ``seed`` (int,
optional): the tie-break RNG's seed.

    policy: least_load
"""

from __future__ import annotations

import random

from policies.base import ClusterView, Decision, Policy, RequestInfo
from policies.load_only import candidates, load_of
from policies.registry import register


@register("policy", "least_load")
class LeastLoad(Policy):
    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def decide(self, request: RequestInfo, cluster: ClusterView) -> Decision:
        found = candidates(request, cluster)
        loads = {t.id: load_of(t) for t in found}
        best = min(loads.values())
        pick = self._rng.choice([tid for tid, v in loads.items() if v == best])
        return Decision(pick, "least in-flight load", {tid: {"load": v} for tid, v in loads.items()})
