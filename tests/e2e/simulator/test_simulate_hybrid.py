"""``mesh simulate --hybrid-checkpoints``: hybrid workers in the simulator, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "traces" / "agent_sessions.jsonl"


def _simulate(tmp_path: Path, *extra: str) -> dict[str, object]:
    out = tmp_path / f"r{len(extra)}.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    proc = subprocess.run([sys.executable, "-m", "mesh", "simulate", str(EXAMPLE), "--workers", "2", "--policy",
                           "kv_aware", "--quiet", "--json", str(out), *extra],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr
    return dict(json.loads(out.read_text()))


def test_hybrid_workers_reuse_only_up_to_checkpoints(tmp_path: Path) -> None:
    plain = _simulate(tmp_path)
    hybrid = _simulate(tmp_path, "--hybrid-checkpoints", "16", "--hybrid-interval-blocks", "8")
    assert hybrid["hybrid_checkpoints"] == 16 and hybrid["hybrid_interval_blocks"] == 8
    assert plain["hybrid_checkpoints"] == 0
    rate = {name: report["policies"]["kv_aware"]["hit_rate"] for name, report in (("plain", plain), ("hybrid", hybrid))}  # type: ignore[index]
    assert 0 < rate["hybrid"] < rate["plain"], rate
