"""vLLM's and SGLang's own Prometheus stat loggers' ``/metrics`` bodies into Mesh's scrape parser.

The bodies are written by the engines' code from the pinned wheels (``tests/fakes/upstream_metrics.py``,
a process each): vLLM's ``PrometheusStatLogger`` over two data-parallel engines (``engine``
label, the capacity on ``vllm:cache_config_info`` summed over the engines by its API server);
SGLang's ``SchedulerMetricsCollector``, one scheduler process per DP rank in prometheus'
multiprocess mode, read back as its HTTP server does. With priority scheduling SGLang writes
each queue's total under ``priority=""`` beside the per-priority lines: it must be read once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from mesh.cluster.worker_metrics import RankLoad, parse
from tests.support.upstream import Upstream
from tests.support.upstream_driver import REPO


def _run(engine: str, wheel: Upstream, cfg: dict[str, Any], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "tests.fakes.upstream_metrics", engine, str(wheel.root),
                             json.dumps(cfg)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "VLLM_CONFIGURE_LOGGING": "0", "PYTHONPATH": str(REPO), **(env or {})})


def _done(proc: subprocess.Popen[bytes]) -> bytes:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode()[-4000:]
    return out


def test_vllm_prometheus_logger_body_gives_each_dp_engine_its_load(vllm_wheel: Upstream) -> None:
    engines = [{"running": 3, "waiting": 2, "usage": 0.25}, {"running": 1, "waiting": 0, "usage": 0.5}]
    body = _done(_run("vllm", vllm_wheel, {"model": "m", "block_size": 16, "num_gpu_blocks": 2000,
                                           "engines": engines}))
    assert b'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5' in body
    assert parse(body) == {
        0: RankLoad(kv_usage=0.25, kv_blocks=1000, kv_block_size=16, num_running=3, num_waiting=2),
        1: RankLoad(kv_usage=0.5, kv_blocks=1000, kv_block_size=16, num_running=1, num_waiting=0),
    }


RANKS = {  # dp rank -> running and waiting requests' priorities, token usage, pool size in tokens
    0: ([0, 0, 5], [1, 5, 5, 5], 0.3, 8192),
    1: ([2], [], 0.6, 4096),
}


@pytest.mark.parametrize("priority", [True, False], ids=["priority_scheduling", "no_priorities"])
def test_sglang_scheduler_collectors_give_each_dp_rank_its_load(sglang_wheel: Upstream, tmp_path: Path,
                                                                priority: bool) -> None:
    ranks: dict[int | None, Any] = dict(RANKS) if priority else {None: RANKS[0]}  # no DP: no dp_rank label
    procs = [_run("sglang", sglang_wheel, {"model": "m", "priority_scheduling": priority, "dp_rank": rank,
                                           "running": run, "waiting": wait, "usage": usage,
                                           "max_total_num_tokens": tokens},
                  env={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)})
             for rank, (run, wait, usage, tokens) in ranks.items()]
    for proc in procs:
        _done(proc)
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(tmp_path))  # SGLang's /metrics in multiprocess mode
    body = generate_latest(registry)
    if priority:
        assert b'priority="5"' in body and b'priority=""' in body
    assert parse(body) == {rank: RankLoad(kv_usage=usage, kv_blocks=tokens, kv_block_size=1, num_running=len(run),
                                          num_waiting=len(wait))
                           for rank, (run, wait, usage, tokens) in ranks.items()}
