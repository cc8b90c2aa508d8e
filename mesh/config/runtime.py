"""The sections that tune the gateway at run time: health checks, the circuit breaker, retries,
sessions, admission (late binding), session-aware retention, the prefix index and the
disaggregated relay's protocol."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from mesh.config.base import ConfigModel, PositiveFloat


class HealthConfig(ConfigModel):
    interval_s: PositiveFloat = Field(2.0, description="Seconds between health checks of each worker (GET /health).")
    timeout_s: PositiveFloat = Field(2.0, description="Longest wait for one health check's answer.")
    # each round also reads every worker's /metrics for its KV usage and capacity (vLLM, SGLang,
    # bundled names: mesh.cluster.worker_metrics); off: they stay unknown and the KV checks never fire
    worker_metrics: bool = True
    unhealthy_threshold: int = Field(2, ge=1, description="Consecutive failed checks that mark a worker unhealthy (it gets no requests).")
    healthy_threshold: int = Field(1, ge=1, description="Consecutive good checks that mark it healthy again.")


class CircuitBreakerConfig(ConfigModel):
    failure_threshold: int = Field(5, ge=1)  # consecutive request failures that open it
    open_s: PositiveFloat = 10.0  # then half-open: the next request is a probe


class RetriesConfig(ConfigModel):
    max_attempts: int = Field(3, ge=1, le=16)  # attempts in all, each on another target
    backoff_base_s: float = Field(0.01, ge=0, description="Wait before the second attempt; doubled for each later one.")
    backoff_max_s: float = Field(0.5, ge=0, description="Longest wait between attempts.")


class SessionsConfig(ConfigModel):
    header: str = Field("x-session-id", description="Request header carrying a session id (requests of one session go to one worker while it can take them).")
    body_field: str = Field("user", description="Body field read as the session id when the header is absent (OpenAI's user).")
    idle_ttl_s: PositiveFloat = Field(600.0, description="A session's binding to its worker ends after this long without a request.")
    max_sessions: int = Field(1_000_000, ge=1, description="Session bindings kept at once; past it the least recently used goes.")
    # The load ceiling of a bound session is a parameter of the session policy
    # (``session_sticky``: ``load_factor``, ``load_slack``, ``max_in_flight``), not of the table.

    @field_validator("header")
    @classmethod
    def _header(cls, header: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9\-_]{1,64}", header):
            raise ValueError("header must be an HTTP header name")
        return header.lower()


class AdmissionConfig(ConfigModel):
    """Late binding (``mesh.gateway.admission_queue``): a request that finds every worker of its
    model at ``max_in_flight`` waits at the gateway and is routed once one has room."""

    max_waiting: int = Field(256, ge=0)  # requests held at once; one more is a 429 (0: no holding, 429 at once)
    max_wait_s: PositiveFloat = 30.0  # longest hold; then a 503 queue_timeout
    # a session whose worker is full waits this long for it before it may move (0: moves at once)
    home_wait_s: float = Field(2.0, ge=0)


class RetentionConfig(ConfigModel):
    """Session-aware retention (``mesh.core.retention``): requests of sessions that do not fit
    their worker's KV cache carry ``x-mesh-retention: spill`` (the bundled worker evicts their
    blocks first; other workers ignore the header)."""

    spill_hint: bool = Field(True, description="Mark requests of sessions that do not fit their worker's KV cache with x-mesh-retention: spill.")
    fill: float = Field(0.9, gt=0, le=1)  # share of a worker's KV capacity the kept sessions may fill
    active_s: PositiveFloat = 30.0  # a session idle this long (no request running) stops counting
    # a session idle this many times its longest think gap (request end to next request) stops counting, if sooner than active_s; 0: active_s only
    idle_factor: float = Field(3.0, ge=0)


# The index's default bound: 32 workers of ~32k GPU blocks each (an H100's KV for an 8B model at
# block size 16) in one index; measured ~570 bytes of gateway memory a key at the bound (nodes,
# engine maps with the evicted nodes' hashes not yet swept, the LRU heap): ~600 MB at most.
# Least recently stored/matched leaves go first (hot prefixes stay).
DEFAULT_MAX_KEYS = 1_000_000


class IndexConfig(ConfigModel):
    max_keys: int = Field(DEFAULT_MAX_KEYS, ge=0, description="Bound on the prefix index's keys (KV blocks over all workers); 0 = unbounded. Least recently stored or matched leaves go first.")
    speculative_ttl_s: float = Field(2.0, ge=0, description="A routed request's prompt blocks count as cached on its worker for this long, until the engine's KV events confirm them (0: off).")
    # KV event ingestion (``mesh.events.pacer``, ``mesh.events.inbox``, ``mesh.events.process``)
    ingest_slice_ms: float = Field(0.5, gt=0, le=100, description="KV event work runs on the gateway's loop in slices this long, so a request's callbacks wait at most one slice behind it.")
    ingest_share: float = Field(0.5, gt=0, le=1, description="The share of the gateway's loop KV event work may take while events pour in (a rest follows each slice); a flood past it piles up in the stream's backlog.")
    max_backlog_frames: int = Field(10_000, ge=1, description="A stream's backlog budget: past this many frames received and not applied, the stream is reset (its backlog dropped, its index entries rebuilt from replay; a WARNING and mesh_kv_events_resets_total{reason=\"backlog\"}).")
    max_backlog_bytes: int = Field(64 << 20, ge=1, description="The same budget in payload bytes (never below one frame of the largest size accepted, 16 MiB).")
    ingest_process: bool = Field(False, description="Receive, decode and key KV events in a child process of the gateway (mesh.events.child), which hands the loop decoded, keyed frames: only index mutation stays on the loop. Off: a thread of the gateway receives, and the loop decodes and keys. A child that dies is restarted (an ERROR) and its streams reset and rebuilt from replay.")


class DisaggConfig(ConfigModel):
    """How the gateway drives its prefill/decode pairs (docs/disaggregation.md)."""

    protocol: Literal["vllm", "sglang"] = Field("vllm", description="The engines' prefill/decode protocol: vllm (kv_transfer_params: the prefill worker first, its answer's parameters to the decode worker; vLLM and the bundled worker) or sglang (the same body with bootstrap_host, bootstrap_port and a random bootstrap_room to both workers at once; the prefill worker's bootstrap_port).")
