"""Policy ``kv_aware``: precise cache-aware routing on the engines' own KV events.

Cost per candidate target, in blocks (Dynamo's KV router cost, REFERENCE.md section 3):

    cost = prefill_load_scale * max(queued_prefill + prompt - gpu_overlap - cpu_weight * cpu_overlap, 0)
           + decode

``queued_prefill`` is the target's in-flight prompt work not yet past its first token, ``decode``
the context of its requests past their first token (both from ``TargetState``, in the target's
block size); ``prompt`` is this request's prompt; the overlaps are the target's longest cached
prefix of the request per tier (``ClusterView.overlaps``). A target whose event stream is unhealthy
(``index_healthy`` false) gets no overlap credit, so routing falls back to load for it.

The lowest cost wins, ties broken uniformly at random (never "the first worker"). With
``temperature`` > 0 the target is sampled instead, with probabilities ``softmax(-c / T)`` of the
costs ``c`` min-max normalized to [0, 1] (Dynamo's sampling). Targets at their admission ceiling
(``max_in_flight``) are skipped while another target has room.
"""

from __future__ import annotations

import math
import random
from typing import Any

from policies.base import NO_OVERLAP, ClusterView, Decision, NoCandidate, Overlap, Policy, RequestInfo, TargetState
from policies.registry import register

_TIE = 1e-9


def _param(name: str, value: Any, lo: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < lo:
        raise ValueError(f"{name} must be a finite number >= {lo}, got {value!r}")
    return float(value)


@register("policy", "kv_aware")
class KvAware(Policy):
    """Params: ``prefill_load_scale`` (1.0), ``cpu_weight`` (0.75, Dynamo's host-tier credit),
    ``temperature`` (0: argmin; > 0: softmax sampling), ``seed``."""

    def __init__(
        self,
        prefill_load_scale: float = 1.0,
        cpu_weight: float = 0.75,
        temperature: float = 0.0,
        seed: int | None = None,
    ) -> None:
        self.prefill_load_scale = _param("prefill_load_scale", prefill_load_scale, 0.0)
        self.cpu_weight = _param("cpu_weight", cpu_weight, 0.0)
        if self.cpu_weight > 1.0:
            raise ValueError(f"cpu_weight must be <= 1 (a CPU hit never beats a GPU hit), got {cpu_weight}")
        self.temperature = _param("temperature", temperature, 0.0)
        self._rng = random.Random(seed)

    def decide(self, request: RequestInfo, cluster: ClusterView) -> Decision:
        found = cluster.available(request)
        if not found:
            raise NoCandidate(f"no healthy worker serves model {request.model!r}")
        roomy = [t for t in found if not t.max_in_flight or t.in_flight < t.max_in_flight]
        found = roomy or found
        overlaps = cluster.overlaps(request) if request.block_keys else {}
        bs = max(request.block_size, 1)
        prompt = request.prompt_tokens / bs
        costs: dict[str, float] = {}
        scores: dict[str, dict[str, float]] = {}
        used: dict[str, Overlap] = {}
        for t in found:
            ov = overlaps.get(t.id, NO_OVERLAP) if t.index_healthy else NO_OVERLAP
            queued, decode, cost = self._cost(t, ov, prompt, bs)
            costs[t.id] = cost
            scores[t.id] = {
                "cost": cost,
                "gpu_overlap": float(ov.gpu_blocks),
                "cpu_overlap": float(ov.cpu_blocks),
                "queued_prefill_blocks": queued,
                "decode_blocks": decode,
                "index_healthy": 1.0 if t.index_healthy else 0.0,
            }
            if ov.blocks:
                used[t.id] = ov
        pick, how = self._pick(costs)
        best = used.get(pick, NO_OVERLAP)
        reason = (
            f"kv_aware: {how} cost {costs[pick]:.1f} blocks; cached {best.gpu_blocks} GPU + "
            f"{best.cpu_blocks} CPU of {len(request.block_keys)} blocks"
        )
        return Decision(pick, reason, scores, used)

    def _cost(self, t: TargetState, ov: Overlap, prompt: float, bs: int) -> tuple[float, float, float]:
        """``(queued prefill blocks, decode blocks, cost)`` of sending the request to ``t``."""
        tbs = max(t.block_size or bs, 1)
        queued = t.prefill_tokens / tbs
        decode = t.decode_tokens / tbs
        new = max(queued + prompt - ov.gpu_blocks - self.cpu_weight * ov.cpu_blocks, 0.0)
        return queued, decode, self.prefill_load_scale * new + decode

    def _pick(self, costs: dict[str, float]) -> tuple[str, str]:
        lo = min(costs.values())
        if self.temperature > 0:
            hi = max(costs.values())
            ids = list(costs)
            if hi - lo <= _TIE:
                return self._rng.choice(ids), f"sampled (T={self.temperature}, all equal)"
            span = hi - lo
            weights = [math.exp(-(costs[i] - lo) / span / self.temperature) for i in ids]
            return self._rng.choices(ids, weights)[0], f"sampled (T={self.temperature})"
        ties = [tid for tid, c in costs.items() if c - lo <= _TIE * max(1.0, abs(lo))]
        return self._rng.choice(ties), "lowest"

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "prefill_load_scale": self.prefill_load_scale,
            "cpu_weight": self.cpu_weight,
            "temperature": self.temperature,
        }

