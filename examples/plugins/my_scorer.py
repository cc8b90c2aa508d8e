"""An example scorer plugin: rendezvous (highest-random-weight) hashing of the session id.

It gives every (session, target) pair a stable pseudo-random score, so a session prefers the same
target even when no binding exists yet -- vLLM production-stack's "session" routing, as one
weighted term among others. Requests without a session score 0.5 everywhere (a neutral term).

Use it from YAML by ``module:Class`` with this directory on the Python path:

    PYTHONPATH=examples/plugins mesh serve --config examples/plugins/my_scorer.yaml

or package it and declare an entry point (then YAML names it ``rendezvous``):

    [project.entry-points."mesh.policies"]
    rendezvous = "my_scorer:RendezvousHash"
"""

from __future__ import annotations

import xxhash

from policies.base import ClusterView, RequestInfo, TargetState
from policies.pipeline import Scorer
from policies.registry import PluginError

_SCALE = 1.0 / float(2**64 - 1)


class RendezvousHash(Scorer):
    """Score in [0, 1]: ``xxh3(salt, session id, target id)`` scaled; 0.5 without a session."""

    name = "rendezvous"
    trusted = True  # the arithmetic below cannot leave [0, 1], so the pipeline skips its clamp

    def __init__(self, salt: str = "") -> None:
        if not isinstance(salt, str):
            raise PluginError(f"scorer 'rendezvous': salt must be a string, got {salt!r}")
        self.seed = xxhash.xxh3_64_intdigest(salt.encode())

    def score(self, request: RequestInfo, cluster: ClusterView, candidates: list[TargetState]) -> list[float]:
        sid = request.session_id
        if not sid:
            return [0.5] * len(candidates)
        h, seed = xxhash.xxh3_64_intdigest, self.seed
        return [h(f"{sid}\0{t.id}".encode(), seed) * _SCALE for t in candidates]
