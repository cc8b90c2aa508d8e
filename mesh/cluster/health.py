"""A worker's health: the circuit breaker (passive, request outcomes) and the ``GET /health``
probe with its streak thresholds (active).

Ownership: each ``Worker`` owns one ``CircuitBreaker``; ``WorkerRegistry`` feeds it request
outcomes and its clock and pushes the state into the targets (``Worker.sync``). ``apply_probe``
writes only the worker's health fields (``healthy``, the streaks, ``last_error``,
``last_check``); the registry calls it after checking that the probed worker is still
registered, and runs model discovery and ``sync`` after it.

A probe never raises but for cancellation: any failure to get a 200 is "not healthy".
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Literal

from mesh.config import CircuitBreakerConfig, HealthConfig

if TYPE_CHECKING:
    from mesh.cluster.worker import Worker
    from mesh.gateway.upstream import UpstreamPool

log = logging.getLogger("mesh.cluster.registry")  # the registry's log channel


class CircuitBreaker:
    """Closed -> open after ``failure_threshold`` consecutive failures -> half-open after ``open_s``.

    Half-open lets traffic through again: the next success closes it, the next failure reopens it.
    An open circuit ignores successes: they come from requests sent before it opened (a long
    one finishing whole said nothing about the failures that opened it), and only ``open_s``
    moves it on, as in the usual breakers (resilience4j, Envoy's outlier ejection).
    """

    def __init__(self, config: CircuitBreakerConfig) -> None:
        self.config = config
        self.state: Literal["closed", "open", "half_open"] = "closed"
        self.failures = 0
        self.opened_at = 0.0

    @property
    def is_open(self) -> bool:
        return self.state == "open"

    def record_success(self) -> None:
        if self.state == "open":
            return
        self.failures = 0
        self.state = "closed"

    def record_failure(self, now: float) -> bool:
        """Count a failure; True when this failure opened the circuit."""
        self.failures += 1
        if self.state == "half_open" or (self.state == "closed" and self.failures >= self.config.failure_threshold):
            self.state = "open"
            self.opened_at = now
            return True
        return False

    def tick(self, now: float) -> None:
        if self.state == "open" and now - self.opened_at >= self.config.open_s:
            self.state = "half_open"


async def probe(pool: UpstreamPool, url: str, headers: list[bytes], timeout_s: float) -> tuple[bool, str | None]:
    """(healthy, why not) from one ``GET`` of ``url``."""
    try:
        status, _ = await pool.get(url, headers, timeout_s)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # connection refused, timeout, bad response: all mean "not healthy"
        return False, f"GET /health failed: {exc}"
    if status == 200:
        return True, None
    return False, f"GET /health answered {status}"


def apply_probe(worker: Worker, ok: bool, error: str | None, cfg: HealthConfig, now: float) -> None:
    """Count one probe's outcome; ``healthy`` flips after ``healthy_threshold`` passes in a row,
    or ``unhealthy_threshold`` failures in a row."""
    worker.last_check = now
    if ok:
        worker.ok_streak += 1
        worker.fail_streak = 0
        if not worker.healthy and worker.ok_streak >= cfg.healthy_threshold:
            worker.healthy = True
            log.info("worker %s is healthy", worker.name)
        return
    worker.fail_streak += 1
    worker.ok_streak = 0
    worker.last_error = error
    if worker.healthy and worker.fail_streak >= cfg.unhealthy_threshold:
        worker.healthy = False
        log.warning("worker %s is unhealthy: %s", worker.name, error)
