"""Trace loaders: every format, the id -> key mapping, session dependencies, and bad input."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from simulator.traces import DONE, START, LoadOptions, TraceError, chain_keys, load_traces

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "traces" / "agent_sessions.jsonl"


def write_lines(path: Path, rows: list[dict], tail: str = "\n") -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + tail)
    return path


def mooncake_rows() -> list[dict]:
    return [
        {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
        {"timestamp": 250, "input_length": 1600, "output_length": 7, "hash_ids": [0, 1, 3, 4]},
        {"timestamp": 1000, "input_length": 700, "output_length": 3, "hash_ids": [9, 10]},
    ]


def weka_doc(trace_id: str = "trace_x") -> dict:
    return {
        "id": trace_id, "models": ["m"], "block_size": 64, "hash_id_scope": "local",
        "requests": [
            {"t": 0.0, "type": "n", "model": "m", "in": 200, "out": 10, "hash_ids": [1, 2, 3],
             "api_time": 2.0, "think_time": 0.0},
            {"t": 5.0, "type": "n", "model": "m", "in": 300, "out": 10, "hash_ids": [1, 2, 3, 4],
             "api_time": 1.0, "think_time": 3.0},
            {"t": 30.0, "type": "subagent", "agent_id": "agent_001", "duration_ms": 20000,
             "requests": [
                 {"t": 0.0, "type": "n", "model": "h", "in": 130, "out": 4, "hash_ids": [50, 51],
                  "api_time": 1.0},
                 {"t": 4.0, "type": "s", "model": "h", "in": 200, "out": 4, "hash_ids": [50, 51, 52],
                  "api_time": 1.0},
             ]},
            {"t": 31.0, "type": "n", "model": "m", "in": 400, "out": 10, "hash_ids": [1, 2, 3, 4, 5, 6],
             "api_time": 1.0, "think_time": 25.0},
        ],
    }


def test_mooncake_arrivals_and_chained_keys(tmp_path: Path) -> None:
    trace = load_traces([write_lines(tmp_path / "m.jsonl", mooncake_rows())])
    assert trace.formats == ["mooncake"] and trace.block_size == 512
    r0, r1, r2 = trace.requests
    assert [r.arrival for r in trace.requests] == [0.0, 0.25, 1.0]
    assert (r0.prompt_tokens, r0.output_tokens) == (1100, 5)
    # only full blocks get keys: 1100 tokens = 2 full blocks of 512
    assert r0.keys.size == 2 and r1.keys.size == 3 and r2.keys.size == 1
    # equal id prefixes give equal keys; a different id at depth 2 gives a different key
    assert list(r0.keys[:2]) == list(r1.keys[:2])
    assert r0.keys[0] != r2.keys[0]
    assert not trace.requests[0].deps and trace.sessions == 0


def test_reblocking_keeps_prefix_identity(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "m.jsonl", mooncake_rows())
    fine = load_traces([path], LoadOptions(block_size=64)).requests
    assert fine[0].keys.size == 1100 // 64 and fine[1].keys.size == 1600 // 64
    shared = 2 * 512 // 64  # ids [0, 1] are common: 16 sub-blocks of 64 tokens
    assert list(fine[0].keys[:shared]) == list(fine[1].keys[:shared])
    assert fine[0].keys[shared] != fine[1].keys[shared]
    coarse = load_traces([path], LoadOptions(block_size=1024)).requests
    assert coarse[0].keys.size == 1 and coarse[1].keys[0] == coarse[0].keys[0]
    # keys at the trace's own block size are a prefix chain too (equal to the helper's)
    assert list(chain_keys([0, 1, 2], 1100, 512, 512, 7)) == list(chain_keys([0, 1, 5], 1100, 512, 512, 7))


def test_weka_sessions_subagents_and_file_scope(tmp_path: Path) -> None:
    a = tmp_path / "trace_a.json.gz"
    a.write_bytes(gzip.compress(json.dumps(weka_doc("trace_a")).encode()))
    b = tmp_path / "trace_b.json"
    b.write_text(json.dumps(weka_doc("trace_b")))
    trace = load_traces([a, b])
    assert trace.formats == ["weka", "weka"] and trace.block_size == 64
    reqs = trace.requests[:5]
    assert reqs[0].arrival == 0.0 and reqs[0].deps == ()
    # closed loop: request 1 starts 3 s (5 - (0 + 2)) after request 0 finished
    assert reqs[1].arrival is None and reqs[1].deps == ((0, DONE, pytest.approx(3.0)),)
    # the sub-agent started at 30 - 20 = 10 s, 4 s after its parent request (5 + 1) finished
    sub0, sub1 = reqs[2], reqs[3]
    assert sub0.session.endswith("agent_001") and sub0.deps == ((1, DONE, pytest.approx(4.0)),)
    assert sub1.deps == ((2, DONE, pytest.approx(3.0)),)
    # the parent's next turn waits for its previous turn and joins the sub-agent
    assert sorted(reqs[4].deps) == [(1, DONE, pytest.approx(25.0)), (3, DONE, pytest.approx(16.0))]
    # ids are local to a file: the same ids in two files give different keys
    assert trace.requests[0].keys[0] != trace.requests[5].keys[0]
    assert trace.sessions == 4
    capped = load_traces([a, b], LoadOptions(max_sessions=1))
    assert len(capped.requests) == 5  # one WEKA file = one session with its sub-agents


def test_weka_concurrent_requests_depend_on_start(tmp_path: Path) -> None:
    doc = weka_doc()
    doc["requests"][1]["t"] = 1.0  # recorded while request 0 was still running (it took 2 s)
    path = tmp_path / "w.json"
    path.write_text(json.dumps(doc))
    assert load_traces([path]).requests[1].deps == ((0, START, pytest.approx(1.0)),)


def test_bailian_turns_follow_parents(tmp_path: Path) -> None:
    rows = [
        {"chat_id": 1, "parent_chat_id": -1, "turn": 1, "timestamp": 10.0, "input_length": 40,
         "output_length": 4, "hash_ids": [7, 8, 9]},
        {"chat_id": 2, "parent_chat_id": -1, "turn": 1, "timestamp": 11.0, "input_length": 20,
         "output_length": 4, "hash_ids": [70, 71]},
        {"chat_id": 3, "parent_chat_id": 1, "turn": 2, "timestamp": 16.5, "input_length": 64,
         "output_length": 4, "hash_ids": [7, 8, 9, 10]},
    ]
    trace = load_traces([write_lines(tmp_path / "b.jsonl", rows)])
    assert trace.formats == ["bailian"] and trace.block_size == 16
    first, other, second = trace.requests
    assert first.arrival == 10.0 and other.arrival == 11.0 and second.arrival is None
    assert sorted(second.deps) == [(0, START, pytest.approx(6.5)), (0, DONE, 0.0)]
    assert first.session == second.session != other.session
    assert list(second.keys[:2]) == list(first.keys[:2])


def test_mesh_format_example(tmp_path: Path) -> None:
    trace = load_traces([EXAMPLE])
    assert trace.formats == ["mesh"] and trace.block_size == 16 and trace.sessions == 2
    alice = [r for r in trace.requests if r.session and r.session.endswith("alice")]
    assert alice[0].arrival == 0.0
    assert alice[1].deps == ((alice[0].idx, DONE, 2.0),)
    bob = [r for r in trace.requests if r.session and r.session.endswith("bob")]
    assert list(alice[0].keys[:3]) == list(bob[0].keys[:3])  # the shared system prompt
    assert alice[0].keys[3] != bob[0].keys[3]


def test_time_scale_and_request_cap(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "m.jsonl", mooncake_rows())
    scaled = load_traces([path], LoadOptions(time_scale=0.5))
    assert [r.arrival for r in scaled.requests] == [0.0, 0.125, 0.5]
    assert len(load_traces([path], LoadOptions(max_requests=2)).requests) == 2
    sessions = load_traces([EXAMPLE], LoadOptions(time_scale=2.0, max_sessions=1))
    assert {r.session for r in sessions.requests} == {"agent_sessions/alice"}
    assert sessions.requests[1].deps[0][2] == 4.0  # think time scaled too


# ------------------------------------------------------------------ bad input
def expect_error(paths: list[Path], *fragments: str) -> str:
    with pytest.raises(TraceError) as info:
        load_traces(paths)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_missing_and_empty_files(tmp_path: Path) -> None:
    expect_error([tmp_path / "nope.jsonl"], "nope.jsonl", "no such file")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    expect_error([tmp_path / "empty.jsonl"], "empty.jsonl", "empty")
    (tmp_path / "dir").mkdir()
    expect_error([tmp_path / "dir"], "holds no trace files")
    (tmp_path / "dir" / "README.md").write_text("# notes beside the traces\n")
    expect_error([tmp_path / "dir"], "holds no trace files")


def test_directory_skips_notes_beside_the_traces(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text("# not a trace\n")
    (tmp_path / "LICENSE").write_text("Apache-2.0\n")
    write_lines(tmp_path / "a.jsonl", mooncake_rows())
    trace = load_traces([tmp_path])
    assert trace.requests and trace.formats == ["mooncake"]


def test_malformed_line_reports_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    rows = [json.dumps(r) for r in mooncake_rows()]
    path.write_text(rows[0] + "\n" + rows[1] + "\n{not json\n" + rows[2] + "\n")
    expect_error([path], f"{path}:3:", "malformed JSON")
    write_lines(path, [mooncake_rows()[0], {"timestamp": 1, "input_length": "x", "output_length": 1, "hash_ids": []}])
    expect_error([path], f"{path}:2:", "input_length")
    write_lines(path, [mooncake_rows()[0], {"timestamp": 1, "input_length": 10, "output_length": 1,
                                             "hash_ids": [1, -2]}])
    expect_error([path], f"{path}:2:", "hash_ids")


def test_inconsistent_hash_chain(tmp_path: Path) -> None:
    row = {"timestamp": 0, "input_length": 5000, "output_length": 1, "hash_ids": [1, 2]}
    path = write_lines(tmp_path / "m.jsonl", [mooncake_rows()[0], row])
    expect_error([path], f"{path}:2:", "inconsistent hash chain", "2 block ids for 5000")


def test_truncated_last_line_is_reported_not_dropped_silently(tmp_path: Path) -> None:
    path = tmp_path / "cut.jsonl"
    rows = [json.dumps(r) for r in mooncake_rows()]
    path.write_text(rows[0] + "\n" + rows[1] + "\n" + rows[2][:20])
    trace = load_traces([path])
    assert len(trace.requests) == 2
    assert trace.warnings == [f"{path}:3: truncated last line skipped (partial trace)"]


def test_truncated_gzip_and_document(tmp_path: Path) -> None:
    data = gzip.compress(json.dumps(weka_doc()).encode())
    gz = tmp_path / "w.json.gz"
    gz.write_bytes(data[: len(data) // 2])
    expect_error([gz], "w.json.gz", "truncated or corrupt gzip")
    doc = tmp_path / "w.json"
    doc.write_text(json.dumps(weka_doc())[:-40])
    expect_error([doc], f"{doc}", "truncated or malformed JSON")
    bad = weka_doc()
    bad["requests"][1]["in"] = "lots"
    doc.write_text(json.dumps(bad))
    expect_error([doc], "$.requests[1].in")


def test_unknown_format_is_named(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "x.jsonl", [{"prompt": "hello", "n": 3}])
    expect_error([path], "unknown trace format", "mooncake, weka, bailian, mesh")
    (tmp_path / "t.txt").write_text("just text\n")
    expect_error([tmp_path / "t.txt"], "t.txt:1", "not JSON")


def test_mixed_block_sizes_need_a_choice(tmp_path: Path) -> None:
    moon = write_lines(tmp_path / "m.jsonl", mooncake_rows())
    expect_error([moon, EXAMPLE], "different block sizes", "--block-size")
    both = load_traces([moon, EXAMPLE], LoadOptions(block_size=16))
    assert len(both.requests) == 3 + 7
