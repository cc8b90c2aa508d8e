"""Policy ``random``: each request to a target drawn uniformly at random.

What it does: ignores load and cache (a baseline). Parameters: ``seed`` (int, optional): the
seed of its RNG, for reproducible choices (``mesh simulate --seed`` passes one).

    policy: {name: random, params: {seed: 7}}
"""

from __future__ import annotations

import random

from policies.base import ClusterView, Decision, Policy, RequestInfo
from policies.load_only import candidates
from policies.registry import register


@register("policy", "random")
class Random(Policy):
    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def decide(self, request: RequestInfo, cluster: ClusterView) -> Decision:
        return Decision(self._rng.choice(candidates(request, cluster)).id, "uniform random")
