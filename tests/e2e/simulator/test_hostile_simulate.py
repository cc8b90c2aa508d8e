"""Hostile `mesh simulate` command lines: odd numeric flags and report paths that cannot be
written. Each must be one error line (exit 2, no traceback), found before the simulation runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
TRACE = ROOT / "examples" / "traces" / "agent_sessions.jsonl"


def simulate(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mesh", "simulate", str(TRACE), "--quiet", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def assert_one_line_error(proc: subprocess.CompletedProcess[str], message: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr


@pytest.mark.parametrize("args, message", [
    # a traceback (ValueError from the session table)
    (["--session-ttl", "0"], "--session-ttl must be a finite number > 0"),
    (["--session-ttl", "-1"], "--session-ttl must be a finite number > 0"),
    (["--session-ttl", "nan"], "--session-ttl must be a finite number > 0"),
    # accepted silently (a negative or NaN TTL)
    (["--speculative-ttl", "-1"], "--speculative-ttl must be a finite number >= 0"),
    (["--speculative-ttl", "nan"], "--speculative-ttl must be a finite number >= 0"),
    (["--speculative-ttl", "inf"], "--speculative-ttl must be a finite number >= 0"),
    # built 100 million worker models: minutes of work and tens of GB before any output
    (["--workers", "100000000"], "--workers must be >= 1 and <= 100000"),
    # said "must leave at least one decode worker"
    (["--prefill-workers", "-1"], "--prefill-workers must be >= 0"),
])
def test_odd_numeric_flags_are_one_line_errors(args: list[str], message: str) -> None:
    assert_one_line_error(simulate(*args, timeout=30), message)


@pytest.mark.parametrize("flag", ["--json", "--html"])
@pytest.mark.parametrize("where", ["directory", "missing_parent", "parent_is_file"])
def test_an_unwritable_report_path_fails_before_simulating(flag: str, where: str, tmp_path: Path) -> None:
    # The report path is checked before the run: a typo'd path never throws away hours of simulation.
    (tmp_path / "file").write_text("x")
    path = {"directory": tmp_path, "missing_parent": tmp_path / "nope" / "r.out",
            "parent_is_file": tmp_path / "file" / "r.out"}[where]
    proc = simulate(flag, str(path), "--policy", "round_robin", "--max-requests", "1")
    assert_one_line_error(proc, f"cannot write {flag[2:]} report to {path}")
    assert "simulating" not in proc.stderr


def test_the_report_check_leaves_no_file_behind_on_a_later_error(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    proc = simulate("--json", str(out), "--policy", "no_such_policy")
    assert_one_line_error(proc, "unknown policy 'no_such_policy'")
    assert not out.exists()


def test_duplicate_policies_and_a_one_request_run_still_work(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    proc = simulate("--json", str(out), "--policy", "round_robin", "--policy", "round_robin", "--max-requests", "1",
                    "--no-default-policy")
    assert proc.returncode == 0, proc.stderr
    import json
    report = json.loads(out.read_text())
    assert sorted(report["policies"]) == ["round_robin", "round_robin#2"]
    assert report["trace"]["requests"] == 1


# -- mesh serve / mesh up: bad flags are one error line, found before anything starts --
def mesh_cmd(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mesh", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.mark.parametrize("port", ["99999"])
def test_serve_with_a_port_out_of_range_is_one_error_line(port: str) -> None:
    # one line, not a pydantic ValidationError traceback
    assert_one_line_error(mesh_cmd("serve", "--port", port), "server.port")


@pytest.mark.parametrize("args, message", [
    # refused first, not a traceback (ConfigError) once the workers are up (minutes for the bundled engine)
    (["--policy", "no_such_policy"], "unknown policy 'no_such_policy'"),
    (["--port", "99999"], "server.port"),
    # refused first, not uvicorn's bind error once the workers are up
    (["--host", "bad host!"], "--host 'bad host!'"),
    # refused, not 100,000 worker processes started
    (["--workers", "100000"], "--workers must be <= 64"),
])
def test_up_refuses_bad_flags_before_starting_any_worker(args: list[str], message: str) -> None:
    proc = mesh_cmd("up", "--engine", "echo", "--port", "0", *args)
    assert_one_line_error(proc, message)


def test_up_refuses_a_port_in_use_before_starting_any_worker() -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = mesh_cmd("up", "--engine", "echo", "--port", str(port))
    assert_one_line_error(proc, f"cannot listen on 127.0.0.1:{port}")


# -- trace and profile files that are not files, or explode --
def test_a_gzip_bomb_trace_is_refused_without_inflating_it(tmp_path: Path) -> None:
    # 1.25 GiB of zeros in a ~6 MB .gz: gzip.decompress inflated it whole (then the next copy, and
    # the split into lines): the machine ran out of memory instead of an error line.
    import gzip

    bomb = tmp_path / "bomb.jsonl.gz"
    bomb.write_bytes(gzip.compress(b"\0" * (1 << 24), 1) * 80)  # 80 members of 16 MiB: 1.25 GiB
    proc = subprocess.run(["prlimit", f"--as={3 << 30}", sys.executable, "-m", "mesh", "simulate", str(bomb), "--quiet"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert_one_line_error(proc, "decompresses to over")


def test_a_multi_member_gzip_trace_still_loads(tmp_path: Path) -> None:
    import gzip

    lines = TRACE.read_bytes().splitlines(keepends=True)
    gz = tmp_path / "two.jsonl.gz"
    gz.write_bytes(gzip.compress(b"".join(lines[:4])) + gzip.compress(b"".join(lines[4:])))
    proc = subprocess.run([sys.executable, "-m", "mesh", "simulate", str(gz), "--quiet", "--policy", "round_robin"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("flag", ["trace", "--profile"])
def test_a_device_or_fifo_is_not_read_forever(flag: str, tmp_path: Path) -> None:
    # refused unread: /dev/zero would be read until memory ran out, a FIFO with no writer block forever
    import os

    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    for path in ("/dev/zero", str(fifo)):
        args = [path] if flag == "trace" else [str(TRACE), "--profile", path]
        proc = subprocess.run([sys.executable, "-m", "mesh", "simulate", *args, "--quiet"],
                              capture_output=True, text=True, timeout=30, cwd=ROOT)
        assert_one_line_error(proc, "not a regular file")


@pytest.mark.parametrize("args, message", [
    (["--out", "/"], "cannot write the profile to /: it is a directory"),
    (["--out", "/nonexistent/dir/p.yaml"], "no such directory"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--max-batch", "0"], "--max-batch must be >= 1"),
    (["--kv-blocks", "-5"], "--kv-blocks must be >= 0"),
    (["--timeout", "0"], "--timeout must be a finite number"),
    (["--token-ids", "1"], "--token-ids must be >= 2"),
])
def test_calibrate_checks_its_flags_before_measuring(args: list[str], message: str, tmp_path: Path) -> None:
    # The endpoint does not exist: an error about the flag (not the endpoint) proves it came first.
    # --out is tried before the measurements (minutes on a GPU endpoint); bad counts are refused,
    # not clamped or written into the profile silently (--kv-blocks -5: a profile that won't load).
    out = ["--out", str(tmp_path / "p.yaml")] if "--out" not in args else []
    proc = mesh_cmd("calibrate", "--url", "http://127.0.0.1:9", "--quick", *out, *args)
    assert_one_line_error(proc, message)


def test_a_misbehaving_plugin_policy_is_an_error_in_simulate_not_the_fallbacks_numbers() -> None:
    # The gateway falls back to least_load when a plugin misbehaves; a simulation did too, and
    # reported least_load's numbers under the plugin's name (only a log line said otherwise).
    proc = simulate("--policy", "tests.plugins.hostile_policies:Misbehaving", "--max-requests", "2")
    assert_one_line_error(proc, "policy plugin tests.plugins.hostile_policies:Misbehaving: bad_target")
