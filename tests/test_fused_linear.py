"""``workers.fused_linear`` under Triton's interpreter on the CPU: the split-K tickets, the
RMSNorm prologue, the bias / SwiGLU / residual epilogues and the fused decoder forward against
their unfused references (``tests/fused_checks.py``; the GPU run is tests/gpu/test_fused_linear_gpu.py).

The interpreter must be chosen before Triton is imported, so the checks run in a subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_fused_linear_matches_reference_in_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "tests.fused_checks", "cpu"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert sum(line.startswith("case ") for line in lines) == 5
    assert any("split=3" in line for line in lines)  # split-K really ran
    assert "same greedy tokens" in proc.stdout
    assert lines[-1] == "fused checks passed"
