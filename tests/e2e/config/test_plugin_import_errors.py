"""Through the real CLI (``mesh config validate``): for a ``module:Class`` plugin whose module
cannot be imported, the message says more than "No module named 'x'": how to put the plugin's
directory on the import path (or which dependency is missing)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from tests.procs import REPO
from tests.support.config_cli import validate_policy


def test_an_unimportable_plugin_module_hints_at_the_import_path(tmp_path: Path) -> None:
    proc = validate_policy(tmp_path, {"name": "pipeline", "params": {"scorers": ["my_missing_plugins:Scorer"]}})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Traceback" not in out, out
    assert "No module named 'my_missing_plugins'" in out and "PYTHONPATH" in out, out


def test_a_plugin_whose_own_import_fails_names_the_missing_dependency(tmp_path: Path) -> None:
    """The module is found, a module it imports is not: the hint names that one, not PYTHONPATH."""
    (tmp_path / "plugdep.py").write_text("import no_such_dependency_xyz\n")
    path = tmp_path / "mesh.yaml"
    path.write_text(yaml.safe_dump({"policy": {"name": "pipeline", "params": {"scorers": ["plugdep:Scorer"]}}}))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "mesh", "config", "validate", str(path)],
                          capture_output=True, text=True, timeout=60, cwd=REPO, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "no_such_dependency_xyz" in out and "PYTHONPATH" not in out, out
