"""Built-in filters: each drops the candidates that must not take a request.

A filter never reorders and never reads anything but the request, the cluster view and the
candidates' ``TargetState``s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from policies.base import ClusterView, RequestInfo, Role, TargetState
from policies.params import number
from policies.pipeline import Filter
from policies.registry import PluginError, register


@register("filter", "healthy")
class Healthy(Filter):
    """Healthy, not draining, circuit closed (``TargetState.available``)."""

    def filter(self, request: RequestInfo, cluster: ClusterView, candidates: list[TargetState]) -> list[TargetState]:
        # ``TargetState.available``, inlined: this runs on every decision over every target.
        return [t for t in candidates if t.healthy and not t.draining and not t.circuit_open]


@register("filter", "model_match")
class ModelMatch(Filter):
    """Serves the request's model and, when one is asked for, its LoRA adapter.

    An empty ``models`` (or ``loras``) set means "not reported": the target is assumed to serve
    any model (adapter), as in ``ClusterView.available``.
    """

    def filter(self, request: RequestInfo, cluster: ClusterView, candidates: list[TargetState]) -> list[TargetState]:
        model, lora = request.model, request.lora
        out = [t for t in candidates if not t.models or model in t.models]
        if lora:
            out = [t for t in out if not t.loras or lora in t.loras]
        return out


@register("filter", "role")
class RoleFilter(Filter):
    """Targets whose role is one of ``roles`` (default: ``[mixed]``)."""

    def __init__(self, roles: Sequence[str] = ("mixed",)) -> None:
        if isinstance(roles, str) or not roles:
            raise PluginError(f"filter 'role': roles must be a non-empty list, got {roles!r}")
        try:
            self.roles = frozenset(Role(r) for r in roles)
        except ValueError as exc:
            valid = [r.value for r in Role]
            raise PluginError(f"filter 'role': unknown role in {list(roles)!r} (valid: {valid})") from exc

    def filter(self, request: RequestInfo, cluster: ClusterView, candidates: list[TargetState]) -> list[TargetState]:
        roles = self.roles
        return [t for t in candidates if t.role in roles]

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "roles": sorted(r.value for r in self.roles)}


def blocks_needed(request: RequestInfo, block_size: int) -> int:
    """The KV blocks ``request`` holds at its longest on a target with none of it cached: the
    prompt's and every choice's ``max_tokens``, the prompt's blocks shared by the choices but for
    the block of its last token (each choice has its own)."""
    need = -(-(request.prompt_tokens + request.choices * request.max_tokens) // block_size)
    return need + request.choices - 1


@register("filter", "admission_headroom")
class AdmissionHeadroom(Filter):
    """Room to admit one more request.

    - ``in_flight < max_in_flight`` where the target has a ceiling (``max_in_flight > 0``);
    - ``kv_usage <= max_kv_usage``;
    - when the KV capacity is known, the free blocks cover the request's uncached blocks
      (its blocks beyond the target's cached prefix) -- a decode worker must not be handed a
      transfer it cannot hold.
    """

    def __init__(self, max_kv_usage: float = 1.0, require_kv_room: bool = True) -> None:
        self.max_kv_usage = number("filter 'admission_headroom'", "max_kv_usage", max_kv_usage, 0.0, 1.0)
        self.require_kv_room = bool(require_kv_room)

    def filter(self, request: RequestInfo, cluster: ClusterView, candidates: list[TargetState]) -> list[TargetState]:
        limit = self.max_kv_usage
        out = [
            t for t in candidates
            if (t.max_in_flight <= 0 or t.in_flight < t.max_in_flight) and t.kv_usage <= limit
        ]
        if not self.require_kv_room:
            return out
        return [t for t in out if self._has_room(request, cluster, t)]

    @staticmethod
    def _has_room(request: RequestInfo, cluster: ClusterView, t: TargetState) -> bool:
        if t.kv_capacity_blocks <= 0:
            return True
        need = blocks_needed(request, t.block_size or request.block_size or 1)
        ov = cluster.overlaps(request).get(t.id)
        if ov is not None:
            need -= ov.gpu_blocks  # CPU-tier hits still need GPU blocks to load into
        free = t.kv_capacity_blocks * (1.0 - t.kv_usage)
        return need <= free

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "max_kv_usage": self.max_kv_usage, "require_kv_room": self.require_kv_room}


@register("filter", "index_healthy")
class IndexHealthy(Filter):
    """Prefer targets whose KV event stream is live (their prefix state is trusted).

    Optional: a target with a broken event stream still serves requests, so when no candidate
    has a live stream every candidate is kept (the filter never empties the set by itself).
    """

    def filter(self, request: RequestInfo, cluster: ClusterView, candidates: list[TargetState]) -> list[TargetState]:
        out = [t for t in candidates if t.index_healthy]
        return out or candidates
