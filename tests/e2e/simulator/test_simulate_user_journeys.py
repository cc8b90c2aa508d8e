"""``mesh simulate`` as a demanding user runs it (real CLI subprocesses, real files)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def mesh(*args: str, pythonpath: str = "", timeout: float = 120) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join(p for p in (str(ROOT), pythonpath) if p)
    env = {**os.environ, "PYTHONPATH": path, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "mesh", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


def session_trace(path: Path, sessions: int = 8, turns: int = 6) -> Path:
    """Agentic sessions: every turn extends its session's previous prompt by 4 blocks."""
    lines = [json.dumps({"format": "mesh-sessions", "version": 1, "block_size": 16})]
    for s in range(sessions):
        ids: list[int] = []
        for turn in range(turns):
            ids = ids + [s * 1000 + len(ids) + j for j in range(4)]
            rec: dict[str, object] = {"session": f"s{s}", "input_tokens": len(ids) * 16, "output_tokens": 4,
                                      "hash_ids": list(ids)}
            rec.update({"t": s * 0.05} if turn == 0 else {"think_s": 0.5})
            lines.append(json.dumps(rec))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_cache_aware_matches_prompts_in_the_simulator(tmp_path: Path) -> None:
    """cache_aware matches a spelling of the block keys in the simulator (traces carry no text),
    not an empty text, which would always route to the least loaded worker and give least_load's
    numbers under its name."""
    out = tmp_path / "r.json"
    proc = mesh("simulate", str(session_trace(tmp_path / "t.jsonl")), "--workers", "4", "--quiet",
                "--policy", "cache_aware", "--policy", "least_load", "--seed", "3", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    pol = json.loads(out.read_text())["policies"]
    # every later turn extends a prompt cache_aware routed itself: it goes back to that worker
    assert pol["cache_aware"]["session_moves"] == 0
    assert pol["cache_aware"]["hit_rate"] > pol["least_load"]["hit_rate"] + 0.2


BAD_PLUGINS = '''
from policies.pipeline import Picker, Scorer


class OutOfRange(Picker):
    name = "out_of_range"

    def pick(self, totals, columns, rng):
        return 99


class Raising(Scorer):
    name = "raising"

    def score(self, request, cluster, candidates):
        raise ValueError("scorer boom")
'''


def test_plugin_picker_named_as_a_string_is_guarded(tmp_path: Path) -> None:
    """``picker: "module:Class"`` (a plain string, as docs/policies.md writes built-in pickers) is
    behind the guard: a picker returning a bad index is a plugin error, not a traceback out of
    mesh simulate (and a 500 per request in the gateway)."""
    (tmp_path / "badplug.py").write_text(BAD_PLUGINS)
    spec = tmp_path / "p.yaml"
    spec.write_text("policy: {name: pipeline, params: {scorers: [prefix], picker: 'badplug:OutOfRange'}}\n")
    trace = session_trace(tmp_path / "t.jsonl", sessions=2, turns=2)
    proc = mesh("simulate", str(trace), "--quiet", "--policy", str(spec), pythonpath=str(tmp_path))
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "picker 'out_of_range' returned 99 for 4 candidates" in proc.stderr


def test_a_raising_plugin_scorer_is_reported_as_raising(tmp_path: Path) -> None:
    """A scorer that raises ValueError is reported as raising, not as having 'returned something
    other than numbers'."""
    (tmp_path / "badplug.py").write_text(BAD_PLUGINS)
    spec = tmp_path / "p.yaml"
    spec.write_text("policy: {name: pipeline, params: {scorers: ['badplug:Raising']}}\n")
    trace = session_trace(tmp_path / "t.jsonl", sessions=2, turns=2)
    proc = mesh("simulate", str(trace), "--quiet", "--policy", str(spec), pythonpath=str(tmp_path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "scorer 'raising' raised ValueError: scorer boom" in proc.stderr
    assert "other than numbers" not in proc.stderr


def test_a_request_larger_than_a_worker_names_the_kv_blocks_value_that_fits(tmp_path: Path) -> None:
    """A request larger than one worker's KV is refused before the run (exit 2), naming the
    --kv-blocks value that fits, in the profile's blocks (16 tokens) as --kv-blocks counts them,
    not the trace's (64 tokens; on the WEKA directory, prompts up to 879k tokens, a count in the
    trace's blocks, 'needs 13311 KV blocks of 64 tokens', would send a user to a worse value)."""
    trace = tmp_path / "big.jsonl"
    trace.write_text("\n".join([
        json.dumps({"format": "mesh-sessions", "version": 1, "block_size": 64}),
        json.dumps({"t": 0, "input_tokens": 64 * 40, "output_tokens": 10, "hash_ids": list(range(40))}),
        json.dumps({"t": 1, "input_tokens": 64 * 90, "output_tokens": 64, "hash_ids": list(range(100, 190))}),
    ]) + "\n")
    # unit: 16-token blocks; 200 of them = 3200 tokens = 50 blocks of 64; the second request needs 91
    proc = mesh("simulate", str(trace), "--quiet", "--profile", "unit", "--kv-blocks", "200")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "1 of 2 requests need more KV than one worker holds" in proc.stderr
    assert "--kv-blocks 364 or more" in proc.stderr  # 91 blocks of 64 = 364 blocks of 16
    ok = mesh("simulate", str(trace), "--quiet", "--profile", "unit", "--kv-blocks", "364")
    assert ok.returncode == 0, ok.stderr


def test_rejected_requests_are_shown_not_hidden(tmp_path: Path) -> None:
    """A policy whose filters leave no candidate for some requests (here: only workers with an empty
    KV cache, and every request arriving at once) has them shown as rejected (a table column and a
    warning), not silently dropped from the 'requests' count (8 requests printed as '2 requests')."""
    spec = tmp_path / "tight.yaml"
    spec.write_text("policy: {name: pipeline, params: {filters: [{name: admission_headroom, "
                    "params: {max_kv_usage: 0.0}}], scorers: [load]}}\n")
    trace = tmp_path / "burst.jsonl"
    trace.write_text("\n".join(json.dumps({"t": i * 0.002, "input_tokens": 32, "output_tokens": 50, "hash_ids": [i, i + 1]})
                               for i in range(0, 16, 2)) + "\n")
    out = tmp_path / "r.json"
    proc = mesh("simulate", str(trace), "--workers", "2", "--policy", str(spec), "--json", str(out),
                "--profile", "unit", "--kv-blocks", "1000")
    assert proc.returncode == 0, proc.stderr
    s = json.loads(out.read_text())["policies"]["tight"]
    assert s["rejected"] == 6 and s["requests"] == 2
    assert "rejected" in proc.stdout  # a column of the table
    assert "tight: 6 of 8 requests rejected" in proc.stderr


def test_a_plugin_whose_constructor_raises_is_a_plugin_error(tmp_path: Path) -> None:
    """A constructor raising anything but TypeError/ValueError (a RuntimeError, a KeyError from a
    missing setting) is a plugin error, not a traceback out of mesh simulate."""
    (tmp_path / "initplug.py").write_text(
        "from policies.base import Policy\n\n\nclass BadInit(Policy):\n    name = 'bad_init'\n\n"
        "    def __init__(self):\n        raise RuntimeError('init boom')\n\n"
        "    def decide(self, request, cluster):\n        raise AssertionError\n")
    spec = tmp_path / "p.yaml"
    spec.write_text("policy: {name: 'initplug:BadInit'}\n")
    trace = session_trace(tmp_path / "t.jsonl", sessions=1, turns=1)
    proc = mesh("simulate", str(trace), "--quiet", "--policy", str(spec), pythonpath=str(tmp_path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "policy 'initplug:BadInit': its constructor raised RuntimeError: init boom" in proc.stderr


def test_no_blank_lines_from_the_progress_bar_in_a_log(tmp_path: Path) -> None:
    """With stderr not a terminal (a CI log, a pipe) the transient progress bar prints no empty line
    per policy before the table."""
    trace = session_trace(tmp_path / "t.jsonl", sessions=2, turns=2)
    proc = mesh("simulate", str(trace), "--profile", "unit", "--policy", "round_robin", "--policy", "kv_aware")
    assert proc.returncode == 0, proc.stderr
    assert "round_robin" in proc.stdout
    assert "" not in proc.stderr.splitlines(), repr(proc.stderr)


def test_the_table_fits_an_80_column_terminal(tmp_path: Path) -> None:
    """A narrow terminal (80 columns) gets one column per policy, so no cell of the 13-column table
    is cut to one character and an ellipsis ('kv…', '2,…')."""
    import io

    from rich.console import Console

    from simulator.report import render_table

    out = tmp_path / "r.json"
    proc = mesh("simulate", str(session_trace(tmp_path / "t.jsonl", sessions=2, turns=2)), "--quiet",
                "--profile", "unit", "--policy", "round_robin", "--policy", "kv_aware", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    summaries = json.loads(out.read_text())["policies"]
    buf = io.StringIO()
    render_table(summaries, Console(file=buf, width=80, color_system=None), title="t")
    text = buf.getvalue()
    assert "…" not in text and max(map(len, text.splitlines())) <= 80
    hit = next(line for line in text.splitlines() if "hit rate" in line)
    assert f"{summaries['kv_aware']['hit_rate']:.1%}" in hit and f"{summaries['round_robin']['hit_rate']:.1%}" in hit
