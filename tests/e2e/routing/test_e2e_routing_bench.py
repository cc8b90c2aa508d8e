"""``bench/e2e_routing.py`` on CPU: real tiny-preset workers, real routers, the real replay.

The GPU run (4 x llama3-8b on an H200) is the same script with other sizes; here two workers
(``--preset tiny --device cpu``), two sessions of the committed WEKA slice, and three routers:
Mesh round robin, Mesh's default policy and the real sglang-router. The JSON must hold every
router's row with its requests served, per-worker counts that add up, live KV event streams
for the Mesh runs (before and after), and the TTFT ratios to sglang-router. A worker that cannot
start stops the benchmark with its name and log tail.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.procs import PYTHON, REPO

BENCH = REPO / "bench" / "e2e_routing.py"
TINY = ["--preset", "tiny", "--device", "cpu", "--workers", "2", "--kv-blocks", "512", "--cpu-blocks", "0",
        "--concurrency", "2", "--sessions", "2", "--max-turns", "3", "--prompt-scale", "64",
        "--max-model-len", "8192", "--cpu-threads", "1", "--startup-timeout", "120", "--progress-s", "2",
        "--warmup-s", "2"]


def bench(tmp: Path, *args: str, timeout: float = 240) -> tuple[subprocess.CompletedProcess[str], dict]:
    out = tmp / "e2e.json"
    proc = subprocess.run([PYTHON, str(BENCH), *TINY, "--json", str(out), "--out-dir", str(tmp / "logs"), *args],
                          check=False, capture_output=True, text=True, cwd=REPO, timeout=timeout)
    return proc, (json.loads(out.read_text()) if out.exists() else {})


def test_the_bench_runs_every_router_on_real_workers(tmp_path: Path) -> None:
    # the budget sizes the runs (4-6 s each: longer than these 6 requests take, so all are sent)
    proc, report = bench(tmp_path, "--routers", "round_robin,mesh_default,sglang", "--budget-s", "200",
                         "--min-run-s", "4", "--max-run-s", "6")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert report["ok"] is True and len(report["points"]) == 1
    point = report["points"][0]
    assert (point["kv_blocks"], point["cpu_blocks"], point["concurrency"]) == (512, 0, 2) and 4 <= point["run_s"] <= 6
    routers = point["routers"]
    assert set(routers) == {"round_robin", "mesh_default", "sglang"}
    planned = report["trace"]["requests"]
    assert planned == 6
    for name, row in routers.items():
        assert row["ok"] and row["error"] is None, (name, row.get("error"))
        assert row["requests"] == planned and row["errors"] == 0 and row["not_sent"] == 0, name
        assert sum(row["requests_per_worker"].values()) == planned, (name, row["requests_per_worker"])
        assert sum(row["worker_prompt_tokens"].values()) > 0  # the workers' own counters moved
        assert 0.0 <= row["hit_rate"] <= 1.0 and row["ttft_ms"]["mean"] > 0
        # every planned request was served, so the served ideal is the whole slice's
        assert row["ideal_hit_rate_served"] == pytest.approx(point["ideal_hit_rate"])
    for name in ("round_robin", "mesh_default"):
        row = routers[name]
        assert row["ready"]["ok"] and row["ready"]["streams"] == {"w0": 1.0, "w1": 1.0}  # live before the run
        assert row["events_live_after"] is True and row["requests_per_worker_source"] == "x-mesh-worker"
        assert row["prefix_tokens"]["reported"] >= 0
    # session_sticky keeps each session on one worker; its predictions are confirmed by the workers
    assert routers["mesh_default"]["session_moves"] == 0
    assert routers["mesh_default"]["prefix_tokens"]["predicted"] > 0
    assert routers["mesh_default"]["hit_rate"] >= routers["round_robin"]["hit_rate"]
    # sglang-router names no worker: its own metrics count them; the ratios are to it
    assert routers["sglang"]["requests_per_worker_source"] == "router metrics"
    assert routers["sglang"]["session_moves"] is None and routers["sglang"]["ttft_mean_vs_sglang"] == 1.0
    assert routers["mesh_default"]["ttft_p99_vs_sglang"] > 0
    assert "mean/sglang" in proc.stdout and "mesh_default" in proc.stdout  # the point's table
    assert "kv512-cpu0-c2-r0 mesh_default: 6/6 requests" in proc.stderr  # progress lines
    # the fresh workers were warmed up through round robin first, and that run is not in the results
    assert "kv512-cpu0-warmup round_robin:" in proc.stderr and "warmed up in" in proc.stderr
    assert [r["repeat"] for r in point["runs"] if r["router"] == "round_robin"] == [0]


def test_a_worker_that_cannot_start_is_named_with_its_log(tmp_path: Path) -> None:
    proc, report = bench(tmp_path, "--routers", "round_robin", "--run-s", "0", "--worker-arg=--dtype=bogus",
                         timeout=120)
    assert proc.returncode == 1
    assert "w0-kv512-cpu0 (pid" in proc.stderr and "exited with code 2" in proc.stderr
    assert "invalid choice" in proc.stderr  # its log tail
    assert report["ok"] is False and any("stopped" in w for w in report["warnings"])
