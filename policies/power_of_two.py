"""Policy ``power_of_two``: two targets drawn at random, the less loaded takes the request.

What it does: the power of two choices (load by ``load_only.load_of``), which spreads load
nearly as well as ``least_load`` while herding less when load reports lag. Ignores the cache.
Draws from ``cluster.rng``. Parameters: none.

    policy: power_of_two
"""

from __future__ import annotations

from policies.base import ClusterView, Decision, Policy, RequestInfo
from policies.load_only import candidates, load_of
from policies.registry import register


@register("policy", "power_of_two")
class PowerOfTwo(Policy):
    def decide(self, request: RequestInfo, cluster: ClusterView) -> Decision:
        found = candidates(request, cluster)
        pair = cluster.rng.sample(found, 2) if len(found) >= 2 else found
        pick = min(pair, key=load_of)
        scores = {t.id: {"load": load_of(t)} for t in pair}
        return Decision(pick.id, "less loaded of two random candidates", scores)
