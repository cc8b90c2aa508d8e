"""Policy ``round_robin``: each request to the next available target in turn.

What it does: cycles through the targets that can take the request, ignoring load and cache
(a baseline; sglang-router's and vLLM router's round robin); the turn passes when a request is
committed (``on_routed``), so a preview does not move it. Parameters: none.

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
        return Decision(found[self._cursor % len(found)].id, "round robin")

    def on_routed(self, request: RequestInfo, target: str, now: float) -> None:
        self._cursor += 1
