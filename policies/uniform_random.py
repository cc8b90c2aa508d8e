"""Policy ``random``: each request to a target drawn uniformly at random.

What it does: ignores load and cache (a baseline); draws from ``cluster.rng`` (``mesh simulate
--seed`` seeds it). Parameters: none.

    policy: random
"""

from __future__ import annotations

from policies.base import ClusterView, Decision, Policy, RequestInfo
from policies.load_only import candidates
from policies.registry import register


@register("policy", "random")
class Random(Policy):
    def decide(self, request: RequestInfo, cluster: ClusterView) -> Decision:
        return Decision(cluster.rng.choice(candidates(request, cluster)).id, "uniform random")
