"""Policy ``least_load``: each request to the target with the fewest requests in flight.

What it does: least in-flight requests, then least queued work (``load_only.load_of``); ties
broken at random (``cluster.rng``), never "always the first". Ignores the cache. Parameters:
none.

    policy: least_load
"""

from __future__ import annotations

from policies.base import ClusterView, Decision, Policy, RequestInfo
from policies.load_only import candidates, load_of
from policies.registry import register


@register("policy", "least_load")
class LeastLoad(Policy):
    def decide(self, request: RequestInfo, cluster: ClusterView) -> Decision:
        found = candidates(request, cluster)
        loads = {t.id: load_of(t) for t in found}
        best = min(loads.values())
        pick = cluster.rng.choice([tid for tid, v in loads.items() if v == best])
        return Decision(pick, "least in-flight load", {tid: {"load": v} for tid, v in loads.items()})
