"""Made-up simulation results for the report tests (``simulator.engine.RunResult``): a burst at
the start, then requests spread evenly over a long span."""

from __future__ import annotations

import numpy as np

from simulator.engine import RunResult

HOUR = 3600.0


def result(policy: str, ttft_s: float, span_s: float = 41 * HOUR, n: int = 400, e2e_s: float = 2.0) -> RunResult:
    """``n`` requests over ``span_s``: half of them in the first minute (a burst, the queue
    building up there), the rest spread evenly."""
    burst = np.linspace(0.0, 60.0, n // 2)
    arrival = np.concatenate([burst, np.linspace(60.0, span_s - e2e_s, n - n // 2)])
    queue_len = np.where(arrival < 30.0, 40.0, 0.0)
    return RunResult(
        policy=policy, policy_spec=policy, workers=["w0", "w1"], block_size=16, arrival=arrival,
        first_token=arrival + ttft_s, finish=arrival + e2e_s, prompt=np.full(n, 1000), output=np.full(n, 51),
        hit=np.full(n, 500), cpu_hit=np.zeros(n, dtype=np.int64), worker=np.arange(n) % 2, preemptions=0, rejected=0,
        session_moves=3, router_session_moves=0, busy_s=[1.0, 1.0], steps=[10, 10], queue_t=arrival,
        queue_len=queue_len, running=np.zeros(n), wall_s=1.5, sessions_enabled=True)
