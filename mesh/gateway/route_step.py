"""The routing step of one attempt: from a parsed request to a lease on a target, or why not.

``RouteStep.lease`` decides (``Router.decide``) and commits on the registry's targets as they are
now, leaving out those at their admission limit; it raises ``OverCapacity`` while the request
should wait (``mesh.gateway.admission_queue``), a 400 for a request no worker of its model could
ever hold, a 503 when no worker is healthy. The proxy owns one and calls it per attempt.
"""

from __future__ import annotations

import time

from mesh.cluster.registry import WorkerRegistry
from mesh.core.router import Lease, Router
from mesh.errors import MeshError
from mesh.gateway.admission_queue import OverCapacity
from mesh.gateway.verdicts import Failure
from mesh.metrics import Metrics
from mesh.request.prompt import ParsedRequest
from policies.base import Decision, NoCandidate, RequestInfo
from policies.filters import blocks_needed


class RouteStep:
    def __init__(self, registry: WorkerRegistry, router: Router, metrics: Metrics) -> None:
        self.registry = registry
        self.router = router
        self.metrics = metrics

    def lease(self, parsed: ParsedRequest, excluded: list[str], failure: Failure | None,
               first: Decision | None = None, arrived: float | None = None) -> Lease | None:
        """A lease on the next target, or None when a retry has nowhere left to go. Raises
        ``OverCapacity`` (the request waits in the admission queue) while every candidate is full,
        and, for ``admission.home_wait_s`` after it ``arrived``, while its session's worker is full:
        its cache is there, and a slot frees sooner than another worker recomputes the prefix.

        A retry does not move the session: the request may be what fails everywhere (a worker's
        500 is only suspect), and a session must not leave its cache for it. ``Proxy._forward`` binds it
        to the retry's target once that target served it; until then the session stays pinned,
        not idle, as for any request of it in flight."""
        now = time.monotonic()
        self.registry.tick(now)
        full = self.registry.full_targets()
        t0 = time.perf_counter()
        info = parsed.info
        if full and arrived is not None and self._home_is_full(info.session_id, full, now, arrived):
            raise OverCapacity()
        try:
            if first is not None and first.target not in full:
                decision = first
            else:
                decision = self.router.decide(info, now, excluded + full if full else excluded, explain=False)
            decision = decision.served_whole()
            if decision.target not in self.router.targets:  # a plugin's decode_target that is no target
                raise NoCandidate(f"the policy named an unknown decode target {decision.target!r}")
            lease = self.router.commit(info, decision, now, bind=failure is None)
        except NoCandidate as exc:
            if failure is not None:
                return None
            if (too_large := self._never_fits(info)) is not None:
                raise too_large from exc
            if full:
                raise OverCapacity() from exc
            raise MeshError(503, f"no healthy worker: {exc}", code="no_healthy_worker") from exc
        self.metrics.routing_decision.observe(time.perf_counter() - t0)
        return lease

    def _never_fits(self, info: RequestInfo) -> MeshError | None:
        """The 400 for a request larger than the KV cache of every worker of its model (known
        capacities only): no wait or retry would serve it, so it must not be a retryable 503."""
        serving = [t for t in self.registry.targets.values()
                   if t.available and (not t.models or info.model in t.models)]
        if not serving or any(t.kv_capacity_blocks <= 0 for t in serving):
            return None
        needs = [blocks_needed(info, t.block_size or info.block_size or 1) for t in serving]
        if any(need <= t.kv_capacity_blocks for need, t in zip(needs, serving, strict=True)):
            return None
        largest = max(t.kv_capacity_blocks for t in serving)
        return MeshError(
            400, f"the request needs {min(needs)} KV blocks ({info.prompt_tokens} prompt tokens + {info.choices} x "
                 f"{info.max_tokens} max_tokens) and the largest worker of {info.model!r} holds {largest}: shorten "
                 "the prompt or lower max_tokens", code="context_length_exceeded")

    def _home_is_full(self, session_id: str | None, full: list[str], now: float, arrived: float) -> bool:
        """Whether the request should wait for its session's worker, at its in-flight limit."""
        sessions = self.router.sessions
        if not session_id or sessions is None or now - arrived >= self.registry.config.admission.home_wait_s:
            return False
        return sessions.bound_target(session_id, now) in full

    def retry_has_a_target(self, parsed: ParsedRequest, excluded: list[str]) -> bool:
        """Whether some available target of the request's model is not excluded yet (it may be
        full now and free after the back-off: routing decides that)."""
        gone = set(excluded)
        model = parsed.info.model
        return any(t.available and t.id not in gone and (not t.models or model in t.models)
                   for t in self.registry.targets.values())
