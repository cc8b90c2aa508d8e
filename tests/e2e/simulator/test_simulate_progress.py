"""A long ``mesh simulate`` with its output piped (no terminal): progress lines early and on a
schedule, each run's result on disk as it finishes, sweeps and sizing. Real CLI subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.procs import SHARED_TRACES

ROOT = Path(__file__).resolve().parents[3]
MOONCAKE = SHARED_TRACES / "mooncake" / "conversation_trace.jsonl"


def _popen(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    return subprocess.Popen([sys.executable, "-m", "mesh", "simulate", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env)


def _read(path: Path) -> dict[str, object] | None:
    try:
        return json.loads(path.read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError):  # not there yet (a torn file would fail the test below instead)
        return None


def test_piped_output_gets_progress_lines_and_each_runs_result_as_it_finishes(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    started = time.monotonic()
    proc = _popen(str(MOONCAKE), "--max-requests", "3000", "--profile", "unit", "--kv-blocks", "100000",
                  "--policy", "round_robin", "--policy", "kv_aware", "--no-default-policy", "--progress-s", "0.2",
                  "--json", str(out))
    lines: list[tuple[float, str]] = []  # (seconds since start, line), as they arrive through the pipe
    reader = threading.Thread(target=lambda: lines.extend((time.monotonic() - started, ln) for ln in proc.stdout or []))
    reader.start()
    partial = None  # the report while the process still ran, with the first run only
    while proc.poll() is None:
        report = _read(out)
        if report is not None and partial is None:
            partial = (time.monotonic() - started, report)
        time.sleep(0.02)
    reader.join(timeout=10)
    assert proc.returncode == 0, "".join(line for _, line in lines)
    text = [line for _, line in lines]
    # a line at once (before the trace load), then percentage lines with an ETA
    assert lines[0][0] < 10 and lines[0][1].startswith("mesh simulate: loading"), lines[:3]
    ticks = [(t, ln) for t, ln in lines if "requests (" in ln and "ETA" in ln]
    assert ticks and ticks[0][1].startswith("mesh simulate: run 1/2 round_robin: "), text
    first_done = next(t for t, ln in lines if "run 1/2 round_robin done in" in ln)
    assert ticks[0][0] < first_done  # progress during the first run, not only after it
    # the first run's result was on disk, whole, while the second still ran
    assert partial is not None, "the report appeared only after the process ended"
    seen_at, report = partial
    assert report["complete"] is False and list(report["policies"]) == ["round_robin"]  # type: ignore[call-overload]
    assert {k: report["runs"][k] for k in ("done", "total", "pending")} == {"done": 1, "total": 2, "pending": ["kv_aware"]}
    assert seen_at >= first_done - 1.0
    final = json.loads(out.read_text())
    assert final["complete"] is True and list(final["policies"]) == ["round_robin", "kv_aware"]
    assert not list(tmp_path.glob(".*.tmp"))  # every write renamed over the report
    assert time.monotonic() - started < 120


def test_a_worker_sweep_names_the_smallest_count_that_meets_the_ttft_target(tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    proc = _popen(str(ROOT / "examples" / "traces" / "agent_sessions.jsonl"), "--workers", "1,2,4", "--profile", "unit",
                  "--policy", "round_robin", "--ttft-p99-target", "100", "--json", str(out), "--html",
                  str(tmp_path / "sweep.html"))
    stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, stdout
    report = json.loads(out.read_text())
    # a run per count per policy, the gateway's default policy its own row named as the gateway names it
    from mesh.config import DEFAULT_POLICY

    assert report["workers"] == [1, 2, 4] and report["gateway_default_policy"] == DEFAULT_POLICY
    assert set(report["policies"]) == {f"{p} ({n} workers)" for p in ("round_robin", DEFAULT_POLICY) for n in (1, 2, 4)}
    assert report["runs"]["workers"] == {k: int(k.split("(")[1].split()[0]) for k in report["policies"]}
    sizing = report["sizing"]
    assert sizing["ttft_p99_target_s"] == 100 and sizing["policies"]["round_robin"]["workers"] == 1
    assert "TTFT p99 <= 100 s: round_robin needs 1 worker (p99" in stdout
    # the trace's ideal hit rate: a reference row, and in the report
    ideal = report["trace"]["ideal_hit_rate"]
    assert 0 < ideal <= 1 and "ideal (trace)" in stdout and f"{ideal:.1%}" in stdout
    page = (tmp_path / "sweep.html").read_text()
    assert f"<td>ideal (trace)</td><td></td><td>{ideal:.1%}" in page and "the gateway&#x27;s default policy" in page
    ideal_any = report["trace"]["ideal_hit_rate_global"]  # no cache reuses more than every prefix seen
    assert all(s["hit_rate"] <= ideal_any + 1e-9 for s in report["policies"].values())
    bad = _popen(str(ROOT / "examples" / "traces" / "agent_sessions.jsonl"), "--workers", "2,0", "--quiet")
    err, _ = bad.communicate(timeout=60)
    assert bad.returncode == 2 and "--workers must be >= 1" in err


def test_an_interrupted_run_keeps_the_runs_that_finished(tmp_path: Path) -> None:
    import signal

    out = tmp_path / "r.json"
    proc = _popen(str(MOONCAKE), "--max-requests", "3000", "--profile", "unit", "--kv-blocks", "100000",
                  "--policy", "round_robin", "--policy", "kv_aware", "--no-default-policy", "--json", str(out))
    seen = []
    for line in proc.stdout or []:
        seen.append(line)
        if line.startswith("mesh simulate: run 2/2 kv_aware:"):  # the second run has begun
            proc.send_signal(signal.SIGINT)
            break
    rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, "".join(seen) + rest
    assert "interrupted; the runs finished are in" in rest and "Traceback" not in rest
    report = json.loads(out.read_text())
    assert report["complete"] is False and list(report["policies"]) == ["round_robin"]


def test_reports_through_a_link_or_a_pipe_are_written_where_they_point(tmp_path: Path) -> None:
    """Renaming a temporary file over the report must not replace a link (``/dev/stdout`` is one)
    or a FIFO: a link's target gets the report, a pipe gets it once, whole, at the end."""
    real, link, fifo = tmp_path / "real.json", tmp_path / "link.json", tmp_path / "pipe.json"
    link.symlink_to(real)
    os.mkfifo(fifo)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()), daemon=True)
    reader.start()
    trace = str(ROOT / "examples" / "traces" / "agent_sessions.jsonl")
    proc = _popen(trace, "--profile", "unit", "--policy", "round_robin", "--quiet", "--json", str(link))
    assert proc.communicate(timeout=60)[0] == "" and proc.returncode == 0
    assert link.is_symlink() and json.loads(real.read_text())["complete"] is True
    proc = _popen(trace, "--profile", "unit", "--policy", "round_robin", "--quiet", "--json", str(fifo))
    assert proc.communicate(timeout=60)[0] == "" and proc.returncode == 0
    reader.join(timeout=10)
    assert fifo.is_fifo() and json.loads(got[0])["runs"]["pending"] == []
