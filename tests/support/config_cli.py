"""``mesh config validate`` run as a real process, for the tests of what the CLI says about a
policy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from tests.procs import REPO


def validate_policy(tmp_path: Path, policy: object) -> subprocess.CompletedProcess[str]:
    """``mesh config validate`` on a config of ``policy`` alone (written under ``tmp_path``)."""
    path = tmp_path / "mesh.yaml"
    path.write_text(yaml.safe_dump({"policy": policy}))
    return subprocess.run([sys.executable, "-m", "mesh", "config", "validate", str(path)],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
