"""Policy ``round_robin``: each request to the next available target in turn.

What it does: cycles through the targets that can take the request, ignoring load and cache
(a baseline; sglang-router's and vLLM router's round robin). Parameters: none.

    policy: round_robin
"""

from __future__ import annotations

from policies.base import ClusterView, Decision, Policy, RequestInfo
from policies.load_only import candidates
from policies.registry import register


@register("policy", "round_robin")
class RoundRobin(Policy):
    def __init__(self) -> None:
        self._cursor = 0

    def decide(self, request: RequestInfo, cluster: ClusterView) -> Decision:
        found = candidates(request, cluster)
        pick = found[self._cursor % len(found)]
        self._cursor += 1
        return Decision(pick.id, "round robin")
