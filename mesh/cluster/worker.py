"""One registered worker: its config, its data-parallel targets, its breaker and health, the
models it serves and what its ``/metrics`` last said.

Ownership: ``WorkerRegistry`` creates and mutates every ``Worker``; the targets
(``TargetState``) are the policies' view of it and are written from here by two calls only:
``sync`` (availability and models) and ``set_reported`` (the worker-reported KV fields). A
target's load fields (``in_flight``, token counts) belong to the router's leases and
``SharedLoad``, never to this module.

Invariants: ``reported`` has one entry per target (``None``: unknown) once the first scrape
landed; ``discovered_loras`` is replaced whole, never mutated (readers may hold the old dict).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

from mesh.cluster.health import CircuitBreaker
from mesh.cluster.worker_metrics import RankLoad
from mesh.config import WorkerConfig
from mesh.log_limit import RateLimitedWarning
from policies.base import TargetState


@dataclass(eq=False)
class Worker:
    """One worker endpoint and its data-parallel targets."""

    config: WorkerConfig
    targets: list[TargetState]
    breaker: CircuitBreaker
    source: Literal["config", "admin", "discovery"] = "config"
    healthy: bool = False  # unknown until the first check passes
    draining: bool = False
    ok_streak: int = 0
    fail_streak: int = 0
    last_error: str | None = None
    last_check: float = 0.0
    discovered_models: frozenset[str] = frozenset()  # base models only (never LoRA adapters)
    discovered_loras: dict[str, str] = field(default_factory=dict)  # adapter -> base; replaced, never mutated
    headers: list[bytes] = field(default_factory=list)  # header lines sent with every request to it
    # What its /metrics said, one entry per target (None: unknown); written by
    # ``WorkerRegistry.read_metrics`` only, with the targets' kv fields.
    reported: list[RankLoad | None] = field(default_factory=list)
    metrics_result: str = ""  # the last scrape's outcome (``METRICS_RESULTS``); "" before the first
    metrics_error: str | None = None
    metrics_ok_at: float = 0.0  # monotonic time of the last scrape that read load signals
    metrics_next_at: float = 0.0  # no scrape before this (backing off a worker that exports none)
    metrics_counts: dict[str, int] = field(default_factory=dict)  # outcome -> scrapes
    metrics_warnings: RateLimitedWarning | None = None  # its scrape problems, rate-limited
    metrics_info_at: float = float("-inf")  # monotonic time of its last INFO line about /metrics
    index_problem: str | None = None  # why the index cannot see it (a blind event stream); set by KvIngest

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def url(self) -> str:
        return self.config.url

    @property
    def base_models(self) -> frozenset[str]:
        return frozenset(self.config.models) if self.config.models is not None else self.discovered_models

    @property
    def loras(self) -> dict[str, str]:
        """LoRA adapter -> its base model: configured, else discovered (``parent`` in /v1/models)."""
        return self.config.loras if self.config.loras is not None else self.discovered_loras

    @property
    def models(self) -> frozenset[str]:
        """Every model name a request may ask this worker for: base models and LoRA adapters."""
        loras = self.loras
        return self.base_models | frozenset(loras) if loras else self.base_models

    def sync(self) -> None:
        """Push availability into the targets (the policies' view)."""
        models, loras = self.models, frozenset(self.loras)
        for t in self.targets:
            t.healthy = self.healthy
            t.draining = self.draining
            t.circuit_open = self.breaker.is_open
            t.models = models
            t.loras = loras

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "url": self.url,
            "role": self.config.role.value,
            "source": self.source,
            "healthy": self.healthy,
            "draining": self.draining,
            "circuit": self.breaker.state,
            "models": sorted(self.models),
            "loras": dict(sorted(self.loras.items())),
            "dp_size": self.config.dp_size,
            "block_size": self.config.block_size,
            "last_error": self.last_error,
            "kv_events": self.events_state(),
            "metrics": {
                "result": self.metrics_result or None,
                "error": self.metrics_error,
                "age_s": round(time.monotonic() - self.metrics_ok_at, 3) if self.metrics_ok_at else None,
            },
            "targets": [
                {
                    "id": t.id,
                    "in_flight": t.in_flight,
                    "prefill_tokens": t.prefill_tokens,
                    "decode_tokens": t.decode_tokens,
                    "live_sessions": t.live_sessions,
                    **reported_fields(t, self.reported[i] if i < len(self.reported) else None),
                }
                for i, t in enumerate(self.targets)
            ],
        }

    def events_state(self) -> str:
        """What the index sees of it: "none" (no kv_events configured), "live" (every rank's stream
        trusted), "not live" (a stream connecting, replaying or broken), or the blind-stream problem."""
        if self.config.kv_events is None:
            return "none"
        if self.index_problem is not None:
            return self.index_problem
        return "live" if all(t.index_healthy for t in self.targets) else "not live"

    def set_reported(self, loads: list[RankLoad | None]) -> None:
        """Push what the worker's /metrics said (one entry per target) into the targets."""
        self.reported = loads
        for t, load in zip(self.targets, loads, strict=True):
            t.kv_usage = load.kv_usage if load is not None and load.kv_usage is not None else 0.0
            t.kv_capacity_blocks = load.capacity_blocks(t.block_size) if load is not None else 0


def reported_fields(t: TargetState, load: RankLoad | None) -> dict[str, Any]:
    """A target's worker-reported load for ``GET /workers`` (None: unknown)."""
    known = load is not None
    return {
        "kv_usage": t.kv_usage if known and load.kv_usage is not None else None,  # type: ignore[union-attr]
        "kv_capacity_blocks": t.kv_capacity_blocks or None,
        "reported_running": load.num_running if known else None,  # type: ignore[union-attr]
        "reported_waiting": load.num_waiting if known else None,  # type: ignore[union-attr]
    }


def auth_headers(cfg: WorkerConfig) -> list[bytes]:
    """The header lines sent with every request to the worker (its ``api_key`` as a Bearer token)."""
    return [f"authorization: Bearer {cfg.api_key}\r\n".encode()] if cfg.api_key else []
