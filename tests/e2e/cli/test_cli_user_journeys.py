"""The CLI as a user drives it: ``mesh up --policy FILE``, ``mesh config validate``,
help texts and bad input (real processes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx

from tests.procs import PYTHON, ProcessGroup, free_port, wait_http

ROOT = Path(__file__).resolve().parents[3]


def mesh(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "mesh", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


def test_mesh_up_takes_an_example_policy_file(procs: ProcessGroup) -> None:
    """``mesh up --policy`` takes the same policy file as ``mesh simulate --policy``
    (``examples/pipeline.yaml``), not a policy name ("unknown policy 'examples/pipeline.yaml'")."""
    port = free_port()
    up = procs.start([PYTHON, "-m", "mesh", "up", "--engine", "echo", "--workers", "2", "--port", str(port),
                      "--policy", "examples/pipeline.yaml"], name="up", port=port)
    wait_http(f"http://127.0.0.1:{port}/ready", proc=up, timeout_s=90)
    body = {"model": "echo", "prompt": "hello", "max_tokens": 4}
    route = httpx.post(f"http://127.0.0.1:{port}/debug/route", json=body, timeout=30).json()
    assert route["policy"]["name"] == "pipeline"  # the file's policy, not the default
    assert [s["name"] for s in route["policy"]["scorers"]] == ["prefix", "kv_utilization", "load"]
    assert route["decision"]["reason"] == "highest weighted score"


def test_mesh_up_and_simulate_refuse_an_undecodable_policy_file(tmp_path: Path) -> None:
    """A policy file that is not UTF-8 is an error line (exit 2) in mesh up and mesh simulate, not a
    UnicodeDecodeError traceback."""
    bad = tmp_path / "p.yaml"
    bad.write_bytes(b"\xff\xfepolicy: x\n")
    trace = ROOT / "examples" / "traces" / "agent_sessions.jsonl"
    for args in (("simulate", str(trace), "--quiet", "--policy", str(bad)),
                 ("up", "--engine", "echo", "--port", str(free_port()), "--policy", str(bad))):
        proc = mesh(*args)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert "not a readable YAML file" in proc.stderr


def test_config_validate_names_the_policy_and_documents_its_argument() -> None:
    """An example config validates under its policy's name (``policy pipeline``), not as 'policy
    custom' (a {name: ...} spec), and ``mesh config validate --help`` documents FILE."""
    proc = mesh("config", "validate", "examples/pipeline_pd.yaml")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "OK: examples/pipeline_pd.yaml (4 workers, policy pipeline)"
    sticky = mesh("config", "validate", "examples/session_sticky.yaml")
    assert "policy session_sticky" in sticky.stdout
    helped = mesh("config", "validate", "--help")
    assert helped.returncode == 0 and "mesh.yaml" in helped.stdout and "error" in helped.stdout


def test_help_says_what_mesh_is_and_a_bad_flag_shows_the_subcommands_usage() -> None:
    """``mesh --help`` says what Mesh is (not an internal docstring); ``mesh simulate T --bogus``
    prints simulate's usage, not the root usage (``mesh [-h] COMMAND ...``)."""
    top = mesh("--help")
    assert top.returncode == 0 and "cache-aware router" in top.stdout
    bad = mesh("simulate", "trace.jsonl", "--bogus")
    assert bad.returncode == 2
    assert "usage: mesh simulate" in bad.stderr and "unrecognized arguments: --bogus" in bad.stderr
