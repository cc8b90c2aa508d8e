"""Hostile traces for `mesh simulate` (small analogues of huge files): deeply nested JSON, chat ids
that are not ids, negative WEKA times. Each must be a `TraceError` naming the file, and the CLI a
one-line error, never a traceback or a misleading diagnosis."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from simulator.traces import LoadOptions, TraceError, load_traces

DEEP = "[" * 100_000 + "]" * 100_000
MOONCAKE = {"timestamp": 0, "input_length": 1024, "output_length": 3, "hash_ids": [1, 2]}
BAILIAN = {"chat_id": 1, "parent_chat_id": -1, "turn": 1, "timestamp": 0, "input_length": 16, "output_length": 3,
           "hash_ids": [1]}


def weka(*requests: dict) -> str:
    return json.dumps({"id": "s", "block_size": 64, "requests": list(requests)})


def req(t: float, api_time: float = 1.0) -> dict:
    return {"type": "n", "t": t, "in": 64, "out": 3, "hash_ids": [1], "api_time": api_time}


HOSTILE = {
    # a deeply nested value anywhere: msgspec raised RecursionError (a traceback)
    "deep_first_line.jsonl": json.dumps(MOONCAKE)[:-1] + ', "x": ' + DEEP + "}\n",
    "deep_later_line.jsonl": json.dumps(MOONCAKE) + "\n" + json.dumps(MOONCAKE)[:-1] + ', "x": ' + DEEP + "}\n",
    "deep_weka.json": weka(req(0.0))[:-1] + ', "x": ' + DEEP + "}",
    # unhashable chat ids: TypeError (a traceback)
    "list_chat_id.jsonl": json.dumps({**BAILIAN, "chat_id": [1]}) + "\n",
    "map_parent_chat_id.jsonl": json.dumps(BAILIAN) + "\n" + json.dumps({**BAILIAN, "chat_id": 2, "parent_chat_id": {"a": 1}}) + "\n",
    # negative times: the request finished before 0 and the run failed with "never finished
    # (dependency cycle in the trace?)"
    "negative_t.json": weka(req(-5.0)),
    "negative_api_time.json": weka(req(5.0, api_time=-1.0), req(7.0)),
    "negative_subagent_duration.json": weka(req(1.0), {"type": "subagent", "t": 5.0, "duration_ms": -10.0,
                                                       "requests": [req(0.0)]}),
    # giant times: arrivals plus think times overflowed to inf, and the report's latencies read
    # "nan" (no error at all)
    "giant_think.jsonl": json.dumps({"session": "a", "t": 1e308, "input_tokens": 32, "output_tokens": 3, "hash_ids": [1, 2]})
    + "\n" + json.dumps({"session": "a", "think_s": 1e308, "input_tokens": 48, "output_tokens": 3, "hash_ids": [1, 2, 3]}) + "\n",
    "giant_timestamp.jsonl": json.dumps({**MOONCAKE, "timestamp": 1e300}) + "\n",
    "giant_weka_t.json": weka(req(1e300)),
}
WHAT = {"deep": "nested too deeply", "chat_id": "must be an integer or a string", "negative": "in [0,",
        "giant": "in [0, 1e+15]"}


def _expected(name: str) -> str:
    return next(msg for key, msg in WHAT.items() if key in name)


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_trace_is_a_trace_error(name: str, tmp_path: Path) -> None:
    path = tmp_path / name
    path.write_text(HOSTILE[name])
    with pytest.raises(TraceError) as info:
        load_traces([path])
    assert str(path) in str(info.value) and _expected(name) in str(info.value)


@pytest.mark.parametrize("name", ["deep_weka.json", "list_chat_id.jsonl", "negative_t.json"])
def test_simulate_cli_reports_a_hostile_trace_in_one_line(name: str, tmp_path: Path) -> None:
    path = tmp_path / name
    path.write_text(HOSTILE[name])
    proc = subprocess.run([sys.executable, "-m", "mesh", "simulate", str(path), "--workers", "2", "--policy",
                           "round_robin", "--quiet"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and "never finished" not in proc.stderr
    assert _expected(name) in proc.stderr


def test_a_giant_time_scale_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({**MOONCAKE, "timestamp": 1e12}) + "\n")
    with pytest.raises(TraceError) as info:
        load_traces([path], LoadOptions(time_scale=1e300))  # 1e9 s * 1e300 = inf
    assert "time scale" in str(info.value)
    assert load_traces([path], LoadOptions(time_scale=1e6)).requests[0].arrival == 1e15


def test_zero_times_are_still_fine(tmp_path: Path) -> None:
    path = tmp_path / "zero.json"
    path.write_text(weka(req(0.0, api_time=0.0), req(0.0, api_time=0.0)))
    trace = load_traces([path])
    assert len(trace.requests) == 2 and trace.requests[0].arrival == 0.0


def _bomb(head: list[str], indent: str, levels: int = 7) -> str:
    lines = head + [f"{indent}- &l0 [" + ",".join(["laughlaugh"] * 9) + "]"]
    lines += [f"{indent}- &l{i} [" + ",".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


SIM_FILES = {
    # --policy FILE: an alias bomb is refused unexpanded (no 65 MB error); deep YAML is an error line
    ("--policy", "bomb.yaml"): (_bomb(["policy:", "  name: round_robin", "  params:", "    junk:"], "      "),
                                "expands to more than"),
    ("--policy", "deep.yaml"): ("policy: " + "[" * 5000 + "]" * 5000 + "\n", "not a readable YAML file"),
    # --profile FILE: deep YAML or JSON is an error line, not a traceback
    ("--profile", "deep.yaml"): ("profile: " + "[" * 5000 + "]" * 5000 + "\n", "not valid YAML"),
    ("--profile", "deep.json"): ('{"profile": ' + DEEP + "}\n", "not valid JSON"),
}


@pytest.mark.parametrize(("flag", "name"), sorted(SIM_FILES))
def test_simulate_cli_hostile_policy_and_profile_files(flag: str, name: str, tmp_path: Path) -> None:
    text, expected = SIM_FILES[(flag, name)]
    path = tmp_path / name
    path.write_text(text)
    trace = Path(__file__).resolve().parents[3] / "examples" / "traces" / "agent_sessions.jsonl"
    proc = subprocess.run([sys.executable, "-m", "mesh", "simulate", str(trace), "--workers", "2", flag, str(path),
                           "--quiet"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert expected in proc.stderr and len(proc.stderr) < 2000
