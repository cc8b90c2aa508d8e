"""``bench/sim_pressure.py`` end to end: the twin's grid, a variant, a device per worker, its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
REBALANCE = ('{"policy":{"name":"session_sticky","params":{"rebalance_margin":1}},'
             '"config":{"retention":{"spill_hint":false}}}')


def test_the_grid_runs_every_router_and_a_rebalancing_variant_moves_sessions(tmp_path: Path) -> None:
    out = tmp_path / "grid.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "sim_pressure.py"), "--points", "2600/24", "--run-s", "10",
         "--workers-per-device", "1", "--seeds", "2", "--variant", f"rebalance={REBALANCE}", "--json", str(out)],
        check=False, capture_output=True, text=True, cwd=REPO, timeout=300)
    bad = subprocess.run([sys.executable, str(REPO / "bench" / "sim_pressure.py"), "--variant", 'x={"config":{"admission":{}}}'],
                         check=False, capture_output=True, text=True, cwd=REPO, timeout=60)
    assert bad.returncode == 2 and "--variant takes" in bad.stderr
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["workers_per_device"] == 1
    assert report["routers"]["rebalance"]["spill_hint"] is False and report["routers"]["mesh_default"]["spill_hint"]
    grid = report["grid"]
    assert set(grid) == {"sglang", "mesh_default", "mesh_kv_aware", "rebalance"}
    assert grid["sglang"][0]["ratio"] == 1.0 and report["seeds"] == 2
    lo, hi = grid["mesh_kv_aware"][0]["ratio_range"]  # a jittered seed plays out differently
    assert lo < hi and lo <= grid["mesh_kv_aware"][0]["ratio"] <= hi
    for rows in grid.values():
        assert rows[0]["requests"] > 0 and rows[0]["ttft_mean_ms"] > 0
    # the default keeps sessions home at this point; rebalancing moves some off a queued home
    assert grid["rebalance"][0]["session_moves"] > grid["mesh_default"][0]["session_moves"]
    assert "geo mean" in proc.stdout
