"""What the load-only policies share: a target's load and the candidates of a request.

``load_of`` orders targets by in-flight requests, then by queued prefill and decode work (tokens,
scaled small enough never to outweigh one request). ``candidates`` are the targets that can take
the request now (``ClusterView.available``); none is ``NoCandidate``.
"""

from __future__ import annotations

from policies.base import ClusterView, NoCandidate, RequestInfo, TargetState


def load_of(t: TargetState) -> float:
    """In-flight requests, tie-broken by queued prefill work (tokens, scaled small)."""
    return t.in_flight + (t.prefill_tokens + t.decode_tokens) * 1e-9


def candidates(request: RequestInfo, cluster: ClusterView) -> list[TargetState]:
    found = cluster.available(request)
    if not found:
        raise NoCandidate(f"no healthy worker serves model {request.model!r}")
    return found
