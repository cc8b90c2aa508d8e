"""Built-in scorers: each returns one score in [0, 1] per candidate (higher is better).

Load-like terms are min-max normalized across the candidates of one decision (llm-d's queue
scorer): the least loaded scores 1, the most loaded 0, and all-equal scores 1 for everyone.
Weights are applied by the pipeline, never here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from policies.base import ClusterView, Overlap, RequestInfo, TargetState
from policies.params import number
from policies.pipeline import Scorer
from policies.registry import register


def fewer_is_better(values: Sequence[float]) -> list[float]:
    """Min-max normalized, inverted: min -> 1.0, max -> 0.0; all equal -> 1.0."""
    lo, hi = min(values), max(values)
    if hi <= lo:
        return [1.0] * len(values)
    inv = 1.0 / (hi - lo)
    return [(hi - v) * inv for v in values]


def _tier_weight(owner: str, value: Any) -> float:
    return number(f"scorer {owner!r}", "tier weights", value, 0.0, 1.0)


@register("scorer", "prefix")
class PrefixOverlap(Scorer):
    """Cached fraction of the request's blocks, tier-weighted (llm-d's precise prefix scorer).

    ``(gpu_weight * gpu_blocks + cpu_weight * cpu_blocks) / request blocks`` over each target's
    longest consecutive cached prefix (GPU weight 1.0, CPU 0.8 by default). A target whose event
    stream is down (``index_healthy`` false) scores 0: its index entries are not trusted.
    """

    trusted = True

    def __init__(self, gpu_weight: float = 1.0, cpu_weight: float = 0.8) -> None:
        self.gpu_weight = _tier_weight("prefix", gpu_weight)
        self.cpu_weight = _tier_weight("prefix", cpu_weight)

    def score(self, request: RequestInfo, cluster: ClusterView, candidates: list[TargetState]) -> list[float]:
        n_blocks = len(request.block_keys)
        ov = cluster.overlaps(request)
        if not n_blocks or not ov:
            return [0.0] * len(candidates)
        # An overlap never exceeds the request's blocks and tier weights are <= 1: no clamp.
        g, c, get = self.gpu_weight / n_blocks, self.cpu_weight / n_blocks, ov.get
        # The index hands many targets the very same Overlap object (the holders of one prefix
        # share it), so the last object's score is reused: same object, same value, ~2x faster.
        out: list[float] = []
        add = out.append
        last: Overlap | None = None
        last_v = 0.0
        for t in candidates:
            o = get(t.id)
            if o is None or not t.index_healthy:
                add(0.0)
            elif o is last:
                add(last_v)
            else:
                last, last_v = o, g * o.gpu_blocks + c * o.cpu_blocks
                add(last_v)
        return out

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "gpu_weight": self.gpu_weight, "cpu_weight": self.cpu_weight}


@register("scorer", "load")
class Load(Scorer):
    """Fewer in-flight requests is better (llm-d's queue scorer), normalized across candidates."""

    trusted = True

    def score(self, request: RequestInfo, cluster: ClusterView, candidates: list[TargetState]) -> list[float]:
        return fewer_is_better([t.in_flight for t in candidates])


@register("scorer", "kv_utilization")
class KvUtilization(Scorer):
    """Free KV cache: ``1 - kv_usage`` (from the worker's metrics; unknown reads as empty)."""

    trusted = True

    def score(self, request: RequestInfo, cluster: ClusterView, candidates: list[TargetState]) -> list[float]:
        return [1.0 - u if 0.0 <= (u := t.kv_usage) <= 1.0 else (0.0 if u > 1.0 else 1.0) for t in candidates]


@register("scorer", "session_affinity")
class SessionAffinity(Scorer):
    """1.0 for the target the request's session is bound to (and not idle-expired), else 0."""

    trusted = True

    def score(self, request: RequestInfo, cluster: ClusterView, candidates: list[TargetState]) -> list[float]:
        bound = None
        if request.session_id and cluster.sessions is not None:
            bound = cluster.sessions.bound_target(request.session_id, cluster.now)
        return [1.0 if t.id == bound else 0.0 for t in candidates]


@register("scorer", "live_sessions")
class LiveSessions(Scorer):
    """Fewer live session bindings is better (ATOM Mesh dp_sticky's new-session rule)."""

    trusted = True

    def score(self, request: RequestInfo, cluster: ClusterView, candidates: list[TargetState]) -> list[float]:
        return fewer_is_better([t.live_sessions for t in candidates])


@register("scorer", "prefill_load")
class PrefillLoad(Scorer):
    """Less prefill work is better: queued prefill tokens plus this request's uncached tokens.

    The uncached part follows Dynamo's cost: prompt tokens minus the cached prefix, a CPU-tier
    block counting ``cpu_weight`` of a GPU block. Normalized across candidates.
    """

    trusted = True

    def __init__(self, cpu_weight: float = 0.8) -> None:
        self.cpu_weight = _tier_weight("prefill_load", cpu_weight)

    def score(self, request: RequestInfo, cluster: ClusterView, candidates: list[TargetState]) -> list[float]:
        ov = cluster.overlaps(request)
        prompt, bs, cw = request.prompt_tokens, request.block_size, self.cpu_weight
        work = []
        for t in candidates:
            o = ov.get(t.id) if ov else None
            cached = (o.gpu_blocks + cw * o.cpu_blocks) * bs if o is not None and t.index_healthy else 0.0
            work.append(t.prefill_tokens + max(prompt - cached, 0.0))
        return fewer_is_better(work)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "cpu_weight": self.cpu_weight}
