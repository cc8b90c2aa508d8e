"""A simulation's settings (``SimConfig``) and their checks, named after the CLI flags."""

from __future__ import annotations

import math
from dataclasses import dataclass

from simulator.profile import Profile


@dataclass(frozen=True, slots=True)
class SimConfig:
    workers: int
    profile: Profile
    seed: int = 0
    model: str = "sim-model"
    prefill_workers: int = 0  # PD: the first P workers take the prefill role, the rest decode
    session_ttl_s: float = 600.0
    max_bound_sessions: int = 1_000_000
    speculative_ttl_s: float = 2.0
    sample_every: int = 1  # record queue length every N arrivals
    # closed-loop admission (simulator.session_gate): at most N session groups in flight (0: no
    # limit), nothing released after horizon_s; both unset: every request at its trace time
    concurrency: int = 0
    horizon_s: float | None = None
    # workers 0..N-1 share device 0, N..2N-1 device 1, ... (simulator.device: time-slicing)
    workers_per_device: int = 1
    # the gateway's session-aware retention (mesh.core.retention; its defaults): the requests of
    # sessions that do not fit their worker are evicted first once they end; False: off
    spill_hint: bool = True
    retention_fill: float = 0.9
    retention_active_s: float = 30.0
    retention_idle_factor: float = 3.0
    # hybrid models (recurrent layers beside attention): each worker keeps this many recurrent-state
    # checkpoints (0: not hybrid), one every ``hybrid_interval_blocks`` prompt blocks (0: none)
    # and one at each request's end; hits and the router's matches end at checkpoints
    hybrid_checkpoints: int = 0
    hybrid_interval_blocks: int = 0


class SimulationError(RuntimeError):
    """A simulation that cannot run as configured (message says why)."""


# Each worker model costs ~5 KB before the first request: 100,000 is ~0.5 GB and seconds; a typo'd
# 100,000,000 ran for minutes and tens of GB before failing (or the machine did).
MAX_WORKERS = 100_000


def check_config(config: SimConfig) -> None:
    """Raise ``SimulationError`` (one line, named after the CLI flag) for a config that cannot run."""
    if not 1 <= config.workers <= MAX_WORKERS:
        raise SimulationError(f"--workers must be >= 1 and <= {MAX_WORKERS}, got {config.workers}")
    if config.prefill_workers < 0:
        raise SimulationError(f"--prefill-workers must be >= 0, got {config.prefill_workers}")
    if config.prefill_workers >= config.workers or (config.prefill_workers and config.workers < 2):
        raise SimulationError("--prefill-workers must leave at least one decode worker")
    if not (math.isfinite(config.session_ttl_s) and config.session_ttl_s > 0):
        raise SimulationError(f"--session-ttl must be a finite number > 0, got {config.session_ttl_s}")
    if not (math.isfinite(config.speculative_ttl_s) and config.speculative_ttl_s >= 0):
        raise SimulationError(f"--speculative-ttl must be a finite number >= 0, got {config.speculative_ttl_s}")
    if config.workers_per_device < 1:
        raise SimulationError(f"--workers-per-device must be >= 1, got {config.workers_per_device}")
    if config.hybrid_checkpoints < 0 or config.hybrid_interval_blocks < 0:
        raise SimulationError("hybrid checkpoints and their interval must be >= 0")
    if config.concurrency < 0:
        raise SimulationError(f"--concurrency must be >= 0 (0: no limit), got {config.concurrency}")
    if config.horizon_s is not None and not (math.isfinite(config.horizon_s) and config.horizon_s > 0):
        raise SimulationError(f"--run-s must be a finite number of seconds > 0, got {config.horizon_s}")
